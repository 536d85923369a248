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
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from edatalog.ir import dtypes
from edatalog.ir.attention import attention_chains, key_index
from edatalog.ir.attention_backward import attention_backwards
from edatalog.ir.cost import (
    ONE_ATTENTION,
    GemmRoles,
    flops_per_point,
    gemm_roles,
    gemm_shape,
    launches,
    routed_share,
)
from edatalog.ir.forms import route_choices, route_lookup, route_rows, routed_form, routed_gemm, routed_parts_only
from edatalog.ir.graph import Access, AxisMap, Graph, JoinAgg
from edatalog.ir.program import CollectiveKind
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
from edatalog.solver.costmodel import (
    compute_seconds,
    group_collective_seconds,
    port_seconds,
    tiled_points,
    transfer_seconds,
)
from edatalog.solver.topology import Topology

Held = tuple[tuple[int, tuple[Box, ...]], ...]  # per device (sorted): the boxes of a relation it holds
Need = tuple[tuple[int, Box], ...]  # per device (sorted): the box of a relation it reads


@dataclass(frozen=True)
class _Pieces:
    boxes: list[Box]
    by: np.ndarray  # piece x device: holds it
    on_node: np.ndarray  # piece x node: some device of the node holds it
    senders: np.ndarray  # piece x node x k: the holders that send to that node (the node's own first), cycled
    count: np.ndarray  # piece x node: how many of ``senders`` there are
    array: np.ndarray | None  # piece x axis x interval x (lo, hi) (see _as_array), None when too many


@dataclass(frozen=True)
class Option:
    """One candidate of one node, costed."""

    cand: Candidate
    layout: Layout
    compute: float  # seconds on the busiest device
    reduce: float  # seconds to reduce-scatter partial results (0 when none)
    held: Held  # where the output is after the node (and its reduction)
    needs: tuple[tuple[Access, Need], ...]  # per distinct input access
    # Per need: the share of its rows that travel (1.0 but for a block over part of a routed
    # index, which reads a row only where the route sends it there; see ``routed_shares``).
    shares: tuple[float, ...]
    out_bytes: int  # the most bytes of output (partials included) one device makes
    in_bytes: dict[str, int]  # per input relation: the most bytes one device reads of it


