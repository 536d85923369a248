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
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from edatalog.ir import dtypes
from edatalog.ir.cost import flops_per_point
from edatalog.ir.graph import Access, Graph, JoinAgg
from edatalog.solver.blocks import Box, Candidate, Layout, box_meet, box_size, split_longest, through
from edatalog.solver.costmodel import compute_seconds, transfer_seconds
from edatalog.solver.topology import Topology

Held = tuple[tuple[int, tuple[Box, ...]], ...]  # per device (sorted): the boxes of a relation it holds
Need = tuple[tuple[int, Box], ...]  # per device (sorted): the box of a relation it reads


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
        self._pairs: dict[tuple[int, Held, Need], float] = {}

    def itemsize(self, relation: str) -> int:
        return dtypes.itemsize(self.graph.relation(relation).dtype)

    def option(self, node: JoinAgg, layout: Layout) -> Option:
        blocks = layout.per_device
        out_item = dtypes.itemsize(node.dtype)
        accesses = tuple(dict.fromkeys(node.inputs))
        per_device: dict[int, float] = {}
        needs: dict[Access, dict[int, Box]] = {a: {} for a in accesses}
        out_boxes: dict[int, Box] = {}
        in_bytes: dict[str, int] = {}
        out_bytes = 0
        fpp = flops_per_point(node)
        for b in blocks:
            out = through(node.out_axes, b.ranges)
            out_boxes[b.device] = out
            nbytes = box_size(out) * out_item
            out_bytes = max(out_bytes, box_size(out) * out_item)
            for acc in accesses:
                need = through(acc.axes, b.ranges)
                needs[acc][b.device] = need
                size = box_size(need) * self.itemsize(acc.relation)
                nbytes += size
                in_bytes[acc.relation] = max(in_bytes.get(acc.relation, 0), size)
            dev = self.topo.devices[b.device]
            per_device[b.device] = per_device.get(b.device, 0.0) + compute_seconds(
                b.points * fpp, nbytes, dev, self.topo
            )
        compute = max(per_device.values(), default=0.0)
        held, reduce = self._finish(node, layout, out_boxes, out_item)
        return Option(
            layout.cand,
            layout,
            compute,
            reduce,
            held,
            tuple((a, tuple(sorted(needs[a].items()))) for a in accesses),
            out_bytes,
            in_bytes,
        )

    def _finish(self, node: JoinAgg, layout: Layout, out_boxes: dict[int, Box], item: int) -> tuple[Held, float]:
        """Where the output ends, and the time to reduce partials: blocks that differ only in
        aggregated indices write the same cells, and their first holders reduce-scatter them."""
        agg = set(node.agg_indices)
        split_agg = any(p > 1 for i, p in zip(node.indices, layout.cand.parts, strict=True) if i.name in agg)
        if not split_agg or node.aggop == "=":
            return tuple((d, (box,)) for d, box in sorted(out_boxes.items())), 0.0
        groups: dict[tuple[tuple[str, tuple[int, int]], ...], list[int]] = {}
        for b in layout.per_device:
            if b.copy == 0:
                key = tuple((k, v) for k, v in sorted(b.ranges.items()) if k not in agg)
                groups.setdefault(key, []).append(b.device)
        held: dict[int, tuple[Box, ...]] = {}
        slowest = 0.0
        for devices in groups.values():
            owners = sorted(devices)
            box = out_boxes[owners[0]]
            pieces = split_longest(box, len(owners))
            for owner, piece in zip(owners, pieces, strict=False):
                held[owner] = (piece,)
                nbytes = box_size(piece) * item
                recv = sum(transfer_seconds(nbytes, self.topo.link(src, owner)) for src in owners if src != owner)
                combine = compute_seconds(
                    box_size(piece), nbytes * (len(owners) + 1), self.topo.devices[owner], self.topo
                )
                slowest = max(slowest, recv + combine)
        return tuple(sorted(held.items())), slowest

    def transfer(self, relation: str, held: Held, need: Need) -> float:
        """Seconds to bring every device what it needs of ``relation`` and lacks: the busiest
        receiving or sending port, latency per source included."""
        key = (self.itemsize(relation), held, need)
        hit = self._pairs.get(key)
        if hit is None:
            hit = self._pairs[key] = self._transfer(key[0], held, need)
        return hit

    def _transfer(self, item: int, held: Held, need: Need) -> float:
        holders: dict[Box, list[int]] = {}
        for d, boxes in held:
            for box in boxes:
                holders.setdefault(box, []).append(d)
        pieces = list(holders)
        wants = [box for _, box in need]
        overlap = _overlaps(wants, pieces)  # need device x piece: cells in both
        n = self.topo.n
        mine = np.zeros(overlap.shape, dtype=bool)
        for j, box in enumerate(pieces):
            for k, (d, _) in enumerate(need):
                mine[k, j] = d in holders[box]
        fetch = (overlap > 0) & ~mine
        if not fetch.any():
            return 0.0
        node_of = np.array([dev.node for dev in self.topo.devices])
        intra, inter = self.topo.intra, self.topo.inter or self.topo.intra
        sent = np.zeros(n)
        worst = 0.0
        for k, (d, _) in enumerate(need):
            seconds = 0.0
            for j in np.flatnonzero(fetch[k]).tolist():
                devs = holders[pieces[j]]
                near = [s for s in devs if node_of[s] == node_of[d]]
                link = intra if near else inter
                t = link.latency + float(overlap[k, j]) * item / link.bandwidth
                seconds += t
                sent[(near or devs)[0]] += t
            worst = max(worst, seconds)
        return max(worst, float(sent.max()))

    @cached_property
    def replicated_need(self) -> dict[str, Need]:
        """The need of an output that must end whole on every device."""
        out = {}
        for name in self.graph.outputs:
            rel = self.graph.relation(name)
            box: Box = tuple(((0, n),) for n in rel.shape)
            out[name] = tuple((d, box) for d in range(self.topo.n))
        return out


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


def ranges_of(layout: Layout) -> Mapping[int, Mapping[str, tuple[int, int]]]:
    return {b.device: b.ranges for b in layout.per_device}
