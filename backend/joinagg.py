"""Evaluating one join-agg on numpy arrays, at a cost that follows its points.

The node is first *prepared* (:func:`prepare`): the ranges its index expressions must land in
join its guard, and bands (``u >= t, u <= t + 2``) are re-indexed by their offset, so that the
join space holds the points that exist and hardly more.  Its inputs are then strided views over
that space (:mod:`edatalog.backend.operands`), and one of two paths computes it:

- *contraction*, for ``+=`` rules whose body is a product: each factor is evaluated over its own
  indices only, and the factors (with the guard as a 0/1 factor) are contracted pairwise in an
  order chosen by cost (:mod:`edatalog.backend.contract`): a matmul stays a matmul, a
  convolution is an im2col-sized matmul;
- *broadcast, mask, reduce* for everything else, in chunks along one index so that memory stays
  bounded whatever the join space's size.

Presence follows Datalog: a point contributes only where its guard holds and every cell it reads
exists; a result cell exists where some point contributes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from edatalog.backend.contract import contract, squeeze
from edatalog.backend.numpy_ops import apply_op, identity
from edatalog.backend.operands import access_view, index_values
from edatalog.ir import dtypes
from edatalog.ir.affine import Affine
from edatalog.ir.graph import JoinAgg
from edatalog.ir.rewrite import reindex_bands
from edatalog.ir.scalar import Const, IndexValue, Load, Op

CHUNK_POINTS = 1 << 22  # points of the join space the broadcast path evaluates at once

_REDUCE: dict[str, Callable[..., np.ndarray]] = {"sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min}
_FOLD: dict[str, np.ufunc] = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}


@functools.lru_cache(maxsize=4096)
def prepare(node: JoinAgg) -> JoinAgg:
    """The node as evaluators run it: index-expression ranges in the guard, bands re-indexed.
    Same points, same results."""
    guard = node.guard
    for acc in node.inputs:
        for ax in acc.axes:
            guard = guard & ax.range_guard()
    node = replace(node, guard=guard.simplify(node.box))
    return reindex_bands(node)


@dataclass
class _Space:
    """The operands of a node over (a chunk of) its join space."""

    node: JoinAgg
    order: list[str]
    box: dict[str, int]
    cdt: np.dtype
    data: list[np.ndarray]  # per input: a view over the space
    present: list[np.ndarray | None]
    offsets: dict[str, int]  # where the chunk starts, per index (missing: 0)

    def index_array(self, name: str) -> np.ndarray:
        return index_values(self.order, self.box, name, self.cdt) + self.cdt.type(self.offsets.get(name, 0))

    def guard_mask(self) -> np.ndarray | bool:
        guard = self.node.guard
        if self.offsets and not guard.is_true:
            guard = guard.substitute({v: Affine.var(v) + lo for v, lo in self.offsets.items()})
        return guard.mask(self.order, self.box)

    def chunk(self, var: str, lo: int, hi: int) -> _Space:
        k = self.order.index(var)

        def cut(a: np.ndarray) -> np.ndarray:
            return a[(slice(None),) * k + (slice(lo, hi),)] if a.shape[k] != 1 else a

        return _Space(
            self.node,
            self.order,
            {**self.box, var: hi - lo},
            self.cdt,
            [cut(a) for a in self.data],
            [None if p is None else cut(p) for p in self.present],
            {**self.offsets, var: self.offsets.get(var, 0) + lo},
        )


def evaluate_node(
    node: JoinAgg, data: Sequence[np.ndarray], present: Sequence[np.ndarray | None]
) -> tuple[np.ndarray, np.ndarray | None, list[str]]:
    """The node's result over its output indices (in join order), its presence (None: every
    cell), and those indices.  ``data[k]``/``present[k]`` hold input ``k``'s relation laid out
    as the node's access reads it."""
    node = prepare(node)
    order = [i.name for i in node.indices]
    box = node.box
    cdt = dtypes.to_numpy(dtypes.compute_dtype(node.dtype))
    views = [
        access_view(np.asarray(d).astype(cdt, copy=False), acc, order, box)
        for d, acc in zip(data, node.inputs, strict=True)
    ]
    masks = [
        None if p is None else access_view(p, acc, order, box, fill=False)
        for p, acc in zip(present, node.inputs, strict=True)
    ]
    space = _Space(node, order, box, cdt, views, masks, {})
    out_vars = [v for v in order if v not in node.agg_indices]
    if node.agg == "sum" and node.agg_indices:
        result = _contraction(space, out_vars)
        if result is not None:
            return result[0], result[1], out_vars
    value, pres = _broadcast_reduce(space, out_vars)
    return value, pres, out_vars


