"""The torch runtime across processes (SPMD): rank ``r`` of a torch.distributed group runs
device ``r``'s program; gloo on CPU, NCCL on CUDA; one node or many (``torchrun --nnodes``).

- **Agreement.** Before anything runs, the ranks compare the fingerprints of their programs
  and plans: a rank that compiled another program or loaded another plan is an error on every
  rank, not a hang.
- **Weights** are loaded once; each rank keeps only the blocks its program loads.  From a
  safetensors file it reads only those slices.
- **Exchanges.** Each run of consecutive sends and receives in a program is posted as one batch
  of point-to-point ops (``batch_isend_irecv``); each receive is waited for where an op first
  reads it, so the ops in between run while it travels.  Every receive follows
  its send in one global order (see :mod:`edatalog.backend.lowering.exchange`), so the batches cannot
  wait for each other forever.  Buffers that are not *full* send which cells exist with them.
- **Collectives.** Exchanges that the lowering made collectives (all-reduce, reduce-scatter,
  all-gather over a group of ranks, as the lowered plan's options asked) run as one
  torch.distributed collective on a group of their own
  (:mod:`edatalog.backend.running.collective_ops`).
- **Outputs** end where the plan leaves them; a call brings each output whole to every rank
  (a broadcast from a rank holding each piece that not every rank holds), or returns this
  rank's pieces.
- **Faults.** The group's timeout bounds every wait (:data:`TIMEOUT_SECONDS`); a rank that dies
  is seen by the launcher, which stops the others (:mod:`edatalog.backend.running.launch`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

from edatalog.backend.kernels.arrays import TorchOps, torch_module, wire_dtype
from edatalog.backend.lowering.lowered import Lowered
from edatalog.backend.running import selection
from edatalog.backend.running.carry import all_local, carried_loads, own, taking
from edatalog.backend.running.collective_ops import TorchCollectives
from edatalog.backend.running.interpreter import NO_MESSAGES, Buffer, Device, Kernels, gather, slicer
from edatalog.backend.running.launch import TIMED_OUT
from edatalog.backend.running.shm_all_reduce import barrier_of
from edatalog.backend.running.torch_runtime import OpTime, Outputs, op_label, torch_devices
from edatalog.errors import EdlError
from edatalog.ir import program as ir
from edatalog.ir.graph import Graph
from edatalog.ir.regions import Region

TIMEOUT_SECONDS = float(os.environ.get("EDL_DIST_TIMEOUT", "45"))  # the longest any rank waits for another


def init_group(device: str | None = None) -> str:
    """Join the torch.distributed group of this job (started by torchrun or by
    :func:`edatalog.backend.running.launch.spawn`), once: NCCL when the ranks use CUDA, else gloo.
    Returns the torch device this rank computes on."""
    torch = torch_module()
    dist = torch.distributed
    use_cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=TIMEOUT_SECONDS))
    if use_cuda:
        torch.cuda.set_device(local)
        return f"cuda:{local}"
    return "cpu"


def exchanged(program: ir.DeviceProgram) -> tuple[bool, ...]:
    """Per op of a rank's program, whether it runs with the exchanges, outside any graph: a send,
    a receive, or a combine of partials that reads a received one (a reduce-scatter's), which
    runs where its result is first read (:meth:`Device.combine_later`), not where it stands.
    The programs place such a combine right after its receive, so waiting there would hold the
    rank until the message came; deferred, the reduction travels while later ops run, as the
    timeline predicts it."""
    received = {op.buf for op in program.ops if isinstance(op, ir.Recv)}
    out: list[bool] = []
    for op in program.ops:
        if isinstance(op, ir.Free):  # the Frees right after such ops go with them
            out.append(bool(out) and out[-1])
        else:
            out.append(
                isinstance(op, ir.Send | ir.Recv)
                or (isinstance(op, ir.Combine) and not received.isdisjoint(op.sources))
            )
    return tuple(out)


def in_group_of(n: int) -> bool:
    """Whether this process is a rank of an initialized group of ``n`` ranks."""
    dist = torch_module().distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() == n


class SpmdExecutable:
    """This rank's program of a plan, ready to run with the other ranks of the group."""

    def __init__(self, graph: Graph, lowered: Lowered, device: str | None = None) -> None:
        torch = torch_module()
        self.dist = torch.distributed
        n = lowered.n_devices
        if not in_group_of(n):
            world = self.dist.get_world_size() if self.dist.is_initialized() else 1
            raise EdlError(
                f"the plan has {n} devices, but this group has {world} ranks",
                help=f"start {n} ranks (edl run --nproc {n}, or torchrun --nproc-per-node {n})",
            )
        self.rank, self.world = self.dist.get_rank(), n
        self.graph, self.lowered = graph, lowered
        programs = lowered.programs
        self.outputs = lowered.outputs  # where each output ends: by buffer, as the programs run
        self.program = programs.devices[self.rank]
        self.exchanged = exchanged(self.program)
        default = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() and device != "cpu" else "cpu"
        self.device = torch_devices(device or default, 1)[0]
        self.xp = TorchOps(self.device)
        self.kernels = Kernels(graph)
        self.blocks: dict[int, Any] = {}
        self.exclusive: set[int] = set()  # held carried blocks no one else holds (see ``carry``)
        made = [m for _, _, op in programs.ops() for m in ir.made(op)]
        self.full = {op.buf: op.full for op in made}
        self.buffer_dtype = {op.buf: op.dtype for op in made}
        self.last_times: list[OpTime] = []
        self.last_peak: dict[int, int] = {}  # this rank's device -> the most bytes it held in the last call
        self._in_flight: list[Any] = []  # sends posted and not yet waited for
        self._kept: list[Any] = []  # what they send
        self._agree()
        self.collective_ops = TorchCollectives(programs, self.rank, self.device, TIMEOUT_SECONDS)
        # State carried from call to call (a training step's params and optimizer state).
        every = carried_loads(graph, lowered)
        self.carried = tuple(c for c in every if c.device == self.rank)
        self.carried_local = all_local(every)  # the same on every rank: the programs decide it
        self.loadable = {r.name for r in graph.relations if r.kind == "param"} | set(graph.carried)

    def _agree(self) -> None:
        """Every rank must hold the same program and plan."""
        mine = self.lowered.fingerprint
        every: list[Any] = [None] * self.dist.get_world_size()
        self.dist.all_gather_object(every, mine)
        others = [r for r, f in enumerate(every) if f != every[0]]
        if others:
            raise EdlError(
                f"ranks {others} hold another program or plan than rank 0 "
                f"(rank {self.rank} holds {mine}, rank 0 holds {every[0]})",
                help="give every rank the same .edl file, dims, consts and plan file",
            )

    # -- weights ----------------------------------------------------------------------------------

    def load(self, params: Mapping[str, Any]) -> None:
        """Keep this rank's blocks of the params (and of carried state), from whole arrays or
        tensors; the blocks of relations not given stay as they are."""
        for op in self.program.ops:
            if isinstance(op, ir.Load) and op.relation in params and op.relation in self.loadable:
                block = self._block(TorchOps().asarray(params[op.relation]), op)
                if op.relation in self.graph.carried:  # a copy of its own, which updates may overwrite
                    block = block.clone()
                    self.exclusive.add(op.buf)
                self.blocks[op.buf] = block

    def load_slices(self, read: Callable[[str, tuple[slice, ...]], Any]) -> None:
        """Keep this rank's blocks of the params, reading only those slices: ``read(param,
        slices)`` gives them (a checkpoint's tensors, by slice)."""
        names = {r.name for r in self.graph.relations if r.kind == "param"}
        for op in self.program.ops:
            if isinstance(op, ir.Load) and op.relation in names:
                ranges = tuple(slice(a[0][0], a[-1][1]) for a in op.region.axes)  # loads are boxes
                self.blocks[op.buf] = self._block(read(op.relation, ranges), op, whole=False)
                self.exclusive.discard(op.buf)

    def _block(self, source: Any, op: ir.Load, whole: bool = True) -> Any:
        """The load's block of ``source`` (the whole param, or with ``whole`` False the block
        already), in its dtype on this rank's device."""
        if whole:
            source = source[tuple(slice(a[0][0], a[-1][1]) for a in op.region.axes)]  # loads are boxes
        return self.xp.asarray(source, self.xp.dtype(op.dtype), self.device).contiguous()

    # -- running ----------------------------------------------------------------------------------

    def __call__(
        self,
        inputs: Mapping[str, Any],
        *,
        gather_outputs: bool = True,
        record: bool = False,
        outputs: Collection[str] | None = None,
    ) -> Outputs:
        """Run this rank's program on ``inputs`` (whole; the same on every rank).  With
        ``gather_outputs``, every rank gets each output whole; else only the pieces it holds
        (the others read as absent); ``outputs`` names the outputs to return (None: all).
        With ``record``, each op's time is kept in ``last_times``.  Carried outputs become
        the next call's blocks of the relations they are carried into."""
        whole = {k: TorchOps().asarray(v) for k, v in inputs.items()}
        start = time.perf_counter()
        times: list[OpTime] = []
        owned: set[int] = set()
        dev = Device(
            self.program, self.graph, self.kernels, self.loader(whole, owned), self.xp, self.device, owned=owned
        )
        torch = torch_module()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        ops = self.program.ops
        k = 0
        while k < len(ops):
            if self.exchanged[k]:
                j = k
                while j < len(ops) and self.exchanged[j]:
                    j += 1
                began = time.perf_counter() - start
                self._exchange(dev, ops[k:j])
                if record:
                    times.append((self.rank, "exchange", began, time.perf_counter() - start))
                k = j
                continue
            began = time.perf_counter() - start
            if isinstance(collective := ops[k], ir.Collective):
                members = ", ".join(str(r) for r in collective.group if r != self.rank)
                with self._waiting(f"the {collective.kind} of {collective.relation} with ranks {members}", None):
                    self.collective_ops.run(dev, collective)
                if record:
                    label = f"{collective.kind} {collective.relation}"
                    times.append((self.rank, label, began, time.perf_counter() - start))
                k += 1
                continue
            dev.execute(ops[k], NO_MESSAGES)
            if record and not isinstance(ops[k], ir.Free):
                times.append((self.rank, op_label(ops[k]), began, time.perf_counter() - start))
            k += 1
        with self._waiting("its messages to be taken", None):
            for request in self._in_flight:
                request.wait()
        self._in_flight, self._kept = [], []
        self.last_times = times
        on_gpu = self.device.type == "cuda"
        self.last_peak = {self.rank: int(torch.cuda.max_memory_allocated(self.device)) if on_gpu else dev.peak_bytes}
        self.carry(dev, outputs)
        return self._outputs(dev, gather_outputs, outputs)

    # -- carried state ------------------------------------------------------------------------------

    def loader(self, whole: Mapping[str, Any], owned: set[int] | None = None) -> Callable[[ir.Load], Any]:
        """Loads from the held blocks, else from the whole inputs; a carried relation given
        among the inputs replaces its held blocks, and carried blocks are taken as loaded (the
        exclusive ones into ``owned``)."""
        for c in self.carried:
            if c.target in whole:
                self.blocks.pop(c.load.buf, None)
                self.exclusive.discard(c.load.buf)
        carried = {c.load.buf for c in self.carried}
        return taking(slicer(whole, self.blocks), self.blocks, carried, owned, self.exclusive)

    def carry(self, dev: Device, returned: Collection[str] | None = None) -> None:
        """The carried outputs as the next call's blocks: cut from this rank's own buffers, or
        (a plan placing the state elsewhere than where it is made) gathered, on every rank.  A
        block the call does not also return (``returned``: the outputs it returns, None: all)
        is exclusive: nothing outside holds it."""
        if not self.graph.carries:
            return
        if self.carried_local:
            for c in self.carried:
                assert c.source is not None
                self.blocks[c.load.buf] = own(dev.cut(dev.get(c.source), c.load.region).data)
                if returned is None or c.output in returned:
                    self.exclusive.discard(c.load.buf)
                else:
                    self.exclusive.add(c.load.buf)
            return
        gathered = self._outputs(dev, True, [out for out, _ in self.graph.carries]).values
        self.load({target: gathered[out] for out, target in self.graph.carries})

    def held(self, names: Collection[str]) -> dict[str, Any]:
        """The held blocks of carried relations and params, whole on every rank (each rank
        must ask alike: pieces not every rank holds are broadcast from one that does)."""
        torch = torch_module()
        out = {}
        for name in names:
            rel = self.graph.relation(name)
            pieces: dict[Region, dict[int, int]] = {}
            for prog in self.lowered.programs.devices:
                for op in prog.ops:
                    if isinstance(op, ir.Load) and op.relation == name:
                        pieces.setdefault(op.region, {})[prog.device] = op.buf
            dtype = self.xp.dtype(rel.dtype)
            whole = torch.zeros(rel.shape, dtype=dtype, device=self.device)
            for region, holders in pieces.items():
                if self.rank in holders:
                    data = self.blocks[holders[self.rank]].to(dtype)
                if len(holders) < self.world:
                    holder = min(holders)
                    if self.rank != holder:
                        data = self.xp.empty(region.shape, wire_dtype(dtype), self.device)
                    else:
                        data = data.contiguous().view(wire_dtype(dtype))
                    self.dist.broadcast(data, src=holder)
                    data = data.view(dtype)
                whole[region.at(Region.whole(rel.shape))] = data
            out[name] = whole
        return out

    def _exchange(self, dev: Device, ops: Sequence[ir.Op]) -> None:
        """A run of sends, receives and the combines of received partials (:func:`exchanged`):
        each batch of sends and receives posted together, each receive waited for where it is
        first read, and each combine run there too."""
        batch: list[ir.Op] = []
        arriving: set[int] = set()  # buffers the batch receives
        for op in ops:
            if isinstance(op, ir.Send | ir.Recv):
                if op.select is not None and not arriving.isdisjoint(b for b, _ in op.select.reads):
                    # A selective message's rows come from a route this batch receives: post
                    # the batch, so that the route can arrive before the rows are counted.
                    self._post(dev, batch)
                    batch, arriving = [], set()
                batch.append(op)
                if isinstance(op, ir.Recv):
                    arriving.add(op.buf)
                continue
            self._post(dev, batch)
            batch, arriving = [], set()
            if isinstance(op, ir.Combine):
                dev.combine_later(op)
            else:
                dev.execute(op, NO_MESSAGES)  # a Free
        self._post(dev, batch)

    def _post(self, dev: Device, ops: Sequence[ir.Op]) -> None:
        """One batch of sends and receives, posted together."""
        dist = self.dist
        posted: list[Any] = []
        # A receive, its tensors, their places in posted, and a selective one's rows.
        arriving: list[tuple[ir.Recv, Any, Any, list[int], selection.Rows | None]] = []
        keep: list[Any] = []  # what is sent stays alive until the send is done
        for op in ops:
            if isinstance(op, ir.Send):
                piece = dev.cut(dev.get(op.buf), op.region)
                full = self.full[op.buf]
                if op.select is not None:  # only the rows the reader reads (both ends count them)
                    data, present = selection.pack(self.xp, piece.data, piece.present, dev.rows(op.select))
                    piece, full = Buffer(op.region, data, present), op.select.dense
                    if data.shape[0] == 0:
                        continue
                for slot, tensor in enumerate(self._wire(piece, full)):
                    keep.append(tensor)
                    posted.append(dist.P2POp(dist.isend, tensor, op.peer, tag=2 * op.tag + slot))
            else:
                assert isinstance(op, ir.Recv)
                shape, full, rows = op.region.shape, op.full, None
                if op.select is not None:  # counted now: the route's buffers may be freed next
                    rows = dev.rows(op.select)
                    shape = selection.packed_shape(shape, rows, int(rows.mask.sum()))
                    full = op.select.dense
                data = self.xp.empty(shape, wire_dtype(self.xp.dtype(op.dtype)), self.device)
                slots = []
                present = None
                if data.numel():
                    slots.append(len(posted))
                    posted.append(dist.P2POp(dist.irecv, data, op.peer, tag=2 * op.tag))
                    if not full:
                        present = self.xp.empty(shape, torch_module().uint8, self.device)
                        slots.append(len(posted))
                        posted.append(dist.P2POp(dist.irecv, present, op.peer, tag=2 * op.tag + 1))
                arriving.append((op, data, present, slots, rows))
        requests = dist.batch_isend_irecv(posted) if posted else []
        # Sends stay in flight, their tensors kept alive, until the call ends: a send may need its
        # peer to post the matching receive, which the peer may do only after sending to us.
        # Receives are waited for where an op first reads them (``Device.defer``), so what comes
        # between runs while they travel.  Waiting later than where a receive stands cannot make
        # the ranks wait for each other forever: by any wait, a rank has posted at least the sends
        # it had posted when it waited there.
        apart = len(requests) == len(posted)  # else one request for the batch (NCCL coalesces it)
        if apart:
            self._in_flight.extend(r for p2p, r in zip(posted, requests, strict=True) if p2p.op is not dist.irecv)
        else:
            self._in_flight.extend(requests)
        self._kept.extend(keep)
        for op, data, present, slots, rows in arriving:
            wait = [requests[i] for i in slots] if apart else list(requests)
            finish = self._arrival(op, data, present, wait if slots else [], rows)
            dev.defer(op.buf, Buffer(op.region, data, present), finish)

    def _arrival(
        self, op: ir.Recv, data: Any, present: Any, requests: Sequence[Any], rows: selection.Rows | None
    ) -> Callable[[], Buffer]:
        """What waits for a receive and makes its buffer (a selective one's ``rows`` put in place)."""

        def finish() -> Buffer:
            with self._waiting(f"a message from rank {op.peer}", op.peer):
                for request in requests:
                    request.wait()
            value = data.view(self.xp.dtype(op.dtype))
            there = None if present is None else present.bool()
            if rows is None:
                return Buffer(op.region, value, there)
            shape = op.region.shape
            return Buffer(op.region, *selection.unpack(self.xp, value, there, rows, shape, self.device))

        return finish

    @contextlib.contextmanager
    def _waiting(self, what: str, peer: int | None) -> Iterator[None]:
        """A wait that the group's timeout ends becomes an error naming what this rank waited
        for (the launcher reports it); a lost connection stays torch's error (see
        :func:`edatalog.backend.running.launch.as_rank`)."""
        try:
            yield
        except RuntimeError as exc:
            if not TIMED_OUT.search(str(exc)):
                raise
            who = f"rank {peer}" if peer is not None else "another rank"
            raise EdlError(
                f"rank {self.rank} timed out after {TIMEOUT_SECONDS:g} s waiting for {what}",
                help=f"{who} hung or is far slower; raise EDL_DIST_TIMEOUT (seconds) if it is only slow",
            ) from None

    def _wire(self, piece: Buffer, full: bool) -> list[Any]:
        """The tensors a buffer travels as: its cells (half floats as 16-bit integers, which every
        backend carries), and unless it is full, which cells exist."""
        torch = torch_module()
        data = piece.data.contiguous()
        tensors = [data.view(wire_dtype(data.dtype))]
        if not full:
            present = piece.present if piece.present is not None else torch.ones(data.shape, dtype=torch.bool)
            tensors.append(present.to(device=data.device, dtype=torch.uint8).contiguous())
        return tensors

    def _outputs(self, dev: Device, everywhere: bool, names: Collection[str] | None = None) -> Outputs:
        values: dict[str, Any] = {}
        present: dict[str, Any | None] = {}
        for name in self.graph.outputs:
            if names is not None and name not in names:
                continue
            entries = self.outputs[name]
            pieces: list[tuple[Region, Buffer]] = []
            for e in entries:
                if not e.holders:
                    continue
                holder, buf = min(e.holders.items())
                if self.rank in e.holders and (not everywhere or len(e.holders) == self.world):
                    pieces.append((e.region, dev.get(e.holders[self.rank])))  # every rank has it
                elif everywhere:
                    pieces.append((e.region, self._broadcast(dev, holder, buf, e.region)))
            values[name], present[name] = gather(self.graph, name, pieces, self.xp, self.device)
        return Outputs(values, present)

    def _broadcast(self, dev: Device, holder: int, buf: int, region: Region) -> Buffer:
        """A piece of an output, from its holder to every rank."""
        torch = torch_module()
        dtype = self.xp.dtype(self.buffer_dtype[buf])
        full = self.full[buf]
        if self.rank == holder:
            wire = self._wire(dev.cut(dev.get(buf), region), full)
        else:
            wire = [self.xp.empty(region.shape, wire_dtype(dtype), self.device)]
            if not full:
                wire.append(self.xp.empty(region.shape, torch.uint8, self.device))
        for tensor in wire:
            self.dist.broadcast(tensor, src=holder)
        return Buffer(region, wire[0].view(dtype), None if full else wire[1].bool())


def timed_calls(
    call: Callable[[], object], reps: int, warmup: int = 0, sync: Callable[[], None] = lambda: None, device: Any = None
) -> tuple[list[float], list[float]]:
    """Seconds of each of ``reps`` calls (after ``warmup`` untimed) on this rank and on the
    slowest rank, in a torch.distributed job: every call starts as the ranks leave a barrier
    together (:func:`~edatalog.backend.running.shm_all_reduce.barrier_of`), and the times are
    gathered after the last call, so that no other collective runs between calls.  A call's
    time is its slowest rank's: a step waits for it (``edl run`` reports the median; the
    median of every call's slowest rank exceeds the slowest rank's median wherever ranks are
    noisy)."""
    torch = torch_module()
    dist = torch.distributed
    meet = barrier_of(dist.group.WORLD, TIMEOUT_SECONDS)
    mine: list[float] = []
    for k in range(warmup + reps):
        meet()
        start = time.perf_counter()
        call()
        sync()
        if k >= warmup:
            mine.append(time.perf_counter() - start)
    local = torch.tensor(mine, dtype=torch.float64, device=device)  # NCCL: on the GPU
    every = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(every, local)
    slowest = torch.stack(every).amax(dim=0)
    return mine, [float(t) for t in slowest]
