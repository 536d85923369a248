"""Pass 1: declarations.  Evaluates dims and consts (with the caller's overrides) and the shapes of
inputs and params; reports duplicates and undefined names."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

from edatalog.errors import EdlError, Note, Span, did_you_mean
from edatalog.ir.scalar import BINARY, FOLD, FUNCTIONS
from edatalog.lang import ast

T = TypeVar("T")

BUILTIN_CONSTS = {"pi": math.pi, "inf": math.inf}
MAX_EXTENT = 2**63 - 1  # the largest extent an int64 index can address
MAX_DEPTH = 200  # expressions nested deeper would exhaust Python's stack in later passes


@dataclass(frozen=True)
class DimInfo:
    name: str
    value: int
    span: Span | None  # None when given only as an override
    expr: ast.Expr | None = None  # the definition; None when overridden


@dataclass(frozen=True)
class ConstInfo:
    name: str
    value: float
    span: Span | None


@dataclass(frozen=True)
class RelDecl:
    name: str
    kind: str  # "input" | "param"
    shape: tuple[int, ...]
    symbols: tuple[str, ...]
    dtype: str
    decl: ast.RelationDecl

    @property
    def span(self) -> Span:
        return self.decl.name_span


@dataclass
class Scope:
    dims: dict[str, DimInfo] = field(default_factory=dict)
    consts: dict[str, ConstInfo] = field(default_factory=dict)
    decls: dict[str, RelDecl] = field(default_factory=dict)
    outputs: list[tuple[str, Span]] = field(default_factory=list)
    rules: list[ast.Rule] = field(default_factory=list)
    const_names: set[str] = field(default_factory=set)  # declared, even before they are evaluated


def dim_symbol(expr: ast.Expr, parent: int = 0) -> str:
    """Compact text of a dim expression: ``H*E``, ``D/H``, ``(S+1)*2``."""
    if isinstance(expr, ast.Num):
        return expr.text
    if isinstance(expr, ast.Name):
        return expr.ident
    if isinstance(expr, ast.Unary):
        return "-" + dim_symbol(expr.arg, 3)
    if isinstance(expr, ast.Binary):
        prec = 1 if expr.op in "+-" else 2
        text = f"{dim_symbol(expr.lhs, prec)}{expr.op}{dim_symbol(expr.rhs, prec + 1)}"
        return f"({text})" if prec < parent else text
    return expr.span.text


class _Declared:
    """Tracks every declared name for duplicate detection."""

    def __init__(self) -> None:
        self.first: dict[str, tuple[str, Span]] = {}

    def add(self, name: str, what: str, span: Span) -> None:
        if name in BUILTIN_CONSTS:
            raise EdlError(f"'{name}' is a built-in constant and cannot be declared", span, help="choose another name")
        if name in FUNCTIONS:
            raise EdlError(f"'{name}' is a built-in function and cannot be declared", span, help="choose another name")
        prev = self.first.get(name)
        if prev is not None:
            article = "an" if prev[0][0] in "aeiou" else "a"
            raise EdlError(
                f"duplicate declaration of '{name}'",
                span,
                help="each name is declared once; rename one of them",
                notes=[Note(f"'{name}' was first declared here, as {article} {prev[0]}", prev[1])],
            )
        self.first[name] = (what, span)


def build_scope(
    program: ast.Program,
    dims: Mapping[str, int] | None = None,
    consts: Mapping[str, float] | None = None,
) -> Scope:
    _check_depth(program)
    scope = Scope()
    declared = _Declared()
    dim_exprs: dict[str, ast.Binding] = {}
    const_exprs: dict[str, ast.Binding] = {}
    rel_decls: list[ast.RelationDecl] = []
    for stmt in program.statements:
        if isinstance(stmt, ast.DimDecl):
            for b in stmt.items:
                declared.add(b.name, "dim", b.name_span)
                dim_exprs[b.name] = b
        elif isinstance(stmt, ast.ConstDecl):
            for b in stmt.items:
                declared.add(b.name, "const", b.name_span)
                const_exprs[b.name] = b
                scope.const_names.add(b.name)
        elif isinstance(stmt, ast.RelationDecl):
            declared.add(stmt.name, stmt.kind, stmt.name_span)
            rel_decls.append(stmt)
        elif isinstance(stmt, ast.OutputDecl):
            for name, span in stmt.names:
                prev = next((s for n, s in scope.outputs if n == name), None)
                if prev is not None:
                    raise EdlError(
                        f"duplicate declaration: '{name}' is already an output",
                        span,
                        help="list each output once",
                        notes=[Note("first listed here", prev)],
                    )
                scope.outputs.append((name, span))
        else:
            assert isinstance(stmt, ast.Rule), "modules are instantiated before scoping"
            scope.rules.append(stmt)

    dim_values = _check_overrides("dim", dims or {}, dim_exprs, _first_decl(program, ast.DimDecl))
    const_values = _check_overrides("const", consts or {}, const_exprs, _first_decl(program, ast.ConstDecl))
    _DimEvaluator(dim_exprs, dim_values, scope).run()
    _ConstEvaluator(const_exprs, const_values, scope).run()
    for d in rel_decls:
        shape = tuple(eval_dim(e, scope, f"the shape of {d.name}") for e in d.shape)
        scope.decls[d.name] = RelDecl(d.name, d.kind, shape, tuple(dim_symbol(e) for e in d.shape), d.dtype, d)
    return scope


def _expressions(program: ast.Program) -> list[ast.Expr]:
    """The top-level expressions of every statement, extents in index positions included."""
    out: list[ast.Expr] = []
    for stmt in program.statements:
        if isinstance(stmt, (ast.DimDecl, ast.ConstDecl)):
            out.extend(b.expr for b in stmt.items)
        elif isinstance(stmt, ast.RelationDecl):
            out.extend(stmt.shape)
        elif isinstance(stmt, ast.Rule):
            out.extend((stmt.head, stmt.body, *stmt.conditions, *(lk.atom for lk in stmt.lookups)))
    return out


def _check_depth(program: ast.Program) -> None:
    """Reject expressions nested so deeply that the recursive passes would overflow the stack:
    ``a + b + ... + z`` nests one level per term."""
    for root in _expressions(program):
        stack: list[tuple[ast.Expr, int]] = [(root, 1)]
        while stack:
            e, depth = stack.pop()
            if depth > MAX_DEPTH:
                raise EdlError(
                    f"expression nested too deeply (more than {MAX_DEPTH} levels)",
                    root.span,
                    help="split it into several rules; a sum of many terms nests one level per term",
                )
            if isinstance(e, ast.Call):
                stack.extend((a, depth + 1) for a in e.args)
            elif isinstance(e, ast.Unary):
                stack.append((e.arg, depth + 1))
            elif isinstance(e, (ast.Binary, ast.Compare)):
                stack.extend(((e.lhs, depth + 1), (e.rhs, depth + 1)))
            elif isinstance(e, ast.Atom):
                stack.extend((c.extent, depth + 1) for p in e.positions for c in p.components if c.extent is not None)


def _first_decl(program: ast.Program, kind: type[ast.DimDecl | ast.ConstDecl]) -> Span | None:
    """The first ``dim`` (or ``const``) declaration: where an override would have to be declared."""
    decl = next((s for s in program.statements if isinstance(s, kind)), None)
    return None if decl is None else decl.span


def _check_overrides(
    what: str, given: Mapping[str, object], declared: Mapping[str, ast.Binding], where: Span | None
) -> dict[str, object]:
    """Check override names and values; numpy scalars are welcome and become Python numbers."""
    out: dict[str, object] = {}
    for name, value in given.items():
        if name not in declared:
            raise EdlError(
                f"unknown {what} '{name}' in the overrides",
                where,
                help=did_you_mean(name, declared, f"{what}s") or f"the program declares no {what}s",
                notes=[Note(f"overrides can only change the {what}s the program declares")] if where else [],
            )
        if isinstance(value, bool | np.bool_):
            number: object = None
        elif what == "dim":
            number = int(value) if isinstance(value, numbers.Integral) else None
        elif isinstance(value, int):
            number = value  # a Python int may not fit a float: the const evaluator reports that
        else:
            number = float(value) if isinstance(value, numbers.Real) else None
        if number is None or (what == "dim" and isinstance(number, int) and not 0 < number <= MAX_EXTENT):
            kind = "a number"
            if what == "dim":
                big = isinstance(number, int) and number > MAX_EXTENT
                kind = f"at most 2^63 - 1 = {MAX_EXTENT}" if big else "a positive integer"
            raise EdlError(f"override of {what} '{name}' must be {kind}, not {value!r}", declared[name].name_span)
        out[name] = number
    return out


class _Bindings(Generic[T]):
    """Evaluates named bindings (dims or consts) on demand, in dependency order, so ``E = D / H``
    follows an override of ``D``; reports cycles and over-long chains."""

    what = ""

    def __init__(self, exprs: dict[str, ast.Binding], overrides: Mapping[str, object], scope: Scope) -> None:
        self.exprs, self.overrides, self.scope = exprs, overrides, scope
        self.active: list[str] = []
        self.done: dict[str, T] = {}

    def run(self) -> None:
        for name in self.exprs:
            try:
                self.value(name)
            except RecursionError:
                raise EdlError(
                    f"{self.what} {name} is defined through too long a chain of other {self.what}s",
                    self.exprs[name].name_span,
                    help=f"define it from fewer intermediate {self.what}s",
                ) from None

    def value(self, name: str) -> T:
        if name in self.done:
            return self.done[name]
        b = self.exprs[name]
        overridden = name in self.overrides
        if overridden:
            v = self.from_override(name, b)
        else:
            if name in self.active:
                cycle = " -> ".join([*self.active[self.active.index(name) :], name])
                raise EdlError(
                    f"{self.what} '{name}' is defined in terms of itself: {cycle}",
                    b.name_span,
                    help="give one of them a value that does not depend on the others",
                )
            self.active.append(name)
            v = self.compute(name, b)
            self.active.pop()
        self.done[name] = v
        self.record(name, v, b, overridden)
        return v

    def from_override(self, name: str, b: ast.Binding) -> T:
        raise NotImplementedError

    def compute(self, name: str, b: ast.Binding) -> T:
        raise NotImplementedError

    def record(self, name: str, value: T, b: ast.Binding, overridden: bool) -> None:
        raise NotImplementedError


class _DimEvaluator(_Bindings[int]):
    what = "dim"

    def from_override(self, name: str, b: ast.Binding) -> int:
        value = self.overrides[name]
        assert isinstance(value, int)  # checked by _check_overrides
        return value

    def compute(self, name: str, b: ast.Binding) -> int:
        return eval_dim(b.expr, self.scope, f"dim {name}", lookup=self)

    def record(self, name: str, value: int, b: ast.Binding, overridden: bool) -> None:
        self.scope.dims[name] = DimInfo(name, value, b.name_span, None if overridden else b.expr)


def eval_dim(expr: ast.Expr, scope: Scope, what: str, lookup: _DimEvaluator | None = None) -> int:
    """Evaluate a dim expression (+ - * / of integers and dims) to a positive integer."""
    v = _dim_value(expr, scope, what, lookup)
    sym = dim_symbol(expr)
    shown = f"{sym} = {v}" if sym != str(v) else str(v)
    if v <= 0:
        raise EdlError(f"{what} must be positive, but it is {shown}", expr.span)
    if v > MAX_EXTENT:
        raise EdlError(
            f"{what} is too large: {shown}",
            expr.span,
            help=f"extents must fit a 64-bit index (at most 2^63 - 1 = {MAX_EXTENT})",
        )
    return v


def _dim_value(expr: ast.Expr, scope: Scope, what: str, lookup: _DimEvaluator | None) -> int:
    if isinstance(expr, ast.Num):
        if isinstance(expr.value, int):
            return expr.value
        raise EdlError(f"{what} must be a whole number, not {expr.text}", expr.span)
    if isinstance(expr, ast.Name):
        if lookup is not None and expr.ident in lookup.exprs:
            return lookup.value(expr.ident)
        if expr.ident in scope.dims:
            return scope.dims[expr.ident].value
        if expr.ident in scope.const_names or expr.ident in BUILTIN_CONSTS:
            raise EdlError(
                f"'{expr.ident}' is a const; {what} may use only dims and integers",
                expr.span,
                help=f"declare '{expr.ident}' as a dim ('dim {expr.ident} = ...') to use it in shapes"
                if expr.ident not in BUILTIN_CONSTS
                else None,
            )
        defining = set(lookup.active) if lookup else set()  # never suggest the dim being defined
        pool = [d for d in [*scope.dims, *(lookup.exprs if lookup else ())] if d not in defining]
        raise EdlError(f"undefined dim '{expr.ident}'", expr.span, help=did_you_mean(expr.ident, pool, "dims"))
    if isinstance(expr, ast.Unary) and expr.op == "-":
        return -_dim_value(expr.arg, scope, what, lookup)
    if isinstance(expr, ast.Binary) and expr.op in "+-*/":
        a = _dim_value(expr.lhs, scope, what, lookup)
        b = _dim_value(expr.rhs, scope, what, lookup)
        if expr.op == "+":
            return a + b
        if expr.op == "-":
            return a - b
        if expr.op == "*":
            return a * b
        if b == 0:
            rhs = dim_symbol(expr.rhs)
            raise EdlError(f"division by zero in {what}" + (f": {rhs} = 0" if rhs != "0" else ""), expr.span)
        if a % b:
            raise EdlError(
                f"{what} is not a whole number: {dim_symbol(expr)} = {a} / {b}",
                expr.span,
                help="dims are integers; pick values that divide evenly",
            )
        return a // b
    raise EdlError(f"{what} may use only + - * / on integers and dims", expr.span)


_AGGREGATE_HELP = (
    "aggregations are rules, not functions: 'y[i] += x[i, j].' sums over j, the index the head "
    "leaves out (also *=, max=, min=)"
)
_AGGREGATE_NAMES = {"sum", "mean", "prod", "product", "amax", "amin", "argmax", "argmin", "count", "reduce"}


def check_call(e: ast.Call) -> None:
    """A call names a built-in function and passes it the right number of arguments."""
    if e.fn not in FUNCTIONS:
        help_text = _AGGREGATE_HELP if e.fn in _AGGREGATE_NAMES else did_you_mean(e.fn, FUNCTIONS, "functions")
        raise EdlError(f"unknown function '{e.fn}'", e.fn_span, help=help_text)
    n = FUNCTIONS[e.fn]
    if len(e.args) != n:
        given = f"{len(e.args)} {'is' if len(e.args) == 1 else 'are'} given"
        help_text = _AGGREGATE_HELP if e.fn in ("max", "min") and len(e.args) == 1 else None
        raise EdlError(f"{e.fn}() takes {n} argument{'s' if n > 1 else ''}, but {given}", e.span, help=help_text)


class _ConstEvaluator(_Bindings[float]):
    what = "const"

    def from_override(self, name: str, b: ast.Binding) -> float:
        try:
            return float(self.overrides[name])  # type: ignore[arg-type]  # a number: _check_overrides
        except OverflowError:
            raise EdlError(f"override of const '{name}' is too large for a floating-point value", b.name_span) from None

    def compute(self, name: str, b: ast.Binding) -> float:
        raw = self.eval(b.expr, name)
        if isinstance(raw, complex):
            raise EdlError(f"const {name} is not a real number", b.expr.span)
        return float(raw)

    def record(self, name: str, value: float, b: ast.Binding, overridden: bool) -> None:
        self.scope.consts[name] = ConstInfo(name, value, b.name_span)

    def eval(self, e: ast.Expr, owner: str) -> float | bool:
        # Consts compute in floating point: integer powers such as 10 ^ 4000 must not become
        # huge Python integers.
        if isinstance(e, ast.Num):
            try:
                return float(e.value)
            except OverflowError:
                raise EdlError(f"number {e.text} is too large for a floating-point value", e.span) from None
        if isinstance(e, ast.Name):
            if e.ident in self.exprs:
                return self.value(e.ident)
            if e.ident in self.scope.dims:
                return float(self.scope.dims[e.ident].value)
            if e.ident in BUILTIN_CONSTS:
                return BUILTIN_CONSTS[e.ident]
            pool = [n for n in (*self.exprs, *self.scope.dims, *BUILTIN_CONSTS) if n not in self.active]
            raise EdlError(
                f"undefined name '{e.ident}' in const {owner}", e.span, help=did_you_mean(e.ident, pool, "names")
            )
        if isinstance(e, ast.Atom):
            raise EdlError(
                f"const {owner} cannot read relation '{e.relation}'",
                e.span,
                help="consts are numbers fixed before the program runs",
            )
        if isinstance(e, ast.Unary | ast.Binary) and e.op in ("and", "or", "not"):
            help_text = "consts are numbers; conditions belong in rule bodies"
            raise EdlError(f"const {owner} cannot use '{e.op}'", e.span, help=help_text)
        try:
            if isinstance(e, ast.Unary):
                return FOLD["neg"](self.eval(e.arg, owner))
            if isinstance(e, ast.Binary):
                return FOLD[BINARY[e.op]](self.eval(e.lhs, owner), self.eval(e.rhs, owner))
            if isinstance(e, ast.Compare):
                raise EdlError(f"const {owner} cannot be a comparison", e.span)
            if isinstance(e, ast.Call):
                check_call(e)
                return FOLD[e.fn](*(self.eval(a, owner) for a in e.args))
        except ZeroDivisionError:
            raise EdlError(f"cannot evaluate const {owner}: division by zero", e.span) from None
        except OverflowError:
            raise EdlError(
                f"cannot evaluate const {owner}: the result is too large for a floating-point value", e.span
            ) from None
        except (ArithmeticError, ValueError):
            raise EdlError(
                f"cannot evaluate const {owner}: an argument is outside the function's domain",
                e.span,
                help="e.g. sqrt and log need arguments that are not negative",
            ) from None
        raise EdlError(f"unexpected expression in const {owner}", e.span)
