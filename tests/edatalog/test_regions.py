"""Regions (``edatalog.ir.regions``) and interval sets (``edatalog.ir.intervals``) against a
brute-force model: plain Python sets of coordinates and of cells, over small extents.  Then the
point of intervals: the same operations at extents of 10^12, where any coordinate array would
not fit in memory, so a test that finishes shows the cost does not grow with the extents."""

from __future__ import annotations

import itertools
import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from edatalog.ir import intervals as iv
from edatalog.ir.affine import Affine
from edatalog.ir.graph import AxisMap, Part
from edatalog.ir.intervals import Ivs
from edatalog.ir.regions import Region, through
from tests.strategies import example_settings

_coords = st.one_of(
    st.tuples(st.integers(0, 40), st.integers(0, 40)).map(lambda r: set(range(min(r), max(r)))),
    st.sets(st.integers(0, 40), max_size=12),
)


def _ivs(coords: set[int]) -> Ivs:
    return iv.merge((c, c + 1) for c in coords)


def _set(a: Ivs) -> set[int]:
    return {c for lo, hi in a for c in range(lo, hi)}


def _region(axes: list[set[int]]) -> Region:
    return Region(tuple(_ivs(a) for a in axes))


def _cells(r: Region) -> set[tuple[int, ...]]:
    return set(itertools.product(*(sorted(_set(a)) for a in r.axes)))


def _normalized(a: Ivs) -> bool:
    return all(lo < hi for lo, hi in a) and all(p[1] < q[0] for p, q in itertools.pairwise(a))


@example_settings("EDL_REGION_EXAMPLES", 200)
@given(a=_coords, b=_coords, parts=st.integers(1, 5))
def test_interval_sets_agree_with_sets(a: set[int], b: set[int], parts: int) -> None:
    x, y = _ivs(a), _ivs(b)
    for got, want in ((iv.meet(x, y), a & b), (iv.minus(x, y), a - b), (iv.merge([*x, *y]), a | b)):
        assert _normalized(got) and _set(got) == want
    assert iv.size(x) == len(a) and iv.meet_size(x, y) == len(a & b)
    assert iv.subset(x, y) == (a <= b)
    assert _set(iv.clip(x, 5, 20)) == {c for c in a if 5 <= c < 20}
    # Splits cut the coordinates as numpy's array_split does (the backend and the solver agree).
    chunks = np.array_split(np.array(sorted(a), dtype=np.int64), min(parts, len(a))) if a else []
    assert [_set(p) for p in iv.split(x, parts)] == [set(c.tolist()) for c in chunks]
    # Positions of a subset inside the data of a set laid out in ascending order.
    sub = a & b
    order = sorted(a)
    assert _set(iv.positions(_ivs(sub), x)) == {order.index(c) for c in sub}


@example_settings("EDL_REGION_EXAMPLES", 100)
@given(sets=st.lists(_coords, min_size=1, max_size=5))
def test_atoms_partition_the_union_by_membership(sets: list[set[int]]) -> None:
    found = iv.atoms([_ivs(s) for s in sets])
    union = set().union(*sets)
    assert sorted(c for atom, _ in found for c in _set(atom)) == sorted(union)
    memberships = [members for _, members in found]
    assert len(set(memberships)) == len(memberships)  # one atom per distinct membership
    for atom, members in found:
        for c in _set(atom):
            assert members == tuple(k for k, s in enumerate(sets) if c in s)


@example_settings("EDL_REGION_EXAMPLES", 200)
@given(a=st.lists(_coords, min_size=1, max_size=3), b=st.lists(_coords, min_size=1, max_size=3))
def test_region_operations_agree_with_cell_sets(a: list[set[int]], b: list[set[int]]) -> None:
    rank = min(len(a), len(b))
    x, y = _region(a[:rank]), _region(b[:rank])
    cx, cy = _cells(x), _cells(y)
    assert x.size == len(cx) and x.empty == (not cx)
    meet = x.intersect(y)
    assert _cells(meet) == cx & cy
    assert x.contains(meet) and y.contains(meet)
    assert x.contains(y) == (cy <= cx)
    rest = x.minus(y)
    pieces = [_cells(r) for r in rest]
    assert all(p for p in pieces) and sum(len(p) for p in pieces) == len(cx - cy)  # disjoint, no empties
    assert set().union(*pieces) == cx - cy
    assert (x == y) == all(_set(p) == _set(q) for p, q in zip(x.axes, y.axes, strict=True))
    assert hash(x.intersect(y)) == hash(y.intersect(x))


