"""Pass 3: extents.  Infers the extent of every index variable and every relation axis.

Extents flow through equalities (an index used at an axis has that axis's extent) and through
composites (an axis used as ``(h, e)`` spans ``|h| * |e|``), across all rules at once, until
nothing changes.  When a composite still has several unknown parts and its axis was declared as a
product with as many factors (``wq[H * E, D]`` read as ``wq[(h, e), d]``), the parts take the
factors in order.  Every extent remembers where it came from, so a conflict names both sides.
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from dataclasses import dataclass

from edatalog.errors import EdlError, Note, Span
from edatalog.lang import ast
from edatalog.rules.check import Checked
from edatalog.rules.indexexpr import INDEX, affine_of, index_names
from edatalog.rules.scope import MAX_EXTENT, Scope, dim_symbol, eval_dim
from edatalog.rules.symbols import Symbols

Key = Hashable  # ("var", rule, name) | ("axis", relation, k) | ("lit", rule, atom, pos, comp)


@dataclass(frozen=True)
class Origin:
    what: str  # human description: "axis 0 of x, declared S"
    span: Span | None


@dataclass
class _Class:
    value: int | None = None
    symbol: str | None = None
    origin: Origin | None = None
    factors: tuple[tuple[int, str], ...] | None = None  # declared product, e.g. ((32,"H"),(128,"E"))


@dataclass(frozen=True)
class _Product:
    axis: Key
    parts: tuple[Key, ...]
    span: Span  # the composite position
    atom: ast.Atom
    axis_no: int


@dataclass
class Extents:
    var: dict[tuple[int, str], tuple[int, str]]  # (rule, var) -> (extent, symbol)
    axis: dict[tuple[str, int], tuple[int, str]]  # (relation, axis) -> (extent, symbol)
    part: dict[tuple[int, int, int, int], int]  # (rule, atom, pos, comp) -> extent of that component


class _Solver:
    def __init__(self, symbols: Symbols) -> None:
        self.symbols = symbols
        self.parent: dict[Key, Key] = {}
        self.cls: dict[Key, _Class] = {}
        self.products: list[_Product] = []

    def find(self, k: Key) -> Key:
        self.parent.setdefault(k, k)
        self.cls.setdefault(k, _Class())
        root = k
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[k] != root:
            self.parent[k], k = root, self.parent[k]
        return root

    def get(self, k: Key) -> _Class:
        return self.cls[self.find(k)]

    def assign(self, k: Key, value: int, symbol: str, origin: Origin, what: str, at: Span | None = None) -> bool:
        c = self.get(k)
        if c.value is None:
            c.value, c.symbol, c.origin = value, symbol, origin
            return True
        if c.value != value:
            raise _mismatch(what, c, value, symbol, origin, at)
        return False

    def union(self, a: Key, b: Key, what: str, at: Span | None = None, help: str | None = None) -> None:
        """Join the classes of ``a`` and ``b``; a conflict is reported at ``at``, with the extent
        of ``a`` named first."""
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        ca, cb = self.cls[ra], self.cls[rb]
        if ca.value is not None and cb.value is not None and ca.value != cb.value:
            assert cb.symbol is not None and cb.origin is not None
            raise _mismatch(what, ca, cb.value, cb.symbol, cb.origin, at, help)
        self.parent[rb] = ra
        if ca.value is None:
            ca.value, ca.symbol, ca.origin = cb.value, cb.symbol, cb.origin
        ca.factors = ca.factors or cb.factors


def _mismatch(
    what: str, c: _Class, value: int, symbol: str, origin: Origin, at: Span | None, help: str | None = None
) -> EdlError:
    """``c`` holds the extent known so far; ``value`` is the conflicting one, met at ``at``."""
    assert c.origin is not None
    first = f"{c.symbol} = {c.value}" if c.symbol != str(c.value) else str(c.value)
    second = f"{symbol} = {value}" if symbol != str(value) else str(value)
    span = at or origin.span or c.origin.span
    notes = [
        Note(f"extent {first} comes from {c.origin.what}", c.origin.span),
        Note(f"extent {second} comes from {origin.what}", origin.span),
    ]
    # A longer first axis read at a shorter index: maybe a table of positions (rows) read for a
    # sequence shorter than it, which an index expression reads (a longer inner axis is far more
    # likely a mix-up of indices, and gets no such note).
    prefix = _PREFIX.fullmatch(what)
    if prefix is not None and prefix.group(2) == "0" and c.value is not None and value > c.value:
        index, axis, rel = prefix.groups()
        notes.append(
            Note(
                f"to read only the first {c.value} of the {value} places of {rel}'s axis {axis} (a position "
                f"table longer than the sequence), write the index as an expression there, which reads "
                f"wherever it lands: {index} + 0",
                span,
            )
        )
    return EdlError(
        f"extent mismatch for {what}: {first} from {c.origin.what}, but {second} from {origin.what}",
        span,
        help=help or "an index has one extent in a rule: use it only at axes of the same size, or use another index",
        notes=notes,
    )


_PREFIX = re.compile(r"index '(\w+)' at axis (\d+) of (\w+)")


def _factors(expr: ast.Expr) -> list[ast.Expr]:
    if isinstance(expr, ast.Binary) and expr.op == "*":
        return _factors(expr.lhs) + _factors(expr.rhs)
    return [expr]


def infer_extents(checked: Checked) -> Extents:
    scope = checked.scope
    s = _Solver(Symbols({d.name: dim_symbol(d.expr) if d.expr is not None else None for d in scope.dims.values()}))
    # Declared shapes.
    for name, decl in scope.decls.items():
        for k, (value, expr) in enumerate(zip(decl.shape, decl.decl.shape, strict=True)):
            axis_key = ("axis", name, k)
            origin = Origin(f"axis {k} of {name}", expr.span)
            s.assign(axis_key, value, decl.symbols[k], origin, f"axis {k} of {name}")
            fs = _factors(expr)
            if len(fs) > 1:
                s.get(axis_key).factors = tuple((eval_dim(f, scope, f"the shape of {name}"), dim_symbol(f)) for f in fs)
    # Uses of indices at axes, annotations and composites.  The head comes after the body, so
    # that a conflict with the head's axis (set by another rule) is reported at the head.
    for info in checked.rules:
        atoms = list(enumerate((info.head, *info.atoms)))
        for a_no, atom in atoms[1:] + atoms[:1]:
            for k, pos in enumerate(atom.positions):
                axis = ("axis", atom.relation, k)
                s.find(axis)
                keys = []
                for c_no, comp in enumerate(pos.components):
                    key: Key = (
                        ("var", info.index, comp.var) if comp.var is not None else ("lit", info.index, a_no, k, c_no)
                    )
                    keys.append(key)
                    s.find(key)
                    if comp.extent is not None:
                        value = eval_dim(comp.extent, scope, f"the extent of {comp}")
                        sym = s.symbols.simplify(dim_symbol(comp.extent))
                        origin = Origin(f"the annotation {comp}", comp.extent.span)
                        s.assign(key, value, sym, origin, _name(comp), at=comp.span)
                if len(pos.components) == 1:
                    what = f"{_name(pos.components[0])} at axis {k} of {atom.relation}"
                    head = (
                        f"every rule for '{atom.relation}' must give its axis {k} the same extent"
                        if a_no == 0
                        else None
                    )
                    s.union(keys[0], axis, what, at=pos.span, help=head)
                else:
                    s.products.append(_Product(axis, tuple(keys), pos.span, atom, k))
        for lk in info.rule.lookups:  # ``pos[] = p:T``
            if lk.extent is not None:
                value = eval_dim(lk.extent, scope, f"the range of '{lk.var}'")
                origin = Origin(f"the range {lk.var}:{lk.extent.span.text}", lk.extent.span)
                sym = s.symbols.simplify(dim_symbol(lk.extent))
                s.assign(("var", info.index, lk.var), value, sym, origin, f"index '{lk.var}'", at=lk.span)
    while True:
        _propagate(s)
        if not _split_declared(s) and not _default_head_literals(s, checked):
            break
    return _collect(checked, s)


def _name(comp: ast.Component) -> str:
    if comp.var is not None:
        return f"index '{comp.var}'"
    if comp.expr is not None:
        return f"the index expression '{comp.expr.span.text}'"
    return f"the literal part {comp.literal}"


def _fixed_place(comp: ast.Component, scope: Scope) -> int | None:
    """The place a literal or an index expression without variables (``S - 1``) fixes."""
    if comp.literal is not None:
        return comp.literal
    if comp.expr is not None and not index_names(comp.expr, scope):
        return affine_of(comp.expr, (), scope, INDEX).const
    return None


def _propagate(s: _Solver) -> None:
    changed = True
    while changed:
        changed = False
        for p in s.products:
            axis = s.get(p.axis)
            parts = [s.get(k) for k in p.parts]
            unknown = [i for i, c in enumerate(parts) if c.value is None]
            known = 1
            for c in parts:
                if c.value is not None:
                    known *= c.value
            where = Origin(f"the composite {_pos_text(p)} of {p.atom.relation}", p.span)
            if not unknown:
                syms = [c.symbol or str(c.value) for c in parts]
                sym = s.symbols.product(syms) or "*".join(_wrap(x) for x in syms)
                if axis.value is None:
                    changed |= s.assign(p.axis, known, sym, where, f"axis {p.axis_no} of {p.atom.relation}")
                elif axis.value != known:
                    raise _composite_error(p, axis, parts)
            elif len(unknown) == 1 and axis.value is not None:
                if axis.value % known:
                    raise _composite_error(p, axis, parts)
                value = axis.value // known
                syms = [c.symbol or str(c.value) for c in parts if c.value is not None]
                sym = s.symbols.quotient(axis.symbol or str(axis.value), syms) or str(value)
                changed |= s.assign(p.parts[unknown[0]], value, sym, where, _key_text(p.parts[unknown[0]]))


def _wrap(sym: str | None) -> str:
    sym = sym or "?"
    return f"({sym})" if any(ch in sym for ch in "+-/") else sym


def _pos_text(p: _Product) -> str:
    return p.span.text


def _composite_error(p: _Product, axis: _Class, parts: list[_Class]) -> EdlError:
    sizes = " * ".join(str(c.value) if c.value is not None else "?" for c in parts)
    known = 1
    for c in parts:
        known *= c.value or 1
    axis_name = f"axis {p.axis_no} of {p.atom.relation}"
    axis_ext = f"{axis.symbol} = {axis.value}" if axis.symbol not in (None, str(axis.value)) else str(axis.value)
    notes = []
    if axis.origin is not None:
        declared = axis.origin.what == axis_name
        text = (
            f"{axis_name} is declared {axis_ext}" if declared else f"{axis_name} is {axis_ext} from {axis.origin.what}"
        )
        notes.append(Note(text, axis.origin.span))
    for comp_c, comp in zip(parts, p.parts, strict=True):
        if comp_c.origin is not None and comp_c.origin.span is not None and comp_c.origin.span != p.span:
            notes.append(
                Note(f"{_key_text(comp)} has extent {comp_c.value} from {comp_c.origin.what}", comp_c.origin.span)
            )
    if all(c.value is not None for c in parts):
        message = f"{_pos_text(p)} spans {sizes} = {known}, but {axis_name} has extent {axis_ext}"
    else:
        message = f"the known parts of {_pos_text(p)} span {sizes}, and {known} does not divide {axis_ext}"
    return EdlError(
        f"composite size mismatch: {message}",
        p.span,
        help="the extents of the parts of a composite multiply to the extent of its axis, first part major",
        notes=notes,
    )


def _key_text(k: Key) -> str:
    assert isinstance(k, tuple)
    return f"index '{k[2]}'" if k[0] == "var" else "a literal part"


def _split_declared(s: _Solver) -> bool:
    """Give unknown composite parts the factors of a declared product axis, in order."""
    changed = False
    for p in s.products:
        axis = s.get(p.axis)
        parts = [s.get(k) for k in p.parts]
        if axis.factors is None or len(axis.factors) != len(parts) or sum(c.value is None for c in parts) < 2:
            continue
        if any(c.value is not None and c.value != f[0] for c, f in zip(parts, axis.factors, strict=True)):
            continue
        literals = [c.literal for c in p.atom.positions[p.axis_no].components]
        if any(lit is not None and lit >= f[0] for lit, f in zip(literals, axis.factors, strict=True)):
            continue  # the split cannot be meant: a literal part would fall outside its factor
        for key, c, (value, sym) in zip(p.parts, parts, axis.factors, strict=True):
            if c.value is None:
                origin = Origin(
                    f"the declared shape {'*'.join(f for _, f in axis.factors)} of {p.atom.relation}",
                    axis.origin.span if axis.origin else None,
                )
                s.assign(key, value, sym, origin, _key_text(key))
                changed = True
    return changed


def _default_head_literals(s: _Solver, checked: Checked) -> bool:
    """Last resort for literal parts in heads (``r[(0, i)] = ...  r[(1, i)] = ...``): the smallest
    extent that holds every literal written at that place by the relation's rules."""
    groups: dict[tuple[str, int, int, int], list[tuple[Key, int, ast.Component]]] = {}
    for info in checked.rules:
        for k, pos in enumerate(info.head.positions):
            for c_no, comp in enumerate(pos.components):
                if comp.literal is not None:
                    place = (info.head.relation, k, len(pos.components), c_no)
                    groups.setdefault(place, []).append((("lit", info.index, 0, k, c_no), comp.literal, comp))
    changed = False
    for members in groups.values():
        if any(s.get(key).value is None for key, _, _ in members):
            size = max(lit for _, lit, _ in members) + 1
            for key, _, comp in members:
                if s.get(key).value is None:
                    origin = Origin(
                        f"the literals written at {comp.span.text} (smallest extent holding them)", comp.span
                    )
                    s.assign(key, size, str(size), origin, _key_text(key))
                    changed = True
    return changed


