"""``benchmarks/attention_kernels.py`` at small shapes, one round: both kernels match f64
attention to bf16's precision, and the script says which one edatalog takes where."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from edatalog.backend.kernels.attention import GEMM_ATTENTION_MIN_ROWS

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "attention_kernels.py"


def test_both_kernels_match_and_the_choice_is_reported() -> None:
    shapes = f"{GEMM_ATTENTION_MIN_ROWS // 2}x2x16,{GEMM_ATTENTION_MIN_ROWS}x2x16"
    cmd = [sys.executable, str(SCRIPT), "--shapes", shapes, "--warmup", "0", "--repeat", "1", "--json"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    results = json.loads(done.stdout)["results"]
    assert [r["taken"] for r in results] == [False, True]
    for r in results:
        assert all(ms > 0 for ms in r["ms"].values()), r
        assert all(err <= 1e-2 for err in r["error"].values()), r


def test_a_malformed_shape_is_a_usage_error() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--shapes", "512x16"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "ROWSxHEADSxWIDTH" in done.stderr, done.stderr
