"""Pass 4: lowering.  Turns each checked rule into a :class:`~edatalog.ir.graph.JoinAgg` whose
guard is still the user's own; :mod:`edatalog.rules.support` adds what the relations read imply."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from edatalog.errors import EdlError
from edatalog.ir import dtypes
from edatalog.ir.affine import Constraint, Guard
from edatalog.ir.graph import Access, AxisMap, Index, JoinAgg, Lookup, Part
from edatalog.ir.scalar import BINARY, COMPARISONS, Const, ExprBuilder, IndexValue, Load, Op, ScalarExpr
from edatalog.lang import ast
from edatalog.rules.check import RuleInfo
from edatalog.rules.extents import Extents
from edatalog.rules.indexexpr import GUARD, INDEX, affine_of
from edatalog.rules.scope import BUILTIN_CONSTS, Scope

# Functions that keep integers integral; everything else computes in floating point.
_INTEGRAL = {"abs", "max", "min", "where", "relu"}


@dataclass(frozen=True)
class Lowered:
    node: JoinAgg  # guard: the user's guards only; dtype: as computed from this rule alone
    info: RuleInfo


def lower_rule(
    info: RuleInfo, name: str, scope: Scope, ext: Extents, rel_dtype: Mapping[str, str], default_float: str
) -> Lowered:
    rule = info.rule
    indices = tuple(Index(v, *ext.var[(info.index, v)]) for v in info.vars)
    rule_vars = set(info.vars)
    atoms = (info.head, *info.atoms)

    def axes(a_no: int) -> tuple[AxisMap, ...]:
        atom = atoms[a_no]
        maps = []
        for k, pos in enumerate(atom.positions):
            parts = []
            for c_no, comp in enumerate(pos.components):
                size = ext.part[(info.index, a_no, k, c_no)]
                if comp.var is not None:
                    parts.append(Part.of_index(comp.var, size))
                elif comp.literal is not None:
                    parts.append(Part.fixed(comp.literal, size))
                else:
                    assert comp.expr is not None
                    parts.append(Part(affine_of(comp.expr, rule_vars, scope, INDEX), size))
            maps.append(AxisMap(tuple(parts)))
        return tuple(maps)

    accesses: list[Access] = []
    load_of: dict[int, int] = {}  # id(atom) -> input number
    for a_no, atom in enumerate(info.atoms, start=1):
        acc = Access(atom.relation, axes(a_no))
        if acc not in accesses:
            accesses.append(acc)
        load_of[id(atom)] = accesses.index(acc)

    builder = ExprBuilder()
    lowerer = _ExprLowerer(builder, set(info.vars), scope, load_of)
    root = lowerer.lower(rule.body)
    expr = builder.build(root)

    dtype = _rule_dtype(rule, [rel_dtype[a.relation] for a in accesses], set(info.vars), scope, default_float)
    _check_numbers(expr, dtype, rule)
    guard = Guard.true()
    for g in rule.conditions:
        assert isinstance(g, ast.Compare)
        guard = guard & guard_of(g, set(info.vars), scope)
    guard = guard.simplify({i.name: i.extent for i in indices})
    lookups = []
    for lk in rule.lookups:
        k = load_of[id(lk.atom)]
        kind = dtypes.kind(rel_dtype[accesses[k].relation])
        if kind != "int":
            name = lk.atom.relation
            declared = name in scope.decls
            raise EdlError(
                f"'{name}' is {rel_dtype[accesses[k].relation]}: a lookup needs integer values",
                lk.atom.span,
                help=f"declare '{name}' as i64 or i32 (token ids, positions)"
                if declared
                else f"'{name}' is computed by rules, and takes their dtype: a lookup reads integers that "
                "rules compute from integer relations (i64 inputs and params, or index values: "
                f"'{name}[i] max= j where ...'); the language has no float-to-integer conversion",
            )
        lookups.append(Lookup(lk.var, k, ext.var[(info.index, lk.var)][0]))
    # A looked-up index not in the head is summed over its one value: '=' is '+=' of one term,
    # which is what a block over part of its range contributes to (a vocabulary-sharded embedding).
    aggop = "+=" if lookups and rule.aggop == "=" else rule.aggop
    node = JoinAgg(
        name,
        rule.head.relation,
        indices,
        tuple(accesses),
        expr,
        aggop,
        axes(0),
        guard,
        dtype,
        str(rule.span),
        tuple(lookups),
    )
    return Lowered(node, info)


class _ExprLowerer:
    def __init__(self, b: ExprBuilder, rule_vars: set[str], scope: Scope, load_of: dict[int, int]) -> None:
        self.b, self.vars, self.scope, self.load_of = b, rule_vars, scope, load_of

    def lower(self, e: ast.Expr) -> int:
        b = self.b
        if isinstance(e, ast.Num):
            return b.add(Const(e.value))
        if isinstance(e, ast.Name):
            if e.ident in self.vars:
                return b.add(IndexValue(e.ident))
            if e.ident in self.scope.dims:
                return b.add(Const(self.scope.dims[e.ident].value, e.ident))
            if e.ident in self.scope.consts:
                return b.add(Const(self.scope.consts[e.ident].value, e.ident))
            return b.add(Const(BUILTIN_CONSTS[e.ident], e.ident))
        if isinstance(e, ast.Atom):
            return b.add(Load(self.load_of[id(e)]))
        if isinstance(e, ast.Unary):
            return b.add(Op("neg" if e.op == "-" else "not", (self.lower(e.arg),)))
        if isinstance(e, ast.Binary):
            return b.add(Op(BINARY[e.op], (self.lower(e.lhs), self.lower(e.rhs))))
        if isinstance(e, ast.Compare):
            return b.add(Op(COMPARISONS[e.op], (self.lower(e.lhs), self.lower(e.rhs))))
        assert isinstance(e, ast.Call)
        return b.add(Op(e.fn, tuple(self.lower(a) for a in e.args)))


def _check_numbers(expr: ScalarExpr, dtype: str, rule: ast.Rule) -> None:
    """Every number of the body (as written or folded) must be representable in the rule's type."""
    np_dtype = dtypes.to_numpy(dtypes.compute_dtype(dtype))
    for node in expr.nodes:
        if not isinstance(node, Const) or isinstance(node.value, bool):
            continue
        v = node.value
        if np_dtype.kind in "iu" and isinstance(v, int):
            info = np.iinfo(np_dtype)
            if not info.min <= v <= info.max:
                raise EdlError(
                    f"the number {v} does not fit the rule's type {dtype} ({info.min} .. {info.max})",
                    rule.body.span,
                    help="use a smaller number, or read a wider relation",
                )
        elif isinstance(v, int):
            try:
                float(v)
            except OverflowError:
                raise EdlError(
                    "a number in this rule is too large for a floating-point value", rule.body.span
                ) from None


