"""Regions (``edatalog.ir.regions``) against plain set arithmetic: intersections take a fast path
when both sides are one run of coordinates, and must agree with the general one."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from edatalog.ir.regions import Region

_coords = st.one_of(
    st.tuples(st.integers(0, 40), st.integers(0, 40)).map(lambda r: np.arange(min(r), max(r), dtype=np.int64)),
    st.sets(st.integers(0, 40), max_size=12).map(lambda s: np.array(sorted(s), dtype=np.int64)),
)


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(a=st.lists(_coords, min_size=1, max_size=3), b=st.lists(_coords, min_size=1, max_size=3))
def test_intersect_and_minus_agree_with_sets(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    rank = min(len(a), len(b))
    x, y = Region(tuple(a[:rank])), Region(tuple(b[:rank]))
    meet = x.intersect(y)
    for got, p, q in zip(meet.axes, x.axes, y.axes, strict=True):
        assert got.dtype == np.int64
        assert list(got) == sorted(set(p.tolist()) & set(q.tolist()))
    theirs = set(_cells(y))
    cells = {c for c in _cells(x) if c not in theirs}
    rest = x.minus(y)
    assert sorted(c for r in rest for c in _cells(r)) == sorted(cells)


def _cells(r: Region) -> list[tuple[int, ...]]:
    return list(itertools.product(*(a.tolist() for a in r.axes)))
