"""Integer affine constraints: guards, supports, and the operations the compiler needs on them.

A :class:`Guard` is a union (DNF) of :class:`Conj` conjunctions of :class:`Constraint`s over named
integer variables.  Every variable also lives in a *box* ``0 <= v < extent`` that is implied and
never stored.  The compiler needs:

- substitution of affine expressions for variables (reading a relation through an index map);
- projection onto a subset of variables (the support of a rule's head), by Fourier-Motzkin;
- simplification against the box, and merging of complementary pieces (``i < 4`` or ``i >= 4``);
- evaluation to a boolean mask, and exact counting of the points inside the box.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from edatalog.ir import lattice

Box = Mapping[str, int]  # variable -> extent


@dataclass(frozen=True, order=True)
class Affine:
    """``sum(coef * var) + const`` with integer coefficients; terms sorted, no zero coefficient."""

    terms: tuple[tuple[str, int], ...] = ()
    const: int = 0

    @staticmethod
    def var(name: str, coef: int = 1) -> Affine:
        return Affine(((name, coef),) if coef else ())

    @staticmethod
    def of(terms: Mapping[str, int] | Iterable[tuple[str, int]], const: int = 0) -> Affine:
        acc: dict[str, int] = {}
        for v, c in terms.items() if isinstance(terms, Mapping) else terms:
            acc[v] = acc.get(v, 0) + c
        return Affine(tuple(sorted((v, c) for v, c in acc.items() if c)), const)

    @property
    def vars(self) -> frozenset[str]:
        return frozenset(v for v, _ in self.terms)

    def coef(self, name: str) -> int:
        return next((c for v, c in self.terms if v == name), 0)

    def __add__(self, other: Affine | int) -> Affine:
        if isinstance(other, int):
            return Affine(self.terms, self.const + other)
        return Affine.of(self.terms + other.terms, self.const + other.const)

    def __neg__(self) -> Affine:
        return self.scale(-1)

    def __sub__(self, other: Affine | int) -> Affine:
        return self + (-other)

    def scale(self, k: int) -> Affine:
        return Affine(tuple((v, c * k) for v, c in self.terms) if k else (), self.const * k)

    def substitute(self, mapping: Mapping[str, Affine]) -> Affine:
        """Replace variables simultaneously; unmapped variables stay."""
        out = Affine((), self.const)
        for v, c in self.terms:
            out = out + (mapping[v].scale(c) if v in mapping else Affine.var(v, c))
        return out

    def bounds(self, box: Box) -> tuple[int, int]:
        """Least and greatest value over the box."""
        lo = hi = self.const
        for v, c in self.terms:
            top = c * (box[v] - 1)
            lo += min(0, top)
            hi += max(0, top)
        return lo, hi

    def evaluate(self, values: Mapping[str, np.ndarray | int]) -> np.ndarray | int:
        acc: np.ndarray | int = self.const
        for v, c in self.terms:
            acc = acc + c * values[v]
        return acc

    def __str__(self) -> str:
        return _render_sum(list(self.terms), self.const)

    def render(self, order: Sequence[str]) -> str:
        """The text with terms in ``order`` (a rule's index order: ``l + k``, not ``k + l``)."""
        rank = {v: k for k, v in enumerate(order)}
        return _render_sum(sorted(self.terms, key=lambda t: (rank.get(t[0], len(rank)), t[0])), self.const)


def _render_sum(terms: list[tuple[str, int]], const: int) -> str:
    parts: list[str] = []
    for v, c in terms:
        mag = abs(c)
        body = v if mag == 1 else f"{mag}*{v}"
        parts.append(("- " if c < 0 else "+ ") + body)
    if const or not parts:
        parts.append(("- " if const < 0 else "+ ") + str(abs(const)))
    text = " ".join(parts)
    return text[2:] if text.startswith("+ ") else "-" + text[2:]


@dataclass(frozen=True, order=True)
class Constraint:
    """``expr >= 0``, or ``expr == 0`` when ``eq``."""

    expr: Affine
    eq: bool = False

    def normalized(self) -> Constraint | bool:
        """Divide by the gcd of the coefficients (tightening the constant over the integers).

        Returns True or False for constraints without variables.
        """
        if not self.expr.terms:
            return self.expr.const == 0 if self.eq else self.expr.const >= 0
        g = 0
        for _, c in self.expr.terms:
            g = math.gcd(g, c)
        if self.eq:
            if self.expr.const % g:
                return False
            # Canonical sign: first coefficient positive.
            sign = -1 if self.expr.terms[0][1] < 0 else 1
            return Constraint(
                Affine(tuple((v, sign * c // g) for v, c in self.expr.terms), sign * self.expr.const // g), True
            )
        return Constraint(Affine(tuple((v, c // g) for v, c in self.expr.terms), self.expr.const // g))

    def negated(self) -> list[Constraint]:
        """The complement over the integers, as a union of constraints."""
        if self.eq:
            return [Constraint(self.expr - 1), Constraint(-self.expr - 1)]
        return [Constraint(-self.expr - 1)]

    def holds(self, values: Mapping[str, np.ndarray | int]) -> np.ndarray | bool:
        val = self.expr.evaluate(values)
        return val == 0 if self.eq else val >= 0

    def __str__(self) -> str:
        pos = [(v, c) for v, c in self.expr.terms if c > 0]
        neg = [(v, -c) for v, c in self.expr.terms if c < 0]
        k = self.expr.const
        if pos and neg:  # N - k' <= P + k  reads best as "t + 1 <= s"
            op = "==" if self.eq else "<="
            return f"{_render_sum(neg, max(0, -k))} {op} {_render_sum(pos, max(0, k))}"
        if pos:
            return f"{_render_sum(pos, 0)} {'==' if self.eq else '>='} {-k}"
        return f"{_render_sum(neg, 0)} {'==' if self.eq else '<='} {k}"


@dataclass(frozen=True)
class Conj:
    """A conjunction; the empty conjunction is true."""

    constraints: tuple[Constraint, ...] = ()

    @property
    def vars(self) -> frozenset[str]:
        out: frozenset[str] = frozenset()
        for c in self.constraints:
            out |= c.expr.vars
        return out

    def __str__(self) -> str:
        return ", ".join(str(c) for c in self.constraints) if self.constraints else "true"


@dataclass(frozen=True)
class Guard:
    """A union of conjunctions.  ``Guard(())`` is false; ``Guard((Conj(),))`` is true."""

    conjs: tuple[Conj, ...]

    @staticmethod
    def true() -> Guard:
        return Guard((Conj(),))

    @staticmethod
    def false() -> Guard:
        return Guard(())

    @staticmethod
    def of(constraints: Iterable[Constraint]) -> Guard:
        return Guard((Conj(tuple(constraints)),))

    @property
    def is_true(self) -> bool:
        return any(not c.constraints for c in self.conjs)

    @property
    def is_false(self) -> bool:
        return not self.conjs

    @property
    def vars(self) -> frozenset[str]:
        out: frozenset[str] = frozenset()
        for c in self.conjs:
            out |= c.vars
        return out

    def __and__(self, other: Guard) -> Guard:
        return Guard(tuple(Conj(a.constraints + b.constraints) for a in self.conjs for b in other.conjs))

    def __or__(self, other: Guard) -> Guard:
        return Guard(self.conjs + other.conjs)

    def substitute(self, mapping: Mapping[str, Affine]) -> Guard:
        return Guard(
            tuple(
                Conj(tuple(Constraint(c.expr.substitute(mapping), c.eq) for c in conj.constraints))
                for conj in self.conjs
            )
        )

    def rename(self, mapping: Mapping[str, str]) -> Guard:
        return self.substitute({k: Affine.var(v) for k, v in mapping.items()})

    def __str__(self) -> str:
        if self.is_false:
            return "false"
        if len(self.conjs) == 1:
            return str(self.conjs[0])
        return " or ".join(f"({c})" if len(c.constraints) > 1 else str(c) for c in self.conjs)

    # -- evaluation --------------------------------------------------------------------------

    def mask(self, order: Sequence[str], box: Box) -> np.ndarray | bool:
        """Boolean array over the variables ``order`` (each axis its extent, or 1 if the guard
        does not mention it), or a plain bool when the guard is constant."""
        if self.is_true:
            return True
        if self.is_false:
            return False
        values: dict[str, np.ndarray] = {}
        for k, v in enumerate(order):
            shape = [1] * len(order)
            shape[k] = box[v]
            values[v] = np.arange(box[v], dtype=np.int64).reshape(shape)
        out: np.ndarray | bool = False
        for conj in self.conjs:
            m: np.ndarray | bool = True
            for c in conj.constraints:
                m = np.logical_and(m, c.holds(values))
            out = np.logical_or(out, m)
        return out

    def count(self, box: Box) -> int:
        """The exact number of points of the box that satisfy the guard.

        In closed form, in time independent of the extents, when every group of variables linked
        by a conjunction's constraints has at most two (see :mod:`edatalog.ir.lattice`).  Raises
        OverflowError when that would take too long (a huge group of three or more variables, or
        many overlapping pieces); :meth:`count_bound` never does."""
        if self.is_false:
            return 0
        if self.is_true:
            return math.prod(box.values())
        involved = sorted(self.vars)
        free = math.prod(box[v] for v in box if v not in self.vars)
        size = math.prod(box[v] for v in involved)
        if size <= _MASK_LIMIT:  # tiny: look at every point
            return free * self._count_mask(involved, box)
        try:
            return free * _count_union([c.constraints for c in self.conjs], involved, box)
        except OverflowError:
            if size > _ENUM_LIMIT:
                raise
            return free * self._count_mask(involved, box)

    def _count_mask(self, involved: list[str], box: Box) -> int:
        shape = tuple(box[v] for v in involved)
        return int(np.count_nonzero(np.broadcast_to(self.mask(involved, box), shape)))

    def count_bound(self, box: Box) -> tuple[int, bool]:
        """The exact count and True, or, when it cannot be had cheaply, the size of the box and
        False (an upper bound)."""
        try:
            return self.count(box), True
        except OverflowError:
            return math.prod(box.values()), False

    # -- symbolic reasoning ------------------------------------------------------------------

    def simplify(self, box: Box) -> Guard:
        """Normalize, drop what the box implies, drop empty pieces, merge complementary ones, and
        recognize a union that covers the whole box (``i != 1`` or ``i == 1``) as true."""
        conjs: list[Conj] = []
        for conj in self.conjs:
            simple = _simplify_conj(conj, box)
            if simple is not None:
                conjs.append(simple)
        merged = Guard(_merge(conjs, box))
        if len(merged.conjs) > 1:
            involved = sorted(merged.vars)
            size = math.prod(box[v] for v in involved)
            if size <= _COVER_LIMIT and merged.count({v: box[v] for v in involved}) == size:
                return Guard.true()
        return merged

    def project(self, keep: Iterable[str], box: Box) -> tuple[Guard, bool]:
        """The guard's shadow on the variables ``keep``: exists the others within the box.

        Returns the projection and whether it is exact over the integers (Fourier-Motzkin is
        exact when every eliminated variable has a unit coefficient on one side).
        """
        keep = frozenset(keep)
        exact = True
        conjs: list[Conj] = []
        for conj in self.conjs:
            cons: list[Constraint] | None = list(conj.constraints)
            for v in sorted(conj.vars - keep):
                assert cons is not None
                bounds = [Constraint(Affine.var(v)), Constraint(Affine.var(v, -1) + (box[v] - 1))]
                cons, ok = _eliminate(cons + bounds, v)
                exact &= ok
                if cons is None:
                    break
            if cons is not None:
                conjs.append(Conj(tuple(cons)))
        return Guard(tuple(conjs)).simplify({v: n for v, n in box.items() if v in keep}), exact


def _eliminate(cons: list[Constraint], v: str) -> tuple[list[Constraint] | None, bool]:
    """Remove ``v`` from a conjunction.  Returns None if it becomes infeasible."""
    eqs = [c for c in cons if c.eq and c.expr.coef(v)]
    if eqs:
        unit = next((c for c in eqs if abs(c.expr.coef(v)) == 1), None)
        if unit is not None:
            a = unit.expr.coef(v)
            # a*v + rest == 0  =>  v = -rest / a
            others = Affine(tuple((w, c) for w, c in unit.expr.terms if w != v), unit.expr.const)
            value = others.scale(-a)  # a is +-1 so 1/a == a
            out = [Constraint(c.expr.substitute({v: value}), c.eq) for c in cons if c is not unit]
            return _clean(out), True
        # Non-unit equality: keep it as two inequalities (rational shadow).
        cons = [c for c in cons if c not in eqs] + [d for c in eqs for d in (Constraint(c.expr), Constraint(-c.expr))]
    lower = [c for c in cons if c.expr.coef(v) > 0]
    upper = [c for c in cons if c.expr.coef(v) < 0]
    rest = [c for c in cons if not c.expr.coef(v)]
    exact = all(c.expr.coef(v) == 1 for c in lower) or all(c.expr.coef(v) == -1 for c in upper)
    for lo in lower:
        for up in upper:
            a, b = lo.expr.coef(v), -up.expr.coef(v)
            rest.append(Constraint(lo.expr.scale(b) + up.expr.scale(a)))
    return _clean(rest), exact


def _clean(cons: list[Constraint]) -> list[Constraint] | None:
    out: list[Constraint] = []
    for c in cons:
        n = c.normalized()
        if n is False:
            return None
        if isinstance(n, Constraint) and n not in out:
            out.append(n)
    return out


def _simplify_conj(conj: Conj, box: Box) -> Conj | None:
    cleaned = _clean(list(conj.constraints))
    if cleaned is None:
        return None
    kept: list[Constraint] = []
    for c in cleaned:
        lo, hi = c.expr.bounds(box)
        if c.eq:
            if lo > 0 or hi < 0:
                return None
            if lo == hi == 0:
                continue
        else:
            if hi < 0:
                return None
            if lo >= 0:
                continue
        kept.append(c)
    kept = _drop_dominated(kept)
    result = Conj(tuple(sorted(kept)))
    if len(kept) > 1 and not _feasible_conj(result, box):
        return None
    return result


def _drop_dominated(cons: list[Constraint]) -> list[Constraint]:
    """Of inequalities with the same variable part keep the tightest (smallest constant)."""
    best: dict[tuple[tuple[str, int], ...], Constraint] = {}
    out: list[Constraint] = []
    for c in cons:
        if c.eq:
            out.append(c)
            continue
        prev = best.get(c.expr.terms)
        if prev is None or c.expr.const < prev.expr.const:
            best[c.expr.terms] = c
    return out + list(best.values())


def _feasible_conj(conj: Conj, box: Box) -> bool:
    cons: list[Constraint] | None = list(conj.constraints)
    for v in sorted(conj.vars):
        assert cons is not None
        cons += [Constraint(Affine.var(v)), Constraint(Affine.var(v, -1) + (box[v] - 1))]
        cons, _ = _eliminate(cons, v)
        if cons is None:
            return False
    return True


def _merge(conjs: list[Conj], box: Box) -> tuple[Conj, ...]:
    """Drop pieces contained in others and merge ``A and c`` with ``A and not c``."""
    changed = True
    pieces = list(dict.fromkeys(conjs))
    while changed:
        changed = False
        if any(not p.constraints for p in pieces):
            return (Conj(),)
        for a, b in itertools.permutations(pieces, 2):
            if set(b.constraints) <= set(a.constraints):  # a implies b
                pieces.remove(a)
                changed = True
                break
            merged = _merge_pair(a, b, box)
            if merged is not None:
                pieces.remove(a)
                pieces.remove(b)
                pieces.append(merged)
                changed = True
                break
    return tuple(sorted(pieces, key=str))


def _merge_pair(a: Conj, b: Conj, box: Box) -> Conj | None:
    sa, sb = set(a.constraints), set(b.constraints)
    only_a, only_b = sa - sb, sb - sa
    if len(only_a) != 1 or len(only_b) != 1:
        return None
    (ca,), (cb,) = only_a, only_b
    neg = ca.negated()
    if len(neg) == 1 and neg[0].normalized() == cb:
        merged = _simplify_conj(Conj(tuple(sorted(sa & sb))), box)
        assert merged is not None, "a union of two non-empty pieces cannot be empty"
        return merged
    return None


# -- counting -----------------------------------------------------------------------------------

_MASK_LIMIT = 1 << 12  # count() looks at every point of boxes this small
_ENUM_LIMIT = 1 << 22  # ... and of boxes this small when the closed forms give up
_COVER_LIMIT = 1 << 16  # simplify() checks coverage by counting only boxes this small
_ROWS_LIMIT = 1 << 22  # rows (all variables but one) a group of 3+ variables may enumerate with numpy
_PAIRS_LIMIT = 1 << 12  # ... else points of all variables but two, each counting a pair in closed form
_MAX_INTERSECTIONS = 4096


def _count_union(conjs: list[tuple[Constraint, ...]], order: list[str], box: Box) -> int:
    """Points of the box over ``order`` inside the union, by inclusion-exclusion over the pieces.
    An empty intersection prunes all its supersets, so disjoint pieces (as ``!=`` makes) cost one
    count each."""
    total = 0
    visited = 0

    def visit(start: int, acc: tuple[Constraint, ...], size: int) -> None:
        nonlocal total, visited
        for k in range(start, len(conjs)):
            piece = _simplify_conj(Conj(acc + conjs[k]), box)
            if piece is None:
                continue  # empty, and so is every intersection containing it
            visited += 1
            if visited > _MAX_INTERSECTIONS:
                raise OverflowError("too many overlapping pieces to count exactly")
            total += (-1) ** (size + 1) * _count_conj(piece.constraints, order, box)
            visit(k + 1, acc + conjs[k], size + 1)

    visit(0, (), 1)
    return total


def _groups(cons: Iterable[Constraint]) -> list[tuple[list[str], list[Constraint]]]:
    """The constraints with variables, grouped by connected variables (two constraints that
    share a variable are in one group), with each group's variables sorted."""
    groups: list[tuple[set[str], list[Constraint]]] = []
    for c in cons:
        vs = set(c.expr.vars)
        if not vs:
            continue
        joined = [g for g in groups if g[0] & vs]
        merged = (vs.union(*(g[0] for g in joined)), [*(x for g in joined for x in g[1]), c])
        groups = [g for g in groups if not g[0] & vs] + [merged]
    return [(sorted(vs), group) for vs, group in groups]


def _constants_hold(cons: Iterable[Constraint]) -> bool:
    return all(bool(c.holds({})) for c in cons if not c.expr.vars)


def _count_conj(cons: tuple[Constraint, ...], order: list[str], box: Box) -> int:
    """Points over ``order`` satisfying every constraint: a product over groups of variables that
    share constraints (unconstrained variables count their whole extent)."""
    if not _constants_hold(cons):
        return 0
    total = 1
    groups = _groups(cons)
    constrained = {v for vs, _ in groups for v in vs}
    for v in order:
        if v not in constrained:
            total *= box[v]
    for vs, group in groups:
        total *= _count_group(tuple(group), vs, box)
    return total


def _pair(cons: Iterable[Constraint], u: str, w: str | None) -> list[lattice.Ineq]:
    """Constraints over ``u`` and ``w`` (or ``u`` alone) as the lattice module takes them."""
    return [(c.expr.coef(u), c.expr.coef(w) if w else 0, c.expr.const, c.eq) for c in cons]


def _count_group(cons: tuple[Constraint, ...], order: list[str], box: Box) -> int:
    """Points of one group of connected constraints.  One or two variables: in closed form.
    More: by enumerating all variables but one (the largest) with numpy when there are at most
    ``_ROWS_LIMIT`` such rows, as each row's feasible set is an interval; else all variables but
    two (the largest), counting each pair in closed form."""
    if len(order) <= 2:
        u, w = order[0], order[1] if len(order) == 2 else None
        return lattice.count_points(_pair(cons, u, w), (0, box[u]), (0, box[w]) if w else (0, 1))
    by_size = sorted(order, key=lambda v: box[v])
    if math.prod(box[v] for v in by_size[:-1]) <= _ROWS_LIMIT:
        return _count_rows(cons, by_size[:-1], by_size[-1], box)
    outer, (u, w) = by_size[:-2], by_size[-2:]
    if math.prod(box[v] for v in outer) > _PAIRS_LIMIT:
        raise OverflowError("support too large to count exactly")
    inner = _pair(cons, u, w)
    rests = [Affine(tuple((v, k) for v, k in c.expr.terms if v not in (u, w))) for c in cons]
    total = 0
    for point in itertools.product(*(range(box[v]) for v in outer)):
        values = dict(zip(outer, point, strict=True))
        shifted = [(a, b, c + int(r.evaluate(values)), eq) for (a, b, c, eq), r in zip(inner, rests, strict=True)]
        total += lattice.count_points(shifted, (0, box[u]), (0, box[w]))
    return total


def _count_rows(cons: tuple[Constraint, ...], outer: list[str], last: str, box: Box) -> int:
    """Points of a group, row by row: for each point of the ``outer`` variables (with numpy) the
    feasible values of ``last`` are an interval.  Python ints (numpy objects) where int64 could
    overflow."""
    n_outer = math.prod(box[v] for v in outer)
    rests = [Affine(tuple((w, k) for w, k in c.expr.terms if w != last), c.expr.const) for c in cons]
    big = max([n_outer * box[last], *(abs(x) for r in rests for x in r.bounds(box))])
    dtype: type = np.int64 if big < 1 << 61 else object
    values: dict[str, np.ndarray] = {}
    grids = np.meshgrid(*[np.arange(box[v], dtype=np.int64) for v in outer], indexing="ij")
    for v, g in zip(outer, grids, strict=True):
        values[v] = g.ravel().astype(dtype)
    lo: np.ndarray = np.zeros(n_outer, dtype=dtype)
    hi: np.ndarray = np.full(n_outer, box[last] - 1, dtype=dtype)
    ok = np.ones(n_outer, dtype=bool)
    for c, rest in zip(cons, rests, strict=True):
        a = c.expr.coef(last)
        r: np.ndarray = np.broadcast_to(np.asarray(rest.evaluate(values), dtype=dtype), (n_outer,))
        if a == 0:
            ok &= (r == 0) if c.eq else (r >= 0)
        elif c.eq:
            ok &= (-r % a) == 0
            val = -r // a
            lo = np.maximum(lo, val)
            hi = np.minimum(hi, val)
        elif a > 0:  # a*x + r >= 0  =>  x >= ceil(-r / a)
            lo = np.maximum(lo, -(r // a))
        else:  # a*x + r >= 0 with a < 0  =>  x <= floor(r / -a)
            hi = np.minimum(hi, r // (-a))
    return int(np.where(ok, np.maximum(hi - lo + 1, 0), 0).sum())


def tight_box(
    cons: Iterable[Constraint], ranges: Mapping[str, tuple[int, int]]
) -> tuple[dict[str, tuple[int, int]], int] | None:
    """The points of the ranges (half-open, one per variable, a superset of the constraints'
    variables) that satisfy every constraint: their bounding box (``{}`` when there are none)
    and their number.  In closed form; None when a group of connected variables has three or
    more."""
    cons = list(cons)
    if not _constants_hold(cons):
        return {}, 0
    groups = _groups(cons)
    if any(len(vs) > 2 for vs, _ in groups):
        return None
    tight = dict(ranges)
    constrained = {v for vs, _ in groups for v in vs}
    total = math.prod(hi - lo for v, (lo, hi) in ranges.items() if v not in constrained)
    for vs, group in groups:
        u, w = vs[0], vs[1] if len(vs) == 2 else None
        pair = _pair(group, u, w)
        w_range = ranges[w] if w else (0, 1)
        count, box = lattice.count_and_box(pair, ranges[u], w_range)
        if box is None:
            return {}, 0
        total *= count
        tight[u] = box[0]
        if w:
            tight[w] = box[1]
    return (tight, total) if total else ({}, 0)
