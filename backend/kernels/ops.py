"""The scalar ops and aggregations of the language, on numpy and on torch: one table each.

:data:`SCALAR_OPS` has a row per op of :data:`edatalog.ir.scalar.OPS` and :data:`AGGREGATIONS`
a row per aggregation (``sum``, ``prod``, ``max``, ``min``: what absent points contribute, how two
partials combine, how an array reduces over axes); each row holds the numpy and the torch
implementation side by side, so that a backend cannot miss an op or disagree on one silently.
Evaluators call them through :func:`apply_op`, :func:`identity`, :func:`fold` and
:func:`reduce` with an array namespace (:mod:`edatalog.backend.kernels.arrays`).

Numeric results stay in the rule's compute dtype (``f64`` stays ``f64``; ``f16`` and ``bf16``
compute in ``f32``).  ``erf`` and ``gelu`` are torch's on both sides: numpy has no ``erf``, and
torch's is what GPU backends compute.  Torch functions are named, not imported, here (:class:`_T`):
torch loads on first use only.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edatalog.backend.kernels.arrays import NUMPY, Array, ArrayOps, torch_module
from edatalog.ir.scalar import OPS, Op, ScalarExpr

Fn = Callable[..., Any]


class _T:
    """The torch function at ``path`` (``"special.erf"``), with keyword arguments bound, looked
    up when first called."""

    def __init__(self, path: str, **kwargs: object) -> None:
        self.path = path
        self.kwargs = kwargs

    @functools.cached_property
    def fn(self) -> Fn:
        return functools.reduce(getattr, self.path.split("."), torch_module())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **self.kwargs, **kwargs)

    def __repr__(self) -> str:
        return f"torch.{self.path}"


@dataclass(frozen=True)
class Impl:
    """One operation in each library: ``numpy`` on numpy arrays, ``torch`` on tensors.  ``out``:
    the torch function takes ``out=`` (an array of the result's shape and dtype, possibly one
    of its arguments), so that an evaluator can compute a chain of ops in place."""

    numpy: Fn
    torch: Fn
    out: bool = False

    def on(self, xp: ArrayOps) -> Fn:
        return self.numpy if xp.name == "numpy" else self.torch


# -- scalar ops -----------------------------------------------------------------------------------


def _np_erf(a: np.ndarray) -> np.ndarray:
    torch = torch_module()  # numpy has no erf; torch's matches what GPU backends compute
    # ascontiguousarray makes a 0-d array 1-d; reshape so a scalar stays a scalar.
    return torch.special.erf(torch.from_numpy(np.require(a, requirements=("C", "W")))).numpy().reshape(a.shape)


def _np_sigmoid(a: np.ndarray) -> np.ndarray:
    one = a.dtype.type(1)
    return one / (one + np.exp(-a))


def _np_gelu_tanh(a: np.ndarray) -> np.ndarray:
    t = a.dtype.type
    return t(0.5) * a * (t(1) + np.tanh(t(math.sqrt(2.0 / math.pi)) * (a + t(0.044715) * a * a * a)))


def _np_gelu(a: np.ndarray) -> np.ndarray:
    t = a.dtype.type
    return t(0.5) * a * (t(1) + _np_erf(a / t(math.sqrt(2.0))))


def _torch_silu(a: Any, out: Any = None) -> Any:
    """torch's silu, with ``out=`` (which its functional form lacks) done in place."""
    silu = torch_module().nn.functional.silu
    if out is None:
        return silu(a)
    return silu(out if out is a else out.copy_(a), inplace=True)