def _rule_dtype(rule: ast.Rule, atom_dtypes: list[str], rule_vars: set[str], scope: Scope, default_float: str) -> str:
    """Atoms set the type; numbers are weak.  Division, powers, transcendental functions and
    fractional numbers need floats; index values, dims, arithmetic and sums need at least
    integers (so booleans add up to counts, as in numpy's ``sum``).  A generated rule may state
    its type instead."""
    if rule.dtype is not None:
        return rule.dtype
    need = "int" if rule.aggop in ("+=", "*=") else "bool"
    for e in ast.walk(rule.body):
        if isinstance(e, ast.Num):
            need = _max_kind(need, "float" if isinstance(e.value, float) else "int")
        elif isinstance(e, ast.Name):
            is_int = e.ident in rule_vars or e.ident in scope.dims
            need = _max_kind(need, "int" if is_int else "float")
        elif (isinstance(e, ast.Binary) and e.op in ("/", "^")) or (isinstance(e, ast.Call) and e.fn not in _INTEGRAL):
            need = "float"
        elif (isinstance(e, ast.Binary) and e.op in "+-*") or (isinstance(e, ast.Unary) and e.op == "-"):
            need = _max_kind(need, "int")
    if not atom_dtypes:
        return {"bool": "bool", "int": "i64", "float": default_float}[need]
    dt = atom_dtypes[0]
    for d in atom_dtypes[1:]:
        dt = dtypes.promote(dt, d)
    if _rank(need) > _rank(dtypes.kind(dt)):
        return "i64" if need == "int" else default_float
    return dt


def _rank(kind: str) -> int:
    return {"bool": 0, "int": 1, "float": 2}[kind]


def _max_kind(a: str, b: str) -> str:
    return a if _rank(a) >= _rank(b) else b


# -- guards --------------------------------------------------------------------------------------


def guard_of(g: ast.Compare, rule_vars: set[str], scope: Scope) -> Guard:
    lhs = affine_of(g.lhs, rule_vars, scope, GUARD)
    rhs = affine_of(g.rhs, rule_vars, scope, GUARD)
    if g.op == "<":
        return Guard.of([Constraint(rhs - lhs - 1)])
    if g.op == "<=":
        return Guard.of([Constraint(rhs - lhs)])
    if g.op == ">":
        return Guard.of([Constraint(lhs - rhs - 1)])
    if g.op == ">=":
        return Guard.of([Constraint(lhs - rhs)])
    if g.op == "==":
        return Guard.of([Constraint(lhs - rhs, eq=True)])
    return Guard.of([Constraint(lhs - rhs - 1)]) | Guard.of([Constraint(rhs - lhs - 1)])
