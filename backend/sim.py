"""The simulated multi-device executor: runs a plan's device programs in one process.

Each device has its own store of buffers and runs its program in order; a send leaves a copy of
its region in a mailbox under its tag, and a receive waits until that tag is there.  Devices
take turns (in device order, or in a random order given a random generator: programs must not
rely on one global order), so a device blocked on a receive lets the others run.  An op that
reads a buffer its device does not hold, or programs that leave every device waiting, are a
:class:`SimError`: a bug in exchange synthesis.  Blocks are evaluated by the reference
evaluator, which makes the simulator's outputs directly comparable with the reference.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping

import numpy as np

from edatalog.backend.exchange import Entry, Schedule
from edatalog.backend.joinagg import evaluate_node
from edatalog.backend.numpy_ops import identity
from edatalog.backend.reference import Value, write_cells
from edatalog.ir import dtypes
from edatalog.ir import program as ir
from edatalog.ir.graph import AGG_NAMES, Graph, JoinAgg
from edatalog.ir.regions import Region
from edatalog.ir.rewrite import restrict


class SimError(Exception):
    """A device touched data it does not hold: exchange synthesis is wrong."""


@dataclasses.dataclass
class _Buffer:
    region: Region
    data: np.ndarray
    present: np.ndarray | None  # None: every cell present


def run(
    schedule: Schedule, inputs: Mapping[str, np.ndarray], interleave: random.Random | None = None
) -> dict[str, Value]:
    """Execute the schedule's programs on the given inputs and params; returns the outputs,
    gathered.  With ``interleave``, devices take turns one op at a time in a random order."""
    graph = schedule.graph
    progs = schedule.programs
    stores: list[dict[int, _Buffer]] = [{} for _ in range(progs.n_devices)]
    mailbox: dict[int, _Buffer] = {}
    position = [0] * progs.n_devices
    nodes = {n.name: n for n in graph.nodes}
    with np.errstate(all="ignore"):
        while True:
            ready = [p.device for p in progs.devices if _runnable(p, position[p.device], mailbox)]
            if not ready:
                break
            for device in [interleave.choice(ready)] if interleave is not None else ready:
                ops = progs.devices[device].ops
                while position[device] < len(ops) and _runnable(progs.devices[device], position[device], mailbox):
                    _execute(ops[position[device]], device, stores, mailbox, inputs, graph, nodes)
                    position[device] += 1
                    if interleave is not None:
                        break
    stuck = [p.device for p in progs.devices if position[p.device] < len(p.ops)]
    if stuck:
        raise SimError(f"devices {stuck} wait forever, at {[str(progs.devices[d].ops[position[d]]) for d in stuck]}")
    return {name: _gather(schedule, name, entries, stores) for name, entries in schedule.outputs.items()}


def _runnable(program: ir.DeviceProgram, k: int, mailbox: Mapping[int, _Buffer]) -> bool:
    if k >= len(program.ops):
        return False
    op = program.ops[k]
    return not isinstance(op, ir.Recv) or op.tag in mailbox


def _execute(
    op: ir.Op,
    device: int,
    stores: list[dict[int, _Buffer]],
    mailbox: dict[int, _Buffer],
    inputs: Mapping[str, np.ndarray],
    graph: Graph,
    nodes: Mapping[str, JoinAgg],
) -> None:
    store = stores[device]
    if isinstance(op, ir.Load):
        full = np.asarray(inputs[op.relation])
        store[op.buf] = _Buffer(op.region, Region.whole(full.shape).cut(full, op.region), None)
    elif isinstance(op, ir.Kernel):
        store[op.buf] = _compute(graph, nodes[op.node], op, store, device)
    elif isinstance(op, ir.Send):
        mailbox[op.tag] = _cut(_get(store, op.buf, device), op.region)
    elif isinstance(op, ir.Recv):
        piece = mailbox.pop(op.tag)
        if piece.region != op.region:
            raise SimError(f"device {device} receives {piece.region} for #{op.tag}, expecting {op.region}")
        store[op.buf] = piece
    elif isinstance(op, ir.Combine):
        parts = [_cut(_get(store, b, device), op.region) for b in op.sources]
        store[op.buf] = _fold(parts, AGG_NAMES[graph.relation(op.relation).aggop or "="], op.dtype)
    else:
        assert isinstance(op, ir.Free)
        _get(store, op.buf, device)
        del store[op.buf]


def _get(store: dict[int, _Buffer], buf: int, device: int) -> _Buffer:
    if buf not in store:
        raise SimError(f"device {device} reads buffer {buf}, which it does not hold")
    return store[buf]


def _cut(buf: _Buffer, region: Region) -> _Buffer:
    if not buf.region.contains(region):
        raise SimError(f"a read of {region} falls outside the buffer's region {buf.region}")
    data = buf.region.cut(buf.data, region)
    present = None if buf.present is None else buf.region.cut(buf.present, region)
    return _Buffer(region, data, present)


def _fold(parts: list[_Buffer], agg: str | None, compute: str) -> _Buffer:
    """Partials of one region folded with the aggregation; absent cells contribute nothing."""
    cdt = dtypes.to_numpy(compute)
    if len(parts) == 1:
        return parts[0]
    assert agg is not None, "only aggregations have partials"
    ident = identity(agg, cdt)
    op = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}[agg]
    acc = None
    present = None
    for p in parts:
        vals = p.data.astype(cdt) if p.present is None else np.where(p.present, p.data, ident).astype(cdt)
        acc = vals if acc is None else op(acc, vals)
        pres = np.ones(p.data.shape, dtype=bool) if p.present is None else p.present
        present = pres if present is None else present | pres
    assert acc is not None and present is not None
    dtype = parts[0].data.dtype
    acc = np.where(present, acc, 0).astype(dtype)
    return _Buffer(parts[0].region, acc, None if present.all() else present)


def _compute(graph: Graph, node: JoinAgg, op: ir.Kernel, store: dict[int, _Buffer], device: int) -> _Buffer:
    ranges = op.range_map
    block = restrict(node, ranges)  # the block as a join-agg of its own, over its parts
    data, present = [], []
    for acc, parts in zip(node.inputs, op.reads, strict=True):
        need = Region.through(acc.axes, ranges)
        operand = _assemble(need, list(parts), store, device, dtypes.to_numpy(graph.relation(acc.relation).dtype))
        data.append(operand.data)
        present.append(operand.present)
    value, pres, out_vars = evaluate_node(block, data, present)
    out = np.zeros(op.region.shape, dtype=dtypes.to_numpy(op.dtype))
    cells = np.zeros(op.region.shape, dtype=bool)
    write_cells(out, cells, block, value, pres, out_vars, None)
    return _Buffer(op.region, out, None if cells.all() else cells)


def _assemble(
    need: Region, parts: list[tuple[int, Region]], store: dict[int, _Buffer], device: int, dtype: np.dtype
) -> Value:
    """A block's view of one input: its need, filled from the local buffers that cover it, in the
    relation's dtype (partials of half types are kept in f32 until they are read)."""
    data = np.zeros(need.shape, dtype=dtype)
    present = np.zeros(need.shape, dtype=bool)
    for buf_id, part in parts:
        piece = _cut(_get(store, buf_id, device), part)
        _paste(data, present, part.at(need), piece)
    return Value(data, None if present.all() else present)


def _paste(data: np.ndarray, present: np.ndarray, at: tuple[slice | np.ndarray, ...], piece: _Buffer) -> None:
    """Write a piece's present cells at ``at``.  Pieces of a relation with several '=' rules can
    overlap, each present only on its own cells: an absent cell must not hide another's."""
    if piece.present is None:
        data[at] = piece.data
        present[at] = True
    else:
        data[at] = np.where(piece.present, piece.data, data[at])
        present[at] = present[at] | piece.present


def _gather(schedule: Schedule, name: str, entries: list[Entry], stores: list[dict[int, _Buffer]]) -> Value:
    """An output assembled on the host from the buffers its final layout names."""
    rel = schedule.graph.relation(name)
    data = np.zeros(rel.shape, dtype=dtypes.to_numpy(rel.dtype))
    present = np.zeros(rel.shape, dtype=bool)
    whole = Region.whole(rel.shape)
    for e in entries:
        if not e.holders:
            continue
        device, buf_id = next(iter(e.holders.items()))
        piece = _cut(_get(stores[device], buf_id, device), e.region)
        _paste(data, present, e.region.at(whole), piece)
    data[~present] = 0
    return Value(data, None if present.all() else present)
