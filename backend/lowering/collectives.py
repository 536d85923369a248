"""Exchanges that are known collectives, run as one collective over a group of devices.

Exchange synthesis (:mod:`edatalog.backend.lowering.exchange`) moves data by point-to-point messages
only: partials are reduce-scattered by direct sends (each member sends every other member that
member's piece of its partial, which the owner combines), and consumers then pull the pieces
they need.  Seen across all devices' programs, some of these exchanges are exactly a collective
over a group of devices:

- an **all-reduce**: every member holds a partial of one region, and after the exchange every
  member holds all of it combined (a reduce-scatter whose pieces every member then pulls: what
  Megatron's row-parallel layers do, twice per transformer block);
- a **reduce-scatter**: every member holds a partial of one region, and after the exchange each
  holds its own piece of it combined;
- an **all-gather**: every member holds a disjoint piece of one region, and every member pulls
  every other member's piece.

Why: a communication library runs such an exchange as one call, with algorithms that direct
messages cannot express (rings, trees, switch reductions: NCCL's all-reduce moves
``2 (n - 1) / n`` of the data per member at link speed, with its reduction fused into the
transfer), and with one launch where the programs post ``2 (n - 1)`` messages, a combine and a
wait per member.  :func:`use_collectives` finds these exchanges and replaces, on every member,
their sends, receives and combines by one :class:`~edatalog.ir.program.Collective` op, placed
where the member's first replaced receive or combine was.  The buffer it makes takes the id of
the member's combine (or of its first replaced receive), so what read the combined piece reads
it unchanged; reads of the pieces that were received read it instead (a buffer larger than the
part read is fine), and every Free is placed again after the last reader.  The programs still
verify and compute exactly the same values.

What stays point-to-point:

- partials that are not *full* (guards or supports leave cells absent): their presence masks
  travel with them, which no collective carries;
- exchanges that are not whole collectives: a piece pulled in parts or by only some members, a
  reduction to one owner, partials a member holds in several buffers;
- a candidate whose rewrite would let the programs wait for each other forever (a member would
  meet its group while another waits for a message it sends only after): each candidate is
  kept only if the programs still run to their end, in the meeting semantics of
  :func:`edatalog.ir.program.run_order`.

It is the last pass of the lowering (:mod:`edatalog.backend.lowering.lowered`), so the timeline,
the simulator and every runtime see the same collectives. Which kinds it applies is a field of
the lowering's options (``Collectives``): every kind, none, or by default the kinds the
machine's library runs faster as one call: every kind on NCCL and all-reduces only on gloo
(:attr:`edatalog.solver.topology.Library.collectives`). On gloo (2 CPU ranks of one thread, a
LLaMA block at D=1024, S=512, medians of 9 calls, measured side by side) the Megatron plan took
85.8 ms with its two all-reduces as ``all_reduce`` against 89.4 ms by direct messages, while the
plan whose one collective is an all-gather took 89.9 ms with ``all_gather_into_tensor`` against
88.6 ms without; gloo's ``reduce_scatter_tensor`` moved 0.54 GB/s of bus bandwidth where the
direct exchange moved 2.1 GB/s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from edatalog.backend.lowering.tasks import Entry
from edatalog.ir import intervals
from edatalog.ir import program as ir
from edatalog.ir.graph import AGG_NAMES, Graph
from edatalog.ir.regions import Region

Kind = ir.CollectiveKind


EVERY = frozenset(Kind)


@dataclass(frozen=True)
class Rewritten:
    """What :func:`use_collectives` made: the programs, and for every buffer it no longer makes
    (a received piece), the collective's buffer that holds its cells now."""

    programs: ir.Programs
    moved: Mapping[int, int]

    def collectives(self) -> dict[int, list[tuple[int, ir.Collective]]]:
        """Each collective (by tag) with its members' ops, by device."""
        return collectives_of(self.programs)

    def outputs(self, entries: Mapping[str, list[Entry]]) -> dict[str, list[Entry]]:
        """Where outputs end (a schedule's ``outputs``), held by the buffers that hold them now."""
        return {
            name: [Entry(e.region, {d: self.moved.get(b, b) for d, b in e.holders.items()}, e.routed) for e in pieces]
            for name, pieces in entries.items()
        }