@example_settings("EDL_REGION_EXAMPLES", 150)
@given(a=st.lists(_coords, min_size=1, max_size=3), b=st.lists(_coords, min_size=1, max_size=3))
def test_cut_and_at_move_exactly_the_cells_asked_for(a: list[set[int]], b: list[set[int]]) -> None:
    """Data laid out as a region (ascending coordinates per axis): cutting a sub-region gives the
    sub-region's cells in its own layout, and ``at`` writes them back where they were."""
    rank = min(len(a), len(b))
    outer = _region(a[:rank])
    sub = outer.intersect(_region(b[:rank]))
    coords = [sorted(_set(ax)) for ax in outer.axes]
    # Each cell holds a number naming its coordinates, so any misplaced cell shows.
    data = np.zeros(outer.shape, dtype=np.int64)
    for pos in itertools.product(*(range(len(c)) for c in coords)):
        data[pos] = sum(coords[k][p] * 100**k for k, p in enumerate(pos))
    got = outer.cut(data, sub)
    assert got.shape == sub.shape
    sub_coords = [sorted(_set(ax)) for ax in sub.axes]
    for pos in itertools.product(*(range(len(c)) for c in sub_coords)):
        assert got[pos] == sum(sub_coords[k][p] * 100**k for k, p in enumerate(pos))
    back = np.full(outer.shape, -1, dtype=np.int64)
    back[sub.at(outer)] = got
    assert np.count_nonzero(back >= 0) == sub.size
    assert np.array_equal(back[back >= 0], data[back >= 0])


def _brute_through(axes: tuple[AxisMap, ...], ranges: dict[str, tuple[int, int]]) -> list[set[int]]:
    """Per axis: every row-major composition of the places each part reaches (inside the part)."""
    out = []
    for ax in axes:
        per_part = []
        for p in ax.parts:
            names = p.indices
            places = set()
            for values in itertools.product(*(range(*ranges[v]) for v in names)):
                place = int(p.expr.evaluate(dict(zip(names, values, strict=True))))
                if 0 <= place < p.extent:
                    places.add(place)
            per_part.append(sorted(places))
        coords = set()
        for combo in itertools.product(*per_part):
            c = 0
            for place, p in zip(combo, ax.parts, strict=True):
                c = c * p.extent + place
            coords.add(c)
        out.append(coords)
    return out


_offsets = st.integers(-3, 3)


@st.composite
def _accesses(draw: st.DrawFn) -> tuple[tuple[AxisMap, ...], dict[str, tuple[int, int]]]:
    """Accesses of up to two axes, each of up to three parts: a plain index, a fixed place, or a
    sum of an index, maybe another and an offset (``l + k``, ``t - 1``); and index ranges."""
    extents = {v: draw(st.integers(1, 6)) for v in "hekl"}
    ranges = {}
    for v, n in extents.items():
        lo = draw(st.integers(0, n - 1))
        ranges[v] = (lo, draw(st.integers(lo + 1, n)))
    axes = []
    for _ in range(draw(st.integers(1, 2))):
        parts = []
        for _ in range(draw(st.integers(1, 3))):
            kind = draw(st.sampled_from(["index", "fixed", "sum"]))
            v = draw(st.sampled_from("hekl"))
            if kind == "index":
                parts.append(Part.of_index(v, extents[v]))
            elif kind == "fixed":
                n = draw(st.integers(1, 4))
                parts.append(Part.fixed(draw(st.integers(0, n - 1)), n))
            else:
                w = draw(st.sampled_from("hekl"))
                expr = Affine.var(v) + (Affine.var(w) if w != v and draw(st.booleans()) else Affine()) + draw(_offsets)
                parts.append(Part(expr, draw(st.integers(1, 8))))
        axes.append(AxisMap(tuple(parts)))
    return tuple(axes), ranges


