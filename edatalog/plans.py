"""Planned programs: a plan, the program it is for and the machine, with everything users ask of
them: the predicted time, traffic and memory, where each block lives, the synthesized per-device
programs, traces, and saving and loading.

This is part of the public facade (with :mod:`edatalog.api`): it ties the solver's plans to the
backend's exchange synthesis and simulator.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edatalog.backend import sim
from edatalog.backend.exchange import REDUCTIONS, Schedule, synthesize
from edatalog.backend.timeline import Report, analyze, write_trace
from edatalog.errors import EdlError, did_you_mean
from edatalog.ir.graph import Graph
from edatalog.solver import auto, refine, strategies
from edatalog.solver import topology as machines
from edatalog.solver.blocks import guarded_dims
from edatalog.solver.plan import Plan as PlanIR
from edatalog.solver.topology import Topology

if TYPE_CHECKING:
    from edatalog.api import Program


class Plan:
    """A plan for one program on one machine.  ``str(plan)`` shows every tile; ``summary()`` the
    predicted cost; ``save()`` writes a self-contained JSON file (plan, machine and program)."""

    def __init__(self, ir: PlanIR, graph: Graph, machine: Topology, reduction: str = "auto") -> None:
        if reduction not in REDUCTIONS:
            raise EdlError(f"unknown reduction '{reduction}'", help=f"reductions: {', '.join(REDUCTIONS)}")
        ir.verify(graph)
        if machine.n < ir.n_devices:
            raise EdlError(f"the plan uses {ir.n_devices} devices but {machine.name} has {machine.n}")
        self.ir, self.graph, self.topology, self.reduction = ir, graph, machine, reduction
        self.solution: auto.Solution | None = None  # how the solver found it, for solved plans

    def __str__(self) -> str:
        return str(self.ir)

    def __repr__(self) -> str:
        return f"<edatalog.Plan {self.ir.strategy} on {self.topology.name}: {len(self.ir.nodes)} rules>"

    @cached_property
    def schedule(self) -> Schedule:
        """The synthesized per-device programs (tasks: loads, computes, sends, combines)."""
        return synthesize(self.graph, self.ir, self.topology, self.reduction)

    @cached_property
    def report(self) -> Report:
        """Time, traffic and memory of the schedule under the machine's cost model."""
        return analyze(self.schedule)

    def summary(self) -> dict[str, Any]:
        r = self.report
        return {
            "strategy": self.ir.strategy,
            "topology": self.topology.name,
            "devices": self.ir.n_devices,
            "predicted_ms": r.seconds * 1e3,
            "bytes_moved": r.bytes_moved,
            "bytes_per_link": {f"{a}->{b}": v for (a, b), v in sorted(r.bytes_per_link.items())},
            "peak_memory": dict(sorted(r.peak_memory.items())),
            "flops": dict(sorted(r.flops.items())),
            "sent": dict(sorted(r.sent.items())),
            "received": dict(sorted(r.received.items())),
            "over_memory": self.over_memory(),
            **(self._solver_summary() if self.solution is not None else {}),
        }

    def _solver_summary(self) -> dict[str, Any]:
        sol = self.solution
        assert sol is not None
        return {
            # Where the time went, honestly: the solver's (building the model, then searching),
            # checking its shortlist in the timeline, refining, and the whole call.
            "solve_seconds": sol.seconds,
            "build_seconds": sol.build_seconds,
            "search_seconds": sol.seconds - sol.build_seconds,
            "check_seconds": sol.check_seconds,
            "refine_seconds": sol.refine_seconds,
            "plan_seconds": sol.total_seconds,
            "unchecked": sol.unchecked,
            "solver_estimate_ms": sol.predicted_ms,
            "lower_bound_ms": sol.lower_bound_ms,
            "optimal": sol.optimal,
            "gap": sol.gap,
            "memory_estimate": sol.memory_estimate,
            "chosen_by": sol.chosen_by,
            "refined": sol.refined,
        }

    def over_memory(self) -> list[int]:
        """Devices whose peak memory exceeds their capacity (the plan would not fit)."""
        peak = self.report.peak_memory
        return [d for d in range(self.ir.n_devices) if peak[d] > self.topology.devices[d].memory]

    def trace(self, path: str) -> None:
        """Write the predicted timeline as Chrome trace JSON (open it in ui.perfetto.dev)."""
        try:
            write_trace(path, self.schedule, self.report)
        except OSError as exc:
            raise EdlError(f"cannot write {path}: {exc.strerror or exc}") from None

    def execute(self, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the per-device programs in the simulator; returns the outputs, gathered, as numpy
        arrays (absent cells read as 0): the convention of ``Program.run``, which calls this for
        ``backend="sim"``.  (``Program.evaluate`` is the detailed API, with presence masks.)
        ``values`` must hold every input and param in its declared shape and dtype (as
        ``Program.prepare`` makes them)."""
        missing = [r.name for r in self.graph.relations if r.kind != "derived" and r.name not in values]
        if missing:
            raise EdlError(f"missing values for {', '.join(missing)}", help="pass every input and param")
        gathered = sim.run(self.schedule, values)
        return {name: gathered[name].data for name in self.graph.outputs}

    # -- files ----------------------------------------------------------------------------------

    def to_json(self) -> str:
        data = json.loads(self.ir.to_json())
        data["machine"] = self.topology.to_dict()
        data["reduction"] = self.reduction
        data["graph"] = json.loads(self.graph.to_json())
        return json.dumps(data, indent=1)

    def save(self, path: str | Path) -> None:
        try:
            Path(path).write_text(self.to_json() + "\n", encoding="utf-8")
        except OSError as exc:
            raise EdlError(f"cannot write {path}: {exc.strerror or exc}") from None


STRATEGIES = ("auto", *strategies.STRATEGIES)
REFINE_TRIES = 3  # the fastest shortlisted plans whose refinements are checked


def make_plan(
    prog: Program,
    topology: str | Topology = "a100x4",
    strategy: str = "auto",
    *,
    seed: int = 0,
    reduction: str = "auto",
    memory: int | str | None = None,
    time_limit: float = 10.0,
    space: str = "join",
    on_progress: Callable[[auto.Progress], None] | None = None,
) -> Plan:
    """Plan ``prog`` on a machine.  ``auto`` (the default) asks the solver for the fastest plan
    within ``time_limit`` seconds that fits every device's memory (``memory`` overrides the
    machine's, e.g. ``"9GB"``); ``space="mesh"`` limits it to GSPMD-style plans.  The other
    strategies are the hand-written baselines (replicate, data, megatron, random)."""
    machine = machines.resolve(topology)
    if memory is not None:
        machine = machine.with_memory(int(machines.quantity(memory, "B", "memory")))
    if strategy not in STRATEGIES:
        close = did_you_mean(strategy, STRATEGIES)
        known = f"strategies: {', '.join(STRATEGIES)}"
        raise EdlError(f"unknown strategy '{strategy}'", help=f"{close} {known}" if close else known)
    if strategy != "auto":
        if space != "join":
            raise EdlError("--space chooses the solver's search space; it goes with --strategy auto")
        return Plan(strategies.build(prog.graph, machine, strategy, seed=seed), prog.graph, machine, reduction)
    return _solved(prog.graph, machine, reduction, time_limit, seed, space, on_progress)


SOLVE_SHARE = 0.8  # of the time left, for building and searching; checking and refining get the rest


class _Clock:
    """One deadline for a whole solved plan, shared by its phases (building and solving, then
    checking the shortlist in the timeline, then refining), and the progress they report."""

    def __init__(self, time_limit: float, on_progress: Callable[[auto.Progress], None] | None) -> None:
        self.start = time.monotonic()
        self.deadline = self.start + time_limit
        self.on_progress = on_progress
        self.last = auto.Progress(0.0, None, 0.0, 0, "building")
        self.solve_began = 0.0  # when the current solve began, on this clock
        self.spent = {"checking": 0.0, "refining": 0.0}
        self.slowest = 0.0  # the longest one timeline check took
        self.checked_ms: float | None = None

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def solving(self, p: auto.Progress) -> None:
        """The solver's progress, on the whole call's clock."""
        self.last = dataclasses.replace(p, elapsed=self.solve_began + p.elapsed)
        if self.on_progress is not None:
            self.on_progress(self.last)

    def check(self, plan: Plan, phase: str, first: bool = False) -> bool:
        """Check ``plan`` in the timeline (its report), unless the deadline would pass before a
        check as long as the slowest so far ends: then False.  The ``first`` is always checked
        (a plan is returned only checked).  Checks are not interrupted: one overruns by at most
        its own length, which the slowest before it predicts."""
        if not first and time.monotonic() + self.slowest > self.deadline:
            return False
        began = time.monotonic()
        fits = not plan.over_memory()  # synthesizes and analyzes the plan
        took = time.monotonic() - began
        self.slowest = max(self.slowest, took)
        self.spent[phase] += took
        if fits and (self.checked_ms is None or plan.report.seconds * 1e3 < self.checked_ms):
            self.checked_ms = plan.report.seconds * 1e3
        if self.on_progress is not None:
            self.last = dataclasses.replace(self.last, elapsed=self.elapsed(), phase=phase, checked_ms=self.checked_ms)
            self.on_progress(self.last)
        return True


def _solved(
    graph: Graph,
    machine: Topology,
    reduction: str,
    time_limit: float,
    seed: int,
    space: str,
    on_progress: Callable[[auto.Progress], None] | None,
) -> Plan:
    """Solve, then check the shortlisted plans in the simulator's accounting: the fastest that
    fits wins, and refinements of the fastest are tried.  All under one deadline: the solver
    gets :data:`SOLVE_SHARE` of the time, checking and refining what is left, stopping when the
    deadline comes with the best plan checked so far.  When none fits (the solver's memory
    estimate was too low), solve again under a budget cut by the overshoot, while time is left."""
    clock = _Clock(time_limit, on_progress)
    limit = min(d.memory for d in machine.devices)
    budget = limit
    solve_seconds = build_seconds = 0.0
    leanest: tuple[Plan, auto.Solution] | None = None  # the least peak checked, should nothing fit
    for attempt in range(4):
        clock.solve_began = clock.elapsed()
        solution = auto.solve(graph, machine, budget, clock.left() * SOLVE_SHARE, seed, space, clock.solving)
        solve_seconds += solution.seconds
        build_seconds += solution.build_seconds
        checked: list[Plan] = []
        for ir in solution.shortlist:
            plan = Plan(ir, graph, machine, reduction)
            if not clock.check(plan, "checking", first=not checked):
                break
            checked.append(plan)
        solution.unchecked = len(solution.shortlist) - len(checked)
        fitting = sorted((p for p in checked if not p.over_memory()), key=lambda p: p.report.seconds)
        if fitting:
            plan = fitting[0]
            solution.chosen_by = "solver" if plan is checked[0] and not solution.infeasible else "timeline"
            # Refinements leave the mesh space (chunks on one device, zigzag parts): join only.
            refined = _refined(graph, machine, reduction, fitting[:REFINE_TRIES], clock) if space == "join" else None
            if refined is not None and refined[0].report.seconds < plan.report.seconds:
                plan, solution.refined = refined
            break
        if solution.infeasible and len(checked) == len(solution.shortlist):
            auto.raise_infeasible(solution, space)
        least = min(checked, key=lambda p: max(p.report.peak_memory.values()))
        if leanest is None or max(least.report.peak_memory.values()) < max(leanest[0].report.peak_memory.values()):
            leanest = (least, solution)
        peak = max(max(p.report.peak_memory.values()) for p in checked)
        if attempt == 3:
            raise EdlError(
                f"the solver found no plan that fits in {limit / 1e9:.3g}GB per device once simulated "
                f"(the best needs {peak / 1e9:.3g}GB)",
                help="give each device more memory (--memory), use more devices, or shrink the dims",
            )
        if clock.left() <= 0:
            # Out of time: the leanest plan checked (never nothing), which the summary and edl plan
            # show over memory; a longer time limit may find one that fits.
            plan, solution = leanest
            break
        budget = int(budget * limit / peak * 0.97)
    solution.seconds, solution.build_seconds, solution.solves = solve_seconds, build_seconds, attempt + 1
    solution.check_seconds, solution.refine_seconds = clock.spent["checking"], clock.spent["refining"]
    solution.total_seconds = clock.elapsed()
    plan.solution = solution
    return plan


def _refined(
    graph: Graph, machine: Topology, reduction: str, plans: list[Plan], clock: _Clock
) -> tuple[Plan, str] | None:
    """The fastest refinement of ``plans`` that fits, and what it is: each plan balanced along
    guarded dims, and each of those pipelined in 2 chunks along a dim every rule has, then 4
    while that keeps helping (see :mod:`edatalog.solver.refine`).  Checked in the timeline,
    while the clock allows."""
    best: tuple[Plan, str] | None = None

    def consider(plan: Plan, what: str) -> bool:
        nonlocal best
        if plan.over_memory():
            return False
        if best is None or plan.report.seconds < best[0].report.seconds:
            best = (plan, what)
        return True

    for base in plans:
        variants = [(base, "")]
        for dim in sorted(guarded_dims(graph)):
            ir = refine.balanced(graph, base.ir, dim)
            if ir is not None:
                plan = Plan(ir, graph, machine, reduction)
                if not clock.check(plan, "refining"):
                    return best
                if consider(plan, f"{dim} balanced"):
                    variants.append((plan, f"{dim} balanced"))
        for plan, what in variants:
            for dim in refine.every_rule_dims(graph):
                last = plan.report.seconds
                for chunks in refine.CHUNKS:
                    ir = refine.pipelined(graph, plan.ir, dim, chunks)
                    if ir is None:
                        break
                    piped = Plan(ir, graph, machine, reduction)
                    if not clock.check(piped, "refining"):
                        return best
                    if piped.report.seconds >= last or not consider(piped, _join(what, f"{dim} in {chunks} chunks")):
                        break
                    last = piped.report.seconds
    return best


def _join(*parts: str) -> str:
    return ", ".join(p for p in parts if p)


# The top-level fields of a plan file (:meth:`Plan.to_json`), and what each holds.
PLAN_FIELDS = {
    "format": "the plan format version",
    "kind": "'edatalog-plan'",
    "program": "the fingerprint of the program",
    "devices": "the number of devices",
    "topology": "the machine's name",
    "strategy": "the strategy that made it",
    "nodes": "every rule's tile: its splits and the devices of each block",
    "inputs": "where every input and param lives at the start",
    "machine": "the machine",
    "graph": "the program",
}


def load_plan(path: str | Path, prog: Program | None = None) -> Plan:
    """A plan saved by :meth:`Plan.save`.  With ``prog``, the plan must have been made for it;
    without, the program saved in the file is used (as ``edl query`` does)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
        data = json.loads(text)
    except OSError as exc:
        raise EdlError(f"cannot read plan {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EdlError(f"{path} is not a plan file (not JSON: {exc})") from None
    if not isinstance(data, dict) or data.get("kind") != "edatalog-plan":
        raise EdlError(f"{path} is not a plan file written by edatalog")
    missing = [k for k in PLAN_FIELDS if k not in data]
    if missing:
        what = "; ".join(f"'{k}' ({PLAN_FIELDS[k]})" for k in missing)
        raise EdlError(
            f"{path} is not a valid plan: it lacks the field{'s' if len(missing) > 1 else ''} {what}",
            help="a plan file holds " + ", ".join(PLAN_FIELDS) + " (docs/plans.md, 'Plan files'), as "
            "'edl plan FILE -o plan.json' writes it: make the plan again",
        )
    if prog is not None:
        graph = prog.graph
        ir = data["graph"].get("ir", {}) if isinstance(data["graph"], dict) else {}
        saved = dict(ir.get("dims", [])) if isinstance(ir, dict) else {}
        ours = dict(graph.dims)
        same_source = isinstance(ir, dict) and ir.get("source_name") == graph.source_name
        if data.get("program") != graph.fingerprint() and same_source and saved.keys() == ours.keys():
            # The same program at other sizes: say which.
            diff = [f"{k}={saved[k]} (here {ours[k]})" for k in saved if ours[k] != saved[k]]
            if diff:
                raise EdlError(
                    f"{path} was made for another program: its dims differ: {', '.join(diff)}",
                    help="make a new plan with these dims, or compile with the plan's dims",
                )
    else:
        try:
            graph = Graph.from_json(json.dumps(data["graph"]))
        except ValueError as exc:
            raise EdlError(f"{path}: the program saved in the plan is damaged: {exc}") from None
    ir = PlanIR.from_json(text, graph, where=str(path))
    machine = machines.from_dict(data["machine"])
    return Plan(ir, graph, machine, str(data.get("reduction", "auto")))
