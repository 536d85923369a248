"""Exchange synthesis: from a graph, a plan and a topology to the per-device programs that
execute it (:mod:`edatalog.ir.program`), with what each op costs beside them.

Every consumer block pulls, for each relation it reads, the intersection of its need with every
piece of that relation's final layout; a device never receives what it holds or already received.
Partials (an aggregated index split across blocks, or several ``+=`` rules) are reduced on a
schedule chosen from the topology: a reduce-scatter with direct sends inside a node, and a
hierarchical one (inside nodes first, then across) when the partials span nodes and run as
messages.  Blocks that guards or supports leave empty are never computed or sent.

The pass first builds one global list of tasks in an order that respects every dependency, then
lowers it (:func:`_lower`): each device's ops in that order, every transfer a send on its source
and a receive on its destination at the same place, and a ``Free`` after each buffer's last
reader.  Because every receive follows its send in one global order, no device can wait for
another forever.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from edatalog.backend.kernels.prepared import general_path
from edatalog.backend.lowering.instances import InstanceCopier
from edatalog.backend.lowering.tasks import (
    Buffer,
    Combine,
    Compute,
    Entry,
    Load,
    Routed,
    RoutedRows,
    Selection,
    Send,
    Task,
)
from edatalog.errors import EdlError
from edatalog.ir import dtypes
from edatalog.ir import program as ir
from edatalog.ir.cost import flops_per_point, gemm_roles, gemm_shape, launches
from edatalog.ir.forms import (
    route_choices,
    route_key,
    route_lookup,
    route_rows,
    routed_form,
    routed_gemm,
    routed_parts_only,
)
from edatalog.ir.graph import Graph, JoinAgg
from edatalog.ir.intervals import atoms
from edatalog.ir.program import OpCost
from edatalog.ir.program import Programs as ProgramsIR
from edatalog.ir.regions import Region
from edatalog.ir.rewrite import restrict
from edatalog.solver.blocks import tighten
from edatalog.solver.plan import Plan, Tile
from edatalog.solver.topology import Topology

REDUCTIONS = ("auto", "direct", "hierarchical")


@dataclass(eq=False)
class Schedule:
    """What synthesis makes of a plan: the device programs, what their ops cost, where every
    relation lives when it is complete, where each output ends, and which blocks of each rule
    are computed (the others are empty)."""

    graph: Graph
    plan: Plan
    topology: Topology
    programs: ProgramsIR
    costs: dict[tuple[int, int], OpCost]  # (device, position) -> what the op costs
    layout: dict[str, list[Entry]]  # where every relation lives when it is complete
    outputs: dict[str, list[Entry]]  # where each output ends
    blocks: dict[str, set[int]]  # rule -> its computed blocks

    def kernels(self, node: str) -> Iterator[tuple[int, ir.Kernel]]:
        """The kernels of one rule, with their devices (one per computed block and holder)."""
        for device, _, op in self.programs.ops():
            if isinstance(op, ir.Kernel) and op.node == node:
                yield device, op


def synthesize(
    graph: Graph,
    plan: Plan,
    topology: Topology,
    reduction: str = "auto",
    collectives: frozenset[ir.CollectiveKind] = frozenset(),
) -> Schedule:
    """The per-device task programs that execute ``graph`` under ``plan`` on ``topology``.
    ``collectives``: the kinds the lowering will run as one collective call (which form of
    reduction ``auto`` picks depends on them)."""
    plan.verify(graph)
    if topology.n < plan.n_devices:
        raise EdlError(f"the plan uses {plan.n_devices} devices but {topology.name} has {topology.n}")
    return _Synthesizer(graph, plan, topology, reduction, collectives).run()


class _Synthesizer:
    def __init__(
        self,
        graph: Graph,
        plan: Plan,
        topology: Topology,
        reduction: str,
        collectives: frozenset[ir.CollectiveKind] = frozenset(),
    ) -> None:
        assert reduction in REDUCTIONS
        self.collectives = collectives
        self.layout: dict[str, list[Entry]] = {}
        self.outputs: dict[str, list[Entry]] = {}
        self.blocks: dict[str, set[int]] = {}
        self.tasks: list[Task] = []
        self.buffers: dict[int, Buffer] = {}
        self.graph, self.plan, self.topo, self.reduction = graph, plan, topology, reduction
        # What each device received of each piece of a final layout: (region, buffer), disjoint;
        # apart, what it received of a piece's routed rows only (see ``_send``).
        self.received: dict[tuple[int, Entry, RoutedRows | None], list[tuple[Region, int]]] = {}
        self.egress = [0] * topology.n  # bytes each device has sent, to spread replicated sources
        self.bounds: dict[str, tuple[list[Entry], np.ndarray, np.ndarray]] = {}  # per layout: piece boxes

    # -- bookkeeping ---------------------------------------------------------------------------

    def _add(self, task: Task, relation: str | None = None, region: Region | None = None) -> int:
        self.tasks.append(task)
        if relation is not None and region is not None:
            dev = task.dst if isinstance(task, Send) else task.device
            self.buffers[task.id] = Buffer(task.id, dev, relation, region)
        return task.id

    def _itemsize(self, relation: str) -> int:
        return dtypes.itemsize(self.graph.relation(relation).dtype)

    # -- the pass ---------------------------------------------------------------------------------

    def run(self) -> Schedule:
        for p in self.plan.inputs:
            self.layout[p.relation] = self._load(p.relation, p.tile)
        remaining = {r.name: len(self.graph.producers(r.name)) for r in self.graph.relations if r.kind == "derived"}
        contributions: dict[str, list[Entry]] = {}
        copier = InstanceCopier.of(self.graph, self.plan)
        layer = _layers(self.graph)
        group: tuple[str, int] | None = None
        nodes = self.graph.nodes
        at = 0
        while at < len(nodes):
            node = nodes[at]
            k = copier.instance_of(node.name) if copier is not None else None
            if at == 0 or layer.get(node.name) != group:
                # Replicated pieces are spread over their holders within each layer (and within
                # the rest of the program): every layer then sends alike, and layers are copies.
                self.egress = [0] * self.topo.n
                group = layer.get(node.name)
                if copier is not None and k is not None:
                    copier.begin(k, len(self.tasks))
                    if copier.copyable(k):
                        copier.copy(self, k)
                        at += len(copier.rep.nodes)
                        continue
            contributions.setdefault(node.out, []).extend(self._node(node))
            remaining[node.out] -= 1
            if remaining[node.out] == 0:
                self.layout[node.out] = self._finalize(node.out, contributions.pop(node.out))
            at += 1
            if copier is not None and k is not None and (at == len(nodes) or copier.instance_of(nodes[at].name) != k):
                copier.end(self, k, len(self.tasks))
        for p in self.plan.outputs:
            self.outputs[p.relation] = self._place(p.relation, p.tile)
        for name in self.graph.outputs:
            self.outputs.setdefault(name, self.layout[name])
        programs, costs = _lower(self.graph, self.tasks, self.outputs, self.plan.n_devices)
        return Schedule(self.graph, self.plan, self.topo, programs, costs, self.layout, self.outputs, self.blocks)

    def _load(self, relation: str, tile: Tile) -> list[Entry]:
        rel = self.graph.relation(relation)
        entries = []
        for block in tile.blocks():
            region = Region.of_box(rel.shape, tuple(block.ranges[a] for a in rel.axis_names))
            holders = {}
            for d in block.devices:
                task = Load(len(self.tasks), d, [], relation, region, region.size * self._itemsize(relation))
                holders[d] = self._add(task, relation, region)
            entries.append(Entry(region, holders))
        return entries

    def _node(self, node: JoinAgg) -> list[Entry]:
        tile = self.plan.node(node.name).tile
        out_item = dtypes.itemsize(node.dtype)
        entries = []
        for block in tile.blocks():
            ranges, points = tighten(node, block.ranges)
            if points == 0:
                continue  # guards and supports leave this block empty: nothing to compute or send
            out = Region.through(node.out_axes, ranges)
            # A looked-up index takes one value per point of the others: the block gathers over
            # those, and over part of the index's range only some of its cells get a value.
            chosen = math.prod(ranges[lk.index][1] - ranges[lk.index][0] for lk in node.lookups)
            routed = routed_form(node) if node.lookups else None
            # A routed block (a grouped GEMM) computes the points routed to its experts: priced
            # at the expected load, as the solver prices it.
            work = points // node.lookups[routed.lookup].extent if routed is not None else points // chosen
            part = any(ranges[lk.index] != (0, lk.extent) for lk in node.lookups)
            routes = self._routes(node, ranges)
            rows = self._rows(node, ranges)
            # The routing relation first: a routed block's other inputs travel by its rows.
            order = sorted(range(len(node.inputs)), key=lambda k: rows[k] is not None)
            holders = {}
            for d in block.devices:
                deps: list[int] = []
                reads: list[list[tuple[int, Region]]] = [[] for _ in node.inputs]
                nbytes = out.size * out_item
                for k in order:
                    acc = node.inputs[k]
                    need = Region.through(acc.axes, ranges)
                    parts = self._fetch(acc.relation, need, d, routes[k], rows[k])
                    reads[k] = [(buf, region) for buf, region in parts]
                    deps.extend(self.buffers[buf].task for buf, _ in parts)
                    size = min(need.size, points // chosen) if node.looked_up & set(acc.indices) else need.size
                    nbytes += size * self._itemsize(acc.relation)
                task = Compute(
                    len(self.tasks),
                    d,
                    sorted(set(deps)),
                    node.name,
                    block.index,
                    ranges,
                    reads,
                    out,
                    work * flops_per_point(node),
                    nbytes,
                    points == math.prod(hi - lo for lo, hi in ranges.values()) and not part,
                )
                holders[d] = self._add(task, node.out, out)
            entries.append(Entry(out, holders, routes[-1], rows[-1]))
            self.blocks.setdefault(node.name, set()).add(block.index)
        return entries

    @staticmethod
    def _routes(node: JoinAgg, ranges: Mapping[str, tuple[int, int]]) -> list[Routed | None]:
        """Per input of a block, then for its head: the part of a routed index the block's points
        are limited to, where the block holds part of it (see
        :func:`edatalog.ir.forms.route_lookup`).  An input's limits which of its pieces the block
        reads: a piece routed to other experts has no cell it reads.  The head's mark the block's
        cells, so that readers routed alike take only their own experts' pieces."""
        lk = route_lookup(node)
        if lk is None or ranges[lk.index] == (0, lk.extent):
            return [None] * (len(node.inputs) + 1)
        lo, hi = ranges[lk.index]
        out: list[Routed | None] = []
        for axes in (*(acc.axes for acc in node.inputs), node.out_axes):
            key = route_key(node, lk, axes)
            out.append(None if key is None else Routed(key, lo, hi))
        return out

    @staticmethod
    def _rows(node: JoinAgg, ranges: Mapping[str, tuple[int, int]]) -> list[RoutedRows | None]:
        """Per input of a block, then for its head: the rows it reads (writes) where the block
        holds part of a routed index (None: all rows), so that only those travel to it (from
        it).  The routing relation itself is read whole."""
        lk = route_lookup(node)
        if lk is None or ranges[lk.index] == (0, lk.extent):
            return [None] * (len(node.inputs) + 1)
        lo, hi = ranges[lk.index]
        route = node.inputs[lk.input].relation
        out: list[RoutedRows | None] = []
        for k, axes in enumerate((*(acc.axes for acc in node.inputs), node.out_axes)):
            along = None if k == lk.input else route_rows(node, lk, axes)
            rows = (
                None if along is None else RoutedRows(route, along, lo, hi, lk.extent, route_choices(node, lk, along))
            )
            out.append(rows)
        return out

    # -- moving data ---------------------------------------------------------------------------------

    def _fetch(
        self, relation: str, need: Region, d: int, routed: Routed | None = None, rows: RoutedRows | None = None
    ) -> list[tuple[int, Region]]:
        """Buffers on device ``d`` that cover ``need`` (where the relation has cells), sending the
        missing parts from their holders; with ``routed``, only pieces whose cells can be routed
        to that part (the others hold nothing the reader reads); with ``rows``, only those rows
        travel (the reader reads no other)."""
        return [(buf, part) for _, buf, part in self._pieces(relation, need, d, routed, rows)]

    def _pieces(
        self, relation: str, need: Region, d: int, routed: Routed | None = None, rows: RoutedRows | None = None
    ) -> list[tuple[Entry, int, Region]]:
        """As :meth:`_fetch`, with the piece of the layout each part comes from."""
        parts = []
        for entry in self._near(relation, need):
            part = entry.region.intersect(need)
            if part.empty or (routed is not None and entry.routed is not None and not entry.routed.meets(routed)):
                continue
            if d in entry.holders:
                parts.append((entry, entry.holders[d], part))
                continue
            # Reuse what ``d`` received of this very piece, and send only the cells still missing:
            # a part that merely overlaps an earlier one must not bring its cells again.  Keyed by
            # piece, not relation: the pieces of a relation with several '=' rules can overlap, each
            # present only on its own cells, so another piece's copy may lack this one's cells.
            # Rows sent for a routed reader are kept apart: they serve readers routed alike only.
            received = self.received.setdefault((d, entry, rows), [])
            missing = [part]
            for region, buf in received:
                overlap = region.intersect(part)
                if not overlap.empty:
                    parts.append((entry, buf, overlap))
                    missing = [rest for m in missing for rest in m.minus(region)]
            for m in missing:
                buf = self._send(relation, m, entry.holders, d, rows)
                received.append((m, buf))
                parts.append((entry, buf, m))
        return parts

    def _near(self, relation: str, need: Region) -> list[Entry]:
        """The pieces of a relation's layout whose bounding boxes meet ``need``'s, in layout
        order: a cheap filter before exact intersection (layouts of pipelined plans have
        hundreds of pieces, and every block of every reader asks)."""
        layout = self.layout[relation]
        if len(layout) < 8 or not need.axes or need.empty:
            return layout
        hit = self.bounds.get(relation)
        if hit is None or hit[0] is not layout:
            # Empty pieces get lo > hi on every axis, so they meet nothing.
            lo = np.array([[b[0] if b[0] < b[1] else 1 for b in e.region.bounds()] for e in layout], dtype=np.int64)
            hi = np.array([[b[1] if b[0] < b[1] else 0 for b in e.region.bounds()] for e in layout], dtype=np.int64)
            hit = self.bounds[relation] = (layout, lo, hi)
        _, lo, hi = hit
        box = need.bounds()
        nlo = np.array([b[0] for b in box], dtype=np.int64)
        nhi = np.array([b[1] for b in box], dtype=np.int64)
        meets = ((lo < nhi) & (hi > nlo)).all(axis=1)
        return [layout[k] for k in np.flatnonzero(meets)]

    def _source(self, holders: Mapping[int, int], d: int) -> int:
        """The holder to send from: the same node first, then the least busy sender."""
        return self._sources(holders, d)[0]

    def _sources(self, holders: Mapping[int, int], d: int) -> list[int]:
        """The holders in the order :meth:`_source` prefers them."""
        node = self.topo.devices[d].node
        return sorted(holders, key=lambda s: (self.topo.devices[s].node != node, self.egress[s], s))

    def _send(
        self, relation: str, region: Region, holders: Mapping[int, int], d: int, rows: RoutedRows | None = None
    ) -> int:
        """Send ``region`` of a relation to ``d`` from one of its holders; with ``rows``, only
        those rows (a routed reader's, or a routed block's partial sums), where both ends hold
        the route's cells for them (else the whole region)."""
        src = self._source(holders, d)
        selection = None
        if rows is not None:
            chosen = self._selection(rows, region, holders, d)
            if chosen is not None:
                src, selection = chosen
        buf = holders[src]
        nbytes = region.size * self._itemsize(relation)
        if selection is not None:
            nbytes = math.ceil(nbytes * selection.rows.share())
        self.egress[src] += nbytes
        deps = [self.buffers[buf].task]
        if selection is not None:
            deps.extend(self.buffers[b].task for b, _ in (*selection.at_source, *selection.at_dest))
        task = Send(len(self.tasks), src, sorted(set(deps)), d, buf, relation, region, nbytes, selection)
        return self._add(task, relation, region)

    def _selection(
        self, rows: RoutedRows, region: Region, holders: Mapping[int, int], d: int
    ) -> tuple[int, Selection] | None:
        """The holder to send ``rows`` of ``region`` from (the first, in :meth:`_source`'s order,
        that holds the route's cells for those rows), and the selection; None where the receiver
        or every holder lacks them."""
        route = self.graph.relation(rows.route)
        need = Region(
            tuple(
                region.axes[m] if m is not None else Region.whole(route.shape).axes[j] for j, m in enumerate(rows.axes)
            )
        )
        at_dest = self._held(rows.route, need, d)
        if at_dest is None:
            return None
        for src in self._sources(holders, d):
            at_source = self._held(rows.route, need, src)
            if at_source is not None:
                return src, Selection(rows, need, at_source, at_dest)
        return None

    def _held(self, relation: str, need: Region, d: int) -> tuple[tuple[int, Region], ...] | None:
        """Buffers already on ``d`` (its own pieces, whole receipts) that cover ``need``, or None."""
        parts: list[tuple[int, Region]] = []
        missing = [need]
        for entry in self._near(relation, need):
            part = entry.region.intersect(need)
            if part.empty:
                continue
            held = [(part, entry.holders[d])] if d in entry.holders else self.received.get((d, entry, None), [])
            for region, buf in held:
                overlap = region.intersect(part)
                if not overlap.empty:
                    parts.append((buf, overlap))
                    missing = [rest for m in missing for rest in m.minus(overlap)]
        return tuple(parts) if all(m.empty for m in missing) else None

    def _place(self, relation: str, tile: Tile) -> list[Entry]:
        """Make an output end where the plan wants it (e.g. replicated on every device)."""
        rel = self.graph.relation(relation)
        # One entry per region of each piece of the layout, with every device holding it.  (Pieces
        # of '=' relations can overlap: the same region of two pieces holds different cells.)
        entries: dict[tuple[int, Region], Entry] = {}
        for block in tile.blocks():
            region = Region.of_box(rel.shape, tuple(block.ranges[a] for a in rel.axis_names))
            for d in block.devices:
                for piece, buf, part in self._pieces(relation, region, d):
                    entries.setdefault((id(piece), part), Entry(part, {})).holders[d] = buf
        return list(entries.values())

    # -- partial results ------------------------------------------------------------------------------

    def _finalize(self, relation: str, contributions: list[Entry]) -> list[Entry]:
        """The final layout of a relation: contributions as they are where they do not overlap,
        reduced where several cover the same cells."""
        rel = self.graph.relation(relation)
        if rel.aggop == "=" or len(contributions) <= 1 or self._routed_parts(relation):
            return contributions
        layout = []
        for region, members in _cell_groups([c.region for c in contributions]):
            if len(members) == 1:
                layout.append(Entry(region, contributions[members[0]].holders))
            else:
                layout.extend(self._reduce(relation, region, [contributions[m] for m in members]))
        return layout

    def _routed_parts(self, relation: str) -> bool:
        """Whether the blocks that cover the same cells of ``relation`` differ only in the part
        of a routed index they hold: each cell then exists in exactly one of them (its routed
        value names one part), and the pieces stay where they are, to be read by presence, as
        an '=' relation's are (no reduction: readers routed alike read their own part only)."""
        producers = self.graph.producers(relation)
        if len(producers) != 1:
            return False
        node = producers[0]
        return routed_parts_only(node, {s.index for s in self.plan.node(node.name).tile.splits if s.parts > 1})

    def _reduce(self, relation: str, region: Region, parts: list[Entry]) -> list[Entry]:
        # One source per contribution (its first holder), then one per device: partials that
        # share a device are combined there first.
        by_device: dict[int, list[Entry]] = {}
        for p in parts:
            by_device.setdefault(min(p.holders), []).append(p)
        sources = {d: self._combine(relation, region, d, [p.holders[d] for p in ps]) for d, ps in by_device.items()}
        # A routed block's partial sums exist on its rows only: only those travel.
        rows = {d: ps[0].rows if len(ps) == 1 else None for d, ps in by_device.items()}
        if len(sources) == 1:
            ((d, buf),) = sources.items()
            return [Entry(region, {d: buf})]
        groups = self._node_groups(list(sources))
        if len(groups) > 1 and self._hierarchy():
            return self._hierarchical(relation, region, sources, groups, rows)
        return self._reduce_scatter(relation, region, sources, rows)

    def _reduce_axis(self, relation: str) -> int | None:
        """The axis the plan reduce-scatters this relation's partials along (None: the longest)."""
        producers = self.graph.producers(relation)
        return self.plan.node(producers[0].name).reduce_axis if producers else None

    def _hierarchy(self) -> bool:
        """Reduce inside nodes first?  Always when asked.  With "auto": not where the lowering
        runs reductions as collective calls (NCCL), since a direct reduce-scatter (and its
        all-gather) then becomes one collective that the library runs in its own hierarchical
        form where that is faster, as the cost model prices it
        (:func:`edatalog.solver.costmodel.group_collective_seconds`), while the hierarchical
        exchange stays messages; else (messages, gloo) when links between nodes are slower than
        links inside them: only one partial per node then crosses them."""
        if self.reduction != "auto":
            return self.reduction == "hierarchical"
        if {ir.CollectiveKind.REDUCE_SCATTER, ir.CollectiveKind.ALL_REDUCE} <= self.collectives:
            return False
        inter = self.topo.inter
        return inter is not None and inter.bandwidth < self.topo.intra.bandwidth

    def _node_groups(self, devices: list[int]) -> list[list[int]]:
        groups: dict[int, list[int]] = {}
        for d in sorted(devices):
            groups.setdefault(self.topo.devices[d].node, []).append(d)
        return list(groups.values())

    def _reduce_scatter(
        self,
        relation: str,
        region: Region,
        sources: dict[int, int],
        rows: Mapping[int, RoutedRows | None] | None = None,
    ) -> list[Entry]:
        """Split the region among the devices holding partials; each owner receives the others'
        partials of its piece directly and combines them.  ``rows``: per source, the rows its
        partial has cells on (None: any)."""
        owners = sorted(sources)
        out = []
        for owner, piece in zip(owners, region.split(len(owners), self._reduce_axis(relation)), strict=False):
            bufs = [sources[owner]]
            for src in owners:
                if src != owner:
                    along = rows.get(src) if rows is not None else None
                    bufs.append(self._send(relation, piece, {src: sources[src]}, owner, along))
            out.append(Entry(piece, {owner: self._combine(relation, piece, owner, bufs)}))
        return out

    def _hierarchical(
        self,
        relation: str,
        region: Region,
        sources: dict[int, int],
        groups: list[list[int]],
        rows: Mapping[int, RoutedRows | None],
    ) -> list[Entry]:
        """Reduce inside each node first, then across nodes: only one partial of each piece crosses
        the slow links per node."""
        width = max(len(g) for g in groups)
        pieces = region.split(width, self._reduce_axis(relation))
        out = []
        for k, piece in enumerate(pieces):
            leaders: dict[int, int] = {}  # node-level owner of this piece -> its combined buffer
            for g in groups:
                inner = {d: sources[d] for d in g}
                leader = g[k % len(g)]
                bufs = [inner[leader]]
                bufs.extend(self._send(relation, piece, {d: inner[d]}, leader, rows.get(d)) for d in g if d != leader)
                leaders[leader] = self._combine(relation, piece, leader, bufs)
            out.extend(self._reduce_scatter(relation, piece, leaders))
        return out

    def _combine(self, relation: str, region: Region, device: int, bufs: list[int]) -> int:
        if len(bufs) == 1 and self.buffers[bufs[0]].region.same(region):
            return bufs[0]
        item = self._itemsize(relation)
        task = Combine(
            len(self.tasks),
            device,
            sorted({self.buffers[b].task for b in bufs}),
            relation,
            region,
            list(bufs),
            region.size * (len(bufs) - 1),
            region.size * item * (len(bufs) + 1),
        )
        return self._add(task, relation, region)


