"""The ``.edl`` text an import writes: declarations, rules and their names.

Rules are written from :class:`~edatalog.importer.terms.View` terms: ``materialize`` makes a
relation of a view (one rule), ``aggregate`` one of a sum or maximum over some of its atoms;
both return the new relation read whole, for the ops after.  Index variables are named per
rule, heads annotate their extents (a rule's relations are not declared), and composites
annotate their parts.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from edatalog.importer import terms as T
from edatalog.lang.parser import KEYWORDS

_RESERVED = {*KEYWORDS, "repeat", "as", "from", "pi", "inf", "max", "min", "where"}
_LETTERS = "bsdfhijklmnopqrtuvwxyzaceg"
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2, "^": 4}


@dataclass(frozen=True)
class Declared:
    """An input or param: its declaration's parts."""

    kind: str  # "input" or "param"
    name: str
    shape: tuple[int, ...]
    dtype: str
    source: str | None  # the state_dict name it loads from

    def line(self, name: str | None = None, source: str | None = None) -> str:
        dims = ", ".join(str(s) for s in self.shape)
        where = source or self.source
        return f"{self.kind} {name or self.name}[{dims}] : {self.dtype}" + (f' from "{where}"' if where else "") + "."


@dataclass(frozen=True)
class Written:
    """A rule: the relation it defines, its text, and the layer whose op wrote it (a repeated
    module's path and instance, as ``("model.layers", 3)``)."""

    name: str
    text: str
    layer: tuple[str, int] | None


