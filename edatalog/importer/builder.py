"""The ``.edl`` text an import writes: declarations, rules and their names.

Rules are written from :class:`~edatalog.importer.terms.View` terms: ``materialize`` makes a
relation of a view (one rule), ``aggregate`` one of a sum or maximum over some of its atoms;
both return the new relation read whole, for the ops after.  Index variables are named per
rule, heads annotate their extents (a rule's relations are not declared), and composites
annotate their parts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from edatalog.importer import terms as T
from edatalog.lang.parser import KEYWORDS

_RESERVED = {*KEYWORDS, "repeat", "as", "from", "pi", "inf", "max", "min", "where"}
_LETTERS = "bsdfhijklmnopqrtuvwxyzaceg"
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2, "^": 4}
_NAMES = re.compile(r"([A-Za-z_]\w*)\[")  # the relations a rule's text names, its head's first


@dataclass(frozen=True)
class Declared:
    """An input or param: its declaration's parts."""

    kind: str  # "input" or "param"
    name: str
    shape: tuple[int, ...]
    dtype: str
    source: str | None  # the state_dict name it loads from
    aliases: tuple[str, ...] = ()  # the same tensor's other names (a head tied to the embedding)

    def line(self, name: str | None = None, rename: Callable[[str], str] = str) -> str:
        """The declaration, ``rename`` applied to each checkpoint name (a layer's to the
        module's ``{i}`` form)."""
        dims = ", ".join(str(s) for s in self.shape)
        names = [rename(n) for n in (self.source, *self.aliases) if n]
        where = " from " + ", ".join(f'"{n}"' for n in names) if names else ""
        return f"{self.kind} {name or self.name}[{dims}] : {self.dtype}{where}."


