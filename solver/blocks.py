"""Candidate partitions of a join space, and what each device's block of one reads and writes.

A :class:`Candidate` splits some join indices (uneven where the extent does not divide) into
``P`` blocks and replicates each block on ``r`` devices, ``P * r <= N``.  Devices follow one
canonical rule for every node: the split indices, ordered by their dim's place in the program
(``KVH`` before ``G``, ``S`` before ``F``...), number the blocks in mixed radix, and block ``L``
lives on devices ``L*r .. L*r + r-1``.  Two nodes that split the same dims the same way therefore
put matching blocks on the same device, which is what makes Megatron-style chains free of traffic.

Coordinates are kept as sorted disjoint intervals (:data:`Ivs`), exact for composite accesses
such as ``wq[(g, r, e), d]``, and cheap to intersect while costing thousands of candidate pairs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from edatalog.ir.affine import Affine, Constraint
from edatalog.ir.graph import AxisMap, Graph, JoinAgg
from edatalog.solver.plan import Split, Tile

Ivs = tuple[tuple[int, int], ...]  # sorted, disjoint, non-adjacent [lo, hi) intervals
Box = tuple[Ivs, ...]  # one interval set per axis of a relation


def ivs_size(a: Ivs) -> int:
    return sum(hi - lo for lo, hi in a)


def ivs_meet(a: Ivs, b: Ivs) -> int:
    """The number of coordinates in both."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def box_size(box: Box) -> int:
    return math.prod(ivs_size(a) for a in box)


def box_meet(a: Box, b: Box) -> int:
    out = 1
    for x, y in zip(a, b, strict=True):
        out *= ivs_meet(x, y)
        if out == 0:
            return 0
    return out


def box_hull(a: Box, b: Box) -> Box:
    """The union of two boxes' coordinates, axis by axis (exact when they differ on one axis)."""
    return tuple(_merge([*x, *y]) for x, y in zip(a, b, strict=True))


def _merge(ivs: list[tuple[int, int]]) -> Ivs:
    ivs.sort()
    out: list[tuple[int, int]] = []
    for lo, hi in ivs:
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


def through(axes: tuple[AxisMap, ...], ranges: Mapping[str, tuple[int, int]]) -> Box:
    """The coordinates an access reaches, as intervals per axis, when its indices run over
    ``ranges`` (the interval twin of :meth:`Region.through`)."""
    out = []
    for ax in axes:
        inner: Ivs = ((0, 1),)
        stride = 1
        for p in reversed(ax.parts):
            lo, hi = ranges[p.index] if p.index is not None else (p.const or 0, (p.const or 0) + 1)
            if inner == ((0, stride),):  # the inner parts cover their whole span: one interval
                inner = ((lo * stride, hi * stride),)
            else:
                inner = _merge([(v * stride + a, v * stride + b) for v in range(lo, hi) for a, b in inner])
            stride *= p.extent
        out.append(inner)
    return tuple(out)


def split_longest(box: Box, parts: int, axis: int | None = None) -> list[Box]:
    """``parts`` pieces of a box cut along ``axis`` (default: its longest) as
    :func:`numpy.array_split` cuts (the way the backend's reduce-scatter divides a reduced block
    among its owners)."""
    if not box:
        return [box]
    k = axis if axis is not None else max(range(len(box)), key=lambda j: ivs_size(box[j]))
    coords = np.concatenate([np.arange(lo, hi) for lo, hi in box[k]]) if box[k] else np.zeros(0, dtype=np.int64)
    pieces = []
    for chunk in np.array_split(coords, min(parts, max(1, len(coords)))):
        if not len(chunk):
            continue
        breaks = np.flatnonzero(np.diff(chunk) != 1)
        starts = np.concatenate(([0], breaks + 1))
        ends = np.concatenate((breaks, [len(chunk) - 1]))
        ivs = tuple((int(chunk[s]), int(chunk[e]) + 1) for s, e in zip(starts, ends, strict=True))
        pieces.append((*box[:k], ivs, *box[k + 1 :]))
    return pieces


