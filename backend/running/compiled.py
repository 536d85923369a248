"""The compiled torch runtime: a lowered plan's device programs recorded once as a graph of ATen
ops, simplified, and replayed on every later call with no per-op bookkeeping.

The interpreter (:mod:`edatalog.backend.running.interpreter`) decides, op by op and on every
call, which buffer a block reads, how its views are laid out, which prepared kernel runs it and
where its result goes: tens of microseconds of Python per op, as much as the arithmetic of a
small block.  Every one of those decisions depends only on the programs and on the inputs'
shapes and dtypes, so this runtime makes them once.  It runs the interpreter itself once while
recording the ATen calls it makes (:func:`edatalog.backend.running.tracer.record`), and nothing
else: the straight-line programs of the devices become one ``torch.fx`` graph.  Then
:func:`edatalog.backend.running.fxpasses.simplify` removes what only the interpreter needed
(chains of views, scalars made afresh, copies made to write in place, the op-overload
dispatch), and later calls with inputs of the same shapes, dtypes and devices run the graph:

- ``graph`` (the default): the simplified ``torch.fx`` GraphModule, straight-line Python
  calling torch: the same kernels as the interpreter, bit for bit, without its bookkeeping;
- ``inductor``: the graph compiled by ``torch.compile``'s inductor (C++/OpenMP on a CPU, Triton
  on a GPU), which fuses elementwise chains into generated kernels (so a bf16 rule no longer
  pays for its f32 widening in memory traffic); on one CUDA GPU its kernels are then captured
  as a CUDA graph too, as ``cudagraph`` captures the plain graph.  The compile takes tens of
  seconds cold, is cached on disk by inductor, and is announced when it starts and ends
  (:data:`edatalog.errors.NOTICES`, which the command line prints);
- ``cudagraph``: on one CUDA GPU, the graph captured once as a CUDA graph and replayed with one
  launch per call (:mod:`edatalog.backend.running.cudagraphs`): the default there, where a
  small kernel costs less than launching it from Python;
- ``none``: the interpreter on every call.

``auto`` is ``cudagraph`` for a program whose devices are all one CUDA GPU and that carries no
state, ``graph`` elsewhere.

The first call with a new input signature runs the interpreter (a program called once is never
compiled; it also computes the rules that read no input, such as rotary tables, which the graph
then keeps as constants); the second records and compiles (its recording run computes that
call); the rest replay. Compiled graphs are kept for the process (:data:`KEPT` of them, by the
lowered plan's fingerprint, the mode, the devices and the signatures of params and inputs), so a
second executable of the same program, such as the next generation's decode step, replays from
its first call. A call with ``record`` (per-op times) always runs the interpreter.

What the recording must not see is a decision that depends on values: the graph would bake in
the first call's (the recorder refuses the ATen calls that read values back, and the signature
then stays on the interpreter). The interpreter makes two kinds, and while recording both are
replaced by what the programs already decided (:class:`StaticOps`): whether a presence mask is
all true (a buffer not known full keeps its mask: the presence pass decided every buffer it
could, and a mask that happens to be all true changes no value), and the range check of looked-
up values (done once per call on the program's inputs, where the API checks them, before the
graph runs). Outputs that may lack cells come back with their masks, checked for all-true after
the graph, outside it: the one host synchronization of a call, and only for such outputs.

Params are inputs of the graph, not constants: loading new weights never recompiles, and the
prefill and decode programs of a generation can share one copy of them.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from edatalog.backend.kernels.arrays import TorchOps, onednn_linear_op, opaque_onednn_linear, torch_module
from edatalog.backend.lowering.lowered import Lowered
from edatalog.backend.running.cudagraphs import CudaGraphed, capturable
from edatalog.backend.running.fxpasses import simplify
from edatalog.backend.running.interpreter import Buffer, Mailbox
from edatalog.backend.running.torch_runtime import OpTime, Outputs, TorchExecutable
from edatalog.backend.running.tracer import TraceError, record
from edatalog.errors import NOTICES, EdlError
from edatalog.ir import dtypes
from edatalog.ir import program as ir
from edatalog.ir.graph import Graph

LOG = logging.getLogger("edatalog")


class Compile(StrEnum):
    """How the torch runtime runs a plan's programs (see the module docstring)."""

    AUTO = "auto"  # cudagraph on one CUDA GPU, graph elsewhere (see the module docstring)
    NONE = "none"
    GRAPH = "graph"
    INDUCTOR = "inductor"
    CUDAGRAPH = "cudagraph"

    def resolved(self) -> Compile:
        """The mode where nothing is known of the devices (auto: graph)."""
        return Compile.GRAPH if self is Compile.AUTO else self

    def on(self, devices: Sequence[Any], carries: bool) -> Compile:
        """The mode for a program on ``devices`` (torch devices), carrying state or not: auto
        captures CUDA graphs where it can; an explicit ``cudagraph`` where it cannot is an
        :class:`EdlError`."""
        can = capturable(devices, carries)
        if self is Compile.AUTO:
            return Compile.CUDAGRAPH if can else Compile.GRAPH
        if self is Compile.CUDAGRAPH and not can:
            where = ", ".join(sorted({str(d) for d in devices}))
            raise EdlError(
                f"compile mode 'cudagraph' replays on one CUDA GPU, but the program runs on {where}"
                + (" and carries state from call to call" if carries else ""),
                help="use compile='graph' (or auto, which picks cudagraph where it can)",
            )
        return self


