"""Guards and supports: every symbolic operation checked against brute-force enumeration."""

from __future__ import annotations

import contextlib
import itertools
import math
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edatalog.ir import affine
from edatalog.ir.affine import Affine, Constraint, Guard
from tests.strategies import example_settings

VARS = ("i", "j", "k")


def _points(box: dict[str, int]) -> list[dict[str, int]]:
    names = sorted(box)
    return [dict(zip(names, p, strict=True)) for p in itertools.product(*(range(box[v]) for v in names))]


def _holds(g: Guard, p: dict[str, int]) -> bool:
    return any(all(bool(c.holds(p)) for c in conj.constraints) for conj in g.conjs)


@st.composite
def guards(draw: st.DrawFn) -> tuple[Guard, dict[str, int]]:
    box = {v: draw(st.integers(1, 5)) for v in VARS}
    conjs = []
    for _ in range(draw(st.integers(0, 3))):
        cons = []
        for _ in range(draw(st.integers(0, 3))):
            coefs = {v: draw(st.integers(-2, 2)) for v in draw(st.sets(st.sampled_from(VARS), min_size=1, max_size=2))}
            cons.append(Constraint(Affine.of(coefs, draw(st.integers(-4, 4))), eq=draw(st.booleans())))
        conjs.append(Guard.of(cons))
    g = Guard.false()
    for c in conjs:
        g = g | c
    return g, box


@settings(max_examples=300, deadline=None, derandomize=True)
@given(guards())
def test_count_mask_and_simplify_agree_with_enumeration(case: tuple[Guard, dict[str, int]]) -> None:
    g, box = case
    inside = [p for p in _points(box) if _holds(g, p)]
    assert g.count(box) == len(inside)
    order = list(VARS)
    mask = np.broadcast_to(g.mask(order, box), tuple(box[v] for v in order))
    assert int(mask.sum()) == len(inside)
    for p in inside:
        assert mask[tuple(p[v] for v in order)]
    simple = g.simplify(box)
    assert [p for p in _points(box) if _holds(simple, p)] == inside


@settings(max_examples=300, deadline=None, derandomize=True)
@given(guards(), st.sets(st.sampled_from(VARS), max_size=2))
def test_projection_is_the_shadow(case: tuple[Guard, dict[str, int]], keep: set[str]) -> None:
    g, box = case
    shadow, exact = g.project(keep, box)
    sub = {v: box[v] for v in keep}
    truth = {tuple(p[v] for v in sorted(keep)) for p in _points(box) if _holds(g, p)}
    got = {tuple(p[v] for v in sorted(keep)) for p in _points(sub) if _holds(shadow, p)}
    assert truth <= got  # always sound
    if exact:
        assert truth == got


def test_complementary_pieces_merge() -> None:
    i = Affine.var("i")
    g = Guard.of([Constraint(-i + 3)]) | Guard.of([Constraint(i - 4)])
    assert g.simplify({"i": 8}).is_true


def test_constraints_print_readably() -> None:
    s, t = Affine.var("s"), Affine.var("t")
    assert str(Constraint(s - t)) == "t <= s"
    assert str(Constraint(s - t - 1)) == "t + 1 <= s"
    assert str(Constraint(s - 3)) == "s >= 3"
    assert str(Constraint(-s + 2)) == "s <= 2"
    assert str(Constraint(s - t, eq=True)) == "t == s"


def test_causal_count_is_exact_at_llama_scale() -> None:
    s, t = Affine.var("s"), Affine.var("t")
    n = 2048
    assert Guard.of([Constraint(s - t)]).count({"s": n, "t": n, "h": 32}) == 32 * n * (n + 1) // 2


def test_disjoint_pieces_count_fast_and_exactly() -> None:
    # Five `!=` guards make 32 disjoint pieces: inclusion-exclusion must prune, not try 2^32 subsets.
    names = ("a", "b", "c", "d", "e")
    g = Guard.true()
    for v in names:
        x = Affine.var(v)
        g = g & (Guard.of([Constraint(x - 2)]) | Guard.of([Constraint(-x)]))
    box = dict.fromkeys(names, 3000)  # too large to enumerate point by point
    assert g.count(box) == 2999**5  # every variable avoids 1


def test_count_bound_falls_back_to_the_box() -> None:
    i, j, k, m = Affine.var("i"), Affine.var("j"), Affine.var("k"), Affine.var("m")
    g = Guard.of([Constraint(-(i + j + k + m) + 4000)])  # one group of four variables
    box = {"i": 4096, "j": 4096, "k": 4096, "m": 4096}
    count, exact = g.count_bound(box)
    assert (count, exact) == (4096**4, False)


def test_three_variables_count_pairs_in_closed_form() -> None:
    i, j, k = Affine.var("i"), Affine.var("j"), Affine.var("k")
    g = Guard.of([Constraint(-(i + j + k) + 4000)])
    assert g.count_bound({"i": 4096, "j": 4096, "k": 4096}) == (math.comb(4003, 3), True)


def test_covering_union_is_true() -> None:
    i = Affine.var("i")
    g = Guard.of([Constraint(i - 1, eq=True)]) | Guard.of([Constraint(i - 2)]) | Guard.of([Constraint(-i)])
    assert g.simplify({"i": 6}).is_true


# -- closed-form counting ------------------------------------------------------------------------

