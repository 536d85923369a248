"""All-reduces between the CPU ranks of one machine through shared memory.

Why: gloo moves every message through a TCP socket and two woken threads (its I/O loop, then
the waiting caller).  Between busy CPU ranks of one machine that costs 0.1-0.3 ms a message
whatever its size, and gloo's own all-reduce of 2 MiB 1.2-1.6 ms, where the bytes themselves
take a few tens of microseconds to copy.  Ranks of one machine can instead meet in a segment of
shared memory: each writes its tensor into its own slot, says so with a sequence number, waits
until every member has, and reduces all the slots itself.  Measured on a 2-core VM (2 ranks,
after small kernels, ``benchmarks/small_all_reduce.py``): 8-10 µs for 2 KiB and 150-170 µs for
2 MiB, against gloo's 0.9-1.7 and 1.7-2.7 ms.  CPU inference runtimes do the same
(DeepSpeed's shared-memory all-reduce for tensor parallelism on CPUs; oneCCL inside a node).

The segment, made by the group's first member and mapped by the others: one flag per member (a
cache line each, so that members do not share one), then two sets of slots, one per member each,
of :data:`~edatalog.solver.costmodel.SHARED_MEMORY_SLOT_BYTES` (as the cost model prices it).  A
call's k-th chunk (a tensor larger than a slot goes by chunks) uses the set of its sequence
number's parity:

1. copy the chunk into this member's slot, then store the sequence number in its flag;
2. wait until every member's flag has reached it;
3. reduce the members' slots in member order (the first's value first, so every member gets
   the same bits) into the chunk.

A member writes a set again two sequence numbers later, after step 2 of the one in between has
seen every member arrive there, so after each has finished reading the set (its reads came
before its store of the next flag).  That order needs stores seen in program order and loads
not passed by later stores, which x86-64 guarantees (TSO); Python gives no fences, so the
segment is used on x86-64 only.  Elsewhere, or when the members are not on one machine (the
group's hosts and boot ids differ) or ``/dev/shm`` is missing, :func:`register` makes nothing
and the runtime takes the next route of :func:`edatalog.solver.costmodel.all_reduce_route`
(pairwise exchanges, or gloo's own).

Waiting spins on the flags for a while (a member comes within microseconds when both run), then
yields the core at each look (ranks sharing cores), then after a millisecond sleeps between
looks (a member far behind, compiling or loading), and gives up after the group's timeout with
an error that names the member that never came: a rank that failed ends the job, never hangs it.
A flag holds its sequence number and a check of what the call reduces: members that reach
different all-reduces at the same point fail with an error instead of mixing their data.
"""

from __future__ import annotations

import functools
import mmap
import os
import platform
import secrets
import socket
import time
import zlib
from collections.abc import Callable
from typing import Any

from edatalog.backend.kernels.arrays import torch_module
from edatalog.backend.running.exchange_all_reduce import COMBINE
from edatalog.backend.running.fxnodes import all_reduce_op
from edatalog.solver.costmodel import SHARED_MEMORY_SLOT_BYTES

_LINE = 64  # bytes: a flag per cache line
_NAME_BYTES = 64
_SPINS = 2000  # looks at the flags (~0.1 ms) before yielding the core at each look
_YIELDING = 1e-3  # seconds of yielding before sleeping between looks (up to a millisecond)
_CHECK_BITS = 24  # a flag: the sequence number, then this many bits of what the call reduces

_GROUPS: dict[str, SharedMemoryAllReduce] = {}  # process group name -> its segment
# The ranks of a group -> their segment: a later group of the same ranks (every executable makes
# its own process groups) shares it, with the first's timeout and slots.  Every member registered
# the same groups in the same order and runs its collectives in program order, so their sequence
# numbers still agree; each flag also says what its call reduces, so members whose calls differ
# (another group, size, dtype or reduction at the same point) fail rather than mix their data.
_SEGMENTS: dict[tuple[int, ...], SharedMemoryAllReduce] = {}