def compile_mode(name: str | Compile | None) -> Compile:
    """The mode named ``name`` (None: auto); an :class:`EdlError` listing them otherwise."""
    if name is None:
        return Compile.AUTO
    try:
        return Compile(name)
    except ValueError:
        known = ", ".join(c.value for c in Compile)
        raise EdlError(f"unknown compile mode '{name}'", help=f"compile modes: {known}") from None


class StaticOps(TorchOps):
    """torch, for tracing: no answer depends on values (see the module docstring).  A presence
    mask is never taken to be all true (the buffer keeps it), and looked-up values are not
    range-checked here (the API checks a program's inputs before every call).  A factor of a
    guarded contraction is assumed finite (the fast path: the guard a 0/1 factor of the
    product), the check itself recorded into ``assumed``: the graph returns whether every such
    assumption held, and a call where one did not runs again on the interpreter."""

    reads_back = False

    def __init__(self, device: Any = None, assumed: list[Any] | None = None) -> None:
        super().__init__(device)
        self.assumed = assumed if assumed is not None else []

    def all_finite(self, a: Any) -> bool:
        # One pass: a sum is finite only if every element is (inf + -inf is nan); an overflowing
        # sum of finite values only sends the call to the interpreter, which checks exactly.
        self.assumed.append(torch_module().isfinite(a.sum()))
        return True

    def all(self, a: Any) -> bool:
        return False

    def argwhere_first(self, a: Any) -> tuple[int, ...] | None:
        return None

    def is_copy(self, made: Any, source: Any) -> bool:
        # Traced tensors have no data pointers; ``asarray`` returns its argument itself unless
        # it converts, so a different object is a copy.
        return isinstance(source, torch_module().Tensor) and made is not source


Signature = tuple[tuple[str, tuple[int, ...], Any, Any], ...]  # per input: name, shape, dtype, torch device

KEPT = 32  # compiled graphs kept for the process
_KEPT: OrderedDict[tuple[Any, ...], Replay] = OrderedDict()


@dataclass
class Replay:
    """One input signature's compiled graph, and what it takes and gives."""

    run: Callable[..., Any]  # state tensors, then the inputs in ``names`` order -> outputs
    names: tuple[str, ...]
    mode: Compile
    seconds: float  # tracing, simplifying and compiling
    nodes: int  # ops of the simplified graph
    summary: dict[str, int]
    checks: bool = False  # the graph's last output: whether its assumptions held (see StaticOps)

    @functools.cached_property
    def call(self) -> Callable[..., Any]:
        return direct_call(self.run)


def direct_call(run: Callable[..., Any]) -> Callable[..., Any]:
    """``run`` as a call costs least: a graph module's generated ``forward`` itself (its
    ``__call__`` goes through ``nn.Module``'s hooks and fx's wrapper, about 15 µs a call on
    this machine, as much as a small kernel); anything else as it is."""
    return run.forward if isinstance(run, torch_module().fx.GraphModule) else run


