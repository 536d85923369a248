"""Pass 5: supports.  Where each relation's cells exist, and the effective guard of every rule.

A rule only contributes at points where its guards hold *and* every relation it reads has the
cell it reads (a failed join contributes nothing).  Supports are affine, so they propagate
symbolically: the support of a head is the shadow of the rule's effective guard on the head's
axes, and a guard written once on a score rule makes a whole softmax causal.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import z3

from edatalog.errors import EdlError, Note
from edatalog.ir.affine import Affine, Constraint, Guard
from edatalog.ir.graph import JoinAgg, Relation


def effective_guard(node: JoinAgg, relations: Mapping[str, Relation]) -> Guard:
    """The user's guards and the supports of everything the node reads."""
    guard = node.guard
    for acc in node.inputs:
        rel = relations[acc.relation]
        if not rel.support.is_true:
            mapping = {name: ax.affine() for name, ax in zip(rel.axis_names, acc.axes, strict=True)}
            guard = guard & rel.support.substitute(mapping)
    return guard.simplify(node.box)


def head_support(node: JoinAgg, axis_names: Sequence[str]) -> tuple[Guard, bool]:
    """The cells of the head relation a node writes, over ``axis_names``; and whether exact."""
    tmp = [f"@{k}" for k in range(len(node.out_axes))]
    links = Guard.of(Constraint(Affine.var(t) - ax.affine(), eq=True) for t, ax in zip(tmp, node.out_axes, strict=True))
    box = node.box | {t: ax.extent for t, ax in zip(tmp, node.out_axes, strict=True)}
    shadow, exact = (node.guard & links).project(tmp, box)
    return shadow.rename(dict(zip(tmp, axis_names, strict=True))), exact


def check_disjoint(rel: str, nodes: Sequence[JoinAgg], spans: Sequence[object]) -> None:
    """``=`` rules for one relation must define disjoint cells; report a cell two of them share."""
    for i in range(len(nodes)):
        for j in range(i + 1, len(nodes)):
            cell = _shared_cell(nodes[i], nodes[j])
            if cell is not None:
                where = ", ".join(str(c) for c in cell)
                raise EdlError(
                    f"overlapping definitions: two '=' rules both define {rel}[{where}]",
                    spans[j],  # type: ignore[arg-type]
                    help="'=' rules for one relation must cover disjoint cells; add guards or use literal "
                    "index positions to separate them, or use += to add contributions",
                    notes=[Note("the other rule is here", spans[i])],  # type: ignore[arg-type]
                )


def _shared_cell(a: JoinAgg, b: JoinAgg) -> tuple[int, ...] | None:
    ctx = z3.Context()
    solver = z3.Solver(ctx=ctx)
    solver.set("timeout", 5000)
    va = {i.name: z3.Int(f"a.{i.name}", ctx) for i in a.indices}
    vb = {i.name: z3.Int(f"b.{i.name}", ctx) for i in b.indices}
    for node, vs in ((a, va), (b, vb)):
        for idx in node.indices:
            solver.add(vs[idx.name] >= 0, vs[idx.name] < idx.extent)
        solver.add(_z3_guard(node.guard, vs, ctx))
    for axa, axb in zip(a.out_axes, b.out_axes, strict=True):
        solver.add(_z3_affine(axa.affine(), va, ctx) == _z3_affine(axb.affine(), vb, ctx))
    if solver.check() != z3.sat:
        return None
    model = solver.model()
    values = {k: model.eval(v, model_completion=True).as_long() for k, v in va.items()}
    return tuple(int(ax.affine().evaluate(values)) for ax in a.out_axes)


def _z3_affine(e: Affine, vs: Mapping[str, z3.ArithRef], ctx: z3.Context) -> z3.ArithRef:
    acc: z3.ArithRef = z3.IntVal(e.const, ctx)
    for v, c in e.terms:
        acc = acc + c * vs[v]
    return acc


def _z3_guard(g: Guard, vs: Mapping[str, z3.ArithRef], ctx: z3.Context) -> z3.BoolRef:
    conjs = []
    for conj in g.conjs:
        parts = [
            (_z3_affine(c.expr, vs, ctx) == 0) if c.eq else (_z3_affine(c.expr, vs, ctx) >= 0) for c in conj.constraints
        ]
        conjs.append(z3.And(*parts, ctx) if parts else z3.BoolVal(True, ctx))
    return z3.Or(*conjs, ctx) if conjs else z3.BoolVal(False, ctx)
