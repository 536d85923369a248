"""Evaluating one join-agg, at a cost that follows its points, on numpy arrays or torch tensors.

The node is first *prepared* (:func:`prepare`): the ranges its index expressions must land in
join its guard, and bands (``u >= t, u <= t + 2``) are re-indexed by their offset, so that the
join space holds the points that exist and hardly more.  Its inputs are then strided views over
that space (:mod:`edatalog.backend.kernels.operands`), and one of two paths computes it:

- *contraction*, for ``+=`` rules whose body is a product: each factor is evaluated over its own
  indices only, and the factors (with the guard as a 0/1 factor) are contracted pairwise in an
  order chosen by cost (:mod:`edatalog.backend.kernels.contract`): a matmul stays a matmul, a
  convolution is an im2col-sized matmul;
- *broadcast, mask, reduce* for everything else, in chunks along one index so that memory stays
  bounded whatever the join space's size.

Presence follows Datalog: a point contributes only where its guard holds and every cell it reads
exists; a result cell exists where some point contributes.

The same code runs on numpy (the reference, :data:`~edatalog.backend.kernels.arrays.NUMPY`) and on torch
(:data:`~edatalog.backend.kernels.arrays.TORCH`, on the inputs' device): the namespace is an argument, so
a torch runtime computes the reference's algorithm step for step, in the same compute dtype
(``f16``/``bf16`` rules in ``f32``).
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from edatalog.backend.kernels import ops
from edatalog.backend.kernels import routed as routed_kernel
from edatalog.backend.kernels.arrays import NUMPY, Array, ArrayOps
from edatalog.backend.kernels.contract import contract, squeeze
from edatalog.backend.kernels.operands import access_view, guard_mask, index_values
from edatalog.errors import EdlError
from edatalog.ir import dtypes
from edatalog.ir.affine import Affine
from edatalog.ir.forms import carried_filter, product_form, routed_form, without_full_filters, without_lookup
from edatalog.ir.graph import JoinAgg, Lookup
from edatalog.ir.rewrite import reindex_bands
from edatalog.ir.scalar import Const, IndexValue, Load, Op, ScalarExpr

CHUNK_POINTS = 1 << 22  # points of the join space the broadcast path evaluates at once


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
    cdt: Any  # the compute dtype, as ``xp`` names it
    xp: ArrayOps
    device: Any
    data: list[Array]  # per input: a view over the space
    present: list[Array | None]
    offsets: dict[str, int]  # where the chunk starts, per index (missing: 0)
    track_presence: bool = True  # False: the result's presence is known beforehand (``Known``)
    owned: frozenset[int] = frozenset()  # inputs whose ``data`` no one else holds (a converted copy)
    looked_up: dict[str, Array] = field(default_factory=dict)  # per looked-up index: its value at each point
    within: Array | None = None  # where the looked-up values fall in the block's part (None: everywhere)
    hits: Array | None = None  # a scatter's points whose head cell is in the block's part (None: all)

    def index_array(self, name: str) -> Array:
        value = self.looked_up.get(name)
        if value is not None:
            return self.xp.cast(value, self.cdt)
        lo = self.offsets.get(name, 0)
        return index_values(self.order, self.box, name, self.cdt, self.xp, lo, self.device)

    def guard_mask(self) -> Array | None:
        """Where the guard holds; None: everywhere."""
        guard = self.node.guard
        if self.offsets and not guard.is_true:
            guard = guard.substitute({v: Affine.var(v) + lo for v, lo in self.offsets.items()})
        mask = guard_mask(guard, self.order, self.box, self.xp, self.device)
        if self.within is None:
            return mask
        return self.within if mask is None else self.xp.logical_and(mask, self.within)

    def scalar(self, value: float | int | bool) -> Array:
        return self.xp.scalar(value, self.cdt, self.device)

    def chunk(self, var: str, lo: int, hi: int) -> _Space:
        k = self.order.index(var)

        def cut(a: Array) -> Array:
            return a[(slice(None),) * k + (slice(lo, hi),)] if a.shape[k] != 1 else a

        # An input not cut (size 1 along ``var``) is shared by every chunk: no longer writable.
        owned = frozenset(j for j in self.owned if self.data[j].shape[k] != 1)

        return _Space(
            self.node,
            self.order,
            {**self.box, var: hi - lo},
            self.cdt,
            self.xp,
            self.device,
            [cut(a) for a in self.data],
            [None if p is None else cut(p) for p in self.present],
            {**self.offsets, var: self.offsets.get(var, 0) + lo},
            self.track_presence,
            owned,
            {name: cut(a) for name, a in self.looked_up.items()},
            None if self.within is None else cut(self.within),
            None if self.hits is None else cut(self.hits),
        )


class Known:
    """Presence decided before running (see :func:`known_presence`): the inputs' absent cells
    are those their supports say, so the guard alone excludes every point that reads one, and
    the result's cells that exist are ``present`` (None: every cell)."""

    def __init__(self, present: Array | None) -> None:
        self.present = present


