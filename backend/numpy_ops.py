"""The scalar operations of the language on numpy arrays, in a given compute dtype."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np


def _erf(a: np.ndarray) -> np.ndarray:
    import torch  # numpy has no erf; torch's matches what GPU backends compute

    # ascontiguousarray makes a 0-d array 1-d; reshape so a scalar stays a scalar.
    return torch.special.erf(torch.from_numpy(np.require(a, requirements=("C", "W")))).numpy().reshape(a.shape)


def _sigmoid(a: np.ndarray) -> np.ndarray:
    one = a.dtype.type(1)
    return one / (one + np.exp(-a))


def _gelu_tanh(a: np.ndarray) -> np.ndarray:
    t = a.dtype.type
    return t(0.5) * a * (t(1) + np.tanh(t(math.sqrt(2.0 / math.pi)) * (a + t(0.044715) * a * a * a)))


def _gelu(a: np.ndarray) -> np.ndarray:
    t = a.dtype.type
    return t(0.5) * a * (t(1) + _erf(a / t(math.sqrt(2.0))))


_UNARY: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "neg": np.negative,
    "not": np.logical_not,
    "exp": np.exp,
    "log": np.log,
    "sqrt": np.sqrt,
    "rsqrt": lambda a: a.dtype.type(1) / np.sqrt(a),
    "abs": np.abs,
    "sin": np.sin,
    "cos": np.cos,
    "tanh": np.tanh,
    "sigmoid": _sigmoid,
    "silu": lambda a: a * _sigmoid(a),
    "gelu": _gelu,
    "gelu_tanh": _gelu_tanh,
    "relu": lambda a: np.maximum(a, a.dtype.type(0)),
    "erf": _erf,
}

_BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": np.true_divide,
    "pow": np.power,
    "max": np.maximum,
    "min": np.minimum,
    "and": np.logical_and,
    "or": np.logical_or,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
    "eq": np.equal,
    "ne": np.not_equal,
}


def apply_op(op: str, args: Sequence[np.ndarray], cdt: np.dtype) -> np.ndarray:
    """Apply a scalar op; numeric results stay in ``cdt`` (the rule's compute dtype)."""
    if op == "where":
        cond, a, b = args
        return np.where(np.asarray(cond).astype(bool), a, b).astype(cdt, copy=False)
    if op in _UNARY:
        (a,) = args
        if op != "not":
            a = np.asarray(a).astype(cdt, copy=False)
        return np.asarray(_UNARY[op](a))
    a, b = (np.asarray(x) for x in args)
    if op in ("and", "or"):
        return np.asarray(_BINARY[op](a.astype(bool), b.astype(bool)))
    if op in ("lt", "le", "gt", "ge", "eq", "ne"):
        return np.asarray(_BINARY[op](a, b))
    a, b = a.astype(cdt, copy=False), b.astype(cdt, copy=False)
    return np.asarray(_BINARY[op](a, b))


def warm_up(ops: Iterable[str]) -> None:
    """Apply each of ``ops`` once to a one-element array, so that what an op loads on first use
    (torch, for erf and gelu: a second or so) is loaded now, and timing a run measures the work."""
    one = np.ones(1, np.float32)
    for op in sorted(set(ops) & _UNARY.keys()):
        _UNARY[op](one)


def identity(agg: str, dtype: np.dtype) -> np.generic:
    """The identity of an aggregation in ``dtype``: what absent points contribute."""
    dtype = np.dtype(dtype)
    if agg == "sum":
        return dtype.type(0)
    if agg == "prod":
        return dtype.type(1)
    if dtype.kind == "f":
        return dtype.type(-np.inf if agg == "max" else np.inf)
    if dtype.kind == "b":
        return dtype.type(agg == "min")
    info = np.iinfo(dtype)
    return dtype.type(info.min if agg == "max" else info.max)
