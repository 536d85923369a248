"""Rules that carry a route: the elementwise rules between a mixture of experts' routed rules
look up the route too, so that plans can keep a token's rows on its experts' devices.

    h1[t, k, f] += x[t, d] * w1[e, f, d] where route[t, k] = e.     # routed: made per expert
    a[t, k, f] = silu(h1[t, k, f]) * h3[t, k, f].                   # carries the route (below)
    y[t, d] += a[t, k, f] * w2[e, d, f] where route[t, k] = e.      # routed: read per expert

A block of ``h1`` over part of the experts has only the cells routed there.  ``a`` has no
expert index, so a plan can split it only by tokens, and each of its blocks must gather every
expert's cells of its tokens: the whole of ``h1`` crosses the devices twice (to ``a``, and
``a`` to ``y``'s experts), where expert parallelism should move only the tokens.  This pass
writes ``a`` as

    a[t, k, f] = silu(h1[t, k, f]) * h3[t, k, f] where route[t, k] = e:X.

a lookup that reads nothing (a filter): the same cells and values, but an expert index the
plan can split like the routed rules', each block computing the cells routed to its experts
from the pieces of ``h1`` made there (exchange synthesis reads only pieces routed alike,
:class:`edatalog.backend.lowering.tasks.Routed`).  Over the whole range a filter changes
nothing and evaluators drop it (:func:`edatalog.ir.forms.without_full_filters`).

A rule follows when it is the only rule of its head, assigns (``=``, nothing aggregated),
looks nothing up, and reads, at plain indices, every index of the route of a relation that a
routed rule (or a rule that follows) made.
"""

from __future__ import annotations

import dataclasses

from edatalog.ir.forms import RouteKey, plain_index, routed_partition
from edatalog.ir.graph import Access, AxisMap, Graph, Index, JoinAgg, Lookup, Part


def follow_routes(graph: Graph) -> Graph:
    """``graph`` with each rule that can carry a route carrying it (see the module docstring)."""
    keyed: dict[str, tuple[RouteKey, Index]] = {}  # relation -> its route, and the routed index
    nodes: list[JoinAgg] = []
    changed = False
    for node in graph.nodes:
        single = len(graph.producers(node.out)) == 1
        if single and node.aggop == "=" and not node.agg_indices and not node.lookups:
            follows = _follow(node, keyed)
            if follows is not None:
                node, changed = follows, True
        found = routed_partition(node) if single and node.lookups else None
        if found is not None:
            lk, key = found
            keyed[node.out] = (key, next(i for i in node.indices if i.name == lk.index))
        nodes.append(node)
    if not changed:
        return graph
    summed = {n.out for n in nodes if n.lookups and n.aggop == "+="}
    relations = tuple(
        dataclasses.replace(r, aggop="+=") if r.name in summed and r.aggop == "=" else r for r in graph.relations
    )
    out = dataclasses.replace(graph, relations=relations, nodes=tuple(nodes))
    out.verify()
    return out


def _follow(node: JoinAgg, keyed: dict[str, tuple[RouteKey, Index]]) -> JoinAgg | None:
    """``node`` looking up the route of the first routed relation it reads at plain indices."""
    box = node.box
    for acc in node.inputs:
        if acc.relation not in keyed:
            continue
        key, routed = keyed[acc.relation]
        args = [plain_index(acc.axes[p]) for p in key.axes]
        if any(v is None for v in args):
            continue
        name = index = routed.name
        n = 1
        while index in box:
            index, n = f"{name}{n}", n + 1
        route = Access(key.relation, tuple(AxisMap((Part.of_index(str(v), box[str(v)]),)) for v in args))
        return dataclasses.replace(
            node,
            indices=(*node.indices, Index(index, routed.extent, routed.symbol)),
            inputs=(*node.inputs, route),
            lookups=(Lookup(index, len(node.inputs), routed.extent),),
            aggop="+=",  # a sum over the one expert each point's route names, as the language has it
        )
    return None