def _layers(graph: Graph) -> dict[str, tuple[str, int]]:
    """Each rule of an instance of a repeated module: (the module's prefix, the instance)."""
    return {name: (rep.prefix, k) for rep in graph.repeats for k in range(rep.count) for name in rep.instance(k)}


def _cell_groups(regions: list[Region]) -> list[tuple[Region, list[int]]]:
    """Partition the union of ``regions`` into products of per-axis atoms (coordinates covered by
    the same regions along that axis), each with the regions that cover it: interval arithmetic,
    as cheap at any extent."""
    groups = []
    for combo in itertools.product(*(atoms([r.axes[k] for r in regions]) for k in range(len(regions[0].axes)))):
        covering = set(range(len(regions)))
        for _, members in combo:
            covering.intersection_update(members)
        if covering:
            groups.append((Region(tuple(a for a, _ in combo)), sorted(covering)))
    return groups


# -- lowering to device programs -------------------------------------------------------------------


def _partials(tasks: list[Task]) -> set[int]:
    """The buffers that are partial results: combined on their device, or sent to be."""
    partial: set[int] = set()
    for t in reversed(tasks):
        if isinstance(t, Combine):
            partial.update(t.sources)
        elif isinstance(t, Send) and t.id in partial:
            partial.add(t.source)
    return partial


