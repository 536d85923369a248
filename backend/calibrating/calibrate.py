"""Calibration: measure this machine with torch and write it as a machine file for ``--topology``.

``edl calibrate`` (and :func:`calibrate`) starts ``nproc`` ranks the way the runtime does (one
process each, gloo on CPU, NCCL on CUDA, ``threads`` torch threads per rank), measures on every
rank at once, so that ranks contend for memory and cores as they will when a plan runs, and
turns the numbers into a :class:`~edatalog.solver.topology.Topology` for the cost model
(``solver/costmodel.py``)::

    kernel   = max(its launches' floors, flops / (efficiency * device.flops), bytes / (efficiency * device.bandwidth))
    call     = call_overhead + the program's timeline
    transfer = link.latency + bytes / link.bandwidth   (each end's compute loses interference * transfer)

What goes where:

- ``device.flops``: the matmul rate ranks *reached* in the program's dtype (``dtype``, default
  f32), the median over :data:`SHAPES_CPU` or :data:`SHAPES_CUDA` (a transformer block's
  projections and attention scores, and a large square), each call on operands no cache holds
  (``Sizes.cold_bytes`` of them, cycled).  Since it is a reached rate, not a peak, the file says
  ``efficiency = 1.0``: there is nothing left to discount.
- ``device.bandwidth``: a large copy (larger than the caches), bytes read + written per second,
  as the cost model counts a kernel's bytes (everything it reads and writes).
- ``kernel_floor`` and ``call_overhead``: what a small kernel launch costs in edatalog's torch
  runtime, in the mode it will run (``Options.compile``: interpreted, or replayed as a recorded
  graph), and what a call of a device's program costs beyond its launches: chains of small
  model-like rules of two lengths run by that runtime, the difference per kernel launch and the
  rest of the shorter chain's time
  (:mod:`~edatalog.backend.calibrating.probe`; the command line compiles the probes and passes them
  as ``Options.probe``).  Without probes the floor falls back to torch's dispatch of a 1-element
  add (no overhead), which is recorded either way as ``[measured] torch_dispatch``, and
  ``[measured.how]`` says which.  With several ranks the call overhead is the shorter chain's
  call as each rank runs its part of a plan, after a barrier, as ``edl run`` times calls
  (:func:`spmd_call_overhead`).
- ``[kernel_floors]``: the floor of each kernel class (elementwise, reduction, GEMM, gather,
  fused attention; :class:`~edatalog.ir.cost.KernelClass`), from a chain of small kernels of
  that class at two lengths (``Options.class_probes``): a small matmul or gather costs a few
  times a small add, a fused attention call several.
- ``device.attention_flops``: the rate one fused causal attention reaches in the program's
  dtype (``Options.attention_probe``, of ``Sizes.attention`` rows, heads and width), its FLOPs
  as the cost model counts them (over the flash tiles) over its time less the call overhead:
  on a CPU torch's flash kernel runs at a fraction of the GEMMs' rate (f32 on this project's
  AMD EPYC: 90 GFLOP/s a rank at one thread against 224 for its matmuls), and pricing it at
  theirs put a 2-rank LLaMA block at 0.8x its measured time.
- ``links.intra.latency``: a 4-byte message to the next rank and one from the previous, posted
  together right after each rank computed (as programs meet their messages), less that
  computing alone; at least half the idle round trip of a 4-byte message between ranks 0 and 1
  (kept in ``[measured.p2p]``): between busy gloo ranks on a 2-vCPU VM the first was 0.20-0.27
  ms where the second was 0.07, and pricing a sharded training step's 80 messages a step by the
  second made the solver pick a plan that ran 1.32x its prediction.
- ``links.intra.collective_latency``: a small all-reduce over every rank, timed right after each
  rank computed (as programs meet collectives) less that computing alone, less its bytes' time,
  over the steps the cost model gives it: on gloo between busy CPU ranks it costs several times
  what the ping-pong's latency would predict.
- ``links.intra.shared_memory_latency`` (gloo): the same all-reduce as the runtime runs it
  between ranks of one machine, through shared memory
  (:mod:`edatalog.backend.running.shm_all_reduce`), less its bytes' memory traffic;
  ``links.intra.exchange_latency`` where the ranks cannot share memory: as pairwise exchanges
  (:mod:`edatalog.backend.running.exchange_all_reduce`), over its steps.
- ``links.intra.bandwidth``: the rate per direction when every rank sends to the next and
  receives from the previous one at once (a ring exchange of a large message), which is how
  exchanges run in a plan (both directions of a reduce-scatter or an all-gather at once); the
  link model gives every device its own egress and ingress port, so this is the port's rate.
- ``links.intra.interference``: matmuls about as long as that exchange, timed alone and while
  it runs (:func:`interference_of`): near 1 where the cores that compute also move the bytes
  (gloo between CPU processes), lower where a DMA engine or NIC moves them.
- ``device.memory``: the machine's available memory divided among the ranks (CPU), or the GPU's.

Device numbers are the slowest rank's (a step waits for its slowest rank).  Every raw number (all
dtypes and shapes, the copy sizes, one-way point-to-point times, all_reduce and reduce_scatter bus
bandwidth, per-rank rates, the command and date) goes into the file's ``[measured]`` table,
which the loader accepts and ignores.

Timings are medians of repeated runs after a warm-up, with :func:`time.perf_counter` (and
``torch.cuda.synchronize`` on CUDA); a call shorter than :data:`BATCH_SECONDS` is timed in
batches.  torch is imported on first use, never on import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import json
import math
import os
import platform
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from edatalog.backend.calibrating import probe as calibrate_probe
from edatalog.backend.kernels.arrays import TorchOps
from edatalog.backend.running import shm_all_reduce as shm
from edatalog.backend.running.compiled import Compile, compile_mode
from edatalog.backend.running.exchange_all_reduce import exchange_all_reduce_
from edatalog.backend.running.spmd import timed_calls
from edatalog.errors import EdlError
from edatalog.ir.cost import KernelClass, Launches
from edatalog.solver.costmodel import AllReduceRoute, all_reduce_route
from edatalog.solver.topology import Device, Library, Link, Topology

ProgressFn = Callable[[float, float, str], None]  # (done, total, what is being measured)

DTYPES = ("f32", "bf16", "f16", "f64")  # matmul dtypes measured, f32 first (the others are compared with it)
USEFUL = 0.25  # a dtype slower than this fraction of f32 (on a small probe) is not measured further
BATCH_SECONDS = 2e-3  # calls shorter than this are timed in batches
MAX_CALL_SECONDS = 2.0  # a matmul shape this slow at the probe's rate is skipped
INIT_TIMEOUT_SECONDS = 300
COLD_SETS = 16  # at most this many operand pairs per matmul shape
SMALL_COLLECTIVE_BYTES = 4096  # a small all-reduce (an activation of a tiny model): its time is its steps' latency

_TORCH_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64"}


@dataclass(frozen=True)
class Sizes:
    """What is measured, and how long each measurement may take."""

    matmuls: tuple[tuple[int, int, int, int], ...]  # (batch, M, K, N): B products of (M x K)(K x N)
    probe: tuple[int, int, int, int]  # a small matmul deciding whether a dtype is worth measuring
    copy_bytes: tuple[int, ...]  # the first is the bandwidth's (larger than the caches)
    floor_elements: int = 1
    p2p_bytes: tuple[int, ...] = (4, 1 << 16, 1 << 20, 16 << 20)  # ping-pong sizes; the first: latency
    exchange_bytes: int = 16 << 20
    collective_bytes: int = 16 << 20
    warmup: int = 2
    min_reps: int = 3
    max_reps: int = 15
    budget: float = 1.0  # seconds per compute measurement: timed runs stop past it (after min_reps)
    link_reps: int = 10  # communication: the same count on every rank
    cold_bytes: int = 128 << 20  # matmul operands cycled through, so that none is in a cache
    attention: tuple[int, int, int] = (512, 8, 64)  # the attention probe's rows, heads and head width


# Shapes of a LLaMA block at D=1024, S=512, F=2816: the q/k/v/o projections, gate/up, down, the
# attention scores of 16 heads of 64, and a large square.
SHAPES_CPU = (
    (1, 512, 1024, 1024),
    (1, 512, 1024, 2816),
    (1, 512, 2816, 1024),
    (16, 512, 64, 512),
    (1, 2048, 2048, 2048),
)
SHAPES_CUDA = (*SHAPES_CPU[:-1], (1, 8192, 8192, 8192))
FULL_CPU = Sizes(matmuls=SHAPES_CPU, probe=(1, 256, 256, 256), copy_bytes=(256 << 20, 4 << 20))
FULL_CUDA = replace(
    FULL_CPU,
    matmuls=SHAPES_CUDA,
    copy_bytes=(1 << 30, 32 << 20),
    p2p_bytes=(4, 1 << 16, 1 << 20, 64 << 20),
    exchange_bytes=256 << 20,
    collective_bytes=256 << 20,
    attention=(2048, 32, 128),
)
QUICK = Sizes(
    matmuls=((1, 32, 64, 64), (1, 32, 64, 176), (4, 32, 16, 32), (1, 96, 96, 96)),
    probe=(1, 32, 32, 32),
    copy_bytes=(1 << 20, 64 << 10),
    p2p_bytes=(4, 4096, 64 << 10),
    exchange_bytes=64 << 10,
    collective_bytes=64 << 10,
    warmup=1,
    min_reps=3,
    max_reps=5,
    budget=0.01,
    link_reps=3,
    cold_bytes=1 << 20,
    attention=(64, 2, 16),
)


def sizes_for(device: str, quick: bool) -> Sizes:
    return QUICK if quick else FULL_CUDA if device == "cuda" else FULL_CPU


def shape_key(shape: Sequence[int]) -> str:
    """``512x1024x1024`` for M x K x N; ``16x512x64x512`` for a batch of 16."""
    b, m, k, n = shape
    return f"{m}x{k}x{n}" if b == 1 else f"{b}x{m}x{k}x{n}"


# -- options --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    nproc: int = 2
    device: str = "cpu"  # "cpu" or "cuda"
    threads: int | None = None  # torch threads per rank; default 1 with several ranks, else torch's
    quick: bool = False  # tiny sizes: checks that calibration works, measures nothing useful
    dtype: str = "f32"  # the programs' dtype: its matmul rate becomes device.flops
    # The runtime probe's join-agg graphs, as JSON (see calibrate_probe): the short and the long
    # chain, whose times per call become kernel_floor and call_overhead.  None: the floor is
    # torch's dispatch of a 1-element add, and no overhead.
    probe: tuple[str, str] | None = field(default=None, repr=False)
    compile: str = "auto"  # how the runtime the machine file prices runs programs (Compile)
    # The general-path probe's graph, as JSON (calibrate_probe.general_source): its time per byte
    # beyond the roofline becomes device.general_bandwidth.  None: not measured (0, not modeled).
    general_probe: str | None = field(default=None, repr=False)
    # The kernel-class probes' graphs, as JSON (calibrate_probe.class_source): per class, its
    # short and long chain, whose times give that class's floor ([kernel_floors]).  None: every
    # class costs kernel_floor.
    class_probes: tuple[tuple[str, str, str], ...] | None = field(default=None, repr=False)
    # The attention probe's graph, as JSON (calibrate_probe.attention_source, in ``dtype``, of
    # ``Sizes.attention``): its fused kernel's FLOPs per second become device.attention_flops
    # for ``dtype``.  None: not measured (attention at the GEMMs' rate).
    attention_probe: str | None = field(default=None, repr=False)

    def resolved(self) -> Options:
        """Checked, with the thread count filled in; a bad option is an :class:`EdlError`."""
        if self.nproc < 1:
            raise EdlError(f"--nproc must be at least 1, not {self.nproc}", help="the number of ranks to measure")
        if self.device not in ("cpu", "cuda"):
            raise EdlError(f"unknown device '{self.device}'", help="use --device cpu or --device cuda")
        if self.dtype not in DTYPES:
            raise EdlError(f"unknown dtype '{self.dtype}'", help=f"use one of {', '.join(DTYPES)}")
        if self.threads is not None and self.threads < 1:
            raise EdlError(f"--threads must be at least 1, not {self.threads}", help="torch threads per rank")
        if self.device == "cuda":
            torch = _torch()
            if not torch.cuda.is_available():
                raise EdlError(
                    "--device cuda: this machine has no CUDA device (or this torch is a CPU build)",
                    help="calibrate the CPU with --device cpu, or run on a machine with a GPU",
                )
            if self.nproc > torch.cuda.device_count():
                raise EdlError(
                    f"--nproc {self.nproc} on CUDA needs {self.nproc} GPUs; this machine has "
                    f"{torch.cuda.device_count()}",
                    help="one rank per GPU: pass at most as many ranks as GPUs",
                )
        runtime_mode(self)  # a mode the runtime cannot run these ranks in is refused before any work
        threads = self.threads
        if threads is None:
            threads = 1 if self.nproc > 1 or self.device == "cuda" else _torch().get_num_threads()
        return replace(self, threads=threads)

    def command(self) -> str:
        parts = ["edl calibrate", f"--nproc {self.nproc}", f"--device {self.device}", f"--threads {self.threads}"]
        if self.dtype != "f32":
            parts.append(f"--dtype {self.dtype}")
        if self.quick:
            parts.append("--quick")
        if self.compile != "auto":
            parts.append(f"--compile {self.compile}")
        return " ".join(parts)


# -- timing -----------------------------------------------------------------------------------------


def _torch() -> Any:
    import torch

    return torch


def runtime_mode(opts: Options) -> Compile:
    """The mode the torch runtime will run plans in, which the probes must run in too: ``auto``
    is ``cudagraph`` for one process on one GPU and ``graph`` elsewhere (ranks of a job replay
    their segments as graphs)."""
    mode = compile_mode(opts.compile)
    if opts.nproc > 1:
        if mode is Compile.CUDAGRAPH:
            raise EdlError(
                "compile mode 'cudagraph' replays the programs of one process, but --nproc is "
                f"{opts.nproc}: ranks of a job replay their segments as graphs",
                help="use --compile graph (or auto), or --nproc 1",
            )
        return mode.resolved()
    return mode.on([_torch().device(opts.device)], carries=False)


def _seconds_per_call(fn: Callable[[], object], sync: Callable[[], None], sizes: Sizes) -> float:
    """The median time of one call of ``fn``, after a warm-up; calls shorter than
    :data:`BATCH_SECONDS` are timed in batches (the median is of the batches' mean)."""
    fn()  # the first call allocates, touches pages, loads kernels
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    estimate = time.perf_counter() - t0
    inner = max(1, min(10_000, math.ceil(BATCH_SECONDS / max(estimate, 1e-9))))

    def batch() -> float:
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        return (time.perf_counter() - t0) / inner

    for _ in range(sizes.warmup):
        batch()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < sizes.max_reps and (len(times) < sizes.min_reps or time.perf_counter() - start < sizes.budget):
        times.append(batch())
    return max(statistics.median(times), 1e-12)


class _Steps:
    """Progress through a known number of steps, reported as (done, total, what)."""

    def __init__(self, total: int, report: ProgressFn | None) -> None:
        self.total, self.count, self.what, self.report = total, 0, "", report

    def now(self, what: str) -> None:
        self.what = what
        self._emit()

    def done(self, n: int = 1) -> None:
        self.count = min(self.total, self.count + n)
        self._emit()

    def _emit(self) -> None:
        if self.report is not None:
            self.report(self.count, self.total, self.what)


def _device_steps(sizes: Sizes) -> int:
    return len(DTYPES) * (1 + len(sizes.matmuls)) + len(sizes.copy_bytes) + 1


def _link_steps(sizes: Sizes, opts: Options) -> int:
    own = all_reduce_route(_library(opts.device), SMALL_COLLECTIVE_BYTES, opts.nproc, one_node=True)
    return len(sizes.p2p_bytes) + 5 + (own is not AllReduceRoute.LIBRARY)


def _library(device: str) -> Library:
    """The torch.distributed backend a calibration's ranks use on ``device`` ("cpu" or "cuda")."""
    return Library.NCCL if device == "cuda" else Library.GLOO


# -- one rank's device ----------------------------------------------------------------------------


def _matmul_rate(
    torch: Any, dev: Any, dtype: Any, shape: Sequence[int], sync: Callable[[], None], sizes: Sizes
) -> float:
    """FLOP/s of ``shape``'s matmul with operands that are not in a cache: each call takes the
    next of enough operand pairs to fill ``sizes.cold_bytes``, as a plan's GEMMs read weights and
    activations that other kernels have since pushed out (a matmul repeated on the same operands
    finds them in the last-level cache, and on a CPU ran 1.3-1.5x faster than the same GEMMs in a
    LLaMA block)."""
    b, m, k, n = shape
    lead = (b,) if b > 1 else ()
    pair_bytes = b * (m * k + k * n + m * n) * torch.empty((), dtype=dtype).element_size()
    count = max(1, min(COLD_SETS, math.ceil(sizes.cold_bytes / pair_bytes)))
    pairs = [
        (torch.randn((*lead, m, k), device=dev).to(dtype), torch.randn((*lead, k, n), device=dev).to(dtype))
        for _ in range(count)
    ]
    turn = itertools.cycle(pairs)
    matmul = TorchOps().matmul  # the runtime's GEMM, library choice included (oneDNN for f32 on a CPU)

    def call() -> None:
        a, w = next(turn)
        matmul(a, w)

    return 2.0 * b * m * k * n / _seconds_per_call(call, sync, sizes)


class _Lockstep:
    """Keeps the ranks of a job in step while each measures its own device: every measurement
    starts on all ranks at once (as a plan's kernels run), and what to skip is rank 0's choice,
    so that all ranks take the same steps.  Without a group (one rank), it does nothing."""

    def __init__(self, dev: Any = None) -> None:
        self.dev = dev

    def barrier(self) -> None:
        if self.dev is not None:
            import torch.distributed as dist

            dist.barrier()

    def agree(self, value: float) -> float:
        """Rank 0's ``value``, on every rank."""
        if self.dev is None:
            return value
        torch = _torch()
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64, device=self.dev)
        dist.broadcast(t, 0)
        return float(t.item())


