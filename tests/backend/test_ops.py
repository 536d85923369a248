"""The op and aggregation registry (:mod:`edatalog.backend.kernels.ops`): one row per op of the language
and per aggregation, with a numpy and a torch implementation that agree."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from edatalog.backend.kernels import ops
from edatalog.backend.kernels.arrays import NUMPY, TORCH, ArrayOps
from edatalog.ir.graph import AGG_NAMES
from edatalog.ir.scalar import FOLD, OPS

_POSITIVE = ("log", "sqrt", "rsqrt")


def _args(op: str, rng: np.random.Generator) -> list[np.ndarray]:
    if op == "where":
        return [rng.random(12) < 0.5, rng.standard_normal(12), rng.standard_normal(12)]
    if op in ("not", "and", "or"):
        return [rng.random(12) < 0.5 for _ in range(OPS[op].arity)]
    if op in _POSITIVE:
        return [rng.uniform(0.1, 4.0, 12)]
    if op == "pow":
        return [rng.uniform(0.1, 4.0, 12), rng.uniform(-2.0, 2.0, 12)]
    if op == "div":  # a denominator never rounds to 0
        return [rng.uniform(-3.0, 3.0, 12).round(1), rng.uniform(0.1, 3.0, 12) * rng.choice([-1.0, 1.0], 12)]
    return [rng.uniform(-3.0, 3.0, 12).round(1) for _ in range(OPS[op].arity)]  # .round: ties for ==


@pytest.mark.parametrize("op", sorted(OPS))
def test_every_op_agrees_on_numpy_torch_and_python(op: str) -> None:
    """Each op of the language on f64 arrays: numpy's and torch's implementation equal the
    compile-time folding rule (``edatalog.ir.scalar.FOLD``) element by element."""
    args = _args(op, np.random.default_rng(sorted(OPS).index(op)))
    f64 = NUMPY.dtype("f64")
    want = np.array([FOLD[op](*(a[k].item() for a in args)) for k in range(12)], dtype=np.float64)
    got_np = ops.apply_op(op, args, f64)
    got_t = ops.apply_op(op, [torch.from_numpy(a) for a in args], TORCH.dtype("f64"), TORCH)
    assert isinstance(got_t, torch.Tensor) and isinstance(got_np, np.ndarray)
    assert got_t.dtype == (torch.bool if got_np.dtype == np.bool_ else torch.float64)
    np.testing.assert_allclose(got_np.astype(np.float64), want, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(TORCH.to_numpy(got_t).astype(np.float64), want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", ["f32", "f64"])
def test_numeric_results_stay_in_the_compute_dtype(name: str) -> None:
    for xp in (NUMPY, TORCH):
        cdt = xp.dtype(name)
        x = xp.asarray(np.linspace(0.5, 1.5, 5), cdt)
        for op in ("exp", "gelu", "gelu_tanh", "silu", "erf", "rsqrt", "sigmoid", "relu"):
            assert ops.apply_op(op, [x], cdt, xp).dtype == cdt, (xp, op)
        assert ops.apply_op("add", [x, xp.scalar(2, xp.dtype("f64"))], cdt, xp).dtype == cdt


def test_erf_is_torchs_on_both_sides() -> None:
    """numpy has no erf: the numpy implementation calls torch's, so the two agree bitwise.  gelu
    is torch's ``F.gelu`` on tensors (one fused kernel) and the erf formula on numpy: both within
    f32 rounding of the exact value."""
    x = np.linspace(-3, 3, 101, dtype=np.float32)
    f32 = np.dtype(np.float32)
    got = {op: ops.apply_op(op, [x], f32) for op in ("erf", "gelu")}
    on_torch = {op: TORCH.to_numpy(ops.apply_op(op, [torch.from_numpy(x)], torch.float32, TORCH)) for op in got}
    np.testing.assert_array_equal(got["erf"], on_torch["erf"])
    exact = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x.astype(np.float64)])
    for gelu in (got["gelu"], on_torch["gelu"]):
        np.testing.assert_allclose(gelu, exact, rtol=1e-6, atol=1e-6)


def _values(xp: ArrayOps, name: str, shape: tuple[int, ...]) -> Any:
    rng = np.random.default_rng(7)
    raw: np.ndarray
    if name == "bool":
        raw = rng.random(shape) < 0.5
    elif name in ("i32", "i64"):
        raw = rng.integers(-3, 4, shape)
    else:
        raw = rng.standard_normal(shape)
    return xp.asarray(raw, xp.dtype(name))


_AGGS = sorted(a for a in AGG_NAMES.values() if a is not None)


@pytest.mark.parametrize(
    ("agg", "name"),
    # sums and products of bools do not occur: a rule that adds or multiplies computes in an int
    [(a, n) for a in _AGGS for n in ("f64", "f32", "i64", "i32", "bool") if n != "bool" or a in ("max", "min")],
)
def test_aggregations_agree(agg: str, name: str) -> None:
    """Identity, fold and reduction over several axes, numpy against torch, in every dtype an
    aggregation can run in."""
    if name in ("f64", "f32"):
        lo, hi = -math.inf, math.inf
    elif name == "bool":
        lo, hi = False, True
    else:
        lo, hi = int(np.iinfo(NUMPY.dtype(name)).min), int(np.iinfo(NUMPY.dtype(name)).max)
    want_identity = {"sum": 0, "prod": 1, "max": lo, "min": hi}[agg]
    for xp in (NUMPY, TORCH):
        ident = ops.identity(agg, xp.dtype(name), xp)
        assert ident == want_identity
        masked = xp.where(_values(xp, "bool", (2, 3)), _values(xp, name, (2, 3)), ident)
        assert masked.dtype == xp.dtype(name)
    a_np, b_np = _values(NUMPY, name, (2, 3, 4)), _values(NUMPY, name, (2, 3, 4))[::-1].copy()
    a_t, b_t = TORCH.asarray(a_np), TORCH.asarray(b_np)
    np.testing.assert_array_equal(TORCH.to_numpy(ops.fold(agg, a_t, b_t, TORCH)), ops.fold(agg, a_np, b_np))
    for axes in [(0,), (1, 2), (0, 2), (0, 1, 2)]:
        want = ops.reduce(agg, a_np, axes)
        got = ops.reduce(agg, a_t, axes, TORCH)
        assert np.asarray(want).dtype == a_np.dtype and got.dtype == a_t.dtype
        rtol = 1e-6 if name == "f32" else 1e-12  # summation order differs
        np.testing.assert_allclose(TORCH.to_numpy(got), want, rtol=rtol)
    assert ops.reduce(agg, a_t, (), TORCH) is a_t


def test_warm_up_takes_any_names() -> None:
    ops.warm_up(["exp", "add", "no such op"])


def test_torch_functions_are_named_not_imported() -> None:
    """The table names torch's functions; it imports torch only when one is called (``import
    edatalog`` must not load torch: see ``test_warm_up_loads_torch_only_for_the_ops_that_need_it``)."""
    fn = ops.SCALAR_OPS["gelu_tanh"].torch
    assert repr(fn) == "torch.nn.functional.gelu"
    x = torch.linspace(-2, 2, 9, dtype=torch.float64)
    torch.testing.assert_close(fn(x), torch.nn.functional.gelu(x, approximate="tanh"), rtol=0, atol=0)
