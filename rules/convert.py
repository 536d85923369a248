"""Pass 0c: conversions to integers.  ``i64(...)`` and ``i32(...)`` turn a rule's values into
integers, exactly:

    slot[t] = i64(floor(pos[t] / W)).      # a computed position, to look up by

A conversion is the whole body of its rule, and what it converts must be a whole number by
construction: integer or boolean values, index values, dims, results of ``floor``, ``ceil``,
``round`` or ``trunc``, and sums, products, ``max``, ``min`` and ``where`` choices of them.  So
no value is ever silently truncated: ``i64(x[t] / 2)`` is an error that says to round first
(checked once the types are known, by :func:`check_conversions`).

A conversion compiles to two rules: the value (``slot.value``, in its own type), then the
head's rule reading it as an integer (a generated rule states its type, see
``ast.Rule.dtype``).
"""

from __future__ import annotations

from dataclasses import dataclass

from edatalog.errors import EdlError
from edatalog.ir import dtypes
from edatalog.ir.graph import Graph
from edatalog.lang import ast

CONVERSIONS = ("i64", "i32")
ROUNDING = ("floor", "ceil", "round", "trunc")


@dataclass(frozen=True)
class Conversion:
    """A conversion as written, kept for the check that needs the converted value's type."""

    call: ast.Call
    value: str  # the generated relation of the values converted


def expand_conversions(program: ast.Program) -> tuple[ast.Program, tuple[Conversion, ...]]:
    """The program with each conversion rule split into its value and its integer reading."""
    statements: list[ast.Statement] = []
    conversions: list[Conversion] = []
    taken: dict[str, int] = {}
    for s in program.statements:
        if not isinstance(s, ast.Rule):
            statements.append(s)
            continue
        _check_placement(s)
        if not (isinstance(s.body, ast.Call) and s.body.fn in CONVERSIONS):
            statements.append(s)
            continue
        call = s.body
        if len(call.args) != 1:
            raise EdlError(f"{call.fn}() takes 1 argument, but {len(call.args)} are given", call.span)
        if s.lookups:
            raise EdlError(
                f"a lookup in a rule that converts to {call.fn}",
                s.lookups[0].span,
                help="look the value up in a rule of its own, then convert that relation",
            )
        n = taken[s.head.relation] = taken.get(s.head.relation, 0) + 1
        name = f"{s.head.relation}.value" + (str(n) if n > 1 else "")
        variables = list(dict.fromkeys([*ast.position_vars(s.head.positions), *ast.body_vars(s.body)]))
        value = _atom(name, variables, s)
        statements.append(ast.Rule(value, "=", call.args[0], s.guards, s.span, s.aggop_span))
        statements.append(ast.Rule(s.head, s.aggop, value, (), s.span, s.aggop_span, call.fn))
        conversions.append(Conversion(call, name))
    return ast.Program(program.source, tuple(statements)), tuple(conversions)


def check_conversions(graph: Graph, conversions: tuple[Conversion, ...]) -> None:
    """What a conversion converts is a whole number (see :func:`_whole`)."""
    for conv in conversions:
        arg = conv.call.args[0]
        if _whole(arg, graph):
            continue
        raise EdlError(
            f"{conv.call.fn}() needs a whole number, but '{arg.span.text}' is {graph.relation(conv.value).dtype}",
            arg.span,
            help=f"say how to make it one: {conv.call.fn}(round(...)), or floor, ceil or trunc",
        )


def _whole(e: ast.Expr, graph: Graph) -> bool:
    """Whether ``e`` is a whole number at every point: integers, booleans, index values, dims,
    whole literals, rounded values, and sums, differences, products, negations, ``abs``,
    ``max``, ``min`` and ``where`` choices of whole numbers."""
    if isinstance(e, ast.Num):
        return float(e.value).is_integer()
    if isinstance(e, ast.Name):
        return e.ident not in dict(graph.consts) and e.ident not in ("pi", "inf")
    if isinstance(e, ast.Atom):
        return dtypes.kind(graph.relation(e.relation).dtype) != "float"
    if isinstance(e, ast.Unary):
        return e.op == "-" and _whole(e.arg, graph)
    if isinstance(e, ast.Binary):
        return e.op in "+-*" and _whole(e.lhs, graph) and _whole(e.rhs, graph)
    if isinstance(e, ast.Call):
        if e.fn in ROUNDING:
            return True
        if e.fn == "where":
            return all(_whole(a, graph) for a in e.args[1:])
        return e.fn in ("abs", "max", "min") and all(_whole(a, graph) for a in e.args)
    return False


def _check_placement(rule: ast.Rule) -> None:
    """A conversion is the whole body of its rule."""
    top = rule.body if isinstance(rule.body, ast.Call) and rule.body.fn in CONVERSIONS else None
    for root in top.args if top is not None else (rule.body,):
        for e in ast.walk(root):
            if isinstance(e, ast.Call) and e.fn in CONVERSIONS:
                raise EdlError(
                    f"{e.fn}(...) inside an expression",
                    e.span,
                    help=f"a conversion is the whole body of a rule: give the value a relation of its own, "
                    f"'n[i] = {e.fn}(...).', and use that",
                )


def _atom(relation: str, variables: list[str], rule: ast.Rule) -> ast.Atom:
    """``relation[v, ...]``, each variable keeping an extent the head gives it (``j:M``)."""
    extents = {c.var: c.extent for p in rule.head.positions for c in p.components if c.var is not None}
    s = rule.span
    positions = tuple(ast.Position((ast.Component(v, None, extents.get(v), s),), False, s) for v in variables)
    return ast.Atom(relation, positions, s, s)
