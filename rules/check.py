"""Pass 2: rule structure.  Resolves every name a rule uses, checks arities, aggregation operators,
index binding and dependencies, and orders the relations so each is computed after what it reads."""

from __future__ import annotations

from dataclasses import dataclass, field

from edatalog.errors import Diagnostic, EdlError, Note, Span, did_you_mean
from edatalog.lang import ast
from edatalog.lang.parser import KEYWORDS
from edatalog.rules.indexexpr import INDEX, affine_of, index_names
from edatalog.rules.scope import BUILTIN_CONSTS, Scope, check_call


@dataclass
class RuleInfo:
    """A rule with its atoms and index variables collected."""

    index: int
    rule: ast.Rule
    atoms: tuple[ast.Atom, ...]  # body atoms, in reading order
    vars: tuple[str, ...]  # index variables, head first, in order of first appearance
    first: dict[str, Span]  # where each variable first appears

    @property
    def head(self) -> ast.Atom:
        return self.rule.head


@dataclass
class Checked:
    scope: Scope
    rules: list[RuleInfo]
    arity: dict[str, int]
    by_head: dict[str, list[RuleInfo]]
    order: list[str]  # derived relations, each after everything it reads
    outputs: list[str]
    warnings: list[Diagnostic] = field(default_factory=list)


def body_atoms(expr: ast.Expr) -> list[ast.Atom]:
    return [e for e in ast.walk(expr) if isinstance(e, ast.Atom)]


def _vars_of(atom: ast.Atom) -> list[ast.Component]:
    return [c for p in atom.positions for c in p.components if c.var is not None]


def _expr_vars(atom: ast.Atom, scope: Scope) -> list[ast.Name]:
    """The index variables named inside the index expressions of an atom (``l`` and ``k`` in
    ``x[b, l + k]``; dims such as ``K`` in ``t + K - 1`` are numbers)."""
    return [n for p in atom.positions for c in p.components if c.expr is not None for n in index_names(c.expr, scope)]


def _check_head_positions(head: ast.Atom) -> None:
    for p in head.positions:
        for c in p.components:
            if c.expr is not None:
                raise EdlError(
                    f"index expression '{c.expr.span.text}' in the head of a rule",
                    c.expr.span,
                    help="a head names the cells it defines with variables, literals and composites; "
                    "shift in the body instead: write 'y[t] = x[t - 1].', not 'y[t + 1] = x[t].'",
                )


def check_rules(scope: Scope) -> Checked:
    heads: dict[str, ast.Rule] = {}
    for r in scope.rules:
        heads.setdefault(r.head.relation, r)
    arity: dict[str, tuple[int, Span]] = {n: (len(d.shape), d.decl.span) for n, d in scope.decls.items()}
    infos: list[RuleInfo] = []
    for rule in scope.rules:
        _check_head(rule, scope)
        arity.setdefault(rule.head.relation, (len(rule.head.positions), rule.head.span))
    for k, rule in enumerate(scope.rules):
        infos.append(_check_rule(k, rule, scope, heads, arity))
    by_head: dict[str, list[RuleInfo]] = {}
    for info in infos:
        by_head.setdefault(info.head.relation, []).append(info)
    for rel, group in by_head.items():
        first = group[0].rule
        for info in group[1:]:
            if info.rule.aggop != first.aggop:
                raise EdlError(
                    f"conflicting aggregation operators for '{rel}': {first.aggop} and {info.rule.aggop}",
                    info.rule.aggop_span,
                    help=f"every rule for '{rel}' must use the same operator; rules combine with it",
                    notes=[Note(f"the first rule for '{rel}' uses {first.aggop}", first.aggop_span)],
                )
    order = _dependency_order(by_head)
    outputs = _outputs(scope, by_head)
    checked = Checked(scope, infos, {n: a for n, (a, _) in arity.items()}, by_head, order, outputs)
    empty = _no_rules(scope)
    checked.warnings.extend([empty] if empty is not None else _unused(scope, infos, outputs))
    return checked


