"""Megatron by structure (:mod:`edatalog.solver.structure`): heads are what attention keeps
apart, FFN columns what a pair of weight contractions splits; never a dim's name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import edatalog
from edatalog import EdlError
from edatalog.solver import strategies
from edatalog.solver.structure import Transformer, transformer_dims
from edatalog.solver.topology import preset

ROOT = Path(__file__).resolve().parents[2]
CONV = """dim B = 2, C = 4, O = 8, H = 6, W = 6, F = 3.
input x[B, C, H, W] : f32.
param w[O, C, F, F] : f32.
output y.
y[b, o, i:H, j:W] += x[b, c, i + p - 1, j + q - 1] * w[o, c, p, q].
"""


@pytest.mark.parametrize(
    ("program", "major", "minor", "ffn"),
    [
        ("llama_block", "KVH", "G", {"F"}),
        ("llama_decode", "KVH", "G", {"F"}),
        ("gpt2", "H", None, {"F"}),
        ("attention", "H", None, set()),
        ("mlp", None, None, {"F"}),
        ("softmax", None, None, set()),
    ],
)
def test_the_programs_dims_are_found_by_structure(program: str, major: str, minor: str | None, ffn: set[str]) -> None:
    dims = transformer_dims(edatalog.compile(ROOT / "programs" / f"{program}.edl").graph)
    assert (dims.major, dims.minor, set(dims.ffn)) == (major, minor, ffn)


def test_renamed_dims_are_the_same_transformer() -> None:
    """The LLaMA block with its dims renamed (heads called Q, FFN called M, height-like H for
    the model dim): the same splits, now of the renamed dims."""
    text = (ROOT / "programs" / "llama_block.edl").read_text()
    for old, new in (("KVH", "KV"), ("F", "M"), ("G", "R"), ("H", "Q"), ("D", "H")):
        text = re.sub(rf"\b{old}\b", new, text)
    dims = transformer_dims(edatalog.compile_string(text, name="renamed.edl").graph)
    assert (dims.major, dims.minor, set(dims.ffn)) == ("KV", "R", {"M"})


def test_megatron_splits_no_spatial_index_of_a_convolution() -> None:
    """A conv2d whose height dim is called H (and kernel dim F) is no transformer: no megatron
    plan, and auto plans it without one to compare with."""
    prog = edatalog.compile_string(CONV, name="conv.edl")
    assert transformer_dims(prog.graph) == Transformer(None, None, frozenset())
    with pytest.raises(EdlError, match="the megatron strategy needs a transformer"):
        strategies.build(prog.graph, preset("a100x2"), "megatron")
    plan = edatalog.plan(prog, topology="a100x2", time_limit=2)
    assert plan.ir.strategy == "auto"
