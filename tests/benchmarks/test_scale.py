"""``benchmarks/scale.py`` at tiny dims: it runs ``edl plan`` for the block and the model on one
node and on two, and reads back what the command printed (auto, the best baseline, how it
nested)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "scale.py"


def test_scale_reads_back_every_case() -> None:
    cmd = [sys.executable, str(SCRIPT), "--small", "--gpus", "8,16", "--time-limit", "3", "--json"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["what"], r["gpus"]) for r in rows] == [("block", 8), ("block", 16), ("model", 8), ("model", 16)]
    for r in rows:
        assert not r["error"] and r["auto_ms"] > 0 and r["baseline_ms"] > 0 and r["wall_s"] > 0, r
        assert abs(r["ratio"] - r["auto_ms"] / r["baseline_ms"]) < 2e-3  # the figures printed, rounded
        assert r["nested"].startswith("B across 2 groups of 8 devices") == (r["gpus"] == 16), r
        assert bool(r["pipeline"]) == (r["what"] == "model" and r["gpus"] == 16), r  # pipelines: models across nodes
