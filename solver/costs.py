"""What the solver knows about each candidate before choosing: compute and reduction time, the
layout it leaves its output in, what each device must receive, and memory footprints.

Everything here mirrors what the backend will do with the chosen plan (one block per device,
reduce-scatter of partials along the longest axis, consumers fetching exactly what they lack) and
prices it with :mod:`edatalog.solver.costmodel`, the functions the simulator's timeline uses.
The estimates differ from the timeline in two ways, both checked afterwards by simulating the
chosen plan: steps are added up rather than overlapped, and a device's footprint is the largest
over devices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from edatalog.ir import dtypes
from edatalog.ir.cost import flops_per_point
from edatalog.ir.graph import Access, Graph, JoinAgg
from edatalog.solver.blocks import (
    Box,
    Candidate,
    DeviceBlock,
    Layout,
    box_hull,
    box_meet,
    box_size,
    split_longest,
    through,
)
from edatalog.solver.costmodel import compute_seconds, transfer_seconds
from edatalog.solver.topology import Topology

Held = tuple[tuple[int, tuple[Box, ...]], ...]  # per device (sorted): the boxes of a relation it holds
Need = tuple[tuple[int, Box], ...]  # per device (sorted): the box of a relation it reads


@dataclass(frozen=True)
class _Pieces:
    boxes: list[Box]
    by: np.ndarray  # piece x device: holds it
    on_node: np.ndarray  # piece x node: some device of the node holds it
    first: np.ndarray  # piece x node: the holder that sends to that node
    array: np.ndarray | None  # piece x axis x (lo, hi) when every axis is one interval


@dataclass(frozen=True)
class Option:
    """One candidate of one node, costed."""

    cand: Candidate
    layout: Layout
    compute: float  # seconds on the busiest device
    reduce: float  # seconds to reduce-scatter partial results (0 when none)
    held: Held  # where the output is after the node (and its reduction)
    needs: tuple[tuple[Access, Need], ...]  # per distinct input access
    out_bytes: int  # the most bytes of output (partials included) one device makes
    in_bytes: dict[str, int]  # per input relation: the most bytes one device reads of it


class Costs:
    """Costs for every node's candidates on one machine."""

    def __init__(self, graph: Graph, topology: Topology) -> None:
        self.graph, self.topo = graph, topology
        self._pairs: dict[tuple[int, int, int], tuple[Held, Need, float]] = {}
        self._held: dict[int, tuple[Held, _Pieces]] = {}
        self._needs: dict[int, tuple[Need, np.ndarray, np.ndarray | None]] = {}
        self._node_of = np.array([d.node for d in topology.devices], dtype=np.int64)

    def itemsize(self, relation: str) -> int:
        return dtypes.itemsize(self.graph.relation(relation).dtype)

    def option(self, node: JoinAgg, layout: Layout) -> Option:
        blocks = layout.per_device
        out_item = dtypes.itemsize(node.dtype)
        accesses = tuple(dict.fromkeys(node.inputs))
        per_device: dict[int, float] = {}
        needs: dict[Access, dict[int, Box]] = {a: {} for a in accesses}
        out_boxes: dict[int, list[Box]] = {}
        in_bytes: dict[str, int] = {}
        made: dict[int, int] = {}  # output bytes per device
        fpp = flops_per_point(node)
        for b in blocks:
            out = through(node.out_axes, b.ranges)
            out_boxes.setdefault(b.device, []).append(out)
            nbytes = box_size(out) * out_item
            made[b.device] = made.get(b.device, 0) + nbytes
            for acc in accesses:
                need = through(acc.axes, b.ranges)
                nbytes += box_size(need) * self.itemsize(acc.relation)
                have = needs[acc].get(b.device)
                needs[acc][b.device] = need if have is None else box_hull(have, need)
            dev = self.topo.devices[b.device]
            per_device[b.device] = per_device.get(b.device, 0.0) + compute_seconds(
                b.points * fpp, nbytes, dev, self.topo
            )
        for acc in accesses:
            size = max((box_size(n) for n in needs[acc].values()), default=0) * self.itemsize(acc.relation)
            in_bytes[acc.relation] = max(in_bytes.get(acc.relation, 0), size)
        compute = max(per_device.values(), default=0.0)
        held, reduce = self._finish(node, layout, out_boxes, out_item)
        return Option(
            layout.cand,
            layout,
            compute,
            reduce,
            held,
            tuple((a, tuple(sorted(needs[a].items()))) for a in accesses),
            max(made.values(), default=0),
            in_bytes,
        )

    def _finish(self, node: JoinAgg, layout: Layout, out_boxes: dict[int, list[Box]], item: int) -> tuple[Held, float]:
        """Where the output ends, and the time to reduce partials: blocks that differ only in
        aggregated indices write the same cells; partials on one device are combined there, and
        the devices holding them reduce-scatter the rest."""
        agg = set(node.agg_indices)
        per = dict(zip((i.name for i in node.indices), layout.splits, strict=True))
        split_agg = any(per[i].parts > 1 for i in agg)
        if not split_agg or node.aggop == "=":
            return tuple((d, tuple(boxes)) for d, boxes in sorted(out_boxes.items())), 0.0
        groups: dict[tuple[tuple[str, tuple[int, int]], ...], list[DeviceBlock]] = {}
        for b in layout.per_device:
            if b.copy == 0:
                key = tuple((k, v) for k, v in sorted(b.ranges.items()) if k not in agg)
                groups.setdefault(key, []).append(b)
        held: dict[int, list[Box]] = {}
        busy: dict[int, float] = {}
        for members in groups.values():
            owners = sorted({b.device for b in members})
            box = through(node.out_axes, members[0].ranges)
            local = len(members) - len(owners)  # partials folded on their own device first
            if local:
                nbytes = box_size(box) * item
                for d in owners:
                    busy[d] = busy.get(d, 0.0) + compute_seconds(
                        box_size(box), 3 * nbytes, self.topo.devices[d], self.topo
                    )
            if len(owners) == 1:
                held.setdefault(owners[0], []).append(box)
                continue
            for owner, piece in zip(owners, split_longest(box, len(owners), layout.cand.reduce_axis), strict=False):
                held.setdefault(owner, []).append(piece)
                nbytes = box_size(piece) * item
                recv = sum(transfer_seconds(nbytes, self.topo.link(src, owner)) for src in owners if src != owner)
                combine = compute_seconds(
                    box_size(piece), nbytes * (len(owners) + 1), self.topo.devices[owner], self.topo
                )
                busy[owner] = busy.get(owner, 0.0) + recv + combine
        return tuple((d, tuple(bs)) for d, bs in sorted(held.items())), max(busy.values(), default=0.0)

    def transfer(self, relation: str, held: Held, need: Need) -> float:
        """Seconds to bring every device what it needs of ``relation`` and lacks: the busiest
        receiving or sending port, latency per source included."""
        key = (self.itemsize(relation), id(held), id(need))  # layouts are big: hashing them is slow
        hit = self._pairs.get(key)
        if hit is None or hit[0] is not held or hit[1] is not need:
            hit = (held, need, self._transfer(key[0], self._pieces(held), need))
            self._pairs[key] = hit
        return hit[2]

    def _pieces(self, held: Held) -> _Pieces:
        """The distinct boxes of a layout as arrays, with who holds them (cached per layout)."""
        hit = self._held.get(id(held))
        if hit is not None and hit[0] is held:
            return hit[1]
        holders: dict[Box, list[int]] = {}
        for d, boxes in held:
            for box in boxes:
                holders.setdefault(box, []).append(d)
        n, nodes = self.topo.n, len(self.topo.nodes)
        distinct = list(holders)
        by = np.zeros((len(distinct), n), dtype=bool)
        on_node = np.zeros((len(distinct), nodes), dtype=bool)
        first = np.zeros((len(distinct), nodes), dtype=np.int64)  # a holder on each node, else any
        for j, box in enumerate(distinct):
            devs = sorted(holders[box])
            by[j, devs] = True
            for node in range(nodes):
                near = [d for d in devs if self._node_of[d] == node]
                on_node[j, node] = bool(near)
                first[j, node] = (near or devs)[0]
        pieces = _Pieces(distinct, by, on_node, first, _as_array(distinct))
        self._held[id(held)] = (held, pieces)
        return pieces

    def _need(self, need: Need) -> tuple[np.ndarray, np.ndarray | None]:
        hit = self._needs.get(id(need))
        if hit is None or hit[0] is not need:
            hit = (need, np.array([d for d, _ in need], dtype=np.int64), _as_array([b for _, b in need]))
            self._needs[id(need)] = hit
        return hit[1], hit[2]

    def _transfer(self, item: int, pieces: _Pieces, need: Need) -> float:
        if not pieces.boxes or not need:
            return 0.0  # nothing is held (no block has a point) or nothing is needed
        devs, wants = self._need(need)
        if wants is not None and pieces.array is not None:  # need device x piece: cells in both
            lo = np.maximum(wants[:, None, :, 0], pieces.array[None, :, :, 0])
            hi = np.minimum(wants[:, None, :, 1], pieces.array[None, :, :, 1])
            overlap = np.clip(hi - lo, 0, None).prod(axis=2)
        else:
            overlap = _overlaps([box for _, box in need], pieces.boxes)
        fetch = (overlap > 0) & ~pieces.by[:, devs].T
        if not fetch.any():
            return 0.0
        intra, inter = self.topo.intra, self.topo.inter or self.topo.intra
        nodes = self._node_of[devs]
        near = pieces.on_node[:, nodes].T  # need device x piece: a holder on the same node
        latency = np.where(near, intra.latency, inter.latency)
        bandwidth = np.where(near, intra.bandwidth, inter.bandwidth)
        seconds = np.where(fetch, latency + overlap * item / bandwidth, 0.0)
        sent = np.zeros(self.topo.n)
        np.add.at(sent, pieces.first[:, nodes].T[fetch], seconds[fetch])
        return float(max(seconds.sum(axis=1).max(), sent.max()))

    @cached_property
    def replicated_need(self) -> dict[str, Need]:
        """The need of an output that must end whole on every device."""
        out = {}
        for name in self.graph.outputs:
            rel = self.graph.relation(name)
            box: Box = tuple(((0, n),) for n in rel.shape)
            out[name] = tuple((d, box) for d in range(self.topo.n))
        return out