@dataclass
class Builder:
    """The program being written: declarations and rules in order, the shape and dtype of every
    relation, and (``layer``) the layer the op being imported belongs to."""

    declared: list[Declared] = field(default_factory=list)
    written: list[Written] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    names: set[str] = field(default_factory=set)
    shapes: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    layer: tuple[str, int] | None = None
    module_names: dict[str, str] = field(default_factory=dict)  # a layer stack's path -> its module's name

    def name(self, wanted: str) -> str:
        """A fresh relation name from ``wanted`` (a module path, an op): dots to underscores."""
        base = re.sub(r"[^A-Za-z0-9_]", "_", wanted).strip("_") or "t"
        if base[0].isdigit():  # a numbered child module (nn.Sequential's): 0.weight
            base = f"m{base}"
        if base in _RESERVED or re.fullmatch(r"y\d*", base):  # a keyword (an argument named input), an output's name
            base = f"{base}_"
        name, k = base, 1
        while name in self.names:
            k += 1
            name = f"{base}_{k}"
        self.names.add(name)
        return name

    def declare(self, kind: str, name: str, shape: Sequence[int], dtype: str, source: str | None = None) -> T.View:
        self.declared.append(Declared(kind, name, tuple(shape), dtype, source))
        self.shapes[name] = (tuple(shape), dtype)
        return T.read(name, shape, dtype)

    def _write(self, name: str, text: str, view: T.View) -> None:
        self.written.append(Written(name, text, self.layer))
        self.shapes[name] = (view.shape, view.dtype)

    def materialize(self, view: T.View, wanted: str) -> T.View:
        """``view`` as a relation of its own (one ``=`` rule), read whole."""
        name = self.name(wanted)
        self._write(name, _rule(name, view, "=", view.term, ()), view)
        return T.read(name, view.shape, view.dtype)

    def output(self, view: T.View, name: str) -> None:
        """``view`` written as the output ``name`` (taken: the program's output names are fixed)."""
        self.names.add(name)
        self._write(name, _rule(name, view, "=", view.term, ()), view)
        self.outputs.append(name)

    def lookup(self, table: T.View, ids: T.View, wanted: str) -> T.View:
        """Rows of ``table`` picked by the integers ``ids``: ``name[ids' axes, d] = table[v, d]
        where ids[...] = v`` (a lookup, docs/language.md section 16)."""
        name = self.name(wanted)
        v = T.fresh()
        row = T.substitute(table.term, {a: ((v, table.extent[a]),) for a in table.axes[0]})
        extent = {**ids.extent, **table.extent, v: table.shape[0]}
        head = T.View(row, (*ids.axes, *table.axes[1:]), extent, table.dtype)
        self._write(name, _rule(name, head, "=", row, (), (ids.term, v)), head)
        return T.read(name, head.shape, table.dtype)

    def concat(self, pieces: Sequence[T.View], axis: int, wanted: str) -> T.View:
        """``pieces`` one after another along ``axis``: one rule per piece, each guarded to its
        window of the axis and reading its piece shifted (``y[i] = x[i - 4] where i >= 4, i < 7``)."""
        name = self.name(wanted)
        pieces = [p if _shiftable(p, axis) else self.materialize(p, f"{wanted}_piece") for p in pieces]
        shape = list(pieces[0].shape)
        shape[axis] = sum(p.shape[axis] for p in pieces)
        atoms = [T.fresh() for _ in shape]
        extent = dict(zip(atoms, shape, strict=True))
        offset = 0
        for p in pieces:
            table: dict[int, T.Replacement] = {
                group[0]: ((atoms[k], shape[k]),) for k, group in enumerate(p.axes) if k != axis
            }
            term = T.shift(T.substitute(p.term, table), p.axes[axis][0], atoms[axis], -offset)
            head = T.View(term, tuple((a,) for a in atoms), {**p.extent, **extent}, p.dtype)
            window = [
                T.Cmp(">=", T.Index(atoms[axis]), T.Num(offset)),
                T.Cmp("<", T.Index(atoms[axis]), T.Num(offset + p.shape[axis])),
            ]
            self._write(name, _rule(name, head, "=", term, (), guards=window), head)
            offset += p.shape[axis]
        return T.read(name, shape, pieces[0].dtype)

    def window_max(self, head: T.View, reduced: Sequence[int], guards: Sequence[T.Cmp], wanted: str) -> T.View:
        """``head.term``'s maximum over the atoms ``reduced`` at the points ``guards`` admit (a
        pooling window, as a band)."""
        name = self.name(wanted)
        self._write(name, _rule(name, head, "max=", head.term, reduced, guards=guards), head)
        return T.read(name, head.shape, head.dtype)

    def aggregate(self, view: T.View, over: Iterable[int], op: str, wanted: str, keep: bool = False) -> T.View:
        """``view``'s term summed (``+=``) or maximized (``max=``) over the axes ``over``: the
        other axes are the head (with ``keep``, the reduced ones stay as axes of 1)."""
        over = set(over)
        name = self.name(wanted)
        kept = tuple(axis for k, axis in enumerate(view.axes) if k not in over)
        reduced = [a for k in sorted(over) for a in view.axes[k]]
        head = T.View(view.term, kept, view.extent, view.dtype)
        self._write(name, _rule(name, head, op, view.term, reduced), head)
        out = T.read(name, head.shape, view.dtype)
        for k in sorted(over) if keep else ():
            out = T.unsqueeze(out, k)
        return out

    def contract(self, head: T.View, reduced: Sequence[int], wanted: str, guards: Sequence[T.Cmp] = ()) -> T.View:
        """``head.term`` summed over the atoms ``reduced`` (shared by the factors it multiplies),
        at the points ``guards`` admit."""
        name = self.name(wanted)
        self._write(name, _rule(name, head, "+=", head.term, reduced, guards=guards), head)
        return T.read(name, head.shape, head.dtype)

    def text(self, title: str) -> str:
        """The program, every rule written out (see :mod:`edatalog.importer.layers` for the
        form with repeated layers as a module)."""
        heads = [d.line() for d in self.declared if d.kind == "input"] + [
            d.line() for d in self.declared if d.kind == "param"
        ]
        parts = [f"# {title}", "", *heads, f"output {', '.join(self.outputs)}.", ""]
        return "\n".join([*parts, *(w.text for w in self.written), ""])


def _rule(
    name: str,
    head: T.View,
    op: str,
    body: T.Term,
    reduced: Sequence[int],
    lookup: tuple[T.Term, int] | None = None,
    guards: Sequence[T.Cmp] = (),
) -> str:
    """One rule's text; ``lookup`` (a term of integers, an atom): the atom takes the term's
    values (``where ids[b, s] = v``); ``guards``: comparisons of indices that restrict its points."""
    names = _Names()
    atoms = [a for axis in head.axes for a in axis] + list(reduced)
    for a in atoms:
        names.get(a)
    for a in sorted(T.atoms_of(body) - set(atoms)):
        names.get(a)
    positions = []
    for axis in head.axes:
        real = [a for a in axis if head.extent[a] != 1] or list(axis[:1])
        if len(real) == 1:
            positions.append(f"{names.get(real[0])}:{head.extent[real[0]]}")
        else:
            positions.append("(" + ", ".join(f"{names.get(a)}:{head.extent[a]}" for a in real) + ")")
    extent = head.extent
    conditions = [f"{_term(lookup[0], names, extent)} = {names.get(lookup[1])}"] if lookup else []
    conditions += [f"{_affine(c.left, names)} {c.op} {_affine(c.right, names)}" for c in guards]
    guard = f" where {', '.join(conditions)}" if conditions else ""
    return f"{name}[{', '.join(positions)}] {op} {_term(body, names, extent)}{guard}."


