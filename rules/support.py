"""Pass 5: supports.  Where each relation's cells exist, and the effective guard of every rule.

A rule only contributes at points where its guards hold *and* every relation it reads has the
cell it reads (a failed join contributes nothing).  Supports are affine, so they propagate
symbolically: the support of a head is the shadow of the rule's effective guard on the head's
axes, and a guard written once on a score rule makes a whole softmax causal.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import z3

from edatalog.errors import Diagnostic, EdlError, Note, Span
from edatalog.ir.affine import Affine, Constraint, Guard
from edatalog.ir.graph import AxisMap, JoinAgg, Relation


def effective_guard(node: JoinAgg, relations: Mapping[str, Relation]) -> Guard:
    """The user's guards, the supports of everything the node reads, and where its index
    expressions land inside the relations (``x[t - 1]`` reads nothing at ``t = 0``)."""
    guard = node.guard
    for acc in node.inputs:
        for ax in acc.axes:
            guard = guard & ax.range_guard()
        rel = relations[acc.relation]
        if not rel.support.is_true:
            mapping = {name: ax.affine() for name, ax in zip(rel.axis_names, acc.axes, strict=True)}
            guard = guard & rel.support.substitute(mapping)
    return guard.simplify(node.box)


def head_support(node: JoinAgg, axis_names: Sequence[str]) -> tuple[Guard, bool]:
    """The cells of the head relation a node writes, over ``axis_names``; and whether exact."""
    tmp = [f"@{k}" for k in range(len(node.out_axes))]
    links = []
    for t, ax in zip(tmp, node.out_axes, strict=True):
        span = _contiguous(node, ax)
        if span is None:
            links.append(Constraint(Affine.var(t) - ax.affine(), eq=True))
        else:  # lo <= t < hi, whatever the other indices: no link to eliminate
            links += [Constraint(Affine.var(t) - span[0]), Constraint(Affine.var(t, -1) + (span[1] - 1))]
    box = node.box | {t: ax.extent for t, ax in zip(tmp, node.out_axes, strict=True)}
    shadow, exact = (node.guard & Guard.of(links)).project(tmp, box)
    return shadow.rename(dict(zip(tmp, axis_names, strict=True))), exact


def _contiguous(node: JoinAgg, axis: AxisMap) -> tuple[int, int] | None:
    """The places a composite head axis covers, when they are one contiguous range whatever the
    guard: fixed places, then indices that only this axis and no guard names, each over its
    whole range (``y[(1, f, h)]`` writes 128 f + h over 128..255).  None otherwise: projecting
    ``t = 64 f + h`` by Fourier-Motzkin is not exact over the integers."""
    if len(axis.parts) < 2:
        return None
    names = [p.index for p in axis.parts]
    free = [n for n in names if n is not None]
    if len(set(free)) != len(free) or any(names[k] is None for k in range(len(names) - len(free), len(names))):
        return None  # a fixed place after an index: the places are not contiguous
    if any(p.const is None for p in axis.parts[: len(names) - len(free)]):
        return None
    if any(node.box[n] != p.extent for n, p in zip(names, axis.parts, strict=True) if n is not None):
        return None
    elsewhere = set(node.guard.vars) | {v for ax in node.out_axes if ax is not axis for v in ax.indices}
    if elsewhere & set(free):
        return None
    lo = axis.affine().substitute({n: Affine((), 0) for n in free}).const
    return lo, lo + math.prod(p.extent for p in axis.parts if p.index is not None)


def check_disjoint(rel: str, nodes: Sequence[JoinAgg], spans: Sequence[Span], exact: bool) -> list[Diagnostic]:
    """``=`` rules for one relation must define disjoint cells: raise with a cell two of them share.

    When the guards over-approximate (``exact`` is False: a support read is approximate) a shared
    cell may not really exist, so it is reported as a warning; so is a check z3 cannot decide."""
    ctx = z3.Context()  # one context for all pairs of this relation
    warnings: list[Diagnostic] = []
    for i in range(len(nodes)):
        for j in range(i + 1, len(nodes)):
            if _literally_disjoint(nodes[i], nodes[j]):
                continue
            found, cell = _shared_cell(nodes[i], nodes[j], ctx)
            notes = (Note("the other rule is here", spans[i]),)
            if found is None:
                warnings.append(
                    Diagnostic(
                        "warning",
                        f"could not prove that these '=' rules for {rel} define disjoint cells",
                        spans[j],
                        notes=notes,
                    )
                )
            elif found:
                where = ", ".join(str(c) for c in cell)
                message = f"overlapping definitions: two '=' rules both define {rel}[{where}]"
                help_text = (
                    "'=' rules for one relation must cover disjoint cells; add guards or use literal "
                    "index positions to separate them, or use += to add contributions"
                )
                if not exact:
                    warnings.append(
                        Diagnostic(
                            "warning",
                            f"{message}, unless an approximate support hides it",
                            spans[j],
                            help_text,
                            tuple(notes),
                        )
                    )
                else:
                    raise EdlError(message, spans[j], help=help_text, notes=notes)
    return warnings


def _literally_disjoint(a: JoinAgg, b: JoinAgg) -> bool:
    """Head positions with different literals at the same place (``r[0, i]`` and ``r[1, i]``)."""
    for axa, axb in zip(a.out_axes, b.out_axes, strict=True):
        if [p.extent for p in axa.parts] != [p.extent for p in axb.parts]:
            continue
        for pa, pb in zip(axa.parts, axb.parts, strict=True):
            if pa.const is not None and pb.const is not None and pa.const != pb.const:
                return True
    return False


def _shared_cell(a: JoinAgg, b: JoinAgg, ctx: z3.Context) -> tuple[bool | None, tuple[int, ...]]:
    """Whether some cell is written by both rules (None: undecided), and one such cell."""
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
    verdict = solver.check()
    if verdict == z3.unknown:
        return None, ()
    if verdict != z3.sat:
        return False, ()
    model = solver.model()
    values = {k: model.eval(v, model_completion=True).as_long() for k, v in va.items()}
    return True, tuple(int(ax.affine().evaluate(values)) for ax in a.out_axes)


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
