"""Recomputation of activations (activation checkpointing), as rules.

A training step keeps what its backward reads of the forward: every layer's intermediates,
from the forward until that layer's backward.  :func:`recompute_layers` trades that memory for
compute, as ``torch.utils.checkpoint`` around each decoder layer does: the backward reads a
copy of each intermediate of a repeated module's instance (``re_<name>``), made again from what
the instance reads (its input, the params) by copies of its rules placed just before the first
backward rule that reads one of them.  The forward's intermediates are then read by the forward
only, and freed as the forward goes; an instance's result (what the next instance or the rest
of the forward reads) is kept, not recomputed.

The values are the same: the copies are the same rules on the same values.
"""

from __future__ import annotations

import dataclasses

from edatalog.errors import EdlError
from edatalog.ir.graph import Graph, JoinAgg, Repeat

PREFIX = "re_"  # a recomputed intermediate's relation
NODE_PREFIX = "re."  # its rule's


def recompute_layers(graph: Graph, forward: int) -> Graph:
    """``graph`` whose first ``forward`` rules are the forward, the rest its backward (and
    updates), with the backward reading recomputed copies of the intermediates of every
    instance of the graph's largest repeated module."""
    rep = _layers(graph)
    nodes = list(graph.nodes)
    fwd, rest = nodes[:forward], nodes[forward:]
    instance: dict[str, int] = {}  # forward rule -> its instance
    for k in range(rep.count):
        for name in rep.instance(k):
            instance[name] = k
    made: dict[str, int] = {n.out: instance[n.name] for n in fwd if n.name in instance}
    # Kept: what rules outside the instance that makes it read in the forward (the next
    # instance's input, the final norm's).
    kept = {
        a.relation for n in fwd for a in n.inputs if a.relation in made and instance.get(n.name) != made[a.relation]
    }
    wanted = {a.relation for n in rest for a in n.inputs if a.relation in made and a.relation not in kept}
    # Everything the wanted ones are made from within their instance, back to what is kept.
    again = set(wanted)
    for n in reversed(fwd):
        if n.out in again:
            again |= {a.relation for a in n.inputs if a.relation in made and a.relation not in kept}
    if not again:
        return graph
    taken = {r.name for r in graph.relations}
    clash = sorted(PREFIX + r for r in again if PREFIX + r in taken)
    if clash:
        raise EdlError(f"recomputation needs the relation '{clash[0]}', which the program has", help="rename it")
    renamed = {r: PREFIX + r for r in again}

    def reading_copies(n: JoinAgg) -> JoinAgg:
        inputs = tuple(dataclasses.replace(a, relation=renamed.get(a.relation, a.relation)) for a in n.inputs)
        return dataclasses.replace(n, inputs=inputs)

    copies: dict[int, list[JoinAgg]] = {}
    for n in fwd:
        if n.out in again:
            copy = dataclasses.replace(reading_copies(n), name=NODE_PREFIX + n.name, out=renamed[n.out])
            copies.setdefault(made[n.out], []).append(copy)
    out: list[JoinAgg] = list(fwd)
    placed: set[int] = set()
    for n in rest:
        needs = sorted({made[a.relation] for a in n.inputs if a.relation in again} - placed, reverse=True)
        for k in needs:  # the later instance first: the backward meets it first
            out.extend(copies[k])
            placed.add(k)
        out.append(reading_copies(n))
    relations = list(graph.relations)
    by_name = {r.name: r for r in relations}
    relations += [dataclasses.replace(by_name[r], name=renamed[r]) for r in sorted(again)]
    result = dataclasses.replace(graph, relations=tuple(relations), nodes=tuple(out))
    result.verify()
    return result


def _layers(graph: Graph) -> Repeat:
    reps = [r for r in graph.repeats if r.count > 1]
    if not reps:
        raise EdlError(
            "recomputation works layer by layer, and this program has no repeated module",
            help="write the layers as a module repeated with 'repeat' (see programs/llama.edl), or train without it",
        )
    return max(reps, key=lambda r: r.count * len(r.nodes))