def _shiftable(view: T.View, axis: int) -> bool:
    """Whether a concat can take ``view`` as it is: one atom per axis, and the atom of ``axis``
    never a part of a composite (it is read shifted)."""
    return all(len(group) == 1 for group in view.axes) and not T.in_composite(view.term, view.axes[axis][0])


class _Names:
    """Index variable names of one rule, by atom."""

    def __init__(self) -> None:
        self.by_atom: dict[int, str] = {}

    def get(self, atom: int) -> str:
        if atom not in self.by_atom:
            k = len(self.by_atom)
            letter = _LETTERS[k % len(_LETTERS)]
            self.by_atom[atom] = letter if k < len(_LETTERS) else f"{letter}{k // len(_LETTERS)}"
        return self.by_atom[atom]


def _term(term: T.Term, names: _Names, extent: dict[int, int] | object, parent: int = 0) -> str:
    if isinstance(term, T.Read):
        return f"{term.relation}[{', '.join(_position(axis, names, extent) for axis in term.axes)}]"
    if isinstance(term, T.Num):
        return _number(term.value)
    if isinstance(term, T.Index):
        return names.get(term.id)
    if isinstance(term, T.Unary):
        if term.op == "-":
            text = f"-{_term(term.arg, names, extent, 3)}"
            return f"({text})" if parent >= 3 else text
        return f"{term.op}({_term(term.arg, names, extent)})"
    if isinstance(term, T.Binary):
        if term.op in ("max", "min"):
            return f"{term.op}({_term(term.left, names, extent)}, {_term(term.right, names, extent)})"
        level = _PRECEDENCE[term.op]
        right_level = level + 1 if term.op != "^" else level
        left_level = level if term.op != "^" else level + 1
        text = (
            f"{_term(term.left, names, extent, left_level)} {term.op} {_term(term.right, names, extent, right_level)}"
        )
        return f"({text})" if parent > level else text
    if isinstance(term, T.Where):
        cond = f"{_term(term.cond.left, names, extent)} {term.cond.op} {_term(term.cond.right, names, extent)}"
        return f"where({cond}, {_term(term.then, names, extent)}, {_term(term.other, names, extent)})"
    raise AssertionError(term)


def _affine(term: T.Term, names: _Names) -> str:
    """An affine term of indices and whole numbers, as a guard writes it (integers, no floats)."""
    if isinstance(term, T.Index):
        return names.get(term.id)
    if isinstance(term, T.Num):
        assert float(term.value).is_integer(), term
        return str(int(term.value))
    assert isinstance(term, T.Binary) and term.op in "+-*", term
    return f"{_affine(term.left, names)} {term.op} {_affine(term.right, names)}"


def _position(axis: tuple[T.Part, ...], names: _Names, extent: object) -> str:
    parts = [p for p in axis if not (isinstance(p, T.Fixed) and p.extent == 1)] or list(axis[:1])
    if len(parts) == 1:
        return _part(parts[0], names)
    shown = []
    for p in parts:
        if isinstance(p, T.Window):
            raise T.Unfoldable("a window in a composite")
        if isinstance(p, T.Fixed):
            shown.append(f"{p.place}:{p.extent}")
        else:
            if p.sliced:
                raise T.Unfoldable("a sliced part of a composite")
            assert isinstance(extent, dict)
            shown.append(f"{names.get(p.id)}:{extent[p.id]}")
    return "(" + ", ".join(shown) + ")"


def _part(p: T.Part, names: _Names) -> str:
    if isinstance(p, T.Fixed):
        return str(p.place)
    if isinstance(p, T.Window):
        text = " + ".join(names.get(a) if c == 1 else f"{c} * {names.get(a)}" for a, c in p.terms)
        return text + (f" + {p.const}" if p.const > 0 else f" - {-p.const}" if p.const < 0 else "")
    name = names.get(p.id)
    # A slice reads a prefix or a window: an index expression (a plain index would have to
    # span the whole axis).
    return name if not p.sliced else f"{name} {'+' if p.offset >= 0 else '-'} {abs(p.offset)}"


def _number(value: float) -> str:
    if value == float("inf"):
        return "inf"
    if value == float("-inf"):
        return "-inf"
    text = repr(float(value))
    return text if "e" in text or "." in text else f"{text}.0"
