"""Time, traffic and memory of a plan's device programs under the topology's cost model.

The programs timed are the ones a runtime runs (:func:`edatalog.backend.lowering.lowered.as_run`:
attention fused into one kernel, exchanges that are whole collectives run as one where the
topology's communication library does so).  Every device has a compute engine and, per link
class, an egress and an ingress port.  Ops take the resources they need (a kernel, fused block
or combine its device's engine; a transfer, timed at its receive, the sender's egress and the
receiver's ingress port, and the pair itself) in the order their inputs become ready, synthesis
order among equals, and start as soon as both inputs and resources are free: compute and
communication overlap wherever dependencies allow, and no transfer waits behind one whose data
comes later.  A transfer holds its pair for its whole time and its ports for less
(:mod:`edatalog.solver.costmodel`): a device sending to several peers at once fills its port,
one pair does not.  A collective starts when all its members have come and their ports are
free, and holds every member's ports until it ends.  On a link whose transfers take the
computing devices' time (``Link.interference``: NCCL's kernels on the SMs, gloo's copies on the
CPU cores) communication also holds back each end's compute engine by that share of its time:
the kernel running then ends that much later, or the next one starts that much later.  A send
itself takes no time (it hands its data to the transfer).  What ops cost comes from the
schedule's cost table, not from the ops; a device's compute engine is first free after the
topology's ``call_overhead`` (the runtime taking the call).  Memory counts every buffer from the op that
makes it to its ``Free``, in program order (as the runtimes run a device's ops); buffers never
freed (loaded inputs and params, outputs) stay.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from edatalog.backend.lowering.lowered import Lowered
from edatalog.ir import program as ir
from edatalog.ir.program import region_bytes
from edatalog.solver.costmodel import (
    collective_bytes,
    compute_seconds,
    group_collective_seconds,
    one_node,
    port_seconds,
    transfer_seconds,
)


@dataclass(frozen=True)
class Span:
    start: float
    end: float


@dataclass
class Report:
    seconds: float
    times: dict[tuple[int, int], Span]  # per op of ``schedule``: (device, position in its program)
    flops: dict[int, int]  # per device
    sent: dict[int, int]  # bytes per device
    received: dict[int, int]
    bytes_per_link: dict[tuple[int, int], int]  # (src, dst) -> bytes
    peak_memory: dict[int, int]  # bytes per device
    computed_blocks: dict[str, int]  # node -> blocks computed (not replicas)
    lowered: Lowered  # what was timed: the programs as they run (attention fused, collectives)

    @property
    def bytes_moved(self) -> int:
        return sum(self.bytes_per_link.values())


Key = tuple[int, int]  # (device, position in its program)


@dataclass
class _Traffic:
    sent: dict[int, int]
    received: dict[int, int]
    per_link: dict[tuple[int, int], int] = field(default_factory=dict)

    def add(self, src: int, dst: int, nbytes: int) -> None:
        self.sent[src] += nbytes
        self.received[dst] += nbytes
        self.per_link[(src, dst)] = self.per_link.get((src, dst), 0) + nbytes


def analyze(s: Lowered) -> Report:
    """The lowered plan's time, traffic and memory, as its programs run."""
    n = s.programs.n_devices
    times: dict[Key, Span] = {}
    # Every device's program starts once the runtime has taken the call (its call overhead).
    free: dict[tuple[Any, ...], float] = {("compute", d): s.topology.call_overhead for d in range(n)}
    flops = dict.fromkeys(range(n), 0)
    traffic = _Traffic(dict.fromkeys(range(n), 0), dict.fromkeys(range(n), 0))
    graph = _Dag(s)
    for key in graph.by_readiness(times):
        op = graph.op[key]
        device = key[0]
        if isinstance(op, ir.Collective):
            if key not in times:  # its first member to come times it for every member
                _meet(s, graph, op.tag, times, free, traffic)
            continue
        ready = max((times[d].end for d in graph.deps[key]), default=0.0)
        duration, resources = _cost(s, key, op)
        start = max([ready, *(free.get(r, 0.0) for r, _ in resources)])
        times[key] = Span(start, start + duration)
        for r, held in resources:
            free[r] = start + held
        if isinstance(op, ir.Kernel | ir.Combine | ir.Fused):
            flops[device] += s.costs[key].flops
        elif isinstance(op, ir.Recv):
            _interfere(free, (op.peer, device), start, s.topology.link(op.peer, device).interference * duration)
            traffic.add(op.peer, device, s.costs[key].nbytes)
    seconds = max((sp.end for sp in times.values()), default=0.0)
    return Report(
        seconds,
        times,
        flops,
        traffic.sent,
        traffic.received,
        traffic.per_link,
        _peak_memory(s),
        _computed_blocks(s),
        s,
    )