SCALAR_OPS: dict[str, Impl] = {
    "neg": Impl(np.negative, _T("neg"), out=True),
    "not": Impl(np.logical_not, _T("logical_not")),
    "add": Impl(np.add, _T("add"), out=True),
    "sub": Impl(np.subtract, _T("sub"), out=True),
    "mul": Impl(np.multiply, _T("mul"), out=True),
    "div": Impl(np.true_divide, _T("true_divide"), out=True),
    "pow": Impl(np.power, _T("pow"), out=True),
    "max": Impl(np.maximum, _T("maximum"), out=True),
    "min": Impl(np.minimum, _T("minimum"), out=True),
    "and": Impl(np.logical_and, _T("logical_and")),
    "or": Impl(np.logical_or, _T("logical_or")),
    "lt": Impl(np.less, _T("lt")),
    "le": Impl(np.less_equal, _T("le")),
    "gt": Impl(np.greater, _T("gt")),
    "ge": Impl(np.greater_equal, _T("ge")),
    "eq": Impl(np.equal, _T("eq")),
    "ne": Impl(np.not_equal, _T("ne")),
    "where": Impl(np.where, _T("where")),
    "exp": Impl(np.exp, _T("exp"), out=True),
    "log": Impl(np.log, _T("log"), out=True),
    "sqrt": Impl(np.sqrt, _T("sqrt"), out=True),
    "rsqrt": Impl(lambda a: a.dtype.type(1) / np.sqrt(a), _T("rsqrt"), out=True),
    "abs": Impl(np.abs, _T("abs"), out=True),
    "sin": Impl(np.sin, _T("sin"), out=True),
    "cos": Impl(np.cos, _T("cos"), out=True),
    "tanh": Impl(np.tanh, _T("tanh"), out=True),
    "sigmoid": Impl(_np_sigmoid, _T("sigmoid"), out=True),
    "silu": Impl(lambda a: a * _np_sigmoid(a), _torch_silu, out=True),
    "gelu": Impl(_np_gelu, _T("nn.functional.gelu")),
    "gelu_tanh": Impl(_np_gelu_tanh, _T("nn.functional.gelu", approximate="tanh")),
    "relu": Impl(lambda a: np.maximum(a, a.dtype.type(0)), _T("relu")),
    "erf": Impl(_np_erf, _T("special.erf"), out=True),
    "floor": Impl(np.floor, _T("floor"), out=True),
    "ceil": Impl(np.ceil, _T("ceil"), out=True),
    "round": Impl(np.rint, _T("round"), out=True),  # halves to even, both
    "trunc": Impl(np.trunc, _T("trunc"), out=True),
}
assert SCALAR_OPS.keys() == OPS.keys(), "every op of the language needs an implementation"

_LOGICAL = ("not", "and", "or")


def writes_into(op: str, xp: ArrayOps) -> bool:
    """Whether :func:`apply_op` can write ``op``'s result into a given array with ``xp``."""
    return xp.name == "torch" and SCALAR_OPS[op].out and OPS[op].result != "bool"


def apply_op(op: str, args: Sequence[Array], cdt: Any, xp: ArrayOps = NUMPY, out: Array | None = None) -> Array:
    """Apply a scalar op; numeric results stay in ``cdt`` (the rule's compute dtype, as ``xp``
    names it).  Logical ops work on truth values, comparisons on their operands as they are.
    ``out`` (only where :func:`writes_into` says so): an array of the result's shape, in
    ``cdt``, that receives the result (it may be one of ``args``)."""
    fn = SCALAR_OPS[op].on(xp)
    if out is not None:
        assert writes_into(op, xp), f"{op} cannot write into an array with {xp.name}"
        return fn(*(xp.cast(a, cdt) for a in args), out=out)
    if op == "where":
        cond, a, b = args
        return xp.cast(fn(xp.cast(cond, xp.bool_), a, b), cdt)
    info = OPS[op]
    if op == "not":
        return xp.asarray(fn(args[0]))
    if op in _LOGICAL:
        return xp.asarray(fn(*(xp.cast(a, xp.bool_) for a in args)))
    if info.result == "bool":
        return xp.asarray(fn(*args))
    return xp.asarray(fn(*(xp.cast(a, cdt) for a in args)))


# -- fused forms (torch) ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Fused:
    """One torch call for an op over another op's result that only it reads: ``add(a, mul(b,
    c))`` is ``addcmul(a, b, c)``, ``sub(a, div(b, c))`` is ``addcdiv(a, b, c, value=-1)``.
    One pass over memory instead of two, and no array in between; ``addcmul`` may round once
    where the two ops round twice (a fused multiply-add), as XLA's and inductor's fusions do.
    ``args``: node ids of the expression, as :class:`~edatalog.ir.scalar.Op`'s."""

    name: str  # "addcmul" or "addcdiv"
    args: tuple[int, ...]
    value: int  # 1 or -1
    inner: int  # the node of the op folded in

    def pays(self, shapes: Sequence[tuple[int, ...]], xp: ArrayOps) -> bool:
        """Whether the call pays with arguments of these shapes: only where the first (``a``)
        has the result's shape.  A broadcast ``a`` is first copied into the result, a pass
        of its own (measured: ``addcdiv(eps, b, c)`` at 3.4x ``div`` then ``add``)."""
        return tuple(shapes[0]) == tuple(xp.broadcast_shape(list(shapes)))

    def apply(self, args: Sequence[Array], cdt: Any, xp: ArrayOps, out: Array | None = None) -> Array:
        fn = getattr(torch_module(), self.name)
        return fn(*(xp.cast(a, cdt) for a in args), value=self.value, out=out)


_FUSED_INNER = {"mul": "addcmul", "div": "addcdiv"}