def collectives_of(programs: ir.Programs) -> dict[int, list[tuple[int, ir.Collective]]]:
    """Each collective of the programs (by tag) with its members' ops, by device."""
    out: dict[int, list[tuple[int, ir.Collective]]] = {}
    for d, _, op in programs.ops():
        if isinstance(op, ir.Collective):
            out.setdefault(op.tag, []).append((d, op))
    return out


def use_collectives(programs: ir.Programs, graph: Graph, kinds: Collection[Kind] = EVERY) -> Rewritten:
    """The programs with every exchange that is a known collective of one of ``kinds`` run as
    one (see the module docstring).  Only full buffers take part: run the presence pass
    (:func:`edatalog.backend.lowering.presence.mark_full`) first."""
    index = _Index(programs)
    candidates = [c for c in _reductions(index, graph) if c.kind in kinds]
    claimed = {at for c in candidates for at in c.removed}
    if Kind.ALL_GATHER in kinds:
        candidates += _gathers(index, claimed)
    candidates.sort(key=lambda c: c.tag)
    rewritten = _rewrite(index, candidates)
    if _runs_through(rewritten.programs):
        return rewritten  # the usual case: no candidate makes the programs wait forever
    kept: list[_Candidate] = []
    rewritten = _rewrite(index, kept)
    for c in candidates:
        trial = _rewrite(index, [*kept, c])
        if _runs_through(trial.programs):
            kept.append(c)
            rewritten = trial
    return rewritten


def _runs_through(programs: ir.Programs) -> bool:
    """Whether no device of the programs can wait forever."""
    return len(ir.run_order(programs)) == sum(len(p.ops) for p in programs.devices)


# -- finding them ---------------------------------------------------------------------------------


@dataclass(eq=False)
class _Candidate:
    """An exchange that is a collective, as found: what each member's op will be, and which ops
    it replaces."""

    kind: ir.CollectiveKind
    group: tuple[int, ...]
    relation: str
    whole: Region
    pieces: tuple[Region, ...]
    reduce: str | None
    dtype: str
    source: dict[int, int]  # member -> the buffer its op reads
    result: dict[int, int]  # member -> the buffer its op makes (an id its replaced ops made)
    removed: set[tuple[int, int]] = field(default_factory=set)  # (device, position) of the ops replaced
    merged: dict[int, int] = field(default_factory=dict)  # buffer no longer made -> the result holding it
    tag: int = 0  # the smallest tag of the messages replaced: unique, and the same on every member

    def at(self, index: _Index) -> dict[int, int] | None:
        """Where each member's op goes: in place of its first replaced receive or combine, which
        must follow the op that makes its source; None where one does not."""
        out = {}
        for d in self.group:
            spots = [k for dev, k in self.removed if dev == d and not isinstance(index.op(d, k), ir.Send)]
            if not spots or index.made[self.source[d]][1] >= min(spots):
                return None
            out[d] = min(spots)
        return out

    def op(self, device: int) -> ir.Collective:
        member = self.group.index(device)
        region = self.pieces[member] if self.kind is Kind.REDUCE_SCATTER else self.whole
        pieces = () if self.kind is Kind.ALL_REDUCE else self.pieces
        return ir.Collective(
            self.result[device],
            self.kind,
            self.group,
            self.tag,
            self.relation,
            self.whole,
            pieces,
            self.source[device],
            self.reduce,
            region,
            self.dtype,
            True,
        )


