"""A join-agg's inputs as arrays over its join space, without copying them.

Every input of a rule is read through an access such as ``x[b, c, l + k]`` or ``wq[(h, e), d]``.
:func:`access_view` turns the relation's array into an array with one axis per join index (size
1 for the indices the access does not use) whose element at a point is the cell that point
reads.  It is a strided view of the relation: a composite axis is a reshape, a fixed place an
offset, a repeated index a diagonal, and ``l + k`` an axis that ``l`` and ``k`` both step along.
Evaluating a rule on these views costs what the rule's points cost, never a copy per point.

Index expressions may reach outside their relation (``x[t - 1]`` at ``t = 0``); those points
read absent cells and the rule's guard excludes them, but the view must still point somewhere:
such parts read from a copy of the relation padded with zeros (absent) on the sides they reach.

Everything here works on numpy arrays and torch tensors alike, through an array namespace
(:mod:`edatalog.backend.kernels.arrays`); masks are arrays too, never host-side index lists.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from edatalog.backend.kernels.arrays import NUMPY, Array, ArrayOps
from edatalog.ir.affine import Guard
from edatalog.ir.graph import Access


def access_view(
    data: Array,
    acc: Access,
    order: Sequence[str],
    box: Mapping[str, int],
    fill: float | int | bool = 0,
    xp: ArrayOps = NUMPY,
) -> Array:
    """``data`` (laid out as the relation ``acc`` reads) at every point of the join space
    ``order`` x ``box``; places outside the relation read ``fill``.  Read-only."""
    order = tuple(order)
    extents, pads, shape, strides, offset = view_spec(acc, order, tuple(box[v] for v in order))
    arr = xp.contiguous(data).reshape(extents)
    if any(a or b for a, b in pads):
        arr = xp.pad(arr, pads, fill)
    return xp.as_strided(arr, shape, strides, offset)


@functools.lru_cache(maxsize=1 << 14)
def view_spec(
    acc: Access, order: tuple[str, ...], sizes: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...], tuple[int, ...], tuple[int, ...], int]:
    """How :func:`access_view` lays an access over a join space, worked out once per access and
    space (runtimes read the same blocks every call): the relation's shape as the access's parts,
    the padding each part needs, and the view's shape, element strides and offset into the
    (padded, row-major) array."""
    box = dict(zip(order, sizes, strict=True))
    parts = [p for ax in acc.axes for p in ax.parts]
    extents = [p.extent for p in parts]
    pads = []
    for p in parts:
        lo, hi = p.expr.bounds(box)
        pads.append((max(0, -lo), max(0, hi - (p.extent - 1))))
    padded = [n + a + b for n, (a, b) in zip(extents, pads, strict=True)]
    steps = [math.prod(padded[k + 1 :]) for k in range(len(padded))] if math.prod(padded) else [0] * len(parts)
    offset = 0  # elements from the start of the padded array to the cell of the point at the origin
    strides = dict.fromkeys(order, 0)
    for p, step, (pad, _) in zip(parts, steps, pads, strict=True):
        offset += (p.expr.const + pad) * step
        for v, c in p.expr.terms:
            strides[v] += c * step
    used = set(acc.indices)
    shape = [box[v] if v in used else 1 for v in order]
    return tuple(extents), tuple(pads), tuple(shape), tuple(strides[v] for v in order), offset


def index_values(
    order: Sequence[str],
    box: Mapping[str, int],
    name: str,
    dtype: Any,
    xp: ArrayOps = NUMPY,
    lo: int = 0,
    device: Any = None,
) -> Array:
    """The values ``lo, lo + 1, ...`` of index ``name`` along its axis of the join space."""
    shape = [1] * len(order)
    k = list(order).index(name)
    shape[k] = box[name]
    return xp.arange(lo, lo + box[name], dtype, device).reshape(shape)


def guard_mask(
    guard: Guard, order: Sequence[str], box: Mapping[str, int], xp: ArrayOps, device: Any = None
) -> Array | None:
    """Where ``guard`` holds over the join space ``order`` x ``box``: a bool array (size 1 along
    the indices it does not mention), or None when it always holds.  :meth:`Guard.mask` on the
    namespace's arrays."""
    if guard.is_true:
        return None
    if guard.is_false:
        return xp.scalar(False, xp.bool_, device)
    values: dict[str, Array] = {}
    for k, v in enumerate(order):
        shape = [1] * len(order)
        shape[k] = box[v]
        values[v] = xp.arange(0, box[v], xp.dtype("i64"), device).reshape(shape)
    out: Array | None = None
    for conj in guard.conjs:
        m: Array | None = None
        for c in conj.constraints:
            held = c.holds(values)
            if isinstance(held, bool):  # a constraint without variables
                held = xp.scalar(held, xp.bool_, device)
            m = held if m is None else xp.logical_and(m, held)
        assert m is not None  # an empty conjunction is true, and the guard is not
        out = m if out is None else xp.logical_or(out, m)
    return out
