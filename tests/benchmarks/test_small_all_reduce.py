"""``benchmarks/small_all_reduce.py`` on 2 gloo ranks, one short round: every all-reduce runs in
the timed loops, and the script says which route edatalog's runtime takes between them."""

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
def test_every_all_reduce_is_timed_and_the_route_is_reported() -> None:
    sizes = f"2048,{EXCHANGE_ALL_REDUCE_MAX_BYTES + 4}"
    argv = ["--sizes", sizes, "--ops", "2", "--kernels", "2", "--loops", "2", "--repeat", "1", "--json"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *argv], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = json.loads(done.stdout)
    assert [r["bytes"] for r in rows] == [2048, EXCHANGE_ALL_REDUCE_MAX_BYTES + 4]
    assert [r["edatalog_takes"] for r in rows] == ["shared_memory", "shared_memory"]  # ranks of one machine
    for r in rows:
        assert sorted(r["rounds"]) == ["exchanges", "gloo", "none", "shared_memory"]
        assert all(len(ts) == 1 and t > 0 for ts in r["rounds"].values() for t in ts), r
        assert all(math.isfinite(r[k]) for k in ("gloo_ms", "exchanges_ms", "shared_memory_ms"))


@pytest.mark.parametrize(("argv", "message"), [(["--nproc", "3"], "power of two"), (["--sizes", "2k"], "byte counts")])
def test_mistakes_are_usage_errors(argv: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *argv], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr
