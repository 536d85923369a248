"""Pipeline parallelism across nodes, the baseline a practitioner runs for a whole model when one
node cannot hold it, or to keep tensor parallelism off the links between nodes: the layers cut
into consecutive stages of one node each, Megatron (``megatron-pp``) or Megatron with sequence
parallelism (``megatron-sp-pp``) inside the node, the batch cut into microbatches that flow
from stage to stage (GPipe's forward), and the nodes left over running replicas of the pipeline
on their share of the batch (data parallelism, as ``megatron-dp`` does).

Its time is **composed**, as the other baselines of whole models are
(:func:`edatalog.plans.composed_ms`): the timelines of one layer, of the rules before the layers (the embedding) and
of those after them (the norm and the head), each on one node at one microbatch's rows, put
together by :func:`edatalog.solver.layers.pipeline_seconds`; the activations sent from stage to
stage priced by the cost model's links (:mod:`edatalog.solver.costmodel`).  It is a prediction
to compare with, not a plan edatalog runs: its runtime has no microbatch schedule.

The baseline is refined as the others are: every number of stages that divides the nodes (two
or more; one stage is ``megatron-dp``), every number of microbatches that divides a replica's
rows, the fastest that fits in memory (every layer of a stage at its own peak, plus the
embedding on the first and the head on the last: the bound auto's layered plans are held to).
"""

from __future__ import annotations

from dataclasses import dataclass

from edatalog.backend.lowering.lowered import Options
from edatalog.errors import EdlError
from edatalog.ir.graph import Graph, Repeat
from edatalog.ir.printer import human
from edatalog.ir.program import CollectiveKind
from edatalog.plans import Plan, ProgramLike, lowering_options, resolve_machine
from edatalog.solver import layers, nested, strategies
from edatalog.solver.costmodel import collective_seconds, transfer_seconds
from edatalog.solver.topology import Topology


@dataclass(frozen=True)
class Pipelined:
    """The fastest pipeline that fits: its predicted time and its shape."""

    strategy: str
    ms: float  # predicted, the whole model on the whole machine
    stages: int  # consecutive groups of layers, one node each
    replicas: int  # pipelines side by side, each on its share of the batch
    microbatches: int  # per replica
    stage_ms: tuple[float, ...]  # one microbatch through each stage, its send included
    send_ms: float  # one microbatch's activations from one stage's node to the next's
    peak: int  # the bound on a device's bytes: every layer of the busiest stage at its own peak
    layer: Plan  # one layer at one microbatch on one node, as timed

    @property
    def shape(self) -> str:
        """``2 stages x 4 replicas, 2 microbatches``."""
        return f"{self.stages} stages x {_count(self.replicas, 'replica')}, {_count(self.microbatches, 'microbatch')}"

    def __str__(self) -> str:
        return f"{self.strategy}: {self.shape}, predicted {self.ms:.4g} ms, at most {human(self.peak)}B per device"


@dataclass(frozen=True)
class _Timed:
    """One microbatch's share of the model timed on one node: seconds without the call's overhead."""

    layer: Plan
    layer_s: float
    before_s: float  # the rules the first layer waits for (the embedding)
    after_s: float  # the rules after the last layer (the norm, the head)
    layer_peak: int
    before_peak: int
    after_peak: int
    send_s: float  # one microbatch's activations from a stage's node to the next