class _Index:
    """Where every buffer is made, every message sent and received, and who reads what."""

    def __init__(self, programs: ir.Programs) -> None:
        self.programs = programs
        self.made: dict[int, tuple[int, int, ir.Op]] = {}  # buf -> device, position, the op making it
        self.sends: dict[int, tuple[int, int, ir.Send]] = {}  # tag -> device, position, send
        self.recvs: dict[int, tuple[int, int, ir.Recv]] = {}  # tag -> device, position, receive
        self.sends_of: dict[int, list[tuple[int, ir.Send]]] = {}  # buf -> (position, send) of it
        self.readers: dict[int, set[tuple[int, int]]] = {}  # buf -> (device, position) reading it (not Frees)
        for d, k, op in programs.ops():
            for m in ir.made(op):
                self.made[m.buf] = (d, k, m)
            if isinstance(op, ir.Send):
                self.sends[op.tag] = (d, k, op)
                self.sends_of.setdefault(op.buf, []).append((k, op))
            if isinstance(op, ir.Recv):
                self.recvs[op.tag] = (d, k, op)
            if not isinstance(op, ir.Free):
                for b in ir.reads(op):
                    self.readers.setdefault(b, set()).add((d, k))
        self.outputs = {piece.buf for piece in programs.outputs}

    def op(self, device: int, position: int) -> ir.Op:
        return self.programs.devices[device].ops[position]

    def info(self, buf: int) -> tuple[str, Region, str, bool]:
        """relation, region, dtype and fullness of a buffer."""
        op = self.made[buf][2]
        assert isinstance(op, ir.DEFINES)
        return op.relation, op.region, op.dtype, op.full


def _reductions(index: _Index, graph: Graph) -> list[_Candidate]:
    """Reduce-scatters (each member combines its own partial with the other members' pieces of
    theirs), extended to all-reduces where every member then receives every other member's
    combined piece whole."""
    found: dict[tuple[str, tuple[tuple[int, int], ...]], list[tuple[int, int, ir.Combine, set[tuple[int, int]]]]] = {}
    for d, k, op in index.programs.ops():
        if not isinstance(op, ir.Combine) or not op.full:
            continue
        reduce = AGG_NAMES.get(graph.relation(op.relation).aggop or "=")
        if reduce not in ir.REDUCTIONS:
            continue
        partials: dict[int, int] = {}  # member -> its partial
        removed = {(d, k)}
        own = [b for b in op.sources if not isinstance(index.made[b][2], ir.Recv)]
        if len(own) != 1:
            continue
        partials[d] = own[0]
        for b in op.sources:
            _, at, recv = index.made[b]
            if not isinstance(recv, ir.Recv):
                continue
            sd, sk, send = index.sends[recv.tag]
            if recv.select is not None or recv.region != op.region or sd in partials:
                break  # a selective message is no collective's (its size depends on values)
            if index.readers.get(b, set()) != {(d, k)}:
                break
            if b in index.outputs:
                break
            partials[sd] = send.buf
            removed |= {(d, at), (sd, sk)}
        else:
            if len(partials) < 2:
                continue
            if not all(_fits(index, b, op.relation, op.region, op.dtype) for b in partials.values()):
                continue
            found.setdefault((op.relation, tuple(sorted(partials.items()))), []).append((d, k, op, removed))
    out = []
    for (relation, held), members in found.items():
        group = tuple(d for d, _ in held)
        if sorted(d for d, _, _, _ in members) != list(group):
            continue  # not one combine per member: a reduction to fewer owners than partials
        members.sort(key=lambda m: m[0])
        pieces = tuple(c.region for _, _, c, _ in members)
        whole = _union(pieces)
        source = dict(held)
        if whole is None or not all(_fits(index, source[d], relation, whole, members[0][2].dtype) for d in group):
            continue
        reduce = AGG_NAMES[graph.relation(relation).aggop or "="]
        c = _Candidate(
            Kind.REDUCE_SCATTER,
            group,
            relation,
            whole,
            pieces,
            reduce,
            members[0][2].dtype,
            source,
            {d: c.buf for d, _, c, _ in members},
        )
        for _, _, _, removed in members:
            c.removed |= removed
        _gathered(index, c)
        c.tag = min(op.tag for d, k in c.removed if isinstance(op := index.op(d, k), ir.Send))
        if c.at(index) is not None:
            out.append(c)
    return out


