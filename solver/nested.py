"""Machines of many identical nodes, planned by nesting: a batch-like dim across groups of nodes,
one group's plan solved once and repeated on every group.

The solver's model grows with the devices: every candidate of every rule on 64 devices, and the
transfer between every pair of their layouts, is minutes of costing before any search.  But the
nodes of a machine are identical, and what practitioners run across nodes is data parallelism:
each node (or group of nodes) takes its own slice of the batch and runs the same plan on it.  So
a program with a dim that no param has and no guard or lookup reads (the batch ``B``: see
:func:`across`) is planned as a program of ``B / g`` on one group of ``n / g`` devices
(:func:`shrink`, :func:`group`), a solve the size of one node's, and that plan is lifted to the
whole machine (:func:`lift`): group ``k`` runs it on its own slice of ``B``, and its outputs
stay on the group.  What the groups exchange (a training step's gradients, summed over the
batch) the exact check of the lifted plan, on the whole machine, prices.

A dim a param has (``D``, ``H``, ``F``) is not split this way: splitting it across groups is
tensor parallelism over the network between nodes, which the group's solve would not price; and
a dim a guard reads (``S`` under a causal mask) gives the groups unequal shares, which one group's
plan would not stand for.
"""

from __future__ import annotations

import dataclasses

from edatalog.ir.graph import AxisMap, Graph, JoinAgg, Part, VerifyError
from edatalog.solver.plan import Placement, Plan, Split, Tile
from edatalog.solver.strategies import plan_of
from edatalog.solver.topology import Topology


@dataclasses.dataclass(frozen=True)
class Across:
    """How a plan nests: ``dim`` split ``groups`` ways, one group of ``size`` devices each."""

    dim: str
    groups: int
    size: int
    idle: int = 0  # devices past the groups, which the plan leaves idle

    def __str__(self) -> str:
        text = f"{self.dim} across {self.groups} groups of {self.size} devices"
        if self.idle:
            first = self.groups * self.size
            text += f" (devices {first}..{first + self.idle - 1} idle: {self.dim} has {self.groups} rows)"
        return text


FLAT_MOST = 16  # devices across several nodes whose solver model builds in time, when nothing nests


