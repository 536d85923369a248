"""The presence pass: which buffers are full, decided once, when the programs are lowered.

A buffer is *full* when every cell of its region exists (see :mod:`edatalog.ir.program`); no
presence mask is kept or sent for it, and only full buffers can take part in collectives.
Exchange synthesis marks a block's result full only when its guard holds at every point of the
block and its inputs are full.  This pass decides more, symbolically: a block whose inputs all
have exact supports (their absent cells are what the guard excludes) and whose guard's shadow on
its output indices covers its output region (counted in closed form, :meth:`Guard.count`) makes
a full buffer.  Under a causal mask every query has a key, so attention's output, and every
partial computed from it, is full though synthesis did not mark it so.  Combines of a full
partial and receives of a full buffer are full in turn.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping

from edatalog.backend.kernels.joinagg import gathers, prepare
from edatalog.ir import program as ir
from edatalog.ir.graph import Graph, JoinAgg
from edatalog.ir.rewrite import restrict


def mark_full(programs: ir.Programs, graph: Graph) -> ir.Programs:
    """The programs with every buffer that is full at run time marked full.

    Lowering marks a block's result full only when its guard holds at every point of the block
    and its inputs are full; the runtime decides more from supports (a block whose inputs all
    have exact supports and whose guard leaves no output cell without a point:
    :func:`edatalog.backend.kernels.joinagg.known_presence`), and keeps no mask for it.  Under a causal
    mask every query has a key, so attention's output, and every partial computed from it, is
    full at run time though not marked so.  Marking it here (and what combines it, and its
    messages) changes no value: the runtime already keeps no mask for these buffers; now none
    travels either, and their exchanges can be collectives."""
    full: dict[int, bool] = {}
    sent: dict[int, int] = {}  # tag -> the buffer sent
    changed: dict[tuple[int, int], ir.Op] = {}
    for d, k in ir.run_order(programs):
        op = programs.devices[d].ops[k]
        if isinstance(op, ir.Send):
            sent[op.tag] = op.buf
        elif isinstance(op, ir.DEFINES):
            marked = _marked(op, full, sent, graph)
            assert isinstance(marked, ir.DEFINES)
            full[marked.buf] = marked.full
            if marked != op:
                changed[(d, k)] = marked
    if not changed:
        return programs
    devices = tuple(
        ir.DeviceProgram(p.device, tuple(changed.get((p.device, k), op) for k, op in enumerate(p.ops)))
        for p in programs.devices
    )
    return ir.Programs(programs.graph, programs.relations, devices, programs.outputs)


def _marked(op: ir.Op, full: dict[int, bool], sent: Mapping[int, int], graph: Graph) -> ir.Op:
    """``op`` marked full when it is (see :func:`mark_full`); ``full`` gets inner buffers."""
    if isinstance(op, ir.Kernel):
        if op.full or not block_is_full(graph, op.node, op.ranges):
            return op
        return dataclasses.replace(op, full=True)
    if isinstance(op, ir.Combine):
        return op if op.full or not any(full[b] for b in op.sources) else dataclasses.replace(op, full=True)
    if isinstance(op, ir.Recv):
        if op.full or op.select is not None or not full[sent[op.tag]]:
            return op  # a selective message's other rows stay absent
        return dataclasses.replace(op, full=True)
    if isinstance(op, ir.Fused):
        body = []
        for inner in op.body:
            marked = _marked(inner, full, sent, graph)
            assert isinstance(marked, ir.Kernel | ir.Combine)
            full[marked.buf] = marked.full
            body.append(marked)
        last = body[-1].full
        return op if tuple(body) == op.body else dataclasses.replace(op, body=tuple(body), full=last or op.full)
    return op


def block_is_full(graph: Graph, node: str, ranges: ir.Ranges) -> bool:
    """Whether every cell of the region a block of ``node`` over ``ranges`` writes exists, by
    supports and guards alone (see the module docstring)."""
    rule = graph.node(node)
    exact = all(graph.relation(acc.relation).support_exact for acc in rule.inputs)
    return exact and _covers(rule.anonymous, ranges)


@functools.lru_cache(maxsize=1 << 16)
def _covers(node: JoinAgg, ranges: ir.Ranges) -> bool:
    """Whether the block's guard leaves no cell of its output region without a point, and its
    head writes every cell it spans (``d[i, i]`` writes a diagonal only)."""
    block = restrict(node, {i: (lo, hi) for i, lo, hi in ranges})
    if any(lk.offset > 0 or block.box[lk.index] < lk.extent for lk in gathers(block)):
        return False  # a block over part of a looked-up range: its cells depend on the values
    heads = [p.index for ax in block.out_axes for p in ax.parts if p.index is not None]
    if len(heads) != len(set(heads)):
        return False
    block = prepare(block)
    out_vars = [i.name for i in block.indices if i.name not in block.agg_indices]
    shadow, exact = block.guard.project(out_vars, block.box)
    if not exact:
        return False
    out_box = {v: block.box[v] for v in out_vars}
    return shadow.is_true or shadow.count(out_box) == math.prod(out_box.values())