class Costs:
    """Costs for every node's candidates on one machine."""

    def __init__(self, graph: Graph, topology: Topology) -> None:
        self.graph, self.topo = graph, topology
        self._pairs: dict[tuple[int, int, int, float], tuple[Held, Need, float]] = {}
        self._held: dict[int, tuple[Held, _Pieces]] = {}
        self._needs: dict[int, tuple[Need, np.ndarray, np.ndarray | None]] = {}
        self._node_of = np.array([d.node for d in topology.devices], dtype=np.int64)
        # Boxes an access reaches, by (access axes, ranges of their indices); axes live as long as the graph.
        self._reached: dict[tuple[object, ...], tuple[Box, int]] = {}
        self._indices: dict[int, tuple[tuple[AxisMap, ...], tuple[str, ...]]] = {}
        self._roles: dict[str, GemmRoles | None] = {}  # per node: its GEMM roles (see gemm_roles)
        # Per rule of an attention chain: the chain's intermediates (scores, maxima,
        # probabilities, sums), which never leave the fused kernel, and the chain's first rule.
        self._fused: dict[str, frozenset[str]] = {}
        self._first: dict[str, str] = {}
        self._key: dict[str, str | None] = {}  # per rule of a chain: its key index (None: it has none)
        for chain in attention_chains(graph):
            inner = frozenset(graph.node(n).out for n in chain.inner)
            for name in chain.nodes:
                self._fused[name], self._first[name] = inner, chain.scores
                self._key[name] = None if name == chain.lse else key_index(graph, chain, name)
        # The backward of a chain is fused as well: its scores and probabilities made again and
        # the gradients of its rows, probabilities and scores stay inside the kernel.
        for bw in attention_backwards(graph):
            inner = frozenset(graph.node(n).out for n in bw.inner)
            for name in bw.nodes:
                self._fused[name], self._first[name] = inner, bw.scores
                self._key[name] = bw.key_of(graph, name)
        self._tiles: dict[tuple[object, ...], int] = {}

    def itemsize(self, relation: str) -> int:
        return dtypes.itemsize(self.graph.relation(relation).dtype)

    def option(self, node: JoinAgg, layout: Layout) -> Option:
        blocks = layout.per_device
        out_item = dtypes.itemsize(node.dtype)
        accesses = tuple(dict.fromkeys(node.inputs))
        items = [self.itemsize(a.relation) for a in accesses]
        per_device: dict[int, float] = {}
        # Per access (by position: hashing accesses is slow), each device's need.
        needs: list[dict[int, Box]] = [{} for _ in accesses]
        out_boxes: dict[int, list[Box]] = {}
        in_bytes: dict[str, int] = {}
        made: dict[int, int] = {}  # output bytes per device
        fpp = flops_per_point(node)
        if node.name not in self._roles:
            self._roles[node.name] = gemm_roles(node)
        roles = self._roles[node.name]
        kernels = launches(node)
        # A rule of an attention chain is part of one flash kernel, unless the candidate splits
        # its key index (the backend fuses only blocks that hold every key of their queries).
        fused = self._fused.get(node.name)
        key = self._key.get(node.name)
        if fused is not None and key is not None:
            k = [i.name for i in node.indices].index(key)
            cand = layout.cand
            if cand.parts[k] > 1 or (cand.chunk > 1 and k in cand.chunked):  # the keys cut: no flash kernel
                fused = None
        gathered = [bool(node.looked_up & set(acc.indices)) for acc in accesses]
        routed = routed_form(node) if node.lookups else None
        for b in blocks:
            out, size = self._reach(node.out_axes, b.ranges)
            out_boxes.setdefault(b.device, []).append(out)
            made[b.device] = made.get(b.device, 0) + size * out_item
            nbytes = 0 if fused is not None and node.out in fused else size * out_item
            # A looked-up index takes one value per point of the others: a block does a (masked)
            # gather over those, whatever part of the looked-up range it has; a routed block (a
            # grouped GEMM) computes the points routed to its experts, at the expected load.
            if routed is not None:
                points = b.points // node.lookups[routed.lookup].extent
            else:
                points = b.points // math.prod(b.ranges[v][1] - b.ranges[v][0] for v in node.looked_up)
            for k, acc in enumerate(accesses):
                need, size = self._reach(acc.axes, b.ranges)
                if fused is None or acc.relation not in fused:
                    nbytes += (min(size, points) if gathered[k] else size) * items[k]
                have = needs[k].get(b.device)
                needs[k][b.device] = need if have is None else box_hull(have, need)
            dev = self.topo.devices[b.device]
            if fused is None:
                extents = {i: hi - lo for i, (lo, hi) in b.ranges.items()}
                gemm = None
                if dev.sms and routed is not None:
                    gemm = routed_gemm(node, routed, extents)
                elif dev.sms and not node.lookups:
                    gemm = gemm_shape(roles, extents)
                seconds = compute_seconds(points * fpp, nbytes, dev, self.topo, node.dtype, gemm, launches=kernels)
            else:
                # As the backend fuses and the timeline costs it (edatalog.backend.lowering.lowered): the
                # rule's flops over the flash tiles holding a point, no bytes of the scores and
                # the other intermediates, and one attention kernel's floor, the scores rule's.
                points = self._tiled(node, b.ranges)
                first = node.name == self._first[node.name]
                seconds = compute_seconds(
                    points * fpp, nbytes, dev, self.topo, node.dtype, floor=first, launches=ONE_ATTENTION
                )
            per_device[b.device] = per_device.get(b.device, 0.0) + seconds
        for k, acc in enumerate(accesses):
            size = max((box_size(n) for n in needs[k].values()), default=0) * items[k]
            in_bytes[acc.relation] = max(in_bytes.get(acc.relation, 0), size)
        compute = max(per_device.values(), default=0.0)
        held, reduce = self._finish(node, layout, out_boxes, out_item)
        return Option(
            layout.cand,
            layout,
            compute,
            reduce,
            held,
            tuple((a, tuple(sorted(needs[k].items()))) for k, a in enumerate(accesses)),
            routed_shares(node, layout.cand, accesses),
            max(made.values(), default=0),
            in_bytes,
        )

    def _tiled(self, node: JoinAgg, ranges: dict[str, tuple[int, int]]) -> int:
        """:func:`tiled_points` of a block, cached by the guard and its variables' ranges: the
        candidates of a node share most blocks, and the rules of an attention chain share the
        guard (the other indices only multiply the count)."""
        gvars = sorted(node.guard.vars & ranges.keys())
        key = (node.guard, *(ranges[v] for v in gvars))
        hit = self._tiles.get(key)
        if hit is None:
            hit = self._tiles[key] = tiled_points(node, {v: ranges[v] for v in gvars})
        return hit * math.prod(hi - lo for v, (lo, hi) in ranges.items() if v not in gvars)

    def _reach(self, axes: tuple[AxisMap, ...], ranges: dict[str, tuple[int, int]]) -> tuple[Box, int]:
        """:func:`through` and its size, cached: candidates of a node share most block ranges."""
        names = self._indices.get(id(axes))
        if names is None or names[0] is not axes:
            names = self._indices[id(axes)] = (
                axes,
                tuple(dict.fromkeys(i for ax in axes for i in ax.indices)),
            )
        key = (id(axes), *(ranges[i] for i in names[1]))
        hit = self._reached.get(key)
        if hit is None:
            box = through(axes, ranges)
            hit = self._reached[key] = (box, box_size(box))
        return hit

    def _finish(self, node: JoinAgg, layout: Layout, out_boxes: dict[int, list[Box]], item: int) -> tuple[Held, float]:
        """Where the output ends, and the time to reduce partials: blocks that differ only in
        aggregated indices write the same cells; partials on one device are combined there, and
        the devices holding them reduce-scatter the rest."""
        agg = set(node.agg_indices)
        per = dict(zip((i.name for i in node.indices), layout.splits, strict=True))
        split_agg = any(per[i].parts > 1 for i in agg)
        split = {i for i, s in per.items() if s.parts > 1}
        if not split_agg or node.aggop == "=" or routed_parts_only(node, split):
            # (Blocks over parts of a routed index hold disjoint cells: each stays where it is.)
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
                        box_size(box), 3 * nbytes, self.topo.devices[d], self.topo, node.dtype
                    )
            if len(owners) == 1:
                held.setdefault(owners[0], []).append(box)
                continue
            pieces = split_longest(box, len(owners), layout.cand.reduce_axis)
            if CollectiveKind.REDUCE_SCATTER in self.topo.library.collectives and len(pieces) == len(owners):
                # One reduce-scatter call, its reduction fused into the transfers.
                seconds, _ = group_collective_seconds(
                    CollectiveKind.REDUCE_SCATTER, box_size(box) * item, owners, self.topo
                )
                for owner, piece in zip(owners, pieces, strict=True):
                    held.setdefault(owner, []).append(piece)
                    busy[owner] = busy.get(owner, 0.0) + seconds
                continue
            for owner, piece in zip(owners, pieces, strict=False):
                held.setdefault(owner, []).append(piece)
                nbytes = box_size(piece) * item
                links = [self.topo.link(src, owner) for src in owners if src != owner]
                recv = max(
                    sum(port_seconds(nbytes, lk) for lk in links), max(transfer_seconds(nbytes, lk) for lk in links)
                )
                combine = compute_seconds(
                    box_size(piece), nbytes * (len(owners) + 1), self.topo.devices[owner], self.topo, node.dtype
                )
                busy[owner] = busy.get(owner, 0.0) + recv + combine
        return tuple((d, tuple(bs)) for d, bs in sorted(held.items())), max(busy.values(), default=0.0)

    def transfer(self, relation: str, held: Held, need: Need, share: float = 1.0) -> float:
        """Seconds to bring every device what it needs of ``relation`` and lacks: the busiest
        receiving or sending port, latency per source included.  ``share``: the part of the
        bytes that travel (a routed reader's rows, :func:`routed_shares`)."""
        return self.transfers(relation, held, [need], [share])[0]

    def transfers(
        self, relation: str, held: Held, needs: Sequence[Need], shares: Sequence[float] | None = None
    ) -> list[float]:
        """:meth:`transfer` from one layout to each of ``needs``, computed together."""
        item = self.itemsize(relation)
        shares = shares if shares is not None else [1.0] * len(needs)
        out: list[float] = []
        todo: list[int] = []
        for k, need in enumerate(needs):
            hit = self._pairs.get((item, id(held), id(need), shares[k]))  # layouts are big: hashing them is slow
            if hit is not None and hit[0] is held and hit[1] is need:
                out.append(hit[2])
            else:
                out.append(0.0)
                todo.append(k)
        if todo:
            pieces = self._pieces(held)
            times = self._transfer(item, pieces, [needs[k] for k in todo], [shares[k] for k in todo])
            for k, seconds in zip(todo, times, strict=True):
                out[k] = seconds
                self._pairs[(item, id(held), id(needs[k]), shares[k])] = (held, needs[k], seconds)
        return out

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
        most = max((len(h) for h in holders.values()), default=1)
        senders = np.zeros((len(distinct), nodes, most), dtype=np.int64)
        count = np.ones((len(distinct), nodes), dtype=np.int64)
        for j, box in enumerate(distinct):
            devs = sorted(holders[box])
            by[j, devs] = True
            for node in range(nodes):
                near = [d for d in devs if self._node_of[d] == node]
                on_node[j, node] = bool(near)
                # The holders on the node send, each to its share of the readers (exchange
                # synthesis picks the least busy); from another node, one holder does.
                who = near or devs[:1]
                senders[j, node, : len(who)] = who
                count[j, node] = len(who)
        pieces = _Pieces(distinct, by, on_node, senders, count, _as_array(distinct))
        self._held[id(held)] = (held, pieces)
        return pieces

    def _need(self, need: Need) -> tuple[np.ndarray, np.ndarray | None]:
        hit = self._needs.get(id(need))
        if hit is None or hit[0] is not need:
            hit = (need, np.array([d for d, _ in need], dtype=np.int64), _as_array([b for _, b in need]))
            self._needs[id(need)] = hit
        return hit[1], hit[2]

    def _transfer(self, item: int, pieces: _Pieces, needs: list[Need], shares: list[float]) -> list[float]:
        out = [0.0] * len(needs)
        if not pieces.boxes:
            return out  # nothing is held (no block has a point)
        rows = [(k, *self._need(need)) for k, need in enumerate(needs) if need]
        if not rows:
            return out
        if pieces.array is not None and all(w is not None for _, _, w in rows):
            # Every need device of every need against every piece, in one array.
            arrays = [w for _, _, w in rows if w is not None]
            shape = (sum(len(w) for w in arrays), pieces.array.shape[1], max(w.shape[2] for w in arrays), 2)
            wants = np.zeros(shape, dtype=np.int64)
            at = 0
            for w in arrays:  # padded with empty intervals
                wants[at : at + len(w), :, : w.shape[2]] = w
                at += len(w)
            overlap = _meet_arrays(wants, pieces.array)
        else:
            overlap = np.concatenate([_overlaps([box for _, box in needs[k]], pieces.boxes) for k, _, _ in rows])
        devs = np.concatenate([d for _, d, _ in rows])
        which = np.repeat(np.arange(len(rows)), [len(d) for _, d, _ in rows])  # need device -> its row
        fetch = (overlap > 0) & ~pieces.by[:, devs].T
        if not fetch.any():
            return out
        intra, inter = self.topo.intra, self.topo.inter or self.topo.intra
        nodes = self._node_of[devs]
        near = pieces.on_node[:, nodes].T  # need device x piece: a holder on the same node
        latency = np.where(near, intra.latency, inter.latency)
        nbytes = overlap * item * np.array([shares[k] for k, _, _ in rows])[which][:, None]
        # Each transfer holds both ports (at the port's rate) and its pair (at the pair's rate).
        port = np.where(fetch, latency + nbytes / np.where(near, intra.bandwidth, inter.bandwidth), 0.0)
        pair = np.where(fetch, latency + nbytes / np.where(near, intra.pair_bandwidth, inter.pair_bandwidth), 0.0)
        row, piece = np.nonzero(fetch)
        # The k-th reader of a piece (within one need) takes its k-th sender, cycling.
        order = np.lexsort((row, piece, which[row]))
        group = which[row][order] * len(pieces.boxes) + piece[order]
        starts = np.r_[0, np.flatnonzero(np.diff(group)) + 1]
        rank = np.empty(len(order), dtype=np.int64)
        rank[order] = np.arange(len(order)) - np.repeat(starts, np.diff(np.r_[starts, len(order)]))
        count = pieces.count[piece, nodes[row]]
        source = pieces.senders[piece, nodes[row], rank % count]
        pairs = np.zeros((len(devs), self.topo.n))  # need device x source: the pair's time
        np.add.at(pairs, (row, source), pair[row, piece])
        received = np.zeros(len(rows))
        np.maximum.at(received, which, np.maximum(port.sum(axis=1), pairs.max(axis=1)))
        sent = np.zeros((len(rows), self.topo.n))
        np.add.at(sent, (which[row], source), port[row, piece])
        for r, (k, _, _) in enumerate(rows):
            out[k] = float(max(received[r], sent[r].max()))
        return out

    @cached_property
    def replicated_need(self) -> dict[str, Need]:
        """The need of an output that must end whole on every device."""
        out = {}
        for name in self.graph.outputs:
            rel = self.graph.relation(name)
            box: Box = tuple(((0, n),) for n in rel.shape)
            out[name] = tuple((d, box) for d in range(self.topo.n))
        return out


