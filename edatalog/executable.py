"""Executables: a compiled program, maybe with a plan, ready to run on a backend many times.

    exe = edatalog.executable(prog, plan, backend="torch", device=None)   # plan=None: one device
    exe.load(params)          # whole arrays or torch tensors, or a safetensors path
    out = exe(inputs)         # dict of outputs: torch tensors on the torch backend, numpy else

Params are checked and loaded once (on the torch backend each device, or each rank, keeps only
the blocks its program loads); every call checks and runs the inputs.  Inside an initialized
torch.distributed group as large as the plan, a torch executable is SPMD: this rank runs its
device's program, and every rank gets the outputs whole (``gather=False``: the pieces it holds,
the rest reading as absent).

A program that carries state from call to call (``Graph.carries``: a training step's params and
optimizer state) keeps it where each call leaves it:

    exe.load({**params, **state})   # the params, and the carried inputs to start from
    out = exe.step(batch)           # the outputs that are not carried; the state stays put
    exe.state()                     # the carried relations now, whole (every rank asks alike)

A call may still give a carried input; it then replaces what is held.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from edatalog.backend.lowering.lowered import Collectives, Lowered
from edatalog.backend.running.compiled import compile_mode
from edatalog.backend.running.runtime import Executable as Runnable
from edatalog.backend.running.runtime import check_plan, runtime
from edatalog.backend.running.torch_runtime import OpTime, Outputs
from edatalog.checkpoint import Checkpoint
from edatalog.errors import EdlError
from edatalog.ir.graph import Graph
from edatalog.plans import Plan

Prepare = Callable[[Mapping[str, Any], Collection[str], bool, Collection[str]], dict[str, Any]]


class Executable:
    """See the module docstring; made by ``edatalog.executable`` or ``Program.executable``."""

    def __init__(
        self,
        graph: Graph,
        prepare: Prepare,
        plan: Plan | Lowered | None,
        backend: str,
        device: str | Sequence[str] | None,
        collectives: str | None = None,
        compile: str | None = None,
    ) -> None:
        rt = runtime(backend)
        check_plan(rt, plan is not None)
        if plan is not None and plan.graph.fingerprint() != graph.fingerprint():
            raise EdlError("this plan was made for another program", help="make a plan for this program")
        self.graph, self.runtime = graph, rt
        self.plan = plan if isinstance(plan, Plan) else None
        self._prepare = prepare
        self._keep_torch = rt.arrays == "torch"
        self.lowered = _lowered(plan, collectives)
        self._impl: Runnable = rt.build(graph, self.lowered, device, compile_mode(compile))
        self._params = [r.name for r in graph.relations if r.kind == "param"]
        self._loaded = not self._params
        # Carried state: what the runtime holds now; for a runtime that does not carry, this
        # object keeps the params and the carried inputs whole and hands them over each call.
        self._carried = graph.carried  # relation -> the output carried into it
        self._held: set[str] = set()
        self._native = hasattr(self._impl, "held")
        self._kept: dict[str, Any] = {}
        self._lost = ""

    def __repr__(self) -> str:
        if self.plan is not None:
            where = f"plan '{self.plan.ir.strategy}' on {self.plan.ir.n_devices} devices"
        elif self.lowered is not None:
            where = f"a lowered plan on {self.lowered.n_devices} devices"
        else:
            where = "no plan"
        return f"<edatalog.Executable {self.runtime.name}, {where}>"

    @property
    def device(self) -> Any:
        """Where the outputs come (the torch device of the plan's device 0, or of this rank);
        None on the numpy backends."""
        return getattr(self._impl, "device", None)

    @property
    def last_times(self) -> list[OpTime]:
        """Each op's (device, position, start, end) seconds in the last call made with ``record``."""
        return self._impl.last_times

    def peak_memory(self) -> dict[int, int]:
        """The most bytes each device held during the last call, by device (under SPMD, this
        rank's): on a GPU what torch's allocator had out (``torch.cuda.max_memory_allocated``),
        elsewhere the buffers of the device's program (every cell and presence mask it held),
        loaded weights included."""
        peak = getattr(self._impl, "last_peak", None)
        if peak is None:
            raise EdlError(f"the {self.runtime.name} runtime does not track memory", help="use backend='torch'")
        if not peak:
            raise EdlError("nothing has run yet", help="call the executable first, then ask for its peak memory")
        return dict(peak)

    def load(self, params: Mapping[str, Any] | str | os.PathLike[str]) -> None:
        """Load every param: whole arrays or torch tensors by name, or a safetensors checkpoint
        (a file, or a model's directory: one file, or shards with their index) whose tensors the
        params name (their declared checkpoint names, else their own: see
        :mod:`edatalog.checkpoint`).  From a checkpoint, each rank of a plan reads only its
        slices."""
        if isinstance(params, str | os.PathLike):
            ckpt = Checkpoint(params)
            names = ckpt.names_for(self.graph)
            load_slices = getattr(self._impl, "load_slices", None)
            if load_slices is not None:  # an SPMD rank reads only its slices
                load_slices(lambda rel, slices: ckpt.read(names[rel], slices))
                self._held |= {p for p in self._params if p in self._carried}
                self._loaded, self._lost = True, ""
                return
            params = {rel: ckpt.read(name) for rel, name in names.items()}
        given = dict(params)
        state = {k: given.pop(k) for k in list(given) if k in self._carried and self._kind(k) == "input"}
        values = self._prepare(given, ("param",), self._keep_torch, ())
        if state:
            values.update(self._prepare(state, ("input",), self._keep_torch, self._inputs - set(state)))
        self._impl.load(values)
        if not self._native:  # kept whole here: every param, to load again with the carried ones
            self._kept.update(values)
        self._held |= {k for k in values if k in self._carried}
        self._loaded, self._lost = True, ""

    def state(self, names: Collection[str] | None = None) -> dict[str, Any]:
        """The carried relations (default: all) as held now, whole: torch tensors on the torch
        backend.  Under SPMD every rank must ask alike (pieces travel between ranks)."""
        names = list(self._carried) if names is None else list(names)
        unknown = [n for n in names if n not in self._carried]
        if unknown:
            raise EdlError(
                f"{unknown[0]} is not carried from call to call", help=f"carried: {', '.join(self._carried)}"
            )
        self._check_held(names)
        if self._native:
            return self._impl.held(names)  # type: ignore[attr-defined]
        return {n: self._kept[n] for n in names}

    def step(self, inputs: Mapping[str, Any], *, record: bool = False) -> dict[str, Any]:
        """One call whose carried outputs stay where they are made, for the next call: the
        other outputs, whole."""
        keep = [o for o in self.graph.outputs if o not in set(self._carried.values())]
        return self.run(inputs, record=record, outputs=keep).values

    def __call__(self, inputs: Mapping[str, Any], *, gather: bool = True, record: bool = False) -> dict[str, Any]:
        """The outputs for ``inputs`` (absent cells read as 0)."""
        return self.run(inputs, gather=gather, record=record).values

    def run(
        self,
        inputs: Mapping[str, Any],
        *,
        gather: bool = True,
        record: bool = False,
        outputs: Collection[str] | None = None,
    ) -> Outputs:
        """As a call, with which cells of each output exist (``Outputs.present``; None: all);
        ``outputs`` names the outputs to return (None: all)."""
        if not self._loaded:
            raise EdlError(
                "the params are not loaded", help="call exe.load(params) first (a dict or a .safetensors path)"
            )
        self._check_held([k for k in self._carried if k not in inputs])
        held = {k for k in self._held if self._kind(k) == "input"}
        values = self._prepare(inputs, ("input",), self._keep_torch, held - set(inputs))
        if not self._carried:
            return self._impl(values, gather_outputs=gather, record=record, outputs=outputs)
        if not self._native:
            values = {**{k: v for k, v in self._kept.items() if k in held}, **values}
        ask = outputs if self._native else None
        try:
            out = self._impl(values, gather_outputs=gather, record=record, outputs=ask)
        except BaseException:
            self._held.clear()
            self._lost = "a call failed after it took the state carried into it"
            raise
        if not self._native:
            self._kept.update({target: out.values[output] for target, output in self._carried.items()})
            self._impl.load({k: v for k, v in self._kept.items() if self._kind(k) == "param"})
        self._held = set(self._carried)
        if outputs is not None:  # runtimes in one process have every output whole anyway
            out = Outputs({k: out.values[k] for k in outputs}, {k: out.present[k] for k in outputs})
        return out

    def _kind(self, name: str) -> str:
        return self.graph.relation(name).kind

    @property
    def _inputs(self) -> set[str]:
        return {r.name for r in self.graph.relations if r.kind == "input"}

    def _check_held(self, names: Collection[str]) -> None:
        missing = [n for n in names if n not in self._held]
        if missing:
            why = f"{self._lost}: " if self._lost else ""
            raise EdlError(
                f"{why}the executable holds no value of the carried {self._kind(missing[0])} '{missing[0]}'",
                help="load it (exe.load({..., name: value})) or give it among the call's inputs",
            )


def _lowered(plan: Plan | Lowered | None, collectives: str | None) -> Lowered | None:
    """What the runtime runs: a lowered plan as given, or the plan lowered with ``collectives``
    (``"auto"``, ``"on"`` or ``"off"``; None: as the plan's options say)."""
    if collectives is not None and collectives not in {c.value for c in Collectives}:
        raise EdlError(f"unknown collectives choice '{collectives}'", help="collectives are 'auto', 'on' or 'off'")
    if isinstance(plan, Lowered):
        if collectives is not None and Collectives(collectives) is not plan.options.collectives:
            raise EdlError(
                "this plan is already lowered with other collectives", help="lower it again, or drop collectives"
            )
        return plan
    if plan is None:
        return None
    if collectives is None:
        return plan.lowered  # as the plan is reported
    return plan.lowering(dataclasses.replace(plan.options, collectives=Collectives(collectives)))
