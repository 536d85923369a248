"""``benchmarks/small_all_reduce.py`` on 2 gloo ranks, one short round: both all-reduces run in
the timed loops, and the script says which sizes edatalog's runtime runs as exchanges."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from edatalog.solver.costmodel import EXCHANGE_ALL_REDUCE_MAX_BYTES

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "small_all_reduce.py"


@pytest.mark.distributed
def test_both_all_reduces_are_timed_and_the_choice_is_reported() -> None:
    sizes = f"2048,{EXCHANGE_ALL_REDUCE_MAX_BYTES + 4}"
    argv = ["--sizes", sizes, "--ops", "2", "--kernels", "2", "--loops", "2", "--repeat", "1", "--json"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *argv], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = json.loads(done.stdout)
    assert [r["bytes"] for r in rows] == [2048, EXCHANGE_ALL_REDUCE_MAX_BYTES + 4]
    assert [r["edatalog_takes"] for r in rows] == [True, False]
    for r in rows:
        assert sorted(r["rounds"]) == ["exchanges", "gloo", "none"]
        assert all(len(ts) == 1 and t > 0 for ts in r["rounds"].values() for t in ts), r
        assert math.isfinite(r["gloo_ms"]) and math.isfinite(r["exchanges_ms"])


@pytest.mark.parametrize(("argv", "message"), [(["--nproc", "3"], "power of two"), (["--sizes", "2k"], "byte counts")])
def test_mistakes_are_usage_errors(argv: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *argv], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr
