"""``benchmarks/moe.py`` at tiny dims, one round: edatalog gives MixtralSparseMoeBlock's result
(else the script exits 1) and both contenders are timed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "moe.py"


def test_moe_layer_matches_transformers_and_is_timed() -> None:
    cmd = [sys.executable, str(SCRIPT), "--dims", "T=16,D=32,F=48", "--repeat", "1", "--calls", "1", "--json"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert report["max_rel_diff"] <= 1e-4
    assert {r["contender"] for r in report["rows"]} == {"transformers MixtralSparseMoeBlock", "edatalog (graph)"}
    assert all(r["median_ms"] > 0 for r in report["rows"])
