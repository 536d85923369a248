"""``benchmarks/plan_quality.py`` on one case with a short time limit: every strategy has a plan,
the refined baselines are never slower than the plain ones, auto is compared with the fastest
baseline that fits, and the block is costed in bf16 by default."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "plan_quality.py"


def test_one_case_against_the_best_baseline() -> None:
    cmd = [sys.executable, str(SCRIPT), "--cases", "7B-S512", "--time-limit", "2", "--json"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert report["dtype"] == "bf16"
    (case,) = report["cases"]
    results = case["results"]
    baselines = {"megatron", "megatron+r", "megatron-sp", "megatron-sp+r", "data"}
    assert set(results) == {"auto", "mesh", "best start", *baselines}
    assert all(r["error"] is None and r["predicted_ms"] > 0 for r in results.values())
    for base in ("megatron", "megatron-sp"):
        assert results[f"{base}+r"]["predicted_ms"] <= results[base]["predicted_ms"]
        assert results[f"{base}+r"]["how"]
    fitting = {s: r["predicted_ms"] for s, r in results.items() if s in baselines and r["fits"]}
    best = min(fitting, key=lambda s: fitting[s])
    assert report["best_baseline"]["7B-S512"] == best
    ratio = results["auto"]["predicted_ms"] / fitting[best]
    assert abs(report["auto_over_best_baseline"]["7B-S512"] - ratio) < 1e-12
    assert results["auto"]["how"]
    # Found by the search: strictly faster than the best start and every baseline that fits.
    rivals = [results["best start"]["predicted_ms"], *fitting.values()]
    assert ("7B-S512" in report["found_by_search"]) == all(results["auto"]["predicted_ms"] < r for r in rivals)
