"""The reference evaluator: the semantic ground truth every other backend is checked against.

It evaluates a join-agg graph on whole arrays, in the declared precision (``f64`` stays ``f64``;
``f16`` and ``bf16`` compute in ``f32`` and round when stored).  Every relation carries a presence
mask, so Datalog semantics hold exactly: a point contributes only where its guard holds and every
cell it reads exists; a cell with no contribution is absent, and reads as 0 when handed to the
user.  Each rule is computed by :mod:`edatalog.backend.kernels.joinagg` at a cost that follows its points;
relations no later rule reads are dropped unless the caller keeps them.

numpy is the reference; with the torch namespace (:data:`~edatalog.backend.kernels.arrays.TORCH`) the
same code evaluates on tensors, on the inputs' device, and :func:`write_cells` folds a rule's
result into a runtime's own tensor buffers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from edatalog.backend.kernels import ops
from edatalog.backend.kernels.arrays import NUMPY, Array, ArrayOps
from edatalog.backend.kernels.joinagg import evaluate_node
from edatalog.ir import dtypes
from edatalog.ir.graph import AGG_NAMES, AxisMap, Graph, JoinAgg


@dataclass(frozen=True)
class Value:
    """A relation's cells (numpy arrays, or tensors of the namespace that made them).  ``data``
    holds 0 where a cell is absent; ``present`` is None when every cell exists."""

    data: Array
    present: Array | None = None


def evaluate(
    graph: Graph,
    inputs: Mapping[str, Any],
    on_node: Callable[[JoinAgg], None] | None = None,
    keep: Collection[str] | None = None,
    xp: ArrayOps = NUMPY,
) -> dict[str, Value]:
    """Every relation of the graph (or only those in ``keep``), given its inputs and params
    (already in their declared dtypes).  With ``keep``, a relation is freed after the last rule
    that reads it.  ``on_node`` is called after each node, for progress displays.  ``xp`` is the
    array namespace: results are its arrays, on the inputs' device."""
    env: dict[str, Value] = {name: Value(xp.asarray(arr)) for name, arr in inputs.items()}
    device = xp.device_of([v.data for v in env.values()])
    pending: dict[str, _Accumulator] = {}
    remaining = {r.name: len(graph.producers(r.name)) for r in graph.relations if r.kind == "derived"}
    last_read = {acc.relation: k for k, node in enumerate(graph.nodes) for acc in node.inputs}
    with xp.ignore_fp_errors():  # IEEE semantics: overflow gives inf, 0/0 gives nan
        for k, node in enumerate(graph.nodes):
            acc = pending.setdefault(node.out, _Accumulator(graph, node.out, xp, device))
            reads = [env[a.relation] for a in node.inputs]
            acc.add(node, *evaluate_node(node, [v.data for v in reads], [v.present for v in reads], xp))
            del reads
            remaining[node.out] -= 1
            if remaining[node.out] == 0:
                env[node.out] = pending.pop(node.out).finish()
            if keep is not None:
                for a in {a.relation for a in node.inputs}:
                    if last_read[a] == k and a not in keep:
                        env.pop(a, None)
            if on_node is not None:
                on_node(node)
    return env if keep is None else {name: env[name] for name in keep}


def _write_view(arr: Array, axes: tuple[AxisMap, ...], out_vars: list[str], xp: ArrayOps) -> Array | None:
    """A writable view of the contiguous ``arr`` through a head's axes, with its axes in the order
    ``out_vars``; None when the head repeats an index (no strided view can express a diagonal
    write)."""
    parts = [p for ax in axes for p in ax.parts]
    labels = [p.index for p in parts if p.index is not None]
    if len(set(labels)) != len(labels):
        return None
    view = xp.view(arr, [p.extent for p in parts])  # an error, not a silent copy, if ``arr`` is not contiguous
    # The trailing Ellipsis keeps a 0-d result an array view rather than a scalar copy.
    view = view[(*(p.const if p.index is None else slice(None) for p in parts), ...)]
    return xp.transpose(view, [labels.index(v) for v in out_vars])