def across(graph: Graph, machine: Topology) -> Across | None:
    """The nesting for ``graph`` on ``machine`` (None: none): on a machine of two or more
    identical nodes, the first batch-like dim (see :func:`batch_like`) split as many ways as
    there are nodes, or, where its extent does not divide so, the most ways that divide both (a
    group is then several nodes).  Where such a group would be more than :data:`FLAT_MOST`
    devices (its own model would take minutes to build, and it has no rows left to nest along),
    the dim is split as many ways as it has rows, up to the nodes, one node each, and the nodes
    past them stay idle, as data parallelism leaves them."""
    nodes = machine.nodes
    if len(nodes) < 2 or not _identical(machine):
        return None
    per_node = len(nodes[0])
    for dim in batch_like(graph):
        extent = dict(graph.dims)[dim]
        ways = max((g for g in range(2, len(nodes) + 1) if len(nodes) % g == 0 and extent % g == 0), default=1)
        if machine.n // ways > max(FLAT_MOST, per_node):
            ways = max((g for g in range(2, len(nodes) + 1) if extent % g == 0), default=1)
            if ways > 1:
                return Across(dim, ways, per_node, machine.n - ways * per_node)
        if ways > 1:
            return Across(dim, ways, machine.n // ways)
    return None


def batch_like(graph: Graph) -> list[str]:
    """Dims every rule handles row by row: no param has one, no guard, lookup or shifted access
    reads one, and each index of one is that dim alone (not ``(b, s)`` flattened): splitting
    one gives each part the same work, and no rule reads across parts except to sum over it."""
    out = []
    for dim, _ in graph.dims:
        if any(dim in _tokens(s) for r in graph.relations if r.kind == "param" for s in r.symbols):
            continue
        if any(_reads_across(node, dim) for node in graph.nodes):
            continue
        if any(  # a support bounding the dim's axis (cells only in some rows)
            a in r.support.vars
            for r in graph.relations
            for a, s in zip(r.axis_names, r.symbols, strict=True)
            if s == dim
        ):
            continue
        if not any(i.symbol == dim for node in graph.nodes for i in node.indices):
            continue
        if shrink(graph, dim, dict(graph.dims)[dim]) is None:  # some access does not cut alike
            continue
        out.append(dim)
    return out


def shrink(graph: Graph, dim: str, ways: int) -> Graph | None:
    """``graph`` with the batch-like ``dim``'s extent divided by ``ways``: one group's share of
    the program (its numbers, constants included, are not the program's: it is for planning, not
    for running).  None when the extent does not divide, or some relation's axis is read both
    through an index of the dim and otherwise."""
    extent = dict(graph.dims).get(dim)
    if extent is None or extent % ways:
        return None
    small = extent // ways
    names = {(n.name, i.name) for n in graph.nodes for i in n.indices if i.symbol == dim}

    def axis(node: JoinAgg, ax: AxisMap) -> AxisMap:
        return AxisMap(
            tuple(Part(p.expr, small) if p.index is not None and (node.name, p.index) in names else p for p in ax.parts)
        )

    nodes = []
    cut: dict[str, set[int]] = {}  # relation -> axes that shrink
    for node in graph.nodes:
        accesses = [(a.relation, a.axes) for a in node.inputs] + [(node.out, node.out_axes)]
        for rel, maps in accesses:
            for k, ax in enumerate(maps):
                if any(p.index is not None and (node.name, p.index) in names for p in ax.parts):
                    cut.setdefault(rel, set()).add(k)
        nodes.append(
            dataclasses.replace(
                node,
                indices=tuple(dataclasses.replace(i, extent=small) if i.symbol == dim else i for i in node.indices),
                inputs=tuple(dataclasses.replace(a, axes=tuple(axis(node, ax) for ax in a.axes)) for a in node.inputs),
                out_axes=tuple(axis(node, ax) for ax in node.out_axes),
            )
        )
    relations = []
    for r in graph.relations:
        axes = cut.get(r.name, set())
        shape = tuple(small if k in axes else e for k, e in enumerate(r.shape))
        relations.append(dataclasses.replace(r, shape=shape))
    dims = tuple((d, small if d == dim else e) for d, e in graph.dims)
    out = dataclasses.replace(graph, relations=tuple(relations), nodes=tuple(nodes), dims=dims)
    try:
        out.verify()  # every access of a cut axis cut alike, supports untouched...
    except VerifyError:
        return None
    return out


def group(machine: Topology, how: Across) -> Topology:
    """The first group's devices, as a machine of their own (every group is alike)."""
    return machine.subset(range(how.size))


def lift(graph: Graph, inner: Plan, how: Across, machine: Topology) -> Plan:
    """The plan of ``graph`` on ``machine`` that runs ``inner`` (a plan of the shrunk graph on
    one group) on every group, group ``k`` on rows ``k`` of ``how.dim``: each index of the dim
    split as the inner plan splits it, within each group's rows; rules without the dim
    replicated on every group.  Inputs and params are placed by their readers; outputs end as
    the inner plan leaves them, on each group (gathered onto a group's devices, not onto every
    device across the network)."""
    tiles: dict[str, Tile] = {}
    axes: dict[str, int | None] = {}
    for node in graph.nodes:
        placed = inner.node(node.name)
        at = next((k for k, i in enumerate(node.indices) if i.symbol == how.dim), None)
        tiles[node.name] = _lifted(placed.tile, at, how)
        axes[node.name] = placed.reduce_axis
    plan = plan_of(graph, machine, "auto", tiles, outputs=False, reduce_axes=axes)
    ends = {p.relation for p in plan.outputs}
    outputs = list(plan.outputs)
    for p in inner.outputs:
        if p.relation not in ends:
            rel = graph.relation(p.relation)
            at = next((k for k, s in enumerate(rel.symbols) if s == how.dim), None)
            outputs.append(Placement(p.relation, _lifted(p.tile, at, how)))
    return dataclasses.replace(plan, outputs=tuple(outputs))


def _lifted(tile: Tile, at: int | None, how: Across) -> Tile:
    """``tile`` (of one group's share) on every group: split ``at`` (the dim's place among the
    splits) across the groups, or with no such place, replicated on each."""
    if at is None:  # every group holds the same blocks
        devices = tuple(tuple(g * how.size + d for g in range(how.groups) for d in ds) for ds in tile.devices)
        return Tile(tile.splits, tuple(tuple(sorted(ds)) for ds in devices))
    inner = tile.splits[at]
    small = inner.extent
    cuts = [0]
    for g in range(how.groups):
        cuts += [g * small + c for c in inner.cuts[1:]]
    splits = (*tile.splits[:at], Split(inner.index, tuple(cuts)), *tile.splits[at + 1 :])
    # Blocks are row-major over the splits: a block's group is its part of the dim over the
    # inner parts, and within the group it is the inner block of the remainder.
    parts = [s.parts for s in tile.splits]
    held = []
    for combo in _row_major([s.parts for s in splits]):
        g, local = divmod(combo[at], parts[at])
        inner_combo = (*combo[:at], local, *combo[at + 1 :])
        held.append(tuple(g * how.size + d for d in tile.devices[_index(inner_combo, parts)]))
    return Tile(splits, tuple(held))


def _row_major(parts: list[int]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for p in parts:
        out = [(*c, k) for c in out for k in range(p)]
    return out


def _index(combo: tuple[int, ...], parts: list[int]) -> int:
    k = 0
    for c, p in zip(combo, parts, strict=True):
        k = k * p + c
    return k


def _reads_across(node: JoinAgg, dim: str) -> bool:
    """Whether ``node`` reads along ``dim`` other than row by row: a guard or lookup on an
    index of it, two indices of it, or an index of it in a shifted or flattened access."""
    ours = {i.name for i in node.indices if i.symbol == dim}
    if any(dim in _tokens(i.symbol) and i.symbol != dim for i in node.indices) or len(ours) > 1:
        return True
    if ours & set(node.guard.vars) or any(lk.index in ours for lk in node.lookups):
        return True
    for ax in (*(ax for a in node.inputs for ax in a.axes), *node.out_axes):
        for p in ax.parts:
            if set(p.indices) & ours and (p.index not in ours or len(ax.parts) > 1):
                return True
    return False


def _tokens(symbol: str) -> set[str]:
    """The dims named in a symbolic extent (``H*E`` -> H, E)."""
    return {t for t in symbol.replace("(", "*").replace(")", "*").replace("+", "*").replace("-", "*").split("*") if t}


def _identical(machine: Topology) -> bool:
    """Nodes of one size, of one kind of device, numbered node by node."""
    nodes = machine.nodes
    size = len(nodes[0])
    if any(len(g) != size for g in nodes) or len({d.kind for d in machine.devices}) != 1:
        return False
    return all(g == tuple(range(k * size, (k + 1) * size)) for k, g in enumerate(nodes))
