"""Repeated layers: solve one, reuse it for every instance.

A program with a repeated module (``h = decoder(x0) repeat L as layers``, see
:class:`edatalog.ir.graph.Repeat`) has ``L`` copies of the same rules over renamed relations.
Planning them as one graph would make the solver's model ``L`` times larger for nothing: this
module cuts the graph into the first instance (:func:`layer_graph`, the layer the solver
solves) and the rest of the program outside every instance (:func:`outer_graph`, solved too,
small), and composes a plan of the whole graph from the two (:func:`compose`): every instance
takes the layer's tiles, renamed, and with ``stages`` > 1 a pipeline split: the devices form
``stages`` groups, the layer is solved on one group's devices, and instance ``k`` runs on group
``k * stages // L``.  Solve time then does not grow with ``L``.

The layer is solved as a graph of its own: what it reads from outside (the previous layer's
result, shared tables, its params) are its inputs, placed where its rules read them, and what
is read after it (its result, and any listed output) its outputs, which the standalone solve
gathers onto every device.  In the whole graph the next instance reads its predecessor's result
where it is, so the composed plan moves no more than the layer's solve paid for: its time is
about ``L`` times the layer's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from edatalog.errors import EdlError
from edatalog.ir.graph import Graph, Repeat
from edatalog.solver.plan import Plan, Tile
from edatalog.solver.strategies import plan_of
from edatalog.solver.topology import Topology


def repeated(graph: Graph) -> Repeat | None:
    """The repeat worth solving once: the one with the most instances (None: no repeat of two
    or more)."""
    reps = [r for r in graph.repeats if r.count > 1]
    return max(reps, key=lambda r: r.count * len(r.nodes), default=None)


def subgraph(graph: Graph, names: Sequence[str]) -> Graph:
    """The rules ``names`` of ``graph`` as a graph of their own: what they read and do not make
    becomes their inputs, what they make and others read (or the graph outputs) their outputs."""
    wanted = set(names)
    nodes = tuple(n for n in graph.nodes if n.name in wanted)
    made = {n.out for n in nodes}
    read = {a.relation for n in nodes for a in n.inputs}
    relations = []
    for r in graph.relations:
        if r.name in made:
            relations.append(r)
        elif r.name in read:
            relations.append(r if r.kind != "derived" else dataclasses.replace(r, kind="input", aggop=None))
    outside = {a.relation for n in graph.nodes if n.name not in wanted for a in n.inputs}
    outputs = tuple(r.name for r in relations if r.name in made and (r.name in outside or r.name in graph.outputs))
    sub = Graph(tuple(relations), nodes, outputs, graph.dims, graph.consts, graph.source_name)
    sub.verify()
    return sub


def layer_graph(graph: Graph, rep: Repeat) -> Graph:
    """Instance 0 of ``rep``, as a graph of its own."""
    return subgraph(graph, rep.instance(0))


def outer_graph(graph: Graph, rep: Repeat) -> Graph | None:
    """Every rule outside ``rep``'s instances, as a graph of its own (None: there is none)."""
    inside = {name for k in range(rep.count) for name in rep.instance(k)}
    names = [n.name for n in graph.nodes if n.name not in inside]
    return subgraph(graph, names) if names else None


def stage_devices(n: int, stages: int) -> list[tuple[int, ...]]:
    """The devices of each pipeline stage: ``stages`` equal groups of consecutive devices."""
    if stages < 1 or n % stages:
        raise EdlError(
            f"{stages} pipeline stages do not divide {n} devices",
            help=f"choose a number of stages that divides {n}: "
            + ", ".join(str(s) for s in range(1, n + 1) if n % s == 0),
        )
    size = n // stages
    return [tuple(range(s * size, (s + 1) * size)) for s in range(stages)]


def stage_of(k: int, count: int, stages: int) -> int:
    """The pipeline stage of instance ``k`` of ``count``: consecutive layers, as even as can be."""
    return k * stages // count


def stage_sizes(count: int, stages: int) -> list[int]:
    """How many of ``count`` instances each of ``stages`` pipeline stages runs (:func:`stage_of`)."""
    sizes = [0] * stages
    for k in range(count):
        sizes[stage_of(k, count, stages)] += 1
    return sizes


def pipeline_seconds(stage_seconds: Sequence[float], microbatches: int) -> float:
    """When the last of ``microbatches`` leaves the last stage, each stage taking
    ``stage_seconds[s]`` per microbatch (its compute, and the send to the next stage) and taking
    them in order, as soon as each arrives (GPipe's forward, buffers unbounded): microbatch ``j``
    leaves stage ``s`` at ``max(its leaving s - 1, j - 1 leaving s) + t_s``, whose last value
    is the longest path through the grid, ``sum(t) + (microbatches - 1) * max(t)``: the bubble
    is the slowest stage's, once per microbatch beyond the first."""
    if microbatches < 1 or not stage_seconds:
        raise ValueError("a pipeline has at least one stage and one microbatch")
    return sum(stage_seconds) + (microbatches - 1) * max(stage_seconds)


def _moved(tile: Tile, devices: Sequence[int]) -> Tile:
    """``tile`` with its device ``d`` (of a group's own numbering) as ``devices[d]``."""
    return dataclasses.replace(tile, devices=tuple(tuple(devices[d] for d in ds) for ds in tile.devices))


def compose(graph: Graph, rep: Repeat, layer: Plan, outer: Plan | None, machine: Topology, stages: int = 1) -> Plan:
    """The plan of the whole graph on ``machine``: every instance of ``rep`` tiled as ``layer``
    (a plan of :func:`layer_graph` on one stage's devices), on its stage's devices; the other
    rules as ``outer`` (a plan of :func:`outer_graph` on every device); inputs and params placed
    where their readers are; outputs gathered onto every device."""
    groups = stage_devices(machine.n, stages)
    placed = {p.node: p for p in layer.nodes}
    local = {name: placed[rep.node(0, name)] for name in rep.nodes}  # q -> layers.0.q's
    tiles: dict[str, Tile] = {}
    axes: dict[str, int | None] = {}
    for k in range(rep.count):
        devices = groups[stage_of(k, rep.count, stages)]
        for name in rep.nodes:
            tiles[rep.node(k, name)] = _moved(local[name].tile, devices)
            axes[rep.node(k, name)] = local[name].reduce_axis
    for p in outer.nodes if outer is not None else ():
        tiles[p.node], axes[p.node] = p.tile, p.reduce_axis
    missing = [node.name for node in graph.nodes if node.name not in tiles]
    assert not missing, f"no tile for {missing[:3]}"
    return plan_of(graph, machine, "auto", tiles, reduce_axes=axes)
