"""Runtimes: what executes a compiled program, with or without a plan; one registry.

Every runtime builds an :class:`Executable` from a graph and, when it runs plans, the plan
lowered (:class:`~edatalog.backend.lowering.lowered.Lowered`: its device programs as they run).
``Program.run``, ``Plan.execute``, ``edatalog.executable`` and the CLI's ``--backend`` all take
their choices from :data:`RUNTIMES`.

- ``reference``: the numpy reference evaluator on whole tensors (no plan);
- ``sim``: a plan's device programs in one process, on numpy (the simulator);
- ``torch``: torch on one device (no plan), on logical devices in this process (a plan), or, in
  a torch.distributed group as large as the plan, this rank's program (SPMD); compiled into
  graphs as its :class:`~edatalog.backend.running.compiled.Compile` mode says.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from edatalog.backend.kernels.arrays import NUMPY
from edatalog.backend.kernels.reference import evaluate
from edatalog.backend.lowering.lowered import Lowered
from edatalog.backend.running import sim
from edatalog.backend.running.compiled import Compile, CompiledExecutable
from edatalog.backend.running.torch_runtime import OpTime, Outputs, TorchExecutable
from edatalog.errors import EdlError, did_you_mean
from edatalog.ir.graph import Graph

Device = str | Sequence[str] | None


class Executable(Protocol):
    """A program ready to run: params loaded once, then called on inputs any number of times."""

    @property
    def last_times(self) -> list[OpTime]: ...

    def load(self, params: Mapping[str, Any]) -> None: ...

    def __call__(
        self,
        inputs: Mapping[str, Any],
        *,
        gather_outputs: bool = True,
        record: bool = False,
        outputs: Collection[str] | None = None,
    ) -> Outputs: ...


@dataclass(frozen=True)
class Runtime:
    name: str
    summary: str
    plans: str  # "never", "required" or "optional"
    arrays: str  # "numpy" or "torch": what calls return
    build: Callable[[Graph, Lowered | None, Device, Compile], Executable]


class _Reference:
    """The reference evaluator: whole tensors, numpy."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.params: dict[str, Any] = {}
        self.last_times: list[OpTime] = []

    def load(self, params: Mapping[str, Any]) -> None:
        self.params = {k: NUMPY.asarray(v) for k, v in params.items()}

    def __call__(
        self,
        inputs: Mapping[str, Any],
        *,
        gather_outputs: bool = True,
        record: bool = False,
        outputs: Collection[str] | None = None,
    ) -> Outputs:
        env = evaluate(self.graph, {**inputs, **self.params}, keep=self.graph.outputs)
        values = {k: env[k].data if k not in inputs and k not in self.params else env[k].data.copy() for k in env}
        return Outputs(values, {k: env[k].present for k in env})


class _Simulated:
    """A plan's device programs on numpy, in one process."""

    def __init__(self, lowered: Lowered) -> None:
        self.lowered = lowered
        self.params: dict[str, Any] = {}
        self.last_times: list[OpTime] = []

    def load(self, params: Mapping[str, Any]) -> None:
        self.params = {k: NUMPY.asarray(v) for k, v in params.items()}

    def __call__(
        self,
        inputs: Mapping[str, Any],
        *,
        gather_outputs: bool = True,
        record: bool = False,
        outputs: Collection[str] | None = None,
    ) -> Outputs:
        got = sim.run(self.lowered, {**{k: NUMPY.asarray(v) for k, v in inputs.items()}, **self.params})
        names = self.lowered.graph.outputs
        return Outputs({k: got[k].data for k in names}, {k: got[k].present for k in names})


def _reference(graph: Graph, lowered: Lowered | None, device: Device, mode: Compile) -> Executable:
    return _Reference(graph)


def _sim(graph: Graph, lowered: Lowered | None, device: Device, mode: Compile) -> Executable:
    assert lowered is not None
    return _Simulated(lowered.verified())


def _torch(graph: Graph, lowered: Lowered | None, device: Device, mode: Compile) -> Executable:
    if lowered is not None:
        lowered = lowered.verified()
        from edatalog.backend.running.segments import CompiledSpmdExecutable
        from edatalog.backend.running.spmd import SpmdExecutable, in_group_of

        if in_group_of(lowered.n_devices):
            one = device if isinstance(device, str) or device is None else None
            if mode.resolved() is Compile.NONE:
                return SpmdExecutable(graph, lowered, one)
            return CompiledSpmdExecutable(graph, lowered, one, mode)
    if mode.resolved() is Compile.NONE:
        return TorchExecutable(graph, lowered, device)
    return CompiledExecutable(graph, lowered, device, mode)


RUNTIMES: dict[str, Runtime] = {
    r.name: r
    for r in (
        Runtime("reference", "the numpy reference evaluator, on whole tensors", "never", "numpy", _reference),
        Runtime("sim", "a plan's device programs simulated in one process, on numpy", "required", "numpy", _sim),
        Runtime(
            "torch",
            "torch: one device, a plan's devices in this process, or one rank each (torchrun)",
            "optional",
            "torch",
            _torch,
        ),
    )
}


def runtime(name: str) -> Runtime:
    """The runtime named ``name``; an :class:`EdlError` listing them otherwise."""
    if name not in RUNTIMES:
        known = ", ".join(RUNTIMES)
        raise EdlError(
            f"unknown backend '{name}'", help=did_you_mean(name, RUNTIMES, "backends") or f"backends: {known}"
        )
    return RUNTIMES[name]


def check_plan(rt: Runtime, has_plan: bool) -> None:
    """A plan where the runtime takes none, or none where it needs one, is the user's mistake."""
    if rt.plans == "never" and has_plan:
        raise EdlError(
            f"the {rt.name} backend evaluates whole tensors, without a plan",
            help="run a plan with backend 'sim' or 'torch'",
        )
    if rt.plans == "required" and not has_plan:
        raise EdlError(f"the {rt.name} backend runs a plan", help="make one with edatalog.plan(prog, ...) or edl plan")