@functools.lru_cache(maxsize=1 << 16)
def _general(node: JoinAgg, ranges: tuple[tuple[str, int, int], ...]) -> bool:
    """:func:`general_path` of one block, kept: every check of a plan lowers the same blocks,
    and every layer of a model the same rules (``node`` is a rule's ``anonymous`` form)."""
    return general_path(restrict(node, {name: (lo, hi) for name, lo, hi in ranges}))


def _lower(
    graph: Graph, tasks: list[Task], outputs: dict[str, list[Entry]], n: int
) -> tuple[ProgramsIR, dict[tuple[int, int], OpCost]]:
    """Each device's ops in the tasks' global order (a transfer is a send on its source and a
    receive on its destination, at the same place), a ``Free`` after each buffer's last reader
    (loaded inputs and params, and output pieces, stay), and every op's cost."""
    dtype: dict[int, str] = {}
    full: dict[int, bool] = {}  # every cell of the buffer's region is known to exist
    partial = _partials(tasks)
    ops: list[list[tuple[ir.Op, OpCost]]] = [[] for _ in range(n)]
    for t in tasks:
        if isinstance(t, Load):
            dtype[t.id], full[t.id] = graph.relation(t.relation).dtype, True
            ops[t.device].append((ir.Load(t.id, t.relation, t.region, dtype[t.id], True), OpCost(0, t.nbytes)))
        elif isinstance(t, Compute):
            node = graph.node(t.node)
            # A partial sum is kept in the compute dtype until it is combined; a finished block
            # is rounded to the relation's dtype once, as it is made, and stored so.
            dtype[t.id] = dtypes.compute_dtype(node.dtype) if t.id in partial else node.dtype
            writes_all = _head_is_onto(node) and t.every_point
            full[t.id] = writes_all and all(_covers(parts, full, need) for parts, need in _needs(node, t))
            ranges = tuple((i.name, *t.ranges[i.name]) for i in node.indices)
            reads = tuple(tuple((b, r) for b, r in parts) for parts in t.reads)
            kernel = ir.Kernel(t.id, t.node, ranges, reads, node.out, t.out, dtype[t.id], full[t.id])
            extents = {i: hi - lo for i, (lo, hi) in t.ranges.items()}
            routed = routed_form(node) if node.lookups else None
            if routed is not None:
                gemm: tuple[int, int, int, int] | None = routed_gemm(node, routed, extents)
            else:
                gemm = gemm_shape(None if node.lookups else gemm_roles(node), extents)  # a gather is no GEMM
            general = _general(node.anonymous, ranges)
            ops[t.device].append((kernel, OpCost(t.flops, t.nbytes, node.dtype, gemm, general, launches(node))))
        elif isinstance(t, Send):
            # A selective transfer leaves the rows it did not send absent.
            dtype[t.id], full[t.id] = dtype[t.source], full[t.source] and t.selection is None
            cost = OpCost(0, t.nbytes)
            at_source, at_dest = _selects(t.selection, full[t.source])
            ops[t.device].append((ir.Send(t.source, t.dst, t.id, t.region, at_source), cost))
            recv = ir.Recv(t.id, t.device, t.id, t.relation, t.region, dtype[t.id], full[t.id], at_dest)
            ops[t.dst].append((recv, cost))
        else:
            assert isinstance(t, Combine)
            dtype[t.id] = dtypes.compute_dtype(graph.relation(t.relation).dtype)
            full[t.id] = any(full[b] for b in t.sources)  # a cell exists where some partial has it
            combine = ir.Combine(t.id, t.relation, t.region, tuple(t.sources), dtype[t.id], full[t.id])
            ops[t.device].append((combine, OpCost(t.flops, t.nbytes, graph.relation(t.relation).dtype)))
    kept = {b for entries in outputs.values() for e in entries for b in e.holders.values()}
    kept |= {t.id for t in tasks if isinstance(t, Load)}
    devices, costs = [], {}
    for d, listed in enumerate(ops):
        listed = _sends_early(listed)
        last: dict[int, int] = {}
        for k, (op, _) in enumerate(listed):
            for b in ir.reads(op):
                last[b] = k
            if isinstance(op, ir.DEFINES):
                last.setdefault(op.buf, k)  # a buffer nobody reads ends with the op that makes it
        ends: dict[int, list[int]] = {}
        for b, k in last.items():
            if b not in kept:
                ends.setdefault(k, []).append(b)
        program: list[ir.Op] = []
        for k, (op, cost) in enumerate(listed):
            costs[(d, len(program))] = cost
            program.append(op)
            program.extend(ir.Free(b) for b in sorted(ends.get(k, ())))
        devices.append(ir.DeviceProgram(d, tuple(program)))
    pieces = tuple(
        ir.OutputPiece(name, e.region, d, b)
        for name, entries in outputs.items()
        for e in entries
        for d, b in sorted(e.holders.items())
    )
    relations = tuple((r.name, r.shape, r.dtype) for r in graph.relations)
    return ProgramsIR(graph.fingerprint(), relations, tuple(devices), pieces), costs


