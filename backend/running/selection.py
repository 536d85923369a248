"""Selective messages (:class:`edatalog.ir.program.Select`): only the rows a routed reader reads
cross devices.

Both ends hold the route's cells for the message's rows, so both work out the same rows
(:func:`rows`) and no count travels.  The sender packs those rows into one array (:func:`pack`):
the row axes first, flattened, indexed by the rows' mask; the receiver scatters them back into
the region, the other cells absent (:func:`unpack`).  A recorded graph cannot give an array a
size its values decide, so while recording (``reads_back`` false) the whole region travels and
the receiver only masks it (:func:`masked`): the same buffer, at the full message's cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edatalog.backend.kernels.arrays import Array, ArrayOps
from edatalog.ir import program as ir


@dataclass(frozen=True)
class Rows:
    """Which rows of a message travel: ``mask`` over the message's row ``axes`` (ascending)."""

    axes: tuple[int, ...]
    mask: Array

    def order(self, rank: int) -> tuple[int, ...]:
        """The message's axes with the row axes first: how a message is laid out to pack it."""
        return (*self.axes, *(a for a in range(rank) if a not in self.axes))


def rows(xp: ArrayOps, route: Array, select: ir.Select) -> Rows:
    """The rows of the message that travel, from the route's cells ``route`` (laid out as
    ``select.region``): those where a routed value (any, along the route's axes the message
    lacks) falls in ``select.lo .. select.hi - 1``."""
    hit = xp.logical_and(route >= select.lo, route < select.hi)
    lacking = tuple(j for j, m in enumerate(select.axes) if m is None)
    if lacking:
        hit = xp.any(hit, lacking)
    kept = [m for m in select.axes if m is not None]  # the message's axis of each remaining route axis
    order = sorted(range(len(kept)), key=lambda j: kept[j])
    if order != list(range(len(kept))):
        hit = xp.transpose(hit, order)
    return Rows(tuple(sorted(kept)), hit)


def pack(xp: ArrayOps, data: Array, present: Array | None, rows: Rows) -> tuple[Array, Array | None]:
    """The message's travelling rows (and their presence, if the buffer keeps one), as arrays of
    shape ``(rows, rest of the message...)``."""

    def one(a: Array) -> Array:
        laid = xp.transpose(a, rows.order(len(a.shape)))
        flat = xp.contiguous(laid).reshape((-1, *laid.shape[len(rows.axes) :]))
        return flat[rows.mask.reshape(-1)]

    return one(data), (None if present is None else one(present))


def packed_shape(shape: tuple[int, ...], rows: Rows, count: int) -> tuple[int, ...]:
    """The shape of a packed message of ``count`` rows, for a message of ``shape``."""
    return (count, *(n for a, n in enumerate(shape) if a not in rows.axes))


def unpack(
    xp: ArrayOps, data: Array, present: Array | None, rows: Rows, shape: tuple[int, ...], device: Any
) -> tuple[Array, Array]:
    """A packed message in its region's layout: the rows that came, the other cells absent."""
    order = rows.order(len(shape))
    laid = tuple(shape[a] for a in order)
    keep = rows.mask.reshape(-1)
    out = xp.full((keep.shape[0], *laid[len(rows.axes) :]), 0, data.dtype, device)
    out[keep] = data
    there = xp.full(out.shape, False, xp.bool_, device)
    there[keep] = True if present is None else present
    back = tuple(order.index(a) for a in range(len(shape)))
    return (
        xp.contiguous(xp.transpose(out.reshape(laid), back)),
        xp.contiguous(xp.transpose(there.reshape(laid), back)),
    )


def masked(xp: ArrayOps, data: Array, present: Array | None, rows: Rows) -> tuple[Array, Array]:
    """A whole message as a selective one arrives: the rows that did not travel absent."""
    shape = tuple(data.shape)
    view = [shape[a] if a in rows.axes else 1 for a in range(len(shape))]
    there = xp.broadcast_to(rows.mask.reshape(view), shape)
    if present is not None:
        there = xp.logical_and(there, present)
    return xp.where(there, data, xp.constant(0, data.dtype)), xp.contiguous(there)
