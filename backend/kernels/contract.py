"""Sums of products over a join space, contracted two operands at a time in an order chosen by
cost, each pair by one matrix multiplication.

``numpy.einsum(..., optimize=True)`` does this too, until an intermediate exceeds its memory
limit; then it silently runs one loop over every index at once, and a 1-D convolution that took
0.1 s takes hours.  Here the order is greedy, as opt_einsum's default: repeatedly contract the
pair whose result is smallest (then the cheapest), after summing out every index that only one
operand has.  Every step is a ``matmul`` of a (batch, rows, shared) array by a (batch, shared,
columns) one, so the work runs in the BLAS and memory is that of the largest intermediate.

The arrays are numpy's or torch's, as the namespace passed in (:mod:`edatalog.backend.kernels.arrays`)
says; the order is chosen from extents alone, so both evaluate the same sequence of products.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from edatalog.backend.kernels import ops
from edatalog.backend.kernels.arrays import NUMPY, Array, ArrayOps

Operand = tuple[Array, tuple[str, ...]]  # an array and the index of each of its axes


def squeeze(arr: Array, order: Sequence[str], xp: ArrayOps = NUMPY) -> Operand:
    """An array over the join space ``order`` (size 1 along the indices it does not vary with)
    as an operand over just the indices it varies with."""
    arr = xp.asarray(arr)
    arr = arr.reshape((1,) * (len(order) - arr.ndim) + arr.shape)
    keep = [k for k, n in enumerate(arr.shape) if n != 1]
    return arr.reshape([arr.shape[k] for k in keep]), tuple(order[k] for k in keep)


def contract(
    operands: Sequence[Operand], out: Sequence[str], extents: Mapping[str, int], xp: ArrayOps = NUMPY
) -> Operand:
    """The sum over every index not in ``out`` of the product of ``operands``; the result is
    over the indices of ``out`` that some operand has, in ``out``'s order."""
    ixs = [ix for _, ix in operands]
    cur = [_sum_private(a, ix, _needed(ixs, {k}, out), xp) for k, (a, ix) in enumerate(operands)]
    while len(cur) > 1:
        ixs = [ix for _, ix in cur]
        i, j = _cheapest_pair(ixs, out, extents)
        pair = _pair(cur[i], cur[j], _needed(ixs, {i, j}, out), xp)
        cur = [op for k, op in enumerate(cur) if k not in (i, j)] + [pair]
    (arr, ix) = _sum_private(*cur[0], set(out), xp)
    final = tuple(v for v in out if v in ix)
    return xp.transpose(arr, [ix.index(v) for v in final]), final


def peak_elements(
    ixs: Sequence[tuple[str, ...]], out: Sequence[str], extents: Mapping[str, int]
) -> tuple[int, tuple[str, ...]]:
    """The most elements :func:`contract` holds at once (two operands and their product) for
    operands over ``ixs``, and the indices of the largest single array among them: what a
    memory estimate needs, without any array."""
    cur = [tuple(v for v in ix if v in _needed(ixs, {k}, out)) for k, ix in enumerate(ixs)]
    largest = max(cur, key=lambda ix: _size(ix, extents), default=())
    peak = _size(largest, extents)
    while len(cur) > 1:
        i, j = _cheapest_pair(cur, out, extents)
        keep = _needed(cur, {i, j}, out)
        result = tuple(dict.fromkeys(v for v in (*cur[i], *cur[j]) if v in keep))
        peak = max(peak, _size(cur[i], extents) + _size(cur[j], extents) + _size(result, extents))
        largest = max((largest, result), key=lambda ix: _size(ix, extents))
        cur = [ix for k, ix in enumerate(cur) if k not in (i, j)] + [result]
    return peak, largest


def _size(ix: Sequence[str], extents: Mapping[str, int]) -> int:
    return math.prod(extents[v] for v in ix)