def _gathered(index: _Index, c: _Candidate) -> None:
    """Make a reduce-scatter an all-reduce when every member receives every other member's
    combined piece, whole, in one message from it."""
    removed: set[tuple[int, int]] = set()
    merged: dict[int, int] = {}
    for k, piece in zip(c.group, c.pieces, strict=True):
        to: dict[int, tuple[int, int]] = {}
        for pos, send in index.sends_of.get(c.result[k], []):
            if send.region == piece and send.peer in c.group and send.peer not in to:
                to[send.peer] = (pos, send.tag)
        if set(to) != set(c.group) - {k}:
            return
        for j, (pos, tag) in to.items():
            _, at, recv = index.recvs[tag]
            removed |= {(k, pos), (j, at)}
            merged[recv.buf] = c.result[j]
    c.kind, c.removed, c.merged = Kind.ALL_REDUCE, c.removed | removed, merged


def _gathers(index: _Index, claimed: set[tuple[int, int]]) -> list[_Candidate]:
    """All-gathers: every member sends its piece of a region, whole, to every other member, and
    nowhere else."""
    offers: dict[tuple[str, tuple[int, ...]], list[tuple[int, int, Region, list[tuple[int, int]]]]] = {}
    for buf, sends in index.sends_of.items():
        d = index.made[buf][0]
        relation, _, _, full = index.info(buf)
        if not full:
            continue
        by_region: dict[Region, list[tuple[int, ir.Send]]] = {}
        for pos, send in sends:
            if send.select is None:  # a selective message is no collective's
                by_region.setdefault(send.region, []).append((pos, send))
        for region, same in by_region.items():
            peers = [s.peer for _, s in same]
            if len(set(peers)) != len(peers) or any((d, pos) in claimed for pos, _ in same):
                continue
            group = tuple(sorted({d, *peers}))
            offers.setdefault((relation, group), []).append((d, buf, region, [(pos, s.tag) for pos, s in same]))
    out = []
    for (relation, group), listed in offers.items():
        if sorted(d for d, _, _, _ in listed) != list(group):
            continue  # not one piece per member
        listed.sort(key=lambda o: o[0])
        pieces = tuple(region for _, _, region, _ in listed)
        whole = _union(pieces)
        dtype = index.info(listed[0][1])[2]
        if whole is None or any(index.info(b)[2] != dtype for _, b, _, _ in listed):
            continue
        source = {d: b for d, b, _, _ in listed}
        c = _Candidate(Kind.ALL_GATHER, group, relation, whole, pieces, None, dtype, source, {})
        for d, _, _, sent in listed:
            for pos, tag in sent:
                j, at, recv = index.recvs[tag]
                c.removed |= {(d, pos), (j, at)}
                c.merged[recv.buf] = recv.buf  # the result takes the id of the member's first receive
        for j in group:
            first = index.op(j, min(k for dev, k in c.removed if dev == j and isinstance(index.op(j, k), ir.Recv)))
            assert isinstance(first, ir.Recv)
            c.result[j] = first.buf
        c.merged = {b: c.result[index.made[b][0]] for b in c.merged if b != c.result[index.made[b][0]]}
        c.tag = min(tag for _, _, _, sent in listed for _, tag in sent)
        if c.at(index) is not None:
            out.append(c)
    return out


def _fits(index: _Index, buf: int, relation: str, region: Region, dtype: str) -> bool:
    """Whether a buffer is a full piece of ``relation`` covering ``region``, in ``dtype``."""
    rel, held, dt, full = index.info(buf)
    return full and rel == relation and dt == dtype and held.contains(region)


def _union(regions: Sequence[Region]) -> Region | None:
    """The region disjoint ``regions`` fill together, when it is one: they agree on every axis
    but one, along which their coordinates join."""
    first = regions[0]
    differ = [a for a in range(len(first.axes)) if any(r.axes[a] != first.axes[a] for r in regions)]
    if len(differ) != 1 or any(r.empty for r in regions):
        return None
    a = differ[0]
    joined = intervals.merge(run for r in regions for run in r.axes[a])
    if intervals.size(joined) != sum(intervals.size(r.axes[a]) for r in regions):
        return None  # they overlap
    return Region((*first.axes[:a], joined, *first.axes[a + 1 :]))


