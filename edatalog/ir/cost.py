"""FLOP and byte counts of join-agg nodes, counting only the points and cells that exist.

A point of the join space counts if the effective guard holds there, so causal attention costs
about half of its dense join.  Bytes are the distinct cells each input is read at and the
distinct output cells written, at the relations' item sizes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from edatalog.ir import dtypes
from edatalog.ir.affine import Guard
from edatalog.ir.scalar import Op, ScalarExpr

# What costing reads of the graph, as protocols that :mod:`edatalog.ir.graph`'s classes have:
# the graph imports this module (for ``Graph.costs``), so this one does not import the graph.


class IndexLike(Protocol):
    """A join index (:class:`edatalog.ir.graph.Index`)."""

    @property
    def name(self) -> str: ...

    @property
    def symbol(self) -> str: ...


class AccessLike(Protocol):
    """An input of a join-agg (:class:`edatalog.ir.graph.Access`)."""

    @property
    def relation(self) -> str: ...

    @property
    def indices(self) -> tuple[str, ...]: ...


class JoinAggLike(Protocol):
    """One rule (:class:`edatalog.ir.graph.JoinAgg`)."""

    @property
    def name(self) -> str: ...

    @property
    def indices(self) -> Sequence[IndexLike]: ...

    @property
    def inputs(self) -> Sequence[AccessLike]: ...

    @property
    def expr(self) -> ScalarExpr: ...

    @property
    def guard(self) -> Guard: ...

    @property
    def dtype(self) -> str: ...

    @property
    def box(self) -> dict[str, int]: ...

    @property
    def out_indices(self) -> tuple[str, ...]: ...

    @property
    def agg(self) -> str | None: ...

    @property
    def agg_indices(self) -> tuple[str, ...]: ...

    @property
    def looked_up(self) -> frozenset[str]: ...


class Typed(Protocol):
    """A relation (:class:`edatalog.ir.graph.Relation`), of which costing reads the dtype."""

    @property
    def dtype(self) -> str: ...


class GraphLike(Protocol):
    """A join-agg graph (:class:`edatalog.ir.graph.Graph`): its nodes and relations."""

    @property
    def nodes(self) -> Sequence[JoinAggLike]: ...

    def relation(self, name: str) -> Typed: ...


@dataclass(frozen=True)
class NodeCost:
    points: int  # supported points of the join space
    dense_points: int  # all points of the join space
    flops: int
    bytes_in: int
    bytes_out: int
    exact: bool  # False when a projection over-approximated a count

    @property
    def bytes(self) -> int:
        return self.bytes_in + self.bytes_out


def flops_per_point(node: JoinAggLike) -> int:
    """Scalar ops per point, plus one for folding it into the aggregate when indices are folded."""
    return node.expr.flops_per_point + (1 if node.agg is not None and node.agg_indices else 0)


class KernelClass(StrEnum):
    """What kind of kernel a launch is.  A small kernel costs its class's floor (``edl calibrate``
    measures one per class): a small matmul or a gather costs a few times a small add."""

    ELEMENTWISE = "elementwise"  # one pointwise operator over a block, broadcast reads included
    REDUCTION = "reduction"  # folding aggregated indices outside a GEMM (a sum, a max)
    GEMM = "gemm"  # a product summed over shared indices: one matmul call
    GATHER = "gather"  # a looked-up index: one gather
    ATTENTION = "attention"  # a fused attention block: one scaled_dot_product_attention call


@dataclass(frozen=True)
class Launches:
    """How many kernels of each class one op launches."""

    elementwise: int = 0
    reduction: int = 0
    gemm: int = 0
    gather: int = 0
    attention: int = 0

    @property
    def total(self) -> int:
        return self.elementwise + self.reduction + self.gemm + self.gather + self.attention

    def items(self) -> Iterator[tuple[KernelClass, int]]:
        """Each class with its count, the classes launched only."""
        for cls in KernelClass:
            count: int = getattr(self, cls.value)
            if count:
                yield cls, count

    def __add__(self, other: Launches) -> Launches:
        return Launches(*(a + b for a, b in zip(self.to_json(), other.to_json(), strict=True)))

    def __str__(self) -> str:
        return ", ".join(f"{n} {cls}" for cls, n in self.items()) or "none"

    def to_json(self) -> list[int]:
        return [getattr(self, cls.value) for cls in KernelClass]

    @staticmethod
    def from_json(data: object) -> Launches:
        """:meth:`to_json`'s list, or a bare count (kernels of no class: elementwise)."""
        if isinstance(data, int):
            return Launches(elementwise=data)
        if not isinstance(data, list) or len(data) != len(KernelClass) or not all(isinstance(n, int) for n in data):
            raise ValueError(f"launches must be {len(KernelClass)} counts, not {data!r}")
        return Launches(*data)


ONE_KERNEL = Launches(elementwise=1)  # a copy, a combine of partial sums: one pointwise kernel
ONE_ATTENTION = Launches(attention=1)  # a fused attention block