@dataclass(frozen=True)
class Written:
    """A rule: the relation it defines, its text, and the layer whose op wrote it (a repeated
    module's path and instance, as ``("model.layers", 3)``)."""

    name: str
    text: str
    layer: tuple[str, int] | None

    def reads(self) -> list[str]:
        """The relations the rule reads (its head's name left out)."""
        return _NAMES.findall(self.text)[1:]


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
    # How readers split each axis of each relation (composites: the finest split of all of them,
    # None where two cross), and what an earlier pass saw of it: the axes to write apart.
    seen: dict[tuple[str, int], list[int] | None] = field(default_factory=dict)
    splits: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    # A relation of one rule: its head, and the rule's text for another name and head (an output
    # that is the relation reshaped takes its rule rather than a copy of it).
    rules: dict[str, tuple[T.View, Callable[[str, T.View], str]]] = field(default_factory=dict)
    # Index names by extent, from the model's config (capture.index_hints): s and t for the
    # sequence, d for the hidden size, h for heads...; rules name other atoms by letter.
    hints: Mapping[int, Sequence[str]] = field(default_factory=dict)
    # Names for views not yet written, by id: what a module returns is named after the module
    # wherever an op after it writes it out (a contraction's operand).
    preferred: dict[int, tuple[T.View, str]] = field(default_factory=dict)

    def prefer(self, view: T.View, name: str) -> None:
        self.preferred[id(view)] = (view, name)  # the view kept, so that its id is not reused

    def preferred_name(self, view: T.View) -> str | None:
        entry = self.preferred.get(id(view))
        return entry[1] if entry is not None and entry[0] is view else None

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

    def declare(
        self,
        kind: str,
        name: str,
        shape: Sequence[int],
        dtype: str,
        source: str | None = None,
        aliases: Sequence[str] = (),
    ) -> T.View:
        self.declared.append(Declared(kind, name, tuple(shape), dtype, source, tuple(aliases)))
        self.shapes[name] = (tuple(shape), dtype)
        return T.read(name, shape, dtype)

    def _write(
        self, name: str, text: str, view: T.View, body: T.Term, render: Callable[[str, T.View], str] | None = None
    ) -> None:
        self.written.append(Written(name, text, self.layer))
        if render is not None:
            self.rules[name] = (view, render)
        self.shapes[name] = (view.shape, view.dtype)
        for relation, axis, factors in _composites(body, view.extent):
            key = (relation, axis)
            if key not in self.seen:
                self.seen[key] = factors
            elif self.seen[key] is not None:
                self.seen[key] = T.refine(self.seen[key] or [], factors)

    def materialize(self, view: T.View, wanted: str, apart: bool = True) -> T.View:
        """``view`` as a relation of its own (one ``=`` rule), read whole.  With ``apart``, its
        axes' parts are the relation's axes (see ``_apart``); without, the relation has the
        view's axes and is read with one atom for each."""
        name = self.name(self.preferred_name(view) or wanted)
        head = self._apart(name, view) if apart else view
        render = _renderer("=", (), hints=self.hints)
        self._write(name, render(name, head), head, head.term, render)
        return self._read(name, view, head) if apart else T.read(name, view.shape, view.dtype)

    def _apart(self, name: str, head: T.View) -> T.View:
        """``head`` with each of its atoms an axis of the relation, and each axis that readers
        split into parts (an earlier pass of the import saw them: ``splits``, by the relation's
        axis) split so: ``q[b, s, h, e]`` rather than ``q[(b, s), (h, e)]``, as a person would
        write it, and as plans split it."""
        flat = T.View(head.term, tuple((a,) for axis in head.axes for a in axis), head.extent, head.dtype)
        for k in reversed(range(len(flat.axes))):
            sizes = self.splits.get((name, k))
            if sizes and len(sizes) > 1:
                try:
                    flat = T.split_axis(flat, k, sizes)
                except T.Unfoldable:
                    continue
        return T.View(flat.term, tuple((a,) for axis in flat.axes for a in axis), flat.extent, flat.dtype)

    def _read(self, name: str, view: T.View, head: T.View) -> T.View:
        """The relation ``name`` (written from ``head``, maybe with axes apart) read as ``view``'s
        axes: each of them the relation's axes it was split into."""
        whole = T.read(name, head.shape, view.dtype)
        if len(head.axes) == len(view.axes):
            return whole
        groups, k = [], 0
        for size in view.shape:
            group: list[int] = list(whole.axes[k])
            k += 1
            while k < len(whole.axes) and math.prod(whole.extent[a] for a in group) < size:
                group.extend(whole.axes[k])
                k += 1
            groups.append(tuple(group))
        return T.View(whole.term, tuple(groups), whole.extent, view.dtype)

    def output(self, view: T.View, name: str) -> None:
        """``view`` written as the output ``name`` (taken: the program's output names are fixed).
        Where ``view`` reads, reshaped, a relation of one rule that nothing else reads (the
        logits' matmul), that rule writes the output itself."""
        self.names.add(name)
        self.outputs.append(name)
        taken = self._taken_over(view, name)
        if not taken:
            self._write(name, _rule(name, view, "=", view.term, (), hints=self.hints), view, view.term)

    def _taken_over(self, view: T.View, name: str) -> bool:
        """Whether the rule of the relation ``view`` reads now writes ``name`` (see ``output``)."""
        term = view.term
        if not isinstance(term, T.Read) or term.relation not in self.rules:
            return False
        head, render = self.rules[term.relation]
        spots = [k for k, w in enumerate(self.written) if w.name == term.relation]
        if len(spots) != 1 or self.written[spots[0]].layer != self.layer or term.relation in self.outputs:
            return False
        if any(term.relation in w.reads() for w in self.written):
            return False
        renames: dict[int, int] = {}
        for parts, atoms in zip(term.axes, head.axes, strict=True):
            (mine,) = atoms
            if len(parts) != 1:
                return False
            (part,) = parts
            if isinstance(part, T.Atom) and not part.sliced and part.offset == 0 and part.id not in renames:
                renames[part.id] = mine
            elif not (head.extent[mine] == 1 and part == T.Fixed(0)):
                return False
        extent = dict(head.extent)
        axes = []
        for axis in view.axes:
            if any(a not in renames and view.extent[a] != 1 for a in axis):
                return False
            axes.append(tuple(renames.get(a, a) for a in axis))
            extent.update({a: view.extent[a] for a in axis if a not in renames})
        if sorted(a for axis in view.axes for a in axis if a in renames) != sorted(renames):
            return False  # each atom once, or it is no reshape (a diagonal reads one twice)
        new = T.View(head.term, tuple(axes), extent, head.dtype)
        self.written[spots[0]] = Written(name, render(name, new), self.layer)
        self.shapes[name] = (view.shape, view.dtype)
        return True

    def lookup(self, table: T.View, ids: T.View, wanted: str) -> T.View:
        """Rows of ``table`` picked by the integers ``ids``: ``name[ids' axes, d] = table[v, d]
        where ids[...] = v`` (a lookup, docs/language.md section 16)."""
        name = self.name(wanted)
        v = T.fresh()
        row = T.substitute(table.term, {a: ((v, table.extent[a]),) for a in table.axes[0]})
        extent = {**ids.extent, **table.extent, v: table.shape[0]}
        head = T.View(row, (*ids.axes, *table.axes[1:]), extent, table.dtype)
        self._write(name, _rule(name, head, "=", row, (), (ids.term, v), hints=self.hints), head, row)
        return T.read(name, head.shape, table.dtype)

    def concat(self, pieces: Sequence[T.View], axis: int, wanted: str) -> T.View:
        """``pieces`` one after another along ``axis``.  Two pieces of one size: a view that
        picks one by the place (``where(p == 0, a, b)``, read in place by the ops after it);
        more of one size: one rule each, its place a literal part of the axis
        (``y[(1, i)] = x[i]``); else one rule each guarded to its window and reading its piece
        shifted (``y[i] = x[i - 4] where i >= 4, i < 7``)."""
        equal = len({p.shape[axis] for p in pieces}) == 1
        if not equal and any(len([a for a in p.axes[axis] if p.extent[a] != 1]) > 1 for p in pieces):
            pieces = [p if _shiftable(p, axis) else self.materialize(p, f"{wanted}_piece", apart=False) for p in pieces]
        if not equal and not all(_shiftable(p, axis) for p in pieces):
            raise T.Unfoldable("a concatenation of pieces of different sizes along a split axis")
        tables: list[dict[int, T.Replacement]] = [{} for _ in pieces]
        extent: dict[int, int] = {}
        head: list[tuple[int, ...]] = []
        for k, size in enumerate(pieces[0].shape):
            if k == axis and not equal:
                head.append((T.fresh(),))
                continue
            groups = [(j, [a for a in p.axes[k] if p.extent[a] != 1]) for j, p in enumerate(pieces)]
            for j, p in enumerate(pieces):
                tables[j].update({a: T.Fixed(0) for a in p.axes[k] if p.extent[a] == 1})
            if size == 1:
                one = T.fresh()
                extent[one] = 1
                head.append((one,))
                continue
            head.append(T.share(pieces, groups, tables, extent))
        literal = T.fresh()  # the piece's place along the axis, when the pieces are of one size
        if equal:
            extent[literal] = len(pieces)
            head[axis] = (literal, *head[axis])
        if equal and len(pieces) == 2:
            # Two halves (rotary's rotate_half): a view that picks one by the place, read in
            # place by the ops after it rather than written out as two copies.
            first, second = (T.substitute(p.term, t) for p, t in zip(pieces, tables, strict=True))
            merged = {a: n for p in pieces for a, n in p.extent.items()} | extent
            pick = T.Cmp("==", T.Index(literal), T.Num(0.0))
            term = first if first == second else T.Where(pick, first, second)  # cat((x, x)): a broadcast
            return T.View(term, tuple(head), merged, pieces[0].dtype)
        name = self.name(wanted)
        offset = 0
        for j, p in enumerate(pieces):
            term = T.substitute(p.term, tables[j])
            guards: list[T.Cmp] = []
            if not equal:
                (at,) = head[axis]
                extent[at] = sum(q.shape[axis] for q in pieces)
                (mine,) = [a for a in p.axes[axis] if p.extent[a] != 1]
                term = T.shift(term, mine, at, -offset)
                guards = [
                    T.Cmp(">=", T.Index(at), T.Num(offset)),
                    T.Cmp("<", T.Index(at), T.Num(offset + p.shape[axis])),
                ]
            view = T.View(term, tuple(head), {**p.extent, **extent}, p.dtype)
            flat = T.View(term, tuple((a,) for axis_atoms in head for a in axis_atoms), view.extent, p.dtype)
            literals = {literal: j} if equal else None
            text = _rule(name, flat, "=", term, (), guards=guards, literals=literals, hints=self.hints)
            self._write(name, text, flat, term)
            offset += p.shape[axis]
        whole = T.View(T.Num(0.0), tuple(head), extent, pieces[0].dtype)  # the axes as ops read them
        return self._read(name, whole, flat)

    def window_max(self, head: T.View, reduced: Sequence[int], guards: Sequence[T.Cmp], wanted: str) -> T.View:
        """``head.term``'s maximum over the atoms ``reduced`` at the points ``guards`` admit (a
        pooling window, as a band)."""
        name = self.name(wanted)
        render = _renderer("max=", reduced, guards, self.hints)
        self._write(name, render(name, head), head, head.term, render)
        return T.read(name, head.shape, head.dtype)

    def aggregate(self, view: T.View, over: Iterable[int], op: str, wanted: str, keep: bool = False) -> T.View:
        """``view``'s term summed (``+=``) or maximized (``max=``) over the axes ``over``: the
        other axes are the head (with ``keep``, the reduced ones stay as axes of 1)."""
        over = set(over)
        name = self.name(wanted)
        kept = tuple(axis for k, axis in enumerate(view.axes) if k not in over)
        reduced = [a for k in sorted(over) for a in view.axes[k]]
        head = T.View(view.term, kept, view.extent, view.dtype)
        render = _renderer(op, reduced, hints=self.hints)
        self._write(name, render(name, head), head, view.term, render)
        out = T.read(name, head.shape, view.dtype)
        for k in sorted(over) if keep else ():
            out = T.unsqueeze(out, k)
        return out

    def contract(self, head: T.View, reduced: Sequence[int], wanted: str, guards: Sequence[T.Cmp] = ()) -> T.View:
        """``head.term`` summed over the atoms ``reduced`` (shared by the factors it multiplies),
        at the points ``guards`` admit."""
        name = self.name(wanted)
        flat = self._apart(name, head)
        render = _renderer("+=", reduced, guards, self.hints)
        self._write(name, render(name, flat), flat, flat.term, render)
        return self._read(name, head, flat)

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
    literals: Mapping[int, int] | None = None,
    hints: Mapping[int, Sequence[str]] | None = None,
) -> str:
    """One rule's text; ``lookup`` (a term of integers, an atom): the atom takes the term's
    values (``where ids[b, s] = v``); ``guards``: comparisons of indices that restrict its
    points; ``hints``: index names by extent."""
    names = _Names(head.extent, hints or {})
    atoms = [a for axis in head.axes for a in axis] + list(reduced)
    for a in atoms:
        names.get(a)
    for a in sorted(T.atoms_of(body) - set(atoms)):
        names.get(a)
    fixed = literals or {}

    def at(a: int) -> str:
        return f"{fixed[a] if a in fixed else names.get(a)}:{head.extent[a]}"

    positions = []
    for axis in head.axes:
        real = [a for a in axis if head.extent[a] != 1] or list(axis[:1])
        positions.append(at(real[0]) if len(real) == 1 else "(" + ", ".join(at(a) for a in real) + ")")
    extent = head.extent
    conditions = [f"{_term(lookup[0], names, extent)} = {names.get(lookup[1])}"] if lookup else []
    conditions += [_guard(c, names) for c in guards]
    guard = f" where {', '.join(conditions)}" if conditions else ""
    return f"{name}[{', '.join(positions)}] {op} {_term(body, names, extent)}{guard}."