# -- candidates -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """Parts per join index (in the node's index order) and copies of each block.  ``chunk``
    cuts each device's block further along the indices in ``chunked`` (the guard's variables),
    so that a guard can leave whole chunks empty: causal attention skips its upper triangle."""

    parts: tuple[int, ...]
    replicas: int
    chunk: int = 1
    chunked: tuple[int, ...] = ()
    reduce_axis: int | None = None  # output axis partials are reduce-scattered along (None: longest)
    balanced: tuple[int, ...] = ()  # indices split zigzag: 2p parts, j and 2p-1-j on one device part

    @property
    def blocks(self) -> int:
        return math.prod(self.parts)

    @property
    def devices(self) -> int:
        return self.blocks * self.replicas


CHUNKS = (2, 4)  # chunkings tried for guarded rules


def zigzag(p: int) -> list[int]:
    """For each of the ``2p`` parts of a zigzag split, the part of a plain ``p``-way split whose
    devices hold it: parts ``j`` and ``2p-1-j`` go together."""
    return [j if j < p else 2 * p - 1 - j for j in range(2 * p)]


def guarded_dims(graph: Graph) -> frozenset[str]:
    """Dims of guard variables (``S`` for causal attention): a plain split of one gives the
    devices unequal shares of the guard's points, so candidates also split them zigzag."""
    return frozenset(i.symbol for node in graph.nodes for i in node.indices if i.name in node.guard.vars)


def dim_order(graph: Graph) -> dict[str, int]:
    """The canonical rank of every dim symbol: its place among the program's dims."""
    order = {name: k for k, (name, _) in enumerate(graph.dims)}
    for node in graph.nodes:
        for i in node.indices:
            order.setdefault(i.symbol, len(order))
    return order