def write_cells(
    data: Array,
    present_cells: Array | None,
    node: JoinAgg,
    value: Array,
    present: Array | None,
    out_vars: list[str],
    agg: str | None,
    xp: ArrayOps = NUMPY,
) -> None:
    """Fold a node's result (over ``out_vars``) into the cells of ``data`` its head addresses, with
    ``agg`` (None: plain writes), and mark them present in ``present_cells`` (bool; None: nothing to
    mark, every cell is known to exist).  ``data`` and ``present_cells`` are contiguous arrays of
    ``xp``, laid out as the head's axes (a whole relation, or a block's region); they are written
    in place."""
    view = _write_view(data, node.out_axes, out_vars, xp)
    if view is not None:  # the common case: write in place through a strided view
        where = None if present is None else xp.broadcast_to(present, view.shape)
        vals = xp.cast(xp.broadcast_to(value, view.shape), data.dtype)
        xp.assign(view, vals if agg is None else ops.fold(agg, view, vals, xp), where)
        if present_cells is not None:
            pview = _write_view(present_cells, node.out_axes, out_vars, xp)
            assert pview is not None
            xp.assign(pview, True, where)
        return
    # Heads that repeat an index (d[i, i]): write through flat cell numbers.  Every output point
    # has its own cell (each output index is a whole part of the head), so there are no clashes.
    full = [node.box[v] for v in out_vars]
    device = xp.device_of([data])
    int64 = xp.dtype("i64")
    grids: dict[str, Array] = {}
    for k, v in enumerate(out_vars):
        shape = [1] * len(out_vars)
        shape[k] = full[k]
        grids[v] = xp.arange(0, full[k], int64, device).reshape(shape)
    flat = xp.full(full, 0, int64, device)
    stride = 1
    for ax, n in reversed(list(zip(node.out_axes, data.shape, strict=True))):
        flat = flat + ax.affine().evaluate(grids) * stride
        stride *= n
    flat_data = xp.view(data, [math.prod(data.shape)])
    old = flat_data[flat]
    vals = xp.cast(xp.broadcast_to(value, full), data.dtype)
    new = vals if agg is None else ops.fold(agg, old, vals, xp)
    pres = None if present is None else xp.broadcast_to(present, full)
    flat_data[flat] = new if pres is None else xp.where(pres, new, old)
    if present_cells is not None:
        flat_present = xp.view(present_cells, [math.prod(data.shape)])
        flat_present[flat] = True if pres is None else xp.logical_or(flat_present[flat], pres)


class _Accumulator:
    """Combines the results of the rules for one relation with its aggregation operator, in the
    compute dtype; :meth:`finish` rounds to the relation's dtype (``f16``, ``bf16``) once."""

    def __init__(self, graph: Graph, name: str, xp: ArrayOps = NUMPY, device: Any = None) -> None:
        self.rel = graph.relation(name)
        self.xp = xp
        self.cdt = xp.dtype(dtypes.compute_dtype(self.rel.dtype))
        self.agg = AGG_NAMES[self.rel.aggop or "="]
        fill = 0 if self.agg is None else ops.identity(self.agg, self.cdt, xp)
        self.data = xp.full(self.rel.shape, fill, self.cdt, device)
        self.present = xp.full(self.rel.shape, False, xp.bool_, device)

    def add(self, node: JoinAgg, value: Array, present: Array | None, out_vars: list[str]) -> None:
        write_cells(self.data, self.present, node, value, present, out_vars, self.agg, self.xp)

    def finish(self) -> Value:
        xp = self.xp
        out_dt = xp.dtype(self.rel.dtype)
        all_present = xp.all(self.present)
        if not all_present:
            xp.masked_fill(self.data, ~self.present, 0)
        return Value(xp.cast(self.data, out_dt), None if all_present else self.present)
