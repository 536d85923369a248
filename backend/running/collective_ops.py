"""Collective ops of SPMD programs (:class:`~edatalog.ir.program.Collective`, made by the
collectives pass, :mod:`edatalog.backend.lowering.collectives`) run with torch.distributed."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from edatalog.backend.kernels.arrays import torch_module, wire_dtype
from edatalog.backend.lowering.collectives import Kind, collectives_of
from edatalog.backend.running import shm_all_reduce as shm
from edatalog.backend.running.exchange_all_reduce import exchange_all_reduce_, exchange_all_reduce_op, register_group
from edatalog.backend.running.interpreter import Buffer, Device
from edatalog.ir import program as ir
from edatalog.ir.regions import Region
from edatalog.solver.costmodel import AllReduceRoute, all_reduce_route
from edatalog.solver.topology import Library


class TorchCollectives:
    """Collective ops of SPMD programs run with torch.distributed, on this rank.

    One process group per distinct group of the programs, made at construction by every rank
    (members or not, as ``new_group`` needs) in one order, whole world included: collectives
    then never share a communicator (nor, on NCCL, a stream) with the point-to-point messages.
    An all-reduce reduces its source in place when nothing reads the source later (a partial
    made by a kernel), else a copy; a reduce-scatter and an all-gather move each member's piece
    as one chunk (``reduce_scatter_tensor``, ``all_gather_into_tensor``): views of the data
    when the pieces are the data's equal, consecutive chunks in group order, else packed (and
    padded to equal sizes).  On gloo, an all-reduce among ranks of one machine goes through
    shared memory (:mod:`edatalog.backend.running.shm_all_reduce`, set up here for each group
    whose members can share it), and a small one elsewhere as pairwise exchanges
    (:mod:`edatalog.backend.running.exchange_all_reduce`): the cost model's rule,
    :func:`~edatalog.solver.costmodel.all_reduce_route`.

    With ``functional``, each collective is torch's functional collective instead (then
    ``wait_tensor``): ops with no work object, which a recorded graph can replay (the compiled
    SPMD runtime, :mod:`edatalog.backend.running.segments`).  An all-reduce's wait is deferred
    to the first op that reads its result (:meth:`Device.defer`); a shared-memory or exchange
    all-reduce is its custom op, which returns its result."""

    def __init__(self, programs: ir.Programs, rank: int, device: Any, timeout: float, functional: bool = False) -> None:
        torch = torch_module()
        self.dist = torch.distributed
        self.rank, self.device, self.functional = rank, device, functional
        self.gloo = "gloo" in str(self.dist.get_backend())
        on_cpu = str(getattr(device, "type", device)).startswith("cpu")
        self.library = Library.GLOO if self.gloo and on_cpu else Library.NCCL  # which the cost model priced
        found = collectives_of(programs)
        self.groups: dict[tuple[int, ...], Any] = {}
        for group in sorted({members[0][1].group for members in found.values()}):
            self.groups[group] = self.dist.new_group(list(group), timeout=timedelta(seconds=timeout))
        for group, made in self.groups.items():  # the members of each, in the same order on every rank
            if rank in group:
                register_group(made)
                if self.library is Library.GLOO:
                    shm.register(made, timeout)
        self.reduce_ops = {
            "sum": self.dist.ReduceOp.SUM,
            "prod": self.dist.ReduceOp.PRODUCT,
            "max": self.dist.ReduceOp.MAX,
            "min": self.dist.ReduceOp.MIN,
        }
        # The functional collectives name their reductions by string, the product as "product".
        self.functional_names = {"sum": "sum", "prod": "product", "max": "max", "min": "min"}
        self.in_place = _consumed(programs.devices[rank], {o.buf for o in programs.outputs})

    def run(self, dev: Device, op: ir.Collective) -> None:
        """This rank's part of ``op``: its result goes to ``dev``'s store."""
        source = dev.get(op.source)
        group = self.groups[op.group]
        if op.kind is Kind.ALL_REDUCE:
            piece = dev.cut(source, op.whole)
            data = piece.data
            if (piece is source and op.tag not in self.in_place) or not data.is_contiguous():
                data = data.clone(memory_format=torch_module().contiguous_format)
            work, back = self._reducible(data)
            reduce = str(op.reduce)
            nbytes, name = data.numel() * data.element_size(), group.group_name
            shared = shm.registered(name)  # its members share a machine, and memory
            route = all_reduce_route(self.library, nbytes, len(op.group), shared, shared)
            if route is AllReduceRoute.SHARED_MEMORY:
                if self.functional:
                    out = shm.shm_all_reduce_op()(work, reduce, name)
                else:
                    out = shm.shm_all_reduce_(work.contiguous(), reduce, name)
                dev.keep(op.buf, Buffer(op.whole, back(out), None))
            elif route is AllReduceRoute.EXCHANGES:
                if self.functional:
                    out = exchange_all_reduce_op()(work, reduce, name)
                else:
                    out = exchange_all_reduce_(work.contiguous(), reduce, group)
                dev.keep(op.buf, Buffer(op.whole, back(out), None))
            elif self.functional:
                # Waited for where it is first read (in a recorded graph too): the ops in between
                # run while it travels.  In place, as the eager path reduces: ``work`` is this
                # call's to overwrite (out of place, the functional op would copy it first).
                issued = self._ops().all_reduce_(work, self.functional_names[str(op.reduce)], group.group_name)
                whole = op.whole
                dev.defer(op.buf, Buffer(whole, issued, None), lambda: Buffer(whole, back(self._wait(issued)), None))
            else:
                self.dist.all_reduce(work, op=self.reduce_ops[str(op.reduce)], group=group)
                dev.keep(op.buf, Buffer(op.whole, back(work), None))
        elif op.kind is Kind.REDUCE_SCATTER:
            dev.keep(op.buf, self._reduce_scatter(dev, op, source, group))
        else:
            dev.keep(op.buf, self._all_gather(dev, op, source, group))

    def _reduce_scatter(self, dev: Device, op: ir.Collective, source: Buffer, group: Any) -> Buffer:
        torch = torch_module()
        mine = op.pieces[op.group.index(self.rank)]
        if _chunks(op.whole, op.pieces):
            flat = dev.cut(source, op.whole).data.reshape(-1)
            chunk = mine.size
        else:
            chunk = max(p.size for p in op.pieces)
            flat = torch.zeros(chunk * len(op.pieces), dtype=source.data.dtype, device=self.device)
            for k, piece in enumerate(op.pieces):
                flat[k * chunk : k * chunk + piece.size] = dev.cut(source, piece).data.reshape(-1)
        work, back = self._reducible(flat.contiguous())
        if self.functional:
            out = self._wait(
                self._ops().reduce_scatter_tensor(
                    work, self.functional_names[str(op.reduce)], len(op.group), group.group_name
                )
            )
        else:
            out = torch.empty(chunk, dtype=work.dtype, device=self.device)
            self.dist.reduce_scatter_tensor(out, work, op=self.reduce_ops[str(op.reduce)], group=group)
        return Buffer(mine, back(out)[: mine.size].reshape(mine.shape), None)

    def _all_gather(self, dev: Device, op: ir.Collective, source: Buffer, group: Any) -> Buffer:
        torch = torch_module()
        me = op.group.index(self.rank)
        mine = dev.cut(source, op.pieces[me]).data.reshape(-1)
        dtype = mine.dtype
        wire = wire_dtype(dtype)
        chunk = max(p.size for p in op.pieces)
        send = torch.zeros(chunk, dtype=dtype, device=self.device)
        send[: mine.numel()] = mine
        if self.functional:
            got = self._wait(self._ops().all_gather_into_tensor(send.view(wire), len(op.group), group.group_name))
            out = got.view(dtype)
        else:
            out = torch.empty(chunk * len(op.pieces), dtype=dtype, device=self.device)
            self.dist.all_gather_into_tensor(out.view(wire), send.view(wire), group=group)
        if _chunks(op.whole, op.pieces):
            return Buffer(op.whole, out.reshape(op.whole.shape), None)
        whole = torch.empty(op.whole.shape, dtype=dtype, device=self.device)
        for k, piece in enumerate(op.pieces):
            whole[dev.index_of(piece, op.whole)] = out[k * chunk : k * chunk + piece.size].reshape(piece.shape)
        return Buffer(op.whole, whole, None)

    def _ops(self) -> Any:
        return torch_module().ops._c10d_functional

    def _wait(self, tensor: Any) -> Any:
        return self._ops().wait_tensor(tensor)

    def _reducible(self, data: Any) -> tuple[Any, Callable[[Any], Any]]:
        """``data`` in a type the backend reduces (bools as bytes; half floats as f32 on gloo),
        and the way back."""
        torch = torch_module()
        if data.dtype == torch.bool:
            return data.to(torch.uint8), lambda out: out != 0
        if self.gloo and data.dtype in (torch.float16, torch.bfloat16):
            dtype = data.dtype
            return data.float(), lambda out: out.to(dtype)
        return data, lambda out: out


def _consumed(program: ir.DeviceProgram, kept: set[int]) -> set[int]:
    """The tags of the all-reduces that may overwrite their source: a partial made by a kernel
    (or combine) of this call, no output, that no later op reads."""
    made = {m.buf: m for op in program.ops for m in ir.made(op)}
    last: dict[int, int] = {}
    for k, op in enumerate(program.ops):
        if not isinstance(op, ir.Free):
            for b in ir.reads(op):
                last[b] = k
    out = set()
    for k, op in enumerate(program.ops):
        if isinstance(op, ir.Collective) and op.kind is Kind.ALL_REDUCE:
            fresh = isinstance(made.get(op.source), ir.Kernel | ir.Combine | ir.Fused)
            if fresh and last.get(op.source) == k and op.source not in kept:
                out.add(op.tag)
    return out


def _chunks(whole: Region, pieces: Sequence[Region]) -> bool:
    """Whether ``pieces`` are, in order, equal consecutive chunks of ``whole``'s data (laid out
    row-major): each is ``whole`` cut along one axis, before which ``whole`` has one cell."""
    size = pieces[0].size
    if any(p.size != size for p in pieces):
        return False
    axis = next((a for a in range(len(whole.axes)) if any(p.axes[a] != whole.axes[a] for p in pieces)), None)
    if axis is None or math.prod(whole.shape[:axis]) != 1:
        return False
    step = pieces[0].shape[axis]
    for k, piece in enumerate(pieces):
        runs = piece.positions_in(whole)
        if any(runs[a] != ((0, n),) for a, n in enumerate(whole.shape) if a != axis):
            return False
        if runs[axis] != ((k * step, (k + 1) * step),):
            return False
    return True
