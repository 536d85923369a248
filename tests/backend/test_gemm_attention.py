"""bf16 attention as blocks of GEMMs (:func:`edatalog.backend.kernels.attention.gemm_attention`).

- It equals attention computed in f64 (fixed cases, and random sizes and head groups), leaves
  its inputs as they were (f32 ones too), and lays its result out as torch's kernel does;
  causal or not, with query rows that are not a multiple of a block's, with more than one
  batch, and with blocks cut into groups of heads, to about the error torch's flash kernel
  makes in bf16: its scores are f32, not rounded to bf16 (large scores make that difference
  visible).
- :func:`gemm_attention_takes` picks it for bf16 on a CPU from ``GEMM_ATTENTION_MIN_ROWS`` query
  rows with no mask or a causal one, never in f32, with fewer rows, with an explicit mask or
  under autograd.
- A bf16 LLaMA block of 256 positions runs it, interpreted and as a recorded graph, and agrees
  with the same block run by torch's flash kernel; a block of 128 positions does not run it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import edatalog
from edatalog.backend.kernels import attention
from edatalog.backend.kernels.attention import GEMM_ATTENTION_MIN_ROWS, gemm_attention, gemm_attention_takes
from edatalog.backend.running import compiled
from tests.strategies import example_settings

LLAMA = Path(__file__).resolve().parents[2] / "programs" / "llama_block.edl"


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    scores = q.double() @ k.double().transpose(-1, -2) * scale
    if causal:
        rows, keys = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(rows, keys, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v.double()


def _qkv(nb: int, nh: int, rows: int, keys: int, width: int, seed: int, spread: float) -> list[torch.Tensor]:
    """q, k, v as (batch, heads, rows, width) views of (batch, rows, heads, width) tensors, as the
    rules lay them out."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [(nb, rows, nh, width), (nb, keys, nh, width), (nb, keys, nh, width)]
    return [(torch.randn(s, generator=gen) * spread).to(torch.bfloat16).transpose(1, 2) for s in sizes]


@pytest.mark.parametrize(
    ("nb", "nh", "rows", "keys", "causal", "spread"),
    [
        (1, 4, 256, 256, True, 1.0),
        (2, 3, 300, 300, True, 3.0),  # rows not a multiple of a block's; scores of tens
        (1, 2, 130, 200, False, 3.0),
        (1, 2, 64, 64, True, 1.0),  # one block
    ],
)
def test_gemm_attention_equals_f64_attention_to_flash_precision(
    nb: int, nh: int, rows: int, keys: int, causal: bool, spread: float
) -> None:
    q, k, v = _qkv(nb, nh, rows, keys, 32, seed=rows, spread=spread)
    scale = 32**-0.5
    want = _reference(q, k, v, causal, scale)
    q_before = q.clone()
    got = gemm_attention(torch, q, k, v, causal, scale)
    assert got.shape == (nb, nh, rows, 32) and got.dtype == torch.bfloat16
    assert got.transpose(1, 2).is_contiguous()  # (batch, rows, heads, width) in memory, as the rules lay it
    assert torch.equal(q, q_before)
    flash = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    top = float(want.abs().max())
    err, flash_err = (float((x.double() - want).abs().max()) / top for x in (got, flash))
    assert err <= max(2 * flash_err, 8e-3), (err, flash_err)
    if spread > 1:  # scores rounded to bf16 before the softmax would miss by far more
        rounded = _reference((q @ k.transpose(-1, -2)).float(), torch.eye(keys), v, causal, scale)
        assert float((rounded - want).abs().max()) / top > 3 * err


@example_settings("EDL_PROPERTY_EXAMPLES", 30)
@given(
    st.integers(1, 2),
    st.integers(1, 5),
    st.integers(1, 200),
    st.integers(1, 200),
    st.sampled_from([8, 16, 24]),
    st.booleans(),
    st.integers(1, 64),
    st.integers(0, 10**6),
)
def test_random_attentions_equal_f64(
    nb: int, nh: int, rows: int, keys: int, width: int, causal: bool, budget_kb: int, seed: int
) -> None:
    """Any sizes (a causal block square, as the runtime gives it), blocks of any head groups."""
    keys = rows if causal else keys
    q, k, v = _qkv(nb, nh, rows, keys, width, seed=seed, spread=1.0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention, "GEMM_ATTENTION_SCORES_BYTES", budget_kb << 10)
        got = gemm_attention(torch, q, k, v, causal, width**-0.5)
    want = _reference(q, k, v, causal, width**-0.5)
    assert got.shape == want.shape
    assert float((got.double() - want).abs().max()) <= 1e-2 * float(want.abs().max())


