"""``benchmarks/runtime_cpu.py``: its contenders reproduce transformers' LlamaDecoderLayer.

The benchmark itself is run at tiny dims on 2 gloo ranks (one timed round): every contender,
the edatalog plans run by edatalog's torch runtime included, must pass its correctness check.  The weights
helper it shares with the edatalog rows is checked against the program directly: the HF layer
holding ``make_weights`` computes what ``programs/llama_block.edl`` computes with them.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import edatalog

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "runtime_cpu.py"
# Grouped-query attention (2 query heads per key/value head), each rank holding one KV head.
TINY = "B=1,S=16,D=64,H=4,KVH=2,F=96"


def load(name: str) -> ModuleType:
    path = ROOT / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_weights_are_the_programs() -> None:
    """The weights by the program's names, in an HF layer, give the program's output."""
    lw = load("llama_weights")
    dims = lw.BlockDims().with_text(TINY)
    consts = lw.program_consts(dims)
    weights = lw.make_weights(dims, seed=3)
    x = lw.make_input(dims, seed=3)
    cos, sin = lw.rope(dims, consts)
    ref = lw.reference(lw.hf_layer(dims, consts, weights, attn_implementation="eager"), x, cos, sin).numpy()

    prog = edatalog.compile(lw.PROGRAM, dims=dims.edl_dims())
    params = {r.name: r.shape for r in prog.arguments if r.kind == "param"}
    assert {name: tuple(w.shape) for name, w in weights.items()} == params
    values: dict[str, Any] = {name: w.numpy() for name, w in weights.items()} | {"x": x.numpy()}
    y = prog.run(values)["y"]
    assert np.abs(y - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.distributed
@pytest.mark.slow
def test_contenders_match_transformers() -> None:
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--dims",
        TINY,
        "--warmup",
        "0",
        "--repeat",
        "1",
        "--time-limit",
        "2",
        "--timeout",
        "60",
        "--json",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert report["ranks"] == 2 and report["threads"] == 1
    results = {r["contender"]: r for r in report["results"]}
    assert not report["skipped"], report["skipped"]
    assert set(results) == {"megatron", "dtensor", "edatalog-megatron", "edatalog-auto", "edatalog-replicate"}
    for name, r in results.items():
        assert r["check"]["ok"] and r["check"]["max_err"] <= 1e-4, name
        assert len(r["call_ms"]) == 1 and len(r["rank_ms"]) == 2, name
        assert r["measured_ms"] > 0, name
        assert (r["predicted_ms"] is None) == (name in ("megatron", "dtensor")), name
