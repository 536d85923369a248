"""The reference evaluator: the semantic ground truth every other backend is checked against.

It evaluates a join-agg graph on whole numpy arrays, in the declared precision (``f64`` stays
``f64``; ``f16`` and ``bf16`` compute in ``f32`` and round when stored).  Every relation carries
a presence mask, so Datalog semantics hold exactly: a point contributes only where its guard
holds and every cell it reads exists; a cell with no contribution is absent, and reads as 0 when
handed to the user.  Each rule is computed by :mod:`edatalog.backend.joinagg` at a cost that
follows its points; relations no later rule reads are dropped unless the caller keeps them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import numpy as np

from edatalog.backend.joinagg import evaluate_node
from edatalog.backend.numpy_ops import identity
from edatalog.ir import dtypes
from edatalog.ir.graph import AGG_NAMES, AxisMap, Graph, JoinAgg


@dataclass(frozen=True)
class Value:
    """A relation's cells.  ``data`` holds 0 where a cell is absent; ``present`` is None when every
    cell exists."""

    data: np.ndarray
    present: np.ndarray | None = None


def evaluate(
    graph: Graph,
    inputs: Mapping[str, np.ndarray],
    on_node: Callable[[JoinAgg], None] | None = None,
    keep: Collection[str] | None = None,
) -> dict[str, Value]:
    """Every relation of the graph (or only those in ``keep``), given its inputs and params
    (already in their declared dtypes).  With ``keep``, a relation is freed after the last rule
    that reads it.  ``on_node`` is called after each node, for progress displays."""
    env: dict[str, Value] = {name: Value(np.asarray(arr)) for name, arr in inputs.items()}
    pending: dict[str, _Accumulator] = {}
    remaining = {r.name: len(graph.producers(r.name)) for r in graph.relations if r.kind == "derived"}
    last_read = {acc.relation: k for k, node in enumerate(graph.nodes) for acc in node.inputs}
    with np.errstate(all="ignore"):  # IEEE semantics: overflow gives inf, 0/0 gives nan
        for k, node in enumerate(graph.nodes):
            acc = pending.setdefault(node.out, _Accumulator(graph, node.out))
            reads = [env[a.relation] for a in node.inputs]
            acc.add(node, *evaluate_node(node, [v.data for v in reads], [v.present for v in reads]))
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


_COMBINE: dict[str, np.ufunc] = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}


def _write_view(arr: np.ndarray, axes: tuple[AxisMap, ...], out_vars: list[str]) -> np.ndarray | None:
    """A writable view of the contiguous ``arr`` through a head's axes, with its axes in the order
    ``out_vars``; None when the head repeats an index (no strided view can express a diagonal
    write)."""
    parts = [p for ax in axes for p in ax.parts]
    labels = [p.index for p in parts if p.index is not None]
    if len(set(labels)) != len(labels):
        return None
    view = arr.reshape([p.extent for p in parts])
    assert np.may_share_memory(view, arr), "reshape copied: the accumulator must be contiguous"
    # The trailing Ellipsis keeps a 0-d result an array view rather than a scalar copy.
    view = view[(*(p.const if p.index is None else slice(None) for p in parts), ...)]
    return view.transpose([labels.index(v) for v in out_vars])


def write_cells(
    data: np.ndarray,
    present_cells: np.ndarray,
    node: JoinAgg,
    value: np.ndarray,
    present: np.ndarray | None,
    out_vars: list[str],
    agg: str | None,
) -> None:
    """Fold a node's result (over ``out_vars``) into the cells of ``data`` its head addresses, with
    ``agg`` (None: plain writes), and mark them present.  ``data`` is laid out as the head's axes
    (a whole relation, or a block's region)."""
    view = _write_view(data, node.out_axes, out_vars)
    if view is not None:  # the common case: write in place through a strided view
        where: np.ndarray | bool = True if present is None else np.broadcast_to(present, view.shape)
        vals = np.broadcast_to(value, view.shape).astype(data.dtype, copy=False)
        if agg is None:
            np.copyto(view, vals, where=where)
        else:
            _COMBINE[agg](view, vals, out=view, where=where)
        pview = _write_view(present_cells, node.out_axes, out_vars)
        assert pview is not None
        np.logical_or(pview, where, out=pview)
        return
    # Heads that repeat an index (d[i, i]): write through flat cell numbers.
    box = node.box
    coords = []
    for ax in node.out_axes:
        vals_of = {}
        for k, v in enumerate(out_vars):
            shape = [1] * len(out_vars)
            shape[k] = box[v]
            vals_of[v] = np.arange(box[v]).reshape(shape)
        coords.append(np.broadcast_to(np.asarray(ax.affine().evaluate(vals_of)), value.shape))
    flat = np.ravel_multi_index(tuple(coords), data.shape) if coords else np.zeros(value.shape, dtype=np.intp)
    pres = np.ones(value.shape, dtype=bool) if present is None else np.broadcast_to(present, value.shape)
    flat_data = data.reshape(-1)
    cells = flat[pres]
    vals = value[pres].astype(data.dtype, copy=False)
    flat_data[cells] = vals if agg is None else _COMBINE[agg](flat_data[cells], vals)
    present_cells.reshape(-1)[cells] = True


class _Accumulator:
    """Combines the results of the rules for one relation with its aggregation operator."""

    def __init__(self, graph: Graph, name: str) -> None:
        self.rel = graph.relation(name)
        self.cdt = dtypes.to_numpy(dtypes.compute_dtype(self.rel.dtype))
        self.agg = AGG_NAMES[self.rel.aggop or "="]
        fill = 0 if self.agg is None else identity(self.agg, self.cdt)
        self.data = np.full(self.rel.shape, fill, dtype=self.cdt)
        self.present = np.zeros(self.rel.shape, dtype=bool)

    def add(self, node: JoinAgg, value: np.ndarray, present: np.ndarray | None, out_vars: list[str]) -> None:
        write_cells(self.data, self.present, node, value, present, out_vars, self.agg)

    def finish(self) -> Value:
        out_dt = dtypes.to_numpy(self.rel.dtype)
        all_present = bool(self.present.all())
        if not all_present:
            self.data[~self.present] = 0
        return Value(self.data.astype(out_dt, copy=False), None if all_present else self.present)