class CompiledExecutable:
    """A program (and maybe a plan) on torch devices in this process, run as compiled graphs."""

    def __init__(
        self,
        graph: Graph,
        lowered: Lowered | None,
        device: str | Sequence[str] | None = None,
        mode: Compile = Compile.AUTO,
    ) -> None:
        self.eager = TorchExecutable(graph, lowered, device)
        self.graph, self.lowered = graph, self.eager.lowered
        self.mode = mode.on(self.eager.devices, bool(graph.carries))
        # Replayed as a CUDA graph: cudagraph always; inductor's kernels too where they can be
        # (as torch.compile's "reduce-overhead" does).
        self.captures = self.mode is Compile.CUDAGRAPH or (
            self.mode is Compile.INDUCTOR and capturable(self.eager.devices, bool(graph.carries))
        )
        self.replays: dict[Signature, Replay] = {}
        self.graphed: OrderedDict[Signature, CudaGraphed] = OrderedDict()  # captures, see _graphed
        self._seen: set[Signature] = set()
        self._refused: set[Signature] = set()  # signatures whose programs a graph cannot replay
        self._keys: list[tuple[int, int]] = []
        self._state: list[Any] = []
        self.last_compiled: Replay | None = None
        self._replayed = False  # whether the last call ran a graph
        self._peaks: dict[int, int] = {}
        self._gpus = frozenset(d for d in self.eager.devices if d.type == "cuda")

    # -- the Executable protocol --------------------------------------------------------------------

    @property
    def device(self) -> Any:
        """The torch device of device 0, where outputs come."""
        return self.eager.device

    @property
    def last_times(self) -> list[OpTime]:
        return self.eager.last_times

    @property
    def last_peak(self) -> dict[int, int]:
        """The most bytes each device held in the last call: on a GPU what its allocator had
        out (replaying a CUDA graph, what it had out over the capture's warm-up: a replay
        allocates nothing); elsewhere the buffers of its program (every cell and presence mask), as the
        interpreter counts them: a graph replaying the programs holds the same buffers."""
        if self._replayed:
            return dict(self._peaks)  # the cached program peaks: never handed out to be changed
        return self.eager.last_peak

    def load(self, params: Mapping[str, Any]) -> None:
        """Keep each device's blocks of each param on its device; compiled graphs take them as
        inputs, so nothing is compiled again (CUDA graphs capture again: they hold the old
        blocks, which go with them)."""
        self.graphed.clear()
        self.eager.load(params)
        self._refresh()

    def held(self, names: Collection[str]) -> dict[str, Any]:
        return self.eager.held(names)

    def _refresh(self) -> None:
        """The held blocks as the graphs' first arguments.  Graphs address views by storage
        offset: every block starts its own storage."""
        self._keys = sorted(self.eager.loaded)
        for key in self._keys:
            block = self.eager.loaded[key]
            if block.storage_offset() != 0:
                self.eager.loaded[key] = block.clone()
        self._state = [self.eager.loaded[k] for k in self._keys]

    def __call__(
        self,
        inputs: Mapping[str, Any],
        *,
        gather_outputs: bool = True,
        record: bool = False,
        outputs: Collection[str] | None = None,
    ) -> Outputs:
        out = self._call(inputs, record)
        if self.graph.carries:
            self._refresh()
        return out

    def _call(self, inputs: Mapping[str, Any], record: bool) -> Outputs:
        tensor = torch_module().Tensor
        whole = {k: at_offset_zero(v if isinstance(v, tensor) else TorchOps().asarray(v)) for k, v in inputs.items()}
        if self.captures:  # a capture reads its inputs on its GPU
            whole = {k: v.to(self.eager.device) for k, v in whole.items()}
        self._replayed = False
        if self.graph.carries:
            self.eager.release(whole)
            self._refresh()
        if record or self.mode is Compile.NONE:
            return self.eager(whole, record=record)
        sig = _signature(whole)
        replay = self.replays.get(sig)
        if replay is None:
            key = self._key(sig)
            replay = _KEPT.get(key)
            if replay is None:
                if sig not in self._seen or sig in self._refused:  # the first call: interpreted
                    self._seen.add(sig)
                    return self.eager(whole)
                try:
                    replay, flat = self._compile(whole)  # the recording run computes this call
                except TraceError as exc:
                    LOG.warning("not compiled (%s): this input signature runs on the interpreter", exc)
                    self._refused.add(sig)
                    return self.eager(whole)
                _KEPT[key] = self.replays[sig] = replay
                while len(_KEPT) > KEPT:
                    _KEPT.popitem(last=False)
                self.eager.last_times = []
                if not _held(replay, flat):
                    return self.eager(whole)
                return self._carried(self._outputs(flat))
            _KEPT.move_to_end(key)
            self.replays[sig] = replay
        torch = torch_module()
        gpus = self._gpus
        for gpu in gpus:
            torch.cuda.reset_peak_memory_stats(gpu)
        args = [*self._state, *(whole[n] for n in replay.names)]
        run = self._graphed(sig, replay, args) if self.captures else replay.call
        with torch.no_grad():
            flat = run(*args)
        self.eager.last_times = []  # only interpreted calls with ``record`` time their ops
        if not _held(replay, flat):
            return self.eager(whole)
        self._replayed = True
        if gpus:  # a replay allocates nothing: its peak is taken as the capture's warm-up's
            captured = run.peak if isinstance(run, CudaGraphed) and run.captured else None
            self._peaks = {
                d: (captured if captured is not None else int(torch.cuda.max_memory_allocated(dev)))
                if dev in gpus
                else peak
                for (d, peak), dev in zip(self._program_peaks.items(), self.eager.devices, strict=True)
            }
        else:
            self._peaks = self._program_peaks
        return self._carried(self._outputs(flat))

    def _graphed(self, sig: Signature, replay: Replay, args: Sequence[Any]) -> CudaGraphed:
        """This executable's CUDA graph of ``replay`` (captured on its first use here: a capture
        holds this executable's params and a memory pool, so it is never shared through the
        process-wide :data:`_KEPT`)."""
        graphed = self.graphed.get(sig)
        if graphed is None or graphed.run is not replay.run:
            self.graphed.pop(sig, None)  # the old capture's pool goes first
            while len(self.graphed) >= KEPT:  # each holds a memory pool and copies of its inputs
                self.graphed.popitem(last=False)
            graphed = self.graphed[sig] = CudaGraphed(replay.run, args, len(self._keys), self.eager.device)
        self.graphed.move_to_end(sig)
        return graphed

    def _carried(self, out: Outputs) -> Outputs:
        """``out``, a graph's, its carried outputs kept as the next call's blocks (the
        interpreter keeps them itself)."""
        if self.graph.carries:
            self.eager.carry(out)
        return out

    @functools.cached_property
    def _program_peaks(self) -> dict[int, int]:
        """Each device's most bytes held, by its program: every buffer from the op that makes it
        to its free, its presence mask with it unless the buffer is full."""
        return program_peaks(self.lowered.programs)

    # -- compiling ----------------------------------------------------------------------------------

    def _key(self, sig: Signature) -> tuple[Any, ...]:
        """What a compiled graph depends on: the programs and options (the lowered plan's
        fingerprint), the mode, the torch devices, and the params' and inputs' signatures."""
        state = tuple((k, tuple(s.shape), s.dtype) for k, s in zip(self._keys, self._state, strict=True))
        devices = tuple(str(d) for d in self.eager.devices)
        return (self.lowered.fingerprint, self.graph.fingerprint(), self.mode, devices, state, sig)

    def _compile(self, whole: Mapping[str, Any]) -> tuple[Replay, list[Any]]:
        """Record the interpreter running on ``whole`` (:func:`record`: the run computes this
        call's outputs, returned too), simplify the graph, and compile it as the mode says."""
        start = time.perf_counter()
        names = tuple(sorted(whole))
        n_state = len(self._keys)
        keys = self._keys
        eager = self.eager
        kernels = eager.kernels.fork()  # what the recording run makes stays its own

        assumed: list[Any] = []

        def body(*flat: Any) -> list[Any]:
            loaded = dict(zip(keys, flat[:n_state], strict=True))
            given = dict(zip(names, flat[n_state:], strict=True))
            ops = functools.partial(StaticOps, assumed=assumed)
            _, out = eager.run(given, loaded, ops, _Moves(eager.devices), kernels=kernels)
            values = [x for name in self.graph.outputs for x in (out.values[name], out.present[name])]
            held = [torch_module().stack([a.to(assumed[0].device) for a in assumed]).all()] if assumed else []
            return values + held

        args = [*self._state, *(whole[n] for n in names)]
        recording = record(body, args)
        reuse = self.mode is not Compile.INDUCTOR and all(d.type == "cpu" for d in self.eager.devices)
        gm, summary = simplify(recording.module, recording.graph, recording.shapes, reuse=reuse)
        run: Callable[..., Any] = gm
        if self.mode is Compile.INDUCTOR:
            run = inductor(gm, args, summary)
        seconds = time.perf_counter() - start
        LOG.info("compiled %d ops (%s) in %.2f s", summary["nodes"], self.mode.value, seconds)
        replay = Replay(run, names, self.mode, seconds, summary["nodes"], summary, checks=bool(assumed))
        self.last_compiled = replay
        return replay, list(recording.outputs)

    def _outputs(self, flat: Sequence[Any]) -> Outputs:
        values, present = {}, {}
        for k, name in enumerate(self.graph.outputs):
            values[name] = flat[2 * k]
            mask = flat[2 * k + 1]
            # The one host synchronization of a call: only an output that may lack cells has a mask.
            present[name] = None if mask is None or bool(mask.all()) else mask
        return Outputs(values, present)