@functools.lru_cache(maxsize=4096)
def fusions(expr: ScalarExpr) -> dict[int, Fused]:
    """The ops of ``expr`` that torch evaluates as one :class:`Fused` call, by node id (where
    :func:`fuses`).  The inner op is one that no other op reads and that is not the root."""
    reads = Counter(a for k in expr.live() if isinstance(n := expr.nodes[k], Op) for a in n.args)
    found: dict[int, Fused] = {}
    for k in expr.live():
        n = expr.nodes[k]
        if not isinstance(n, Op) or n.op not in ("add", "sub"):
            continue
        a, b = n.args
        sides = [(b, a, 1 if n.op == "add" else -1)] + ([(a, b, 1)] if n.op == "add" else [])
        for inner, other, value in sides:
            m = expr.nodes[inner]
            if not isinstance(m, Op) or m.op not in _FUSED_INNER or reads[inner] != 1 or inner == expr.root:
                continue  # read once: by this op alone, so no other fusion can take it
            found[k] = Fused(_FUSED_INNER[m.op], (other, *m.args), value, inner)
            break
    return found


def fuses(cdt: Any, xp: ArrayOps) -> bool:
    """Whether an evaluator in compute dtype ``cdt`` with ``xp`` uses :func:`fusions`: torch, in
    f32 or f64 (``f16``/``bf16`` rules compute in f32 and round once; one computed natively in
    its half type rounds after every op, as the language says, which a fused call would not)."""
    if xp.name != "torch":
        return False
    torch = torch_module()
    return cdt in (torch.float32, torch.float64)


def warm_up(ops: Iterable[str]) -> None:
    """Apply each unary op of ``ops`` once to a one-element array, so that what an op loads on
    first use (torch, for erf and gelu: a second or so) is loaded now, and timing a run measures
    the work.  Unknown names are ignored."""
    one = np.ones(1, np.float32)
    for op in sorted(set(ops) & SCALAR_OPS.keys()):
        if OPS[op].arity == 1:
            SCALAR_OPS[op].numpy(one)


# -- aggregations ---------------------------------------------------------------------------------


def _torch_prod(a: Any, axes: tuple[int, ...]) -> Any:
    """torch's prod takes one axis: move ``axes`` last, as one."""
    keep = [k for k in range(a.dim()) if k not in axes]
    moved = a.permute(*keep, *axes).reshape(*(a.shape[k] for k in keep), math.prod(a.shape[k] for k in axes))
    return torch_module().prod(moved, dim=-1)


@dataclass(frozen=True)
class Aggregation:
    """``identity``: what an absent point contributes, ``"zero"``, ``"one"``, or the ``"lowest"``
    or ``"highest"`` value of the dtype; ``fold(a, b)`` combines partials elementwise;
    ``reduce(a, axes)`` over a tuple of axes."""

    identity: str
    fold: Impl
    reduce: Impl


AGGREGATIONS: dict[str, Aggregation] = {
    "sum": Aggregation("zero", Impl(np.add, _T("add")), Impl(np.sum, _T("sum"))),
    "prod": Aggregation("one", Impl(np.multiply, _T("mul")), Impl(np.prod, _torch_prod)),
    "max": Aggregation("lowest", Impl(np.maximum, _T("maximum")), Impl(np.max, _T("amax"))),
    "min": Aggregation("highest", Impl(np.minimum, _T("minimum")), Impl(np.min, _T("amin"))),
}


def identity(agg: str, dtype: Any, xp: ArrayOps = NUMPY) -> Any:
    """The identity of an aggregation in ``dtype``: what absent points contribute.  With numpy,
    a numpy scalar of ``dtype``; with torch, a Python number (which keeps a tensor's dtype)."""
    lowest, highest = xp.limits(dtype)
    kind = AGGREGATIONS[agg].identity
    value = {"zero": 0, "one": 1, "lowest": lowest, "highest": highest}[kind]
    return xp.constant(value, dtype)


def fold(agg: str, a: Array, b: Array, xp: ArrayOps = NUMPY) -> Array:
    """Two partials combined elementwise."""
    return AGGREGATIONS[agg].fold.on(xp)(a, b)


def reduce(agg: str, a: Array, axes: tuple[int, ...], xp: ArrayOps = NUMPY) -> Array:
    """``a`` aggregated over ``axes``, in ``a``'s dtype (numpy and torch sum integers in 64 bits;
    wrapping back is what summing in the narrow type gives).  Empty ``axes``: ``a`` itself."""
    if not axes:
        return a
    out = AGGREGATIONS[agg].reduce.on(xp)(a, axes)
    if out.dtype != a.dtype and a.dtype != xp.bool_:
        out = xp.cast(out, a.dtype)
    return out
