"""``benchmarks/training.py``: its contenders train the same model on the same batches.

In this process, as a group of one rank (the benchmark's spawned ranks run the same functions):
torch's DDP and FSDP2 steps and edatalog's planned step program give the same loss at every step,
and the report's table reads them."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests.benchmarks.test_runtime_cpu import load

TINY = ["--dim", "64", "--layers", "2", "--vocab", "96", "--ffn", "160", "--heads", "4", "--seq", "16"]


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29000 + os.getpid() % 1000))
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.slow
def test_contenders_take_the_same_steps(tmp_path: Path, one_rank: Any) -> None:
    bench = load("training")
    run = ["--batch", "2", "--steps", "3", "--warmup", "1", "--nproc", "1", "--time-limit", "2"]
    args = bench.parse_args([*TINY, *run])
    bench.make_model(args, tmp_path)
    plan, _ = bench.solve(args, tmp_path)
    runs = []
    for contender in ("ddp", "fsdp2"):
        runs.append(bench.torch_rank(contender, args, tmp_path))
        dist.destroy_process_group()
    runs.append(bench.edatalog_rank(dataclasses.replace(bench._request(args, tmp_path), plan=plan)))
    report = bench.summarize(runs, args, 0.0)
    rows = report["contenders"]
    assert set(rows) == {"ddp", "fsdp2", "edatalog"}
    for name, row in rows.items():
        assert row["loss_rel_diff_vs_edatalog"] < 1e-4, name
        assert row["steps_timed"] == 2
    assert rows["edatalog"]["predicted_ms"] > 0
    assert "edatalog" in bench.table(report)
