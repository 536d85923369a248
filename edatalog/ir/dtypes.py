"""Element types of relations: names, sizes, numpy equivalents and promotion.

Promotion follows PyTorch rather than numpy: the wider type of a kind wins, an integer with a
float gives that float (``i32`` with ``f16`` is ``f16``), and ``f16`` with ``bf16`` gives ``f32``.
``bf16`` arrays use ``ml_dtypes``, imported on first use (its import takes most of a second:
planning never needs it).  Numbers written in a program are *weak*: they never widen an
operand, so ``x * 0.5`` keeps ``x`` in ``f32``.
"""

from __future__ import annotations

import functools

import numpy as np

DTYPES = ("f64", "f32", "f16", "bf16", "i64", "i32", "bool")
FLOATS = ("f64", "f32", "f16", "bf16")
INTS = ("i64", "i32")

_NUMPY: dict[str, np.dtype] = {
    "f64": np.dtype(np.float64),
    "f32": np.dtype(np.float32),
    "f16": np.dtype(np.float16),
    "i64": np.dtype(np.int64),
    "i32": np.dtype(np.int32),
    "bool": np.dtype(np.bool_),
}
_ITEMSIZE = {**{name: d.itemsize for name, d in _NUMPY.items()}, "bf16": 2}
_FROM_NUMPY = {v: k for k, v in _NUMPY.items()}

# Rank within a kind; the wider one wins.  bf16 and f16 are incomparable and meet at f32.
_ORDER = {"bool": 0, "i32": 1, "i64": 2, "f16": 3, "bf16": 3, "f32": 4, "f64": 5}


def kind(dtype: str) -> str:
    """'bool', 'int' or 'float'."""
    return "float" if dtype in FLOATS else "int" if dtype in INTS else "bool"


def itemsize(dtype: str) -> int:
    return _ITEMSIZE[dtype]


def to_numpy(dtype: str) -> np.dtype:
    return _bfloat16() if dtype == "bf16" else _NUMPY[dtype]


def from_numpy(dtype: np.dtype) -> str | None:
    """The edatalog name of a numpy dtype, or None if edatalog has no such type."""
    d = np.dtype(dtype)
    if d.name == "bfloat16":  # only ml_dtypes makes one: it is loaded by then
        return "bf16" if d == _bfloat16() else None
    return _FROM_NUMPY.get(d)


@functools.cache
def _bfloat16() -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def promote(a: str, b: str) -> str:
    if a == b:
        return a
    if {a, b} == {"f16", "bf16"}:
        return "f32"
    return a if _ORDER[a] > _ORDER[b] else b


def compute_dtype(dtype: str) -> str:
    """The type arithmetic runs in: half floats compute in f32 and round when stored, as GPUs do."""
    return "f32" if dtype in ("f16", "bf16") else dtype
