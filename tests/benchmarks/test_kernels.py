"""``benchmarks/block_kernels.py`` at tiny dims, one round: both contenders reproduce the f32
transformers layer in every case (f32 MHA and GQA to 1e-4, bf16 to 3e-2), and edatalog's time
is split by kernel class, fused attention included; where edatalog takes oneDNN's GEMMs or its
GEMM attention, the baseline is also timed with them."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

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
    assert set(rows) == {(c, w) for c in ("f32-mha", "f32-gqa", "bf16-mha", "bf16-gqa") for w in contenders}
    for key, r in rows.items():
        assert r["ok"] and r["ms"] > 0, key
        assert r["error"] <= (3e-2 if key[0].startswith("bf16") else 1e-4), key
    for case, shares in report["profile"].items():
        assert {"contraction", "fused attention"} <= set(shares), case
        assert all(v >= 0 for v in shares.values()), case


def _one_round(dims: str, case: str) -> dict[str, Any]:
    """The rows of one untimed-warm-up round of ``case`` at ``dims`` in the graph mode."""
    cmd = [sys.executable, str(SCRIPT), "--dims", dims, "--cases", case]
    cmd += ["--warmup", "0", "--repeat", "1", "--modes", "graph", "--json"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return {r["contender"]: r for r in json.loads(done.stdout)["results"]}


def test_the_baseline_takes_onednn_where_edatalog_does() -> None:
    """At dims with a GEMM of oneDNN's size (64 x 256 x 256), the f32 case also times transformers'
    layer with its GEMMs routed as edatalog's are; both still reproduce the reference."""
    rows = _one_round("S=64,D=256,H=4,F=256", "f32-mha")
    assert set(rows) == {"transformers", "transformers+onednn", "edatalog/graph"}
    assert all(r["ok"] and r["error"] <= 1e-4 for r in rows.values()), rows


def test_the_bf16_baseline_takes_gemm_attention_where_edatalog_does() -> None:
    """At 256 positions the bf16 case also times transformers' layer with edatalog's GEMM
    attention; both still reproduce the reference."""
    rows = _one_round("S=256,D=64,H=4,F=96", "bf16-mha")
    assert set(rows) == {"transformers", "transformers+gemm-attn", "edatalog/graph"}
    assert all(r["ok"] and r["error"] <= 3e-2 for r in rows.values()), rows


def test_the_registered_attention_is_edatalogs_and_equals_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' layer under the registered attention calls edatalog's function, once per
    call, with grouped key/value heads repeated, and agrees with its sdpa layer."""
    import torch

    from edatalog.backend.kernels import attention

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # scripts, not a package: mypy does not follow them
    block_kernels = importlib.import_module("block_kernels")
    lw = importlib.import_module("llama_weights")

    shapes: list[tuple[int, ...]] = []
    real = attention.gemm_attention

    def counted(torch_: Any, q: Any, k: Any, *rest: Any) -> Any:
        shapes.append(tuple(k.shape))
        return real(torch_, q, k, *rest)

    monkeypatch.setattr(attention, "gemm_attention", counted)
    dims = lw.BlockDims().with_text("S=256,D=64,H=4,KVH=2,F=96")
    consts = lw.program_consts(dims)
    weights = lw.make_weights(dims, 0)
    x = lw.make_input(dims, 0).to(torch.bfloat16)
    cos, sin = (t.to(torch.bfloat16) for t in lw.rope(dims, consts))
    assert block_kernels.gemm_attention_served(x, dims)
    name = block_kernels.register_gemm_attention()
    outs = []
    for impl in (name, "sdpa"):
        layer = lw.hf_layer(dims, consts, weights, attn_implementation=impl).to(torch.bfloat16)
        outs.append(block_kernels._layer_caller(layer, x, cos, sin)().float())
    assert shapes == [(1, 4, 256, 16)]
    assert float((outs[0] - outs[1]).abs().max()) <= 2e-2 * float(outs[1].abs().max())


def test_a_whole_model_under_the_registered_attention_keeps_its_padding_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-layer LlamaModel with a left-padded row: the registered attention gets sdpa's masks,
    so the padded row falls back to sdpa with its mask and the unpadded one runs edatalog's
    function; both agree with the sdpa model on the real tokens."""
    import torch
    from transformers import LlamaConfig, LlamaModel

    from edatalog.backend.kernels import attention

    calls: list[int] = []
    real = attention.gemm_attention

    def counted(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(attention, "gemm_attention", counted)
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    name = importlib.import_module("block_kernels").register_gemm_attention()
    config: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1}
    config |= {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 512}
    ids = torch.randint(0, 100, (2, 256), generator=torch.Generator().manual_seed(0))
    padded = torch.ones(2, 256, dtype=torch.long)
    padded[1, :100] = 0
    outs = {}
    for impl in ("sdpa", name):
        torch.manual_seed(0)
        model: Any = LlamaModel(LlamaConfig(**config | {"attn_implementation": impl}))
        model = model.to(torch.bfloat16).eval()
        with torch.no_grad():
            for rows, mask in (("one", None), ("both", padded)):
                outs[impl, rows] = model(input_ids=ids[:1] if mask is None else ids, attention_mask=mask)
    assert calls == [1]  # the unpadded call only: the padded batch has a mask
    for rows in ("one", "both"):
        want, got = (outs[impl, rows].last_hidden_state.float() for impl in ("sdpa", name))
        real_tokens = (slice(None), slice(100, None)) if rows == "both" else (slice(None), slice(None))
        top = float(want[real_tokens].abs().max())
        assert float((got - want)[real_tokens].abs().max()) <= 3e-2 * top, rows