def _as_array(boxes: list[Box]) -> np.ndarray | None:
    """Boxes as a (box, axis, lo/hi) array, when every axis of every box is one interval."""
    if not all(len(ax) == 1 for b in boxes for ax in b):
        return None
    rank = len(boxes[0]) if boxes else 0
    return np.array([[ax[0] for ax in b] for b in boxes], dtype=np.int64).reshape(len(boxes), rank, 2)


def _overlaps(wants: list[Box], pieces: list[Box]) -> np.ndarray:
    """Cells in both, for every (want, piece) pair: vectorized when every axis is one interval."""
    if all(len(ax) == 1 for b in (*wants, *pieces) for ax in b):
        rank = len(wants[0]) if wants else 0
        a = np.array([[ax[0] for ax in b] for b in wants], dtype=np.int64).reshape(len(wants), rank, 2)
        b = np.array([[ax[0] for ax in b] for b in pieces], dtype=np.int64).reshape(len(pieces), rank, 2)
        lo = np.maximum(a[:, None, :, 0], b[None, :, :, 0])
        hi = np.minimum(a[:, None, :, 1], b[None, :, :, 1])
        return np.clip(hi - lo, 0, None).prod(axis=2)
    return np.array([[box_meet(w, p) for p in pieces] for w in wants], dtype=np.int64).reshape(len(wants), len(pieces))


def need_bytes(need: Need, item: int) -> int:
    """The most bytes one device reads."""
    return max((box_size(b) for _, b in need), default=0) * item


def held_bytes(held: Held, item: int) -> int:
    return max((sum(box_size(b) for b in boxes) for _, boxes in held), default=0) * item


def least_bytes(graph: Graph, n: int) -> tuple[int, list[tuple[str, int]]]:
    """A floor on any plan's memory per device: every input and param split ``n`` ways (none
    can be smaller), with the relations that dominate it."""
    sizes = [(r.name, math.ceil(r.nbytes / n)) for r in graph.relations if r.kind != "derived"]
    sizes.sort(key=lambda kv: -kv[1])
    return sum(s for _, s in sizes), sizes
