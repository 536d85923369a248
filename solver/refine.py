"""Refinements of a finished plan that the solver's estimate cannot price, for the caller to
check in the exact timeline and keep only when they are faster:

- **pipelining**: every block cut into chunks along one dim, so that moving one chunk (a
  reduce-scatter, a gather) overlaps computing the next.  The estimate adds steps up, so it
  sees only the chunks' extra launches and latencies, never the overlap.  Megatron on
  LLaMA-65B at S=2048 goes from 4.42 to 3.70 ms with two chunks along ``s``.
- **balancing**: a split of a dim that a guard restricts (causal attention's ``t <= s``) cut
  in twice as many parts, dealt out zigzag (part ``j`` and part ``2p-1-j`` to the same devices),
  so every device gets as many cells under the guard.  Plain splits give the last device of a
  causal sequence split most of the work.

Both keep every block on the devices it had, and apply to every rule alike, so layouts that
lined up still line up.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

from edatalog.ir.graph import Graph
from edatalog.solver.blocks import zigzag
from edatalog.solver.plan import NodePlan, Plan, Split, Tile

CHUNKS = (2, 4)  # chunk counts worth trying, in order


def every_rule_dims(graph: Graph) -> list[str]:
    """Dims every rule has an index of: chunking one of them runs the whole program as a pipeline."""
    every = [{i.symbol for i in node.indices} for node in graph.nodes]
    return [name for name, extent in graph.dims if extent > 1 and all(name in s for s in every)]


def pipelined(graph: Graph, plan: Plan, dim: str, chunks: int) -> Plan | None:
    """``plan`` with every block cut into ``chunks`` along the rule's first index of ``dim``, each
    chunk on its block's devices.  None when no block can be cut."""

    def cut(split: Split) -> tuple[Split, list[int]] | None:
        cuts, parent = [0], []
        for k, (lo, hi) in enumerate(split.ranges):
            sub = Split.even(split.index, hi - lo, chunks)
            cuts.extend(lo + c for c in sub.cuts[1:])
            parent.extend([k] * sub.parts)
        return (Split(split.index, tuple(cuts)), parent) if len(parent) > split.parts else None

    return _resplit(graph, plan, dim, cut)


def balanced(graph: Graph, plan: Plan, dim: str) -> Plan | None:
    """``plan`` with every split of ``dim`` into ``p > 1`` parts cut into ``2p`` equal parts, part
    ``j`` and part ``2p-1-j`` on the devices of old part ``j``.  None when nothing is split."""

    def cut(split: Split) -> tuple[Split, list[int]] | None:
        p = split.parts
        if p == 1 or 2 * p > split.extent:
            return None
        return Split.even(split.index, split.extent, 2 * p), zigzag(p)

    return _resplit(graph, plan, dim, cut)


def _resplit(graph: Graph, plan: Plan, dim: str, cut: Callable[[Split], tuple[Split, list[int]] | None]) -> Plan | None:
    """Apply ``cut`` (a new split, and the old part each new part's block inherits devices from)
    to every rule's first index of ``dim``."""
    nodes = []
    changed = False
    for np_ in plan.nodes:
        node = graph.node(np_.node)
        index = next((i.name for i in node.indices if i.symbol == dim), None)
        tile = np_.tile
        pos = next((k for k, s in enumerate(tile.splits) if s.index == index), None)
        new = cut(tile.splits[pos]) if pos is not None else None
        if new is None:
            nodes.append(np_)
            continue
        assert pos is not None
        split, parent = new
        splits = (*tile.splits[:pos], split, *tile.splits[pos + 1 :])
        devices = []
        for combo in itertools.product(*(range(s.parts) for s in splits)):
            linear = 0
            for k, s in enumerate(tile.splits):
                linear = linear * s.parts + (parent[combo[k]] if k == pos else combo[k])
            devices.append(tile.devices[linear])
        nodes.append(NodePlan(np_.node, Tile(splits, tuple(devices)), np_.reduce_axis))
        changed = True
    return dataclasses.replace(plan, nodes=tuple(nodes)) if changed else None
