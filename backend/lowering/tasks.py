"""The steps of exchange synthesis (:mod:`edatalog.backend.lowering.exchange`): tasks in one global
order, each leaving a buffer, and the pieces of a relation's layout.  Lowered to device programs
once synthesis is done."""

from __future__ import annotations

from dataclasses import dataclass

from edatalog.ir.cost import routed_share
from edatalog.ir.forms import RouteKey
from edatalog.ir.regions import Region


@dataclass(eq=False)
class Task:
    """A step of synthesis, in one global order; lowered to device ops by :func:`_lower`."""

    id: int  # also the id of the buffer it leaves
    device: int
    deps: list[int]  # tasks that must finish first


@dataclass(eq=False)
class Load(Task):
    relation: str
    region: Region
    nbytes: int


@dataclass(eq=False)
class Compute(Task):
    node: str
    block: int
    ranges: dict[str, tuple[int, int]]
    reads: list[list[tuple[int, Region]]]  # per input of the node: (buffer, part of the need it covers)
    out: Region
    flops: int
    nbytes: int  # bytes read and written
    every_point: bool  # the guard holds at every point of the (tightened) block


@dataclass(frozen=True)
class RoutedRows:
    """The rows of a relation that a block over part ``lo .. hi - 1`` of a routed index reads or
    writes: those where some value of the route along them falls in the part (see
    :class:`edatalog.ir.program.Select`).  ``axes``: per axis of the route, the relation's axis
    along it, or None."""

    route: str
    axes: tuple[int | None, ...]
    lo: int
    hi: int
    extent: int  # how many values the route takes (the looked-up index's extent)
    choices: int  # how many of them a row has (a token's K: see edatalog.ir.forms.route_choices)

    def share(self) -> float:
        """The expected share of the rows that travel (:func:`edatalog.ir.cost.routed_share`)."""
        return routed_share(self.extent, self.hi - self.lo, self.choices)


@dataclass(frozen=True)
class Selection:
    """The rows of one transfer that travel (:class:`RoutedRows`), with where each end holds
    the route's cells for them: ``region``, the route's part, made of ``at_source``'s parts on
    the sender and ``at_dest``'s on the receiver (buffer, part)."""

    rows: RoutedRows
    region: Region
    at_source: tuple[tuple[int, Region], ...]
    at_dest: tuple[tuple[int, Region], ...]


@dataclass(eq=False)
class Send(Task):
    dst: int
    source: int  # buffer (task id) on the sending device
    relation: str
    region: Region
    nbytes: int  # expected, for a selective transfer
    selection: Selection | None = None


@dataclass(eq=False)
class Combine(Task):
    relation: str
    region: Region
    sources: list[int]  # buffers on this device, each covering ``region``
    flops: int
    nbytes: int


@dataclass(frozen=True, eq=False)
class Buffer:
    """Data a task leaves on a device: a region of one relation."""

    task: int
    device: int
    relation: str
    region: Region


@dataclass(frozen=True)
class Routed:
    """The part ``lo .. hi - 1`` of a routed index that a block holds: its cells exist only where
    the routed value (see :class:`~edatalog.ir.forms.RouteKey`) falls in the part."""

    key: RouteKey
    lo: int
    hi: int

    def meets(self, other: Routed) -> bool:
        """Whether a cell can exist in both (another key says nothing about this one's cells)."""
        return self.key != other.key or (self.lo < other.hi and other.lo < self.hi)


@dataclass(eq=False)
class Entry:
    """A piece of a relation's final layout (or a block's contribution to it): a region, and the
    buffer holding it on each device; ``routed``: the part of a routed index its cells are
    limited to (None: no such limit)."""

    region: Region
    holders: dict[int, int]  # device -> buffer
    routed: Routed | None = None
    rows: RoutedRows | None = None  # a routed block's partial: its cells exist on these rows only
