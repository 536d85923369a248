"""Per-device programs: what every device executes, in order; the IR that exchange synthesis
emits and that every runtime runs (the simulator, torch on logical devices in one process, and
torch across processes, where rank ``r`` runs device ``r``'s program).

Ops that make data define a *buffer*: an integer, unique across the programs of one plan, that
names a region of one relation held on one device, in one element type.  An op reads only
buffers defined earlier on its own device (and not freed); data crosses devices only through a
:class:`Send` on one device and the :class:`Recv` with the same tag on its peer.

- :class:`Load`: the device's piece of an input or param, present at the start;
- :class:`Kernel`: one block of one join-agg, its index ranges given (the block's kernel is the
  join-agg restricted to them, :func:`edatalog.ir.rewrite.restrict`), reading its inputs from
  local buffers; partial results of split aggregated indices included;
- :class:`Send` / :class:`Recv`: a region of a buffer to a peer, and its arrival;
- :class:`Combine`: partials of one region folded with the relation's aggregation;
- :class:`Fused`: kernels of one device run as one (a runtime's optimization; see
  :mod:`edatalog.backend.lowering.fusion`);
- :class:`Collective`: one member's part in an all-reduce, reduce-scatter or all-gather over a
  group of devices, which the members meet at (a runtime's rewrite of sends, receives and
  combines; see :mod:`edatalog.backend.lowering.collectives`);
- :class:`Free`: a buffer no later op reads; what makes memory peaks real.

A buffer is *full* when every cell of its region is known, when the programs are made, to
exist: then no presence mask is kept or sent for it.  A partial result of a block that guards
leave partly empty is not full, and its mask travels with it.

Programs know nothing of time: what ops cost (FLOPs, bytes) is kept beside them, in
:class:`OpCost` tables that the timeline reads.  ``verify()`` checks that every read is defined
earlier on its device and covered by its buffer, that sends and receives pair up with equal
regions and types, that the members of every collective agree on it and meet at their
collectives of one group in one order, and that no device can wait forever.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum

from edatalog.ir import dtypes, intervals, serialize
from edatalog.ir.cost import ONE_KERNEL, Launches
from edatalog.ir.graph import VerifyError
from edatalog.ir.regions import Region

Ranges = tuple[tuple[str, int, int], ...]  # (index, lo, hi) per index of a join-agg, [lo, hi)


@dataclass(frozen=True)
class Load:
    buf: int
    relation: str
    region: Region
    dtype: str
    full: bool = True  # every cell of the region exists (see the module docstring)

    def __str__(self) -> str:
        return f"%{self.buf} = load {self.relation}{self.region}"


@dataclass(frozen=True)
class Kernel:
    """One block of the join-agg ``node`` over ``ranges``, writing ``region`` of its head
    relation.  ``reads[k]`` are the buffers (and the part of the block's need each covers) that
    together hold what the block reads of the node's input ``k``."""

    buf: int
    node: str
    ranges: Ranges
    reads: tuple[tuple[tuple[int, Region], ...], ...]
    relation: str
    region: Region
    dtype: str  # the node's compute type: partials of half types stay f32 until read
    full: bool = False

    @property
    def range_map(self) -> dict[str, tuple[int, int]]:
        return {i: (lo, hi) for i, lo, hi in self.ranges}

    def __str__(self) -> str:
        block = ", ".join(f"{i}={lo}:{hi}" for i, lo, hi in self.ranges)
        reads = "; ".join(", ".join(f"%{b}{r}" for b, r in parts) for parts in self.reads)
        return f"%{self.buf} = kernel {self.node}[{block}] ({reads}) -> {self.relation}{self.region}"


@dataclass(frozen=True)
class Select:
    """The cells of a message that travel: those a routed reader can read.  A reader routed to
    experts ``lo .. hi - 1`` (a block of ``h1[t, k, f] += x[t, d] * w1[e, f, d] where route[t, k]
    = e`` over part of ``e``) reads row ``t`` of ``x`` only where some ``route[t, k]`` falls
    there, and the partial sums it writes exist only there: both ends of the transfer hold the
    route's cells for the message's rows (``region`` of it, in the buffers ``reads`` names), so
    both work out the same rows, and only those cross.  ``axes``: for each axis of the route,
    the axis of the message it runs along, or None where the message has no such axis (a row
    is sent when any of the route's values along it falls in the part).  The receiver's buffer
    has the other cells absent."""

    relation: str  # the route
    reads: tuple[tuple[int, Region], ...]  # buffers on this op's device holding its cells, and their parts
    region: Region  # the route's part read: the message's rows, every value of the rest
    axes: tuple[int | None, ...]
    lo: int
    hi: int
    dense: bool  # the sent buffer was full when the programs were made: no presence travels

    def __str__(self) -> str:
        held = ", ".join(f"%{b}{r}" for b, r in self.reads)
        return f" where {self.relation}{self.region} in [{self.lo}, {self.hi}) ({held})"

    def agreed(self) -> tuple[object, ...]:
        """What both ends must agree on (each names its own buffers)."""
        return (self.relation, self.region, self.axes, self.lo, self.hi, self.dense)


@dataclass(frozen=True)
class Send:
    buf: int  # the local buffer sent from
    peer: int
    tag: int
    region: Region  # the part of the buffer's region sent
    select: Select | None = field(default=None, metadata={serialize.OMIT_EMPTY: True})

    def __str__(self) -> str:
        select = "" if self.select is None else str(self.select)
        return f"send %{self.buf}{self.region}{select} -> device {self.peer} #{self.tag}"


@dataclass(frozen=True)
class Recv:
    buf: int
    peer: int
    tag: int
    relation: str
    region: Region
    dtype: str
    full: bool = False
    select: Select | None = field(default=None, metadata={serialize.OMIT_EMPTY: True})

    def __str__(self) -> str:
        select = "" if self.select is None else str(self.select)
        return f"%{self.buf} = recv {self.relation}{self.region}{select} <- device {self.peer} #{self.tag}"


@dataclass(frozen=True)
class Combine:
    """``sources`` (local buffers, each covering ``region``) folded with the relation's
    aggregation; a cell exists where some source has it."""

    buf: int
    relation: str
    region: Region
    sources: tuple[int, ...]
    dtype: str
    full: bool = False

    def __str__(self) -> str:
        return f"%{self.buf} = combine {self.relation}{self.region} ({', '.join(f'%{b}' for b in self.sources)})"


@dataclass(frozen=True)
class Fused:
    """Several ops of one device run as one (``kind`` names how, e.g. ``"attention"``): kernels,
    and the combines of partials among them.  The buffers the inner ops make and read among
    themselves never exist outside; the last op's buffer is the fused op's, and ``exports``
    names inner ops' buffers that outlive it too (an attention's backward makes the gradients
    of q, k and v at once).  ``overwrites`` names buffers it reads whose last reader it is on
    its device: a runtime may write its results over those whose memory the call owns (an
    AdamW update over a param's and its moments' blocks, as torch's optimizers update)."""

    buf: int
    kind: str
    body: tuple[Kernel | Combine, ...]
    relation: str
    region: Region
    dtype: str
    full: bool = False
    exports: tuple[int, ...] = field(default=(), metadata={serialize.OMIT_EMPTY: True})
    overwrites: tuple[int, ...] = field(default=(), metadata={serialize.OMIT_EMPTY: True})

    @property
    def internal(self) -> frozenset[int]:
        return frozenset(k.buf for k in self.body[:-1] if k.buf not in self.exports)

    @property
    def exported(self) -> tuple[Kernel | Combine, ...]:
        """The inner ops whose buffers outlive the fused op, besides the last."""
        return tuple(k for k in self.body[:-1] if k.buf in self.exports)

    @property
    def kernels(self) -> tuple[Kernel, ...]:
        return tuple(k for k in self.body if isinstance(k, Kernel))

    def __str__(self) -> str:
        outer = ", ".join(f"%{b}" for b in reads(self))
        return f"%{self.buf} = fused {self.kind} ({self.names()}) ({outer}) -> {self.relation}{self.region}"

    def names(self) -> str:
        """What the inner ops are, in order: ``sc + mx + combine mx + p + ...``."""
        return " + ".join(k.node if isinstance(k, Kernel) else f"combine {k.relation}" for k in self.body)


class CollectiveKind(StrEnum):
    ALL_REDUCE = "all_reduce"  # every member holds a partial of ``whole``, and ends with it combined
    REDUCE_SCATTER = "reduce_scatter"  # ... and ends with its own piece of it combined
    ALL_GATHER = "all_gather"  # every member holds its piece of ``whole``, and ends with all of it


@dataclass(frozen=True)
class Collective:
    """One member's part in a collective over the devices ``group``: every member has one, with
    the same ``tag``, and they meet there (none goes on before every member has come).

    ``source`` is the local buffer it reads: a partial covering ``whole`` (all-reduce,
    reduce-scatter; folded with the aggregation ``reduce``), or this member's piece (all-gather).
    ``pieces`` are the members' pieces of ``whole``, in ``group`` order: disjoint, they fill it
    (none for an all-reduce).  The buffer made holds ``region``: ``whole``, or for a
    reduce-scatter this member's piece.  Buffers of collectives are full: presence masks travel
    by point-to-point messages only."""

    buf: int
    kind: CollectiveKind
    group: tuple[int, ...]  # ascending
    tag: int  # the same on every member, unique among the collectives of the programs
    relation: str
    whole: Region
    pieces: tuple[Region, ...]
    source: int
    reduce: str | None  # "sum", "prod", "max" or "min"; None for an all-gather
    region: Region
    dtype: str
    full: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", CollectiveKind(self.kind))  # from JSON: the kind's name

    def part(self, device: int) -> Region:
        """What ``device`` (a member) reads of its source: ``whole``, or its piece (all-gather)."""
        if self.kind is CollectiveKind.ALL_GATHER:
            return self.pieces[self.group.index(device)]
        return self.whole

    def __str__(self) -> str:
        group = ",".join(str(d) for d in self.group)
        what = self.kind.value if self.reduce is None else f"{self.kind.value} {self.reduce}"
        return f"%{self.buf} = {what} {self.relation}{self.region} (%{self.source}) group {{{group}}} #{self.tag}"


@dataclass(frozen=True)
class Free:
    buf: int

    def __str__(self) -> str:
        return f"free %{self.buf}"


Op = Load | Kernel | Send | Recv | Combine | Fused | Collective | Free
DEFINES = (Load, Kernel, Recv, Combine, Fused, Collective)  # the ops that make a buffer
Maker = Load | Kernel | Recv | Combine | Fused | Collective


def made(op: Op) -> tuple[Maker, ...]:
    """What defines each buffer ``op`` leaves behind: the op itself where it makes one, and a
    fused op's exported inner ops (their buffer, relation, region, dtype and fullness)."""
    if isinstance(op, Fused):
        return (*op.exported, op)
    return (op,) if isinstance(op, DEFINES) else ()


def reads(op: Op) -> tuple[int, ...]:
    """The buffers an op reads (a Free "reads" the buffer it ends)."""
    if isinstance(op, Kernel):
        return tuple(dict.fromkeys(b for parts in op.reads for b, _ in parts))
    if isinstance(op, Fused):
        inside = {k.buf for k in op.body}
        return tuple(dict.fromkeys(b for k in op.body for b in reads(k) if b not in inside))
    if isinstance(op, Combine):
        return op.sources
    if isinstance(op, Collective):
        return (op.source,)
    if isinstance(op, Send):
        return (op.buf,) if op.select is None else tuple(dict.fromkeys((op.buf, *(b for b, _ in op.select.reads))))
    if isinstance(op, Recv):
        return () if op.select is None else tuple(dict.fromkeys(b for b, _ in op.select.reads))
    if isinstance(op, Free):
        return (op.buf,)
    return ()


@dataclass(frozen=True)
class DeviceProgram:
    device: int
    ops: tuple[Op, ...]

    def __str__(self) -> str:
        return "\n".join([f"device {self.device}:", *(f"  {op}" for op in self.ops)])


@dataclass(frozen=True)
class OutputPiece:
    """Where a piece of an output ends: ``region`` of ``relation`` in buffer ``buf`` on ``device``."""

    relation: str
    region: Region
    device: int
    buf: int


@dataclass(frozen=True)
class Programs:
    """The programs of every device of a plan, for the graph with fingerprint ``graph``; the
    relations' shapes and dtypes they move (for checking buffers without the graph), and where
    each output ends."""

    graph: str
    relations: tuple[tuple[str, tuple[int, ...], str], ...]  # name, shape, dtype
    devices: tuple[DeviceProgram, ...]
    outputs: tuple[OutputPiece, ...]

    @property
    def n_devices(self) -> int:
        return len(self.devices)

    def ops(self) -> Iterator[tuple[int, int, Op]]:
        """Every op with its device and position in that device's program."""
        for prog in self.devices:
            for k, op in enumerate(prog.ops):
                yield prog.device, k, op

    def __str__(self) -> str:
        return "\n".join(str(p) for p in self.devices)

    # -- invariants -----------------------------------------------------------------------------

    def verify(self) -> None:
        """Check every invariant (see the module docstring); :class:`VerifyError` on the first
        broken one: a bug in whatever made the programs, never a user mistake."""
        shapes = {name: (shape, dtype) for name, shape, dtype in self.relations}
        defined: dict[int, tuple[int, str, Region, str]] = {}  # buf -> device, relation, region, dtype
        full_of: dict[int, bool] = {}
        sends: dict[int, tuple[int, int, Region, str, bool]] = {}  # tag -> src, dst, region, dtype, full
        recvs: dict[int, tuple[int, int, Region, str, bool]] = {}
        selects: dict[tuple[int, bool], tuple[object, ...] | None] = {}  # (tag, at the sender) -> agreed
        meetings: dict[int, list[tuple[int, Collective]]] = {}  # tag -> (device, its op)
        in_group: dict[tuple[tuple[int, ...], int], list[int]] = {}  # (group, member) -> its tags in order
        for p in self.devices:
            if not (0 <= p.device < self.n_devices):
                raise VerifyError(f"program of unknown device {p.device}")
            live: set[int] = set()
            overwritten: set[int] = set()  # read last by a fused op that may write over them
            for op in p.ops:
                where = _At(p.device, op)  # printed only in an error
                for b in reads(op):
                    if b not in live:
                        raise VerifyError(f"{where}: reads %{b}, which is not defined (or freed) on this device")
                    if b in overwritten and not isinstance(op, Free):
                        raise VerifyError(f"{where}: reads %{b} after an op that may overwrite it")
                if isinstance(op, Fused):
                    overwritten.update(op.overwrites)
                if isinstance(op, Kernel):
                    for parts in op.reads:
                        for b, part in parts:
                            if not defined[b][2].contains(part):
                                raise VerifyError(f"{where}: %{b} does not cover {part}")
                elif isinstance(op, Fused):
                    made_inside: dict[int, Region] = {}
                    for k in op.body:
                        if isinstance(k, Kernel):
                            inputs = [part for ps in k.reads for part in ps]
                        else:
                            inputs = [(b, k.region) for b in k.sources]
                        for b, part in inputs:
                            if not (b in made_inside or b in live):
                                raise VerifyError(f"{where}: %{b} is not made before it is read")
                            region = made_inside[b] if b in made_inside else defined[b][2]
                            if not region.contains(part):
                                raise VerifyError(f"{where}: %{b} does not cover {part}")
                        made_inside[k.buf] = k.region
                    if op.body[-1].buf != op.buf:
                        raise VerifyError(f"{where}: the last inner op's buffer is not the op's")
                    if len(op.exported) != len(op.exports):
                        raise VerifyError(f"{where}: exports a buffer no inner op but the last makes")
                    if not set(op.overwrites) <= set(reads(op)):
                        raise VerifyError(f"{where}: overwrites a buffer it does not read")
                elif isinstance(op, Send):
                    _, rel, region, dtype = defined[op.buf]
                    if not region.contains(op.region):
                        raise VerifyError(f"{where}: %{op.buf} does not cover {op.region}")
                    if op.tag in sends:
                        raise VerifyError(f"{where}: tag #{op.tag} sent twice")
                    if op.peer == p.device:
                        raise VerifyError(f"{where}: sends to itself")
                    # A selective message's receiver holds the unsent cells absent.
                    sends[op.tag] = (p.device, op.peer, op.region, dtype, full_of[op.buf] and op.select is None)
                    selects[(op.tag, True)] = _check_select(op.select, defined, op.region, where)
                elif isinstance(op, Combine):
                    for b in op.sources:
                        if not defined[b][2].contains(op.region):
                            raise VerifyError(f"{where}: %{b} does not cover {op.region}")
                elif isinstance(op, Collective):
                    _check_collective(op, p.device, defined[op.source], full_of[op.source], where)
                    if not (op.group[-1] < self.n_devices):
                        raise VerifyError(f"{where}: a group of unknown devices")
                    members = meetings.setdefault(op.tag, [])
                    if any(d == p.device for d, _ in members):
                        raise VerifyError(f"{where}: collective #{op.tag} twice")
                    members.append((p.device, op))
                    in_group.setdefault((op.group, p.device), []).append(op.tag)
                if isinstance(op, Recv):
                    if op.tag in recvs:
                        raise VerifyError(f"{where}: tag #{op.tag} received twice")
                    recvs[op.tag] = (op.peer, p.device, op.region, op.dtype, op.full)
                    selects[(op.tag, False)] = _check_select(op.select, defined, op.region, where)
                if isinstance(op, Combine) and any(full_of[b] for b in op.sources) and not op.full:
                    raise VerifyError(f"{where}: a full source, not full")
                for m in made(op):
                    if m.buf in defined:
                        raise VerifyError(f"{where}: %{m.buf} defined twice")
                    if m.relation not in shapes:
                        raise VerifyError(f"{where}: unknown relation {m.relation}")
                    shape, _ = shapes[m.relation]
                    if len(m.region.axes) != len(shape):
                        raise VerifyError(f"{where}: region of rank {len(m.region.axes)}")
                    if not (
                        all(
                            not a or (a[0][0] >= 0 and a[-1][1] <= n) for a, n in zip(m.region.axes, shape, strict=True)
                        )
                    ):
                        raise VerifyError(f"{where}: region outside {m.relation}{list(shape)}")
                    if m.dtype not in dtypes.DTYPES:
                        raise VerifyError(f"{where}: bad dtype {m.dtype}")
                    defined[m.buf] = (p.device, m.relation, m.region, m.dtype)
                    full_of[m.buf] = m.full
                    live.add(m.buf)
                if isinstance(op, Free):
                    live.discard(op.buf)
        if set(sends) != set(recvs):
            raise VerifyError(f"unpaired sends or receives: tags {sorted(set(sends) ^ set(recvs))}")
        for tag, s in sends.items():
            r = recvs[tag]
            if s[:2] != r[:2]:
                raise VerifyError(f"#{tag}: sent {s[0]} -> {s[1]} but received {r[0]} <- {r[1]}")
            if s[2] != r[2]:
                raise VerifyError(f"#{tag}: sent {s[2]} but received {r[2]}")
            if s[3] != r[3]:
                raise VerifyError(f"#{tag}: sent {s[3]} but received {r[3]}")
            if s[4] != r[4]:
                raise VerifyError(f"#{tag}: sent a buffer with full={s[4]}, received one with full={r[4]}")
            if selects[(tag, True)] != selects[(tag, False)]:
                raise VerifyError(f"#{tag}: the sender and the receiver select different cells")
        for tag, members in meetings.items():
            d0, first = members[0]
            devices = sorted(d for d, _ in members)
            if devices != list(first.group):
                raise VerifyError(f"collective #{tag} is on devices {devices}, not {list(first.group)}")
            for d, op in members[1:]:
                if _agreed(op) != _agreed(first):
                    raise VerifyError(f"collective #{tag}: device {d} disagrees with device {d0}")
        for group in {op.group for members in meetings.values() for _, op in members}:
            orders = {d: in_group.get((group, d), []) for d in group}
            if not all(tags == orders[group[0]] for tags in orders.values()):
                raise VerifyError(f"the collectives of group {list(group)} come in different orders: {orders}")
        for out in self.outputs:
            if out.buf not in defined:
                raise VerifyError(f"output piece of {out.relation} in unknown %{out.buf}")
            dev, rel, region, _ = defined[out.buf]
            if not (dev == out.device and rel == out.relation):
                raise VerifyError(f"output piece %{out.buf} is not {out.relation}")
            if not region.contains(out.region):
                raise VerifyError(f"output piece %{out.buf} does not cover {out.region}")
        order = run_order(self)
        _check(len(order) == sum(len(p.ops) for p in self.devices), "the programs can deadlock: a wait cycle")

    # -- JSON -----------------------------------------------------------------------------------

    def to_json(self) -> str:
        return serialize.dumps(self)

    @staticmethod
    def from_json(text: str) -> Programs:
        """Programs written by :meth:`to_json`, verified; ValueError for anything else."""
        try:
            progs = serialize.loads(text, PROGRAM_CLASSES)
        except TypeError as exc:
            raise ValueError(f"malformed programs: {exc}") from None
        if not isinstance(progs, Programs):
            raise ValueError("JSON does not hold device programs")
        try:
            progs.verify()
        except VerifyError as exc:
            raise ValueError(f"the programs in this JSON are inconsistent: {exc}") from None
        return progs

    def fingerprint(self) -> str:
        """A hash of what the programs do: ranks compare it before running together."""
        blob = json.dumps(serialize.encode(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def with_frees(body: list[Op], freed: set[int]) -> list[Op]:
    """``body`` (ops of one device, without Frees) with a Free after the last reader of each
    buffer in ``freed`` that it still makes or reads: what a pass that moves, merges or drops
    ops uses to place the frees again."""
    last: dict[int, int] = {}
    for k, op in enumerate(body):
        for b in reads(op):
            last[b] = k
        for m in made(op):
            last.setdefault(m.buf, k)
    ends: dict[int, list[int]] = {}
    for b, k in last.items():
        if b in freed:
            ends.setdefault(k, []).append(b)
    out: list[Op] = []
    for k, op in enumerate(body):
        out.append(op)
        out.extend(Free(b) for b in sorted(ends.get(k, ())))
    return out


def run_order(progs: Programs) -> list[tuple[int, int]]:
    """(device, position) of every op in an order a runtime could run them: each device in
    program order, a receive after its send, a collective once every member of its group has
    come to it.  Shorter than the op count when the programs would wait for each other forever."""
    position = dict.fromkeys(range(progs.n_devices), 0)
    sent: set[int] = set()
    arrived: dict[int, set[int]] = {}  # collective tag -> the members that have come to it
    order: list[tuple[int, int]] = []
    progress = True
    while progress:
        progress = False
        for p in progs.devices:
            k = position[p.device]
            while k < len(p.ops):
                op = p.ops[k]
                if isinstance(op, Recv) and op.tag not in sent:
                    break
                if isinstance(op, Collective):
                    here = arrived.setdefault(op.tag, set())
                    here.add(p.device)
                    if not here.issuperset(op.group):
                        break
                if isinstance(op, Send):
                    sent.add(op.tag)
                order.append((p.device, k))
                k += 1
                progress = True
            position[p.device] = k
    return order


@dataclass(frozen=True)
class OpCost:
    """What an op costs: floating-point operations and the bytes it reads and writes (for a
    send or receive: the bytes moved), and the dtype a kernel computes in (its rule's: a bf16
    GEMM runs at the bf16 rate even when its partial sums are kept in f32)."""

    flops: int
    nbytes: int
    dtype: str = "f32"
    gemm: tuple[int, int, int, int] | None = None  # (batch, m, n, k) of a GEMM kernel, for its tiles
    general: bool = False  # a kernel the runtime evaluates on its general path (masks, passes)
    launches: Launches = (
        ONE_KERNEL  # kernels a runtime that does not fuse launches, by class (edatalog.ir.cost.launches)
    )


REDUCTIONS = ("sum", "prod", "max", "min")  # the aggregations a collective folds with


def _check_select(
    select: Select | None, defined: dict[int, tuple[int, str, Region, str]], message: Region, where: _At
) -> tuple[object, ...] | None:
    """What a selective message's end must agree on with the other (None: not selective), after
    checking that its route buffer covers the route's part and that the part runs along the
    message's rows."""
    if select is None:
        return None
    for b, part in select.reads:
        if not (select.region.contains(part) and defined[b][2].contains(part)) or defined[b][1] != select.relation:
            raise VerifyError(f"{where}: %{b} does not hold {select.relation}{part}")
    if len(select.axes) != len(select.region.axes) or not any(m is not None for m in select.axes):
        raise VerifyError(f"{where}: a selection's axes {select.axes} do not fit {select.region}")
    for axis, m in zip(select.region.axes, select.axes, strict=True):
        if m is not None and (not 0 <= m < len(message.axes) or message.axes[m] != axis):
            raise VerifyError(f"{where}: the route's part {select.region} does not run along {message}")
    if not select.lo < select.hi:
        raise VerifyError(f"{where}: an empty selection [{select.lo}, {select.hi})")
    return select.agreed()


def _check_collective(
    op: Collective, device: int, source: tuple[int, str, Region, str], source_full: bool, where: _At
) -> None:
    """One member's collective, on its own: its group, its pieces, its source and its result."""
    if not (len(op.group) >= 2 and list(op.group) == sorted(set(op.group))):
        raise VerifyError(f"{where}: bad group {list(op.group)}")
    if device not in op.group:
        raise VerifyError(f"{where}: device {device} is not in the group")
    _, relation, region, dtype = source
    if not (relation == op.relation and dtype == op.dtype):
        raise VerifyError(f"{where}: %{op.source} is {relation} in {dtype}")
    if not region.contains(op.part(device)):
        raise VerifyError(f"{where}: %{op.source} does not cover {op.part(device)}")
    if not (op.full and source_full):
        raise VerifyError(f"{where}: a collective of cells that may be absent")
    gather = op.kind is CollectiveKind.ALL_GATHER
    if not ((op.reduce is None) == gather and op.reduce in (None, *REDUCTIONS)):
        raise VerifyError(f"{where}: reduces with {op.reduce}")
    if op.kind is CollectiveKind.ALL_REDUCE:
        if op.pieces:
            raise VerifyError(f"{where}: an all-reduce has no pieces")
    else:
        if len(op.pieces) != len(op.group):
            raise VerifyError(f"{where}: {len(op.pieces)} pieces for {len(op.group)} members")
        if not all(op.whole.contains(r) for r in op.pieces):
            raise VerifyError(f"{where}: a piece outside {op.whole}")
        if not (
            sum(r.size for r in op.pieces) == op.whole.size
            and all(a.intersect(b).empty for k, a in enumerate(op.pieces) for b in op.pieces[k + 1 :])
        ):
            raise VerifyError(f"{where}: the pieces do not tile {op.whole}")
    mine = op.pieces[op.group.index(device)] if op.kind is CollectiveKind.REDUCE_SCATTER else op.whole
    if op.region != mine:
        raise VerifyError(f"{where}: makes {op.region}, not {mine}")


def _agreed(op: Collective) -> tuple[object, ...]:
    """What every member of a collective must agree on."""
    return (op.kind, op.group, op.relation, op.whole, op.pieces, op.reduce, op.dtype, op.full)


def region_bytes(region: Region, dtype: str) -> int:
    return intervals.box_size(region.axes) * dtypes.itemsize(dtype)


@dataclass(frozen=True)
class _At:
    """Where in the programs a check looks, printed only when it fails: ``device 1: %5 = ...``."""

    device: int
    op: object

    def __str__(self) -> str:
        return f"device {self.device}: {self.op}"


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise VerifyError(msg)


# Every class device programs are made of: what ``Programs.from_json`` may build, and nothing else.
PROGRAM_CLASSES: tuple[type, ...] = (
    Region,
    Load,
    Kernel,
    Fused,
    Send,
    Recv,
    Select,
    Combine,
    Collective,
    Free,
    DeviceProgram,
    OutputPiece,
    Programs,
)
