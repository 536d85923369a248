"""``benchmarks/importer.py`` at tiny widths: it imports a transformers LLaMA from the meta device,
plans it and ``programs/llama.edl`` with ``edl plan``, and reads back what each printed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "importer.py"


def test_importer_benchmark_reads_back_both_programs() -> None:
    cmd = [sys.executable, str(SCRIPT), "--small", "--layers", "2", "--seq", "16", "--time-limit", "3", "--json"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(rows) == {"imported", "programs/llama.edl"}
    for row in rows.values():
        assert row["rules"] > 0 and row["predicted_ms"] > 0 and row["wall_s"] > 0, rows
    assert rows["imported"]["rules"] <= 1.5 * rows["programs/llama.edl"]["rules"]