def _held(replay: Replay, flat: Sequence[Any]) -> bool:
    """Whether the assumptions the graph was recorded under held in this run (a host
    synchronization, only for graphs that assume something)."""
    if replay.checks and not bool(flat[-1]):
        LOG.info("a factor of a guarded contraction is not finite: this call runs on the interpreter")
        return False
    return True


def program_peaks(programs: ir.Programs) -> dict[int, int]:
    """Each device's most bytes held while its program runs (see ``last_peak``)."""
    out = {}
    for prog in programs.devices:
        live, peak, size = 0, 0, {}
        for op in prog.ops:
            if isinstance(op, ir.DEFINES):
                for m in ir.made(op):
                    size[m.buf] = m.region.size * (dtypes.itemsize(m.dtype) + (0 if m.full else 1))
                    live += size[m.buf]
                peak = max(peak, live)
            elif isinstance(op, ir.Free):
                live -= size.pop(op.buf, 0)
        out[prog.device] = peak
    return out


class _Moves(Mailbox):
    """Messages between logical devices of one process under tracing: a plain ``.to`` of the
    receiver's device (copy streams cannot be traced; on one device it is no op at all)."""

    def __init__(self, devices: Sequence[Any]) -> None:
        super().__init__()
        self.devices = list(devices)

    def recv(self, device: int, op: Any) -> Buffer:
        piece = self.messages.pop(op.tag)
        target = self.devices[device]
        present = None if piece.present is None else piece.present.to(target)
        return Buffer(piece.region, piece.data.to(target), present)