_SETTINGS = example_settings("EDL_AFFINE_EXAMPLES", 200)


@st.composite
def wide_guards(draw: st.DrawFn) -> tuple[Guard, dict[str, int]]:
    """Unions of up to three conjunctions over one to three variables, with coefficients in
    [-3, 3] (equalities too), constants in [-10, 10] and extents up to 12."""
    names = draw(st.sets(st.sampled_from(VARS), min_size=1, max_size=3))
    box = {v: draw(st.integers(1, 12)) for v in VARS}
    g = Guard.false()
    for _ in range(draw(st.integers(1, 3))):
        cons = []
        for _ in range(draw(st.integers(0, 4))):
            used = draw(st.sets(st.sampled_from(sorted(names)), min_size=1, max_size=3))
            coefs = {v: draw(st.integers(-3, 3)) for v in sorted(used)}
            cons.append(Constraint(Affine.of(coefs, draw(st.integers(-10, 10))), eq=draw(st.integers(0, 4)) == 0))
        g = g | Guard.of(cons)
    return g, box


@pytest.mark.parametrize("path", ["mask", "closed", "pairs"])
@_SETTINGS
@given(wide_guards())
def test_closed_form_counts_agree_with_enumeration(path: str, case: tuple[Guard, dict[str, int]]) -> None:
    """Every way of counting, forced even on small boxes: looking at each point, the closed
    forms (groups of three enumerate rows), and groups of three enumerating pairs."""
    g, box = case
    want = sum(1 for p in _points(box) if _holds(g, p))
    limits = {"mask": {}, "closed": {"_MASK_LIMIT": 0}, "pairs": {"_MASK_LIMIT": 0, "_ROWS_LIMIT": 0}}[path]
    with contextlib.ExitStack() as stack:
        for name, value in limits.items():
            stack.enter_context(mock.patch.object(affine, name, value))
        assert g.count(box) == want
        assert g.count_bound(box) == (want, True)


def test_causal_count_at_a_trillion() -> None:
    s, t = Affine.var("s"), Affine.var("t")
    n = 10**12
    assert Guard.of([Constraint(s - t)]).count({"s": n, "t": n, "h": 32}) == 32 * n * (n + 1) // 2
    assert Guard.of([Constraint(s - t)]).count_bound({"s": 2**63 - 1, "t": 2**63 - 1}) == (
        (2**63 - 1) * 2**63 // 2,
        True,
    )
    # Unions: disjoint (everything but t == s + 1), and overlapping (inclusion-exclusion).
    gap = Guard.of([Constraint(s - t)]) | Guard.of([Constraint(t - s - 2)])
    assert gap.count({"s": n, "t": n}) == n * n - (n - 1)
    low = Guard.of([Constraint(s - t)]) | Guard.of([Constraint(-t + 5)])
    assert low.count({"s": n, "t": n}) == n * (n + 1) // 2 + sum(range(1, 6))


def test_band_and_window_counts_at_a_billion() -> None:
    t, u, ell, k = Affine.var("t"), Affine.var("u"), Affine.var("l"), Affine.var("k")
    big = 10**9
    band = Guard.of([Constraint(u - t), Constraint(t + 2 - u)])  # t <= u <= t + 2
    assert band.count({"t": big, "u": big}) == 3 * big - 3
    kk = 10**6
    window = Guard.of([Constraint(ell + k), Constraint(-(ell + k) + (big - 1))])  # 0 <= l + k <= T - 1
    assert window.count({"l": big - kk + 1, "k": kk}) == (big - kk + 1) * kk
    assert window.count({"l": big, "k": kk}) == kk * big - kk * (kk - 1) // 2


def test_lattice_equalities_at_a_trillion() -> None:
    i, j = Affine.var("i"), Affine.var("j")
    n = 10**12
    odd = Guard.of([Constraint(i.scale(2) - j - 1, eq=True)])  # 2*i == j + 1: j odd
    assert odd.count({"i": n, "j": n}) == n // 2
    assert Guard.of([Constraint(i.scale(3) - j.scale(3) - 1, eq=True)]).count({"i": n, "j": n}) == 0


def test_three_variable_group_at_a_trillion() -> None:
    """``t <= s <= t + h`` with ``h < 4``: four pairs counted in closed form."""
    s, t, h = Affine.var("s"), Affine.var("t"), Affine.var("h")
    n = 10**12
    g = Guard.of([Constraint(s - t), Constraint(t + h - s)])
    assert g.count({"s": n, "t": n, "h": 4}) == sum(n - d for width in range(4) for d in range(width + 1))


def test_three_variable_rows_sum_past_int64() -> None:
    """``k >= i + j`` with ``k < 2**62`` over 64 rows: their sum overflows int64."""
    i, j, k = Affine.var("i"), Affine.var("j"), Affine.var("k")
    g = Guard.of([Constraint(k - i - j)])
    want = sum(2**62 - (a + b) for a in range(8) for b in range(8))
    assert want > 2**63
    assert g.count({"i": 8, "j": 8, "k": 2**62}) == want
    # 2*k == i + j + 2**62: a non-unit equality with constants beyond int64 products.
    half = Guard.of([Constraint(k.scale(2) - i - j - 2**62, eq=True)])
    assert half.count({"i": 8, "j": 8, "k": 2**62}) == sum(1 for a in range(8) for b in range(8) if (a + b) % 2 == 0)
