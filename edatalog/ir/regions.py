"""Regions of relations: for each axis, the set of coordinates a region covers, as intervals.

A region is a product of per-axis coordinate sets (:data:`~edatalog.ir.intervals.Box`, the
solver's representation too).  A block of a join space reads, through an access such as
``wq[(h,e),d]``, the coordinates ``h*E + e`` for its ranges of ``h`` and ``e`` (a strided set,
several intervals, when ``e`` is split), so sets rather than bounding boxes keep every need exact.
Everything but moving data costs in proportion to the intervals, never to the extents: a block of
a sequence of 10^9 tokens is described, intersected and subtracted as cheaply as one of 10^3.
The data of a region is always laid out in ascending coordinate order per axis.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from edatalog.ir import intervals as iv
from edatalog.ir.graph import AxisMap
from edatalog.ir.intervals import Box, Ivs


def through(axes: tuple[AxisMap, ...], ranges: Mapping[str, tuple[int, int]]) -> Box:
    """The coordinates an access reaches, per axis, when its indices run over ``ranges``: per part
    the places :meth:`Part.places` gives (a halo for ``l + k``; none outside the part, whose
    points are failed joins), composed row-major.  Ascending coordinates are then exactly the
    row-major order of the parts' places, the layout :func:`edatalog.ir.rewrite.restrict` gives
    each block's view of the relation."""
    out = []
    for ax in axes:
        inner: Ivs = ((0, 1),)
        stride = 1
        for p in reversed(ax.parts):
            lo, hi = p.places(ranges)
            if not inner or lo >= hi:
                inner = ()
            elif inner == ((0, stride),):  # the inner parts cover their whole span: one interval
                inner = ((lo * stride, hi * stride),)
            else:  # one copy of the inner runs per place of this part (head counts, not sequences)
                inner = iv.merge((v * stride + a, v * stride + b) for v in range(lo, hi) for a, b in inner)
            stride *= p.extent
        out.append(inner)
    return tuple(out)


@dataclass(frozen=True)
class Region:
    """A product of per-axis interval sets; a value (hashable; equal when every axis covers the
    same coordinates)."""

    axes: Box

    @staticmethod
    def whole(shape: tuple[int, ...]) -> Region:
        return Region(tuple(((0, n),) if n > 0 else () for n in shape))

    @staticmethod
    def of_box(shape: tuple[int, ...], ranges: tuple[tuple[int, int], ...]) -> Region:
        return Region(tuple(((lo, hi),) if lo < hi else () for lo, hi in ranges))

    @staticmethod
    def through(axes: tuple[AxisMap, ...], ranges: Mapping[str, tuple[int, int]]) -> Region:
        """The coordinates an access reaches when its indices run over ``ranges`` (:func:`through`)."""
        return Region(through(axes, ranges))

    @functools.cached_property
    def shape(self) -> tuple[int, ...]:  # cached: runtimes ask on every op
        return tuple(iv.size(a) for a in self.axes)

    @functools.cached_property
    def size(self) -> int:
        return iv.box_size(self.axes)

    @property
    def empty(self) -> bool:
        return any(not a for a in self.axes)

    def bounds(self) -> tuple[tuple[int, int], ...]:
        """Per axis the ``[lo, hi)`` hull of the coordinates (``(0, 0)`` for an empty axis)."""
        return tuple((a[0][0], a[-1][1]) if a else (0, 0) for a in self.axes)

    def intersect(self, other: Region) -> Region:
        return Region(tuple(iv.meet(a, b) for a, b in zip(self.axes, other.axes, strict=True)))

    def contains(self, other: Region) -> bool:
        return other.empty or all(iv.subset(b, a) for a, b in zip(self.axes, other.axes, strict=True))

    def minus(self, other: Region) -> list[Region]:
        """The cells of this region that ``other`` lacks, as disjoint regions (at most one per
        axis): those outside ``other`` on axis ``k`` and inside it on every axis before ``k``."""
        if self.empty:
            return []
        inside = [iv.meet(a, b) for a, b in zip(self.axes, other.axes, strict=True)]
        if any(not c for c in inside):
            return [self]
        out = []
        for k, (a, b) in enumerate(zip(self.axes, other.axes, strict=True)):
            rest = iv.minus(a, b)
            if rest:
                out.append(Region((*inside[:k], rest, *self.axes[k + 1 :])))
        return out

    def same(self, other: Region) -> bool:
        return self == other

    def split(self, parts: int, axis: int | None = None) -> list[Region]:
        """Up to ``parts`` non-empty pieces, cut along ``axis`` (default: the longest) as evenly as
        can be (:func:`edatalog.ir.intervals.split_longest`, which the solver prices)."""
        return [Region(b) for b in iv.split_longest(self.axes, parts, axis)]

    def positions_in(self, outer: Region) -> tuple[Ivs, ...]:
        """Where this region's coordinates sit inside ``outer``'s data (``self`` within
        ``outer``), per axis as runs of positions."""
        return tuple(iv.positions(a, o) for a, o in zip(self.axes, outer.axes, strict=True))

    def at(self, outer: Region) -> tuple[slice | np.ndarray, ...]:
        """An index selecting this region's cells in data laid out as ``outer``: slices when every
        axis is one run (a view), else open-mesh positions, as many as the cells selected."""
        picks = [iv.index(runs) for runs in self.positions_in(outer)]
        if all(isinstance(p, slice) for p in picks):
            return tuple(picks)
        spans = [np.arange(p.start, p.stop, dtype=np.int64) if isinstance(p, slice) else p for p in picks]
        return tuple(np.ix_(*spans))

    def cut(self, data: np.ndarray, sub: Region) -> np.ndarray:
        """The part of ``data`` (laid out as this region) covering ``sub``, as a new array."""
        if not self.axes:
            return data.copy()  # a scalar relation: data[()] would be a number, not an array
        at = sub.at(self)
        out = data[at]
        # Slices give a view (copied here); open-mesh positions a new array already.
        return out.copy() if all(isinstance(a, slice) for a in at) else out

    def __str__(self) -> str:
        return "[" + ", ".join(runs_text(a) for a in self.axes) + "]"


def runs_text(a: Ivs, most: int = 6) -> str:
    """``lo:hi`` for one run, ``{0:2,4,8:10}`` for several (single places bare), the first
    ``most`` of many then ``...``."""
    if len(a) == 1:
        return f"{a[0][0]}:{a[0][1]}"
    shown = [f"{lo}" if hi == lo + 1 else f"{lo}:{hi}" for lo, hi in a[:most]]
    return "{" + ",".join(shown) + (",..." if len(a) > most else "") + "}"