def _renderer(
    op: str, reduced: Sequence[int], guards: Sequence[T.Cmp] = (), hints: Mapping[int, Sequence[str]] | None = None
) -> Callable[[str, T.View], str]:
    """A rule's text for a name and head (its body the head's term)."""
    return lambda name, head: _rule(name, head, op, head.term, reduced, guards=guards, hints=hints)


def _composites(term: T.Term, extent: Mapping[int, int]) -> list[tuple[str, int, list[int]]]:
    """Each read of a relation's axis as a composite: (relation, axis, the parts' extents)."""
    if isinstance(term, T.Read):
        out = []
        for k, axis in enumerate(term.axes):
            parts = [p for p in axis if not (isinstance(p, T.Fixed) and p.extent == 1)]
            if len(parts) > 1 and all(isinstance(p, T.Atom | T.Fixed) for p in parts):
                sizes = [p.extent if isinstance(p, T.Fixed) else extent[p.id] for p in parts]  # type: ignore[union-attr]
                out.append((term.relation, k, sizes))
        return out
    if isinstance(term, T.Unary):
        return _composites(term.arg, extent)
    if isinstance(term, T.Binary):
        return _composites(term.left, extent) + _composites(term.right, extent)
    if isinstance(term, T.Where):
        found = []
        for t in (term.cond.left, term.cond.right, term.then, term.other):
            found += _composites(t, extent)
        return found
    return []


