"""Why a plan splits a rule as it does: every candidate partition of the rule, priced in the
context of the rest of the plan (its producers' layouts and its consumers' needs held fixed), by
the same estimates the solver minimizes."""

from __future__ import annotations

from dataclasses import dataclass

from edatalog.errors import EdlError, did_you_mean
from edatalog.ir.graph import Graph
from edatalog.solver.blocks import Layout, candidates, dim_order
from edatalog.solver.costs import Costs, Option
from edatalog.solver.plan import Plan, Tile
from edatalog.solver.topology import Topology


@dataclass(frozen=True)
class Priced:
    """One partition of a rule and what it costs where it stands in the plan (seconds)."""

    tile: Tile
    reduce_axis: int | None  # the output axis partials are reduce-scattered along (None: longest)
    compute: float
    reduce: float
    inbound: float  # bringing its inputs from the producers' layouts
    outbound: float  # bringing its output to the consumers' needs (and to where outputs must end)
    chosen: bool
    # Inputs whose rows travel only where the route sends them (a block over part of the
    # experts; an all-to-all), with the expected share of their rows that does.
    selective: tuple[tuple[str, float], ...] = ()

    @property
    def total(self) -> float:
        return self.compute + self.reduce + self.inbound + self.outbound

    def describe(self, n_devices: int) -> str:
        axis = f", reduce along axis {self.reduce_axis}" if self.reduce_axis is not None and self.reduce > 0 else ""
        return self.tile.describe(n_devices) + axis


def explain(graph: Graph, topo: Topology, plan: Plan, rule: str) -> list[Priced]:
    """Every distinct candidate for ``rule`` (the plan's own first among equals), cheapest first."""
    names = [n.name for n in graph.nodes]
    if rule not in names:
        close = did_you_mean(rule, names)
        raise EdlError(f"the program has no rule '{rule}'", help=close or f"rules: {', '.join(names)}")
    node = graph.node(rule)
    costs = Costs(graph, topo)
    planned = {p.node: p for p in plan.nodes}
    fixed = {
        n.name: costs.option(n, Layout.of_tile(n, planned[n.name].tile, planned[n.name].reduce_axis))
        for n in graph.nodes
    }
    rank = dim_order(graph)
    own = planned[rule]
    layouts = [Layout.of_tile(node, own.tile, own.reduce_axis)]
    for c in candidates(node, plan.n_devices):
        layout = Layout(node, c, rank)
        if (layout.tile, c.reduce_axis) != (own.tile, own.reduce_axis):
            layouts.append(layout)
    out = []
    seen: set[tuple[object, ...]] = set()  # candidates alike in layout and needs are one choice
    for k, layout in enumerate(layouts):
        o = costs.option(node, layout)
        if (o.held, o.needs, o.shares) in seen:
            continue
        seen.add((o.held, o.needs, o.shares))
        out.append(_price(graph, costs, plan, fixed, o, chosen=k == 0))
    out.sort(key=lambda p: (p.total, not p.chosen))
    return out


def _price(graph: Graph, costs: Costs, plan: Plan, fixed: dict[str, Option], o: Option, chosen: bool) -> Priced:
    node = o.layout.node
    inbound = 0.0
    for (acc, need), share in zip(o.needs, o.shares, strict=True):
        for producer in graph.producers(acc.relation):
            inbound += costs.transfer(acc.relation, fixed[producer.name].held, need, share)
    outbound = 0.0
    for consumer in graph.nodes:
        reader = fixed[consumer.name]
        for (acc, need), share in zip(reader.needs, reader.shares, strict=True):
            if acc.relation == node.out:
                outbound += costs.transfer(node.out, o.held, need, share)
    if node.out in {p.relation for p in plan.outputs}:
        outbound += costs.transfer(node.out, o.held, costs.replicated_need[node.out])
    selective = tuple(
        dict.fromkeys((acc.relation, share) for (acc, _), share in zip(o.needs, o.shares, strict=True) if share < 1.0)
    )
    return Priced(o.layout.tile, o.cand.reduce_axis, o.compute, o.reduce, inbound, outbound, chosen, selective)