def test_blocks_cut_into_groups_of_heads_give_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = _qkv(1, 5, 200, 200, 16, seed=1, spread=1.0)
    whole = gemm_attention(torch, q, k, v, True, 0.25)
    monkeypatch.setattr(attention, "GEMM_ATTENTION_SCORES_BYTES", 2 * 64 * 200 * 4)  # two heads a block
    grouped = gemm_attention(torch, q, k, v, True, 0.25)
    torch.testing.assert_close(grouped, whole, rtol=0, atol=0)


def test_f32_inputs_are_not_written() -> None:
    q, k, v = (x.float() for x in _qkv(1, 2, 100, 100, 8, seed=2, spread=1.0))
    before = q.clone()
    got = gemm_attention(torch, q, k, v, True, 0.5)
    assert torch.equal(q, before) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _reference(q, k, v, True, 0.5), rtol=1e-5, atol=1e-5)


def test_it_takes_bf16_on_a_cpu_from_enough_rows_without_an_explicit_mask() -> None:
    many, few = GEMM_ATTENTION_MIN_ROWS, GEMM_ATTENTION_MIN_ROWS - 1
    bf16 = torch.zeros(1, 2, many, 8, dtype=torch.bfloat16)
    assert gemm_attention_takes(bf16, bf16, True)
    assert gemm_attention_takes(bf16, bf16, None)
    assert not gemm_attention_takes(bf16, bf16, torch.ones(many, many, dtype=torch.bool))
    assert not gemm_attention_takes(bf16.float(), bf16.float(), True)
    short = torch.zeros(1, 2, few, 8, dtype=torch.bfloat16)
    assert not gemm_attention_takes(short, bf16, True)
    assert not gemm_attention_takes(bf16.clone().requires_grad_(), bf16, True)


# -- in a program ----------------------------------------------------------------------------------


@functools.cache
def _block(positions: int) -> edatalog.Program:
    return edatalog.compile(LLAMA, dims={"B": 1, "S": positions, "D": 64, "H": 4, "KVH": 2, "F": 96}, dtype="bf16")


def _run(prog: edatalog.Program, mode: str) -> Any:
    """The output of a third call: a replay of the recorded graph where compiled (the first call
    interprets, the second records)."""
    compiled._KEPT.clear()  # recorded graphs are kept per process: record this one afresh
    values = prog.random_inputs(seed=0)
    params = {r.name for r in prog.arguments if r.kind == "param"}
    exe = edatalog.executable(prog, backend="torch", device="cpu", compile=mode)
    exe.load({k: v for k, v in values.items() if k in params})
    inputs = {k: v for k, v in values.items() if k not in params}
    exe(inputs)
    exe(inputs)
    return exe(inputs)["y"].float()


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shapes of q in each call of gemm_attention; every call is passed through."""
    seen: list[tuple[int, ...]] = []
    real = attention.gemm_attention

    def counted(torch_: Any, q: Any, *rest: Any) -> Any:
        seen.append(tuple(q.shape))
        return real(torch_, q, *rest)

    monkeypatch.setattr(attention, "gemm_attention", counted)
    return seen


@pytest.mark.parametrize("mode", ["none", "graph"])
def test_a_bf16_block_of_256_positions_runs_it_and_agrees_with_flash(
    mode: str, calls: list[tuple[int, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    prog = _block(256)
    got = _run(prog, mode)
    assert calls and all(shape == (1, 4, 256, 16) for shape in calls)
    monkeypatch.setattr(attention, "GEMM_ATTENTION_MIN_ROWS", 10**9)
    del calls[:]
    flash = _run(prog, mode)
    assert calls == []
    assert not torch.equal(got, flash)  # two kernels, rounded apart
    assert float((got - flash).abs().max()) <= 2e-2 * float(flash.abs().max())


def test_a_bf16_block_of_128_positions_keeps_the_flash_kernel(calls: list[tuple[int, ...]]) -> None:
    _run(_block(128), "none")
    assert calls == []
