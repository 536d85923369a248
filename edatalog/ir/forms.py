"""What a rule's body is, structurally: a product of factors (:func:`product_form`).  The
backend evaluates products as contractions, the solver and the backend recognize attention by
them (:mod:`edatalog.ir.attention`).  A product whose weight is looked up by a routed value is
a :func:`routed_form`: the backend runs it as a grouped GEMM, the solver prices it by the points
routed to a block's experts."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from edatalog.ir.graph import JoinAgg
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