def _collect(checked: Checked, s: _Solver) -> Extents:
    scope = checked.scope
    ext = Extents({}, {}, {})
    for info in checked.rules:
        for v in info.vars:
            c = s.get(("var", info.index, v))
            if c.value is None:
                var_key = ("var", info.index, v)
                in_composite = [p for p in s.products if var_key in p.parts]
                notes = [
                    Note(
                        f"'{v}' is a part of {_pos_text(p)}, which splits axis {p.axis_no} of {p.atom.relation}; "
                        "the extents of all parts but one must be known",
                        p.span,
                    )
                    for p in in_composite[:1]
                ]
                in_exprs = [
                    c.expr
                    for atom in info.atoms
                    for pos in atom.positions
                    for c in pos.components
                    if c.expr is not None and any(n.ident == v for n in index_names(c.expr, scope))
                ]
                notes += [
                    Note(
                        f"'{v}' is used in the index expression '{e.span.text}', which does not fix its range: "
                        "the expression's values only have to fall inside the axis",
                        e.span,
                    )
                    for e in in_exprs[:1]
                ]
                raise EdlError(
                    f"cannot infer the extent of index '{v}'",
                    info.first[v],
                    help=f"give it where it first appears, e.g. {v}:N with N a dim; "
                    "extents come from the declared shapes of the relations an index is used with",
                    notes=notes,
                )
            ext.var[(info.index, v)] = (c.value, c.symbol or str(c.value))
        for a_no, atom in enumerate((info.head, *info.atoms)):
            for k, pos in enumerate(atom.positions):
                axis = s.get(("axis", atom.relation, k))
                if axis.value is None:
                    raise EdlError(
                        f"cannot infer the extent of axis {k} of '{atom.relation}'",
                        pos.span,
                        help="give the extent with an annotation such as 0:N",
                    )
                if axis.value > MAX_EXTENT:
                    raise EdlError(
                        f"axis {k} of '{atom.relation}' is too large: it has extent {axis.value}",
                        pos.span,
                        help=f"extents must fit a 64-bit index (at most 2^63 - 1 = {MAX_EXTENT})",
                    )
                ext.axis[(atom.relation, k)] = (axis.value, axis.symbol or str(axis.value))
                for c_no, comp in enumerate(pos.components):
                    key = ("var", info.index, comp.var) if comp.var is not None else ("lit", info.index, a_no, k, c_no)
                    c = s.get(key)
                    if c.value is None:
                        raise EdlError(
                            f"cannot infer the extent of {_name(comp)} of {pos.span.text}",
                            comp.span,
                            help=f"annotate it, e.g. {comp}:N with N a dim",
                        )
                    place = _fixed_place(comp, scope)
                    if place is not None and not 0 <= place < c.value:
                        shown = str(place) if comp.literal is not None else f"{comp} = {place}"
                        raise EdlError(
                            f"index {shown} is out of range: "
                            + (f"axis {k} of '{atom.relation}'" if len(pos.components) == 1 else "this composite part")
                            + f" has extent {c.value}",
                            comp.span,
                        )
                    ext.part[(info.index, a_no, k, c_no)] = c.value
    return ext
