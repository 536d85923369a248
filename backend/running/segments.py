"""The compiled SPMD runtime: this rank's program as graphs between its point-to-point exchanges.

A rank's program (:mod:`edatalog.backend.running.spmd`) alternates runs of kernels, combines
and collectives with runs of exchanges: sends, receives and the combines of received partials
(:func:`edatalog.backend.running.spmd.exchanged`).  The exchanges stay as they are (one batch of
``batch_isend_irecv`` each, every receive, and every combine of one, run before the first
segment that reads it: point-to-point messages cannot live in a graph); every run in between
is a *segment*, recorded once per input signature as a graph
(:func:`edatalog.backend.running.tracer.record`), simplified and replayed, as the one-process
compiled runtime does with a whole program (:mod:`edatalog.backend.running.compiled`).  The
collectives of a segment are torch's functional collectives (``_c10d_functional``: an
all-reduce, reduce-scatter or all-gather and its ``wait_tensor``), ATen ops like any other, so
they are inside the graph.

A segment's graph takes the params this rank holds, the inputs, and the buffers it reads that
earlier ops made (their cells and, where kept, their presence masks); it gives the buffers it
makes that later ops read.  Every rank records at the same call (its second of an input
signature), so the recording runs' collectives meet.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from edatalog.backend.kernels.arrays import TorchOps, torch_module
from edatalog.backend.lowering.lowered import Lowered
from edatalog.backend.running.compiled import (
    LOG,
    Compile,
    StaticOps,
    at_offset_zero,
    direct_call,
    inductor,
    program_peaks,
)
from edatalog.backend.running.fxpasses import simplify
from edatalog.backend.running.interpreter import NO_MESSAGES, Buffer, Device, slicer
from edatalog.backend.running.spmd import SpmdExecutable, exchanged
from edatalog.backend.running.torch_runtime import OpTime, Outputs
from edatalog.backend.running.tracer import TraceError, record
from edatalog.errors import EdlError
from edatalog.ir import program as ir
from edatalog.ir.graph import Graph


@dataclass(frozen=True)
class Segment:
    """Ops ``start`` to ``stop`` of the program: an exchange, or a run of everything else with
    the buffers it reads from before (``entering``) and leaves for after (``leaving``)."""

    start: int
    stop: int
    exchange: bool
    entering: tuple[int, ...] = ()
    leaving: tuple[int, ...] = ()
    freed: tuple[int, ...] = ()  # buffers made before that it frees (outside its graph)


def segments(program: ir.DeviceProgram) -> list[Segment]:
    """The program cut at its exchanges (see the module docstring)."""
    ops = program.ops
    outside = exchanged(program)
    out: list[Segment] = []
    k = 0
    while k < len(ops):
        exchange = outside[k]
        j = k
        while j < len(ops) and outside[j] == exchange:
            j += 1
        if exchange:
            out.append(Segment(k, j, True))
        else:
            made: dict[int, None] = {}
            read: dict[int, None] = {}
            freed: set[int] = set()
            for op in ops[k:j]:
                if isinstance(op, ir.Free):
                    freed.add(op.buf)
                    continue
                for b in ir.reads(op):
                    if b not in made:
                        read[b] = None
                for m in ir.made(op):
                    made[m.buf] = None
            leaving = tuple(b for b in made if b not in freed)
            out.append(Segment(k, j, False, tuple(read), leaving, tuple(b for b in freed if b not in made)))
        k = j
    return out


@dataclass
class _Replay:
    run: Any
    nodes: int


class CompiledSpmdExecutable:
    """This rank's program of a plan, its segments compiled (see the module docstring)."""

    def __init__(self, graph: Graph, lowered: Lowered, device: str | None = None, mode: Compile = Compile.AUTO) -> None:
        if mode is Compile.CUDAGRAPH:
            raise EdlError(
                "compile mode 'cudagraph' replays the programs of one process; a rank of a job replays its "
                "segments as graphs",
                help="use compile='graph' (or auto)",
            )
        self.eager = SpmdExecutable(graph, lowered, device)
        self.graph, self.lowered, self.mode = graph, lowered, mode.resolved()
        self.program = self.eager.program
        self.rank = self.eager.rank
        self.cut = self._kept_only(segments(self.program))
        # Per segment: the other ranks its collectives meet (named while waiting on them).
        self.meets = [self._collective_members(seg) for seg in self.cut]
        self.regions = {m.buf: m.region for op in self.program.ops for m in ir.made(op)}
        self.functional = copy.copy(self.eager.collective_ops)  # the same process groups
        self.functional.functional = True
        self.replays: dict[tuple[Any, ...], dict[int, _Replay]] = {}  # signature -> segment -> graph
        self._seen: set[tuple[Any, ...]] = set()
        self._replayed = False

    # -- the Executable protocol --------------------------------------------------------------------

    @property
    def device(self) -> Any:
        return self.eager.device

    @property
    def last_times(self) -> list[OpTime]:
        return self.eager.last_times

    @property
    def last_peak(self) -> dict[int, int]:
        if self._replayed and self.device.type != "cuda":
            return {self.rank: program_peaks(self.lowered.programs)[self.rank]}
        return self.eager.last_peak

    def load(self, params: Mapping[str, Any]) -> None:
        self.eager.load(params)
        self._own_storage()

    def load_slices(self, read: Any) -> None:
        self.eager.load_slices(read)
        self._own_storage()

    def held(self, names: Collection[str]) -> dict[str, Any]:
        return self.eager.held(names)

    def _own_storage(self) -> None:
        """Graphs address views by storage offset: every param block starts its own storage."""
        for b, block in self.eager.blocks.items():
            self.eager.blocks[b] = at_offset_zero(block)

    def __call__(
        self,
        inputs: Mapping[str, Any],
        *,
        gather_outputs: bool = True,
        record: bool = False,
        outputs: Collection[str] | None = None,
    ) -> Outputs:
        self._replayed = False
        if record or self.mode is Compile.NONE:
            return self.eager(inputs, gather_outputs=gather_outputs, record=record, outputs=outputs)
        whole = {k: at_offset_zero(TorchOps().asarray(v)) for k, v in inputs.items()}
        sig = tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(whole.items()))
        if sig not in self._seen:  # the first call: interpreted (every rank alike)
            self._seen.add(sig)
            return self.eager(whole, gather_outputs=gather_outputs, outputs=outputs)
        out = self._run(whole, sig, gather_outputs, outputs)
        self._replayed = True
        return out

    # -- running ------------------------------------------------------------------------------------

    def _run(
        self, whole: Mapping[str, Any], sig: tuple[Any, ...], gather_outputs: bool, outputs: Collection[str] | None
    ) -> Outputs:
        eager = self.eager
        torch = torch_module()
        dev = Device(self.program, self.graph, eager.kernels, eager.loader(whole), eager.xp, eager.device)
        # The held blocks are the graphs' first arguments: graphs are kept per set of them too,
        # and per set of those the call owns (a graph may update those in place).
        owned = frozenset(eager.exclusive.intersection(eager.blocks))  # exclusive: carried blocks only
        graphs = self.replays.setdefault((sig, tuple(sorted(eager.blocks)), owned), {})
        names = tuple(sorted(whole))
        state_keys = sorted(eager.blocks)
        flat_state = [eager.blocks[b] for b in state_keys]
        for k, seg in enumerate(self.cut):
            ops = self.program.ops[seg.start : seg.stop]
            if seg.exchange:
                eager._exchange(dev, ops)
                continue
            masks = tuple(dev.get(b).present is not None for b in seg.entering)
            args = [*flat_state, *(whole[n] for n in names), *(dev.get(b).data for b in seg.entering)]
            args += [dev.get(b).present for b in seg.entering if dev.get(b).present is not None]
            replay = graphs.get(k)
            if replay is None:
                began = time.perf_counter()
                fn = self._segment_fn(seg, names, state_keys, masks, owned)
                try:
                    recording = record(fn, args)
                except TraceError as exc:  # never expected: every rank must take this path alike
                    raise AssertionError(f"segment {k} of rank {self.rank} cannot be recorded: {exc}") from None
                reuse = self.mode is not Compile.INDUCTOR and self.device.type == "cpu"
                direct = self.mode is not Compile.INDUCTOR
                gm, summary = simplify(recording.module, recording.graph, recording.shapes, reuse=reuse, direct=direct)
                run: Any = inductor(gm, args, summary) if self.mode is Compile.INDUCTOR else gm
                graphs[k] = _Replay(direct_call(run), summary["nodes"])
                outs = list(recording.outputs)
                LOG.info(
                    "rank %d: segment %d compiled (%d ops) in %.2f s",
                    self.rank,
                    k,
                    summary["nodes"],
                    time.perf_counter() - began,
                )
            else:
                members = self.meets[k]
                waiting: Any = contextlib.nullcontext()
                if members:
                    waiting = eager._waiting(f"a collective with ranks {members}", None)
                with waiting, torch.no_grad():
                    outs = list(replay.run(*args))
            for b in seg.freed:
                dev.store.pop(b, None)
            n = len(seg.leaving)
            for b, data, mask in zip(seg.leaving, outs[:n], outs[n:], strict=True):
                dev.store[b] = Buffer(self.regions[b], data, mask)
        with eager._waiting("its messages to be taken", None):
            for request in eager._in_flight:
                request.wait()
        eager._in_flight, eager._kept = [], []
        eager.last_times = []
        eager.carry(dev, outputs)
        return eager._outputs(dev, gather_outputs, outputs)

    def _segment_fn(
        self,
        seg: Segment,
        names: tuple[str, ...],
        state_keys: list[int],
        masks: tuple[bool, ...],
        owned: frozenset[int],
    ) -> Any:
        """What a segment's graph records: its ops on a device whose store holds what it reads
        (the ``owned`` held blocks its own to overwrite)."""
        eager, graph, program = self.eager, self.graph, self.program
        kernels = eager.kernels.fork()
        ops = program.ops[seg.start : seg.stop]
        n_state, n_in, n_enter = len(state_keys), len(names), len(seg.entering)
        regions, functional = self.regions, self.functional
        outer = frozenset(seg.freed)

        def fn(*flat: Any) -> list[Any]:
            blocks = dict(zip(state_keys, flat[:n_state], strict=True))
            given = dict(zip(names, flat[n_state : n_state + n_in], strict=True))
            data = flat[n_state + n_in : n_state + n_in + n_enter]
            kept = iter(flat[n_state + n_in + n_enter :])
            dev = Device(
                program, graph, kernels, slicer(given, blocks), StaticOps(eager.device), eager.device, owned=set(owned)
            )
            for b, d, has in zip(seg.entering, data, masks, strict=True):
                dev.store[b] = Buffer(regions[b], d, next(kept) if has else None)
            for op in ops:
                if isinstance(op, ir.Free) and op.buf in outer:
                    continue
                if isinstance(op, ir.Collective):
                    functional.run(dev, op)
                else:
                    dev.execute(op, NO_MESSAGES)
            return [dev.get(b).data for b in seg.leaving] + [dev.get(b).present for b in seg.leaving]

        return fn

    def _kept_only(self, cut: list[Segment]) -> list[Segment]:
        """Each segment leaving only the buffers something reads after it: a later op (a free
        included), the call's outputs on this rank, the state it carries.  A param's block is
        made by a load and never freed: returned by the graph and stored on every call, it
        cost a microsecond each (a tiny GPT-2's graph returned all 38)."""
        ops = self.program.ops
        entries = [e for es in self.eager.outputs.values() for e in es]
        wanted = {e.holders[self.rank] for e in entries if self.rank in e.holders}
        wanted |= {c.source for c in self.eager.carried if c.source is not None}
        out: list[Segment] = []
        for seg in reversed(cut):
            out.append(dataclasses.replace(seg, leaving=tuple(b for b in seg.leaving if b in wanted)))
            wanted |= {b for op in ops[seg.start : seg.stop] for b in ir.reads(op)}
        return out[::-1]

    def _collective_members(self, seg: Segment) -> str:
        ranks = {r for op in self.program.ops[seg.start : seg.stop] if isinstance(op, ir.Collective) for r in op.group}
        return ", ".join(str(r) for r in sorted(ranks - {self.rank}))