def candidates(node: JoinAgg, n: int, mesh: bool = False, balance: AbstractSet[str] = frozenset()) -> list[Candidate]:
    """Every way to give ``n`` devices (or fewer, when extents are too small) blocks of the node:
    up to three split indices, parts at most the extent, the rest as replicas.  ``mesh`` keeps
    only what a device mesh can express: parts that divide the extent, and products of the prime
    factors of ``n``.  Splits of indices of the dims in ``balance`` also come zigzag: causal
    attention split along the sequence then gives every device as many unmasked scores, and
    since every rule with such an index has the same variant, layouts still line up."""
    extents = [i.extent for i in node.indices]
    out = []
    for total in sorted({d for d in range(1, n + 1) if n % d == 0}, reverse=True):
        for blocks in (b for b in range(1, total + 1) if total % b == 0):
            for parts in _factorizations(blocks, extents, limit=3):
                if mesh and any(e % p for p, e in zip(parts, extents, strict=True)):
                    continue
                out.append(Candidate(parts, total // blocks))
        if out and total == n:
            break  # every device can get work: fewer devices only when nothing fits all of them
    if not out:
        out.append(Candidate((1,) * len(extents), n))
    # Partial results can be reduce-scattered along any output axis long enough: the one the
    # readers split is free of a reshuffle.  (The longest is what None does already.)
    agg = set(node.agg_indices) if node.agg else set()
    extents_out = [ax.extent for ax in node.out_axes]
    longest = max(range(len(extents_out)), key=lambda a: extents_out[a], default=None)
    out += [
        Candidate(c.parts, c.replicas, reduce_axis=a)
        for c in list(out)
        if any(p > 1 for p, i in zip(c.parts, node.indices, strict=True) if i.name in agg)
        for a in range(len(extents_out))
        if extents_out[a] >= c.devices and a != longest and not mesh
    ]
    if balance and not mesh:
        for c in list(out):
            zig = tuple(
                k
                for k, (p, i) in enumerate(zip(c.parts, node.indices, strict=True))
                if p > 1 and i.symbol in balance and 2 * p <= i.extent
            )
            if zig:
                out.append(Candidate(c.parts, c.replicas, reduce_axis=c.reduce_axis, balanced=zig))
    guarded = tuple(k for k, i in enumerate(node.indices) if i.name in node.guard.vars)
    if guarded and not mesh:
        out += [
            Candidate(c.parts, c.replicas, chunk, guarded)
            for c in list(out)
            for chunk in CHUNKS
            # Chunk blocks that span the guard's variables whole: where they are split across
            # devices already, each device's block is mostly full or mostly empty.
            if all(c.parts[k] == 1 and chunk <= extents[k] for k in guarded)
        ]
    return out


def _factorizations(blocks: int, extents: list[int], limit: int) -> Iterator[tuple[int, ...]]:
    """Tuples of parts (each at most its extent) whose product is ``blocks``, at most ``limit``
    of them above 1."""
    if blocks == 1:
        yield (1,) * len(extents)
        return
    divisors = [d for d in range(2, blocks + 1) if blocks % d == 0]
    for k in range(1, min(limit, len(extents)) + 1):
        for where in itertools.combinations(range(len(extents)), k):
            for combo in itertools.product(divisors, repeat=k):
                if math.prod(combo) != blocks:
                    continue
                if any(c > extents[w] for c, w in zip(combo, where, strict=True)):
                    continue
                parts = [1] * len(extents)
                for c, w in zip(combo, where, strict=True):
                    parts[w] = c
                yield tuple(parts)


@dataclass(frozen=True)
class DeviceBlock:
    """One device's block: its ranges tightened to where the guard has points, the points."""

    device: int
    copy: int  # 0 for the block's first holder (the one that sends partials)
    block: int  # row-major block number in the node's tile
    ranges: dict[str, tuple[int, int]]
    points: int


class Layout:
    """A candidate applied to a node: its tile, and each device's block."""

    @staticmethod
    def of_tile(node: JoinAgg, tile: Tile, reduce_axis: int | None = None) -> Layout:
        """The layout of any tile of the node (a saved plan's, a baseline's): devices as given."""
        layout = Layout.__new__(Layout)
        layout.node, layout.splits, layout.tile = node, tile.splits, tile
        replicas = len(tile.devices[0]) if tile.devices else 1
        layout.cand = Candidate(tuple(s.parts for s in tile.splits), replicas, reduce_axis=reduce_axis)
        return layout

    def __init__(self, node: JoinAgg, cand: Candidate, rank: Mapping[str, int]) -> None:
        self.node, self.cand = node, cand
        names = [i.name for i in node.indices]
        # Pieces per device part: chunks, or the two halves of a zigzag split.
        per = [cand.chunk if k in cand.chunked else 2 if k in cand.balanced else 1 for k in range(len(names))]
        self.splits = tuple(
            Split.even(i.name, i.extent, p * c) for i, p, c in zip(node.indices, cand.parts, per, strict=True)
        )
        split_order = sorted(
            (k for k, p in enumerate(cand.parts) if p > 1),
            key=lambda k: (rank[node.indices[k].symbol], k),
        )
        zig = {k: zigzag(cand.parts[k]) for k in cand.balanced}
        devices = []
        for combo in itertools.product(*(range(p * c) for p, c in zip(cand.parts, per, strict=True))):
            linear = 0
            for k in split_order:
                part = zig[k][combo[k]] if k in zig else combo[k] // per[k]
                linear = linear * cand.parts[k] + part
            devices.append(tuple(range(linear * cand.replicas, (linear + 1) * cand.replicas)))
        self.tile = Tile(self.splits, tuple(devices))

    @cached_property
    def per_device(self) -> list[DeviceBlock]:
        out = []
        for block in self.tile.blocks():
            ranges, points = tighten(self.node, block.ranges)
            if points == 0:
                continue
            for copy, d in enumerate(block.devices):
                out.append(DeviceBlock(d, copy, block.index, ranges, points))
        return out


# (id of the guard, its variables' ranges) -> (the guard, tightened ranges, points); the guard is
# kept so that an id reused after it is gone never matches.
_TIGHTEN_CACHE: dict[tuple[object, ...], tuple[object, dict[str, tuple[int, int]], int]] = {}


def tighten(node: JoinAgg, ranges: Mapping[str, tuple[int, int]]) -> tuple[dict[str, tuple[int, int]], int]:
    """A block's ranges shrunk to where the node's guard has points, and the number of points.
    Exact: the backend computes and skips blocks by it, the solver prices them by it."""
    dense = math.prod(hi - lo for lo, hi in ranges.values())
    guard = node.guard
    if guard.is_true:
        return dict(ranges), dense
    gvars = sorted(guard.vars)
    key = (id(guard), tuple(ranges[v] for v in gvars))
    cached = _TIGHTEN_CACHE.get(key)
    hit = cached[1:] if cached is not None and cached[0] is guard else None
    if hit is None and len(guard.conjs) == 1 and 1 <= len(gvars) <= 2:
        hit = _tighten_conj(guard.conjs[0].constraints, gvars, ranges)
        _TIGHTEN_CACHE[key] = (guard, *hit)
    if hit is None:  # any other guard: look at every point of the block's guard variables
        shift = {v: Affine.var(v) + ranges[v][0] for v in gvars}
        box = {v: ranges[v][1] - ranges[v][0] for v in gvars}
        mask = np.broadcast_to(guard.substitute(shift).mask(gvars, box), tuple(box[v] for v in gvars))
        inside = int(np.count_nonzero(mask))
        tight: dict[str, tuple[int, int]] = {}
        if inside:
            for k, v in enumerate(gvars):
                idx = np.flatnonzero(mask.any(axis=tuple(j for j in range(len(gvars)) if j != k)))
                tight[v] = (ranges[v][0] + int(idx[0]), ranges[v][0] + int(idx[-1]) + 1)
        hit = (tight, inside)
        if len(_TIGHTEN_CACHE) > 100_000:
            _TIGHTEN_CACHE.clear()
        _TIGHTEN_CACHE[key] = (guard, *hit)
    tight, inside = hit
    others = math.prod(hi - lo for v, (lo, hi) in ranges.items() if v not in gvars)
    return {**ranges, **tight}, inside * others


def _tighten_conj(
    constraints: tuple[Constraint, ...], gvars: list[str], ranges: Mapping[str, tuple[int, int]]
) -> tuple[dict[str, tuple[int, int]], int]:
    """:func:`tighten` for one conjunction over at most two variables, row by row: for each
    value of the first variable, the constraints bound the second to an interval."""
    u = gvars[0]
    w = gvars[1] if len(gvars) > 1 else None
    us = np.arange(*ranges[u], dtype=np.int64)
    ok = np.ones(len(us), dtype=bool)
    lo = np.full(len(us), ranges[w][0] if w else 0, dtype=np.int64)
    hi = np.full(len(us), ranges[w][1] if w else 1, dtype=np.int64)  # exclusive
    for c in constraints:
        a, b, k = c.expr.coef(u), c.expr.coef(w) if w else 0, c.expr.const
        rest = a * us + k  # the constraint is rest + b*w >= 0 (or == 0)
        if b == 0:
            ok &= rest == 0 if c.eq else rest >= 0
        elif c.eq:
            exact = (-rest) % b == 0
            ok &= exact
            val = np.where(exact, -rest // b, 0)
            lo, hi = np.maximum(lo, val), np.minimum(hi, val + 1)
        elif b > 0:
            lo = np.maximum(lo, -(rest // b))  # w >= ceil(-rest / b)
        else:
            hi = np.minimum(hi, rest // -b + 1)  # w <= floor(rest / -b)
    width = np.where(ok, np.maximum(hi - lo, 0), 0)
    rows = np.flatnonzero(width)
    if not len(rows):
        return {}, 0
    tight = {u: (int(us[rows[0]]), int(us[rows[-1]]) + 1)}
    if w is not None:
        tight[w] = (int(lo[rows].min()), int(hi[rows].max()))
    return tight, int(width.sum())