def _selects(selection: Selection | None, dense: bool) -> tuple[ir.Select | None, ir.Select | None]:
    """A selective transfer's selection as its sender's and its receiver's ops name it;
    ``dense``: the sent buffer is full."""
    if selection is None:
        return None, None
    r = selection.rows

    def at(parts: tuple[tuple[int, Region], ...]) -> ir.Select:
        return ir.Select(r.route, parts, selection.region, r.axes, r.lo, r.hi, dense)

    return at(selection.at_source), at(selection.at_dest)


def _needs(node: JoinAgg, t: Compute) -> list[tuple[list[tuple[int, Region]], Region]]:
    """Per input of a compute task: the buffers it reads and the block's whole need."""
    return [(parts, Region.through(acc.axes, t.ranges)) for acc, parts in zip(node.inputs, t.reads, strict=True)]


def _covers(parts: list[tuple[int, Region]], full: dict[int, bool], need: Region) -> bool:
    """Whether full buffers give every cell of ``need``: parts are inside the need, so when
    their sizes add up to the need's they tile it (overlapping parts are not trusted)."""
    return all(full[b] for b, _ in parts) and sum(r.size for _, r in parts) == need.size


def _head_is_onto(node: JoinAgg) -> bool:
    """Whether every cell of a block's output region gets a point: not when the head repeats an
    index (``d[i, i]`` writes a diagonal of its block's square)."""
    indices = [p.index for ax in node.out_axes for p in ax.parts if p.index is not None]
    return len(indices) == len(set(indices))


def _sends_early(listed: list[tuple[ir.Op, OpCost]]) -> list[tuple[ir.Op, OpCost]]:
    """Each send moved up to just after the op that makes its buffer (but never before an earlier
    send to the same peer, so every pair of devices keeps its order of messages, as NCCL needs):
    a device hands its data over as soon as it has it, so a reduce-scatter runs both ways at
    once rather than one device receiving, combining and only then sending.  Moving a send up
    removes waits and adds none, so the programs still cannot wait for each other forever."""
    keys: list[tuple[int, int, int]] = []  # (position it follows, 0 for itself / 1 for a send, order)
    made: dict[int, int] = {}  # buffer -> position of the op that makes it
    last_to: dict[int, int] = {}  # peer -> the position the latest send to it follows
    for k, (op, _) in enumerate(listed):
        if isinstance(op, ir.Send):
            after = max(max(made[b] for b in ir.reads(op)), last_to.get(op.peer, -1))
            last_to[op.peer] = after
            keys.append((after, 1, k))
            continue
        if isinstance(op, ir.DEFINES):
            made[op.buf] = k
        keys.append((k, 0, k))
    return [listed[k] for _, _, k in sorted(keys)]