def _computed_blocks(s: Lowered) -> dict[str, int]:
    """Per rule, its blocks computed (replicas once): its kernels' distinct ranges."""
    seen: dict[str, set[ir.Ranges]] = {}
    for _, _, op in s.programs.ops():
        for k in op.body if isinstance(op, ir.Fused) else (op,):
            if isinstance(k, ir.Kernel):
                seen.setdefault(k.node, set()).add(k.ranges)
    return {node: len(r) for node, r in seen.items()}


def _interfere(free: dict[tuple[Any, ...], float], devices: tuple[int, ...], start: float, lost: float) -> None:
    """Communication that began at ``start`` takes ``lost`` seconds from each device's compute."""
    if lost:
        for d in devices:
            free[("compute", d)] = max(free.get(("compute", d), 0.0), start) + lost


def _meet(
    s: Lowered, graph: _Dag, tag: int, times: dict[Key, Span], free: dict[tuple[Any, ...], float], traffic: _Traffic
) -> None:
    """Time one collective for all its members: it starts when every member has come and their
    ports are free, and holds every member's ports of its link class until it ends (NCCL's time,
    ring or tree, across nodes also hierarchical: :func:`group_collective_seconds`).  Each
    member sends its ring successor and receives from its predecessor the ring's share of the
    bytes."""
    members = graph.members[tag]
    op = graph.op[members[0]]
    assert isinstance(op, ir.Collective)
    group = op.group
    # Across nodes the collective holds the ports between nodes (flat or hierarchical, whichever
    # NCCL's time is shorter for: group_collective_seconds).
    nbytes = s.costs[members[0]].nbytes
    duration, link = group_collective_seconds(op.kind, nbytes, group, s.topology)
    ports = [(way, d, link.name) for d in group for way in ("out", "in")]
    ready = max((times[dep].end for key in members for dep in graph.deps[key]), default=0.0)
    start = max([ready, *(free.get(p, 0.0) for p in ports)])
    for key in members:
        times[key] = Span(start, start + duration)
    for p in ports:
        free[p] = start + duration
    _interfere(free, group, start, link.interference * duration)
    topo = s.topology
    moved = collective_bytes(op.kind, nbytes, len(group), topo.library, one_node(group, topo), topo.shared_memory)
    for k, d in enumerate(group):
        traffic.add(d, group[(k + 1) % len(group)], moved)


class _Dag:
    """The ops of every device (frees aside) with what each waits for: the ops that make the
    buffers it reads, for a receive its send, and for a collective what every member reads."""

    def __init__(self, s: Lowered) -> None:
        self.op: dict[Key, ir.Op] = {}
        self.deps: dict[Key, list[Key]] = {}
        self.maker: dict[int, Key] = {}
        self.members: dict[int, list[Key]] = {}  # collective tag -> its members' ops
        self.order: dict[Key, int] = {}  # synthesis order: buffers and tags are numbered in it
        send_of: dict[int, Key] = {}
        for device, k, op in s.programs.ops():
            if isinstance(op, ir.Free):
                continue
            key = (device, k)
            self.op[key] = op
            self.deps[key] = sorted({self.maker[b] for b in ir.reads(op)})
            for m in ir.made(op):
                self.maker[m.buf] = key
            if isinstance(op, ir.Send):
                send_of[op.tag] = key
            if isinstance(op, ir.Collective):
                self.members.setdefault(op.tag, []).append(key)
            self.order[key] = op.tag if isinstance(op, ir.Send) else op.buf
        for key, op in self.op.items():
            if isinstance(op, ir.Recv):
                self.deps[key].append(send_of[op.tag])
        for members in self.members.values():
            every = sorted({d for key in members for d in self.deps[key]})
            for key in members:
                self.deps[key] = every

    def by_readiness(self, times: dict[Key, Span]) -> Iterator[Key]:
        """Ops in the order their inputs become ready (synthesis order among equals): each
        resource runs what is ready first, so a transfer never waits behind one whose data comes
        later.  ``times`` is filled by the caller as each op is placed."""
        pending = {k: len(set(d)) for k, d in self.deps.items()}
        readers: dict[Key, list[Key]] = {}
        for k, deps in self.deps.items():
            for d in set(deps):
                readers.setdefault(d, []).append(k)
        heap = [(0.0, self.order[k], k) for k, c in pending.items() if not c]
        heapq.heapify(heap)
        while heap:
            _, _, k = heapq.heappop(heap)
            yield k
            for r in readers.get(k, ()):
                pending[r] -= 1
                if not pending[r]:
                    heapq.heappush(heap, (max(times[d].end for d in self.deps[r]), self.order[r], r))