def evaluate_node(
    node: JoinAgg,
    data: Sequence[Array],
    present: Sequence[Array | None],
    xp: ArrayOps = NUMPY,
    known: Known | None = None,
) -> tuple[Array, Array | None, list[str]]:
    """The node's result over its output indices (in join order), in its compute dtype (a
    native half-precision GEMM's, see :func:`native_gemm`, in the node's own dtype), its
    presence (None: every cell), and those indices.  ``data[k]``/``present[k]`` hold input
    ``k``'s relation laid out as the node's access reads it (0 where absent), as arrays of
    ``xp`` (numpy arrays are accepted by every namespace); results are ``xp``'s, on the inputs'
    device.  With ``known`` the presence masks are neither read nor computed."""
    node = without_full_filters(prepare(node))
    carried = carried_filter(node)
    if carried is not None:
        return _evaluate_carrying(node, carried, data, present, xp, known)
    if known is not None:
        present = [None] * len(present)
    order = [i.name for i in node.indices]
    box = node.box
    device = xp.device_of(data)
    native = native_gemm(node, present, xp, device) or native_arithmetic(node, [_dtype(d) for d in data], present, xp)
    cdt = xp.dtype(node.dtype if native else dtypes.compute_dtype(node.dtype))
    converted = [xp.asarray(d, cdt, device) for d in data]
    views = [access_view(c, acc, order, box, xp=xp) for c, acc in zip(converted, node.inputs, strict=True)]
    owned = frozenset(k for k, (d, c) in enumerate(zip(data, converted, strict=True)) if xp.is_copy(c, d))
    masks = [
        None if p is None else access_view(xp.asarray(p, xp.bool_, device), acc, order, box, fill=False, xp=xp)
        for p, acc in zip(present, node.inputs, strict=True)
    ]
    routed = routed_form(node) if node.lookups and xp.name == "torch" else None
    if routed is not None and all(m is None for k, m in enumerate(masks) if k != routed.gathered):
        # The routed rows may be absent in part (a block of an expert-parallel chain reads the
        # rows routed to its experts only): an absent row adds nothing and is not dispatched.
        lk = node.lookups[routed.lookup]
        routes = _looked_up_values(node, lk, data, order, box, None, xp, device)
        scale = constant_scale(node, cdt, xp, device)
        value, pres, out_vars = routed_kernel.evaluate_routed(
            node, routed, routes, converted, scale, xp, device, masks[routed.gathered]
        )
        return value, (pres if known is None else known.present), out_vars
    looked_up: dict[str, Array] = {}
    within = hits = None
    full_box = box
    if node.lookups:
        box, views, masks, looked_up, within, hits = _gather(node, data, order, box, views, masks, xp, device)
    space = _Space(node, order, box, cdt, xp, device, views, masks, {}, known is None, owned, looked_up, within, hits)
    out_vars = [v for v in order if v not in node.agg_indices]
    if node.looked_up & set(out_vars):
        value, pres = _scatter(space, out_vars, full_box)
        return value, (pres if known is None else known.present), out_vars
    result = _contraction(space, out_vars) if node.agg == "sum" and node.agg_indices else None
    if native and result is not None:  # a GEMM: native_gemm saw a product of two loads, nothing absent
        value, pres = result
        return value, pres, out_vars  # already rounded to the node's dtype, once
    value, pres = result if result is not None else _broadcast_reduce(space, out_vars)
    return value, (pres if known is None else known.present), out_vars


