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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

from edatalog.ir.graph import Access


def access_view(
    data: np.ndarray, acc: Access, order: Sequence[str], box: Mapping[str, int], fill: object = 0
) -> np.ndarray:
    """``data`` (laid out as the relation ``acc`` reads) at every point of the join space
    ``order`` x ``box``; places outside the relation read ``fill``.  Read-only."""
    parts = [p for ax in acc.axes for p in ax.parts]
    arr = np.ascontiguousarray(data).reshape([p.extent for p in parts])
    pads = []
    for p in parts:
        lo, hi = p.expr.bounds(box)
        pads.append((max(0, -lo), max(0, hi - (p.extent - 1))))
    if any(a or b for a, b in pads):
        arr = np.pad(arr, pads, constant_values=fill)  # type: ignore[call-overload]
    item = arr.itemsize
    offset = 0  # elements from the start of ``arr`` to the cell of the point at the origin
    strides = dict.fromkeys(order, 0)
    for k, (p, (pad, _)) in enumerate(zip(parts, pads, strict=True)):
        step = arr.strides[k] // item if arr.size else 0
        offset += (p.expr.const + pad) * step
        for v, c in p.expr.terms:
            strides[v] += c * step
    used = set(acc.indices)
    shape = [box[v] if v in used else 1 for v in order]
    flat = arr.reshape(-1)
    base = flat[offset:] if arr.size else flat
    return as_strided(base, shape=shape, strides=[strides[v] * item for v in order], writeable=False)


def index_values(order: Sequence[str], box: Mapping[str, int], name: str, dtype: np.dtype) -> np.ndarray:
    """The values of index ``name`` along its axis of the join space."""
    shape = [1] * len(order)
    k = list(order).index(name)
    shape[k] = box[name]
    return np.arange(box[name], dtype=dtype).reshape(shape)
