"""Tensors that depend on shapes only, folded at import: computed once with torch, then written
back as terms of their indices.

transformers builds its attention masks and position ids from ``arange``, ``cumsum``,
comparisons and ``index`` ops whose inputs are shapes, never data.  Such a node (no input, param
or buffer among its ancestors) is evaluated here, and its value becomes a term when it has a
shape the language says directly:

- the same value everywhere: a number;
- an affine function of its indices (``arange``, position ids): ``c0 + c1 * i + ...``;
- a band over two indices (causal and sliding-window masks): ``where(j - i <= k, 1, 0)``, with a
  lower bound too where there is one.

Anything else is an error naming the op: the language has no literal tensors.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from edatalog.importer import terms as T

RANDOM = ("rand", "randn", "randint", "bernoulli", "normal", "uniform", "dropout", "native_dropout")


def foldable(node: Any, folded: set[str]) -> bool:
    """Whether ``node`` depends on shapes only: every node it reads is folded (and it reads no
    placeholder), and it draws no random numbers."""
    if node.op != "call_function" or any(r in str(node.target) for r in RANDOM):
        return False
    return all(n.name in folded for n in node.all_input_nodes)


def evaluate(node: Any, values: dict[str, Any]) -> Any:
    """``node``'s value, its inputs' values in ``values`` (torch tensors)."""
    import torch.fx

    args = torch.fx.node.map_arg(node.args, lambda n: values[n.name])
    kwargs = dict(torch.fx.node.map_arg(node.kwargs, lambda n: values[n.name]))
    if "device" in kwargs:  # computed here, on the CPU, whatever device the model was captured on
        kwargs["device"] = torch.device("cpu")
    return node.target(*args, **kwargs)


def as_view(value: Any, dtype: str) -> T.View | None:
    """A folded tensor as a view whose term computes it from its indices, or None."""
    array = np.asarray(value.detach().cpu().numpy() if hasattr(value, "detach") else value)
    ids = [T.fresh() for _ in array.shape]
    axes = tuple((i,) for i in ids)
    extent = dict(zip(ids, array.shape, strict=True))
    term = _term(array, ids)
    return None if term is None else T.View(term, axes, extent, dtype)


def _term(array: np.ndarray, ids: list[int]) -> T.Term | None:
    flat = array.reshape(-1)
    if flat.size == 0:
        return None
    if array.dtype == np.bool_:
        return _band(array, ids)
    first = float(flat[0])
    if np.all(flat == flat[0]):
        return T.Num(first)
    values = np.unique(flat)
    if len(values) == 2:  # an additive mask (0 and -inf), a 0/1 mask as numbers: a band
        yes, no = float(values[1]), float(values[0])
        band = _band(array == values[1], ids)
        if band is not None:
            return _relabel(band, yes, no)
    if not np.all(np.isfinite(flat.astype(np.float64))):
        return None
    return _affine(array.astype(np.float64), ids) or _geometric(array, ids)


def _geometric(array: np.ndarray, ids: list[int]) -> T.Term | None:
    """``c * r ^ i`` along one axis (rotary frequencies: ``theta ^ (-2 i / E)``), to the
    precision of the array's type."""
    varying = [k for k in range(array.ndim) if array.shape[k] > 1 and not _constant_along(array, k)]
    if len(varying) != 1:
        return None
    (k,) = varying
    line = array.reshape(-1, *array.shape[k:])[0].reshape(array.shape[k], -1)[:, 0].astype(np.float64)
    if line[0] == 0 or line[1] == 0:
        return None
    ratio = line[1] / line[0]
    tol = 1e-12 if array.dtype == np.float64 else 1e-6
    if not np.allclose(line, line[0] * ratio ** np.arange(len(line)), rtol=tol, atol=0):
        return None
    power: T.Term = T.Binary("^", T.Num(float(ratio)), T.Index(ids[k]))
    return power if line[0] == 1 else T.Binary("*", T.Num(float(line[0])), power)


def _relabel(cond: T.Term, yes: float, no: float) -> T.Term:
    """A 0/1 condition term (nested ``where``s of 1 and 0) with ``yes`` for 1 and ``no`` for 0."""
    if isinstance(cond, T.Num):
        return T.Num(yes if cond.value == 1.0 else no)
    assert isinstance(cond, T.Where)
    return T.Where(cond.cond, _relabel(cond.then, yes, no), _relabel(cond.other, yes, no))


def _affine(array: np.ndarray, ids: list[int]) -> T.Term | None:
    origin = float(array[(0,) * array.ndim])
    term: T.Term = T.Num(origin)
    want = np.full(array.shape, origin)
    for axis, atom in enumerate(ids):
        if array.shape[axis] < 2:
            continue
        step = [0] * array.ndim
        step[axis] = 1
        slope = float(array[tuple(step)]) - origin
        if slope == 0:
            continue
        shape = [1] * array.ndim
        shape[axis] = array.shape[axis]
        want = want + slope * np.arange(array.shape[axis]).reshape(shape)
        part: T.Term = T.Index(atom) if slope == 1 else T.Binary("*", T.Num(slope), T.Index(atom))
        term = part if isinstance(term, T.Num) and term.value == 0 else T.Binary("+", term, part)
    return term if np.array_equal(want, array) else None


def _band(array: np.ndarray, ids: list[int]) -> T.Term | None:
    """A bool tensor as a condition on at most two of its indices."""
    varying = [k for k in range(array.ndim) if array.shape[k] > 1 and not _constant_along(array, k)]
    if not varying:
        return T.Num(1.0 if bool(array.reshape(-1)[0]) else 0.0)
    if len(varying) > 2:
        return None
    picked = array[tuple(slice(None) if k in varying else 0 for k in range(array.ndim))]
    left: T.Term
    if len(varying) == 1:
        (k,) = varying
        diff, left = np.arange(array.shape[k]), T.Index(ids[k])
    else:
        p, q = varying
        diff = np.arange(array.shape[q])[None, :] - np.arange(array.shape[p])[:, None]
        left = T.Binary("-", T.Index(ids[q]), T.Index(ids[p]))
    if not picked.any():
        return T.Num(0.0)
    hi, lo = int(diff[picked].max()), int(diff[picked].min())
    if not np.array_equal(picked, (diff <= hi) & (diff >= lo)):
        return None
    cond: T.Term = T.Num(1.0)
    if hi < int(diff.max()):
        cond = T.Where(T.Cmp("<=", left, T.Num(float(hi))), T.Num(1.0), T.Num(0.0))
    if lo > int(diff.min()):
        inner = cond
        cond = T.Where(T.Cmp(">=", left, T.Num(float(lo))), inner, T.Num(0.0))
    return cond


def _constant_along(array: np.ndarray, axis: int) -> bool:
    return bool(np.all(array == np.take(array, [0], axis=axis)))