def _evaluate_carrying(
    node: JoinAgg, lk: Lookup, data: Sequence[Array], present: Sequence[Array | None], xp: ArrayOps, known: Known | None
) -> tuple[Array, Array | None, list[str]]:
    """A block of a rule that carries a route, over part of the experts
    (:func:`edatalog.ir.forms.carried_filter`): the rule as if the filter were not written (an
    elementwise rule stays elementwise, with no gather: a Mixtral-shaped ``a`` block took 7.7
    ms here, against 78 ms by the lookup path), its cells kept where the route falls in the
    block's part."""
    bare = without_lookup(node, lk)
    value, pres, out_vars = evaluate_node(bare, data, present, xp)
    order = [i.name for i in bare.indices]
    box = bare.box
    device = xp.device_of(data)
    raw = _looked_up_values(bare, lk, data, order, box, None, xp, device) - lk.offset
    inside = xp.logical_and(raw >= 0, raw < node.box[lk.index])
    inside = xp.view(xp.contiguous(inside), [n for n, v in zip(inside.shape, order, strict=True) if v in out_vars])
    pres = inside if pres is None else xp.logical_and(pres, inside)
    return value, (pres if known is None else known.present), out_vars


def gathers(node: JoinAgg) -> tuple[Lookup, ...]:
    """The lookups of ``node`` that read (the looked-up index is not in the head): over part of
    the index's range, which cells exist depends on the values.  A scatter's (an index of the
    head) has every cell of its part, whatever the values."""
    head = set(node.out_indices)
    return tuple(lk for lk in node.lookups if lk.index not in head)


def _gather(
    node: JoinAgg,
    data: Sequence[Array],
    order: list[str],
    box: dict[str, int],
    views: list[Array],
    masks: list[Array | None],
    xp: ArrayOps,
    device: Any,
) -> tuple[dict[str, int], list[Array], list[Array | None], dict[str, Array], Array | None, Array | None]:
    """The join space with each looked-up index resolved: at every point, the index takes the
    value its input holds there, so the inputs it indexes are read there (a gather) and its
    axis shrinks to one place.  A value outside the index's full range is an error; one outside
    this block's part of it (a block over part of the vocabulary) leaves the point absent here,
    or, for an index of the head (a scatter), adds nothing here.  Returns the space's box, the
    inputs' views and presence, each looked-up index's value at every point (relative to the
    block, as the rule's index values are; a scatter's clamped into the part), where the
    gathers' values fall in this block's part and where the scatters' do (None: everywhere),
    masks like the guard's."""
    box, views, masks = dict(box), list(views), list(masks)
    values: dict[str, Array] = {}
    within: Array | None = None  # where every gathered value falls in this block's part
    hits: Array | None = None  # where every scattered value does
    head = set(node.out_indices)
    i64 = xp.dtype("i64")
    resolved = []
    for lk in node.lookups:
        raw = _looked_up_values(node, lk, data, order, box, masks[lk.input], xp, device)
        value = raw - lk.offset if lk.offset else raw
        size = box[lk.index]
        partial = lk.offset > 0 or size < lk.extent
        inside = xp.logical_and(value >= 0, value < size) if partial else None
        where = xp.where(inside, value, xp.constant(0, i64)) if inside is not None else value
        resolved.append((lk, value, inside, where))
    for j, other in enumerate(node.inputs):
        picks = [(order.index(lk.index), where) for lk, _, _, where in resolved if lk.index in other.indices]
        if picks:
            views[j] = _take_along_many(xp, views[j], picks)
            mask = masks[j]
            masks[j] = None if mask is None else _take_along_many(xp, mask, picks)
    for lk, value, inside, where in resolved:
        box[lk.index] = 1
        if lk.index in head:  # a scatter: the point adds to the cell its value names, if here
            values[lk.index] = where
            if inside is not None:
                hits = inside if hits is None else xp.logical_and(hits, inside)
            continue
        if inside is not None:  # the point's own presence, whether or not an input is gathered
            within = inside if within is None else xp.logical_and(within, inside)
        values[lk.index] = value
    return box, views, masks, values, within, hits


