"""The model programs against Hugging Face transformers, in float64.

``programs/llama_block.edl`` must compute what ``LlamaDecoderLayer`` computes, and
``programs/gpt2_block.edl`` what ``GPT2Block`` computes (eval mode, no dropout), to a relative
error (Frobenius norm of the difference over the norm of the reference) of at most 1e-6.

The weights are random and large enough that every part of a block matters (not the default init,
which zeroes biases and sets norm weights to one); the dims are small and odd where the model
allows (rotate-half RoPE needs an even head size); the programs run in float64 (``: f32``
replaced by ``: f64``).  Besides the final output, the attention and MLP halves of each block are
compared on their own, so the residual stream cannot hide an error in either, and the checks
below make sure the reference is causal and that attention really contributes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import pytest
import torch
from transformers import GPT2Config, LlamaConfig
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

import edatalog

PROGRAMS = Path(__file__).resolve().parents[2] / "programs"
TOL = 1e-6

Array = npt.NDArray[np.float64]


def f64_program(name: str, dims: Mapping[str, int], consts: Mapping[str, float]) -> edatalog.Program:
    """The program ``programs/<name>`` with every declared ``f32`` made ``f64``."""
    text = (PROGRAMS / name).read_text(encoding="utf-8")
    assert ": f32" in text
    text = text.replace(": f32", ": f64")
    assert "f32" not in text
    prog = edatalog.compile_string(text, name=name, dims=dims, consts=consts)
    assert prog.warnings == ()
    return prog


def rel_err(out: Array, ref: Array) -> float:
    assert out.shape == ref.shape
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def rel_norm(part: Array, whole: Array) -> float:
    return float(np.linalg.norm(part) / np.linalg.norm(whole))


def causal_mask(s: int) -> torch.Tensor:
    """The additive causal mask eager attention expects, [1, 1, S, S]: 0 where t <= s, the most
    negative float64 above the diagonal (what transformers' own mask builder uses)."""
    mask = torch.full((s, s), torch.finfo(torch.float64).min, dtype=torch.float64)
    return mask.triu(1)[None, None]


def randomize(module: torch.nn.Module, gen: torch.Generator, *, fan_in_axis: int) -> None:
    """Random parameters: matrices ~ N(0, 1.5² / fan_in) (so activations stay O(1) at any width,
    with softmaxes neither flat nor one-hot), biases ~ N(0, 0.5²), norm weights ~ N(1, 0.5²)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 1.5 / p.shape[fan_in_axis] ** 0.5, generator=gen)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5, generator=gen)
            else:
                p.normal_(1.0, 0.5, generator=gen)


def numpy_of(t: torch.Tensor) -> Array:
    out: Array = t.detach().numpy()
    return out


@dataclass(frozen=True)
class Measured:
    y: float  # relative error of the block's output
    attn: float  # ... of the attention half (its output before the residual add)
    mlp: float  # ... of the MLP half


def check_block(
    prog: edatalog.Program,
    values: Mapping[str, Array],
    mid: str,
    forward: Callable[..., torch.Tensor],
    attn_half: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    mask: torch.Tensor,
) -> Measured:
    """Compare the program with the reference ``forward(x, mask)``, and make sure the comparison
    means something.  ``mid`` is the program's relation after the attention residual;
    ``attn_half(x)`` is the reference attention output (causal) before the residual."""
    with torch.no_grad():
        ref_t = forward(x, mask)
        attn_t = attn_half(x)
        # Causality of the reference: changing the last position changes nothing before it.
        x2 = x.clone()
        x2[:, -1] += torch.randn(x2[:, -1].shape, dtype=x.dtype, generator=torch.Generator().manual_seed(1))
        ref2_t = forward(x2, mask)
        # The mask matters: without it, eager attention is bidirectional.
        unmasked_t = forward(x, None)
    ref, attn_ref = numpy_of(ref_t), numpy_of(attn_t)
    xs = numpy_of(x)
    mlp_ref = ref - xs - attn_ref

    ref2 = numpy_of(ref2_t)
    np.testing.assert_allclose(ref2[:, :-1], ref[:, :-1], rtol=0, atol=1e-12)
    assert rel_norm(ref2[:, -1] - ref[:, -1], ref[:, -1]) > 0.1
    assert rel_err(numpy_of(unmasked_t), ref) > 0.05

    # Both halves move the residual stream substantially.
    assert rel_norm(attn_ref, xs) > 0.3
    assert rel_norm(mlp_ref, xs) > 0.3

    env = prog.evaluate(values)
    y = env["y"].data
    h = env[mid].data
    assert env["y"].present is None
    assert np.all(np.isfinite(y))
    return Measured(rel_err(y, ref), rel_err(h - xs, attn_ref), rel_err(y - h, mlp_ref))


# -- LLaMA -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaCase:
    b: int
    s: int
    h: int
    kvh: int
    e: int  # head size; even, as rotate-half RoPE needs
    f: int
    theta: float
    eps: float
    seed: int

    @property
    def d(self) -> int:
        return self.h * self.e


LLAMA_CASES = [
    pytest.param(LlamaCase(b=2, s=7, h=3, kvh=3, e=10, f=37, theta=500.0, eps=1e-5, seed=0), id="mha"),
    pytest.param(LlamaCase(b=1, s=9, h=9, kvh=3, e=6, f=43, theta=1234.5, eps=1e-6, seed=1), id="gqa"),
    pytest.param(LlamaCase(b=3, s=5, h=5, kvh=1, e=4, f=23, theta=50.0, eps=3e-6, seed=2), id="mqa"),
]


def llama_rope(case: LlamaCase) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions 0..S-1, [B, S, E], in float64.

    Hugging Face's rotary module computes them in float32 whatever the model's dtype (an error of
    about 1e-7 relative, a large part of the budget), so we compute them here, in float64, with its
    formula (``compute_default_rope_parameters`` and ``LlamaRotaryEmbedding.forward``), and pass them
    to the layer as ``position_embeddings``.  The program computes its own angles from ``theta``.
    RMSNorm and the attention softmax also run in float32 inside transformers; those rounding
    errors are of order 1e-7 and stay well inside the tolerance.
    """
    e = case.e
    inv_freq = 1.0 / (case.theta ** (torch.arange(0, e, 2, dtype=torch.float64) / e))
    pos = torch.arange(case.s, dtype=torch.float64)
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[None].expand(case.b, case.s, e)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("case", LLAMA_CASES)
def test_llama_block_matches_transformers(case: LlamaCase) -> None:
    measured = measure_llama(case)
    assert measured.y <= TOL
    assert measured.attn <= TOL
    assert measured.mlp <= TOL


def measure_llama(case: LlamaCase) -> Measured:
    config = LlamaConfig(
        hidden_size=case.d,
        intermediate_size=case.f,
        num_attention_heads=case.h,
        num_key_value_heads=case.kvh,
        rms_norm_eps=case.eps,
        rope_parameters={"rope_type": "default", "rope_theta": case.theta},
    )
    config._attn_implementation = "eager"
    layer: Any = LlamaDecoderLayer(config, layer_idx=0).double().eval()
    assert layer.self_attn.config._attn_implementation == "eager"
    assert layer.self_attn.head_dim == case.e
    gen = torch.Generator().manual_seed(case.seed)
    randomize(layer, gen, fan_in_axis=1)  # Linear: out x in
    x = torch.randn(case.b, case.s, case.d, dtype=torch.float64, generator=gen)
    cos, sin = llama_rope(case)

    # Our cos/sin agree with transformers' own (float32) rotary module for this config, so the
    # program's theta and the config's are the same thing.
    with torch.no_grad():
        hf_cos, hf_sin = LlamaRotaryEmbedding(config)(x, torch.arange(case.s)[None].expand(case.b, case.s))
    torch.testing.assert_close(hf_cos, cos, rtol=0, atol=1e-5)
    torch.testing.assert_close(hf_sin, sin, rtol=0, atol=1e-5)

    def forward(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        out = layer(x, attention_mask=mask, position_embeddings=(cos, sin))
        return out[0] if isinstance(out, tuple) else out

    def attn_half(x: torch.Tensor) -> torch.Tensor:
        out = layer.self_attn(
            hidden_states=layer.input_layernorm(x), attention_mask=causal_mask(case.s), position_embeddings=(cos, sin)
        )
        return out[0]

    prog = f64_program(
        "llama_block.edl",
        dims={"B": case.b, "S": case.s, "D": case.d, "H": case.h, "KVH": case.kvh, "F": case.f},
        consts={"eps": case.eps, "theta": case.theta},
    )
    assert prog.dims["E"] == case.e
    a, m = layer.self_attn, layer.mlp
    params = {
        "wq": a.q_proj.weight,
        "wk": a.k_proj.weight,
        "wv": a.v_proj.weight,
        "wo": a.o_proj.weight,
        "w_gate": m.gate_proj.weight,
        "w_up": m.up_proj.weight,
        "w_down": m.down_proj.weight,
        "attn_norm": layer.input_layernorm.weight,
        "ffn_norm": layer.post_attention_layernorm.weight,
    }
    # Every parameter of the layer is used, once.
    assert sorted(id(p) for p in params.values()) == sorted(id(p) for p in layer.parameters())
    values = {name: numpy_of(p) for name, p in params.items()} | {"x": numpy_of(x)}
    return check_block(prog, values, "h", forward, attn_half, x, causal_mask(case.s))


# -- GPT-2 -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gpt2Case:
    b: int
    s: int
    h: int
    e: int
    f: int | None  # n_inner; None is GPT-2's default of 4 * D (the program's default too)
    eps: float
    seed: int

    @property
    def d(self) -> int:
        return self.h * self.e


GPT2_CASES = [
    pytest.param(Gpt2Case(b=2, s=7, h=3, e=5, f=33, eps=1e-5, seed=0), id="h3"),
    pytest.param(Gpt2Case(b=1, s=11, h=5, e=3, f=None, eps=1e-5, seed=1), id="h5-f4d"),
    pytest.param(Gpt2Case(b=3, s=5, h=1, e=9, f=21, eps=1e-3, seed=2), id="h1"),
]


@pytest.mark.parametrize("case", GPT2_CASES)
def test_gpt2_block_matches_transformers(case: Gpt2Case) -> None:
    measured = measure_gpt2(case)
    assert measured.y <= TOL
    assert measured.attn <= TOL
    assert measured.mlp <= TOL


def measure_gpt2(case: Gpt2Case) -> Measured:
    config = GPT2Config(
        n_embd=case.d,
        n_head=case.h,
        n_inner=case.f,
        n_positions=case.s,
        layer_norm_epsilon=case.eps,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        attn_pdrop=0.0,
        embd_pdrop=0.0,
    )
    config._attn_implementation = "eager"
    block: Any = cast(Any, GPT2Block)(config, layer_idx=0).double().eval()
    # Eager attention is causal only through the mask it is given (GPT2Attention.is_causal is read
    # by the SDPA and flash paths alone, and only when no mask is passed), so every call passes
    # the causal mask explicitly; check_block verifies that the result is causal.
    assert block.attn.config._attn_implementation == "eager"
    assert block.attn.scaling == case.e**-0.5
    gen = torch.Generator().manual_seed(case.seed)
    randomize(block, gen, fan_in_axis=0)  # Conv1D: in x out
    x = torch.randn(case.b, case.s, case.d, dtype=torch.float64, generator=gen)

    def forward(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        out = block(x, attention_mask=mask)
        return out[0] if isinstance(out, tuple) else out

    def attn_half(x: torch.Tensor) -> torch.Tensor:
        out = block.attn(block.ln_1(x), attention_mask=causal_mask(case.s))
        return out[0]

    dims = {"B": case.b, "S": case.s, "D": case.d, "H": case.h}
    if case.f is not None:
        dims["F"] = case.f
    prog = f64_program("gpt2_block.edl", dims=dims, consts={"eps": case.eps})
    assert prog.dims["E"] == case.e
    assert prog.dims["F"] == (case.f or 4 * case.d)
    # The params are the state dict, one to one: each '.' becomes '_'.
    state = block.state_dict()
    values = {key.replace(".", "_"): numpy_of(t) for key, t in state.items()}
    assert set(values) == {r.name for r in prog.arguments if r.kind == "param"}
    values["x"] = numpy_of(x)
    return check_block(prog, values, "h1", forward, attn_half, x, causal_mask(case.s))


def test_gpt2_block_defaults_are_gpt2_small() -> None:
    config = GPT2Config()  # GPT-2 small
    prog = edatalog.compile(PROGRAMS / "gpt2_block.edl")
    d = config.n_embd
    assert prog.dims == {
        "B": 1,
        "S": config.n_positions,
        "D": d,
        "H": config.n_head,
        "E": d // config.n_head,
        "F": 4 * d if config.n_inner is None else config.n_inner,
    }
    assert prog.consts == {"eps": config.layer_norm_epsilon}
    assert config.activation_function == "gelu_new"
    shapes = {r.name: r.shape for r in prog.arguments if r.kind == "param"}
    with torch.device("meta"):  # shapes only
        block: Any = cast(Any, GPT2Block)(config, layer_idx=0)
    assert shapes == {key.replace(".", "_"): tuple(t.shape) for key, t in block.state_dict().items()}