def _shiftable(view: T.View, axis: int) -> bool:
    """Whether a concat can take ``view`` as it is: one atom per axis, and the atom of ``axis``
    never a part of a composite (it is read shifted)."""
    return all(len(group) == 1 for group in view.axes) and not T.in_composite(view.term, view.axes[axis][0])


class _Names:
    """Index variable names of one rule, by atom: the first free name ``hints`` gives the
    atom's extent, else the first free letter no hint uses (so ``s`` always means the
    sequence where a config says so)."""

    def __init__(self, extent: Mapping[int, int], hints: Mapping[int, Sequence[str]]) -> None:
        self.by_atom: dict[int, str] = {}
        self.extent, self.hints = extent, hints
        hinted = {n for names in hints.values() for n in names}
        self.spare = [c for c in _LETTERS if c not in hinted]

    def get(self, atom: int) -> str:
        if atom not in self.by_atom:
            used = set(self.by_atom.values())
            wanted = [n for n in self.hints.get(self.extent.get(atom, 0), ()) if n not in used]
            k = 0
            while not wanted:
                letter = self.spare[k % len(self.spare)]
                name = letter if k < len(self.spare) else f"{letter}{k // len(self.spare)}"
                wanted = [name] if name not in used else []
                k += 1
            self.by_atom[atom] = wanted[0]
        return self.by_atom[atom]


