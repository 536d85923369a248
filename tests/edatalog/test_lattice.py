"""Closed-form lattice-point counting (edatalog.ir.lattice) against brute force, and at extents
that no enumeration could reach."""

from __future__ import annotations

import itertools

from hypothesis import example, given
from hypothesis import strategies as st

from edatalog.ir import lattice
from edatalog.ir.lattice import Ineq, Range
from tests.strategies import example_settings

_SETTINGS = example_settings("EDL_LATTICE_EXAMPLES", 300)


@_SETTINGS
@given(st.integers(0, 40), st.integers(1, 25), st.integers(-60, 60), st.integers(-60, 60))
def test_floor_sum_is_the_sum(n: int, m: int, a: int, b: int) -> None:
    assert lattice.floor_sum(n, m, a, b) == sum((a * i + b) // m for i in range(n))


@_SETTINGS
@given(st.integers(-50, 50), st.integers(-50, 50))
def test_extended_gcd(a: int, b: int) -> None:
    g, x, y = lattice.ext_gcd(a, b)
    assert g >= 0 and a * x + b * y == g
    assert all(v % g == 0 for v in (a, b)) if g else a == b == 0


@st.composite
def polygons(draw: st.DrawFn) -> tuple[list[Ineq], Range, Range]:
    """Ranges of up to 12 values, and up to four constraints with coefficients in [-3, 3] and
    constants in [-10, 10], many through a point of the ranges (so that their lines cross inside)
    and some paired with a nearly opposite one: narrow bands, whose rows often hold no point."""
    ranges = []
    for _ in range(2):
        lo = draw(st.integers(-5, 5))
        ranges.append((lo, lo + draw(st.integers(0, 12))))
    x, y = (draw(st.integers(lo, max(lo, hi - 1))) for lo, hi in ranges)
    cons: list[Ineq] = []
    for _ in range(draw(st.integers(0, 4))):
        a, b, eq = draw(st.integers(-3, 3)), draw(st.integers(-3, 3)), draw(st.integers(0, 4)) == 0
        c = draw(st.integers(-10, 10))
        if draw(st.integers(0, 3)):  # through (x, y), or a little beside
            c = max(-10, min(10, (0 if eq else draw(st.integers(0, 3))) - a * x - b * y))
        cons.append((a, b, c, eq))
        if draw(st.booleans()):
            cons.append((-a, -b, max(-10, min(10, -c + draw(st.integers(0, 3)))), False))
    return cons, ranges[0], ranges[1]


@_SETTINGS
@given(polygons())
# 0 <= u - 3*w <= 1: rows u = 2 and u = 11 hold no point (the first and last the ranges allow),
# and the same with the roles of u and w swapped.
@example(([(1, -3, 0, False), (-1, 3, 1, False)], (2, 12), (0, 12)))
@example(([(-3, 1, 0, False), (3, -1, 1, False)], (0, 12), (2, 12)))
def test_count_and_box_agree_with_enumeration(case: tuple[list[Ineq], Range, Range]) -> None:
    cons, u, w = case
    points = [
        (x, y)
        for x, y in itertools.product(range(*u), range(*w))
        if all(a * x + b * y + c == 0 if eq else a * x + b * y + c >= 0 for a, b, c, eq in cons)
    ]
    assert lattice.count_points(cons, u, w) == len(points)
    box = lattice.bounding_box(cons, u, w)
    if not points:
        assert box is None
    else:
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        assert box == ((min(xs), max(xs) + 1), (min(ys), max(ys) + 1))


def test_causal_triangle_at_a_trillion() -> None:
    n = 10**12
    causal: list[Ineq] = [(1, -1, 0, False)]  # u - w >= 0
    assert lattice.count_points(causal, (0, n), (0, n)) == n * (n + 1) // 2
    assert lattice.bounding_box(causal, (0, n), (n // 2, n)) == ((n // 2, n), (n // 2, n))


def test_sparse_rows_at_the_edge_are_found() -> None:
    """``3*w <= u <= 3*w`` only holds on every third row: the box starts at the first of them."""
    n = 2**62
    band: list[Ineq] = [(1, -3, 0, False), (-1, 3, 0, False)]
    assert lattice.count_points(band, (1, n), (0, n)) == (n - 1) // 3
    assert lattice.bounding_box(band, (1, n), (0, n)) == ((3, (n - 1) // 3 * 3 + 1), (1, (n - 1) // 3 + 1))
    # A slowly widening wedge, 7*w in [5*u, 5*u + 3]: rows whose interval holds no integer.
    wedge: list[Ineq] = [(-5, 7, 0, False), (5, -7, 3, False)]
    big = 10**15
    want = sum(1 for x in range(700) for y in range(700) if 5 * x <= 7 * y <= 5 * x + 3)
    assert lattice.count_points(wedge, (0, 700), (0, 700)) == want
    rows = [x for x in range(big, big + 700) if (5 * x + 3) // 7 >= -(-5 * x // 7)]  # at most one w each
    assert lattice.count_points(wedge, (big, big + 700), (0, 2 * big)) == len(rows)
    box = lattice.bounding_box(wedge, (big, big + 700), (0, 2 * big))
    assert box == ((rows[0], rows[-1] + 1), (-(-5 * rows[0] // 7), (5 * rows[-1] + 3) // 7 + 1))


def test_equalities_leave_a_chain() -> None:
    n = 10**12
    odd: list[Ineq] = [(2, -1, -1, True)]  # 2*u == w + 1
    assert lattice.count_points(odd, (0, n), (0, n)) == n // 2
    assert lattice.bounding_box(odd, (0, n), (0, n)) == ((1, n // 2 + 1), (1, n))
    assert lattice.count_points([(2, -2, -1, True)], (0, n), (0, n)) == 0  # 2u - 2w == 1