# -- the scalar DAG ----------------------------------------------------------------------------


def _eval_dag(space: _Space, root: int, memo: dict[int, np.ndarray]) -> np.ndarray:
    """The sub-DAG under ``root``, broadcast over the join indices it depends on."""
    nodes = space.node.expr.nodes
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
            memo[k] = apply_op(n.op, [memo[a] for a in n.args], space.cdt)
        elif isinstance(n, Load):
            memo[k] = space.data[n.input]
        elif isinstance(n, IndexValue):
            memo[k] = space.index_array(n.index)
        else:
            assert isinstance(n, Const)
            memo[k] = np.asarray(n.value, dtype=space.cdt if not isinstance(n.value, bool) else np.bool_)
        stack.pop()
    return memo[root]


def _loads_under(space: _Space, root: int) -> set[int]:
    nodes = space.node.expr.nodes
    return {n.input for k in space.node.expr.under(root) if isinstance(n := nodes[k], Load)}


def _and(masks: Sequence[np.ndarray | bool | None]) -> np.ndarray | bool:
    out: np.ndarray | bool = True
    for m in masks:
        if m is not None and m is not True:
            out = np.logical_and(out, m)
    return out


# -- sums of products ------------------------------------------------------------------------------


def _contraction(space: _Space, out_vars: list[str]) -> tuple[np.ndarray, np.ndarray | None] | None:
    """Sum of a product: each factor over its own indices, contracted pairwise.  None when the
    body is not a product, or a factor is not finite (the masked path then keeps absent points
    from poisoning sums with ``inf * 0``)."""
    split = _split_product(space)
    if split is None:
        return None
    scale, factors = split
    memo: dict[int, np.ndarray] = {}
    values: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    for node_id, power in factors:
        val = _eval_dag(space, node_id, memo)
        if power < 0:
            val = np.divide(space.cdt.type(1), val)
        if space.cdt.kind == "f" and not np.all(np.isfinite(val)):
            return None
        m = _and([space.present[k] for k in _loads_under(space, node_id)])
        if m is not True:
            val = np.where(m, val, space.cdt.type(0))
            masks.append(np.asarray(m))
        values.append(np.asarray(val))
    guard = space.guard_mask()
    if guard is not True:
        g = np.asarray(guard)
        values.append(g.astype(space.cdt))
        masks.append(g)
    value = _sum_over(values, space, out_vars)
    if scale is not None:
        value = value * scale
    # A cell exists where some point has every mask set: count such points with a contraction.
    present = _sum_over([m.astype(np.float32) for m in masks], space, out_vars) > 0 if masks else None
    return value.astype(space.cdt, copy=False), present


def _sum_over(arrays: list[np.ndarray], space: _Space, out_vars: list[str]) -> np.ndarray:
    """The contraction of ``arrays`` (over the join space) onto ``out_vars``; aggregated indices
    no array spans multiply the sum by their extent."""
    operands = [squeeze(a, space.order) for a in arrays]
    result, spanned = contract(operands, out_vars, space.box)
    spanned_all = {v for _, ix in operands for v in ix}
    for v in space.node.agg_indices:
        if v not in spanned_all and space.box[v] != 1:
            result = result * space.box[v]
    shape = [space.box[v] if v in spanned else 1 for v in out_vars]
    return np.broadcast_to(result.reshape(shape), [space.box[v] for v in out_vars])


@dataclass(frozen=True)
class Product:
    """A body written as ``(-1)^negate * prod(constant ^ +-1) * prod(factor ^ +-1)``: node
    numbers of the scalar DAG with their powers; constants do not vary over the join space."""

    factors: tuple[tuple[int, int], ...]
    constants: tuple[tuple[int, int], ...]
    negate: bool