# -- rewriting ----------------------------------------------------------------------------------


def _rewrite(index: _Index, chosen: Sequence[_Candidate]) -> Rewritten:
    """The programs with the ``chosen`` collectives in place of the ops they replace."""
    programs = index.programs
    if not chosen:
        return Rewritten(programs, {})
    placed: dict[tuple[int, int], ir.Collective] = {}
    removed: set[tuple[int, int]] = set()
    moved: dict[int, int] = {}
    for c in chosen:
        at = c.at(index)
        assert at is not None
        for d, k in at.items():
            placed[(d, k)] = c.op(d)
        removed |= c.removed
        moved.update(c.merged)
    devices = []
    for p in programs.devices:
        freed = {op.buf for op in p.ops if isinstance(op, ir.Free)}
        # A buffer that now also holds what another held is freed only if both were.
        keep = {moved[b] for b in moved if index.made[b][0] == p.device and b not in freed}
        body: list[ir.Op] = []
        for k, op in enumerate(p.ops):
            if (p.device, k) in placed:
                body.append(placed[(p.device, k)])
            elif (p.device, k) not in removed and not isinstance(op, ir.Free):
                body.append(_renamed(op, moved))
        devices.append(ir.DeviceProgram(p.device, tuple(ir.with_frees(body, freed - keep))))
    outputs = tuple(ir.OutputPiece(o.relation, o.region, o.device, moved.get(o.buf, o.buf)) for o in programs.outputs)
    return Rewritten(ir.Programs(programs.graph, programs.relations, tuple(devices), outputs), moved)


def _renamed(op: ir.Op, moved: Mapping[int, int]) -> ir.Op:
    """``op`` reading, for each moved buffer, the buffer holding its cells now."""
    if not any(b in moved for b in ir.reads(op)):
        return op
    if isinstance(op, ir.Kernel):
        return _renamed_kernel(op, moved)
    if isinstance(op, ir.Fused):
        body = tuple(_renamed(k, moved) for k in op.body)
        overwrites = tuple(dict.fromkeys(moved.get(b, b) for b in op.overwrites))
        return dataclasses.replace(op, body=body, overwrites=overwrites)  # type: ignore[arg-type]
    if isinstance(op, ir.Combine):
        sources = tuple(moved.get(b, b) for b in op.sources)
        return ir.Combine(op.buf, op.relation, op.region, sources, op.dtype, op.full)
    if isinstance(op, ir.Send):
        return ir.Send(moved.get(op.buf, op.buf), op.peer, op.tag, op.region, _moved_select(op.select, moved))
    if isinstance(op, ir.Recv):
        return dataclasses.replace(op, select=_moved_select(op.select, moved))
    raise AssertionError(f"{op} reads a moved buffer")


def _moved_select(select: ir.Select | None, moved: Mapping[int, int]) -> ir.Select | None:
    if select is None:
        return None
    return dataclasses.replace(select, reads=tuple((moved.get(b, b), r) for b, r in select.reads))


def _renamed_kernel(op: ir.Kernel, moved: Mapping[int, int]) -> ir.Kernel:
    """A kernel reading moved buffers from where they are now; the parts of one input that now
    read one buffer and join into one region are read as one (a view, not a copy)."""
    reads = []
    for parts in op.reads:
        renamed = tuple((moved.get(b, b), r) for b, r in parts)
        bufs = {b for b, _ in renamed}
        joined = _union([r for _, r in renamed]) if len(bufs) == 1 and len(renamed) > 1 else None
        reads.append(((renamed[0][0], joined),) if joined is not None else renamed)
    return ir.Kernel(op.buf, op.node, op.ranges, tuple(reads), op.relation, op.region, op.dtype, op.full)