def launches(node: JoinAggLike) -> Launches:
    """The kernels a runtime that does not fuse (eager torch, and edatalog's recorded graphs)
    launches for one block of ``node``: one per operator of its scalar function that varies over
    the join space (a GEMM's product among them, as its matmul), one for folding the aggregated
    indices (a GEMM folds its product and sum in one), one per looked-up index's gather.  At
    least one.  A kernel floor is paid per launch, by class: ``a[i] * 0.5 + x[i]`` is two
    elementwise kernels, a layer norm's ``w[d] * (xc * rsqrt(v + eps)) + b[d]`` five, an
    attention score ``q * k / sqrt(E)`` a GEMM and an elementwise scaling."""
    expr = node.expr
    ops = sum(1 for k in expr.varying() if isinstance(expr.nodes[k], Op))
    folded = set(node.agg_indices) - node.looked_up  # a looked-up index is its gather's
    gemm = 1 if gemm_roles(node) is not None and ops and not node.looked_up else 0  # a gather is no GEMM
    reduction = 1 if node.agg is not None and folded and not gemm else 0  # a GEMM sums in its product's kernel
    gathers = len(node.looked_up)
    elementwise = ops - gemm
    if elementwise + gemm + reduction + gathers == 0:
        elementwise = 1  # a copy
    return Launches(elementwise, reduction, gemm, gathers)


GemmRoles = tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], tuple[str, ...]]


def gemm_roles(node: JoinAggLike) -> GemmRoles | None:
    """The indices of a GEMM node by role, ``(batch, m, n, k)``: a sum over indices that both
    of its two widest inputs read.  ``k`` is the summed indices, ``m`` and ``n`` the kept ones
    only the first or only the second reads, ``batch`` the rest (read by both, or by neither:
    a third input such as attention's ``1 / l``).  None for everything else (elementwise rules,
    reductions of one input): those are bound by memory, not by tensor-core tiles."""
    if node.agg != "sum" or not node.agg_indices:
        return None
    distinct = list(dict.fromkeys(node.inputs))
    if len(distinct) < 2:
        return None
    a, b = sorted(distinct, key=lambda acc: -len(acc.indices))[:2]
    ia, ib = set(a.indices), set(b.indices)
    summed = node.agg_indices
    if not set(summed) <= ia & ib:
        return None
    out = node.out_indices
    m = tuple(i for i in out if i in ia - ib)
    n = tuple(i for i in out if i in ib - ia)
    batch = tuple(i for i in out if (i in ia) == (i in ib))
    return batch, m, n, summed


def gemm_shape(roles: GemmRoles | None, extents: Mapping[str, int]) -> tuple[int, int, int, int] | None:
    """``(batch, m, n, k)`` of a block of a GEMM node with :func:`gemm_roles` ``roles``, its
    indices of sizes ``extents``."""
    if roles is None:
        return None
    batch, m, n, k = (math.prod(extents[i] for i in names) for names in roles)
    return batch, m, n, k


def _cells(guard: Guard, keep: tuple[str, ...], box: dict[str, int]) -> tuple[int, bool]:
    """Distinct values of ``keep`` over the supported points."""
    shadow, exact = guard.project(keep, box)
    cells, counted = shadow.count_bound({k: box[k] for k in keep})
    return cells, exact and counted


def node_cost(graph: GraphLike, node: JoinAggLike) -> NodeCost:
    box = node.box
    dense = math.prod(box.values())
    points, exact = node.guard.count_bound(box)
    # A looked-up index takes one value per point of the others: the rule's points are theirs.
    chosen = math.prod(box[v] for v in node.looked_up)
    points, dense = points // chosen, dense // chosen
    bytes_in = 0
    for acc in dict.fromkeys(node.inputs):  # the same access twice is read once
        cells, ok = _cells(node.guard, acc.indices, box)
        if node.looked_up & set(acc.indices):  # a gather reads at most a cell per point
            cells = min(cells, points)
        exact &= ok
        bytes_in += cells * dtypes.itemsize(graph.relation(acc.relation).dtype)
    cells, ok = _cells(node.guard, node.out_indices, box)
    exact &= ok
    bytes_out = cells * dtypes.itemsize(node.dtype)
    return NodeCost(points, dense, points * flops_per_point(node), bytes_in, bytes_out, exact)


def graph_costs(graph: GraphLike) -> dict[str, NodeCost]:
    return {n.name: node_cost(graph, n) for n in graph.nodes}


def flops_formula(node: JoinAggLike, cost: NodeCost) -> str:
    """``2·B·S·D·H·E``; with a partial guard the fraction of the join space that exists follows."""
    coef = flops_per_point(node)
    factors: list[str] = []
    for idx in node.indices:
        if idx.name in node.looked_up:
            continue  # one value per point of the others
        sym = idx.symbol
        if re.fullmatch(r"\d+", sym):
            coef *= int(sym)
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\*[A-Za-z_][A-Za-z0-9_]*)*", sym):
            factors.extend(sym.split("*"))
        else:
            factors.append(f"({sym})")
    if coef == 0:
        return "0"
    text = "·".join(([str(coef)] if coef != 1 or not factors else []) + factors)
    if cost.points != cost.dense_points and cost.dense_points:
        text += f" × {cost.points / cost.dense_points:.3g}"
    return text if cost.exact else f"≤ {text}"  # an approximate support bounds the count


def routed_share(extent: int, part: int, choices: int) -> float:
    """The expected share of rows a block over ``part`` of a routed index's ``extent`` values
    reads, when each row routes to ``choices`` distinct values, uniformly (a token's top-K
    experts; ``choices`` 1: one value per row): a row is read when any of its values falls in the
    part.  The planner's expected load, as expert rules are priced (k/E of the tokens per
    expert, uniform unless told otherwise)."""
    if part >= extent or choices >= extent:
        return 1.0
    missed = 1.0
    for j in range(choices):  # every choice outside the part: C(extent - part, K) / C(extent, K)
        missed *= (extent - part - j) / (extent - j)
    return 1.0 - max(missed, 0.0)
