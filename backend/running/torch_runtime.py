"""The torch runtime in one process: a program on one torch device, or a plan's device programs
on logical devices mapped to torch devices (``["cuda:0", "cuda:1"]``, or all of them on ``"cpu"``
or on one GPU).

Weights are loaded once (:meth:`TorchExecutable.load`): each logical device keeps only the
blocks of each param its program loads, already on its torch device.  Each call then slices the
inputs the same way, runs every device's program (:mod:`edatalog.backend.running.interpreter`; a
message between devices is moved to the receiver's torch device), and returns the outputs as
torch tensors.  Without a plan the program runs on one device as the one-device plan that
computes each rule whole (:func:`one_device`), through the same interpreter, kernels and fusions.

On CUDA, a message between two GPUs is copied on copy streams of its own (:class:`CopyStreams`),
so that it overlaps the kernels both GPUs run meanwhile; logical devices on one GPU share its
memory and pass their buffers as they are.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from edatalog.backend.kernels.arrays import TorchOps, torch_module
from edatalog.backend.lowering.exchange import synthesize
from edatalog.backend.lowering.lowered import Lowered, lower
from edatalog.backend.running.carry import own, taking
from edatalog.backend.running.interpreter import Buffer, Device, Kernels, Mailbox, gather, run_devices, slicer
from edatalog.errors import EdlError
from edatalog.ir import program as ir
from edatalog.ir.graph import Graph
from edatalog.ir.regions import Region
from edatalog.solver.strategies import build
from edatalog.solver.topology import preset

# One op of one device as measured: (device, what it was, start and end seconds from the call's start).
OpTime = tuple[int, str, float, float]


def op_label(op: ir.Op) -> str:
    """What a measured op was, for traces: the rule of a kernel, ``attention`` for fused ones."""
    if isinstance(op, ir.Kernel):
        return op.node
    if isinstance(op, ir.Fused):
        return f"{op.kind} ({op.names()})"
    if isinstance(op, ir.Combine):
        return f"combine {op.relation}"
    if isinstance(op, ir.Collective):
        return f"{op.kind.value} {op.relation}"
    if isinstance(op, ir.Send | ir.Recv):
        return "exchange"
    return type(op).__name__.lower()


def torch_devices(device: str | Sequence[str] | None, n: int) -> list[Any]:
    """The torch device of each of ``n`` logical devices: one name for all of them, or one per
    logical device (a sequence, or names separated by commas); None: the first GPU when there
    is one, else the CPU."""
    torch = torch_module()
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, str) and "," in device:
        device = [name.strip() for name in device.split(",")]
    names = [device] * n if isinstance(device, str) else list(device)
    if len(names) != n:
        raise EdlError(f"the plan has {n} devices, but {len(names)} torch devices were given: {names}")
    out = []
    for name in names:
        try:
            dev = torch.device(name)
        except RuntimeError as exc:
            raise EdlError(f"'{name}' is not a torch device: {exc}", help="use cpu, cuda or cuda:N") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise EdlError(f"device {name} asked for, but this torch has no CUDA GPU", help="use --device cpu")
        if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
            raise EdlError(f"device {name} asked for, but there are {torch.cuda.device_count()} GPUs")
        out.append(dev)
    return out


@dataclass
class Outputs:
    """What a call returns: each output whole, as a torch tensor (absent cells 0), and which
    cells exist (None: all)."""

    values: dict[str, Any]
    present: dict[str, Any | None]


class TorchExecutable:
    """A program (and maybe a plan) ready to run on torch devices in this process."""

    def __init__(self, graph: Graph, lowered: Lowered | None, device: str | Sequence[str] | None = None) -> None:
        lowered = lowered if lowered is not None else one_device(graph)
        self.graph, self.lowered = graph, lowered
        self.devices = torch_devices(device, lowered.n_devices)
        self.programs = lowered.programs
        self.kernels = Kernels(graph)
        self.loaded: dict[tuple[int, int], Any] = {}  # (device, buffer) -> its block of a param
        self.param_names = {r.name for r in graph.relations if r.kind == "param"}
        self.loadable = self.param_names | set(graph.carried)  # params, and state carried between calls
        self.carried = {  # (device, buffer) -> relation, of the loads of carried relations
            (d, op.buf): op.relation
            for d, _, op in self.programs.ops()
            if isinstance(op, ir.Load) and op.relation in graph.carried
        }
        self.last_times: list[OpTime] = []
        self.last_peak: dict[int, int] = {}  # device -> the most bytes it held in the last call
        self.copy_streams: dict[Any, Any] = {}  # GPU -> the stream copies to and from it run on

    @property
    def device(self) -> Any:
        """The torch device of device 0, where outputs come."""
        return self.devices[0]

    def load(self, params: Mapping[str, Any]) -> None:
        """Keep each device's blocks of each param (and of carried state), on that device; the
        blocks of relations not given stay as they are."""
        for name, value in params.items():
            if name not in self.loadable:
                continue
            whole = TorchOps().asarray(value)
            for d, _, op in self.programs.ops():
                if isinstance(op, ir.Load) and op.relation == name:
                    block = whole[op.region.at(Region.whole(tuple(whole.shape)))]
                    self.loaded[(d, op.buf)] = own(block.to(self.devices[d]))

    def carry(self, out: Outputs) -> None:
        """The carried outputs (whole, on the first device) as the next call's blocks."""
        self.load({target: out.values[output] for output, target in self.graph.carries})

    def release(self, given: Collection[str]) -> None:
        """Drop what is held of the carried relations given among a call's inputs."""
        for key, relation in self.carried.items():
            if relation in given:
                self.loaded.pop(key, None)

    def held(self, names: Collection[str]) -> dict[str, Any]:
        """The held blocks of carried relations and params, whole on the first device."""
        out = {}
        for name in names:
            rel = self.graph.relation(name)
            whole = torch_module().zeros(rel.shape, dtype=TorchOps().dtype(rel.dtype), device=self.devices[0])
            for d, _, op in self.programs.ops():
                if isinstance(op, ir.Load) and op.relation == name:
                    whole[op.region.at(Region.whole(rel.shape))] = self.loaded[(d, op.buf)].to(whole.device)
            out[name] = whole
        return out

    def __call__(
        self,
        inputs: Mapping[str, Any],
        *,
        gather_outputs: bool = True,
        record: bool = False,
        outputs: Collection[str] | None = None,
    ) -> Outputs:
        """Run on ``inputs`` (the program's inputs, whole); with ``record``, the time of every
        op is kept in ``last_times``.  Outputs come whole on the first device (every logical
        device lives in this process: there is nothing else to gather to).  A relation carried
        between calls given among the inputs replaces what is held of it."""
        whole = {k: TorchOps().asarray(v) for k, v in inputs.items()}
        self.release(whole)
        start = time.perf_counter()
        times: list[OpTime] = []
        recorder = (lambda d: _recorder(d, start, times)) if record else None
        gpus = {dev for dev in self.devices if dev.type == "cuda"}
        for gpu in gpus:
            torch_module().cuda.reset_peak_memory_stats(gpu)
        devices, out = self.run(
            whole, self.loaded, TorchOps, CopyStreams(self.devices, self.copy_streams), recorder, take=True
        )
        if self.graph.carries:
            self.carry(out)
        self.last_times = times
        self.last_peak = {
            d.index: int(torch_module().cuda.max_memory_allocated(self.devices[d.index]))
            if self.devices[d.index] in gpus
            else d.peak_bytes
            for d in devices
        }
        return out

    def run(
        self,
        whole: Mapping[str, Any],
        loaded: Mapping[tuple[int, int], Any],
        ops: Callable[[Any], TorchOps],
        transport: Mailbox,
        recorder: Callable[[int], Callable[[int, ir.Op, str], None]] | None = None,
        kernels: Kernels | None = None,
        take: bool = False,
    ) -> tuple[list[Device], Outputs]:
        """Every device's program on the whole inputs ``whole`` and the param blocks ``loaded``
        (by device and buffer), each device computing with the array namespace ``ops(its torch
        device)``, messages passed by ``transport``: the devices as they ended, and the outputs.
        (The compiled runtime traces this very call, with ``kernels`` of its own.)  With
        ``take``, carried blocks leave ``loaded`` as they are loaded (see
        :func:`edatalog.backend.running.carry.taking`)."""
        kernels = kernels if kernels is not None else self.kernels
        devices = []
        for prog in self.programs.devices:
            d = prog.device
            blocks = {buf: t for (dd, buf), t in loaded.items() if dd == d}
            carried = {buf for dd, buf in self.carried if dd == d} if take else set()
            if carried:
                for buf in carried:
                    self.loaded.pop((d, buf), None)
            on_op = recorder(d) if recorder is not None else None
            dev = self.devices[d]
            load = taking(slicer(whole, blocks), blocks, carried)
            devices.append(Device(prog, self.graph, kernels, load, ops(dev), dev, on_op))
        run_devices(devices, transport)
        values, present = {}, {}
        first = self.devices[0]
        for name in self.graph.outputs:
            pieces = []
            for e in self.lowered.outputs[name]:
                if e.holders:
                    d, buf = next(iter(e.holders.items()))
                    pieces.append((e.region, devices[d].get(buf)))
            values[name], present[name] = gather(self.graph, name, pieces, ops(first), first)
        return devices, Outputs(values, present)


