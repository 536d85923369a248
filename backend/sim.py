"""The simulated multi-device executor: runs a schedule's per-device programs in one process.

Each device has its own store of buffers.  A task reads only buffers on its own device (anything
else is a :class:`SimError`, a bug in exchange synthesis), so a correct result proves the
synthesized exchanges deliver everything each block needs.  Blocks are evaluated by the reference
evaluator, which makes the simulator's outputs directly comparable with the reference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from edatalog.backend.exchange import Combine, Compute, Entry, Load, Schedule, Send
from edatalog.backend.joinagg import evaluate_node
from edatalog.backend.numpy_ops import identity
from edatalog.backend.reference import Value, write_cells
from edatalog.ir import dtypes
from edatalog.ir.graph import AGG_NAMES, JoinAgg
from edatalog.ir.regions import Region
from edatalog.ir.rewrite import restrict


class SimError(Exception):
    """A device touched data it does not hold: exchange synthesis is wrong."""


@dataclasses.dataclass
class _Buffer:
    region: Region
    data: np.ndarray
    present: np.ndarray | None  # None: every cell present


def run(schedule: Schedule, inputs: Mapping[str, np.ndarray]) -> dict[str, Value]:
    """Execute ``schedule`` on the given inputs and params; returns the outputs, gathered."""
    graph = schedule.graph
    stores: list[dict[int, _Buffer]] = [{} for _ in range(schedule.plan.n_devices)]
    nodes = {n.name: n for n in graph.nodes}
    rel_dtype = {r.name: r.dtype for r in graph.relations}
    with np.errstate(all="ignore"):
        for task in schedule.tasks:
            store = stores[task.device]
            if isinstance(task, Load):
                full = np.asarray(inputs[task.relation])
                store[task.id] = _Buffer(task.region, Region.whole(full.shape).cut(full, task.region), None)
            elif isinstance(task, Compute):
                store[task.id] = _compute(nodes[task.node], task, store, rel_dtype)
            elif isinstance(task, Send):
                src = _get(store, task.source, task.device)
                stores[task.dst][task.id] = _cut(src, task.region)
            elif isinstance(task, Combine):
                rel = graph.relation(task.relation)
                parts = [_cut(_get(store, b, task.device), task.region) for b in task.sources]
                store[task.id] = _fold(parts, AGG_NAMES[rel.aggop or "="], dtypes.compute_dtype(rel.dtype))
    return {name: _gather(schedule, name, entries, stores) for name, entries in schedule.outputs.items()}


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


def _compute(node: JoinAgg, task: Compute, store: dict[int, _Buffer], graph_dtype: Mapping[str, str]) -> _Buffer:
    block = restrict(node, task.ranges)  # the block as a join-agg of its own, over its parts
    data, present = [], []
    for acc, parts in zip(node.inputs, task.reads, strict=True):
        need = Region.through(acc.axes, task.ranges)
        operand = _assemble(need, parts, store, task.device, dtypes.to_numpy(graph_dtype[acc.relation]))
        data.append(operand.data)
        present.append(operand.present)
    value, pres, out_vars = evaluate_node(block, data, present)
    cdt = dtypes.to_numpy(dtypes.compute_dtype(node.dtype))
    out = np.zeros(task.out.shape, dtype=cdt)
    cells = np.zeros(task.out.shape, dtype=bool)
    write_cells(out, cells, block, value, pres, out_vars, None)
    return _Buffer(task.out, out, None if cells.all() else cells)


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