def product_form(node: JoinAgg) -> Product | None:
    """The body as a :class:`Product`, or None when it is not one (or has no varying factor)."""
    nodes = node.expr.nodes
    varying = node.expr.varying()
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

    if not walk(node.expr.root, 1) or not factors:
        return None
    return Product(tuple(factors), tuple(constants), negate)


def factor_indices(node: JoinAgg, root: int) -> tuple[str, ...]:
    """The join indices the sub-DAG under ``root`` varies with, in join order."""
    used: set[str] = set()
    for k in node.expr.under(root):
        n = node.expr.nodes[k]
        if isinstance(n, Load):
            used.update(node.inputs[n.input].indices)
        elif isinstance(n, IndexValue):
            used.add(n.index)
    return tuple(i.name for i in node.indices if i.name in used)


def _split_product(space: _Space) -> tuple[np.ndarray | None, list[tuple[int, int]]] | None:
    """The varying factors of a product body as (node, power), and its constant scale (None
    for 1); None if the body is not a product."""
    form = product_form(space.node)
    if form is None:
        return None
    if not form.constants and not form.negate:
        return None, list(form.factors)
    scale = np.asarray(-1 if form.negate else 1, dtype=space.cdt)
    memo: dict[int, np.ndarray] = {}
    for k, power in form.constants:
        c = _eval_dag(space, k, memo)
        scale = scale * c if power > 0 else scale / c
    return scale, list(form.factors)


# -- everything else ----------------------------------------------------------------------------


def _broadcast_reduce(space: _Space, out_vars: list[str]) -> tuple[np.ndarray, np.ndarray | None]:
    """Evaluate the body over the join space, mask absent points with the aggregation's
    identity, and reduce; in chunks along the longest index, so that no temporary exceeds
    :data:`CHUNK_POINTS` points by more than that index's other extents allow."""
    node = space.node
    out_shape = [space.box[v] for v in out_vars]
    points = math.prod(space.box.values())
    var = max(space.order, key=lambda v: space.box[v], default=None)
    if var is None or points <= CHUNK_POINTS or space.box[var] == 1:
        return _reduce_block(space)
    step = max(1, space.box[var] * CHUNK_POINTS // points)
    kept = var in out_vars
    value: np.ndarray | None = None
    present: np.ndarray | None = None
    any_absent = False
    for lo in range(0, space.box[var], step):
        hi = min(lo + step, space.box[var])
        v, p = _reduce_block(space.chunk(var, lo, hi))
        any_absent |= p is not None
        if kept:
            k = out_vars.index(var)
            if value is None:
                value = np.empty(out_shape, dtype=v.dtype)
                present = np.ones(out_shape, dtype=bool)
            at = (slice(None),) * k + (slice(lo, hi),)
            value[at] = v
            assert present is not None
            present[at] = True if p is None else p
        else:
            assert node.agg is not None
            pres = np.ones(v.shape, dtype=bool) if p is None else p
            ident = identity(node.agg, v.dtype)
            v = np.where(pres, v, ident)
            value = v if value is None else _FOLD[node.agg](value, v)
            present = pres if present is None else present | pres
    assert value is not None
    if not kept:
        assert present is not None
        value = np.where(present, value, 0).astype(value.dtype)
    return value, present if any_absent else None


def _reduce_block(space: _Space) -> tuple[np.ndarray, np.ndarray | None]:
    node = space.node
    full = tuple(space.box[v] for v in space.order)
    value = _eval_dag(space, node.expr.root, {})
    mask = _and([space.guard_mask(), *space.present])
    axes = tuple(space.order.index(v) for v in node.agg_indices)
    if not axes:
        present = None if mask is True else np.broadcast_to(mask, full)
        return np.broadcast_to(value, full), present
    assert node.agg is not None
    ident = identity(node.agg, value.dtype)
    masked = np.broadcast_to(value, full) if mask is True else np.where(mask, value, ident)
    result = _REDUCE[node.agg](np.broadcast_to(masked, full), axis=axes)
    if node.agg in ("sum", "prod") and result.dtype != value.dtype:
        result = result.astype(value.dtype)
    present = None if mask is True else np.any(np.broadcast_to(mask, full), axis=axes)
    return result, present