def _cost(s: Lowered, key: Key, op: ir.Op) -> tuple[float, list[tuple[tuple[Any, ...], float]]]:
    """An op's time, and the resources it holds with how long it holds each."""
    topo = s.topology
    device = key[0]
    cost = s.costs[key]
    if isinstance(op, ir.Kernel | ir.Combine | ir.Fused):
        seconds = compute_seconds(
            cost.flops,
            cost.nbytes,
            topo.devices[device],
            topo,
            cost.dtype,
            cost.gemm,
            general=cost.general,
            launches=cost.launches,
        )
        return seconds, [(("compute", device), seconds)]
    if isinstance(op, ir.Recv):
        link = topo.link(op.peer, device)
        seconds, port = transfer_seconds(cost.nbytes, link), port_seconds(cost.nbytes, link)
        ports = [(("out", op.peer, link.name), port), (("in", device, link.name), port)]
        return seconds, [*ports, (("pair", op.peer, device, link.name), seconds)]
    return 0.0, []  # loads and sends


def _peak_memory(s: Lowered) -> dict[int, int]:
    """Each device's most bytes held, in the order its program runs: a device runs its ops one
    after another as the program lists them (the interpreter, a recorded graph, a CUDA
    stream), whatever order the timeline's overlap would allow, so a buffer lives from the op
    that makes it to its ``Free``.  (Rules that the program places late on purpose, such as
    recomputed activations, are late in memory too.)"""
    peak = {}
    for prog in s.programs.devices:
        live = top = 0
        size: dict[int, int] = {}
        for op in prog.ops:
            if isinstance(op, ir.Free):
                live -= size.pop(op.buf, 0)
                continue
            for m in ir.made(op):
                # Counted in the relation's type, as the solver's memory model counts it.
                size[m.buf] = region_bytes(m.region, s.graph.relation(m.relation).dtype)
                live += size[m.buf]
            top = max(top, live)
        peak[prog.device] = top
    return peak


def chrome_trace(report: Report) -> dict[str, Any]:
    """The timeline as Chrome trace JSON (chrome://tracing, ui.perfetto.dev): one process per
    device, with lanes for compute, sends and receives (a collective shows in both)."""
    s = report.lowered
    events: list[dict[str, Any]] = []
    lanes = {"compute": 0, "send": 1, "recv": 2}
    for d in range(s.programs.n_devices):
        events.append({"name": "process_name", "ph": "M", "pid": d, "args": {"name": f"device {d}"}})
        for lane, tid in lanes.items():
            events.append({"name": "thread_name", "ph": "M", "pid": d, "tid": tid, "args": {"name": lane}})
    for (device, k), sp in sorted(report.times.items()):
        op = s.programs.devices[device].ops[k]
        cost = s.costs[(device, k)]
        base = {"ts": sp.start * 1e6, "dur": max(sp.end - sp.start, 0.0) * 1e6, "ph": "X", "pid": device}
        if isinstance(op, ir.Kernel):
            block = {i: [lo, hi] for i, lo, hi in op.ranges}
            args = {"block": block, "flops": cost.flops, "bytes": cost.nbytes}
            events.append({**base, "name": op.node, "cat": "compute", "tid": 0, "args": args})
        elif isinstance(op, ir.Fused):
            args = {"rules": op.names(), "flops": cost.flops, "bytes": cost.nbytes}
            events.append({**base, "name": f"{op.kind} {op.relation}", "cat": "compute", "tid": 0, "args": args})
        elif isinstance(op, ir.Combine):
            args = {"sources": len(op.sources), "bytes": cost.nbytes}
            events.append({**base, "name": f"combine {op.relation}", "cat": "reduce", "tid": 0, "args": args})
        elif isinstance(op, ir.Collective):
            args = {"bytes": cost.nbytes, "group": list(op.group), "region": str(op.whole)}
            name = f"{op.kind.value} {op.relation}"
            for tid in (1, 2):
                events.append({**base, "name": name, "cat": "collective", "tid": tid, "args": args})
        elif isinstance(op, ir.Recv):
            args = {"bytes": cost.nbytes, "region": str(op.region)}
            events.append({**base, "name": f"{op.relation} <- {op.peer}", "cat": "recv", "tid": 2, "args": args})
            out = {**base, "pid": op.peer, "name": f"{op.relation} -> {device}", "cat": "send", "tid": 1}
            events.append({**out, "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"predicted_ms": report.seconds * 1e3}}


def write_trace(path: str, report: Report) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(chrome_trace(report), fh)
