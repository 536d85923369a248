"""Ranks started by :func:`edatalog.backend.running.launch.spawn`: what comes back, and how a
rank that cannot send its result back ends the job (with its error, never a wait)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from edatalog.backend.running.launch import spawn

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.distributed


def _result_rank(n: int) -> dict[str, Any]:
    return {"n": n, "list": list(range(n))}


def _unpicklable_rank() -> Any:
    return threading.Lock()  # finishes, but its result cannot go back to the launcher


def test_each_rank_returns_its_result() -> None:
    assert spawn(2, _result_rank, (3,)) == {r: {"n": 3, "list": [0, 1, 2]} for r in range(2)}


def test_a_result_that_cannot_go_back_fails_the_job_at_once() -> None:
    """The rank finished and left its group, then its result failed to pickle: the job fails
    with that error (in a process of its own, so that a launcher waiting for the result forever
    fails this test at its timeout instead of hanging the suite)."""
    script = (
        "from edatalog.backend.running.launch import spawn\n"
        "from tests.backend.test_launch import _unpicklable_rank\n"
        "spawn(1, _unpicklable_rank)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode != 0 and "rank 0" in done.stderr and "pickle" in done.stderr, done.stderr[-3000:]
