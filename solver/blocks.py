"""Candidate partitions of a join space, and what each device's block of one reads and writes.

A :class:`Candidate` splits some join indices (uneven where the extent does not divide) into
``P`` blocks and replicates each block on ``r`` devices, ``P * r <= N``.  Devices follow one
canonical rule for every node: the split indices, ordered by their dim's place in the program
(``KVH`` before ``G``, ``S`` before ``F``...), number the blocks in mixed radix, and block ``L``
lives on devices ``L*r .. L*r + r-1``.  Two nodes that split the same dims the same way therefore
put matching blocks on the same device, which is what makes Megatron-style chains free of traffic.

Coordinates are kept as sorted disjoint intervals (:mod:`edatalog.ir.intervals`), exact for
composite accesses such as ``wq[(g, r, e), d]``, cheap to intersect while costing thousands of
candidate pairs, and as cheap at any extent.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from edatalog.ir.affine import Affine, Constraint, Guard, tight_box
from edatalog.ir.graph import Graph, JoinAgg
from edatalog.ir.intervals import Box as Box  # re-exported, as the names below: the interval
from edatalog.ir.intervals import box_hull as box_hull  # arithmetic of blocks lives with regions,
from edatalog.ir.intervals import box_meet as box_meet  # one copy for the solver and the backend
from edatalog.ir.intervals import box_size as box_size
from edatalog.ir.intervals import split_longest as split_longest
from edatalog.ir.regions import through as through
from edatalog.solver.plan import Split, Tile

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
_MASK_LIMIT = 1 << 22  # guards outside the closed forms are tightened point by point in blocks this small


def tighten(node: JoinAgg, ranges: Mapping[str, tuple[int, int]]) -> tuple[dict[str, tuple[int, int]], int]:
    """A block's ranges shrunk to the bounding box of the points of the node's guard inside it,
    and the number of those points.  The backend computes and skips blocks by it, the solver
    prices them by it.

    Exact, in time independent of the extents, when each conjunction's groups of connected
    variables have at most two (causal ``t <= s``, bands, ``0 <= l + k <= T - 1``...): see
    :func:`edatalog.ir.affine.tight_box`; a union takes the hull of its pieces' boxes.  Otherwise
    exact when the block's guard variables span at most ``_MASK_LIMIT`` points (it looks at each);
    beyond that the ranges stay as they are and the points are :meth:`Guard.count_bound`'s, an
    upper bound where that cannot count exactly (a block it calls empty is empty)."""
    dense = math.prod(hi - lo for lo, hi in ranges.values())
    guard = node.guard
    if guard.is_true:
        return dict(ranges), dense
    gvars = sorted(guard.vars)
    key = (id(guard), tuple(ranges[v] for v in gvars))
    cached = _TIGHTEN_CACHE.get(key)
    hit = cached[1:] if cached is not None and cached[0] is guard else None
    if hit is None:
        hit = _tighten_guard(guard, gvars, ranges)
        if len(_TIGHTEN_CACHE) > 100_000:
            _TIGHTEN_CACHE.clear()
        _TIGHTEN_CACHE[key] = (guard, *hit)
    tight, inside = hit
    others = math.prod(hi - lo for v, (lo, hi) in ranges.items() if v not in gvars)
    return {**ranges, **tight}, inside * others


def _tighten_guard(
    guard: Guard, gvars: list[str], ranges: Mapping[str, tuple[int, int]]
) -> tuple[dict[str, tuple[int, int]], int]:
    """:func:`tighten` over the guard's variables alone."""
    found = [_tighten_conj(conj.constraints, gvars, ranges) for conj in guard.conjs]
    closed = [f for f in found if f is not None]
    if len(closed) == len(found):
        boxes = [tight for tight, points in closed if points]
        if len(closed) == 1 or not boxes:
            return closed[0] if boxes else ({}, 0)
        hull = {v: (min(b[v][0] for b in boxes), max(b[v][1] for b in boxes)) for v in gvars}
        # Count the union (its pieces may overlap) over the hull, by inclusion-exclusion.
        at_hull = {v: Affine.var(v) + hull[v][0] for v in gvars}
        points, _ = guard.substitute(at_hull).count_bound({v: hull[v][1] - hull[v][0] for v in gvars})
        return hull, points
    shift = {v: Affine.var(v) + ranges[v][0] for v in gvars}
    box = {v: ranges[v][1] - ranges[v][0] for v in gvars}
    if math.prod(box.values()) > _MASK_LIMIT:  # too big to look at: no tightening, an upper bound
        return {}, guard.substitute(shift).count_bound(box)[0]
    mask = np.broadcast_to(guard.substitute(shift).mask(gvars, box), tuple(box[v] for v in gvars))
    inside = int(np.count_nonzero(mask))
    tight: dict[str, tuple[int, int]] = {}
    if inside:
        for k, v in enumerate(gvars):
            idx = np.flatnonzero(mask.any(axis=tuple(j for j in range(len(gvars)) if j != k)))
            tight[v] = (ranges[v][0] + int(idx[0]), ranges[v][0] + int(idx[-1]) + 1)
    return tight, inside


def _tighten_conj(
    constraints: tuple[Constraint, ...], gvars: list[str], ranges: Mapping[str, tuple[int, int]]
) -> tuple[dict[str, tuple[int, int]], int] | None:
    """:func:`tighten` for one conjunction over the variables ``gvars`` in closed form, or None
    when a group of its connected variables has three or more."""
    return tight_box(constraints, {v: ranges[v] for v in gvars})
