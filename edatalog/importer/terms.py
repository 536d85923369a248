"""Scalar terms of imported rules, and the tensors the importer tracks as views of relations.

A tensor of the captured graph is a :class:`View`: a scalar :data:`Term` over *atoms* (index
variables, each with an extent) and how the tensor's axes are made of them, row-major (an axis of
10 that a ``view`` split from a ``[2, 5]`` tensor is the atoms ``(a, b)``, read as the composite
``x[(a, b)]``).  Views, permutes, broadcasts, slices and elementwise arithmetic only rewrite the
term and the axes; nothing is computed until a rule is written (``materialize`` in
:mod:`edatalog.importer.builder`).  So layout ops fold into index positions, as the language's
composites and index expressions say them, and elementwise chains become one rule.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

_fresh = itertools.count()


def fresh() -> int:
    """A new atom id (ids are global, so terms of different tensors never mix up atoms)."""
    return next(_fresh)


# -- terms ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Atom:
    """The place of atom ``id`` (a variable), shifted by ``offset``: a slice's start (``sliced``:
    the atom ranges over part of the axis, even from place 0)."""

    id: int
    offset: int = 0
    sliced: bool = False


@dataclass(frozen=True)
class Fixed:
    """A fixed place on an axis (a broadcast size-1 axis reads place 0) of ``extent`` places."""

    place: int
    extent: int = 1


@dataclass(frozen=True)
class Window:
    """The place ``sum(coef * atom) + const``: a convolution's ``stride * y + dilation * k - pad``."""

    terms: tuple[tuple[int, int], ...]  # (atom, coefficient)
    const: int


Part = Atom | Fixed | Window


@dataclass(frozen=True)
class Read:
    """``relation[...]``: each axis of the relation as its parts (several: a composite)."""

    relation: str
    axes: tuple[tuple[Part, ...], ...]


@dataclass(frozen=True)
class Num:
    value: float


@dataclass(frozen=True)
class Index:
    """An atom's place as a number (``arange``)."""

    id: int


@dataclass(frozen=True)
class Unary:
    op: str  # a built-in function of the language, or "-"
    arg: Term


@dataclass(frozen=True)
class Binary:
    op: str  # + - * / ^ max min
    left: Term
    right: Term


@dataclass(frozen=True)
class Where:
    cond: Cmp
    then: Term
    other: Term


@dataclass(frozen=True)
class Cmp:
    op: str  # < <= > >= == !=
    left: Term
    right: Term


Term = Read | Num | Index | Unary | Binary | Where


def atoms_of(term: Term) -> set[int]:
    """The atoms a term reads."""
    if isinstance(term, Read):
        ids = {p.id for axis in term.axes for p in axis if isinstance(p, Atom)}
        return ids | {a for axis in term.axes for p in axis if isinstance(p, Window) for a, _ in p.terms}
    if isinstance(term, Index):
        return {term.id}
    if isinstance(term, Unary):
        return atoms_of(term.arg)
    if isinstance(term, Binary):
        return atoms_of(term.left) | atoms_of(term.right)
    if isinstance(term, Where):
        return atoms_of(term.cond.left) | atoms_of(term.cond.right) | atoms_of(term.then) | atoms_of(term.other)
    return set()


# An atom replaced: by other atoms (a split, row-major, with their extents), by a fixed place,
# or renamed.
Replacement = tuple[tuple[int, int], ...] | Fixed


