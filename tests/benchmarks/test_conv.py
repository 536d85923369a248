"""``benchmarks/conv.py`` at tiny dims, one round: edatalog gives F.conv2d's result in both modes
(else the script exits 1) and every contender is timed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "conv.py"


def test_conv_matches_f_conv2d_and_is_timed() -> None:
    cmd = [sys.executable, str(SCRIPT), "--dims", "B=2,C=3,O=4,H=6,W=5", "--repeat", "1", "--calls", "1", "--json"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(done.stdout)
    rows = {r["contender"]: r for r in report["rows"]}
    assert set(rows) == {"F.conv2d", "edatalog none", "edatalog graph"}
    assert all(r["median_ms"] > 0 for r in rows.values())
