"""The runtime probe of calibration: what a kernel op costs in edatalog's torch runtime.

The cost model prices a kernel at ``max(kernel_floor, flops / rate, bytes / bandwidth)``, so its
``kernel_floor`` must be the least a kernel costs *as edatalog runs it*: a device program's
kernel op goes through the interpreter (:class:`~edatalog.backend.running.interpreter.Device`: assembling
its inputs from buffers, evaluating the block's join-agg, writing the result), which on a CPU
costs tens of microseconds, against about one for torch dispatching a 1-element add.  A floor
of torch's dispatch alone predicts plans of many small blocks far too fast.

So calibration runs a probe: a chain of :data:`RULES` one-cell rules over one input
(:func:`source`), planned on one device and synthesized into a device program as any plan is,
then run by the same interpreter, on the same torch device and array namespace, as
:mod:`~edatalog.backend.running.torch_runtime` and :mod:`~edatalog.backend.running.spmd` run a plan's programs.
Each rank runs it while the others do, as they will run a plan's kernels.  The floor is the time
of one run over its kernel ops: its load and frees, which the cost model prices at nothing,
are counted in, as every run pays them.

This module is apart from :mod:`~edatalog.backend.calibrating.calibrate` because the backend cannot compile
``.edl`` text (the layering of ``tests/test_architecture.py``): the command line compiles
:func:`source` and passes the graph's JSON in :class:`~edatalog.backend.calibrating.calibrate.Options`;
:func:`runner` takes it from there.  torch is imported on first use, never on import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from edatalog.backend.kernels.arrays import TorchOps
from edatalog.backend.lowering.exchange import synthesize
from edatalog.backend.lowering.lowered import Lowered, lower
from edatalog.backend.running.interpreter import Device, Kernels, Mailbox, run_devices, slicer
from edatalog.errors import EdlError
from edatalog.ir import program as ir
from edatalog.ir.graph import Graph
from edatalog.solver.strategies import build
from edatalog.solver.topology import preset

RULES = 16  # one-cell rules in the probe's chain


def source(rules: int = RULES, dtype: str = "f32") -> str:
    """The probe program: ``rules`` one-cell elementwise rules, each reading the one before and
    the input ``x`` (as most rules read two relations), the last one the output."""
    if rules < 1:
        raise ValueError(f"the probe needs at least one rule, not {rules}")
    lines = [
        "# edl calibrate's runtime probe: a chain of one-cell rules, timed per kernel op.",
        "dim I = 1.",
        f"input x[I] : {dtype}.",
        f"output a{rules - 1}.",
        "a0[i] = x[i] + 1.0.",
    ]
    lines += [f"a{k}[i] = a{k - 1}[i] * 0.5 + x[i]." for k in range(1, rules)]
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


Cost = tuple[int, int, bool]  # a kernel's flops, bytes and whether it takes the general path


def general_runner(graph_json: str, device: Any) -> tuple[Callable[[], None], list[Cost]]:
    """A call that runs the general probe once on ``device``, and its kernels' costs as the
    cost model counts them (``OpCost``): calibration prices the others by the roofline and
    gives the rest of the time to the general ones' bytes."""
    run, lowered = _runner(graph_json, device)
    costs = [lowered.costs[(d, k)] for d, k, op in lowered.programs.ops() if isinstance(op, ir.Kernel)]
    if not any(c.general for c in costs):
        raise EdlError("the general-path probe has no kernel on the general path to time")
    return run, [(c.flops, c.nbytes, c.general) for c in costs]


def describe(kernels: int) -> str:
    """Where the floor comes from, for the machine file."""
    return f"a one-cell rule run by edatalog's torch runtime (a chain of {kernels}, per kernel op)"


def runner(graph_json: str, device: Any) -> tuple[Callable[[], None], int]:
    """A call that runs the probe's program once on the torch ``device`` (as the torch runtime
    runs a plan's program on one device), and how many kernel ops each call runs."""
    run, lowered = _runner(graph_json, device)
    kernels = sum(isinstance(op, ir.Kernel) for _, _, op in lowered.programs.ops())
    if kernels == 0:
        raise EdlError("the calibration probe has no kernel to time")
    return run, kernels


def _runner(graph_json: str, device: Any) -> tuple[Callable[[], None], Lowered]:
    """A call that runs a probe's program once on ``device``, and the lowered plan it runs
    (planned on one device, synthesized and lowered as any plan is)."""
    try:
        graph = Graph.from_json(graph_json)
    except ValueError as exc:
        raise EdlError(f"the calibration probe is not a join-agg graph: {exc}") from None
    topology = preset("cpux1")  # one device: the plan's name for it; nothing is priced here
    lowered = lower(synthesize(graph, build(graph, topology, "replicate"), topology))
    programs = lowered.programs
    xp = TorchOps(device)
    values = {r.name: xp.full(r.shape, 1, xp.dtype(r.dtype), device) for r in graph.relations if r.kind != "derived"}
    cache = Kernels(graph)  # made once, kept across calls, as an executable keeps it

    def run() -> None:
        load = slicer(values)
        devices = [Device(p, graph, cache, load, xp, device) for p in programs.devices]
        run_devices(devices, Mailbox())

    return run, lowered
