"""One LLaMA decoder block's weights, shared by every contender of the runtime benchmarks.

The weights are made once, from a seed, under the names and layouts of ``programs/llama_block.edl``
(``wq``, ``wk``, ``wv``, ``wo``, ``w_gate``, ``w_up``, ``w_down``: PyTorch Linear layout, out x
in; ``attn_norm``, ``ffn_norm``).  :data:`HF_NAMES` maps each of them to its parameter in Hugging
Face's ``LlamaDecoderLayer`` (the same mapping as ``tests/programs/test_transformers.py``), so the
hand-written Megatron layer, the DTensor-parallel transformers layer and edatalog's plans all run
the very same tensors.  ``eps`` and ``theta`` are read from the program (its ``const`` line), so the
transformers config and the program cannot disagree.

The weights are drawn as in ``tests/programs/test_transformers.py``: matrices ~ N(0, 1.5² / fan_in)
(activations stay O(1) at any width, softmaxes neither flat nor one-hot), norm weights ~ N(1, 0.5²).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used, so that the launcher of the benchmark starts quickly
    import torch

PROGRAM = Path(__file__).resolve().parent.parent / "programs" / "llama_block.edl"

# edatalog param -> LlamaDecoderLayer parameter (state-dict key).
HF_NAMES = {
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
    "attn_norm": "input_layernorm.weight",
    "ffn_norm": "post_attention_layernorm.weight",
}


@dataclass(frozen=True)
class BlockDims:
    """The block's sizes, named as in the program (``E = D / H`` is derived)."""

    B: int = 1  # batch
    S: int = 512  # sequence
    D: int = 1024  # model width
    H: int = 16  # query heads
    KVH: int = 16  # key/value heads (KVH = H: multi-head attention; fewer: grouped-query)
    F: int = 2816  # MLP width

    @property
    def E(self) -> int:
        return self.D // self.H

    def with_text(self, text: str) -> BlockDims:
        """These dims with ``"D=256,F=704,S=128"`` applied (names as in the program)."""
        names = [f.name for f in dataclasses.fields(self)]
        changes: dict[str, int] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, eq, value = item.partition("=")
            name = name.strip().upper()
            if not eq or name not in names:
                raise ValueError(f"bad dim {item!r}: write NAME=VALUE with NAME one of {', '.join(names)}")
            try:
                changes[name] = int(value)
            except ValueError:
                raise ValueError(f"bad dim {item!r}: {value.strip()!r} is not an integer") from None
            if changes[name] <= 0:
                raise ValueError(f"bad dim {item!r}: sizes are positive")
        return dataclasses.replace(self, **changes)

    def problems(self, nproc: int) -> list[str]:
        """Why these dims cannot run tensor-parallel on ``nproc`` ranks (empty when they can)."""
        out = []
        if self.D % self.H:
            out.append(f"D={self.D} is not a multiple of H={self.H}")
        elif self.E % 2:
            out.append(f"head size E = D/H = {self.E} is odd (rotate-half RoPE needs it even)")
        if self.H % self.KVH:
            out.append(f"H={self.H} is not a multiple of KVH={self.KVH}")
        for name in ("H", "KVH", "F"):
            if getattr(self, name) % nproc:
                out.append(f"{name}={getattr(self, name)} does not split over {nproc} ranks")
        return out

    def edl_dims(self) -> dict[str, int]:
        """The program's dims: ``edatalog.compile(PROGRAM, dims=...)``, or ``--dim NAME=VALUE`` each."""
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.edl_dims().items())


def program_consts(dims: BlockDims) -> dict[str, float]:
    """The program's constants (``eps``, ``theta``), as compiled at these dims."""
    import edatalog

    prog = edatalog.compile(PROGRAM, dims=dims.edl_dims())
    return dict(prog.consts)


def llama_config(dims: BlockDims, consts: dict[str, float], attn_implementation: str = "sdpa") -> Any:
    """transformers' ``LlamaConfig`` of this block, f32."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=dims.D,
        intermediate_size=dims.F,
        num_attention_heads=dims.H,
        num_key_value_heads=dims.KVH,
        rms_norm_eps=consts["eps"],
        rope_parameters={"rope_type": "default", "rope_theta": consts["theta"]},
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
    )
    config._attn_implementation = attn_implementation
    return config


def make_weights(dims: BlockDims, seed: int) -> dict[str, torch.Tensor]:
    """The block's weights by the program's names, f32, drawn from ``seed``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "wq": (dims.H * dims.E, dims.D),
        "wk": (dims.KVH * dims.E, dims.D),
        "wv": (dims.KVH * dims.E, dims.D),
        "wo": (dims.D, dims.H * dims.E),
        "w_gate": (dims.F, dims.D),
        "w_up": (dims.F, dims.D),
        "w_down": (dims.D, dims.F),
        "attn_norm": (dims.D,),
        "ffn_norm": (dims.D,),
    }
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 2:
            out[name] = torch.randn(shape, generator=gen) * (1.5 / shape[1] ** 0.5)  # Linear: out x in
        else:
            out[name] = 1.0 + 0.5 * torch.randn(shape, generator=gen)
    return out


def make_input(dims: BlockDims, seed: int) -> torch.Tensor:
    """The block's input ``x[B, S, D]``, f32."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1_000_003)
    return torch.randn(dims.B, dims.S, dims.D, generator=gen)


def hf_layer(
    dims: BlockDims, consts: dict[str, float], weights: dict[str, torch.Tensor], attn_implementation: str = "sdpa"
) -> Any:
    """transformers' ``LlamaDecoderLayer`` holding ``weights`` (copies), f32, eval mode."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = llama_config(dims, consts, attn_implementation)
    with torch.device("meta"):
        layer = LlamaDecoderLayer(config, layer_idx=0)
    state = {HF_NAMES[name]: w.detach().clone() for name, w in weights.items()}
    # Every parameter of the layer is one of the program's, once.
    assert sorted(state) == sorted(k for k, _ in layer.named_parameters()), sorted(state)
    layer.load_state_dict(state, assign=True)
    return layer.float().eval()


def rope(dims: BlockDims, consts: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions 0..S-1, ``[B, S, E]``, f32, from transformers' own rotary module
    (what ``LlamaModel`` hands every layer as ``position_embeddings``)."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = llama_config(dims, consts)
    x = torch.zeros(dims.B, dims.S, dims.D)
    positions = torch.arange(dims.S)[None].expand(dims.B, dims.S)
    with torch.no_grad():
        cos, sin = LlamaRotaryEmbedding(config)(x, positions)
    return cos.contiguous(), sin.contiguous()


def reference(layer: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The layer's output on ``x`` with an explicit additive causal mask (so that an eager layer is
    causal without relying on any ``is_causal`` flag)."""
    import torch

    s = x.shape[1]
    mask = torch.full((s, s), torch.finfo(x.dtype).min, dtype=x.dtype, device=x.device).triu(1)[None, None]
    with torch.no_grad():
        out = layer(x, attention_mask=mask, position_embeddings=(cos, sin))
    return out[0] if isinstance(out, tuple) else out
