"""``benchmarks/block_kernels.py`` at tiny dims, one round: both contenders reproduce the f32
transformers layer in every case (f32 MHA and GQA to 1e-4, bf16 to 3e-2), and edatalog's time
is split by kernel class, fused attention included."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "block_kernels.py"


def test_every_case_matches_transformers() -> None:
    cmd = [sys.executable, str(SCRIPT), "--dims", "S=32,D=64,H=4,F=96", "--warmup", "0", "--repeat", "1", "--json"]
    cmd += ["--modes", "none,graph"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(done.stdout)
    rows = {(r["case"], r["contender"]): r for r in report["results"]}
    contenders = ("transformers", "edatalog/none", "edatalog/graph")
    assert set(rows) == {(c, w) for c in ("f32-mha", "f32-gqa", "bf16-mha") for w in contenders}
    for key, r in rows.items():
        assert r["ok"] and r["ms"] > 0, key
        assert r["error"] <= (3e-2 if key[0] == "bf16-mha" else 1e-4), key
    for case, shares in report["profile"].items():
        assert {"contraction", "fused attention"} <= set(shares), case
        assert all(v >= 0 for v in shares.values()), case


def test_the_baseline_takes_onednn_where_edatalog_does() -> None:
    """At dims with a GEMM of oneDNN's size (64 x 256 x 256), the f32 case also times transformers'
    layer with its GEMMs routed as edatalog's are; both still reproduce the reference."""
    cmd = [sys.executable, str(SCRIPT), "--dims", "S=64,D=256,H=4,F=256", "--cases", "f32-mha"]
    cmd += ["--warmup", "0", "--repeat", "1", "--modes", "graph", "--json"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = {r["contender"]: r for r in json.loads(done.stdout)["results"]}
    assert set(rows) == {"transformers", "transformers+onednn", "edatalog/graph"}
    assert all(r["ok"] and r["error"] <= 1e-4 for r in rows.values()), rows
