"""``benchmarks/moe.py`` at tiny dims, one round of each part: edatalog gives transformers'
result (else the script exits 1) and every contender is timed; on 2 ranks, every plan of the
MoE and the dense program gives the reference's output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "moe.py"


def test_moe_layer_matches_transformers_and_is_timed() -> None:
    cmd = [sys.executable, str(SCRIPT), "--dims", "T=16,D=32,F=48", "--repeat", "1", "--calls", "1", "--json"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert report["max_rel_diff"] <= 1e-4
    names = {r["contender"] for r in report["rows"]}
    assert names == {"transformers (eager)", "transformers (grouped_mm)", "edatalog (graph)"}
    assert all(r["median_ms"] > 0 for r in report["rows"])


def test_whole_small_model_matches_transformers_and_is_timed() -> None:
    cmd = [sys.executable, str(SCRIPT), "--part", "model", "--dims", "S=8", "--repeat", "1", "--calls", "1", "--json"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert report["max_rel_diff"] <= 1e-4 and len(report["rows"]) == 3


@pytest.mark.slow
@pytest.mark.distributed
def test_moe_and_dense_programs_on_two_ranks_equal_the_reference() -> None:
    cmd = [sys.executable, str(SCRIPT), "--part", "ranks", "--dims", "T=16,D=32,F=48", "--repeat", "1"]
    cmd += ["--time-limit", "2", "--json"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = json.loads(done.stdout)["rows"]
    assert {(r["program"], r["plan"]) for r in rows} == {
        ("moe", "expert"),
        ("moe", "megatron"),
        ("moe", "auto"),
        ("capacity", "expert"),
        ("capacity", "data"),
        ("capacity", "auto"),
        ("dense", "megatron"),
        ("dense", "data"),
        ("dense", "auto"),
    }
    assert all(r["max_rel_diff"] <= 1e-5 and r["measured_ms"] > 0 for r in rows)