def _check_head(rule: ast.Rule, scope: Scope) -> None:
    name = rule.head.relation
    decl = scope.decls.get(name)
    if decl is not None:
        raise EdlError(
            f"cannot assign to {decl.kind} '{name}'",
            rule.head.name_span,
            help=f"{decl.kind}s are given when the program runs; write the result to a new relation",
            notes=[
                Note(f"'{name}' is declared as {'an' if decl.kind == 'input' else 'a'} {decl.kind} here", decl.span)
            ],
        )
    if name in scope.dims or name in scope.consts:
        what = "dim" if name in scope.dims else "const"
        raise EdlError(f"'{name}' is a {what}, not a relation", rule.head.name_span, help="rename the relation")


def _check_rule(
    k: int, rule: ast.Rule, scope: Scope, heads: dict[str, ast.Rule], arity: dict[str, tuple[int, Span]]
) -> RuleInfo:
    atoms = [*body_atoms(rule.body), *(lk.atom for lk in rule.lookups)]
    for atom in atoms:
        if atom.relation not in scope.decls and atom.relation not in heads:
            if atom.relation in scope.dims or atom.relation in scope.consts:
                what = "dim" if atom.relation in scope.dims else "const"
                raise EdlError(
                    f"'{atom.relation}' is a {what}, not a relation",
                    atom.name_span,
                    help=f"use {atom.relation} without brackets",
                )
            pool = sorted({*scope.decls, *heads} - {rule.head.relation})
            known = f"; known relations: {', '.join(pool[:8])}{', ...' if len(pool) > 8 else ''}" if pool else ""
            raise EdlError(
                f"undefined relation '{atom.relation}'",
                atom.name_span,
                help=did_you_mean(atom.relation, pool)
                or f"declare it ('input {atom.relation}[...] : f32.') or define it with a rule{known}",
            )
    for atom in (rule.head, *atoms):
        want, where = arity[atom.relation]
        if len(atom.positions) != want:
            how = "is declared with" if atom.relation in scope.decls else "gets"
            raise EdlError(
                f"wrong number of indices for '{atom.relation}': it has {want} ax{'i' if want == 1 else 'e'}s, "
                f"but {len(atom.positions)} {'is' if len(atom.positions) == 1 else 'are'} given",
                atom.span,
                notes=[Note(f"'{atom.relation}' {how} {want} ax{'i' if want == 1 else 'e'}s here", where)],
            )
    _check_head_positions(rule.head)
    first: dict[str, Span] = {}
    for atom in (rule.head, *atoms):
        for c in _vars_of(atom):
            assert c.var is not None
            first.setdefault(c.var, c.span)
            if c.var in scope.dims or c.var in scope.consts or c.var in BUILTIN_CONSTS:
                what = "dim" if c.var in scope.dims else "const"
                raise EdlError(
                    f"index '{c.var}' has the name of a {what}",
                    c.span,
                    help=f"index variables must differ from dims and consts; rename it (e.g. '{c.var.lower()}')"
                    if c.var.lower() != c.var
                    else "rename the index",
                )
    for atom in atoms:
        for n in _expr_vars(atom, scope):
            first.setdefault(n.ident, n.span)
    for atom in atoms:  # every index expression is affine in the rule's variables
        for p in atom.positions:
            for c in p.components:
                if c.expr is not None:
                    affine_of(c.expr, first, scope, INDEX)
    _check_lookups(rule, atoms, scope)
    for lk in rule.lookups:
        first.setdefault(lk.var, lk.var_span)
    info = RuleInfo(k, rule, tuple(atoms), tuple(first), first)
    names = _check_expr(rule.body, info, scope, cond=False)
    for g in rule.conditions:
        if not isinstance(g, ast.Compare):
            both = isinstance(g, ast.Binary) and g.op == "and"
            raise EdlError(
                "a guard must be a comparison such as 't <= s'",
                g.span,
                help="write several guards separated by commas: 'where t <= s, s < N'"
                if both
                else "compare index expressions with < <= > >= == or !=, e.g. 'where i + 1 < N'",
            )
        names |= _check_expr(g, info, scope, cond=True)
    _check_binding(info, names, scope)
    return info


