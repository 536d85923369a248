"""What a rule's body is, structurally: a product of factors (:func:`product_form`).  The
backend evaluates products as contractions, the solver and the backend recognize attention by
them (:mod:`edatalog.ir.attention`).  A product whose weight is looked up by a routed value is
a :func:`routed_form`: the backend runs it as a grouped GEMM, the solver prices it by the points
routed to a block's experts."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from edatalog.ir.graph import AxisMap, JoinAgg, Lookup
from edatalog.ir.scalar import Load, Op


@dataclass(frozen=True)
class Product:
    """A body written as ``(-1)^negate * prod(constant ^ +-1) * prod(factor ^ +-1)``: node
    numbers of the scalar DAG with their powers; constants do not vary over the join space."""

    factors: tuple[tuple[int, int], ...]
    constants: tuple[tuple[int, int], ...]
    negate: bool


@functools.lru_cache(maxsize=4096)
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


@dataclass(frozen=True)
class RoutedForm:
    """``out[R_head, O] += c * g[R, C] * w[e, C, O] where route[R] = e``, by input number."""

    lookup: int  # the lookup (of ``node.lookups``) that routes
    gathered: int  # the input read at the routed points (``x``)
    weight: int  # the input indexed by the expert (``w1``)
    routed: tuple[str, ...]  # R: the route's indices, in join order (``t, k``)
    shared: tuple[str, ...]  # C: contracted between the two (``d``)
    columns: tuple[str, ...]  # O: the weight's indices in the head (``f``)
    kept: tuple[str, ...]  # the routed indices the head keeps (``t, k``; ``t`` for ``y``)


@functools.lru_cache(maxsize=4096)
def routed_form(node: JoinAgg) -> RoutedForm | None:
    """The node as a routed contraction (see ``backend/kernels/routed.py``), or None."""
    if node.agg != "sum" or len(node.lookups) != 1 or not node.guard.is_true:
        return None
    lk = node.lookups[0]
    out = node.out_indices
    if lk.index in out:  # a scatter
        return None
    form = product_form(node)
    if form is None or len(form.factors) != 2 or any(p != 1 for _, p in form.factors):
        return None
    loads = [node.expr.nodes[k] for k, _ in form.factors]
    if not all(isinstance(n, Load) for n in loads):
        return None
    inputs = [n.input for n in loads if isinstance(n, Load)]
    weights = [k for k in inputs if lk.index in node.inputs[k].indices]
    if len(weights) != 1 or lk.input in inputs:
        return None
    weight = weights[0]
    gathered = next(k for k in inputs if k != weight)
    order = [i.name for i in node.indices]
    routed = tuple(v for v in order if v in node.inputs[lk.input].indices)
    g_ix, w_ix = set(node.inputs[gathered].indices), set(node.inputs[weight].indices)
    shared = tuple(v for v in order if v in g_ix and v not in routed)
    columns = tuple(v for v in order if v in w_ix and v != lk.index and v not in shared)
    kept = tuple(v for v in routed if v in out)
    if (
        w_ix & set(routed)
        or not set(shared) <= w_ix
        or set(shared) & set(out)
        or set(out) != set(kept) | set(columns)
        or set(order) != set(routed) | set(shared) | set(columns) | {lk.index}
    ):
        return None
    return RoutedForm(0, gathered, weight, routed, shared, columns, kept)


def routed_gemm(node: JoinAgg, form: RoutedForm, extents: dict[str, int]) -> tuple[int, int, int, int]:
    """``(batch, m, n, k)`` of a block of a routed node over ``extents``, at the expected load:
    one GEMM per expert the block holds, each over that expert's share of the routed points (a
    uniform router sends ``1/X`` of the tokens' choices to each), by the block's columns, over
    its shared indices.  Small groups fill tiles worse than one GEMM of all the rows would."""
    lk = node.lookups[form.lookup]
    rows = math.prod(extents[v] for v in form.routed) // lk.extent
    columns = math.prod(extents[v] for v in form.columns)
    return extents[lk.index], max(rows, 1), columns, math.prod(extents[v] for v in form.shared)


# -- routed partitions: which cells a routed value decides ------------------------------------------


@dataclass(frozen=True)
class RouteKey:
    """Which routed value decides a cell of a relation: the routing relation, and for each of
    its axes the axis of the relation that holds the same index.  ``h1[t, k, f]``, made by
    ``... where route[t, k] = e``, has the key ``(route, (0, 1))``: cell ``(t, k, f)`` exists on a
    block over part of the experts only where ``route[t, k]`` falls in the part."""

    relation: str
    axes: tuple[int, ...]


def route_lookup(node: JoinAgg) -> Lookup | None:
    """The lookup that partitions ``node``'s points by a routed value, or None: a routed
    contraction's, or a filter's (:func:`filter_lookups`: over part of its range a block
    computes only the points whose value falls there)."""
    form = routed_form(node)
    if form is not None:
        return node.lookups[form.lookup]
    filters = filter_lookups(node)
    return node.lookups[filters[0]] if filters else None


def filter_lookups(node: JoinAgg) -> tuple[int, ...]:
    """The positions (in ``node.lookups``) of lookups that only filter (``where route[t, k] =
    e:X``): their index is read by no input, kept by no head, and used by neither the body nor
    the guard (``where pos[] = p:T`` with ``p`` in the body is a value, not a filter), so over
    its whole range such a lookup changes nothing."""
    used = set(node.out_indices) | set(node.expr.index_values()) | node.guard.vars
    return tuple(
        k
        for k, lk in enumerate(node.lookups)
        if lk.index not in used and not any(lk.index in acc.indices for acc in node.inputs)
    )


def route_key(node: JoinAgg, lk: Lookup, axes: tuple[AxisMap, ...]) -> RouteKey | None:
    """The lookup's arguments as axes of ``axes`` (the head's or an input's), or None where an
    argument is no plain index held by one of them."""
    positions = _argument_axes(node, lk, axes)
    if positions is None or any(p is None for p in positions):
        return None
    return RouteKey(node.inputs[lk.input].relation, tuple(p for p in positions if p is not None))


def route_rows(node: JoinAgg, lk: Lookup, axes: tuple[AxisMap, ...]) -> tuple[int | None, ...] | None:
    """For each argument of the lookup, the axis of ``axes`` (an input's or the head's) holding
    it, or None where none does: ``x[t, d]`` read under ``where route[t, k] = e`` runs along the
    route's ``t`` (axis 0) and lacks its ``k``.  None when no argument is held, or one is no plain
    index.  A block over part of the routed range reads (or writes) a row only where some value
    of the route along it falls in the part (:class:`edatalog.ir.program.Select`)."""
    positions = _argument_axes(node, lk, axes)
    return positions if positions is not None and any(p is not None for p in positions) else None


def route_choices(node: JoinAgg, lk: Lookup, along: tuple[int | None, ...]) -> int:
    """How many routed values a row runs along (see :func:`route_rows`) has: one per cell of
    the route along the arguments the row lacks (a token's ``K`` choices for ``x[t, d]``)."""
    args = node.inputs[lk.input].axes
    return math.prod(node.box[str(ax.parts[0].index)] for ax, m in zip(args, along, strict=True) if m is None)


def _argument_axes(node: JoinAgg, lk: Lookup, axes: tuple[AxisMap, ...]) -> tuple[int | None, ...] | None:
    """For each argument of the lookup, the axis of ``axes`` holding the same plain index (None
    where none does); None where an argument is no plain index."""
    plain = [plain_index(ax) for ax in axes]
    positions: list[int | None] = []
    for ax in node.inputs[lk.input].axes:
        v = plain_index(ax)
        if v is None:
            return None
        positions.append(plain.index(v) if v in plain else None)
    return tuple(positions)


def routed_partition(node: JoinAgg) -> tuple[Lookup, RouteKey] | None:
    """Where ``node``'s cells exist decided by a routed value (see :class:`RouteKey`): its
    routing lookup, and the key of its head.  None when it has none, or the head does not keep
    every index the route reads."""
    lk = route_lookup(node)
    if lk is None:
        return None
    key = route_key(node, lk, node.out_axes)
    return None if key is None else (lk, key)


def plain_index(ax: AxisMap) -> str | None:
    """The index an axis holds as it is, or None (an expression, a constant, several parts)."""
    if len(ax.parts) != 1:
        return None
    index = ax.parts[0].index
    return None if index is None else str(index)


def plain_indices(axes: Sequence[AxisMap]) -> list[str] | None:
    """The indices of axes that each hold one index as it is, in order; None where any does not."""
    names = [plain_index(ax) for ax in axes]
    return None if None in names else [n for n in names if n is not None]


def routed_parts_only(node: JoinAgg, split: Collection[str]) -> bool:
    """Whether blocks that split only ``split`` write each cell of the head in one block alone,
    though the rule aggregates: ``split`` leaves every aggregated index whole but the routed
    one (see :func:`routed_partition`), and a point's routed value names one part of that."""
    found = routed_partition(node)
    if found is None:
        return False
    lk, _ = found
    return set(node.agg_indices) & set(split) <= {lk.index}


def carried_filter(node: JoinAgg) -> Lookup | None:
    """The filter of a block of a rule that carries a route over part of the experts (its only
    lookup, reading indices the head keeps: ``a[t, k, f] = ... where route[t, k] = e:X`` with
    ``e`` in ``0 .. 3``), or None.  Such a block is the rule without the filter, its cells kept
    where the route falls in the part: the part decides cells, not points."""
    if len(node.lookups) != 1 or filter_lookups(node) != (0,):
        return None
    lk = node.lookups[0]
    return lk if route_key(node, lk, node.out_axes) is not None else None


def without_lookup(node: JoinAgg, lk: Lookup) -> JoinAgg:
    """``node`` without the filter ``lk`` (see :func:`filter_lookups`) and its index."""
    return dataclasses.replace(
        node,
        indices=tuple(i for i in node.indices if i.name != lk.index),
        lookups=tuple(x for x in node.lookups if x != lk),
    )


def without_full_filters(node: JoinAgg) -> JoinAgg:
    """``node`` without the filtering lookups (:func:`filter_lookups`) that cover their whole
    range: those keep every point, so evaluators run the rule as if they were not written (a
    rule that carries a route for expert parallelism costs nothing on one device)."""
    box = node.box
    whole = [node.lookups[k] for k in filter_lookups(node)]
    for lk in whole:
        if lk.offset == 0 and box[lk.index] == lk.extent:
            node = without_lookup(node, lk)
    return node