def _guard(cmp: T.Cmp, names: _Names) -> str:
    """A guard's text; ``a - b <= 0`` (a band folded from a mask) as ``a <= b``."""
    diff = cmp.left
    if cmp.right == T.Num(0.0) and isinstance(diff, T.Binary) and diff.op == "-" and isinstance(diff.right, T.Index):
        return f"{_affine(diff.left, names)} {cmp.op} {_affine(diff.right, names)}"
    return f"{_affine(cmp.left, names)} {cmp.op} {_affine(cmp.right, names)}"


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
        cond = (
            _guard(term.cond, names)  # a comparison of places: whole numbers
            if _is_affine(term.cond.left) and _is_affine(term.cond.right)
            else f"{_term(term.cond.left, names, extent)} {term.cond.op} {_term(term.cond.right, names, extent)}"
        )
        return f"where({cond}, {_term(term.then, names, extent)}, {_term(term.other, names, extent)})"
    raise AssertionError(term)


def _is_affine(term: T.Term) -> bool:
    """Whether ``term`` is indices and whole numbers under + - * (a place, not a value)."""
    if isinstance(term, T.Index):
        return True
    if isinstance(term, T.Num):
        return float(term.value).is_integer()
    return isinstance(term, T.Binary) and term.op in "+-*" and _is_affine(term.left) and _is_affine(term.right)


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