def _check_lookups(rule: ast.Rule, atoms: list[ast.Atom], scope: Scope) -> None:
    """A looked-up index takes the value its relation holds: it must index some relation of
    the body (which gives its extent), and nothing may constrain it otherwise."""
    seen: set[str] = set()
    for lk in rule.lookups:
        v = lk.var
        if v in seen:
            raise EdlError(f"index '{v}' is looked up twice", lk.span, help="look each index up once")
        seen.add(v)
        if v in scope.dims or v in scope.consts or v in BUILTIN_CONSTS:
            raise EdlError(
                f"'{v}' is a {'dim' if v in scope.dims else 'const'}, not an index",
                lk.var_span,
                help="a lookup binds an index variable: 'where ids[b, s] = v' with v a new name",
            )
        if any(c.var == v for c in _vars_of(lk.atom)) or v in {n.ident for n in _expr_vars(lk.atom, scope)}:
            raise EdlError(
                f"'{lk.atom.relation}' is indexed by '{v}', the index it looks up",
                lk.atom.span,
                help="the relation a lookup reads must be indexed by other indices: 'where ids[b, s] = v'",
            )
        in_head = [c for c in _vars_of(rule.head) if c.var == v]
        if in_head and rule.aggop != "+=":
            raise EdlError(
                f"looked-up index '{v}' in the head of a '{rule.aggop}' rule",
                in_head[0].span,
                help=f"a looked-up index in the head scatters: each point adds to the cell its value names, "
                f"which only '+=' does ('counts[{v}, d] += x[b, d] where ids[b] = {v}:V'); to write one place "
                f"named by a value, select it in the body: "
                f"'new[t, e] = where(t == {v}, k[e], old[t, e]) where pos[] = {v}'",
            )
        others = [a for a in atoms if a is not lk.atom and a not in (o.atom for o in rule.lookups)]
        plain = [c for a in others for c in _vars_of(a) if c.var == v] + in_head
        if not plain and lk.extent is None:
            raise EdlError(
                f"looked-up index '{v}' indexes no relation of the rule, so its range is unknown",
                lk.var_span,
                help=f"use it to read a relation ('emb[b, s, d] = table[{v}, d] where ids[b, s] = {v}'), "
                f"or give its range: 'where pos[] = {v}:T'",
            )
        exprs = [n for a in others for n in _expr_vars(a, scope) if n.ident == v]
        if exprs:
            raise EdlError(
                f"looked-up index '{v}' in an index expression",
                exprs[0].span,
                help="a looked-up index reads a relation at its value only; look up the shifted value instead",
            )
        for g in rule.conditions:
            for n in ast.walk(g):
                if isinstance(n, ast.Name) and n.ident == v:
                    raise EdlError(
                        f"a guard compares looked-up index '{v}'",
                        n.span,
                        help=f"guards select points by their indices before any value is read; compare "
                        f"the value in the body instead: where({_unwrapped(g.span.text)}, ..., ...)",
                    )


