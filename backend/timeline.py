"""Time, traffic and memory of a schedule under the topology's cost model.

Every device has a compute engine and, per link class, an egress and an ingress port.  Tasks take
the resources they need (a kernel its device's engine; a transfer the sender's egress and the
receiver's ingress port) in the order their inputs become ready, program order among equals, and
start as soon as both inputs and resources are free: compute and communication overlap wherever
dependencies allow, and no transfer waits behind one whose data comes later.  Memory counts every
buffer from the start of the task that makes it to the end of its last reader; loaded inputs and
params, and outputs, stay.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from edatalog.backend.exchange import Combine, Compute, Load, Schedule, Send, Task
from edatalog.ir import dtypes
from edatalog.solver.costmodel import compute_seconds, transfer_seconds


@dataclass(frozen=True)
class Span:
    start: float
    end: float


@dataclass
class Report:
    seconds: float
    times: dict[int, Span]  # per task
    flops: dict[int, int]  # per device
    sent: dict[int, int]  # bytes per device
    received: dict[int, int]
    bytes_per_link: dict[tuple[int, int], int]  # (src, dst) -> bytes
    peak_memory: dict[int, int]  # bytes per device
    computed_blocks: dict[str, int] = field(default_factory=dict)  # node -> blocks computed (not replicas)

    @property
    def bytes_moved(self) -> int:
        return sum(self.bytes_per_link.values())


def analyze(s: Schedule) -> Report:
    n = s.plan.n_devices
    times: dict[int, Span] = {}
    free: dict[tuple[Any, ...], float] = {}
    flops = dict.fromkeys(range(n), 0)
    sent = dict.fromkeys(range(n), 0)
    received = dict.fromkeys(range(n), 0)
    per_link: dict[tuple[int, int], int] = {}
    for t in _by_readiness(s, times):
        ready = max((times[d].end for d in t.deps), default=0.0)
        duration, resources = _cost(s, t)
        start = max([ready, *(free.get(r, 0.0) for r in resources)])
        times[t.id] = Span(start, start + duration)
        for r in resources:
            free[r] = start + duration
        if isinstance(t, Compute | Combine):
            flops[t.device] += t.flops
        elif isinstance(t, Send):
            sent[t.device] += t.nbytes
            received[t.dst] += t.nbytes
            per_link[(t.device, t.dst)] = per_link.get((t.device, t.dst), 0) + t.nbytes
    seconds = max((sp.end for sp in times.values()), default=0.0)
    blocks: dict[str, set[int]] = {}
    for t in s.tasks:
        if isinstance(t, Compute):
            blocks.setdefault(t.node, set()).add(t.block)
    return Report(
        seconds,
        times,
        flops,
        sent,
        received,
        per_link,
        _peak_memory(s, times),
        {k: len(v) for k, v in blocks.items()},
    )


def _by_readiness(s: Schedule, times: dict[int, Span]) -> Iterator[Task]:
    """Tasks in the order their inputs become ready (program order among equals): each resource
    runs what is ready first, so a transfer never waits behind one whose data comes later.
    ``times`` is filled by the caller as each task is placed."""
    pending = {t.id: len(set(t.deps)) for t in s.tasks}
    readers: dict[int, list[int]] = {}
    for t in s.tasks:
        for d in set(t.deps):
            readers.setdefault(d, []).append(t.id)
    heap = [(0.0, t.id) for t in s.tasks if not pending[t.id]]
    heapq.heapify(heap)
    while heap:
        _, k = heapq.heappop(heap)
        yield s.tasks[k]
        for r in readers.get(k, ()):
            pending[r] -= 1
            if not pending[r]:
                heapq.heappush(heap, (max(times[d].end for d in s.tasks[r].deps), r))


def _cost(s: Schedule, t: Task) -> tuple[float, list[tuple[Any, ...]]]:
    topo = s.topology
    if isinstance(t, Load):
        return 0.0, []
    if isinstance(t, Compute | Combine):
        return compute_seconds(t.flops, t.nbytes, topo.devices[t.device], topo), [("compute", t.device)]
    assert isinstance(t, Send)
    link = topo.link(t.device, t.dst)
    return transfer_seconds(t.nbytes, link), [("out", t.device, link.name), ("in", t.dst, link.name)]


def _readers(s: Schedule) -> dict[int, list[int]]:
    """For every buffer, the tasks that read it."""
    out: dict[int, list[int]] = {}
    for t in s.tasks:
        if isinstance(t, Compute):
            for parts in t.reads:
                for buf, _ in parts:
                    out.setdefault(buf, []).append(t.id)
        elif isinstance(t, Send):
            out.setdefault(t.source, []).append(t.id)
        elif isinstance(t, Combine):
            for buf in t.sources:
                out.setdefault(buf, []).append(t.id)
    return out


def _peak_memory(s: Schedule, times: dict[int, Span]) -> dict[int, int]:
    readers = _readers(s)
    keep = {buf for entries in s.outputs.values() for e in entries for buf in e.holders.values()}
    events: dict[int, list[tuple[float, int]]] = {d: [] for d in range(s.plan.n_devices)}
    for buf in s.buffers.values():
        nbytes = buf.region.size * dtypes.itemsize(s.graph.relation(buf.relation).dtype)
        task = s.tasks[buf.task]
        born = times[buf.task].start
        resident = isinstance(task, Load) or buf.task in keep or buf.task not in readers
        events[buf.device].append((born, nbytes))
        # Resident buffers are never freed.  (Freeing them at the schedule's end freed them before
        # they were counted when the schedule ends as it starts: only loads, every block empty.)
        if not resident:
            events[buf.device].append((max(times[r].end for r in readers[buf.task]), -nbytes))
    peak = {}
    for d, evs in events.items():
        live = top = 0
        # At equal times frees go first: a buffer read by the task that makes the next one is
        # gone when that task ends, and a new buffer starts when its task starts.
        for _, delta in sorted(evs, key=lambda e: (e[0], e[1])):
            live += delta
            top = max(top, live)
        peak[d] = top
    return peak


def chrome_trace(s: Schedule, report: Report) -> dict[str, Any]:
    """The timeline as Chrome trace JSON (chrome://tracing, ui.perfetto.dev): one process per
    device, with lanes for compute, sends and receives."""
    events: list[dict[str, Any]] = []
    lanes = {"compute": 0, "send": 1, "recv": 2}
    for d in range(s.plan.n_devices):
        events.append({"name": "process_name", "ph": "M", "pid": d, "args": {"name": f"device {d}"}})
        for lane, tid in lanes.items():
            events.append({"name": "thread_name", "ph": "M", "pid": d, "tid": tid, "args": {"name": lane}})
    for t in s.tasks:
        sp = report.times[t.id]
        base = {"ts": sp.start * 1e6, "dur": max(sp.end - sp.start, 0.0) * 1e6, "ph": "X"}
        if isinstance(t, Compute):
            events.append(
                {
                    **base,
                    "name": t.node,
                    "cat": "compute",
                    "pid": t.device,
                    "tid": 0,
                    "args": {"block": t.block, "flops": t.flops, "bytes": t.nbytes},
                }
            )
        elif isinstance(t, Combine):
            events.append(
                {
                    **base,
                    "name": f"combine {t.relation}",
                    "cat": "reduce",
                    "pid": t.device,
                    "tid": 0,
                    "args": {"sources": len(t.sources), "bytes": t.nbytes},
                }
            )
        elif isinstance(t, Send):
            args = {"bytes": t.nbytes, "region": str(t.region)}
            events.append(
                {**base, "name": f"{t.relation} -> {t.dst}", "cat": "send", "pid": t.device, "tid": 1, "args": args}
            )
            events.append(
                {**base, "name": f"{t.relation} <- {t.device}", "cat": "recv", "pid": t.dst, "tid": 2, "args": args}
            )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"predicted_ms": report.seconds * 1e3}}


def write_trace(path: str, s: Schedule, report: Report) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(chrome_trace(s, report), fh)
