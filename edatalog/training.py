"""Training: a program with a scalar loss, stepped by an optimizer, all of it rules.

    trainer = edatalog.Trainer(prog, optimizer=edatalog.AdamW(lr=1e-3), clip=1.0)
    trainer.load(params)                    # numpy arrays, torch tensors or a checkpoint path
    loss = trainer.step({"ids": ..., "labels": ...})
    trainer.params                          # the params now, by name

One step is one program (:func:`edatalog.rules.optim.training_step`: the forward, the
gradients, clipping and the update), run by any runtime: the reference evaluator, or torch in
one process or on the ranks of a plan.  Each step's new params and optimizer state are outputs
that the program carries into the next step: on torch they stay on the devices, each block
where the plan makes it (sharded under the ``zero`` plan), and ``trainer.params`` and
``trainer.state`` gather them when asked.  Half-typed programs train with f32 master weights
(``master``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from edatalog.api import Program
from edatalog.errors import EdlError
from edatalog.executable import Executable
from edatalog.plans import Plan
from edatalog.rules.optim import AdamW, Optimizer, StepNames, training_step


def step_program(
    prog: Program,
    loss: str | None = None,
    optimizer: Optimizer | None = None,
    clip: float = 0.0,
    master: str | None = "f32",
    recompute: bool = False,
) -> tuple[Program, StepNames]:
    """``prog``'s training step as a program of its own (to plan, inspect or run), and the names
    of what it reads and writes.  Params of a half type (bf16, f16) get ``master`` weights:
    f32 params, gradients and optimizer state, the rules computing in the half type (None:
    everything in the half type).  With ``recompute``, the backward makes each layer's
    intermediates again instead of keeping them from the forward (activation checkpointing)."""
    loss = prog.loss_name(loss)
    graph, names = training_step(prog.graph, loss, optimizer or AdamW(), clip, master=master, recompute=recompute)
    return prog.with_graph(graph), names


class Trainer:
    """Steps a program's params by an optimizer; see the module docstring."""

    def __init__(
        self,
        prog: Program,
        *,
        loss: str | None = None,
        optimizer: Optimizer | None = None,
        clip: float = 0.0,
        backend: str = "reference",
        plan: Plan | None = None,
        device: str | Sequence[str] | None = None,
        master: str | None = "f32",
        recompute: bool = False,
    ) -> None:
        self.program, self.names = step_program(prog, loss, optimizer, clip, master, recompute)
        self.optimizer = optimizer or AdamW()
        self.backend = backend
        self._exe: Executable | None = None
        if backend != "reference":
            self._exe = self.program.executable(plan, backend=backend, device=device)
        elif plan is not None:
            raise EdlError("the reference evaluator runs without a plan", help="give backend='torch' to run a plan")
        self._params: dict[str, Any] = {}  # on the reference: the params and state, whole
        self._state: dict[str, Any] = {}
        self._loaded = False
        self.steps = 0

    @property
    def params(self) -> dict[str, Any]:
        """The params now, whole, by name (under SPMD every rank must ask alike: the shards
        of each travel between ranks)."""
        if self._exe is not None and self._loaded:
            return self._exe.state(self.names.params)
        return dict(self._params)

    @property
    def state(self) -> dict[str, Any]:
        """The optimizer's state now (moments, buffers), whole, by name (as :attr:`params`)."""
        if self._exe is not None and self._loaded:
            return self._exe.state([s for s, _ in self.names.state])
        return dict(self._state)

    @property
    def last_peak(self) -> dict[int, int]:
        """Measured: the most bytes each device held in the last step (empty on the reference)."""
        return self._exe.peak_memory() if self._exe is not None and self.steps else {}

    def load(self, params: Mapping[str, Any], state: Mapping[str, Any] | None = None, steps: int = 0) -> None:
        """The params to start from (every param of the program), and the optimizer's state
        (default: fresh, zeros) after ``steps`` steps.  On a runtime, both then live on the
        devices where the plan places them, from step to step."""
        prepared = self.program.prepare(dict(params), kinds=("param",))  # every param, checked
        fresh = {s: np.zeros_like(np.asarray(prepared[p])) for s, p in self.names.state}
        given = dict(state or {})
        unknown = sorted(set(given) - set(fresh))
        if unknown:
            raise EdlError(f"'{unknown[0]}' is no state of this optimizer", help=f"its state: {', '.join(fresh)}")
        others = {r.name for r in self.program.arguments if r.kind == "input"} - set(given)
        self._params = prepared
        self._state = {**fresh, **self.program.prepare(given, kinds=("input",), optional=others)}
        if self._exe is not None:
            self._exe.load({**self._params, **self._state})
            self._params, self._state = {}, {}  # the executable holds them
        self.steps = steps
        self._loaded = True

    def step(self, batch: Mapping[str, Any]) -> float:
        """One step on ``batch`` (the program's inputs: ids, labels...): the loss before the
        update.  The params and the state move to their next values."""
        if not self._loaded:
            raise EdlError("the trainer has no params yet", help="call trainer.load(params) first")
        given: dict[str, Any] = dict(batch)
        if self.names.step is not None:
            given[self.names.step] = np.float64(self.steps + 1)
        if self._exe is None:
            out = self.program.run({**given, **self._state, **self._params})
            for p in self.names.params:
                self._params[p] = out[self.names.next(p)]
            for s, _ in self.names.state:
                self._state[s] = out[self.names.next(s)]
        else:
            out = self._exe.step(given)
        self.steps += 1
        loss = out[self.names.loss]
        return float(loss.item() if hasattr(loss, "item") else np.asarray(loss))  # bf16 tensors too