class SharedMemoryAllReduce:
    """One process group's segment and its all-reduce; made by :func:`register`."""

    def __init__(
        self, buffer: mmap.mmap, members: int, me: int, timeout: float, ranks: list[int], slot_bytes: int
    ) -> None:
        import numpy as np

        torch = torch_module()
        self.members, self.me, self.timeout, self.ranks, self.slot = members, me, timeout, ranks, slot_bytes
        self._buffer = buffer  # kept: the arrays below are views of it
        header = members * _LINE
        self._flags = np.frombuffer(buffer, dtype=np.int64, count=header // 8)[:: _LINE // 8]
        self._data = torch.frombuffer(buffer, dtype=torch.uint8, count=2 * members * slot_bytes, offset=header)
        self._typed: dict[Any, list[list[Any]]] = {}  # dtype -> [parity][member] -> the slot
        self.sequence = 0

    def _slots(self, dtype: Any) -> list[list[Any]]:
        slots = self._typed.get(dtype)
        if slots is None:
            cut = [self._data[k * self.slot : (k + 1) * self.slot] for k in range(2 * self.members)]
            slots = [[c.view(dtype) for c in cut[p * self.members : (p + 1) * self.members]] for p in range(2)]
            self._typed[dtype] = slots
        return slots

    def all_reduce_(self, x: Any, reduce: str, group: str) -> Any:
        """Reduce ``x`` (contiguous, on the CPU) in place over the group named ``group``; returns
        ``x``."""
        torch = torch_module()
        name = COMBINE.get(reduce)
        if name is None:
            raise ValueError(f"no shared-memory all-reduce for the reduction {reduce!r}")
        if not x.is_contiguous():
            raise ValueError("a shared-memory all-reduce takes a contiguous tensor")
        combine = getattr(torch, name)
        flat = x.view(-1)
        slots = self._slots(x.dtype)
        per = self.slot // x.element_size()
        check = zlib.crc32(f"{group} {flat.numel()} {x.dtype} {reduce}".encode()) & ((1 << _CHECK_BITS) - 1)
        for lo in range(0, flat.numel(), per):
            chunk = flat[lo : lo + per]
            count = chunk.numel()
            self.sequence += 1
            mine = slots[self.sequence & 1]
            mine[self.me][:count].copy_(chunk)
            self._flags[self.me] = self.sequence << _CHECK_BITS | check
            self._wait(self.sequence, check)
            combine(mine[0][:count], mine[1][:count], out=chunk)
            for k in range(2, self.members):
                combine(chunk, mine[k][:count], out=chunk)
        return x

    def _wait(self, sequence: int, check: int) -> None:
        """Until every member's flag has reached ``sequence`` (one whose flag is at it must be
        reducing what this member is: ``check``)."""
        flags, spins, since = self._flags, 0, 0.0
        for member in range(self.members):
            while (flag := int(flags[member])) >> _CHECK_BITS < sequence:
                spins += 1
                if spins < _SPINS:
                    continue
                now = time.monotonic()
                since = since or now
                if now - since < _YIELDING:
                    os.sched_yield()
                elif now - since <= self.timeout:
                    time.sleep(min(1e-3, (now - since) / 20))  # a member that is far behind: free the core
                else:
                    raise RuntimeError(  # "timed out": what the runtime and launcher look for
                        f"rank {self.ranks[self.me]} timed out after {self.timeout:g} s waiting for rank "
                        f"{self.ranks[member]} in a shared-memory all-reduce: that rank failed or is stuck"
                    )
            if flag >> _CHECK_BITS == sequence and flag & ((1 << _CHECK_BITS) - 1) != check:
                raise RuntimeError(
                    f"ranks {self.ranks[self.me]} and {self.ranks[member]} reached a shared-memory all-reduce "
                    "of different tensors or groups at the same point of their programs"
                )


def register(group: Any, timeout: float, slot_bytes: int = SHARED_MEMORY_SLOT_BYTES) -> bool:
    """Make a segment for ``group`` (every member calls this, in the same order as its other
    collectives on the group): True if the members share it, False where they cannot (not one
    machine, not x86-64, no ``/dev/shm``), and then nothing was made.  ``slot_bytes``: the
    cost model's, but for tests."""
    torch = torch_module()
    dist = torch.distributed
    if group.group_name in _GROUPS:
        return True
    ranks = dist.get_process_group_ranks(group)
    members, me = len(ranks), ranks.index(dist.get_rank())
    if members < 2:
        return False
    if tuple(ranks) in _SEGMENTS:
        _GROUPS[group.group_name] = _SEGMENTS[tuple(ranks)]
        return True
    able = platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")
    facts = torch.tensor([int(able), _host_key()], dtype=torch.int64)
    every = [torch.empty_like(facts) for _ in ranks]
    dist.all_gather(every, facts, group=group)
    if not all(int(f[0]) for f in every) or len({int(f[1]) for f in every}) != 1:
        return False
    size = members * _LINE + 2 * members * slot_bytes
    name = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
    path, buffer = "", None
    if me == 0:
        path = f"/dev/shm/edatalog-{os.getpid()}-{secrets.token_hex(8)}"
        buffer = _map(path, size, create=True)
        if buffer is not None:
            name[: len(path)] = torch.tensor(list(path.encode()), dtype=torch.uint8)
    mapped = torch.zeros(1, dtype=torch.int64)
    try:
        dist.broadcast(name, ranks[0], group=group)
        if me != 0:
            path = bytes(name[name != 0].tolist()).decode()
            buffer = _map(path, size, create=False) if path else None
        mapped[0] = int(buffer is not None)
        dist.all_reduce(mapped, op=dist.ReduceOp.MIN, group=group)  # every member mapped it, or none uses it
    finally:
        if me == 0 and buffer is not None:
            os.unlink(path)  # mapped by all who will: the name goes, the memory stays while mapped
    if not int(mapped) or buffer is None:
        return False
    made = SharedMemoryAllReduce(buffer, members, me, timeout, ranks, slot_bytes)
    _GROUPS[group.group_name] = _SEGMENTS[tuple(ranks)] = made
    return True


def barrier_of(group: Any, timeout: float) -> Callable[[], None]:
    """A barrier of ``group`` (every member calls this, as :func:`register`) that its members
    leave together and awake: through the group's segment where they share memory (a one-cell
    all-reduce: each spins until all came, and all leave within microseconds), else
    torch.distributed's.  Why: gloo's barrier wakes each member by a message, tens of
    microseconds apart, and a member that slept in it starts with cold caches; on a 2-core VM a
    tiny GPT-2's call on 2 ranks took 80-100 µs more after it than in a loop.  Timed calls meet
    here first (``edl run``, calibration, the benchmarks' contenders alike)."""
    dist = torch_module().distributed
    if dist.get_backend(group) != "gloo" or not register(group, timeout):
        return lambda: dist.barrier(group=group)
    token, name = torch_module().zeros(1), group.group_name
    return lambda: shm_all_reduce_(token, "sum", name)


def registered(group_name: str) -> bool:
    """Whether the group of that name all-reduces through shared memory."""
    return group_name in _GROUPS


def shm_all_reduce(x: Any, reduce: str, group: str) -> Any:
    """The reduction of ``x`` over the registered group ``group`` (its name), as a fresh tensor;
    what a recorded graph calls (:func:`shm_all_reduce_op`, or this function directly)."""
    return _GROUPS[group].all_reduce_(x.clone(memory_format=torch_module().contiguous_format), reduce, group)


def shm_all_reduce_(x: Any, reduce: str, group: str) -> Any:
    """Reduce ``x`` (contiguous) in place over the registered group ``group``; returns ``x``."""
    return _GROUPS[group].all_reduce_(x, reduce, group)


@functools.cache
def shm_all_reduce_op() -> Any:
    """``edatalog::shm_all_reduce(Tensor x, str reduce, str group) -> Tensor``: as
    :func:`shm_all_reduce`, an op that a graph records
    (:func:`~edatalog.backend.running.fxnodes.all_reduce_op`)."""
    return all_reduce_op("shm_all_reduce", shm_all_reduce)


def _map(path: str, size: int, create: bool) -> mmap.mmap | None:
    """The segment at ``path`` mapped (made ``size`` bytes long first if ``create``), or None."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError:
        return None
    try:
        if create:  # taken now: a full /dev/shm is an error here, not a SIGBUS at the first write
            os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size)
    except OSError:
        if create:
            os.unlink(path)
        return None
    finally:
        os.close(fd)


def _host_key() -> int:
    """This machine's name and boot as one number: members that share it share ``/dev/shm``."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return zlib.crc32(f"{socket.gethostname()}\0{boot}".encode())