def _check_expr(e: ast.Expr, info: RuleInfo, scope: Scope, cond: bool) -> set[str]:
    """Validate an expression; returns the index variables it uses by name."""
    used: set[str] = set()
    if isinstance(e, ast.Name):
        if e.ident in KEYWORDS:
            raise EdlError(
                f"'{e.ident}' is a reserved word, not a value",
                e.span,
                help="where(cond, a, b) selects between values; 'where' after the body starts the guards",
            )
        if e.ident in info.first:
            used.add(e.ident)
        elif e.ident not in scope.dims and e.ident not in scope.consts and e.ident not in BUILTIN_CONSTS:
            pool = [*info.vars, *scope.dims, *scope.consts, *BUILTIN_CONSTS]
            raise EdlError(
                f"undefined name '{e.ident}'",
                e.span,
                help=did_you_mean(e.ident, pool)
                or f"declare it ('const {e.ident} = 1.0.' or 'dim {e.ident} = 8.'), "
                "or use it as an index of a relation in this rule",
            )
    elif isinstance(e, ast.Num | ast.Atom):
        pass
    elif isinstance(e, ast.Compare):
        if not cond:
            raise EdlError(
                f"comparison '{e.op}' outside where(...)",
                e.span,
                help=f"to choose between two values write where({_unwrapped(e.span.text)}, a, b); "
                "to keep only some cells, put a guard on index variables after the body: '... where i < j.'",
            )
        used |= _check_expr(e.lhs, info, scope, False) | _check_expr(e.rhs, info, scope, False)
    elif (isinstance(e, ast.Unary) and e.op == "not") or (isinstance(e, ast.Binary) and e.op in ("and", "or")):
        if not cond:
            raise EdlError(
                f"'{e.op}' outside where(...)", e.span, help="logical operators combine conditions of where(cond, a, b)"
            )
        parts = [e.arg] if isinstance(e, ast.Unary) else [e.lhs, e.rhs]
        for p in parts:
            used |= _check_expr(p, info, scope, True)
    elif isinstance(e, ast.Unary):
        used |= _check_expr(e.arg, info, scope, False)
    elif isinstance(e, ast.Binary):
        used |= _check_expr(e.lhs, info, scope, False) | _check_expr(e.rhs, info, scope, False)
    elif isinstance(e, ast.Call):
        check_call(e)
        for pos, a in enumerate(e.args):
            used |= _check_expr(a, info, scope, cond=e.fn == "where" and pos == 0)
    return used


def _unwrapped(text: str) -> str:
    """Source text on one line, without the parentheses around the whole of it."""
    text = " ".join(text.split())
    depth = 0
    for k, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0 and k < len(text) - 1:
            return text  # the first parenthesis closes before the end: '(a) < (b)'
    return text[1:-1] if text.startswith("(") and text.endswith(")") else text


def _check_binding(info: RuleInfo, named: set[str], scope: Scope) -> None:
    rule = info.rule
    head_vars = {c.var for c in _vars_of(rule.head)}
    body_vars = {c.var for a in info.atoms for c in _vars_of(a)}
    body_vars |= {n.ident for a in info.atoms for n in _expr_vars(a, scope)}
    body_vars |= {lk.var for lk in rule.lookups}  # a value of the body names it (a scatter)
    annotated = {c.var for c in _vars_of(rule.head) if c.extent is not None}
    for c in _vars_of(rule.head):
        if c.var not in body_vars and c.var not in named and c.var not in annotated:
            raise EdlError(
                f"head index '{c.var}' is not bound in the body",
                c.span,
                help=f"use '{c.var}' in the body, or give its range in the head ({c.var}:N) to broadcast",
            )
    if rule.aggop == "=":
        # An index that an equality guard may define (``where u == t - 1``) is substituted away
        # when it can be (pass 4b); the compiler checks the rest once that is known.
        in_equalities = {
            n.ident
            for g in rule.conditions
            if isinstance(g, ast.Compare) and g.op == "=="
            for n in ast.walk(g)
            if isinstance(n, ast.Name)
        }
        in_equalities |= {lk.var for lk in rule.lookups}  # one value per point: nothing to aggregate
        for v in info.vars:
            if v not in head_vars and v not in in_equalities:
                raise aggregated_by_assignment(info, v)


def aggregated_by_assignment(info: RuleInfo, var: str, in_equality: bool = False) -> EdlError:
    """``var`` is left aggregated in an ``=`` rule; ``in_equality``: although an equality guard
    names it (it did not define it: its coefficient there is not 1 or -1)."""
    fix = f"keep '{var}' in the head, or aggregate it with +=, max=, min= or *="
    if in_equality:
        fix += (
            f"; an equality guard defines an index (and so does not aggregate it) only where the index has "
            f"coefficient 1 or -1, e.g. '{var} == i - 1'"
        )
    return EdlError(f"index '{var}' is aggregated, but '=' does not aggregate", info.first[var], help=fix)


