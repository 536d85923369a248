"""Integer points of a polygon in two variables, counted and bounded in closed form.

The constraints are ``a*u + b*w + c >= 0`` (or ``== 0``) over integers ``u`` and ``w`` in
half-open ranges; everything here is pure integer arithmetic (Python ints: no overflow), and the
work depends on the number of constraints and the size of their coefficients, never on the
ranges, which may be as long as ``2**63``.

**Equalities.**  The integer solutions of ``a*u + b*w + c == 0`` form a lattice line: with
``g = gcd(a, b)`` (no solutions unless ``g`` divides ``c``) and ``a*x + b*y == g`` from the
extended Euclid algorithm, they are ``u = u0 + (b/g)*t``, ``w = w0 - (a/g)*t`` for integer ``t``,
where ``(u0, w0) = (-c/g) * (x, y)``.  Substituting that into every other constraint and the
ranges leaves constraints on ``t`` alone, whose solutions are an interval.

**Inequalities.**  Each constraint with ``b != 0`` bounds ``w`` by a line in ``u``:
``w >= (-a*u - c)/b`` when ``b > 0``, ``w <= (a*u + c)/(-b)`` when ``b < 0`` (the range of ``w``
adds two constant lines).  For each ``u`` the feasible ``w`` are
``ceil(max_i L_i(u)) .. floor(min_j U_j(u))`` (floor and ceil are monotone, so the max of ceilings
is the ceiling of the max).  Where ``min U >= max L`` over the reals the width
``floor(min U) - ceil(max L) + 1`` is never negative (each rounding loses less than 1), and where
``min U < max L`` it is never positive: so the ``u`` to sum over are an interval (Fourier-Motzkin
on every lower/upper pair), the sum needs no clamping, and a sum over part of it grows with the
part.  The envelopes ``max L`` and ``min U`` are piecewise linear, with breakpoints among the
crossings of the lines: cut the interval at ``floor`` of every crossing and each piece has one
lower and one upper line, whose sums have the closed form :func:`floor_sum`:

    sum_{u=A}^{B} floor((p*u + q) / r) = floor_sum(B - A + 1, r, p, p*A + q)
    sum_{u=A}^{B} ceil((p*u + q) / r) = -floor_sum(B - A + 1, r, -p, -p*A - q)

The bounding box of the points is the least and greatest ``u`` with a non-empty ``w`` interval
(the first piece with points, then a binary search on its prefix counts when its first row is
empty), and the same with the roles of ``u`` and ``w`` swapped.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

Ineq = tuple[int, int, int, bool]  # (a, b, c, eq): a*u + b*w + c >= 0, or == 0 when eq
Range = tuple[int, int]  # half-open [lo, hi)
_Line = tuple[int, int, int]  # (p, q, r) with r > 0: the line u -> (p*u + q) / r


def floor_sum(n: int, m: int, a: int, b: int) -> int:
    """``sum_{i=0}^{n-1} floor((a*i + b) / m)`` for ``m > 0`` and any integers ``a``, ``b``.

    Euclid-like: write ``a = qa*m + a'`` and ``b = qb*m + b'`` with ``0 <= a', b' < m`` (the
    quotients contribute ``qa*n*(n-1)/2 + qb*n``); then ``sum floor((a'*i + b')/m)`` counts the
    lattice points under a line, which counted the other way round is the same sum with
    ``n' = (a'*n + b') // m``, ``b' = (a'*n + b') % m`` and the roles of ``a'`` and ``m`` swapped.
    The steps are those of Euclid's algorithm on ``(a, m)``: their number does not depend on ``n``.
    """
    if n <= 0:
        return 0
    total = 0
    while True:
        if a < 0 or a >= m:
            q, a = divmod(a, m)
            total += q * (n * (n - 1) // 2)
        if b < 0 or b >= m:
            q, b = divmod(b, m)
            total += q * n
        top = a * n + b
        if top < m:
            return total
        n, b = divmod(top, m)
        m, a = a, m


def ext_gcd(a: int, b: int) -> tuple[int, int, int]:
    """``(g, x, y)`` with ``g = gcd(a, b) >= 0`` and ``a*x + b*y == g``."""
    x0, y0, x1, y1 = 1, 0, 0, 1
    while b:
        q = a // b
        a, b = b, a - q * b
        x0, x1 = x1, x0 - q * x1
        y0, y1 = y1, y0 - q * y1
    return (a, x0, y0) if a >= 0 else (-a, -x0, -y0)


def interval(terms: Iterable[tuple[int, int, bool]], lo: int | None, hi: int | None) -> tuple[int, int] | None:
    """The integers ``t`` in ``[lo, hi]`` (inclusive; None: unbounded) with ``k*t + d >= 0`` (or
    ``== 0`` when ``eq``) for every ``(k, d, eq)``, as an inclusive interval, or None if empty.
    The terms must bound it on both sides."""
    for k, d, eq in terms:
        if k == 0:
            if (d != 0) if eq else (d < 0):
                return None
            continue
        if eq:
            if d % k:
                return None
            lo = -d // k if lo is None else max(lo, -d // k)
            hi = -d // k if hi is None else min(hi, -d // k)
        elif k > 0:  # t >= ceil(-d / k)
            lo = -(d // k) if lo is None else max(lo, -(d // k))
        else:  # t <= floor(d / -k)
            hi = d // -k if hi is None else min(hi, d // -k)
    assert lo is not None and hi is not None, "unbounded"
    return (lo, hi) if lo <= hi else None


@dataclass(frozen=True)
class _Chain:
    """The points ``(u0 + du*t, w0 + dw*t)`` for ``lo <= t <= hi``: what an equality leaves."""

    u0: int
    w0: int
    du: int
    dw: int
    lo: int
    hi: int

    def hull(self) -> tuple[Range, Range]:
        us = (self.u0 + self.du * self.lo, self.u0 + self.du * self.hi)
        ws = (self.w0 + self.dw * self.lo, self.w0 + self.dw * self.hi)
        return (min(us), max(us) + 1), (min(ws), max(ws) + 1)


@dataclass(frozen=True)
class _Piece:
    """Rows ``lo <= u <= hi`` where ``w`` runs from ``ceil(lower(u))`` to ``floor(upper(u))``;
    no row's interval is reversed, though one may be empty."""

    lo: int
    hi: int
    lower: _Line
    upper: _Line

    def count(self, lo: int, hi: int) -> int:
        """Points in rows ``lo..hi`` (within the piece)."""
        n = hi - lo + 1
        if n <= 0:
            return 0
        (p, q, r), (pl, ql, rl) = self.upper, self.lower
        return floor_sum(n, r, p, p * lo + q) + floor_sum(n, rl, -pl, -pl * lo - ql) + n

    def first(self) -> int | None:
        """The first row with points."""
        if self.count(self.lo, self.lo):
            return self.lo
        if not self.count(self.lo, self.hi):
            return None
        lo, hi = self.lo, self.hi
        while lo < hi:  # the count of rows lo..mid grows with mid
            mid = (lo + hi) // 2
            if self.count(self.lo, mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def last(self) -> int | None:
        """The last row with points."""
        if self.count(self.hi, self.hi):
            return self.hi
        if not self.count(self.lo, self.hi):
            return None
        lo, hi = self.lo, self.hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.count(mid, self.hi):
                lo = mid
            else:
                hi = mid - 1
        return lo


def _solve(cons: Sequence[Ineq], u: Range, w: Range) -> _Chain | list[_Piece] | None:
    """The points as a chain (when there is an equality) or as pieces of rows; None if empty."""
    if u[0] >= u[1] or w[0] >= w[1]:
        return None
    eq = next((c for c in cons if c[3] and (c[0] or c[1])), None)
    if eq is not None:
        return _chain(cons, eq, u, w)
    if any(c[3] and c[2] for c in cons):  # 0 == c with c != 0
        return None
    return _pieces(cons, u, w)


def _chain(cons: Sequence[Ineq], eq: Ineq, u: Range, w: Range) -> _Chain | None:
    a, b, c, _ = eq
    g, x, y = ext_gcd(a, b)
    if c % g:
        return None
    u0, w0, du, dw = -c // g * x, -c // g * y, b // g, -a // g
    terms = [(a2 * du + b2 * dw, a2 * u0 + b2 * w0 + c2, e2) for a2, b2, c2, e2 in cons]
    terms += [(du, u0 - u[0], False), (-du, u[1] - 1 - u0, False)]
    terms += [(dw, w0 - w[0], False), (-dw, w[1] - 1 - w0, False)]
    span = interval(terms, None, None)
    return None if span is None else _Chain(u0, w0, du, dw, *span)


def _value(line: _Line, twice: int) -> Fraction:
    """The line's value at ``twice / 2``."""
    p, q, r = line
    return Fraction(p * twice + 2 * q, 2 * r)


def _pieces(cons: Sequence[Ineq], u: Range, w: Range) -> list[_Piece] | None:
    lowers: list[_Line] = [(0, w[0], 1)]
    uppers: list[_Line] = [(0, w[1] - 1, 1)]
    rows: list[tuple[int, int, bool]] = []  # constraints on u alone
    for a, b, c, _ in cons:
        if b == 0:
            rows.append((a, c, False))
        elif b > 0:
            lowers.append((-a, -c, b))
        else:
            uppers.append((a, c, -b))
    lowers, uppers = list(dict.fromkeys(lowers)), list(dict.fromkeys(uppers))
    for (pl, ql, rl), (pu, qu, ru) in itertools.product(lowers, uppers):
        rows.append((pu * rl - pl * ru, qu * rl - ql * ru, False))  # upper(u) >= lower(u)
    span = interval(rows, u[0], u[1] - 1)
    if span is None:
        return None
    lo, hi = span
    cuts: set[int] = set()
    for lines in (lowers, uppers):
        for (p1, q1, r1), (p2, q2, r2) in itertools.combinations(lines, 2):
            slope = p1 * r2 - p2 * r1
            if slope:
                x = (q2 * r1 - q1 * r2) // slope  # floor of the crossing
                if lo <= x < hi:
                    cuts.add(x)
    pieces: list[_Piece] = []
    start = lo
    for end in [*sorted(cuts), hi]:
        # No crossing lies strictly inside [start, end]: one line is extreme over all of it.
        lower = max(lowers, key=lambda line: _value(line, start + end))
        upper = min(uppers, key=lambda line: _value(line, start + end))
        if pieces and (pieces[-1].lower, pieces[-1].upper) == (lower, upper):
            pieces[-1] = _Piece(pieces[-1].lo, end, lower, upper)
        else:
            pieces.append(_Piece(start, end, lower, upper))
        start = end + 1
    return pieces


def count_points(cons: Sequence[Ineq], u: Range, w: Range) -> int:
    """The number of integer points ``(u, w)`` in the ranges that satisfy every constraint."""
    found = _solve(cons, u, w)
    if found is None:
        return 0
    if isinstance(found, _Chain):
        return found.hi - found.lo + 1
    return sum(p.count(p.lo, p.hi) for p in found)


def bounding_box(cons: Sequence[Ineq], u: Range, w: Range) -> tuple[Range, Range] | None:
    """The least ranges (half-open) holding every point, or None when there is none."""
    return count_and_box(cons, u, w)[1]


def count_and_box(cons: Sequence[Ineq], u: Range, w: Range) -> tuple[int, tuple[Range, Range] | None]:
    """:func:`count_points` and :func:`bounding_box` at once."""
    found = _solve(cons, u, w)
    if found is None:
        return 0, None
    if isinstance(found, _Chain):
        return found.hi - found.lo + 1, found.hull()
    count = sum(p.count(p.lo, p.hi) for p in found)
    if not count:
        return 0, None
    u_range = _rows_with_points(found)
    swapped = _solve([(b, a, c, eq) for a, b, c, eq in cons], w, u)
    assert u_range is not None and isinstance(swapped, list)
    w_range = _rows_with_points(swapped)
    assert w_range is not None
    return count, (u_range, w_range)


def _rows_with_points(pieces: list[_Piece]) -> Range | None:
    first = next((r for r in (p.first() for p in pieces) if r is not None), None)
    if first is None:
        return None
    last = next(r for r in (p.last() for p in reversed(pieces)) if r is not None)
    return first, last + 1