def _take_along_many(xp: ArrayOps, a: Array, picks: list[tuple[int, Array]]) -> Array:
    """``a`` read at several looked-up axes at once (``ye[g, e, c, d]`` at ``e = route[g, s, k]``
    and ``c = slot[g, s, k]``): one gather over those axes flattened.  One gather per axis would
    first make the join space over the other looked-up axes (the whole ``c`` range at every
    point: ``C`` times the result).  Each index is of size 1 along every picked axis."""
    if len(picks) == 1:
        axis, where = picks[0]
        return xp.take_along(a, where, axis)
    axes = [axis for axis, _ in picks]
    rest = [k for k in range(len(a.shape)) if k not in axes]
    perm = rest + axes
    sizes = [a.shape[axis] for axis in axes]
    flat = xp.contiguous(xp.transpose(a, perm))  # the input's size: its own cells, rearranged
    flat = xp.view(flat, [a.shape[k] for k in rest] + [math.prod(sizes)])
    index: Array | None = None
    stride = 1
    for (_, where), n in reversed(list(zip(picks, sizes, strict=True))):  # row-major: the last fastest
        term = where * stride if stride != 1 else where
        index = term if index is None else index + term
        stride *= n
    assert index is not None
    index = xp.contiguous(xp.transpose(index, perm))
    index = xp.view(index, [*index.shape[: len(rest)], 1])
    out = xp.take_along(flat, index, len(rest))
    out = xp.view(xp.contiguous(out), list(out.shape[:-1]) + [1] * len(axes))
    back = sorted(range(len(perm)), key=perm.__getitem__)
    return xp.transpose(out, back)


def _looked_up_values(
    node: JoinAgg,
    lk: Lookup,
    data: Sequence[Array],
    order: list[str],
    box: dict[str, int],
    mask: Array | None,
    xp: ArrayOps,
    device: Any,
) -> Array:
    """The values ``lk`` looks up, over the join space (i64), each checked to name a place."""
    acc = node.inputs[lk.input]
    raw = access_view(xp.asarray(data[lk.input], xp.dtype("i64"), device), acc, order, box, xp=xp)
    bad = xp.logical_or(raw < 0, raw >= lk.extent)
    if mask is not None:  # an absent cell names no place
        bad = xp.logical_and(bad, mask)
    if xp.argwhere_first(bad) is not None:
        raise EdlError(
            f"rule '{node.out}': a value of '{acc.relation}' looked up as index '{lk.index}' is "
            f"out of range: the index runs 0 .. {lk.extent - 1}",
            help=f"every value of '{acc.relation}' must name a place along '{lk.index}' "
            "(a token id below the vocabulary size, a position below the cache's length)",
        )
    return raw


