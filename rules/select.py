"""Pass 0b: selections.  ``argmax=``, ``argmin=``, ``top=`` and ``argtop=`` choose cells by value:

    best[t] argmax= logits[t, e].          # the first e with the largest logit (an i64)
    gate[t, k:K] top= logits[t, e].        # the K largest logits, largest first
    route[t, k:K] argtop= logits[t, e].    # where they are: ties go to the lower e

They are written as aggregations and compile to rules of the core language, printed as such, so
that everything downstream (extents, supports, FLOP counts, plans that split the chosen index,
exchanges, every runtime, gradients) needs nothing new:

- ``argmax=`` is a maximum, then the smallest index that attains it: two passes over the
  scores, linear in the chosen index, and splittable like any ``max=`` and ``min=`` (each block
  finds its own candidates; the combine keeps the lowest);
- ``top=`` and ``argtop=`` rank every cell by how many others beat it (a larger value, or an
  equal one at a lower index), then read the cells of ranks ``0 .. K - 1``: ``E²`` comparisons
  a row, which suits routers over tens or hundreds of experts, not vocabularies.

The intermediate relations are named after the head (``route.rank``, ``best.max``); dots
cannot be written in a program, so they never collide with a user's names.  Counting and index
arithmetic run in ``f64`` (exact for any extent below 2**53) and the results are stored as
``i64``, whatever the program's float type: an ``argmax`` over 150k vocabulary entries in a
``bf16`` model is still exact.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from edatalog.errors import EdlError, Span
from edatalog.ir.graph import Graph
from edatalog.lang import ast

ARG = ("argmax=", "argmin=")
RANKED = ("top=", "argtop=")
SELECTIONS = ARG + RANKED


@dataclass(frozen=True)
class Selection:
    """A ranked selection as written, kept for the check that needs extents (K at most E)."""

    rule: ast.Rule
    rank: ast.Component  # the head's rank index (``k:K``)
    rank_axis: int  # its position in the head
    chosen: str  # the index it ranks along
    ranks: str  # the generated relation of ranks, whose last axis is the chosen index


def expand_selections(program: ast.Program) -> tuple[ast.Program, tuple[Selection, ...]]:
    """The program with every selection rule replaced by the core rules that compute it."""
    rules = [s for s in program.statements if isinstance(s, ast.Rule)]
    if not any(r.aggop in SELECTIONS for r in rules):
        return program, ()
    heads: dict[str, ast.Rule] = {}
    for r in rules:
        first = heads.setdefault(r.head.relation, r)
        if first is not r and (r.aggop in SELECTIONS or first.aggop in SELECTIONS):
            chosen = first if first.aggop in SELECTIONS else r
            raise EdlError(
                f"'{r.head.relation}' is chosen by {chosen.aggop}, so it has one rule",
                r.span,
                help="give each choice a relation of its own",
            )
    # Names a generated index must not take: a variable may not share a dim's or const's name.
    declared = {b.name for s in program.statements if isinstance(s, ast.DimDecl | ast.ConstDecl) for b in s.items}
    statements: list[ast.Statement] = []
    selections: list[Selection] = []
    for s in program.statements:
        if isinstance(s, ast.Rule) and s.aggop in SELECTIONS:
            expanded, selection = _expand(s, declared)
            statements.extend(expanded)
            if selection is not None:
                selections.append(selection)
        else:
            statements.append(s)
    return ast.Program(program.source, tuple(statements)), tuple(selections)


def check_ranks(graph: Graph, selections: tuple[Selection, ...]) -> None:
    """A rank index runs over at most as many places as the index it ranks along."""
    for sel in selections:
        want = graph.relation(sel.rule.head.relation).shape[sel.rank_axis]
        have = graph.relation(sel.ranks).shape[-1]
        if want > have:
            raise EdlError(
                f"{sel.rule.aggop} asks for the {want} best places of index '{sel.chosen}', which has only {have}",
                sel.rank.span,
                help=f"the rank index '{sel.rank.var}' may run over at most {have} places ({sel.rank.var}:{have})",
            )


# -- the rewrite ---------------------------------------------------------------------------------


def _expand(rule: ast.Rule, declared: set[str]) -> tuple[list[ast.Rule], Selection | None]:
    op = rule.aggop
    if rule.lookups:
        raise EdlError(
            f"a lookup in {_a(op)} rule",
            rule.lookups[0].span,
            help="look the value up in a rule of its own, then choose from that relation",
        )
    read = list(dict.fromkeys(ast.body_vars(rule.body)))
    head_vars = list(dict.fromkeys(ast.position_vars(rule.head.positions)))
    chosen = [v for v in read if v not in head_vars]
    if len(chosen) != 1:
        raise EdlError(
            f"{op} chooses along one index that the head leaves out, but "
            + ("every index of the body is in the head" if not chosen else f"it leaves out {_names(chosen)}"),
            rule.body.span,
            help="keep the others in the head, or gather them into one relation first"
            if chosen
            else "leave the index to choose along out of the head: 'best[t] argmax= x[t, e].'",
        )
    e = chosen[0]
    unread = [v for v in head_vars if v not in read]
    rank = _rank_component(rule, unread) if op in RANKED else None
    if op in ARG and unread:
        raise EdlError(
            f"index '{unread[0]}' in the head of {_a(op)} rule is not read by its body",
            _component(rule.head.positions, unread[0]).span,
            help=f"{op} keeps the head's indices and chooses along one more; for the K best, "
            "rank them: 'route[t, k:K] argtop= x[t, e].'",
        )
    kept = [v for v in head_vars if v in read]
    b = _Builder(rule)
    name = rule.head.relation
    out: list[ast.Rule] = []
    if isinstance(rule.body, ast.Atom) and not rule.guards and _plain(rule.body):
        score = rule.body
    else:  # a computed or guarded score is computed once, where it exists
        score_name = f"{name}.score"
        out.append(b.rule(b.atom(score_name, [*kept, e]), "=", rule.body, rule.guards))
        score = b.atom(score_name, [*kept, e])
    if op in ARG:
        best = b.atom(f"{name}.{op[3:6]}", kept)
        out.append(b.rule(best, op[3:], score))
        first = b.atom(f"{name}.first", kept)
        hit = b.call("where", b.compare("==", score, best), b.name(e), b.name("inf"))
        out.append(b.rule(first, "min=", hit, dtype="f64"))
        out.append(b.rule(rule.head, "=", first, dtype="i64", span=rule.span))
        return out, None
    assert rank is not None and rank.var is not None
    other = _fresh(e, {*read, *head_vars, *declared})
    rival = _renamed(score, e, other)
    beats = b.binary(
        "or",
        b.compare(">", rival, score),
        b.binary("and", b.compare("==", rival, score), b.compare("<", b.name(other), b.name(e))),
    )
    counted = b.atom(f"{name}.beaten", [*kept, e])
    out.append(b.rule(counted, "+=", b.call("where", beats, b.num(1), b.num(0)), dtype="f64"))
    ranks = b.atom(f"{name}.rank", [*kept, e])
    out.append(b.rule(ranks, "=", counted, dtype="i64"))
    value = b.name(e) if op == "argtop=" else score
    pick = b.call("where", b.compare("==", ranks, b.name(rank.var)), value, b.num(0))
    out.append(b.rule(rule.head, "+=", pick, span=rule.span))
    axis = next(k for k, p in enumerate(rule.head.positions) if rank in p.components)
    return out, Selection(rule, rank, axis, e, ranks.relation)


def _rank_component(rule: ast.Rule, unread: list[str]) -> ast.Component:
    example = f"'{rule.head.relation}[t, k:K] {rule.aggop} x[t, e].'"
    if len(unread) != 1:
        raise EdlError(
            f"{rule.aggop} needs one rank index in its head, one that the body does not read"
            + (f", but {_names(unread)} are not read" if unread else ""),
            rule.head.span,
            help=f"the rank index counts the best places from 0: {example}",
        )
    comp = _component(rule.head.positions, unread[0])
    if any(comp in p.components and p.composite for p in rule.head.positions):
        raise EdlError(
            f"the rank index '{comp.var}' of {_a(rule.aggop)} rule is part of a composite",
            comp.span,
            help=f"give the rank an axis of its own: {example}",
        )
    return comp


def _a(op: str) -> str:
    return f"an {op}" if op.startswith("arg") else f"a {op}"


def _names(vs: list[str]) -> str:
    return ", ".join(f"'{v}'" for v in vs)


def _component(positions: tuple[ast.Position, ...], var: str) -> ast.Component:
    return next(c for p in positions for c in p.components if c.var == var)


def _plain(atom: ast.Atom) -> bool:
    """Every position a lone variable: the atom can be read again with one variable renamed."""
    return all(not p.composite and p.components[0].var is not None for p in atom.positions)


def _fresh(base: str, taken: set[str]) -> str:
    k = 2
    while f"{base}{k}" in taken:
        k += 1
    return f"{base}{k}"


def _renamed(atom: ast.Atom, old: str, new: str) -> ast.Atom:
    def position(p: ast.Position) -> ast.Position:
        comps = tuple(replace(c, var=new) if c.var == old else c for c in p.components)
        return replace(p, components=comps)

    return replace(atom, positions=tuple(position(p) for p in atom.positions))


class _Builder:
    """Syntax for generated rules, every node spanning the rule it comes from (so an error in
    one points at what the user wrote)."""

    def __init__(self, rule: ast.Rule) -> None:
        self.rule_ = rule
        self.span: Span = rule.span

    def atom(self, relation: str, variables: list[str]) -> ast.Atom:
        s = self.span
        positions = tuple(ast.Position((ast.Component(v, None, None, s),), False, s) for v in variables)
        return ast.Atom(relation, positions, s, s)

    def rule(
        self,
        head: ast.Atom,
        aggop: str,
        body: ast.Expr,
        guards: tuple[ast.Expr | ast.Lookup, ...] = (),
        dtype: str | None = None,
        span: Span | None = None,
    ) -> ast.Rule:
        return ast.Rule(head, aggop, body, guards, span or self.span, self.rule_.aggop_span, dtype)

    def name(self, ident: str) -> ast.Name:
        return ast.Name(ident, self.span)

    def num(self, value: int) -> ast.Num:
        return ast.Num(value, str(value), self.span)

    def call(self, fn: str, *args: ast.Expr) -> ast.Call:
        return ast.Call(fn, args, self.span, self.span)

    def compare(self, op: str, lhs: ast.Expr, rhs: ast.Expr) -> ast.Compare:
        return ast.Compare(op, lhs, rhs, self.span)

    def binary(self, op: str, lhs: ast.Expr, rhs: ast.Expr) -> ast.Binary:
        return ast.Binary(op, lhs, rhs, self.span)