MOST_INTERVALS = 8  # per axis, for the vectorized overlap; boxes with more take the slow path


def _as_array(boxes: list[Box]) -> np.ndarray | None:
    """Boxes as a (box, axis, interval, lo/hi) array, each axis's intervals padded with empty
    ones, when no axis has more than :data:`MOST_INTERVALS` (zigzag splits have two)."""
    if not boxes:
        return None
    most = max((len(ax) for b in boxes for ax in b), default=1)
    if most > MOST_INTERVALS:
        return None
    rank = len(boxes[0])
    out = np.zeros((len(boxes), rank, max(most, 1), 2), dtype=np.int64)
    for k, b in enumerate(boxes):
        for j, ax in enumerate(b):
            if ax:
                out[k, j, : len(ax)] = ax
    return out


def _meet_arrays(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cells in both, for every pair of boxes of :func:`_as_array` arrays ``a`` and ``b``."""
    lo = np.maximum(a[:, None, :, :, None, 0], b[None, :, :, None, :, 0])
    hi = np.minimum(a[:, None, :, :, None, 1], b[None, :, :, None, :, 1])
    return np.clip(hi - lo, 0, None).sum(axis=(3, 4)).prod(axis=2)


def _overlaps(wants: list[Box], pieces: list[Box]) -> np.ndarray:
    """Cells in both, for every (want, piece) pair: vectorized unless an axis has many intervals."""
    a, b = _as_array(wants), _as_array(pieces)
    if a is not None and b is not None:
        return _meet_arrays(a, b)
    return np.array([[box_meet(w, p) for p in pieces] for w in wants], dtype=np.int64).reshape(len(wants), len(pieces))


def routed_shares(node: JoinAgg, cand: Candidate, accesses: Sequence[Access]) -> tuple[float, ...]:
    """Per input access of a candidate: the expected share of the rows it needs that travel
    (1.0 for all but the inputs a block over part of a routed index reads by their rows; see
    :class:`edatalog.ir.program.Select`): exchange synthesis sends a token's row only to the
    devices of its experts, at the expected load (uniform routing)."""
    lk = route_lookup(node) if node.lookups else None
    if lk is None:
        return (1.0,) * len(accesses)
    parts = cand.parts[[i.name for i in node.indices].index(lk.index)]
    if parts <= 1:
        return (1.0,) * len(accesses)
    route = node.inputs[lk.input]
    out = []
    for acc in accesses:
        along = None if acc.relation == route.relation else route_rows(node, lk, acc.axes)
        if along is None:
            out.append(1.0)
            continue
        out.append(routed_share(lk.extent, -(-lk.extent // parts), route_choices(node, lk, along)))
    return tuple(out)


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