def _dependency_order(by_head: dict[str, list[RuleInfo]]) -> list[str]:
    """Derived relations, each after the relations it reads (depth-first, with an explicit stack so
    that long chains of rules never hit Python's recursion limit)."""
    deps = {rel: [a for info in group for a in info.atoms if a.relation in by_head] for rel, group in by_head.items()}
    order: list[str] = []
    state: dict[str, int] = {}  # 1 = on the path, 2 = done
    for root in by_head:
        if state.get(root) == 2:
            continue
        state[root] = 1
        path: list[tuple[str, int]] = [(root, 0)]  # relation and the next dependency to visit
        while path:
            rel, k = path[-1]
            if k == len(deps[rel]):
                path.pop()
                state[rel] = 2
                order.append(rel)
                continue
            path[-1] = (rel, k + 1)
            atom = deps[rel][k]
            if state.get(atom.relation) == 1:
                names = [r for r, _ in path]
                cycle = [*names[names.index(atom.relation) :], atom.relation]
                raise EdlError(
                    f"dependency cycle: {' -> '.join(cycle)}",
                    atom.span,
                    help="edatalog programs are not recursive: a relation cannot depend on itself; "
                    "use a new name for the updated value",
                )
            if state.get(atom.relation) is None:
                state[atom.relation] = 1
                path.append((atom.relation, 0))
    return order


def _outputs(scope: Scope, by_head: dict[str, list[RuleInfo]]) -> list[str]:
    for name, span in scope.outputs:
        if name not in by_head and name not in scope.decls:
            pool = [*by_head, *scope.decls]
            close = did_you_mean(name, pool)
            raise EdlError(
                f"output '{name}' is never defined",
                span,
                help=close
                or f"add a rule that defines '{name}', or list a relation the program defines"
                + (f" ({', '.join(sorted(by_head))})" if by_head else ""),
            )
    if scope.outputs:
        return [n for n, _ in scope.outputs]
    read = {a.relation for group in by_head.values() for info in group for a in info.atoms}
    return [rel for rel in by_head if rel not in read]


def _no_rules(scope: Scope) -> Diagnostic | None:
    """A program without rules and without outputs computes nothing: one warning says so (rather
    than one per declaration, each "never used").  Without rules but with outputs, the program
    hands its inputs back: an identity, which is not a mistake, so no warning."""
    if scope.rules or scope.outputs:
        return None
    spans = [d.span for d in scope.decls.values()]
    spans += [d.span for d in scope.dims.values() if d.span is not None]
    spans += [c.span for c in scope.consts.values() if c.span is not None]
    return Diagnostic(
        "warning",
        "the program has no rules: it computes nothing and has no outputs",
        min(spans, key=lambda s: s.start) if spans else None,
        help="add rules that define what it computes, e.g. 'y[i] = x[i] * 2.0.' (see docs/language.md)",
    )


def _unused(scope: Scope, infos: list[RuleInfo], outputs: list[str]) -> list[Diagnostic]:
    read = {a.relation for info in infos for a in info.atoms} | set(outputs)
    out = []
    for name, decl in scope.decls.items():
        if name not in read:
            out.append(
                Diagnostic(
                    "warning",
                    f"{decl.kind} '{name}' is never used",
                    decl.span,
                    help="remove it, or read it in a rule",
                )
            )
    if scope.outputs:  # with no `output` statement, the relations nobody reads are the outputs
        heads: dict[str, ast.Rule] = {}
        for info in infos:
            heads.setdefault(info.head.relation, info.rule)
        for name, rule in heads.items():
            if name not in read:
                out.append(
                    Diagnostic(
                        "warning",
                        f"relation '{name}' is computed but never used",
                        rule.head.name_span,
                        help="list it in an output statement, read it in a rule, or remove its rules",
                    )
                )
    return out
