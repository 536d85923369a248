"""Guards and supports: every symbolic operation checked against brute-force enumeration."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from edatalog.ir.affine import Affine, Constraint, Guard

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
    i, j, k = Affine.var("i"), Affine.var("j"), Affine.var("k")
    g = Guard.of([Constraint(-(i + j + k) + 4000)])
    box = {"i": 4096, "j": 4096, "k": 4096}
    count, exact = g.count_bound(box)
    assert (count, exact) == (4096**3, False)


def test_covering_union_is_true() -> None:
    i = Affine.var("i")
    g = Guard.of([Constraint(i - 1, eq=True)]) | Guard.of([Constraint(i - 2)]) | Guard.of([Constraint(-i)])
    assert g.simplify({"i": 6}).is_true