def pipelined_ms(
    prog: ProgramLike,
    topology: str | Topology,
    strategy: str,
    *,
    reduction: str = "auto",
    memory: int | str | None = None,
    collectives: str = "auto",
    stages: int | None = None,
    microbatches: int | None = None,
) -> Pipelined:
    """The fastest pipeline of ``strategy`` (``megatron-pp`` or ``megatron-sp-pp``) for a program
    with a repeated module, on a machine of several identical nodes (see the module); ``stages``
    and ``microbatches`` fix those instead of trying each."""
    if strategy not in strategies.PIPELINED:
        raise EdlError(f"'{strategy}' is not a pipeline baseline", help=f"choose {' or '.join(strategies.PIPELINED)}")
    graph = prog.graph
    rep = layers.repeated(graph)
    if rep is None:
        raise EdlError(
            f"the {strategy} baseline splits a repeated module's layers into stages; this program has none",
            help="compare a single block with megatron-dp or megatron-sp-dp",
        )
    machine = resolve_machine(topology, memory)
    g = strategies.node_size(machine, strategy)
    inner = strategy.removesuffix("-pp")
    options = lowering_options(collectives)
    batch = strategies.batch_symbol(graph)
    rows = dict(graph.dims)[batch]
    nodes = len(machine.nodes)
    limit = min(d.memory for d in machine.devices)
    timed: dict[int, _Timed | None] = {}  # by the rows of one microbatch
    best: Pipelined | None = None
    for n_stages in (s for s in range(2, min(nodes, rep.count) + 1) if nodes % s == 0 and stages in (None, s)):
        replicas = nodes // n_stages
        if rows % replicas:
            continue
        sizes = layers.stage_sizes(rep.count, n_stages)
        share = rows // replicas
        for m in (m for m in range(1, share + 1) if share % m == 0 and microbatches in (None, m)):
            each = share // m
            if each not in timed:
                timed[each] = _time(graph, rep, batch, rows // each, machine, g, inner, reduction, options)
            t = timed[each]
            if t is None:
                continue
            stage_s = [
                k * t.layer_s + (t.before_s if s == 0 else 0.0) + (t.after_s if s == n_stages - 1 else t.send_s)
                for s, k in enumerate(sizes)
            ]
            peak = max(
                k * t.layer_peak + (t.before_peak if s == 0 else 0) + (t.after_peak if s == n_stages - 1 else 0)
                for s, k in enumerate(sizes)
            )
            if peak > limit:
                continue
            ms = (layers.pipeline_seconds(stage_s, m) + machine.call_overhead) * 1e3
            if best is None or ms < best.ms:
                stage_ms = tuple(x * 1e3 for x in stage_s)
                best = Pipelined(strategy, ms, n_stages, replicas, m, stage_ms, t.send_s * 1e3, peak, t.layer)
    if best is None:
        asked = "".join(
            f", {what} {n}" for what, n in (("stages", stages), ("microbatches", microbatches)) if n is not None
        )
        raise EdlError(
            f"no {strategy} pipeline of this program fits {machine.name}{asked}",
            help="stages are 2 or more, divide the nodes and are at most the layers; the nodes they leave split the "
            "batch, and microbatches split a replica's rows; the layers of a stage must fit a device's memory",
        )
    return best


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}{'es' if what.endswith('h') else 's'}"


def _time(
    graph: Graph,
    rep: Repeat,
    batch: str,
    ways: int,
    machine: Topology,
    g: int,
    inner: str,
    reduction: str,
    options: Options,
) -> _Timed | None:
    """One microbatch (``1 / ways`` of the rows) timed on one node of ``machine``: a layer, the
    rules before the layers and those after, each alone, with ``inner``'s tiles; None when the
    rows do not divide so."""
    node = machine.subset(machine.nodes[0])
    first = set(rep.instance(0))
    inside = {name for k in range(rep.count) for name in rep.instance(k)}
    order = [n.name for n in graph.nodes]
    start = min(order.index(name) for name in first)
    before = [name for name in order[:start] if name not in inside]
    after = [name for name in order[start:] if name not in inside]

    def shrunk(names: list[str]) -> Graph | None:
        part = layers.subgraph(graph, names)
        return nested.shrink(part, batch, ways) if ways > 1 else part

    # The baseline's tiles of every rule it times, built on one layer and the rest (building
    # them on all the layers would take L times as long for the same tiles).
    core = shrunk([name for name in order if name in first or name not in inside])
    if core is None:
        return None
    whole = strategies.build(core, node, inner)

    def timed(names: list[str]) -> tuple[float, int, Plan | None] | None:
        if not names:
            return 0.0, 0, None
        part = shrunk(names)
        if part is None:
            return None
        tiles = {n.name: whole.node(n.name).tile for n in part.nodes}
        axes = {n.name: whole.node(n.name).reduce_axis for n in part.nodes}
        ir = strategies.plan_of(part, node, inner, tiles, outputs=False, reduce_axes=axes)
        # Each result gathered onto the node's devices, as the baselines across nodes leave a
        # layer's (:func:`edatalog.plans.composed_ms`), and auto's layer solved alone does.
        ir = strategies.per_node_outputs(part, ir, g, 1, batch)
        plan = Plan(ir, part, node, reduction, options)
        seconds = max(0.0, plan.report.seconds - node.call_overhead)  # paid once per call, by the whole
        return seconds, max(plan.report.peak_memory.values()), plan

    one, pre, post = timed(list(rep.instance(0))), timed(before), timed(after)
    if one is None or pre is None or post is None:
        return None
    (layer_s, layer_peak, layer), (before_s, before_peak, _), (after_s, after_peak, _) = one, pre, post
    assert layer is not None
    # What the next stage reads: the layer's results, gathered on every device of the node.
    sent = sum(layer.graph.relation(name).nbytes for name in layer.graph.outputs)
    inter = machine.inter
    assert inter is not None, "a machine of several nodes"
    # Each device sends its peer all of it, or (Megatron's scatter-gather) a 1/g share, which
    # the receiving node then gathers over its own links: the faster.
    whole_send = transfer_seconds(sent, inter)
    shared = transfer_seconds(-(-sent // g), inter) + collective_seconds(CollectiveKind.ALL_GATHER, sent, g, node.intra)
    return _Timed(layer, layer_s, before_s, after_s, layer_peak, before_peak, after_peak, min(whole_send, shared))
