"""Pass 4b: indices defined by equality guards are substituted away.

``conv[b, o, l] += x[b, c, t] * w[o, c, k] where t == l + k.`` has the join space b, o, l, c,
t, k, but only one ``t`` per (l, k) exists.  Substituting ``t = l + k`` gives the rule its real
join space, b, o, l, c, k, reading ``x[b, c, l + k]``: exactly what the rule means, written
with an index expression, and exactly what the user gets by writing that expression directly.
Its points are then the work, and evaluation, FLOP counts and plans all follow the work.

The range of ``t`` is kept as a guard ``0 <= l + k <= T - 1`` (simplified away when the other
extents imply it).  An index is substituted only when an equality in every piece of the guard
gives it a unit coefficient (so the value is an integer) and the head does not name it (heads
address cells with plain indices).
"""

from __future__ import annotations

from edatalog.ir.affine import Affine
from edatalog.ir.graph import JoinAgg
from edatalog.ir.rewrite import substitute_index


def eliminate_defined(node: JoinAgg) -> JoinAgg:
    """The node with every index that an equality guard defines substituted away."""
    while (found := _definition(node)) is not None:
        node = substitute_index(node, *found)
    return node


def _definition(node: JoinAgg) -> tuple[str, Affine] | None:
    """An index some equality of the guard defines, and its value in terms of the others."""
    if node.guard.is_false or node.guard.is_true:
        return None
    shared = set(node.guard.conjs[0].constraints)
    for conj in node.guard.conjs[1:]:
        shared &= set(conj.constraints)
    head = set(node.out_indices)
    for c in sorted(shared):
        if not c.eq:
            continue
        for idx in node.indices:  # in join order, for a deterministic choice
            coef = c.expr.coef(idx.name)
            if abs(coef) == 1 and idx.name not in head:
                rest = Affine(tuple(t for t in c.expr.terms if t[0] != idx.name), c.expr.const)
                return idx.name, rest.scale(-coef)  # coef * v + rest == 0, coef = +-1
    return None
