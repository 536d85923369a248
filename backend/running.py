"""The programs as the runtimes run them, and what their ops cost.

Exchange synthesis makes point-to-point programs of separate kernels; the simulator runs them
so.  The torch runtimes run them otherwise, in two steps: each device's attention blocks become
one fused kernel (:func:`edatalog.backend.fusion.fuse_programs`), and across processes the
exchanges that are whole collectives become one collective call
(:func:`edatalog.backend.collectives.use_collectives`, the kinds the communication library runs
faster so: :func:`edatalog.backend.collectives.wanted`).  :func:`runtime_programs` applies both,
for the SPMD runtime and for the timeline alike, so that what is predicted is what runs.

:func:`as_run` is a schedule with those programs and a cost for each of their ops:

- a kernel, load, send, receive or combine costs what it cost before;
- a fused attention block costs as flash attention: the flops of its five rules, counted over
  the ``FLASH_TILE x FLASH_TILE`` tiles of queries and keys that hold a point of the guard
  (a causal block skips whole tiles above the diagonal, and computes whole tiles on it), and
  the bytes of its inputs and output only: scores and probabilities never leave the chip;
- a collective moves its whole region (its cost model is
  :func:`edatalog.solver.costmodel.collective_seconds`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from edatalog.backend.collectives import Kind, use_collectives, wanted
from edatalog.backend.exchange import Entry, Schedule
from edatalog.backend.fusion import fuse_programs
from edatalog.ir import dtypes
from edatalog.ir import program as ir
from edatalog.ir.graph import Graph
from edatalog.ir.program import OpCost
from edatalog.ir.regions import Region
from edatalog.solver.blocks import tighten
from edatalog.solver.costmodel import tiled_points


@dataclass(frozen=True)
class RuntimePrograms:
    programs: ir.Programs
    outputs: dict[str, list[Entry]]  # where each output ends: by buffer, as these programs run


def runtime_programs(
    programs: ir.Programs, graph: Graph, outputs: dict[str, list[Entry]], kinds: Collection[Kind]
) -> RuntimePrograms:
    """``programs`` with attention fused and the exchanges of ``kinds`` run as collectives."""
    fused = fuse_programs(programs, graph)
    if not kinds:
        return RuntimePrograms(fused, outputs)
    rewritten = use_collectives(fused, graph, kinds)
    return RuntimePrograms(rewritten.programs, rewritten.outputs(outputs))


def as_run(s: Schedule) -> Schedule:
    """The schedule as a runtime on the topology's communication library runs it, each op
    costed (see the module docstring)."""
    run = runtime_programs(s.programs, s.graph, s.outputs, wanted(None, s.topology.library.value))
    if run.programs is s.programs:  # nothing to fuse, no collective
        return s
    costs = _costs(s, run.programs)
    return dataclasses.replace(s, programs=run.programs, costs=costs, outputs=run.outputs)


def _costs(s: Schedule, programs: ir.Programs) -> dict[tuple[int, int], OpCost]:
    made: dict[tuple[int, int], OpCost] = {}  # (device, buffer) -> the cost of the op making it
    sent: dict[tuple[int, int], OpCost] = {}  # (device, tag) -> the cost of the send
    for (device, k), cost in s.costs.items():
        op = s.programs.devices[device].ops[k]
        if isinstance(op, ir.DEFINES):
            made[(device, op.buf)] = cost
        elif isinstance(op, ir.Send):
            sent[(device, op.tag)] = cost
    out: dict[tuple[int, int], OpCost] = {}
    for device, k, op in programs.ops():
        if isinstance(op, ir.Fused):
            inner = {part.buf: made[(device, part.buf)] for part in op.body}
            out[(device, k)] = flash_cost(s.graph, op, inner, programs, device)
        elif isinstance(op, ir.Collective):
            out[(device, k)] = OpCost(0, op.whole.size * dtypes.itemsize(op.dtype), op.dtype)
        elif isinstance(op, ir.Send):
            out[(device, k)] = sent[(device, op.tag)]
        elif isinstance(op, ir.DEFINES):
            out[(device, k)] = made[(device, op.buf)]
        else:
            out[(device, k)] = OpCost(0, 0)
    return out


def flash_cost(graph: Graph, op: ir.Fused, inner: Mapping[int, OpCost], programs: ir.Programs, device: int) -> OpCost:
    """A fused attention block's cost as flash attention runs it (see the module docstring):
    ``inner`` holds the cost of each of its ops as a separate kernel."""
    scores = op.body[0]
    assert isinstance(scores, ir.Kernel), "a fused block starts with its scores kernel"
    node = graph.node(scores.node)
    ranges = {i: (lo, hi) for i, lo, hi in scores.ranges}
    _, points = tighten(node, ranges)
    ratio = tiled_points(node, ranges) / points if points else 1.0
    flops = math.ceil(sum(c.flops for c in inner.values()) * ratio)
    dtype_of = {o.buf: o.dtype for o in programs.devices[device].ops if isinstance(o, ir.DEFINES)}
    read = {(b, region) for k in op.body for parts in _reads(k) for b, region in parts if b not in op.internal}
    nbytes = sum(region.size * dtypes.itemsize(dtype_of[b]) for b, region in read)
    nbytes += op.region.size * dtypes.itemsize(op.dtype)
    return OpCost(flops, nbytes, inner[scores.buf].dtype)


def _reads(op: ir.Kernel | ir.Combine) -> tuple[tuple[tuple[int, Region], ...], ...]:
    if isinstance(op, ir.Kernel):
        return op.reads
    return tuple(((b, op.region),) for b in op.sources)