def substitute(term: Term, table: Mapping[int, Replacement]) -> Term:
    """``term`` with each atom of ``table`` replaced (see :data:`Replacement`)."""
    if not table:
        return term
    if isinstance(term, Read):
        axes = []
        for axis in term.axes:
            parts: list[Part] = []
            for p in axis:
                if isinstance(p, Window):
                    parts.append(_window(p, table))
                    continue
                new = table.get(p.id) if isinstance(p, Atom) else None
                if new is None:
                    parts.append(p)
                elif isinstance(new, Fixed):
                    assert isinstance(p, Atom)
                    parts.append(Fixed(new.place + p.offset, new.extent))
                else:
                    assert isinstance(p, Atom)
                    if p.sliced and len(new) > 1:
                        raise Unfoldable("a sliced axis split again")
                    parts.extend(Atom(i, p.offset, p.sliced) for i, _ in new)
            axes.append(tuple(parts))
        return Read(term.relation, tuple(axes))
    if isinstance(term, Index):
        new = table.get(term.id)
        if new is None:
            return term
        if isinstance(new, Fixed):
            return Num(float(new.place))
        value: Term = Index(new[0][0])
        for i, extent in new[1:]:
            value = Binary("+", Binary("*", value, Num(float(extent))), Index(i))
        return value
    if isinstance(term, Unary):
        return Unary(term.op, substitute(term.arg, table))
    if isinstance(term, Binary):
        return Binary(term.op, substitute(term.left, table), substitute(term.right, table))
    if isinstance(term, Where):
        cond = Cmp(term.cond.op, substitute(term.cond.left, table), substitute(term.cond.right, table))
        return Where(cond, substitute(term.then, table), substitute(term.other, table))
    return term


def _window(p: Window, table: Mapping[int, Replacement]) -> Window:
    """A window's place with its atoms replaced: renamed, or fixed (into the constant)."""
    terms, const = [], p.const
    for atom, coef in p.terms:
        new = table.get(atom)
        if new is None:
            terms.append((atom, coef))
        elif isinstance(new, Fixed):
            const += coef * new.place
        elif len(new) == 1:
            terms.append((new[0][0], coef))
        else:
            raise Unfoldable("a window's index split")
    return Window(tuple(terms), const)


class Unfoldable(Exception):
    """A layout op that the term cannot express as index positions: the importer writes the
    tensor as a relation first, and folds the op into reads of that."""


# -- views ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class View:
    """A tensor: ``term`` at each point of its atoms; axis ``k`` is the atoms ``axes[k]``,
    row-major.  ``extent`` gives every atom's."""

    term: Term
    axes: tuple[tuple[int, ...], ...]
    extent: Mapping[int, int]
    dtype: str

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(math.prod(self.extent[a] for a in axis) for axis in self.axes)

    def is_plain(self) -> bool:
        """A read of a relation, every atom once, nothing fixed or shifted (cheap to read
        anywhere: contractions take it as it is)."""
        if not isinstance(self.term, Read):
            return False
        parts = [p for axis in self.term.axes for p in axis]
        return all(isinstance(p, Atom) and not p.sliced for p in parts) and len(parts) == len(
            {p.id for p in parts if isinstance(p, Atom)}
        )


def read(relation: str, shape: Sequence[int], dtype: str) -> View:
    """A relation read whole: one atom per axis."""
    ids = [fresh() for _ in shape]
    term = Read(relation, tuple((Atom(i),) for i in ids))
    return View(term, tuple((i,) for i in ids), dict(zip(ids, shape, strict=True)), dtype)


def refine(a: Sequence[int], b: Sequence[int]) -> list[int] | None:
    """The coarsest row-major factorization that refines both ``a`` and ``b`` (extents of the
    same product, size-1 parts left out), or None where their boundaries cross."""
    a, b = [x for x in a if x != 1], [x for x in b if x != 1]
    out: list[int] = []
    i = j = 0
    ra = a[0] if a else 1
    rb = b[0] if b else 1
    while i < len(a) and j < len(b):
        if ra == rb:
            out.append(ra)
            i, j = i + 1, j + 1
            ra = a[i] if i < len(a) else 1
            rb = b[j] if j < len(b) else 1
        elif ra > rb and ra % rb == 0:
            out.append(rb)
            ra //= rb
            j += 1
            rb = b[j] if j < len(b) else 1
        elif rb > ra and rb % ra == 0:
            out.append(ra)
            rb //= ra
            i += 1
            ra = a[i] if i < len(a) else 1
        else:
            return None
    return out if i == len(a) and j == len(b) else None


