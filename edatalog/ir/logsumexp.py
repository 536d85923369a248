"""Maxima that only shift a log-sum-exp, recognized by structure and checked at chosen points
(never by rule or relation names).

    mx[.., r]  max= x[.., r, w]
    s[.., r]   += exp(x[.., r, w] - mx[.., r])          one or more such sums
    f(.., mx[.., r], s[.., r], ..)                       every other reader of mx and the sums

Shifting ``mx`` by any ``c`` scales each sum by ``exp(-c)``.  Where that leaves every other
reader's value unchanged (a cross-entropy reads ``log(s) + mx``), nothing the program computes
depends on ``mx``: its gradient is exactly 0, and ``edatalog.rules.grad`` sends none (no
winners counted, no pass over ``x``), as torch's log-softmax backward has none.  The readers'
bodies are evaluated at random points, shifted and not (to 1e-9 relative, in Python floats);
the maximum's only role is to keep ``exp`` finite.  An attention's maximum is the same idea in
another shape (:mod:`edatalog.ir.attention`: ``p = exp(sc - mx)`` read only as ``p / l``).
"""

from __future__ import annotations

import math
import random

from edatalog.ir.attention import exp_of_difference
from edatalog.ir.forms import plain_indices
from edatalog.ir.graph import Access, Graph, JoinAgg
from edatalog.ir.scalar import Load

TOLERANCE = 1e-9  # relative, in Python floats (f64)
SHIFTS = (0.75, -1.5, 3.0, 25.0, -25.0)  # small and large: a body may branch on the values


def shift_only_maxima(graph: Graph) -> frozenset[str]:
    """The relations of ``graph`` that are maxima only shifting log-sum-exps (see the module
    docstring)."""
    readers: dict[str, list[JoinAgg]] = {}
    for n in graph.nodes:
        for acc in n.inputs:
            readers.setdefault(acc.relation, []).append(n)
    return frozenset(m.out for m in graph.nodes if _shift_only(graph, m, readers))


def _simple(node: JoinAgg) -> bool:
    return not node.lookups and node.guard.is_true


def _shift_only(graph: Graph, m: JoinAgg, readers: dict[str, list[JoinAgg]]) -> bool:
    # mx max= x: one plain load, one index reduced, the head the rest in order.
    if m.agg != "max" or len(m.agg_indices) != 1 or len(m.inputs) != 1 or not _simple(m):
        return False
    if not isinstance(m.expr.nodes[m.expr.root], Load) or not _only(graph, m):
        return False
    read, head = plain_indices(m.inputs[0].axes), plain_indices(m.out_axes)
    w = m.agg_indices[0]
    if read is None or w not in read or head != [v for v in read if v != w]:
        return False
    sums = [r for r in readers.get(m.out, []) if _shifted_sum(r, m.inputs[0].relation, m.out, read.index(w))]
    if not sums or not all(_only(graph, s) for s in sums):
        return False
    shifted = {m.out, *(s.out for s in sums)}
    others = {r.name: r for rel in shifted for r in readers.get(rel, []) if r not in sums}
    return all(_invariant(r, m.out, shifted - {m.out}) for r in others.values())


def _only(graph: Graph, node: JoinAgg) -> bool:
    return graph.producers(node.out) == (node,) and node.out not in graph.outputs


def _shifted_sum(node: JoinAgg, x: str, mx: str, w_at: int) -> bool:
    """Whether ``node`` is ``s[.., r] += exp(x[.., r, w] - mx[.., r])``, reading ``x`` as the
    maximum does (``w_at``: where the reduced index is among its axes)."""
    pair = exp_of_difference(node)
    if node.aggop != "+=" or len(node.agg_indices) != 1 or len(node.inputs) != 2 or pair is None or not _simple(node):
        return False
    xa, ma = node.inputs[pair[0]], node.inputs[pair[1]]
    read, row = plain_indices(xa.axes), plain_indices(ma.axes)
    if xa.relation != x or ma.relation != mx or read is None or w_at >= len(read):
        return False
    w = read[w_at]
    return node.agg_indices == (w,) and row == [v for v in read if v != w] and plain_indices(node.out_axes) == row


def _invariant(node: JoinAgg, mx: str, sums: set[str]) -> bool:
    """Whether ``node``'s body is unchanged when ``mx`` grows by ``c`` and every sum shrinks by
    ``exp(-c)``: the reads of them all at one cell, the body checked at random points."""
    shifted: dict[int, str] = {k: a.relation for k, a in enumerate(node.inputs) if a.relation in {mx, *sums}}
    cells: set[Access] = {Access("", a.axes) for a in node.inputs if a.relation in shifted.values()}
    if len(cells) != 1 or any(lk.input in shifted for lk in node.lookups):
        return False
    rng = random.Random(0)
    checked = 0
    for _ in range(12):
        point = {k: _draw(rng, shifted.get(k), mx) for k in range(len(node.inputs))}
        base = node.expr.at(point)
        if base is None:
            continue
        for c in SHIFTS:
            got = node.expr.at({k: _shift(v, c, shifted.get(k), mx) for k, v in point.items()})
            if got is None or not math.isclose(got, base, rel_tol=TOLERANCE, abs_tol=TOLERANCE):
                return False
        checked += 1
        if checked == 3:
            return True
    return False


def _shift(value: float, c: float, relation: str | None, mx: str) -> float:
    """A load's value with the maximum moved by ``c`` (the sums scaled by ``exp(-c)``)."""
    if relation is None:
        return value
    return value + c if relation == mx else value * math.exp(-c)


def _draw(rng: random.Random, relation: str | None, mx: str) -> float:
    """A load's value at a random point: the maximum anywhere in [-40, 40], the sums over six
    decades, other reads near 1."""
    if relation is None:
        return rng.uniform(0.5, 3.0)
    return rng.uniform(-40.0, 40.0) if relation == mx else math.exp(rng.uniform(-7.0, 7.0))