def _scatter(space: _Space, out_vars: list[str], full_box: dict[str, int]) -> tuple[Array, Array | None]:
    """A ``+=`` rule with looked-up indices in its head (``g_tok[v, d] += g[b, s, d] where
    ids[b, s] = v``): every point adds its value to the cell its values name (a scatter-add),
    the cells of the block's part of the looked-up range all exist (0 where no point names
    them), exactly as the one-hot form ``g_tok[v, d] += where(ids[b, s] == v, g[b, s, d], 0)``
    whose result this is.  ``full_box``: the block's box before the gather (the head's extents
    along the looked-up indices).  In chunks along the longest aggregated index."""
    node, xp = space.node, space.xp
    targets = [v for v in out_vars if v in node.looked_up]
    rest = [v for v in out_vars if v not in node.looked_up]
    agg = list(node.agg_indices)
    rows = math.prod(full_box[v] for v in targets)
    width = math.prod(space.box[v] for v in rest)
    # Laid out as the head where it has the looked-up indices last (a label's pick gives
    # grad_logits[b, s, v]): the rows are then a transposed view, and the result is the head's
    # layout, with no copy to make it so.
    last = [p.index for ax in node.out_axes for p in ax.parts] == rest + targets
    held = xp.full([width, rows] if last else [rows, width], 0, space.cdt, space.device)
    target = xp.transpose(held, [1, 0]) if last else held
    points = math.prod(space.box.values())
    var = max(agg, key=lambda v: space.box[v], default=None)
    parts = [space]
    if var is not None and points > CHUNK_POINTS:
        step = max(1, space.box[var] * CHUNK_POINTS // points)
        parts = [space.chunk(var, lo, min(lo + step, space.box[var])) for lo in range(0, space.box[var], step)]
    present: Array | None = None
    for part in parts:
        p = _scatter_block(part, target, targets, rest, agg, full_box)
        if p is not None:
            present = p if present is None else xp.logical_or(present, p)
    placed = rest + targets if last else targets + rest
    value = held.reshape([full_box[v] if v in targets else space.box[v] for v in placed])
    perm = [placed.index(v) for v in out_vars]
    shape = [full_box[v] if v in targets else space.box[v] for v in out_vars]
    value = xp.transpose(value, perm)
    if present is not None:  # over the head's other indices: the same for every looked-up cell
        present = xp.broadcast_to(xp.transpose(present.reshape([1] * len(targets) + list(present.shape)), perm), shape)
    return value, present


def _scatter_block(
    space: _Space, target: Array, targets: list[str], rest: list[str], agg: list[str], full_box: dict[str, int]
) -> Array | None:
    """Adds a chunk's points into ``target`` (rows: the looked-up cells, columns: the head's
    other cells); returns where the points exist over ``rest`` (None: everywhere, or not tracked)."""
    xp, order = space.xp, space.order
    full = [space.box[v] for v in order]
    value = xp.broadcast_to(xp.asarray(_eval_dag(space, space.node.expr.root, {})), full)
    mask = _and(xp, [space.guard_mask(), *space.present])
    adds = _and(xp, [mask, space.hits])
    if adds is not None:
        value = xp.where(xp.broadcast_to(adds, full), value, space.scalar(0))
    row = None
    stride = 1
    for v in reversed(targets):
        term = space.looked_up[v] * stride if stride != 1 else space.looked_up[v]
        row = term if row is None else row + term
        stride *= full_box[v]
    assert row is not None
    perm = [order.index(v) for v in (*agg, *targets, *rest)]
    n_agg = math.prod(space.box[v] for v in agg)
    width = math.prod(space.box[v] for v in rest)
    flat = xp.contiguous(xp.transpose(value, perm)).reshape([n_agg, width])
    varies = any(row.shape[order.index(v)] != 1 for v in rest)
    if varies:
        index = xp.contiguous(xp.transpose(xp.broadcast_to(row, full), perm)).reshape([n_agg, width])
    else:
        at = [space.box[v] if v in agg else 1 for v in order]
        index = xp.contiguous(xp.transpose(xp.broadcast_to(row, at), perm)).reshape([n_agg])
    xp.add_rows(target, index, flat)
    if mask is None or not space.track_presence:
        return None
    axes = tuple(order.index(v) for v in agg)
    seen = xp.any(xp.broadcast_to(mask, full), axes) if axes else xp.broadcast_to(mask, full)
    return seen.reshape([space.box[v] for v in rest])


def native_gemm(node: JoinAgg, present: Sequence[Array | None], xp: ArrayOps, device: Any) -> bool:
    """Whether ``node`` is a half-precision sum of the product of two inputs, with no guard,
    scale or absent cell, that ``xp`` multiplies natively (accumulating in f32, rounding once:
    the semantics of a ``bf16`` rule): then it runs as one matmul on its half-precision inputs,
    never widened to f32 first (which makes a CPU's bf16 GEMM several times slower)."""
    if node.dtype not in ("bf16", "f16") or node.agg != "sum" or not node.agg_indices or node.lookups:
        return False
    if not node.guard.is_true or any(p is not None for p in present):
        return False
    if not xp.native_matmul(node.dtype, device):
        return False
    form = product_form(node)
    if form is None or form.constants or form.negate or len(form.factors) != 2:
        return False
    loads = [n for k, power in form.factors if power == 1 and isinstance(n := node.expr.nodes[k], Load)]
    return len(loads) == 2 and loads[0].input != loads[1].input


_EXACT_OPS = frozenset({"add", "sub", "mul", "div", "max", "min", "neg"})


def _dtype(a: Any) -> Any:
    return getattr(a, "dtype", None)


def native_arithmetic(node: JoinAgg, data_dtypes: Sequence[Any], present: Sequence[Array | None], xp: ArrayOps) -> bool:
    """Whether ``node`` is a half-precision rule with no aggregation, guard or absent cell whose
    body is one IEEE operation (``+ - * /``, ``max``, ``min``, negation) of inputs of its own
    dtype: torch then computes it on the half-precision inputs directly (each kernel widens to
    f32 in registers, computes and rounds once), which is exactly the rule's semantics, without
    a widened copy of each input."""
    if node.dtype not in ("bf16", "f16") or node.agg_indices or xp.name != "torch" or node.lookups:
        return False
    if not node.guard.is_true or any(p is not None for p in present):
        return False
    live = [node.expr.nodes[k] for k in node.expr.live()]
    ops_ = [n for n in live if isinstance(n, Op)]
    if len(ops_) != 1 or ops_[0].op not in _EXACT_OPS or not all(isinstance(n, Op | Load) for n in live):
        return False
    want = xp.dtype(node.dtype)
    return all(d == want for d in data_dtypes)


def known_presence(node: JoinAgg, exact_inputs: bool, xp: ArrayOps = NUMPY, device: Any = None) -> Known | None:
    """The presence of ``node``'s result decided from its guard alone, when it can be: every
    relation it reads has an exact support (``exact_inputs``: their absent cells are what the
    guard excludes) and the guard's shadow on the output indices is exact.  None otherwise (the
    evaluator then tracks presence cell by cell).  A block over part of a looked-up index's
    range has cells only where the values fall in its part: decided at run time."""
    if not exact_inputs:
        return None
    if any(lk.offset > 0 or node.box[lk.index] < lk.extent for lk in gathers(node)):
        return None
    node = prepare(node)
    box = node.box
    out_vars = [i.name for i in node.indices if i.name not in node.agg_indices]
    shadow, exact = node.guard.project(out_vars, box)
    if not exact:
        return None
    out_box = {v: box[v] for v in out_vars}
    if shadow.is_true or shadow.count(out_box) == math.prod(out_box.values()):
        return Known(None)
    mask = np.asarray(shadow.mask(out_vars, out_box))  # size 1 along the indices it does not involve
    return Known(xp.asarray(mask.reshape(mask.shape + (1,) * (len(out_vars) - mask.ndim)), xp.bool_, device))


# -- the scalar DAG ----------------------------------------------------------------------------


def _eval_dag(space: _Space, root: int, memo: dict[int, Array], in_place: bool = False) -> Array:
    """The sub-DAG under ``root``, broadcast over the join indices it depends on.  With
    ``in_place``, an op whose argument is an array only it reads (an earlier op's result, or an
    input's converted copy) of the result's shape writes its result there: a chain of
    elementwise ops then makes one array, not one per op (on a CPU, fresh arrays of megabytes
    cost page faults that rival the arithmetic)."""
    nodes = space.node.expr.nodes
    xp = space.xp
    single = read_once(space.node.expr) if in_place else frozenset()
    fused = ops.fusions(space.node.expr) if ops.fuses(space.cdt, xp) else {}
    unfused: set[int] = set()  # fusions that would not pay with these shapes
    stack = [root]
    while stack:
        k = stack[-1]
        if k in memo:
            stack.pop()
            continue
        n = nodes[k]
        if isinstance(n, Op):
            f = fused.get(k)
            if f is not None and (f.inner in memo or k in unfused):
                f = None  # the inner op's result is at hand (a sub-DAG evaluated before)
            reads = f.args if f is not None else n.args
            missing = [a for a in reads if a not in memo]
            if missing:
                stack.extend(missing)
                continue
            args = [memo[a] for a in reads]
            if f is not None and not f.pays([tuple(a.shape) for a in args], xp):
                unfused.add(k)  # again, with the inner op's result
                continue
            writable = single and (f is not None or ops.writes_into(n.op, xp))
            out = _reusable(space, reads, args, single) if writable else None
            if f is not None:
                memo[k] = f.apply(args, space.cdt, xp, out=out)
            else:
                memo[k] = ops.apply_op(n.op, args, space.cdt, xp, out=out)
        elif isinstance(n, Load):
            memo[k] = space.data[n.input]
        elif isinstance(n, IndexValue):
            memo[k] = space.index_array(n.index)
        else:
            assert isinstance(n, Const)
            dtype = xp.bool_ if isinstance(n.value, bool) else space.cdt
            memo[k] = xp.scalar(n.value, dtype, space.device)
        stack.pop()
    return memo[root]


@functools.lru_cache(maxsize=4096)
def read_once(expr: ScalarExpr) -> frozenset[int]:
    """The nodes of ``expr`` that one op reads, once (a load also only if no other node loads its
    input): the arrays an evaluator may overwrite with that op's result."""
    live = expr.live()
    reads = Counter(a for k in live if isinstance(n := expr.nodes[k], Op) for a in n.args)
    loads = Counter(n.input for k in live if isinstance(n := expr.nodes[k], Load))
    once = {k for k, count in reads.items() if count == 1}
    return frozenset(k for k in once if not isinstance(n := expr.nodes[k], Load) or loads[n.input] == 1)


def _reusable(space: _Space, reads: tuple[int, ...], args: list[Array], single: frozenset[int]) -> Array | None:
    """An argument (of node ids ``reads``) that an op's result may overwrite (see
    :func:`_eval_dag`), or None."""
    nodes, xp = space.node.expr.nodes, space.xp
    shape = xp.broadcast_shape([a.shape for a in args])
    for a, arr in zip(reads, args, strict=True):
        n = nodes[a]
        mine = isinstance(n, Op) or (isinstance(n, Load) and n.input in space.owned)
        if a in single and mine and arr.dtype == space.cdt and tuple(arr.shape) == shape and xp.is_dense(arr):
            return arr
    return None


def _loads_under(space: _Space, root: int) -> set[int]:
    nodes = space.node.expr.nodes
    return {n.input for k in space.node.expr.under(root) if isinstance(n := nodes[k], Load)}


def _and(xp: ArrayOps, masks: Sequence[Array | None]) -> Array | None:
    """The conjunction of masks; None (every point) when there are none."""
    out: Array | None = None
    for m in masks:
        if m is not None:
            out = m if out is None else xp.logical_and(out, m)
    return out


# -- sums of products ------------------------------------------------------------------------------


def _contraction(space: _Space, out_vars: list[str]) -> tuple[Array, Array | None] | None:
    """Sum of a product: each factor over its own indices, contracted pairwise.  None when the
    body is not a product, or a factor is not finite (the masked path then keeps absent points
    from poisoning sums with ``inf * 0``)."""
    split = _split_product(space)
    if split is None:
        return None
    xp = space.xp
    scale, factors = split
    memo: dict[int, Array] = {}
    values: list[Array] = []
    masks: list[Array] = []
    guard = space.guard_mask()
    # A guard over output indices only is applied to the sum (``where``: a value it excludes,
    # even an infinite one, is never multiplied); any other guard is a 0/1 factor of the product.
    after = guard is not None and space.within is None and space.node.guard.vars <= set(out_vars)
    for node_id, power in factors:
        val = xp.cast(_eval_dag(space, node_id, memo), space.cdt)
        if power < 0:
            val = space.scalar(1) / val
        # A guard factor is 0 where it excludes a point: an infinite value there would give
        # inf * 0 = nan.  (Absent cells are set to 0 below, whatever they held.)
        if guard is not None and not after and xp.is_float(space.cdt) and not xp.all_finite(val):
            return None
        m = _and(xp, [space.present[k] for k in _loads_under(space, node_id)])
        if m is not None:
            val = xp.where(m, val, space.scalar(0))
            masks.append(m)
        values.append(val)
    if guard is not None:
        if not after:
            values.append(xp.cast(guard, space.cdt))
        masks.append(guard)
    value = _sum_over(values, space, out_vars)
    if after:
        assert guard is not None
        if guard.ndim == len(space.order):  # over the join space: keep the output indices' axes
            guard = guard.reshape([n for n, v in zip(guard.shape, space.order, strict=True) if v in out_vars])
        value = xp.where(xp.broadcast_to(guard, value.shape), value, space.scalar(0))
    if scale is not None:
        value = value * scale
    # A cell exists where some point has every mask set: count such points with a contraction.
    f32 = xp.dtype("f32")
    present = None
    if masks and space.track_presence:
        present = _sum_over([xp.cast(m, f32) for m in masks], space, out_vars) > 0
    return xp.cast(value, space.cdt), present


def _sum_over(arrays: list[Array], space: _Space, out_vars: list[str]) -> Array:
    """The contraction of ``arrays`` (over the join space) onto ``out_vars``; aggregated indices
    no array spans multiply the sum by their extent."""
    xp = space.xp
    operands = [squeeze(a, space.order, xp) for a in arrays]
    result, spanned = contract(operands, out_vars, space.box, xp)
    spanned_all = {v for _, ix in operands for v in ix}
    for v in space.node.agg_indices:
        if v not in spanned_all and space.box[v] != 1:
            result = result * space.box[v]
    shape = [space.box[v] if v in spanned else 1 for v in out_vars]
    return xp.broadcast_to(result.reshape(shape), [space.box[v] for v in out_vars])


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


def _split_product(space: _Space) -> tuple[Array | None, list[tuple[int, int]]] | None:
    """The varying factors of a product body as (node, power), and its constant scale (None
    for 1); None if the body is not a product."""
    form = product_form(space.node)
    if form is None:
        return None
    return constant_scale(space.node, space.cdt, space.xp, space.device), list(form.factors)


def constant_scale(node: JoinAgg, cdt: Any, xp: ArrayOps, device: Any) -> Array | None:
    """The constant factor of a product body (see :func:`product_form`) as a 0-d array in
    ``cdt``, or None for 1: its constants (sub-DAGs of numbers and ops) evaluated once."""
    form = product_form(node)
    assert form is not None, "not a product"
    if not form.constants and not form.negate:
        return None
    nodes = node.expr.nodes
    values: dict[int, Array] = {}
    scale = xp.scalar(-1 if form.negate else 1, cdt, device)
    for root, power in form.constants:
        for k in node.expr.under(root):
            n = nodes[k]
            if isinstance(n, Const):
                values[k] = xp.scalar(n.value, xp.bool_ if isinstance(n.value, bool) else cdt, device)
            else:
                assert isinstance(n, Op), "a constant reads no input and no index"
                values[k] = ops.apply_op(n.op, [values[a] for a in n.args], cdt, xp)
        scale = scale * values[root] if power > 0 else scale / values[root]
    return scale


# -- everything else ----------------------------------------------------------------------------


def _broadcast_reduce(space: _Space, out_vars: list[str]) -> tuple[Array, Array | None]:
    """Evaluate the body over the join space, mask absent points with the aggregation's
    identity, and reduce; in chunks along the longest index, so that no temporary exceeds
    :data:`CHUNK_POINTS` points by more than that index's other extents allow."""
    node, xp = space.node, space.xp
    out_shape = [space.box[v] for v in out_vars]
    points = math.prod(space.box.values())
    var = max(space.order, key=lambda v: space.box[v], default=None)
    if var is None or points <= CHUNK_POINTS or space.box[var] == 1:
        return _reduce_block(space)
    step = max(1, space.box[var] * CHUNK_POINTS // points)
    kept = var in out_vars
    value: Array | None = None
    present: Array | None = None
    any_absent = False
    for lo in range(0, space.box[var], step):
        hi = min(lo + step, space.box[var])
        v, p = _reduce_block(space.chunk(var, lo, hi))
        any_absent |= p is not None
        if kept:
            k = out_vars.index(var)
            if value is None:
                value = xp.empty(out_shape, v.dtype, space.device)
                present = xp.full(out_shape, True, xp.bool_, space.device)
            at = (slice(None),) * k + (slice(lo, hi),)
            value[at] = v
            assert present is not None
            present[at] = True if p is None else p
        else:
            assert node.agg is not None
            pres = xp.full(v.shape, True, xp.bool_, space.device) if p is None else p
            v = xp.where(pres, v, ops.identity(node.agg, v.dtype, xp))
            value = v if value is None else ops.fold(node.agg, value, v, xp)
            present = pres if present is None else present | pres
    assert value is not None
    if not kept:
        assert present is not None
        value = xp.cast(xp.where(present, value, xp.constant(0, value.dtype)), value.dtype)
    return value, present if any_absent else None


def _reduce_block(space: _Space) -> tuple[Array, Array | None]:
    node, xp = space.node, space.xp
    full = tuple(space.box[v] for v in space.order)
    value = xp.asarray(_eval_dag(space, node.expr.root, {}, in_place=True))
    mask = _and(xp, [space.guard_mask(), *space.present])
    axes = tuple(space.order.index(v) for v in node.agg_indices)
    track = space.track_presence and mask is not None
    if not axes:
        return xp.broadcast_to(value, full), (xp.broadcast_to(mask, full) if track else None)
    assert node.agg is not None
    masked = value if mask is None else xp.where(mask, value, ops.identity(node.agg, value.dtype, xp))
    result = ops.reduce(node.agg, xp.broadcast_to(masked, full), axes, xp)
    return result, (xp.any(xp.broadcast_to(mask, full), axes) if track else None)