def _split_atoms(
    atoms: Sequence[int], sizes: Sequence[int], table: dict[int, Replacement], extent: dict[int, int]
) -> list[int]:
    """``atoms`` (in order, none of extent 1) split into new atoms of ``sizes``, which refine
    them: each split atom's replacement goes into ``table`` and the new extents into ``extent``
    (which has the old ones); the atoms after, in order (an atom left whole is itself)."""
    out: list[int] = []
    k = 0
    for a in atoms:
        need, parts = extent[a], []
        while need > 1:
            parts.append((fresh(), sizes[k]))
            need //= sizes[k]
            k += 1
        if len(parts) == 1:
            out.append(a)
            continue
        table[a] = tuple(parts)
        extent.update(parts)
        out.extend(i for i, _ in parts)
    return out


def split_axis(view: View, axis: int, sizes: Sequence[int]) -> View:
    """``view`` with the atoms of ``axis`` split into atoms of ``sizes`` (which must refine
    them; size-1 atoms fixed at 0).  Raises :class:`Unfoldable` otherwise."""
    old = [a for a in view.axes[axis] if view.extent[a] != 1]
    if refine([view.extent[a] for a in old], sizes) != list(sizes):
        raise Unfoldable(f"axis of {view.shape[axis]} cannot be split as {list(sizes)}")
    table: dict[int, Replacement] = {a: Fixed(0) for a in view.axes[axis] if view.extent[a] == 1}
    extent = dict(view.extent)
    new = _split_atoms(old, sizes, table, extent)
    axes = (*view.axes[:axis], tuple(new), *view.axes[axis + 1 :])
    return View(substitute(view.term, table), axes, extent, view.dtype)


def reshape(view: View, shape: Sequence[int]) -> View:
    """``view`` as ``shape`` (same size): atoms split where the new axes cut through them."""
    flat = [a for axis in view.axes for a in axis if view.extent[a] != 1]
    sizes = refine([view.extent[a] for a in flat], [s for s in shape if s != 1])
    if sizes is None:
        raise Unfoldable(f"reshape of {list(view.shape)} to {list(shape)}")
    # Fix size-1 atoms, split the rest as ``sizes`` says, then group by the new shape.
    table: dict[int, Replacement] = {a: Fixed(0) for axis in view.axes for a in axis if view.extent[a] == 1}
    extent = dict(view.extent)
    atoms = _split_atoms(flat, sizes, table, extent)
    axes: list[tuple[int, ...]] = []
    for size in shape:
        group: list[int] = []
        while math.prod(extent[a] for a in group) < size:
            group.append(atoms.pop(0))
        if size == 1:
            one = fresh()
            extent[one] = 1
            group = [one]
        axes.append(tuple(group))
    assert not atoms
    return View(substitute(view.term, table), tuple(axes), extent, view.dtype)


def permute(view: View, order: Sequence[int]) -> View:
    return View(view.term, tuple(view.axes[k] for k in order), view.extent, view.dtype)


def unsqueeze(view: View, axis: int) -> View:
    one = fresh()
    axes = list(view.axes)
    axes.insert(axis, (one,))
    return View(view.term, tuple(axes), {**view.extent, one: 1}, view.dtype)


def squeeze(view: View, dims: Sequence[int]) -> View:
    drop = {d for d in dims if view.shape[d] == 1}
    table: dict[int, Replacement] = {a: Fixed(0) for d in drop for a in view.axes[d]}
    axes = tuple(axis for k, axis in enumerate(view.axes) if k not in drop)
    return View(substitute(view.term, table), axes, view.extent, view.dtype)


def expand(view: View, shape: Sequence[int]) -> View:
    """Broadcast size-1 axes (and new leading ones) to ``shape``."""
    lead = len(shape) - len(view.axes)
    table: dict[int, Replacement] = {}
    extent = dict(view.extent)
    axes: list[tuple[int, ...]] = []
    for k, size in enumerate(shape):
        have = view.axes[k - lead] if k >= lead else None
        if have is not None and (size == -1 or view.shape[k - lead] == size):
            axes.append(have)
            continue
        if have is not None:
            for a in have:
                table[a] = Fixed(0)
        new = fresh()
        extent[new] = size
        axes.append((new,))
    return View(substitute(view.term, table), tuple(axes), extent, view.dtype)


