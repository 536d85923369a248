"""Every program in ``programs/``: compiles at its default dims, runs at small dims, and, for the
small ones, matches a direct numpy computation in float64."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

import edatalog

PROGRAMS = Path(__file__).resolve().parents[2] / "programs"
ALL = sorted(p.name for p in PROGRAMS.glob("*.edl"))

Array = npt.NDArray[np.float64]

# Small dims for every program, and the shape of each output in dim names.
SMALL: dict[str, tuple[dict[str, int], dict[str, tuple[str, ...]]]] = {
    "attention.edl": ({"B": 2, "S": 5, "D": 12, "H": 3}, {"y": ("B", "S", "D")}),
    "gpt2_block.edl": ({"B": 2, "S": 5, "D": 15, "H": 3, "F": 7}, {"y": ("B", "S", "D")}),
    "gpt2.edl": ({"B": 2, "S": 5, "D": 12, "H": 3, "F": 7, "L": 2, "V": 11, "P": 8}, {"logits": ("B", "S", "V")}),
    "llama_block.edl": ({"B": 2, "S": 5, "D": 12, "H": 3, "KVH": 1, "F": 7}, {"y": ("B", "S", "D")}),
    "llama.edl": ({"S": 5, "D": 12, "H": 3, "KVH": 1, "F": 7, "L": 2, "V": 11}, {"logits": ("B", "S", "V")}),
    "llama_decode.edl": (
        {"D": 12, "H": 3, "KVH": 1, "F": 7, "L": 2, "V": 11, "T": 6},
        {"logits": ("B", "V"), **{f"layers.{k}.{c}_new": ("B", "KVH", "E") for k in (0, 1) for c in ("kr", "v")}},
    ),
    "mixtral.edl": (
        {"S": 5, "D": 12, "H": 3, "KVH": 1, "F": 7, "L": 2, "V": 11, "X": 4, "K": 2},
        {"logits": ("B", "S", "V")},
    ),
    "mixtral_capacity.edl": (
        {"S": 5, "D": 12, "H": 3, "KVH": 1, "F": 7, "L": 2, "V": 11, "X": 4, "K": 2, "C": 2},
        {"logits": ("B", "S", "V")},
    ),
    "mixtral_decode.edl": (
        {"D": 12, "H": 3, "KVH": 1, "F": 7, "L": 2, "V": 11, "X": 4, "K": 2, "T": 6},
        {"logits": ("B", "V"), **{f"layers.{k}.{c}_new": ("B", "KVH", "E") for k in (0, 1) for c in ("kr", "v")}},
    ),
    "mlp.edl": ({"B": 3, "D": 5, "F": 7}, {"y": ("B", "D")}),
    "moe_layer.edl": ({"T": 6, "D": 12, "F": 7, "X": 4, "K": 2}, {"y": ("T", "D")}),
    "moe_capacity.edl": ({"G": 2, "S": 6, "D": 12, "F": 7, "X": 4, "K": 2, "C": 2}, {"y": ("G", "S", "D")}),
    "softmax.edl": ({"N": 4, "C": 9}, {"y": ("N", "C")}),
}


def test_programs_found() -> None:
    assert {"attention.edl", "llama_block.edl", "gpt2_block.edl", "mlp.edl", "softmax.edl"} <= set(ALL)


@pytest.mark.parametrize("name", ALL)
def test_compiles_at_default_dims(name: str) -> None:
    prog = edatalog.compile(PROGRAMS / name)
    assert prog.warnings == ()
    assert prog.outputs
    assert prog.arguments
    assert all(n > 0 for n in prog.dims.values())


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("seed", [0, 1])
def test_runs_at_small_dims(name: str, seed: int) -> None:
    assert name in SMALL, f"add small dims for programs/{name} to SMALL"
    dims, shapes = SMALL[name]
    prog = edatalog.compile(PROGRAMS / name, dims=dims)
    assert prog.warnings == ()
    out = prog.run(prog.random_inputs(seed))
    assert set(out) == set(shapes) == set(prog.outputs)
    for rel, symbols in shapes.items():
        y = out[rel]
        assert y.shape == tuple(prog.dims[s] for s in symbols)
        assert y.dtype == np.float32
        assert np.all(np.isfinite(y))
        assert np.any(y != 0)


# -- against numpy, in float64 -----------------------------------------------------------------------


def run_f64(name: str, dims: dict[str, int], seed: int) -> tuple[dict[str, Array], Array]:
    """The program's random inputs (in float64) and its output ``y``, computed in float64."""
    text = (PROGRAMS / name).read_text(encoding="utf-8").replace(": f32", ": f64")
    prog = edatalog.compile_string(text, name=name, dims=dims)
    values = prog.random_inputs(seed)
    assert all(v.dtype == np.float64 for v in values.values())
    y = prog.run(values)["y"]
    assert y.dtype == np.float64
    return values, y


def rel_err(out: Array, ref: Array) -> float:
    assert out.shape == ref.shape
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


_erf = np.vectorize(math.erf, otypes=[np.float64])


@pytest.mark.parametrize("seed", [0, 1])
def test_mlp_matches_numpy(seed: int) -> None:
    v, y = run_f64("mlp.edl", {"B": 3, "D": 5, "F": 7}, seed)
    h = v["x"] @ v["w1"].T + v["b1"]
    a = 0.5 * h * (1.0 + _erf(h / math.sqrt(2.0)))  # exact (erf) GELU
    ref = a @ v["w2"].T + v["b2"]
    assert rel_err(y, ref) <= 1e-10


@pytest.mark.parametrize("seed", [0, 1])
def test_softmax_matches_numpy(seed: int) -> None:
    v, y = run_f64("softmax.edl", {"N": 4, "C": 9}, seed)
    x = v["x"]
    ex = np.exp(x - x.max(axis=1, keepdims=True))
    ref = ex / ex.sum(axis=1, keepdims=True)
    assert rel_err(y, ref) <= 1e-10
    np.testing.assert_allclose(y.sum(axis=1), 1.0, rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_attention_matches_numpy(seed: int) -> None:
    b, s, d, h = 2, 5, 12, 3
    e = d // h
    v, y = run_f64("attention.edl", {"B": b, "S": s, "D": d, "H": h}, seed)
    x = v["x"]
    q = (x @ v["wq"].T).reshape(b, s, h, e)
    k = (x @ v["wk"].T).reshape(b, s, h, e)
    val = (x @ v["wv"].T).reshape(b, s, h, e)
    scores = np.einsum("bshe,bthe->bhst", q, k) / math.sqrt(e)
    causal = np.tril(np.ones((s, s), dtype=bool))
    scores = np.where(causal, scores, -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    o = np.einsum("bhst,bthe->bshe", p, val).reshape(b, s, h * e)
    ref = o @ v["wo"].T
    assert rel_err(y, ref) <= 1e-10
    # The causal mask matters: the first position attends only to itself.
    np.testing.assert_allclose(o[:, 0], val[:, 0].reshape(b, h * e), rtol=1e-12)
