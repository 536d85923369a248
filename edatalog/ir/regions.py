"""Regions of relations: for each axis, the sorted set of coordinates a region covers.

A region is a product of per-axis coordinate sets.  A block of a join space reads, through an
access such as ``wq[(h,e),d]``, the coordinates ``h*E + e`` for its ranges of ``h`` and ``e`` (a
strided set when ``e`` is split), so sets rather than intervals keep every need exact.
Intersections are per axis; the data of a region is always in ascending coordinate order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from edatalog.ir.graph import AxisMap


@dataclass(frozen=True, eq=False)
class Region:
    axes: tuple[np.ndarray, ...]  # sorted, unique int64 coordinates per axis

    @staticmethod
    def whole(shape: tuple[int, ...]) -> Region:
        return Region(tuple(np.arange(n, dtype=np.int64) for n in shape))

    @staticmethod
    def of_box(shape: tuple[int, ...], ranges: tuple[tuple[int, int], ...]) -> Region:
        return Region(tuple(np.arange(lo, hi, dtype=np.int64) for lo, hi in ranges))

    @staticmethod
    def through(axes: tuple[AxisMap, ...], ranges: Mapping[str, tuple[int, int]]) -> Region:
        """The coordinates an access reaches when its indices run over ``ranges``."""
        out = []
        for ax in axes:
            coords = np.zeros(1, dtype=np.int64)
            stride = 1
            for p in reversed(ax.parts):
                if p.index is None:
                    part = np.array([(p.const or 0) * stride], dtype=np.int64)
                else:
                    lo, hi = ranges[p.index]
                    part = np.arange(lo, hi, dtype=np.int64) * stride
                coords = (part[:, None] + coords[None, :]).ravel()
                stride *= p.extent
            out.append(coords if _increasing(coords) else np.unique(coords))
        return Region(tuple(out))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(len(a) for a in self.axes)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def empty(self) -> bool:
        return self.size == 0

    def intersect(self, other: Region) -> Region:
        return Region(tuple(_meet(a, b) for a, b in zip(self.axes, other.axes, strict=True)))

    def contains(self, other: Region) -> bool:
        return all(_subset(b, a) for a, b in zip(self.axes, other.axes, strict=True))

    def minus(self, other: Region) -> list[Region]:
        """The cells of this region that ``other`` lacks, as disjoint regions (at most one per
        axis): those outside ``other`` on axis ``k`` and inside it on every axis before ``k``."""
        inside = [_meet(a, b) for a, b in zip(self.axes, other.axes, strict=True)]
        if any(len(c) == 0 for c in inside):
            return [] if self.empty else [self]
        out = []
        for k, (a, b) in enumerate(zip(self.axes, other.axes, strict=True)):
            rest = np.setdiff1d(a, b, assume_unique=True)
            if len(rest):
                out.append(Region((*inside[:k], rest, *self.axes[k + 1 :])))
        return out

    def key(self) -> bytes:
        """A hashable identity of the covered cells."""
        return b"|".join(a.tobytes() for a in self.axes) + b"#" + bytes(len(self.axes))

    def same(self, other: Region) -> bool:
        return all(np.array_equal(a, b) for a, b in zip(self.axes, other.axes, strict=True))

    def positions_in(self, outer: Region) -> tuple[np.ndarray, ...]:
        """Where this region's coordinates sit inside ``outer``'s data (``self`` within ``outer``)."""
        return tuple(np.searchsorted(o, a) for o, a in zip(outer.axes, self.axes, strict=True))

    def cut(self, data: np.ndarray, sub: Region) -> np.ndarray:
        """The part of ``data`` (laid out as this region) covering ``sub``, as a new array."""
        if not self.axes:
            return data.copy()
        return data[np.ix_(*sub.positions_in(self))]

    def __str__(self) -> str:
        parts = []
        for a in self.axes:
            if len(a) == 0:
                parts.append("{}")
            elif a[-1] - a[0] + 1 == len(a):
                parts.append(f"{a[0]}:{a[-1] + 1}")
            else:
                parts.append(f"{len(a)} of {a[0]}..{a[-1]}")
        return "[" + ", ".join(parts) + "]"


def _increasing(coords: np.ndarray) -> bool:
    return len(coords) < 2 or bool((coords[1:] > coords[:-1]).all())


def _dense(a: np.ndarray) -> bool:
    """Whether sorted unique coordinates form one run ``lo .. hi-1``."""
    return len(a) > 0 and int(a[-1]) - int(a[0]) + 1 == len(a)


def _meet(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The coordinates in both (sorted, unique); a slice of ``a`` when both are one run, which
    is most of what exchange synthesis intersects.  Coordinate arrays are never written to."""
    if _dense(a) and _dense(b):
        lo, hi = max(int(a[0]), int(b[0])), min(int(a[-1]), int(b[-1])) + 1
        return a[lo - int(a[0]) : max(lo, hi) - int(a[0])]
    return np.intersect1d(a, b, assume_unique=True)


def _subset(small: np.ndarray, big: np.ndarray) -> bool:
    """Whether the sorted coordinates ``small`` all occur in the sorted ``big``."""
    if len(small) == 0:
        return True
    if len(small) > len(big) or small[0] < big[0] or small[-1] > big[-1]:
        return False
    at = np.searchsorted(big, small)
    return bool(np.array_equal(big[at], small))
