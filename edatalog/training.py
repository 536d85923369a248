"""Training: a program with a scalar loss, stepped by an optimizer, all of it rules.

    trainer = edatalog.Trainer(prog, optimizer=edatalog.AdamW(lr=1e-3), clip=1.0)
    trainer.load(params)                    # numpy arrays, torch tensors or a checkpoint path
    loss = trainer.step({"ids": ..., "labels": ...})
    trainer.params                          # the params now, by name

One step is one program (:func:`edatalog.rules.optim.training_step`: the forward, the
gradients, clipping and the update), run by any runtime: the reference evaluator, or torch in
one process, with or without a plan of the step.  The optimizer's state (moments, buffers) and
the step count live with the trainer between steps; each step's new params and state come back
as the program's outputs and are kept for the next.
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
    prog: Program, loss: str | None = None, optimizer: Optimizer | None = None, clip: float = 0.0
) -> tuple[Program, StepNames]:
    """``prog``'s training step as a program of its own (to plan, inspect or run), and the names
    of what it reads and writes."""
    loss = prog.loss_name(loss)
    graph, names = training_step(prog.graph, loss, optimizer or AdamW(), clip)
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
    ) -> None:
        self.program, self.names = step_program(prog, loss, optimizer, clip)
        self.optimizer = optimizer or AdamW()
        self.backend = backend
        self._exe: Executable | None = None
        if backend != "reference":
            self._exe = self.program.executable(plan, backend=backend, device=device)
        elif plan is not None:
            raise EdlError("the reference evaluator runs without a plan", help="give backend='torch' to run a plan")
        self.params: dict[str, Any] = {}
        self.state: dict[str, Any] = {}
        self.steps = 0

    @property
    def last_peak(self) -> dict[int, int]:
        """Measured: the most bytes each device held in the last step (empty on the reference)."""
        return self._exe.peak_memory() if self._exe is not None and self.steps else {}

    def load(self, params: Mapping[str, Any]) -> None:
        """The params to start from (every param of the program), and a fresh optimizer state."""
        self.params = self.program.prepare(dict(params), kinds=("param",))  # every param, checked
        self.state = {s: np.zeros_like(np.asarray(self.params[p])) for s, p in self.names.state}
        self.steps = 0

    def step(self, batch: Mapping[str, Any]) -> float:
        """One step on ``batch`` (the program's inputs: ids, labels...): the loss before the
        update.  The params and the state move to their next values."""
        if not self.params:
            raise EdlError("the trainer has no params yet", help="call trainer.load(params) first")
        self.steps += 1
        given: dict[str, Any] = {**batch, **self.state}
        if self.names.step is not None:
            given[self.names.step] = np.float64(self.steps)
        if self._exe is None:
            out = self.program.run({**given, **self.params})
        else:
            self._exe.load(self.params)
            out = self._exe(given)
        for p in self.names.params:
            self.params[p] = out[self.names.next(p)]
        for s, _ in self.names.state:
            self.state[s] = out[self.names.next(s)]
        return float(np.asarray(_host(out[self.names.loss])))


def _host(value: Any) -> Any:
    return value.detach().cpu().numpy() if hasattr(value, "detach") else value