class CopyStreams(Mailbox):
    """Messages between logical devices of this process, moved to the receiver's torch device.

    Between two GPUs the copy runs on a copy stream of each (it is queued on the source's and
    the receiver's waits for it, as torch's copies between GPUs do with the current streams):
    the send marks the sender's stream with an event where the data is ready, the receive queues
    the copy after that mark, and the receiver's stream waits for the copy there.  Kernels queued
    meanwhile on either GPU run beside the copy.  Each tensor is recorded on the streams that use
    it, so the caching allocator never hands its memory out while a copy still reads or writes it.
    Anything else (one GPU, CPU to GPU, CPU) moves with a plain ``.to``."""

    def __init__(self, devices: Sequence[Any], streams: dict[Any, Any]) -> None:
        super().__init__()
        self.devices = list(devices)
        self.torch = torch_module()
        self.streams = streams  # GPU -> its copy stream, made on first use and kept by the caller
        self.marks: dict[int, Any] = {}  # tag -> event on the sender's stream, at the send

    def send(self, device: int, op: ir.Send, piece: Buffer) -> None:
        super().send(device, op, piece)
        source = piece.data.device
        if source.type == "cuda":
            mark = self.torch.cuda.Event()
            mark.record(self.torch.cuda.current_stream(source))
            self.marks[op.tag] = mark

    def recv(self, device: int, op: ir.Recv) -> Buffer:
        piece = self.messages.pop(op.tag)
        mark = self.marks.pop(op.tag, None)
        target = self.devices[device]
        source = piece.data.device
        if source.type == "cuda" and target.type == "cuda" and self._gpu(source) != self._gpu(target):
            return self._between_gpus(piece, self._gpu(source), self._gpu(target), mark)
        present = None if piece.present is None else piece.present.to(target)
        return Buffer(piece.region, piece.data.to(target), present)

    def _between_gpus(self, piece: Buffer, source: Any, target: Any, mark: Any) -> Buffer:
        cuda = self.torch.cuda
        out_of, into = self._stream(source), self._stream(target)
        if mark is not None:
            out_of.wait_event(mark)  # the data is made
        tensors = [t for t in (piece.data, piece.present) if t is not None]
        with cuda.stream(out_of), cuda.stream(into):  # the copy's memory comes from the receiver's copy stream
            moved = [t.to(target, non_blocking=True) for t in tensors]
        for t in tensors:
            t.record_stream(out_of)
        compute = cuda.current_stream(target)
        compute.wait_stream(into)
        for t in moved:
            t.record_stream(compute)
        return Buffer(piece.region, moved[0], moved[1] if len(moved) > 1 else None)

    def _gpu(self, device: Any) -> Any:
        """The GPU a torch device names (``cuda`` alone is the current one)."""
        index = device.index if device.index is not None else self.torch.cuda.current_device()
        return self.torch.device("cuda", index)

    def _stream(self, gpu: Any) -> Any:
        if gpu not in self.streams:
            self.streams[gpu] = self.torch.cuda.Stream(device=gpu)
        return self.streams[gpu]


def one_device(graph: Graph) -> Lowered:
    """The program on one device, as a plan's device program (every rule one block, on device
    0), lowered, so that it runs through the interpreter, kernels and fusions every plan runs
    through."""
    machine = preset("cpux1")
    return lower(synthesize(graph, build(graph, machine, "replicate"), machine))


def _recorder(device: int, start: float, times: list[OpTime]) -> Callable[[int, ir.Op, str], None]:
    began: dict[int, float] = {}

    def on_op(position: int, op: ir.Op, phase: str) -> None:
        now = time.perf_counter() - start
        if phase == "begin":
            began[position] = now
        elif not isinstance(op, ir.Free):
            times.append((device, op_label(op), began.pop(position), now))

    return on_op