def measure_device(
    opts: Options, sizes: Sizes, steps: _Steps, dev: Any = None, lockstep: _Lockstep | None = None
) -> dict[str, Any]:
    """Matmul rates per dtype and shape, copy rates and the kernel floor, in this process (one
    rank), on ``dev`` (default: the CPU, or the first GPU)."""
    torch = _torch()
    if dev is None:
        dev = torch.device("cuda", 0) if opts.device == "cuda" else torch.device("cpu")
    step = lockstep or _Lockstep()
    sync: Callable[[], None] = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)

    matmul: dict[str, dict[str, Any]] = {}
    f32_probe = 0.0
    probe_key = shape_key(sizes.probe)
    for name in DTYPES:
        dtype = getattr(torch, _TORCH_DTYPES[name])
        steps.now(f"matmul {name}")
        step.barrier()
        try:
            probe = _matmul_rate(torch, dev, dtype, sizes.probe, sync, sizes)
        except (RuntimeError, TypeError) as exc:  # the device has no such matmul (alike on every rank)
            if name == opts.dtype:
                raise EdlError(f"{name} matmul does not run on {dev}: {_first_line(exc)}") from None
            matmul[name] = {"skipped": f"not supported: {_first_line(exc)}"}
            steps.done(1 + len(sizes.matmuls))
            continue
        steps.done()
        entry: dict[str, Any] = {probe_key: probe}
        matmul[name] = entry
        probe = step.agree(probe)
        if name == "f32":
            f32_probe = probe
        if name not in ("f32", opts.dtype) and probe < USEFUL * f32_probe:
            entry["skipped"] = (
                f"{rate(probe, 'FLOP/s')} at {probe_key} (rank 0), under a quarter of f32's {rate(f32_probe, 'FLOP/s')}"
            )
            steps.done(len(sizes.matmuls))
            continue
        for shape in sizes.matmuls:
            key = shape_key(shape)
            steps.now(f"matmul {name} {key}")
            flops = 2.0 * math.prod(shape)
            if flops / probe > MAX_CALL_SECONDS:  # a slow dtype: this shape would take too long
                entry.setdefault("too_slow", []).append(key)
            else:
                step.barrier()
                entry[key] = _matmul_rate(torch, dev, dtype, shape, sync, sizes)
            steps.done()

    def copy_rate(nbytes: int) -> float:
        src = torch.ones(max(1, nbytes // 4), device=dev)
        dst = torch.empty_like(src)
        return 2.0 * src.numel() * 4 / _seconds_per_call(lambda: dst.copy_(src), sync, sizes)

    copy: dict[str, float] = {}
    for nbytes in sizes.copy_bytes:
        steps.now(f"copy {size(nbytes)}")
        step.barrier()
        copy[str(nbytes)] = copy_rate(nbytes)
        steps.done()

    steps.now("kernel floor")
    step.barrier()
    floor = measure_floor(opts, sizes, dev, sync)
    steps.done()

    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        memory, kind = int(props.total_memory), str(props.name)
    else:
        memory, kind = 0, f"CPU ({opts.threads} thread{'s' if opts.threads != 1 else ''})"
    return {"matmul": matmul, "copy": copy, **floor, "memory": memory, "kind": kind}


def measure_floor(opts: Options, sizes: Sizes, dev: Any, sync: Callable[[], None]) -> dict[str, Any]:
    """The kernel floor and the call overhead on ``dev``: from the runtime probes' times
    (``opts.probe``, see :mod:`~edatalog.backend.calibrating.probe`) in ``opts.compile``'s mode,
    or without them torch's dispatch of a 1-element add (no overhead), which is measured either
    way (``torch_dispatch``).  ``probe_kernels``: the kernel launches of one run of each probe (empty:
    no probe)."""
    torch = _torch()
    mode = runtime_mode(opts)
    x = torch.ones(sizes.floor_elements, device=dev)
    dispatch = _seconds_per_call(lambda: torch.add(x, x), sync, sizes)
    if opts.probe is None:
        return {"kernel_floor": dispatch, "call_overhead": 0.0, "torch_dispatch": dispatch, "probe_kernels": []}
    seconds, launches = _two_chains(opts.probe, mode, sizes, dev, sync)
    kernels = (launches[0].total, launches[1].total)
    floor, overhead = calibrate_probe.floor_and_overhead(seconds, kernels)
    out: dict[str, Any] = {
        "kernel_floor": floor,
        "call_overhead": overhead,
        "torch_dispatch": dispatch,
        "probe_kernels": list(kernels),
        "probe_seconds": list(seconds),
    }
    if opts.class_probes:
        out["kernel_floors"] = measure_class_floors(opts.class_probes, mode, floor, sizes, dev, sync)
    if _ranks() > 1:  # what a plan's call costs on several ranks; the one-device call's prices the general probe
        out["device_call_overhead"] = overhead
        out["call_overhead"] = spmd_call_overhead(opts.probe[0], mode, floor, sizes, dev, sync)
    if opts.general_probe is not None:
        general, costs = calibrate_probe.general_runner(opts.general_probe, dev, mode)
        out["general"] = {"seconds": _seconds_per_call(general, sync, sizes), "kernels": costs}
    if opts.attention_probe is not None:
        attention, flops = calibrate_probe.attention_runner(opts.attention_probe, dev, mode)
        out["attention"] = {"seconds": _seconds_per_call(attention, sync, sizes), "flops": flops}
    return out


# -- links between ranks ----------------------------------------------------------------------------


def _ranks() -> int:
    """The ranks of the torch.distributed group this process is in (1: none)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def spmd_call_overhead(
    probe: str, mode: Compile, floor: float, sizes: Sizes, dev: Any, sync: Callable[[], None]
) -> float:
    """What a call of a plan's programs costs each rank beyond its kernels: the short probe split
    by rows across the ranks (:func:`calibrate_probe.runner`), each call timed as ``edl
    run`` times calls (the ranks meet at a barrier, then each runs its part), its median less
    its launches at ``floor``.  A rank woken from the barrier, and the multi-rank call's handling
    of its share of the outputs, cost more than one device's call in a loop."""
    import torch.distributed as dist

    run, kernels = calibrate_probe.runner(probe, dev, mode, dist.get_world_size())
    times = _after_barriers(run, sizes.link_reps * 5, sizes.warmup, sync, dev)
    return max(0.0, statistics.median(times) - kernels.total * floor)


def _after_barriers(
    op: Callable[[], None], reps: int, warmup: int, sync: Callable[[], None], dev: Any, slowest: bool = True
) -> list[float]:
    """``op``'s time in each of ``reps`` runs (after ``warmup`` untimed), every run started as
    the ranks leave a barrier together, as ``edl run`` times calls
    (:func:`edatalog.backend.running.spmd.timed_calls`): with ``slowest``, each run's slowest
    rank's, the time ``edl run`` reports of a call; else this rank's own."""
    mine, slowest_times = timed_calls(op, reps, warmup, sync, dev)
    return slowest_times if slowest else mine


def measure_class_floors(
    probes: tuple[tuple[str, str, str], ...],
    mode: Compile,
    fallback: float,
    sizes: Sizes,
    dev: Any,
    sync: Callable[[], None],
) -> dict[str, float]:
    """Each kernel class's floor (:func:`calibrate_probe.class_floor`), from its probe's two
    chains run by the runtime in ``mode``, in the order given; a class's other kernels cost the
    floors measured before it, else ``fallback`` (the mixed probe's)."""
    known: dict[KernelClass, float] = {}
    for name, short, long in probes:
        cls = KernelClass(name)
        seconds, launches = _two_chains((short, long), mode, sizes, dev, sync)
        known[cls] = calibrate_probe.class_floor(cls, seconds, launches, known, fallback)
    return {cls.value: floor for cls, floor in known.items()}


def _two_chains(
    graphs: tuple[str, str], mode: Compile, sizes: Sizes, dev: Any, sync: Callable[[], None]
) -> tuple[tuple[float, float], tuple[Launches, Launches]]:
    """A probe's short and long chain run by the runtime in ``mode``: each one's time per call
    and the kernels it launches."""
    runs = [calibrate_probe.runner(graph, dev, mode) for graph in graphs]
    seconds = (_seconds_per_call(runs[0][0], sync, sizes), _seconds_per_call(runs[1][0], sync, sizes))
    return seconds, (runs[0][1], runs[1][1])


def measure_links(sizes: Sizes, steps: _Steps, dev: Any) -> dict[str, Any]:
    """Point-to-point, exchange and collective times of this rank, inside an initialized
    torch.distributed group of at least two ranks; the ping-pong times only on rank 0."""
    torch = _torch()
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    sync: Callable[[], None] = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)

    def timed(op: Callable[[], None], reps: int, slowest: bool = True) -> list[float]:
        return _after_barriers(op, reps, sizes.warmup, sync, dev, slowest)

    pingpong: dict[str, float] = {}
    for nbytes in sizes.p2p_bytes:
        steps.now(f"ping-pong {size(nbytes)}")
        buf = torch.zeros(max(1, nbytes // 4), device=dev)

        def ping(buf: Any = buf) -> None:
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        reps = sizes.link_reps * (5 if nbytes <= 1 << 16 else 1)  # small messages: cheap, and noisy
        half = statistics.median(timed(ping, reps, slowest=False)) / 2  # rank 0's round trips
        if rank == 0:
            pingpong[str(nbytes)] = half
        steps.done()

    steps.now(f"exchange {size(sizes.exchange_bytes)}")
    send = torch.ones(max(1, sizes.exchange_bytes // 4), device=dev)
    recv = torch.empty_like(send)

    def exchange() -> None:
        reqs = [dist.isend(send, (rank + 1) % world), dist.irecv(recv, (rank - 1) % world)]
        for req in reqs:
            if req is not None:  # None only on a rank outside the group
                req.wait()

    exchange_s = statistics.median(timed(exchange, sizes.link_reps))
    steps.done()

    # Interference: matmuls about as long as the exchange, alone and while it runs.
    steps.now("matmuls beside an exchange")
    m, k, n = sizes.matmuls[0][-3:]
    a, b = torch.randn(m, k, device=dev), torch.randn(k, n, device=dev)
    matmul = TorchOps().matmul  # the runtime's GEMM, as the matmul rate is timed
    t0 = time.perf_counter()
    matmul(a, b)
    sync()
    one = max(time.perf_counter() - t0, 1e-9)
    count = max(1, round(exchange_s / one))

    def compute() -> None:
        for _ in range(count):
            matmul(a, b)

    def both() -> None:
        reqs = [dist.isend(send, (rank + 1) % world), dist.irecv(recv, (rank - 1) % world)]
        compute()
        for req in reqs:
            if req is not None:
                req.wait()

    compute_s = statistics.median(timed(compute, sizes.link_reps))
    both_s = statistics.median(timed(both, sizes.link_reps))
    steps.done()

    # A collective's step latency: a small all-reduce is nearly all steps, few bytes.  Timed as a
    # program meets it, right after every rank computed (a matmul), less that matmul alone: on
    # CPU ranks, a library thread woken while the cores are busy waits longer than in a ping-pong.
    steps.now(f"all_reduce {size(SMALL_COLLECTIVE_BYTES)} after a matmul")
    small = torch.ones(SMALL_COLLECTIVE_BYTES // 4, device=dev)
    sa, sb = torch.randn(192, 192, device=dev), torch.randn(192, 192, device=dev)  # ~0.2 ms on a CPU core
    sc = torch.empty(192, 192, device=dev)

    def matmul_then_all_reduce() -> None:
        torch.mm(sa, sb, out=sc)
        dist.all_reduce(small)

    # A mean, not a median: a call's time is the sum of its collectives', whose expected value is
    # the sum of their means; on gloo between busy CPU ranks a small all-reduce's median is a
    # third of its mean (a tenth of them wait out a scheduler tick, ~4 ms).  Timed as a loop, as
    # a program meets its collectives one after another, not each after a barrier.
    reps = sizes.link_reps * 5

    def per_call(op: Callable[[], None]) -> float:
        for _ in range(sizes.warmup):
            op()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            op()
        sync()
        return (time.perf_counter() - t0) / reps

    tiny, tiny_in = torch.ones(1, device=dev), torch.empty(1, device=dev)

    def matmul_then_message() -> None:  # as a program meets its messages: posted together after computing
        torch.mm(sa, sb, out=sc)
        ops = [dist.P2POp(dist.isend, tiny, (rank + 1) % world), dist.P2POp(dist.irecv, tiny_in, (rank - 1) % world)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    alone_s = per_call(lambda: torch.mm(sa, sb, out=sc))
    small_all_reduce_s = max(0.0, per_call(matmul_then_all_reduce) - alone_s)
    small_message_s = max(0.0, per_call(matmul_then_message) - alone_s)
    steps.done()
    # The same all-reduce as the runtime runs it, where the rule takes its own route: through
    # shared memory (the calibration's ranks share a machine), or where they cannot share it,
    # as pairwise exchanges.
    pairwise_s = shared_s = None
    world_group = dist.group.WORLD
    assert world_group is not None  # initialized
    library = _library(dev.type)
    wanted = all_reduce_route(library, SMALL_COLLECTIVE_BYTES, world, one_node=True)
    shared = wanted is AllReduceRoute.SHARED_MEMORY and shm.register(world_group, INIT_TIMEOUT_SECONDS)
    route = all_reduce_route(library, SMALL_COLLECTIVE_BYTES, world, one_node=True, shared_memory=shared)
    if route is AllReduceRoute.SHARED_MEMORY:
        steps.now(f"all_reduce {size(SMALL_COLLECTIVE_BYTES)} through shared memory")
        name = world_group.group_name
        for _ in range(sizes.warmup):
            shm.shm_all_reduce_(small, "sum", name)
        dist.barrier()
        each = []
        for _ in range(reps):
            t0 = time.perf_counter()
            shm.shm_all_reduce_(small, "sum", name)
            each.append(time.perf_counter() - t0)
        # Back to back, each call timed, the median: after a matmul, as gloo's is timed, its few
        # microseconds drowned in the matmul's own spread (the difference came out 0 in one
        # calibration and 98 µs in the next), and a loop's mean in the rare waits for a rank
        # the scheduler took off its core (197 µs in a third, 8 in a fourth).
        shared_s = statistics.median(each)
        steps.done()
    elif route is AllReduceRoute.EXCHANGES:
        steps.now(f"all_reduce {size(SMALL_COLLECTIVE_BYTES)} as pairwise exchanges, after a matmul")

        def matmul_then_exchange() -> None:
            torch.mm(sa, sb, out=sc)
            exchange_all_reduce_(small, "sum", world_group)

        pairwise_s = max(0.0, per_call(matmul_then_exchange) - alone_s)
        steps.done()

    numel = max(world, sizes.collective_bytes // 4 // world * world)
    data = torch.ones(numel, device=dev)
    steps.now(f"all_reduce {size(numel * 4)}")
    all_reduce_s = statistics.median(timed(lambda: dist.all_reduce(data), sizes.link_reps))
    steps.done()
    steps.now(f"reduce_scatter {size(numel * 4)}")
    out = torch.empty(numel // world, device=dev)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter_s = statistics.median(timed(lambda: reduce_scatter(out, data), sizes.link_reps))
    steps.done()
    return {
        "pingpong": pingpong,
        "exchange": exchange_s,
        "overlap": {"compute": compute_s, "both": both_s},
        "collective_bytes": numel * 4,
        "all_reduce": all_reduce_s,
        "small_all_reduce": small_all_reduce_s,
        "small_message": small_message_s,
        "small_exchange_all_reduce": pairwise_s,
        "small_shared_all_reduce": shared_s,
        "shared_memory": shared,
        "reduce_scatter": reduce_scatter_s,
    }


# -- running the ranks -------------------------------------------------------------------------------


def _rank_main(options: dict[str, Any], progress_path: str | None) -> dict[str, Any]:
    """One rank of a calibration job (started by :func:`edatalog.backend.running.launch.spawn`): its
    device's numbers and its side of the links."""
    opts = Options(**options)
    torch = _torch()
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    assert opts.threads is not None
    torch.set_num_threads(opts.threads)
    with contextlib.suppress(RuntimeError):  # only allowed before any parallel work
        torch.set_num_interop_threads(1)
    sizes = sizes_for(opts.device, opts.quick)
    timeout = datetime.timedelta(seconds=INIT_TIMEOUT_SECONDS)
    if opts.device == "cuda":
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
        dist.init_process_group(_library(opts.device).value, timeout=timeout, device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group(_library(opts.device).value, timeout=timeout)
    report = _file_reporter(progress_path) if rank == 0 and progress_path else None
    steps = _Steps(_device_steps(sizes) + _link_steps(sizes, opts), report)
    try:
        dist.barrier()  # every rank measures its device at once: they share the machine
        device = measure_device(opts, sizes, steps, dev, _Lockstep(dev))
        dist.barrier()
        links = measure_links(sizes, steps, dev)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return {"rank": rank, "device": device, "links": links}


def _file_reporter(path: str) -> ProgressFn:
    def report(done: float, total: float, what: str) -> None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{done}\t{total}\t{what}\n")

    return report


def _watch(path: Path, progress: ProgressFn, stop: threading.Event) -> None:
    """Pass the progress lines rank 0 appends to ``path`` on to ``progress``."""
    seen = 0
    while True:
        stopped = stop.wait(0.1)
        try:
            data = path.read_bytes()
        except OSError:
            data = b""
        end = max(seen, data.rfind(b"\n") + 1)
        for line in data[seen:end].decode("utf-8", "replace").splitlines():
            with contextlib.suppress(ValueError):  # only rank 0 writes these lines, whole
                done, total, what = line.split("\t", 2)
                progress(float(done), float(total), what)
        seen = end
        if stopped:  # the lines written last were passed on above
            return


def _spawned(opts: Options, progress: ProgressFn | None) -> dict[int, dict[str, Any]]:
    from edatalog.backend.running.launch import spawn

    sizes = sizes_for(opts.device, opts.quick)
    if progress is not None:
        progress(0, _device_steps(sizes) + _link_steps(sizes, opts), f"starting {opts.nproc} ranks")
    with tempfile.TemporaryDirectory(prefix="edl-calibrate-") as tmp:
        path = Path(tmp, "progress")
        stop = threading.Event()
        watcher = None
        if progress is not None:
            watcher = threading.Thread(target=_watch, args=(path, progress, stop), daemon=True)
            watcher.start()
        try:
            return spawn(opts.nproc, _rank_main, (dataclasses.asdict(opts), str(path)))
        finally:
            stop.set()
            if watcher is not None:
                watcher.join()


def _in_process(opts: Options, progress: ProgressFn | None) -> dict[int, dict[str, Any]]:
    torch = _torch()
    sizes = sizes_for(opts.device, opts.quick)
    before = torch.get_num_threads()
    assert opts.threads is not None
    torch.set_num_threads(opts.threads)
    try:
        device = measure_device(opts, sizes, _Steps(_device_steps(sizes), progress))
    finally:
        torch.set_num_threads(before)
    return {0: {"rank": 0, "device": device, "links": {}}}


# -- the result -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Calibration:
    """A measured machine: the topology the cost model uses, and every raw number."""

    topology: Topology
    measured: dict[str, Any] = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        """The machine file's content: the topology's keys and ``measured``."""
        return {**self.topology.to_dict(), "measured": self.measured}

    def toml(self) -> str:
        return _toml(self)

    def save(self, path: str) -> None:
        """Write the machine file: TOML or JSON, by ``path``'s suffix (as ``--topology`` reads it)."""
        check_output(path)
        text = self.toml() if Path(path).suffix.lower() == ".toml" else json.dumps(self.to_dict(), indent=1) + "\n"
        try:
            Path(path).write_text(text, encoding="utf-8")
        except OSError as exc:
            raise EdlError(f"cannot write {path}: {exc.strerror or exc}") from None


def check_output(path: str) -> None:
    """Fail before measuring when the machine file cannot be written there."""
    p = Path(path)
    if p.suffix.lower() not in (".toml", ".json"):
        raise EdlError(
            f"cannot write the machine file {path}: its name must end in .toml or .json",
            help="--topology reads a machine file by its suffix: use e.g. -o machine.toml",
        )
    if p.is_dir():
        raise EdlError(f"cannot write {path}: it is a directory")
    parent = p.parent
    if not parent.is_dir():
        raise EdlError(f"cannot write {path}: the directory {parent} does not exist", help="create it first")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise EdlError(f"cannot write {path}: permission denied")


def calibrate(options: Options | None = None, progress: ProgressFn | None = None) -> Calibration:
    """Measure this machine (see the module's docstring); ``progress(done, total, what)`` is
    called as it goes (from another thread when several ranks run)."""
    opts = (options or Options()).resolved()
    before = {"busy_cores": busy_cores(), "load_average": load_average()}  # how quiet the machine was
    results = _in_process(opts, progress) if opts.nproc == 1 else _spawned(opts, progress)
    result = summarize(opts, results)
    result.measured.update({k: round(v, 2) for k, v in before.items() if v is not None})
    return result


def interference_of(compute: float, transfer: float, both: float) -> float:
    """The share of a transfer's time that compute loses to it, from compute alone, the transfer
    alone and both at once: 0 when both take as long as the longer alone (they overlap fully), 1
    when they take as long as the two one after the other."""
    shorter = min(compute, transfer)
    if shorter <= 0:
        return 0.0
    return min(1.0, max(0.0, (both - max(compute, transfer)) / shorter))


def summarize(opts: Options, results: dict[int, dict[str, Any]]) -> Calibration:
    """The machine from every rank's numbers: device rates the slowest rank's, links rank 0's
    ping-pong and the slowest rank's exchange and collectives."""
    torch = _torch()
    sizes = sizes_for(opts.device, opts.quick)
    ranks = [results[r] for r in sorted(results)]
    devices = [r["device"] for r in ranks]
    keys = [shape_key(s) for s in sizes.matmuls]
    probe_key = shape_key(sizes.probe)

    def program_rate(device: dict[str, Any]) -> float:
        entry = device["matmul"][opts.dtype]
        rates = [entry[k] for k in keys if k in entry]
        return statistics.median(rates) if rates else float(entry[probe_key])

    rank_flops = [program_rate(d) for d in devices]
    rank_bandwidth = [d["copy"][str(sizes.copy_bytes[0])] for d in devices]
    rank_floor = [d["kernel_floor"] for d in devices]
    rank_overhead = [d["call_overhead"] for d in devices]
    rank_dispatch = [d["torch_dispatch"] for d in devices]
    kernels = devices[0]["probe_kernels"]
    if kernels:
        floor_how = calibrate_probe.describe((kernels[0], kernels[1]), runtime_mode(opts))
    else:
        floor_how = "a 1-element add (torch's dispatch): no runtime probe was given"
    flops, bandwidth, floor = _sig(min(rank_flops)), _sig(min(rank_bandwidth)), _sig(max(rank_floor))
    overhead = _sig(max(rank_overhead)) if max(rank_overhead) > 0 else 0.0

    matmul: dict[str, dict[str, Any]] = {}
    for name, entry in devices[0]["matmul"].items():
        matmul[name] = {
            k: (_sig(min(d["matmul"][name].get(k, v) for d in devices)) if isinstance(v, float) else v)
            for k, v in entry.items()
        }
    copy = {k: _sig(min(d["copy"][k] for d in devices)) for k in devices[0]["copy"]}

    if opts.device == "cuda":
        memory = min(d["memory"] for d in devices)
        memory_note = "the GPU's memory"
    else:
        available = available_memory()
        memory = available // opts.nproc
        memory_note = f"available memory ({size(available)}) / {opts.nproc} rank{'s' if opts.nproc > 1 else ''}"
    several = opts.nproc > 1
    measured: dict[str, Any] = {
        "command": opts.command(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "edatalog": _version(),
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": devices[0]["kind"] if opts.device == "cuda" else cpu_name(),
        "device": opts.device,
        "ranks": opts.nproc,
        "threads": opts.threads,
        "dtype": opts.dtype,
        "compile": runtime_mode(opts).value,
        "quick": opts.quick,
        "torch_dispatch": _sig(max(rank_dispatch)),  # a 1-element add: torch alone, no runtime
        "how": {  # where each number of the machine comes from
            "flops": f"{opts.dtype} matmul, the median over {len(keys)} shapes ([measured.matmul.{opts.dtype}])",
            "bandwidth": f"copy of {size(sizes.copy_bytes[0])}, bytes read + written",
            "kernel_floor": floor_how,
            "call_overhead": (
                "what the shorter chain's time per call leaves beyond its kernel launches"
                + (
                    ", split by rows across the ranks, each call started as edl run starts calls"
                    " (the ranks leave a barrier together)"
                )
                * several
            )
            if kernels
            else "no runtime probe was given",
            "memory": memory_note,
        },
        "matmul": matmul,
        "copy": copy,
        "per_rank": {
            "flops": [_sig(v) for v in rank_flops],
            "bandwidth": [_sig(v) for v in rank_bandwidth],
            "kernel_floor": [_sig(v) for v in rank_floor],
            "call_overhead": [_sig(v) if v else 0.0 for v in rank_overhead],
            "torch_dispatch": [_sig(v) for v in rank_dispatch],
            "probe_seconds": [[_sig(v) for v in d.get("probe_seconds", [])] for d in devices],
        },
    }

    if opts.device == "cuda":  # whether f32 matmuls ran on TF32 tensor cores
        measured["tf32"] = bool(torch.backends.cuda.matmul.allow_tf32)
    if opts.nproc > 1:
        links = [r["links"] for r in ranks]
        pingpong = links[0]["pingpong"]
        latency = _sig(pingpong[str(sizes.p2p_bytes[0])])
        largest = sizes.p2p_bytes[-1]
        exchange_s = max(lk["exchange"] for lk in links)
        link_bw = _sig(sizes.exchange_bytes / _beyond(exchange_s, latency))
        n, cbytes = opts.nproc, links[0]["collective_bytes"]
        all_reduce_s = max(lk["all_reduce"] for lk in links)
        reduce_scatter_s = max(lk["reduce_scatter"] for lk in links)
        backend = _library(opts.device).value
        compute_s = max(lk["overlap"]["compute"] for lk in links)
        both_s = max(lk["overlap"]["both"] for lk in links)
        interference = _sig(interference_of(compute_s, exchange_s, both_s))
        # The cost model's small all-reduce: 2 min(n - 1, ceil(log2 n)) steps, and its bytes.
        small_s = max(lk["small_all_reduce"] for lk in links)
        hops = 2 * min(n - 1, math.ceil(math.log2(n)))
        beyond = max(small_s - 2 * SMALL_COLLECTIVE_BYTES / link_bw, small_s / 2)
        step_latency = _sig(beyond / hops)
        # A message as programs meet them (right after computing): on gloo between busy CPU ranks
        # several times the idle ping-pong's half round trip, which the rates above are net of.
        message_s = max(lk.get("small_message", 0.0) for lk in links)
        message_latency = _sig(max(latency, message_s))
        # The small all-reduce as the runtime runs it where it takes pairwise exchanges (gloo):
        # log2 n steps, each its bytes one way and then the other.
        pairwise = [lk.get("small_exchange_all_reduce") for lk in links]
        exchange_latency = None
        if all(t is not None for t in pairwise):
            pairwise_s = max(t for t in pairwise if t is not None)
            exchanges = round(math.log2(n))
            exchange_latency = _sig(
                max(pairwise_s - 2 * exchanges * SMALL_COLLECTIVE_BYTES / link_bw, pairwise_s / 2) / exchanges
            )
            measured["how"]["exchange_latency"] = (
                f"an all-reduce of {size(SMALL_COLLECTIVE_BYTES)} as the runtime's pairwise exchanges right after a "
                "matmul, less the matmul alone (the slowest rank's mean over a loop of them) and its bytes' time, "
                "over its steps"
            )
            measured["small_exchange_all_reduce"] = {
                "bytes": SMALL_COLLECTIVE_BYTES,
                "seconds": _sig(pairwise_s),
                "steps": exchanges,
            }
        # The all-reduce through shared memory (gloo's ranks of one machine): one chunk, less its
        # bytes' memory traffic (shared_memory_all_reduce_seconds).
        shared = [lk.get("small_shared_all_reduce") for lk in links]
        shared_latency = None
        if all(t is not None for t in shared):
            shared_s = max(t for t in shared if t is not None)
            traffic = (n + 3) * SMALL_COLLECTIVE_BYTES / bandwidth
            shared_latency = _sig(max(shared_s - traffic, shared_s / 2))
            measured["how"]["shared_memory_latency"] = (
                f"an all-reduce of {size(SMALL_COLLECTIVE_BYTES)} through shared memory as the runtime runs it "
                "(the slowest rank's median over a loop of them), less its bytes' memory traffic"
            )
            measured["small_shared_all_reduce"] = {"bytes": SMALL_COLLECTIVE_BYTES, "seconds": _sig(shared_s)}
        intra = Link(
            backend,
            link_bw,
            message_latency,
            interference,
            collective_latency=step_latency,
            exchange_latency=exchange_latency,
            shared_memory_latency=shared_latency,
        )
        measured["how"]["collective_latency"] = (
            f"an all-reduce of {size(SMALL_COLLECTIVE_BYTES)} right after a matmul, less the matmul alone "
            "(the slowest rank's mean over a loop of them) and its bytes' time, over its steps"
        )
        measured["small_all_reduce"] = {"bytes": SMALL_COLLECTIVE_BYTES, "seconds": _sig(small_s), "steps": hops}
        measured["backend"] = backend
        measured["how"]["latency"] = (
            "a 4 B message to the next rank and one from the previous, posted together right after a matmul, "
            "less the matmul alone (the slowest rank's mean over a loop of them); at least half the round trip "
            f"of {size(sizes.p2p_bytes[0])} between ranks 0 and 1 ([measured.p2p])"
        )
        measured["small_message"] = {"bytes": 4, "seconds": _sig(message_s)}
        exchanged = size(sizes.exchange_bytes)
        measured["how"]["link_bandwidth"] = f"per direction, in a {exchanged} exchange of all ranks at once"
        measured["p2p"] = {
            "latency": latency,
            "bandwidth": _sig(largest / _beyond(pingpong[str(largest)], latency)),
            "one_way": {k: _sig(v) for k, v in pingpong.items()},
        }
        measured["exchange"] = {"bytes": sizes.exchange_bytes, "seconds": _sig(exchange_s), "bandwidth": link_bw}
        measured["all_reduce"] = {
            "bytes": cbytes,
            "seconds": _sig(all_reduce_s),
            "busbw": _sig(cbytes / all_reduce_s * 2 * (n - 1) / n),
        }
        measured["reduce_scatter"] = {
            "bytes": cbytes,
            "seconds": _sig(reduce_scatter_s),
            "busbw": _sig(cbytes / reduce_scatter_s * (n - 1) / n),
        }
        measured["how"]["interference"] = (
            "matmuls as long as the exchange, alone and while it runs: the share of the shorter that did not overlap"
        )
        measured["overlap"] = {
            "compute_seconds": _sig(compute_s),
            "exchange_seconds": _sig(exchange_s),
            "both_seconds": _sig(both_s),
            "interference": interference,
        }
    else:
        intra = Link("local", bandwidth, 0.0)  # one device: nothing is ever sent
        measured["how"]["link_bandwidth"] = "one device: no link to measure; the copy rate stands in"
        measured["how"]["latency"] = "one device: no link to measure"
    kind = devices[0]["kind"]
    name = f"calibrated-{opts.device}x{opts.nproc}"
    library = _library(opts.device)
    device_overhead = max(d.get("device_call_overhead", d["call_overhead"]) for d in devices)
    general = _general_bandwidth(devices, floor, device_overhead, flops, bandwidth)
    if general is not None:
        measured["general"] = general
        measured["how"]["general_bandwidth"] = (
            f"causal scores and their row maxima over {calibrate_probe.GENERAL_S} x {calibrate_probe.GENERAL_S} run "
            "by edatalog's torch runtime: the maxima's bytes / (seconds - the roofline's)"
        )
    rate = general["bandwidth"] if general is not None else 0.0
    attention = _attention_rate(devices, device_overhead)
    attention_peaks: tuple[tuple[str, float], ...] = ()
    if attention is not None:
        rows, heads, width = sizes.attention
        measured["attention"] = attention
        measured["how"]["attention_flops"] = (
            f"a causal {opts.dtype} attention of {heads} heads of {width} over {rows} positions, fused, run by "
            "edatalog's torch runtime: its FLOPs over the flash tiles / (seconds - the call overhead)"
        )
        attention_peaks = ((opts.dtype, attention["flops_per_second"]),)
    machine = tuple(
        Device(i, 0, kind, memory, flops, bandwidth, general_bandwidth=rate, attention_peaks=attention_peaks)
        for i in range(opts.nproc)
    )
    if all("device_call_overhead" in d for d in devices):
        measured["per_rank"]["device_call_overhead"] = [_sig(d["device_call_overhead"]) for d in devices]
    classes = [d.get("kernel_floors", {}) for d in devices]
    floors = tuple(
        (cls, _sig(max(c[cls.value] for c in classes))) for cls in KernelClass if all(cls.value in c for c in classes)
    )
    if floors:
        measured["how"]["kernel_floors"] = calibrate_probe.describe_classes(runtime_mode(opts))
        measured["per_rank"]["kernel_floors"] = {cls.value: [_sig(c[cls.value]) for c in classes] for cls, _ in floors}
    # Whether the ranks could share memory (gloo): else the machine says so, and its small
    # all-reduces are priced as the pairwise exchanges the runtime then runs.
    shared_memory = opts.nproc < 2 or all(r["links"].get("shared_memory", True) for r in ranks)
    topo = Topology(name, machine, intra, None, 1.0, floor, library, overhead, floors, shared_memory)
    topo.verify()
    return Calibration(topo, measured)


def _general_bandwidth(
    devices: list[dict[str, Any]], floor: float, overhead: float, flops: float, bandwidth: float
) -> dict[str, Any] | None:
    """The general path's rate from the slowest rank's probe: the probe's time less the call
    overhead of one device's program (the probe runs on one device, in a loop) and what the
    roofline gives each of its kernels (``max(floor * launches, flops / rate, bytes /
    bandwidth)``), over the general kernels' bytes, so that the cost model, adding ``bytes /
    general_bandwidth`` to those, prices the probe at its measured time; None without a probe,
    0 when the probe ran within its roofline (nothing to add)."""
    probes = [d["general"] for d in devices if "general" in d]
    if not probes:
        return None
    seconds = max(p["seconds"] for p in probes)
    kernels = probes[0]["kernels"]
    roof = overhead + sum(max(floor * n, f / flops, b / bandwidth) for f, b, _, n in kernels)
    nbytes = sum(b for _, b, general, _ in kernels if general)
    beyond = seconds - roof
    rate = _sig(nbytes / beyond) if beyond > 0 else 0.0
    return {"seconds": _sig(seconds), "roofline_seconds": _sig(roof), "bytes": nbytes, "bandwidth": rate}


def _attention_rate(devices: list[dict[str, Any]], overhead: float) -> dict[str, Any] | None:
    """The fused attention's rate from the slowest rank's probe: its FLOPs (as the cost model
    counts them) over its time less the call overhead of one device's program; None without a
    probe."""
    probes = [d["attention"] for d in devices if "attention" in d]
    if not probes:
        return None
    seconds = max(p["seconds"] for p in probes)
    flops = probes[0]["flops"]
    rate = _sig(flops / max(seconds - overhead, seconds / 2))
    return {"seconds": _sig(seconds), "flops": flops, "flops_per_second": rate}


def _beyond(seconds: float, latency: float) -> float:
    """A transfer's time less its latency (the part bytes / bandwidth accounts for)."""
    return seconds - latency if seconds > 2 * latency else seconds / 2


# -- the machine file -------------------------------------------------------------------------------


def _toml(cal: Calibration) -> str:
    t, m = cal.topology, cal.measured
    d = t.devices[0]
    several = t.n > 1
    head = [
        f"# {t.name}: this machine as `{m['command']}` measured it,",
        f"# {m['date']}; edatalog {m['edatalog']}, torch {m['torch']}, {m['processor']}.",
        "# Use it with --topology FILE (edl plan, edl run) or edatalog.topology(FILE).",
        "# flops and bandwidth are rates the ranks reached (the slowest rank's), not peaks: efficiency = 1.0.",
        "# [measured] keeps every raw number; the loader ignores it.",
    ]
    if m["quick"]:
        head.append("# --quick: tiny sizes, to check the setup; these numbers predict nothing.")
    body: list[tuple[str, str]] = [
        ("", ""),
        (f"name = {_value(t.name)}", ""),
        (f"nodes = [{t.n}]", "all ranks on this machine"),
        ("efficiency = 1.0", "the rates below were reached: nothing to discount"),
        (f"kernel_floor = {_value(t.kernel_floor)}", f"s: {m['how']['kernel_floor']}"),
        (f"call_overhead = {_value(t.call_overhead)}", f"s: {m['how']['call_overhead']}"),
        (f"library = {_value(t.library.value)}", "torch.distributed's backend: which exchanges run as collectives"),
        *(
            []
            if t.shared_memory
            else [("shared_memory = false", "the ranks could not share memory: small all-reduces go as exchanges")]
        ),
        ("", ""),
        ("[device]", ""),
        (f"kind = {_value(d.kind)}", ""),
        (f"memory = {d.memory}", f"bytes: {m['how']['memory']}"),
        (f"flops = {_value(d.flops)}", f"FLOP/s: {m['how']['flops']}"),
        (f"bandwidth = {_value(d.bandwidth)}", f"B/s: {m['how']['bandwidth']}"),
        *(
            [(f"general_bandwidth = {_value(d.general_bandwidth)}", f"B/s: {m['how']['general_bandwidth']}")]
            if "general_bandwidth" in m["how"]
            else []
        ),
        *(
            [(f"attention_flops = {{ {_inline(d.attention_peaks)} }}", f"FLOP/s: {m['how']['attention_flops']}")]
            if d.attention_peaks
            else []
        ),
    ]
    if t.kernel_floors:
        body += [("", ""), ("[kernel_floors]", f"s: {m['how']['kernel_floors']}")]
        body += [(f"{cls.value} = {_value(f)}", "") for cls, f in t.kernel_floors]
    body += [
        ("", ""),
        ("[links.intra]", ""),
        (f"name = {_value(t.intra.name)}", "torch.distributed's backend" if several else ""),
        (f"bandwidth = {_value(t.intra.bandwidth)}", f"B/s: {m['how']['link_bandwidth']}"),
        (f"latency = {_value(t.intra.latency)}", f"s: {m['how']['latency']}"),
    ]
    if t.intra.collective_latency is not None:
        body.append(
            (f"collective_latency = {_value(t.intra.collective_latency)}", f"s: {m['how']['collective_latency']}")
        )
    if t.intra.exchange_latency is not None:
        body.append((f"exchange_latency = {_value(t.intra.exchange_latency)}", f"s: {m['how']['exchange_latency']}"))
    if t.intra.shared_memory_latency is not None:
        how = m["how"]["shared_memory_latency"]
        body.append((f"shared_memory_latency = {_value(t.intra.shared_memory_latency)}", f"s: {how}"))
    if several:
        body.append((f"interference = {_value(t.intra.interference)}", m["how"]["interference"]))
    width = max(len(code) for code, _ in body) + 2
    lines = head + [f"{code:<{width}}# {note}" if note else code for code, note in body]
    lines += ["", *_tables("measured", m, _COMMENTS)]
    return "\n".join(lines) + "\n"


def _inline(rates: Sequence[tuple[str, float]]) -> str:
    """Rates per dtype as an inline TOML table's body."""
    return ", ".join(f"{k} = {_value(v)}" for k, v in rates)


_COMMENTS = {
    "measured": "every raw number (informational: the loader ignores this table)",
    "measured.how": "where each number of the machine above comes from",
    "measured.matmul": "FLOP/s by shape: MxKxN is (M x K)(K x N), BxMxKxN a batch of B; the slowest rank's",
    "measured.copy": "B/s (bytes read + written) by bytes copied; the slowest rank's",
    "measured.per_rank": "each rank's flops (FLOP/s), bandwidth (B/s), kernel floor and torch dispatch (s)",
    "measured.p2p": "between ranks 0 and 1: latency (s), bandwidth of the largest message one way (B/s)",
    "measured.p2p.one_way": "s by message bytes: half a ping-pong's round trip",
    "measured.exchange": "every rank sends to the next and receives from the previous at once; B/s per direction",
    "measured.all_reduce": "bus bandwidth: bytes / seconds * 2 (n - 1) / n; the slowest rank's seconds",
    "measured.reduce_scatter": "bus bandwidth: bytes / seconds * (n - 1) / n; the slowest rank's seconds",
    "measured.small_all_reduce": "right after a matmul, less the matmul alone; the slowest rank's mean over a loop",
    "measured.small_exchange_all_reduce": "the same, as the runtime's pairwise exchanges",
    "measured.overlap": "matmuls alone, the exchange alone, both at once (s; the slowest rank's)",
}


def _tables(prefix: str, table: dict[str, Any], comments: dict[str, str]) -> list[str]:
    """``table`` as TOML: its values under ``[prefix]`` (with its comment), then its subtables."""
    note = comments.get(prefix)
    lines = [f"[{prefix}]  # {note}" if note else f"[{prefix}]"]
    subtables = []
    for key, value in table.items():
        if isinstance(value, dict):
            subtables.append((key, value))
        else:
            lines.append(f"{_key(key)} = {_value(value)}")
    for key, value in subtables:
        lines += ["", *_tables(f"{prefix}.{_key(key)}", value, comments)]
    return lines


def _key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() and key.isascii() else json.dumps(key)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"not a finite number: {value}")
        text = f"{value:.4g}"  # 5.501e+10 rather than 55010000000.0
        if float(text) != value:
            return repr(value)
        return text if any(c in text for c in ".e") else text + ".0"  # a TOML float, not an integer
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


# -- small helpers ----------------------------------------------------------------------------------


def _sig(x: float) -> float:
    """Four significant digits: measurements are not more precise than that."""
    return float(f"{x:.4g}")


def rate(x: float, unit: str) -> str:
    """``51.2 GFLOP/s``, ``12.3 GB/s``: three significant digits and a decimal prefix."""
    for prefix in ("", "k", "M", "G", "T", "P"):
        if abs(x) < 1000:
            return f"{x:.3g} {prefix}{unit}"
        x /= 1000
    return f"{x:.3g} E{unit}"


def seconds(x: float) -> str:
    """``2.9 µs``, ``41 ms``."""
    for unit, scale in (("ns", 1e-9), ("µs", 1e-6), ("ms", 1e-3)):
        if abs(x) < 1000 * scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g} s"


def size(nbytes: float) -> str:
    """``256 MiB``, ``4 B``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.4g} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("edatalog")
    except metadata.PackageNotFoundError:
        return "unknown"


def available_memory() -> int:
    """Bytes of memory available to new processes (Linux: MemAvailable), else the physical memory."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def load_average() -> float | None:
    """The machine's load (runnable processes, averaged over a minute), where the OS says it."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def busy_cores(interval: float = 0.25) -> float | None:
    """How many cores other programs keep busy now (Linux: /proc/stat over ``interval`` seconds)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields[:8]), idle  # user nice system idle iowait irq softirq steal

    try:
        total0, idle0 = sample()
        time.sleep(interval)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return None
    return (1 - (idle1 - idle0) / (total1 - total0)) * (os.cpu_count() or 1)


BUSY_CORES = 0.5  # other programs using this much of the machine when calibration begins: a warning


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"
