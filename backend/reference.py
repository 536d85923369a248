"""The reference evaluator: the semantic ground truth every other backend is checked against.

It evaluates a join-agg graph on whole numpy arrays, in the declared precision (``f64`` stays
``f64``; ``f16`` and ``bf16`` compute in ``f32`` and round when stored).  Every relation carries
a presence mask, so Datalog semantics hold exactly: a point contributes only where its guard
holds and every cell it reads exists; a cell with no contribution is absent, and reads as 0 when
handed to the user.

Two paths compute a node:

- *factorized einsum*, for ``+=`` rules whose body is a product: each factor is evaluated over
  just its own indices, then one ``numpy.einsum`` contracts them (a matmul stays a matmul);
- *broadcast-then-reduce* for everything else: the body is evaluated over the join space, masked
  with the aggregation's identity, and reduced.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from edatalog.backend.numpy_ops import apply_op, identity
from edatalog.ir import dtypes
from edatalog.ir.affine import Affine
from edatalog.ir.graph import AGG_NAMES, Access, AxisMap, Graph, JoinAgg
from edatalog.ir.scalar import Const, IndexValue, Load, Op

_LETTERS = string.ascii_letters
_REDUCE: dict[str, Callable[..., np.ndarray]] = {"sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min}


@dataclass(frozen=True)
class Value:
    """A relation's cells.  ``data`` holds 0 where a cell is absent; ``present`` is None when every
    cell exists."""

    data: np.ndarray
    present: np.ndarray | None = None


def evaluate(
    graph: Graph, inputs: Mapping[str, np.ndarray], on_node: Callable[[JoinAgg], None] | None = None
) -> dict[str, Value]:
    """Every relation of the graph, given its inputs and params (already in their declared dtypes).
    ``on_node`` is called after each node, for progress displays."""
    env: dict[str, Value] = {name: Value(np.asarray(arr)) for name, arr in inputs.items()}
    pending: dict[str, _Accumulator] = {}
    remaining = {r.name: len(graph.producers(r.name)) for r in graph.relations if r.kind == "derived"}
    with np.errstate(all="ignore"):  # IEEE semantics: overflow gives inf, 0/0 gives nan
        for node in graph.nodes:
            acc = pending.setdefault(node.out, _Accumulator(graph, node.out))
            acc.add(node, *evaluate_node(node, [env[a.relation] for a in node.inputs]))
            remaining[node.out] -= 1
            if remaining[node.out] == 0:
                env[node.out] = pending.pop(node.out).finish()
            if on_node is not None:
                on_node(node)
    return env


# -- operands ------------------------------------------------------------------------------------


def _view(arr: np.ndarray, acc: Access, order: list[str], box: Mapping[str, int]) -> np.ndarray:
    """``arr`` read through ``acc``, as an array over the join indices ``order`` (1 for the indices
    the access does not use).  A view whenever numpy allows."""
    parts = [p for ax in acc.axes for p in ax.parts]
    arr = arr.reshape([p.extent for p in parts])
    arr = arr[tuple(p.const if p.index is None else slice(None) for p in parts)]
    labels = [p.index for p in parts if p.index is not None]
    used = [v for v in order if v in labels]
    sub_in = "".join(_LETTERS[order.index(v)] for v in labels)
    sub_out = "".join(_LETTERS[order.index(v)] for v in used)
    if sub_in != sub_out:
        arr = np.einsum(f"{sub_in}->{sub_out}", arr)
    return arr.reshape([box[v] if v in labels else 1 for v in order])


@dataclass
class _Operands:
    node: JoinAgg
    order: list[str]
    cdt: np.dtype
    data: list[np.ndarray]
    present: list[np.ndarray | None]
    offsets: Mapping[str, int]  # where each index of a block starts in the whole join space

    @property
    def box(self) -> dict[str, int]:
        return self.node.box

    def index_array(self, name: str) -> np.ndarray:
        shape = [1] * len(self.order)
        k = self.order.index(name)
        shape[k] = self.box[name]
        lo = self.offsets.get(name, 0)
        return np.arange(lo, lo + self.box[name], dtype=self.cdt).reshape(shape)

    def guard_mask(self) -> np.ndarray | bool:
        guard = self.node.guard
        if self.offsets and not guard.is_true:
            guard = guard.substitute({v: Affine.var(v) + self.offsets.get(v, 0) for v in guard.vars})
        return guard.mask(self.order, self.box)


def _operands(node: JoinAgg, inputs: Sequence[Value], offsets: Mapping[str, int]) -> _Operands:
    order = [i.name for i in node.indices]
    cdt = dtypes.to_numpy(dtypes.compute_dtype(node.dtype))
    data, present = [], []
    for acc, val in zip(node.inputs, inputs, strict=True):
        arr = _view(val.data, acc, order, node.box)
        data.append(arr.astype(cdt, copy=False))  # f16 and bf16 inputs widen to f32
        present.append(None if val.present is None else _view(val.present, acc, order, node.box))
    return _Operands(node, order, cdt, data, present, offsets)


# -- scalar DAG ------------------------------------------------------------------------------------


def _eval_dag(ops: _Operands, root: int, memo: dict[int, np.ndarray]) -> np.ndarray:
    """Evaluate the sub-DAG under ``root`` with numpy broadcasting over the join indices."""
    nodes = ops.node.expr.nodes
    stack = [root]
    while stack:
        k = stack[-1]
        if k in memo:
            stack.pop()
            continue
        n = nodes[k]
        if isinstance(n, Op):
            missing = [a for a in n.args if a not in memo]
            if missing:
                stack.extend(missing)
                continue
            memo[k] = apply_op(n.op, [memo[a] for a in n.args], ops.cdt)
        elif isinstance(n, Load):
            memo[k] = ops.data[n.input]
        elif isinstance(n, IndexValue):
            memo[k] = ops.index_array(n.index)
        else:
            assert isinstance(n, Const)
            memo[k] = np.asarray(n.value, dtype=ops.cdt if not isinstance(n.value, bool) else np.bool_)
        stack.pop()
    return memo[root]


def _loads_under(ops: _Operands, root: int) -> set[int]:
    nodes = ops.node.expr.nodes
    out: set[int] = set()
    stack, seen = [root], set()
    while stack:
        k = stack.pop()
        if k in seen:
            continue
        seen.add(k)
        n = nodes[k]
        if isinstance(n, Load):
            out.add(n.input)
        elif isinstance(n, Op):
            stack.extend(n.args)
    return out


def _and(masks: list[np.ndarray | bool | None]) -> np.ndarray | bool:
    out: np.ndarray | bool = True
    for m in masks:
        if m is not None and m is not True:
            out = np.logical_and(out, m)
    return out


# -- node evaluation -------------------------------------------------------------------------------


def evaluate_node(
    node: JoinAgg, inputs: Sequence[Value], offsets: Mapping[str, int] | None = None
) -> tuple[np.ndarray, np.ndarray | None, list[str]]:
    """The node's result over its output indices (join order), its presence, and those indices.

    ``inputs`` hold each input's cells laid out as the node's access reads them: whole relations,
    or, for a block of a plan, just the block's region with ``offsets`` giving where the block's
    index ranges start (index values and guards see global positions)."""
    ops = _operands(node, inputs, offsets or {})
    out_vars = [v for v in ops.order if v not in node.agg_indices]
    if node.agg == "sum" and node.agg_indices:
        result = _factorized(ops, out_vars)
        if result is not None:
            return result[0], result[1], out_vars
    value, present = _broadcast_reduce(ops)
    return value, present, out_vars


def _broadcast_reduce(ops: _Operands) -> tuple[np.ndarray, np.ndarray | None]:
    node = ops.node
    full = tuple(ops.box[v] for v in ops.order)
    value = _eval_dag(ops, node.expr.root, {})
    mask = _and([ops.guard_mask(), *ops.present])
    axes = tuple(ops.order.index(v) for v in node.agg_indices)
    if not axes:
        present = None if mask is True else np.broadcast_to(mask, full)
        return np.broadcast_to(value, full), present
    assert node.agg is not None
    ident = identity(node.agg, value.dtype)
    masked = np.broadcast_to(value, full) if mask is True else np.where(mask, value, ident)
    masked = np.broadcast_to(masked, full)
    reduce = _REDUCE[node.agg]
    result = reduce(masked, axis=axes)
    if node.agg in ("sum", "prod") and result.dtype != value.dtype:
        result = result.astype(value.dtype)
    present = None if mask is True else np.any(np.broadcast_to(mask, full), axis=axes)
    return result, present


def _factorized(ops: _Operands, out_vars: list[str]) -> tuple[np.ndarray, np.ndarray | None] | None:
    """Sum of a product: evaluate each factor over its own indices, contract with einsum.
    Returns None when the body is not a product, or a factor is not finite (the masked
    broadcast path then keeps absent points from poisoning sums with inf * 0)."""
    split = _split_product(ops)
    if split is None:
        return None
    scale, factors = split
    memo: dict[int, np.ndarray] = {}
    arrays: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    for node_id, power in factors:
        val = _eval_dag(ops, node_id, memo)
        if power < 0:
            val = np.divide(ops.cdt.type(1), val)
        if not np.all(np.isfinite(val)) and ops.cdt.kind == "f":
            return None
        m = _and([ops.present[k] for k in _loads_under(ops, node_id)])
        if m is not True:
            val = np.where(m, val, ops.cdt.type(0))
            masks.append(np.asarray(m))
        arrays.append(np.asarray(val))
    guard = ops.guard_mask()
    if guard is not True:
        g = np.asarray(guard)
        arrays.append(g.astype(ops.cdt))
        masks.append(g)
    value = _contract(arrays, ops, out_vars)
    if scale is not None:
        value = value * scale
    # A cell exists if some point has every mask set: a boolean einsum is exactly "or of ands".
    present = _contract(masks, ops, out_vars) if masks else None
    return value.astype(ops.cdt, copy=False), present


def _contract(arrays: list[np.ndarray], ops: _Operands, out_vars: list[str]) -> np.ndarray:
    """einsum over the join indices; indices no operand spans are summed as extents or broadcast."""
    subs = []
    spanned: set[str] = set()
    squeezed = []
    for a in arrays:
        a = np.asarray(a).reshape([1] * (len(ops.order) - a.ndim) + list(a.shape))
        keep = [k for k, v in enumerate(ops.order) if a.shape[k] != 1 or ops.box[v] == 1]
        squeezed.append(a.reshape([a.shape[k] for k in keep]))
        subs.append("".join(_LETTERS[k] for k in keep))
        spanned.update(ops.order[k] for k in keep)
    out_sub = "".join(_LETTERS[ops.order.index(v)] for v in out_vars if v in spanned)
    result = np.einsum(",".join(subs) + "->" + out_sub, *squeezed, optimize=True)
    # Aggregated indices no operand spans multiply a sum by their extent (an "or" is unchanged).
    if result.dtype != np.bool_:
        for v in ops.node.agg_indices:
            if v not in spanned:
                result = result * ops.box[v]
    shape = [ops.box[v] if v in spanned else 1 for v in out_vars]
    return np.broadcast_to(result.reshape(shape), [ops.box[v] for v in out_vars])


def _split_product(ops: _Operands) -> tuple[np.ndarray | None, list[tuple[int, int]]] | None:
    """The body as ``scale * prod(factor ^ +-1)``: the constant scale (None for 1) and the
    varying factors as (node, power).  None if the body is not a product."""
    nodes = ops.node.expr.nodes
    varying = ops.node.expr.varying()
    factors: list[tuple[int, int]] = []
    constants: list[tuple[int, int]] = []
    negate = False

    def walk(k: int, power: int) -> bool:
        nonlocal negate
        n = nodes[k]
        if k not in varying:
            constants.append((k, power))
            return True
        if isinstance(n, Op) and n.op == "mul":
            return walk(n.args[0], power) and walk(n.args[1], power)
        if isinstance(n, Op) and n.op == "div":
            return walk(n.args[0], power) and walk(n.args[1], -power)
        if isinstance(n, Op) and n.op == "neg":
            negate = not negate
            return walk(n.args[0], power)
        factors.append((k, power))
        return True

    if not walk(ops.node.expr.root, 1) or not factors:
        return None
    if not constants and not negate:
        return None, factors
    scale = np.asarray(-1 if negate else 1, dtype=ops.cdt)
    memo: dict[int, np.ndarray] = {}
    for k, power in constants:
        c = _eval_dag(ops, k, memo)
        scale = scale * c if power > 0 else scale / c
    return scale, factors


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