def narrow(view: View, axis: int, start: int, end: int) -> View:
    """Places ``start`` to ``end`` of ``axis`` (a slice of step 1)."""
    size = view.shape[axis]
    start, end = max(0, start), min(end, size)
    if (start, end) == (0, size):
        return view
    group = [a for a in view.axes[axis] if view.extent[a] != 1]
    if len(group) > 1:
        return _narrow_composite(view, axis, start, end)
    (a,) = group
    length = end - start
    if size % length == 0 and start % length == 0:
        # One of equal pieces (a split into q, k and v): the axis read as (piece, place), the
        # piece fixed, ``qkv[(1, d)]``, so that the place can be split again (into heads).
        try:
            return _narrow_composite(split_axis(view, axis, [size // length, length]), axis, start, end)
        except Unfoldable:
            pass
    if in_composite(view.term, a):
        raise Unfoldable("a slice of a part of a composite")
    new = fresh()
    term = shift(view.term, a, new, start)
    axes = (*view.axes[:axis], (new,), *view.axes[axis + 1 :])
    return View(term, axes, {**view.extent, new: end - start}, view.dtype)


def _narrow_composite(view: View, axis: int, start: int, end: int) -> View:
    """A slice of an axis of several atoms that keeps whole the atoms inside one atom ``k``
    and one place of each atom outside it: those are fixed, ``k`` kept whole or fixed too (a
    rotary embedding's halves of a head axis read as (half, e))."""
    group = [a for a in view.axes[axis] if view.extent[a] != 1]
    for k, a in enumerate(group):
        inner = math.prod(view.extent[b] for b in group[k + 1 :])
        outer = view.extent[a] * inner
        if start % inner or (end - start) % inner or start // outer != (end - 1) // outer:
            continue
        length = (end - start) // inner
        if length not in (1, view.extent[a]):
            continue
        table: dict[int, Replacement] = {}
        rest = start // outer
        for b in reversed(group[:k]):
            table[b] = Fixed(rest % view.extent[b], view.extent[b])
            rest //= view.extent[b]
        keep = list(group[k + 1 :])
        if length == 1:
            table[a] = Fixed(start // inner % view.extent[a], view.extent[a])
        else:
            keep.insert(0, a)
        if not keep:  # one place left: the axis is a new atom of extent 1
            one = fresh()
            extent = {**view.extent, one: 1}
            keep = [one]
        else:
            extent = dict(view.extent)
        axes = (*view.axes[:axis], tuple(keep), *view.axes[axis + 1 :])
        return View(substitute(view.term, table), axes, extent, view.dtype)
    raise Unfoldable("a slice of a composite axis")


def select(view: View, axis: int, place: int) -> View:
    group = [a for a in view.axes[axis] if view.extent[a] != 1]
    if len(group) > 1:
        raise Unfoldable("a select of a composite axis")
    table: dict[int, Replacement] = {a: Fixed(0) for a in view.axes[axis]}
    if group:
        table[group[0]] = Fixed(place, view.extent[group[0]])
    axes = (*view.axes[:axis], *view.axes[axis + 1 :])
    return View(substitute(view.term, table), axes, view.extent, view.dtype)


def in_composite(term: Term, atom: int) -> bool:
    """Whether a read of ``term`` has ``atom`` as one part of a composite."""
    if isinstance(term, Read):
        return any(len(axis) > 1 and any(isinstance(p, Atom) and p.id == atom for p in axis) for axis in term.axes)
    if isinstance(term, Unary):
        return in_composite(term.arg, atom)
    if isinstance(term, Binary):
        return in_composite(term.left, atom) or in_composite(term.right, atom)
    if isinstance(term, Where):
        parts = (term.cond.left, term.cond.right, term.then, term.other)
        return any(in_composite(t, atom) for t in parts)
    return False


def shift(term: Term, old: int, new: int, by: int) -> Term:
    """``term`` reading atom ``new`` plus ``by`` where it read ``old`` (a window of the axis)."""
    if isinstance(term, Read):
        axes = tuple(
            tuple(Atom(new, p.offset + by, True) if isinstance(p, Atom) and p.id == old else p for p in axis)
            for axis in term.axes
        )
        return Read(term.relation, axes)
    if isinstance(term, Index):
        if term.id != old:
            return term
        if by == 0:
            return Index(new)
        return Binary("+" if by > 0 else "-", Index(new), Num(float(abs(by))))
    return _map(term, lambda t: shift(t, old, new, by))


def _map(term: Term, f: Callable[[Term], Term]) -> Term:
    if isinstance(term, Unary):
        return Unary(term.op, f(term.arg))
    if isinstance(term, Binary):
        return Binary(term.op, f(term.left), f(term.right))
    if isinstance(term, Where):
        return Where(Cmp(term.cond.op, f(term.cond.left), f(term.cond.right)), f(term.then), f(term.other))
    return term


def share(
    views: Sequence[View],
    groups: Sequence[tuple[int, Sequence[int]]],
    tables: list[dict[int, Replacement]],
    extent: dict[int, int],
) -> tuple[int, ...]:
    """New atoms for one axis that several operands have (``groups``: an operand's index in
    ``views`` and its atoms of the axis, size-1 ones left out), split as the coarsest
    refinement of all their splits; each operand's atoms are mapped onto them in its table, and
    their extents added to ``extent``.  Raises :class:`Unfoldable` where two splits cross."""
    sizes: list[int] | None = [views[groups[0][0]].extent[a] for a in groups[0][1]] if groups else [1]
    for j, g in groups[1:]:
        sizes = refine(sizes or [], [views[j].extent[a] for a in g])
        if sizes is None:
            raise Unfoldable("operands split an axis in crossing ways")
    assert sizes is not None
    ids = [fresh() for _ in sizes]
    extent.update(zip(ids, sizes, strict=True))
    for j, g in groups:
        k = 0
        for a in g:
            need, parts = views[j].extent[a], []
            while need > 1:
                parts.append((ids[k], sizes[k]))
                need //= sizes[k]
                k += 1
            tables[j][a] = tuple(parts)
    return tuple(ids)


def one_index(axes: Sequence[tuple[dict[int, Replacement], Sequence[int]]], one: int) -> None:
    """Operands' axes of extent 1 read at the atom ``one`` (the head's axis of 1) rather than
    at place 0: the first atom of each axis renamed in its operand's table, as a person writes
    ``x[b, s] * y[b, s]`` (and as the attention chain's rules must read, index for index)."""
    for table, atoms in axes:
        if atoms:
            table[atoms[0]] = ((one, 1),)


def align(
    views: Sequence[View], shape: Sequence[int]
) -> tuple[list[Term], tuple[tuple[int, ...], ...], dict[int, int]]:
    """Operands of an elementwise op, broadcast to ``shape`` as torch broadcasts, on shared
    atoms: each operand's term rewritten onto the output's atoms, the output's axes and
    extents.  Raises :class:`Unfoldable` where two operands split an axis in crossing ways."""
    n = len(shape)
    out_axes: list[tuple[int, ...]] = []
    extent: dict[int, int] = {}
    tables: list[dict[int, Replacement]] = [{} for _ in views]
    for k in range(n):
        size = shape[k]
        groups = []
        for j, v in enumerate(views):
            at = k - (n - len(v.shape))
            if at < 0:
                continue
            if v.shape[at] == size and size != 1:
                groups.append((j, [a for a in v.axes[at] if v.extent[a] != 1]))
            else:
                for a in v.axes[at]:
                    tables[j][a] = Fixed(0)
        if size == 1 or not groups:
            one = fresh()
            extent[one] = size
            out_axes.append((one,))
            if size == 1:
                ones = [(tables[j], v.axes[at]) for j, v in enumerate(views) if (at := k - (n - len(v.shape))) >= 0]
                one_index(ones, one)
            continue
        out_axes.append(share(views, groups, tables, extent))
    terms = [substitute(v.term, t) for v, t in zip(views, tables, strict=True)]
    return terms, tuple(out_axes), extent
