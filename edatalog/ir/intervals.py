"""Sets of integer coordinates as sorted, disjoint, non-adjacent half-open intervals, and boxes
(one such set per axis).

This is the one representation of "which places along an axis" that planning, exchange synthesis
and the simulator share: its size is the number of runs, never the number of coordinates, so a
block of a sequence of 10^9 tokens costs as much to describe, intersect or subtract as one of
10^3.  Only moving data (:func:`positions`) costs in proportion to the cells, and then only to
the cells moved.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence

import numpy as np

Ivs = tuple[tuple[int, int], ...]  # sorted, disjoint, non-adjacent [lo, hi) intervals
Box = tuple[Ivs, ...]  # one interval set per axis of a relation


def merge(ivs: Iterable[tuple[int, int]]) -> Ivs:
    """The union of any intervals, normalized (empty ones dropped, touching ones joined)."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(iv for iv in ivs if iv[0] < iv[1]):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


def size(a: Ivs) -> int:
    return sum(hi - lo for lo, hi in a)


def meet(a: Ivs, b: Ivs) -> Ivs:
    """The coordinates in both."""
    if len(a) == 1 and len(b) == 1:  # most of what planning intersects: one run each
        lo, hi = max(a[0][0], b[0][0]), min(a[0][1], b[0][1])
        return ((lo, hi),) if lo < hi else ()
    out: list[tuple[int, int]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def meet_size(a: Ivs, b: Ivs) -> int:
    """The number of coordinates in both (:func:`meet` without building it)."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def minus(a: Ivs, b: Ivs) -> Ivs:
    """The coordinates of ``a`` that ``b`` lacks."""
    out: list[tuple[int, int]] = []
    j = 0
    for lo, hi in a:
        while j < len(b) and b[j][1] <= lo:
            j += 1
        k = j
        while lo < hi and k < len(b) and b[k][0] < hi:
            if b[k][0] > lo:
                out.append((lo, b[k][0]))
            lo = max(lo, b[k][1])
            k += 1
        if lo < hi:
            out.append((lo, hi))
    return tuple(out)


def subset(small: Ivs, big: Ivs) -> bool:
    """Whether every coordinate of ``small`` is in ``big``: each run of ``small`` lies inside one
    run of ``big`` (runs of a normalized set never touch)."""
    j = 0
    for lo, hi in small:
        while j < len(big) and big[j][1] <= lo:
            j += 1
        if j == len(big) or big[j][0] > lo or big[j][1] < hi:
            return False
    return True


def clip(a: Ivs, lo: int, hi: int) -> Ivs:
    """The coordinates of ``a`` in ``lo .. hi - 1``."""
    return meet(a, ((lo, hi),)) if lo < hi else ()


def hull(a: Ivs) -> Ivs:
    return ((a[0][0], a[-1][1]),) if a else ()


def split(a: Ivs, parts: int) -> list[Ivs]:
    """At most ``parts`` non-empty pieces of ``a``, in order, cut as :func:`numpy.array_split`
    cuts its coordinates (the first ``size % parts`` pieces one coordinate longer): the way a
    reduce-scatter divides a region among its owners, which the solver prices the same way."""
    total = size(a)
    count = min(parts, total)
    if count <= 0:
        return []
    base, extra = divmod(total, count)
    out: list[Ivs] = []
    runs = iter(a)
    lo, hi = next(runs)
    for k in range(count):
        want = base + (k < extra)
        piece: list[tuple[int, int]] = []
        while want:
            if lo == hi:
                lo, hi = next(runs)
            take = min(want, hi - lo)
            piece.append((lo, lo + take))
            lo += take
            want -= take
        out.append(tuple(piece))
    return out


def positions(sub: Ivs, outer: Ivs) -> Ivs:
    """Where the coordinates of ``sub`` (a subset of ``outer``) sit in data laid out as ``outer``
    (its coordinates in ascending order), as runs of positions."""
    out: list[tuple[int, int]] = []
    j = offset = 0
    for lo, hi in sub:
        while outer[j][1] <= lo:  # sub is inside outer: some run of outer holds [lo, hi)
            offset += outer[j][1] - outer[j][0]
            j += 1
        start = offset + lo - outer[j][0]
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], start + hi - lo)
        else:
            out.append((start, start + hi - lo))
    return tuple(out)


def index(runs: Ivs) -> slice | np.ndarray:
    """Runs of positions as something to index an axis with: a slice for one run, else the
    positions themselves (as many as the cells selected)."""
    if len(runs) == 1:
        return slice(*runs[0])
    if not runs:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(lo, hi, dtype=np.int64) for lo, hi in runs])


def atoms(sets: Sequence[Ivs]) -> list[tuple[Ivs, tuple[int, ...]]]:
    """The union of ``sets`` cut into atoms: the coordinates covered by exactly the same sets,
    each with the positions of those sets, in order of first coordinate; its cost grows with the
    runs, never with the coordinates."""
    changes: dict[int, list[tuple[int, int]]] = {}  # coordinate -> (set, +1 entering / -1 leaving)
    for k, s in enumerate(sets):
        for lo, hi in s:
            changes.setdefault(lo, []).append((k, 1))
            changes.setdefault(hi, []).append((k, -1))
    edges = sorted(changes)
    inside: set[int] = set()
    found: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for lo, hi in itertools.pairwise(edges):
        for k, step in changes[lo]:
            if step > 0:
                inside.add(k)
            else:
                inside.discard(k)
        if inside:
            found.setdefault(tuple(sorted(inside)), []).append((lo, hi))
    return [(merge(runs), members) for members, runs in found.items()]


# -- boxes ------------------------------------------------------------------------------------------


def box_size(box: Box) -> int:
    return math.prod(size(a) for a in box)


def box_meet(a: Box, b: Box) -> int:
    """The number of cells in both boxes."""
    out = 1
    for x, y in zip(a, b, strict=True):
        out *= meet_size(x, y)
        if out == 0:
            return 0
    return out


def box_hull(a: Box, b: Box) -> Box:
    """The union of two boxes' coordinates, axis by axis (exact when they differ on one axis)."""
    return tuple(merge([*x, *y]) for x, y in zip(a, b, strict=True))


def split_longest(box: Box, parts: int, axis: int | None = None) -> list[Box]:
    """At most ``parts`` non-empty pieces of a box cut along ``axis`` (default: its longest, the
    first of equals) by :func:`split`."""
    if not box:
        return [box]
    k = axis if axis is not None else max(range(len(box)), key=lambda j: size(box[j]))
    return [(*box[:k], piece, *box[k + 1 :]) for piece in split(box[k], parts)]
