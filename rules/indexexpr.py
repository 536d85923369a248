"""Affine expressions of index variables, as written in guards (``t <= s + W``) and in index
positions (``x[b, c, l + k]``): sums of index variables times integers or dims, plus integers
and dims.  Both are checked and converted by :func:`affine_of`, so that they accept exactly the
same forms and reject the rest with the same explanations."""

from __future__ import annotations

from collections.abc import Container

from edatalog.errors import EdlError
from edatalog.ir.affine import Affine
from edatalog.lang import ast
from edatalog.rules.scope import BUILTIN_CONSTS, Scope

GUARD = "guard"
INDEX = "index expression"

_EXAMPLES = {
    GUARD: "a guard compares sums of index variables times integers, dims and integers, e.g. 't <= s', 'i + j < N'",
    INDEX: "an index expression is a sum of index variables times integers or dims, plus integers and dims, "
    "e.g. 'l + k', 't - 1', '2 * s + 1'",
}


def affine_of(e: ast.Expr, rule_vars: Container[str], scope: Scope, what: str) -> Affine:
    """``e`` as an affine function of ``rule_vars``; ``what`` (:data:`GUARD` or :data:`INDEX`)
    says where it was written, for the error messages."""
    help_text = _EXAMPLES[what]
    if isinstance(e, ast.Num):
        if isinstance(e.value, float):
            raise EdlError(f"{what}s use whole numbers, not {e.text}", e.span, help=help_text)
        return Affine((), e.value)
    if isinstance(e, ast.Name):
        if e.ident in rule_vars:
            return Affine.var(e.ident)
        if e.ident in scope.dims:
            return Affine((), scope.dims[e.ident].value)
        raise EdlError(f"{what}s may not use the const '{e.ident}'", e.span, help=help_text)
    if isinstance(e, ast.Unary) and e.op == "-":
        return -affine_of(e.arg, rule_vars, scope, what)
    if isinstance(e, ast.Binary) and e.op in "+-":
        a, b = affine_of(e.lhs, rule_vars, scope, what), affine_of(e.rhs, rule_vars, scope, what)
        return a + b if e.op == "+" else a - b
    if isinstance(e, ast.Binary) and e.op == "*":
        a, b = affine_of(e.lhs, rule_vars, scope, what), affine_of(e.rhs, rule_vars, scope, what)
        if a.terms and b.terms:
            raise EdlError(f"{what} is not affine: '{e.span.text}' multiplies index variables", e.span, help=help_text)
        return b.scale(a.const) if not a.terms else a.scale(b.const)
    if isinstance(e, ast.Binary) and e.op == "/":
        a, b = affine_of(e.lhs, rule_vars, scope, what), affine_of(e.rhs, rule_vars, scope, what)
        if b.terms or b.const == 0:
            raise EdlError(
                f"{what} is not affine: '{e.span.text}' divides by an index or by zero", e.span, help=help_text
            )
        if a.const % b.const or any(c % b.const for _, c in a.terms):
            fix = (
                "multiply both sides instead, e.g. 'i < 2 * j' rather than 'i / 2 < j'"
                if what == GUARD
                else "index expressions are integers: pick values that divide evenly, or use a composite "
                "such as x[(i, r:2)] to address every second place"
            )
            raise EdlError(f"{what} is not integral: '{e.span.text}' does not divide evenly", e.span, help=fix)
        return Affine(tuple((v, c // b.const) for v, c in a.terms), a.const // b.const)
    if isinstance(e, ast.Atom):
        fix = (
            "use where(cond, a, b) in the body to select on values"
            if what == GUARD
            else "positions are computed from index variables, never read from relations"
        )
        raise EdlError(f"{what}s cannot read relations ('{e.relation}')", e.span, help=fix)
    raise EdlError(f"{what} is not affine: '{e.span.text}'", e.span, help=help_text)


def index_names(e: ast.Expr, scope: Scope) -> list[ast.Name]:
    """The names in an index expression that are index variables (not dims or consts), in order."""
    named = (*scope.dims, *scope.consts, *scope.const_names, *BUILTIN_CONSTS)
    return [n for n in ast.walk(e) if isinstance(n, ast.Name) and n.ident not in named]
