"""The runtime probe of calibration: what a kernel launch, and a call, cost in edatalog's runtime.

The cost model prices a kernel at ``max(kernel_floor * launches, flops / rate, bytes / bandwidth)``
(a rule's block launches one kernel per operator: :func:`edatalog.ir.cost.launches`) and a
call of a device's program at ``call_overhead`` more, so both must be what edatalog's runtime
costs *as it runs a plan*, in the mode it runs it (:class:`~edatalog.backend.running.compiled.Compile`):
interpreted, an op costs tens of microseconds of Python (assembling its inputs, evaluating the
block, writing the result); replayed as a recorded graph, a few, about torch's own dispatch;
and a call pays once for taking its inputs and handing out its outputs.  A floor of torch's
dispatch alone predicts an interpreted plan of many small blocks far too fast, and the
interpreter's floor a compiled one far too slow.

So calibration runs a probe: a chain of small rules over a few inputs (:func:`source`), planned
on one device and synthesized into a device program as any plan is, then run by the torch
runtime in the mode asked for, as :mod:`~edatalog.backend.running.runtime` builds it for a
plan (its first calls interpret and record, untimed).  It runs at two lengths,
:data:`RULES` and :data:`RULES_LONG`: the difference of their times over the difference of
their kernel launches is the floor, and what the shorter chain's time leaves beyond its
launches is the call overhead.  Each rank runs it while the others do, as they will run a plan's kernels.

This module is apart from :mod:`~edatalog.backend.calibrating.calibrate` because the backend cannot compile
``.edl`` text (the layering of ``tests/test_architecture.py``): the command line compiles
:func:`source` and passes the graphs' JSON in :class:`~edatalog.backend.calibrating.calibrate.Options`;
:func:`runner` takes it from there.  torch is imported on first use, never on import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from edatalog.backend.kernels.arrays import TorchOps
from edatalog.backend.lowering.exchange import synthesize
from edatalog.backend.lowering.lowered import Lowered, lower
from edatalog.backend.running.compiled import Compile
from edatalog.backend.running.runtime import runtime
from edatalog.errors import EdlError
from edatalog.ir import program as ir
from edatalog.ir.cost import KernelClass, Launches
from edatalog.ir.graph import Graph
from edatalog.solver.strategies import build
from edatalog.solver.topology import from_dict

RULES = 16  # rules in the probe's chain
RULES_LONG = 64  # and in the longer chain: the floor is the difference per kernel launch
ROWS, COLS = 16, 64  # the probe's blocks: a few KiB each, so every launch costs its floor


def source(rules: int = RULES, dtype: str = "f32") -> str:
    """The probe program: a chain of ``rules`` small rules of the kinds a model's layers are made
    of, in turn (a GEMM, a norm's sum of squares and its scaling, a residual update that also
    reads a row vector), each reading the one before: a launch is priced as a model's small
    kernels cost, views and broadcasts included, not as the cheapest possible kernel (a one-cell
    add runs in half the time of a small block's)."""
    if rules < 1:
        raise ValueError(f"the probe needs at least one rule, not {rules}")
    lines = [
        "# edl calibrate's runtime probe: a chain of small rules, timed per kernel launch.",
        f"dim I = {ROWS}, J = {COLS}.",
        f"input x[I, J] : {dtype}.",
        f"param w[J, J] : {dtype}.",
        f"param v[J] : {dtype}.",
        f"output a{rules - 1}.",
        "a0[i, j] = x[i, j] + v[j].",
    ]
    for k in range(1, rules):
        prev = f"a{k - 1}"
        kind = k % 4
        if kind == 1:
            lines.append(f"a{k}[i, j] += {prev}[i, l] * w[l, j].")
        elif kind == 2:
            lines.append(f"a{k}[i] += {prev}[i, j] * {prev}[i, j] / J.")
        elif kind == 3:
            lines.append(f"a{k}[i, j] = a{k - 2}[i, j] * rsqrt({prev}[i] + 1.0).")
        else:
            lines.append(f"a{k}[i, j] = {prev}[i, j] * 0.5 + x[i, j] * v[j].")
    return "\n".join(lines) + "\n"


GENERAL_S = 512  # the general probe's sequence: a causal maximum over S x S scores


def general_source(seq: int = GENERAL_S, dtype: str = "f32") -> str:
    """The general-path probe: causal scores and their row maxima, as attention's rules run when
    a plan cuts them apart (no prepared torch call covers a maximum, and the maximum reads
    scores only partly present, as the guard left them)."""
    lines = [
        "# edl calibrate's general-path probe: causal scores and their row maxima.",
        f"dim S = {seq}.",
        f"input x[S, S] : {dtype}.",
        "output m.",
        "a[s, t] = x[s, t] * 0.5 where t <= s.",
        "m[s] max= a[s, t].",
    ]
    return "\n".join(lines) + "\n"


def attention_source(rows: int, heads: int, width: int, dtype: str = "f32") -> str:
    """The attention probe: one causal attention of ``heads`` heads of ``width`` over ``rows``
    positions (q = k = v the input), the five rules the torch runtime fuses into one kernel: its
    time gives the rate a fused attention reaches (``device.attention_flops``)."""
    lines = [
        "# edl calibrate's attention probe: one causal attention, fused into one kernel.",
        f"dim S = {rows}, H = {heads}, E = {width}.",
        f"input x[S, H, E] : {dtype}.",
        "output o.",
        f"sc[h, s, t] += x[s, h, e] * x[t, h, e] / {width**0.5} where t <= s.",
        "mx[h, s] max= sc[h, s, t].",
        "p[h, s, t] = exp(sc[h, s, t] - mx[h, s]).",
        "l[h, s] += p[h, s, t].",
        "o[s, h, e] += p[h, s, t] * x[t, h, e] / l[h, s].",
    ]
    return "\n".join(lines) + "\n"


def attention_runner(graph_json: str, device: Any, mode: Compile) -> tuple[Callable[[], None], int]:
    """A call that runs the attention probe once on ``device`` in ``mode``, and its fused
    kernel's FLOPs as the cost model counts them (over the flash tiles it computes)."""
    run, lowered = _runner(graph_json, device, mode)
    fused = [lowered.costs[(d, k)] for d, k, op in lowered.programs.ops() if isinstance(op, ir.Fused)]
    if len(fused) != 1 or any(isinstance(op, ir.Kernel) for _, _, op in lowered.programs.ops()):
        raise EdlError("the attention probe did not run as one fused attention kernel")
    return run, fused[0].flops


CLASS_LINKS = (8, 32)  # links in the short and the long chain of a kernel class's probe
HEADS, HEAD_DIM = 4, 16  # the attention probe's heads, of ROWS queries and keys each


def class_source(cls: KernelClass, links: int, dtype: str = "f32") -> str:
    """The probe of one kernel class: a chain of ``links`` small blocks, each one kernel of
    ``cls`` (a reduction's link also scales by its result: an elementwise kernel, whose floor
    is measured first), so that the difference of two chains' times per kernel is that class's
    floor (:func:`class_floor`)."""
    if links < 1:
        raise ValueError(f"a class probe needs at least one link, not {links}")
    lines = [
        f"# edl calibrate's {cls} probe: a chain of small {cls} kernels, timed per launch.",
        f"dim I = {ROWS}, J = {COLS}, H = {HEADS}, E = {HEAD_DIM}.",
        f"param w[J, J] : {dtype}.",
        f"param v[J] : {dtype}.",
        "input ids[I] : i64.",
        f"output a{links}.",
    ]
    if cls is KernelClass.ATTENTION:  # causal attention over I positions, q = k = v the previous link
        lines[2:5] = [f"input x[I, H, E] : {dtype}."]
        lines.append("a0[s, h, e] = x[s, h, e] * 0.5.")
    else:
        lines.insert(2, f"input x[I, J] : {dtype}.")
        lines.append("a0[i, j] = x[i, j] + v[j].")
    for k in range(1, links + 1):
        p = f"a{k - 1}"
        if cls is KernelClass.ELEMENTWISE:
            lines.append(f"a{k}[i, j] = {p}[i, j] * v[j].")
        elif cls is KernelClass.GEMM:
            lines.append(f"a{k}[i, j] += {p}[i, l] * w[l, j].")
        elif cls is KernelClass.REDUCTION:
            lines += [f"r{k}[i] += {p}[i, j].", f"a{k}[i, j] = {p}[i, j] * r{k}[i]."]
        elif cls is KernelClass.GATHER:
            lines.append(f"a{k}[i, j] = {p}[u, j] where ids[i] = u.")
        else:
            lines += [
                f"sc{k}[h, s, t] += {p}[s, h, e] * {p}[t, h, e] / {HEAD_DIM**0.5} where t <= s.",
                f"mx{k}[h, s] max= sc{k}[h, s, t].",
                f"p{k}[h, s, t] = exp(sc{k}[h, s, t] - mx{k}[h, s]).",
                f"l{k}[h, s] += p{k}[h, s, t].",
                f"a{k}[s, h, e] += p{k}[h, s, t] * {p}[t, h, e] / l{k}[h, s].",
            ]
    return "\n".join(lines) + "\n"


CLASS_ORDER = tuple(KernelClass)  # elementwise first: the reduction probe's links scale by their sums


def class_floor(
    cls: KernelClass,
    seconds: tuple[float, float],
    launches: tuple[Launches, Launches],
    known: dict[KernelClass, float],
    fallback: float,
) -> float:
    """The floor of ``cls`` from its probe's two chains: the difference of their times, less
    what their other kernels cost (at the floors ``known`` so far, else ``fallback``), per
    kernel of ``cls`` more.  Noise larger than the difference: the longer chain's time per kernel."""
    (short_s, long_s), (short, long) = seconds, launches
    more = {c: n - dict(short.items()).get(c, 0) for c, n in long.items()}
    if more.get(cls, 0) <= 0:
        raise ValueError(f"the longer {cls} chain must launch more {cls} kernels: {short} and {long}")
    others = sum(known.get(c, fallback) * n for c, n in more.items() if c is not cls)
    floor = (long_s - short_s - others) / more[cls]
    return floor if floor > 0 else long_s / long.total


Cost = tuple[int, int, bool, int]  # a kernel's flops, bytes, whether it takes the general path, launches


def general_runner(graph_json: str, device: Any, mode: Compile) -> tuple[Callable[[], None], list[Cost]]:
    """A call that runs the general probe once on ``device`` in ``mode``, and its kernels'
    costs as the cost model counts them (``OpCost``): calibration prices the others by the
    roofline and gives the rest of the time to the general ones' bytes."""
    run, lowered = _runner(graph_json, device, mode)
    costs = [lowered.costs[(d, k)] for d, k, op in lowered.programs.ops() if isinstance(op, ir.Kernel)]
    if not any(c.general for c in costs):
        raise EdlError("the general-path probe has no kernel on the general path to time")
    return run, [(c.flops, c.nbytes, c.general, c.launches.total) for c in costs]


def describe(kernels: tuple[int, int], mode: Compile) -> str:
    """Where the floor comes from, for the machine file."""
    how = "interpreted op by op" if mode is Compile.NONE else f"replayed as a recorded graph ({mode.value})"
    short, long = kernels
    return (
        f"small rules (a GEMM, a norm, an update) run by edatalog's torch runtime, {how}: chains of "
        f"{short} and {long} kernel launches, the difference per launch"
    )


def describe_classes(mode: Compile) -> str:
    """Where the per-class floors come from, for the machine file."""
    how = "interpreted op by op" if mode is Compile.NONE else f"replayed as a recorded graph ({mode.value})"
    short, long = CLASS_LINKS
    return (
        f"per kernel class, chains of {short} and {long} small kernels of the class run by edatalog's torch "
        f"runtime, {how}: the difference per kernel, less the chains' other kernels at their floors"
    )


def runner(graph_json: str, device: Any, mode: Compile, world: int = 1) -> tuple[Callable[[], None], Launches]:
    """A call that runs the probe's program once on the torch ``device`` in ``mode`` (as the
    torch runtime runs a plan's program on one device), and the kernels each call launches
    (as the cost model counts them: :func:`edatalog.ir.cost.launches`).  With ``world`` ranks
    (in a torch.distributed group of that many), the call is this rank's part of a plan that
    splits the rows across them, without exchanges (the ``data`` baseline), and the kernels are
    one rank's: a call of a plan on several ranks costs more than one device's (each rank's
    share of the outputs, their absent cells), and the call overhead is measured so."""
    run, lowered = _runner(graph_json, device, mode, world)
    kernels = Launches()
    for d, k, op in lowered.programs.ops():
        if d == 0 and isinstance(op, ir.Kernel | ir.Fused | ir.Combine):
            kernels += lowered.costs[(d, k)].launches
    if kernels.total == 0:
        raise EdlError("the calibration probe has no kernel to time")
    return run, kernels


def floor_and_overhead(seconds: tuple[float, float], kernels: tuple[int, int]) -> tuple[float, float]:
    """The kernel floor and the call overhead from the two chains' times per call: the slope
    and what the shorter chain's time leaves beyond its kernels (neither below zero)."""
    (short_s, long_s), (short_k, long_k) = seconds, kernels
    if long_k <= short_k:
        raise ValueError(f"the longer chain must have more kernels: {kernels}")
    floor = max(0.0, (long_s - short_s) / (long_k - short_k))
    if floor == 0.0:  # noise larger than the difference: every kernel takes the longer chain's share
        floor = long_s / long_k
    return floor, max(0.0, short_s - short_k * floor)


def _runner(graph_json: str, device: Any, mode: Compile, world: int = 1) -> tuple[Callable[[], None], Lowered]:
    """A call that runs a probe's program once on ``device`` in ``mode``, warmed up (its first
    calls interpret and record), and the lowered plan it runs (planned on one device, or with
    ``world`` ranks split by rows, synthesized and lowered as any plan is)."""
    try:
        graph = Graph.from_json(graph_json)
    except ValueError as exc:
        raise EdlError(f"the calibration probe is not a join-agg graph: {exc}") from None
    topology = from_dict({"nodes": [world]})  # only the plan's device count matters: nothing is priced here
    strategy = "replicate" if world == 1 else "data"
    lowered = lower(synthesize(graph, build(graph, topology, strategy), topology))
    xp = TorchOps(device)
    values = {r.name: xp.full(r.shape, 1, xp.dtype(r.dtype), device) for r in graph.relations if r.kind != "derived"}
    params = {r.name for r in graph.relations if r.kind == "param"}
    exe = runtime("torch").build(graph, lowered, str(device), mode)
    exe.load({k: v for k, v in values.items() if k in params})
    inputs = {k: v for k, v in values.items() if k not in params}
    for _ in range(2):  # interpreted, then recorded: what a plan's first calls do
        exe(inputs, gather_outputs=False)

    def run() -> None:
        exe(inputs, gather_outputs=False)

    return run, lowered