def _needed(ixs: Sequence[tuple[str, ...]], skip: set[int], out: Sequence[str]) -> set[str]:
    """Indices needed beyond the operands ``skip``: the result's and every other operand's."""
    need = set(out)
    for k, ix in enumerate(ixs):
        if k not in skip:
            need.update(ix)
    return need


def _sum_private(arr: Array, ix: tuple[str, ...], needed: set[str], xp: ArrayOps) -> Operand:
    """Sum out the indices nothing else needs."""
    drop = tuple(k for k, v in enumerate(ix) if v not in needed)
    if not drop:
        return arr, ix
    return ops.reduce("sum", arr, drop, xp), tuple(v for v in ix if v in needed)


def _cheapest_pair(ixs: Sequence[tuple[str, ...]], out: Sequence[str], extents: Mapping[str, int]) -> tuple[int, int]:
    best: tuple[int, int, int, int] | None = None
    for i in range(len(ixs)):
        for j in range(i + 1, len(ixs)):
            keep = _needed(ixs, {i, j}, out)
            both = set(ixs[i]) | set(ixs[j])
            size = _size([v for v in both if v in keep], extents)
            work = _size(list(both), extents)
            if best is None or (size, work) < best[:2]:
                best = (size, work, i, j)
    assert best is not None
    return best[2], best[3]


def _pair(a: Operand, b: Operand, keep: set[str], xp: ArrayOps) -> Operand:
    """One pairwise contraction: ``keep`` are the indices still needed after it."""
    (x, ix), (y, iy) = _sum_private(*a, keep | set(b[1]), xp), _sum_private(*b, keep | set(a[1]), xp)
    batch = [v for v in ix if v in iy and v in keep]
    shared = [v for v in ix if v in iy and v not in keep]
    rows = [v for v in ix if v not in iy]
    cols = [v for v in iy if v not in ix]
    size = dict(zip(ix, x.shape, strict=True)) | dict(zip(iy, y.shape, strict=True))
    if not shared:
        return _product(x, ix, y, iy, xp)
    nb, nr, ns, nc = (math.prod(size[v] for v in group) for group in (batch, rows, shared, cols))
    lhs = xp.transpose(x, [ix.index(v) for v in (*batch, *rows, *shared)]).reshape(nb, nr, ns)
    rhs = xp.transpose(y, [iy.index(v) for v in (*batch, *shared, *cols)]).reshape(nb, ns, nc)
    if nr == 1 and nc == 1:  # a dot product per batch: one matmul of 1-by-1 results per batch is slow
        result = ops.reduce("sum", lhs.reshape(nb, ns) * rhs.reshape(nb, ns), (1,), xp)
    elif nb == 1:  # a plain GEMM: a batch of one goes another, slower way in some libraries (bf16: 2x)
        result = xp.matmul(lhs.reshape(nr, ns), rhs.reshape(ns, nc))
    else:
        result = xp.matmul(lhs, rhs)
    return result.reshape([size[v] for v in (*batch, *rows, *cols)]), (*batch, *rows, *cols)


def _product(x: Array, ix: tuple[str, ...], y: Array, iy: tuple[str, ...], xp: ArrayOps) -> Operand:
    """Nothing to sum: an elementwise product by broadcasting, in the larger operand's layout
    (a matmul of 1-by-1 blocks would be one call per cell, and transposing a large operand a
    copy of it)."""
    if x.ndim < y.ndim:
        x, ix, y, iy = y, iy, x, ix
    extra = tuple(v for v in iy if v not in ix)
    order = (*ix, *extra)
    x = x.reshape(tuple(x.shape) + (1,) * len(extra))
    mine = [v for v in order if v in iy]  # y's indices, in the result's order
    y = xp.transpose(y, [iy.index(v) for v in mine])
    dims = dict(zip(mine, y.shape, strict=True))
    return x * y.reshape(tuple(dims.get(v, 1) for v in order)), order
