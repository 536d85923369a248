"""Rewrites of one join-agg that keep its meaning: an index replaced by an affine function of
the others (and maybe a new index).

- The compiler substitutes an index that an equality guard defines (``t == l + k``), so the
  join space is the work (:mod:`edatalog.rules.eliminate`).
- Evaluators re-index a *band*: in ``slide[b, t, c] max= x[b, u, c] where u >= t, u <= t + 2``
  each ``t`` has three ``u``; with ``u = t + j`` and ``j`` in ``0 .. 2`` the join space is the
  band, not the dense ``t`` by ``u`` square (:func:`reindex_bands`).

Both are bijections between the points that exist before and after, so every result is the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from edatalog.ir.affine import Affine, Constraint, Guard
from edatalog.ir.graph import Access, AxisMap, Index, JoinAgg, Part
from edatalog.ir.scalar import substitute_indices

BAND_GAIN = 2  # re-index a band only when it is at most half of the index's extent


def substitute_index(node: JoinAgg, var: str, value: Affine, new: Index | None = None) -> JoinAgg:
    """``node`` with index ``var`` replaced by ``value`` everywhere (accesses, guard, index
    values), ``var``'s range ``0 <= value <= extent - 1`` kept as a guard, and ``new`` (an index
    ``value`` may use) added in ``var``'s place.  ``var`` must not be in the head."""
    assert var not in node.out_indices, f"{var} is in the head of {node.name}"
    mapping = {var: value}
    extent = node.box[var]

    def axes(maps: tuple[AxisMap, ...]) -> tuple[AxisMap, ...]:
        return tuple(AxisMap(tuple(Part(p.expr.substitute(mapping), p.extent) for p in ax.parts)) for ax in maps)

    indices = tuple(
        i for old in node.indices for i in ((new,) if old.name == var and new is not None else (old,)) if i.name != var
    )
    in_range = Guard.of([Constraint(value), Constraint(-value + (extent - 1))])
    guard = (node.guard.substitute(mapping) & in_range).simplify({i.name: i.extent for i in indices})
    return dataclasses.replace(
        node,
        indices=indices,
        inputs=tuple(Access(a.relation, axes(a.axes)) for a in node.inputs),
        expr=substitute_indices(node.expr, mapping),
        guard=guard,
    )


def reindex_bands(node: JoinAgg) -> JoinAgg:
    """The node with every band re-indexed by its offset (see the module docstring)."""
    while (band := _band(node)) is not None:
        var, start, width = band
        offset = Index(_fresh(node, f"{var}_off"), width, str(width))
        node = substitute_index(node, var, start + Affine.var(offset.name), offset)
    return node


def _band(node: JoinAgg) -> tuple[str, Affine, int] | None:
    """An index ``u`` outside the head that one conjunction bounds as ``f + a <= u <= f + b``
    with the same ``f`` on both sides, and ``b - a + 1`` well below its extent: ``u``, ``f + a``
    and the width ``b - a + 1``."""
    if len(node.guard.conjs) != 1:
        return None
    head = set(node.out_indices)
    cons = [c for c in node.guard.conjs[0].constraints if not c.eq]
    for idx in node.indices:
        if idx.name in head:
            continue
        lower: dict[Affine, int] = {}  # f -> a, for u >= f + a
        upper: dict[Affine, int] = {}  # f -> b, for u <= f + b
        for c in cons:
            coef = c.expr.coef(idx.name)
            if abs(coef) != 1:
                continue
            rest = Affine(tuple(t for t in c.expr.terms if t[0] != idx.name))
            if not rest.terms:
                continue  # a bound by a number: the box, not a band
            # coef * u + rest + k >= 0:  u >= -(rest + k)  (coef 1),  u <= rest + k  (coef -1)
            f = rest.scale(-coef)
            k = c.expr.const
            if coef > 0:
                lower[f] = max(lower.get(f, -k), -k)
            else:
                upper[f] = min(upper.get(f, k), k)
        for f, a in lower.items():
            if f in upper:
                width = upper[f] - a + 1
                if width > 0 and width * BAND_GAIN <= idx.extent:
                    return idx.name, f + a, width
    return None


def _fresh(node: JoinAgg, base: str) -> str:
    names = {i.name for i in node.indices}
    name, k = base, 1
    while name in names:
        name, k = f"{base}{k}", k + 1
    return name


def restrict(node: JoinAgg, ranges: Mapping[str, tuple[int, int]]) -> JoinAgg:
    """One block of ``node``, its indices over ``ranges`` (``[lo, hi)`` per index), as a join-agg
    of its own: indices run from 0, index values and the guard are shifted to where the block
    sits, and each access (the head too) reads its relation laid out as the block's part of it,
    per axis the places :meth:`Part.places` reaches (``x[b, c, l + k]`` over a block of ``l``
    reads ``x`` from ``l_lo`` to ``l_hi + K - 2``, its halo included).  Evaluating it on those
    parts gives the block's results, exactly."""
    shift = {v: Affine.var(v) + lo for v, (lo, _) in ranges.items() if lo}

    def local(maps: tuple[AxisMap, ...]) -> tuple[AxisMap, ...]:
        out = []
        for ax in maps:
            parts = []
            for p in ax.parts:
                lo, hi = p.places(ranges)
                assert hi > lo, f"a block of {node.name} reads no place of {p}: its guard leaves no point"
                parts.append(Part(p.expr.substitute(shift) - lo, hi - lo))
            out.append(AxisMap(tuple(parts)))
        return tuple(out)

    indices = tuple(Index(i.name, ranges[i.name][1] - ranges[i.name][0], i.symbol) for i in node.indices)
    box = {i.name: i.extent for i in indices}
    return dataclasses.replace(
        node,
        indices=indices,
        inputs=tuple(Access(a.relation, local(a.axes)) for a in node.inputs),
        out_axes=local(node.out_axes),
        expr=substitute_indices(node.expr, shift),
        guard=node.guard.substitute(shift).simplify(box),
        lookups=tuple(dataclasses.replace(lk, offset=lk.offset + ranges[lk.index][0]) for lk in node.lookups),
    )