@example_settings("EDL_REGION_EXAMPLES", 200)
@given(access=_accesses())
def test_through_is_the_row_major_composition_of_the_places(
    access: tuple[tuple[AxisMap, ...], dict[str, tuple[int, int]]],
) -> None:
    """Exactly the coordinates the parts reach, and as many as the product of the parts' places:
    the block layout :func:`edatalog.ir.rewrite.restrict` gives (per part ``Part.places``)."""
    axes, ranges = access
    box = through(axes, ranges)
    for got, want, ax in zip(box, _brute_through(axes, ranges), axes, strict=True):
        assert _normalized(got) and _set(got) == want
        assert iv.size(got) == math.prod(max(0, hi - lo) for lo, hi in (p.places(ranges) for p in ax.parts))
    assert Region.through(axes, ranges).axes == box


def test_composite_accesses_are_strided_sets() -> None:
    """``wq[(h, e), d]`` with E = 4, heads 1..2 and e cut at 1..3: two runs, one per head."""
    axis = AxisMap((Part.of_index("h", 3), Part.of_index("e", 4)))
    (got,) = through((axis,), {"h": (1, 3), "e": (1, 3)})
    assert got == ((5, 7), (9, 11))
    (whole,) = through((axis,), {"h": (1, 3), "e": (0, 4)})
    assert whole == ((4, 12),)
    assert str(Region((got, ((0, 1), (3, 4))))) == "[{5:7,9:11}, {0,3}]"


def test_halo_of_an_index_expression() -> None:
    """``x[l + k]`` over a block ``l`` in 4..8 with K = 3 reads 4 .. 8 + 3 - 2; clipped at the end."""
    axis = AxisMap((Part(Affine.var("l") + Affine.var("k"), 10),))
    assert through((axis,), {"l": (4, 8), "k": (0, 3)}) == (((4, 10),),)
    assert through((axis,), {"l": (6, 10), "k": (0, 3)}) == (((6, 10),),)
    shifted = AxisMap((Part(Affine.var("t") - 1, 10),))
    assert through((shifted,), {"t": (0, 5)}) == (((0, 4),),)  # t = 0 reads nothing


def test_operations_cost_nothing_like_the_extents() -> None:
    """Regions of 10^12 cells per axis: every operation is arithmetic on a few runs (an array of
    coordinates here would need terabytes), and moving data costs only the cells moved."""
    big = 10**12
    zig = Region((((0, big // 4), (3 * big // 4, big)), ((0, big),)))
    block = Region.of_box((big, big), ((big // 8, big // 2), (0, big // 2)))
    meet = zig.intersect(block)
    assert meet.axes == (((big // 8, big // 4),), ((0, big // 2),))
    assert meet.size == (big // 8) * (big // 2)
    rest = zig.minus(block)
    assert sum(r.size for r in rest) == zig.size - meet.size
    pieces = zig.split(8, axis=0)
    assert len(pieces) == 8 and sum(p.size for p in pieces) == zig.size
    assert [p.shape[0] for p in pieces] == [big // 16] * 8
    assert Region.whole((big, big)).contains(zig) and not block.contains(zig)
    assert iv.atoms([zig.axes[0], block.axes[0]])[1] == (((big // 8, big // 4),), (0, 1))
    # A few cells of a huge region: positions are arithmetic, the copy is four cells.
    tiny = Region((((big - 2, big),), ((5, 7),)))
    assert tiny.positions_in(zig) == (((big // 2 - 2, big // 2),), ((5, 7),))
    axis = AxisMap((Part(Affine.var("l") + Affine.var("k"), big),))
    assert through((axis,), {"l": (big // 2, big), "k": (0, 4)}) == (((big // 2, big),),)