def inductor(gm: Any, args: Sequence[Any], summary: dict[str, int]) -> Callable[..., Any]:
    """The graph compiled by inductor (cached on disk by inductor itself)."""
    from torch._inductor.compile_fx import compile_fx

    NOTICES.info(
        "compiling %d ops with inductor (a first compile takes tens of seconds; inductor caches it)", summary["nodes"]
    )
    began = time.perf_counter()
    opaque_gemms(gm)
    compiled: Callable[..., Any] = compile_fx(gm, list(args))  # type: ignore[assignment]
    NOTICES.info("compiled with inductor in %.1f s", time.perf_counter() - began)
    return compiled


def opaque_gemms(gm: Any) -> int:
    """oneDNN's linear calls of ``gm`` (:mod:`edatalog.backend.kernels.arrays`) as the custom op
    inductor calls as it is (:func:`~edatalog.backend.kernels.arrays.opaque_onednn_linear`);
    returns how many."""
    target = onednn_linear_op()
    if target is None:
        return 0
    found = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target is target and n.args[2:4] == (None, "none") and not n.kwargs
    ]
    for node in found:
        a, w = node.args[:2]
        node.target, node.args, node.kwargs = opaque_onednn_linear(), (a, w), {}
    if found:
        gm.recompile()
    return len(found)


def _signature(whole: Mapping[str, Any]) -> Signature:
    return tuple((k, tuple(v.shape), v.dtype, v.device) for k, v in sorted(whole.items()))


def at_offset_zero(t: Any) -> Any:
    """``t`` contiguous and at the start of its storage (a graph addresses views by offset)."""
    if t.storage_offset() != 0 or not t.is_contiguous():
        return t.clone(memory_format=torch_module().contiguous_format)
    return t
