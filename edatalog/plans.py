"""Planned programs: a plan, the program it is for and the machine, with everything users ask of
them: the predicted time, traffic and memory, where each block lives, the synthesized per-device
programs, traces, and saving and loading.

This is part of the public facade (with :mod:`edatalog.api`): it ties the solver's plans to the
backend's exchange synthesis and simulator, and gives the planning policy
(:mod:`edatalog.solver.policy`) its exact check: the timeline.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from edatalog.backend.lowering.exchange import REDUCTIONS, Schedule, synthesize
from edatalog.backend.lowering.lowered import Collectives, Lowered, Options, lower
from edatalog.backend.predicting.timeline import Report, analyze, write_trace
from edatalog.backend.running.compiled import Compile
from edatalog.backend.running.runtime import check_plan, runtime
from edatalog.errors import EdlError, did_you_mean
from edatalog.ir.graph import Graph, Repeat
from edatalog.ir.printer import human
from edatalog.solver import auto, layers, policy, strategies
from edatalog.solver import topology as machines
from edatalog.solver.plan import Plan as PlanIR
from edatalog.solver.topology import Topology


class ProgramLike(Protocol):
    """What planning reads of a program (an :class:`edatalog.Program`): its join-agg graph.  A
    protocol, so that this module, which :mod:`edatalog.api` imports, does not import it back."""

    @property
    def graph(self) -> Graph: ...


class Plan:
    """A plan for one program on one machine.  ``str(plan)`` shows every tile; ``summary()`` the
    predicted cost; ``save()`` writes a self-contained JSON file (plan, machine and program)."""

    def __init__(
        self, ir: PlanIR, graph: Graph, machine: Topology, reduction: str = "auto", options: Options | None = None
    ) -> None:
        if reduction not in REDUCTIONS:
            raise EdlError(f"unknown reduction '{reduction}'", help=f"reductions: {', '.join(REDUCTIONS)}")
        ir.verify(graph)
        if machine.n < ir.n_devices:
            raise EdlError(f"the plan uses {ir.n_devices} devices but {machine.name} has {machine.n}")
        self.ir, self.graph, self.topology, self.reduction = ir, graph, machine, reduction
        self.options = options if options is not None else Options()  # how it is lowered, reported and run
        self.solution: auto.Solution | None = None  # how the solver found it, for solved plans
        self.refined = ""  # a baseline's refinement that was kept ("S in 2 chunks"); solved plans: solution.refined
        self.layered: policy.Layered | None = None  # a repeated module solved once: its layer's solve
        self.picked = ""  # why the solver returned a baseline as built instead of its own plan
        self._lowered: dict[Options, Lowered] = {}

    def __str__(self) -> str:
        return str(self.ir)

    def __repr__(self) -> str:
        return f"<edatalog.Plan {self.ir.strategy} on {self.topology.name}: {len(self.ir.nodes)} rules>"

    @cached_property
    def schedule(self) -> Schedule:
        """The synthesized per-device programs (tasks: loads, computes, sends, combines)."""
        kinds = self.options.collectives.kinds(self.topology.library)
        return synthesize(self.graph, self.ir, self.topology, self.reduction, kinds)

    @property
    def lowered(self) -> Lowered:
        """The plan lowered with its options (by default: attention fused, collectives where the
        machine's library runs them faster): the device programs as every runtime runs them."""
        return self.lowering(self.options)

    def lowering(self, options: Options) -> Lowered:
        """The plan lowered with ``options`` (made once per options).  Its programs are verified
        before anything runs them (:meth:`Lowered.verified`); predicting their time does not
        need it, and a whole model's planning checks a dozen plans."""
        if options not in self._lowered:
            self._lowered[options] = lower(self.schedule, options, check=False)
        return self._lowered[options]

    @cached_property
    def report(self) -> Report:
        """Time, traffic and memory of the lowered plan under the machine's cost model."""
        return analyze(self.lowered)

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
            **({"refined": self.refined} if self.refined else {}),
            **({"picked": self.picked} if self.picked else {}),
            **(self._solver_summary() if self.solution is not None else {}),
            **(self._layers_summary() if self.layered is not None else {}),
        }

    def _layers_summary(self) -> dict[str, Any]:
        lay = self.layered
        assert lay is not None
        return {
            "layers": {
                "count": lay.count,
                "stages": lay.stages,
                "layer_ms": lay.layer_ms,  # one layer's predicted time, solved on its own (no call overhead)
                "outer_ms": lay.outer_ms,  # the rest of the program's, solved on its own, and the call overhead
                "layers_times_count_ms": lay.layer_ms * lay.count,
                "layer_origin": lay.layer.origin,
            }
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
            "searched": sol.searched,  # false: building took the time, the best baseline is kept
            "solver_estimate_ms": sol.predicted_ms if sol.searched else None,
            "lower_bound_ms": sol.lower_bound_ms if sol.searched else None,
            "optimal": sol.optimal,
            "gap": sol.gap,
            "memory_estimate": sol.memory_estimate,
            "chosen_by": sol.chosen_by,
            "origin": sol.origin,
            "refined": sol.refined,
        }

    def over_memory(self) -> list[int]:
        """Devices whose peak memory exceeds their capacity (the plan would not fit)."""
        peak = self.report.peak_memory
        return [d for d in range(self.ir.n_devices) if peak[d] > self.topology.devices[d].memory]

    def trace(self, path: str) -> None:
        """Write the predicted timeline as Chrome trace JSON (open it in ui.perfetto.dev)."""
        try:
            write_trace(path, self.report)
        except OSError as exc:
            raise EdlError(f"cannot write {path}: {exc.strerror or exc}") from None

    def execute(self, values: dict[str, np.ndarray], backend: str = "sim") -> dict[str, Any]:
        """Run the device programs (in the simulator, or with any runtime that runs plans);
        returns the outputs, gathered (absent cells read as 0): the convention of
        ``Program.run``.  (``Program.evaluate`` is the detailed API, with presence masks.)
        ``values`` must hold every input and param in its declared shape and dtype (as
        ``Program.prepare`` makes them)."""
        missing = [r.name for r in self.graph.relations if r.kind != "derived" and r.name not in values]
        if missing:
            raise EdlError(f"missing values for {', '.join(missing)}", help="pass every input and param")
        rt = runtime(backend)
        check_plan(rt, True)
        exe = rt.build(self.graph, self.lowered, None, Compile.AUTO)
        params = {r.name for r in self.graph.relations if r.kind == "param"}
        exe.load({k: v for k, v in values.items() if k in params})
        return exe({k: v for k, v in values.items() if k not in params}).values

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


def make_plan(
    prog: ProgramLike,
    topology: str | Topology = "a100x4",
    strategy: str = "auto",
    *,
    seed: int = 0,
    reduction: str = "auto",
    memory: int | str | None = None,
    time_limit: float = 10.0,
    space: str = "join",
    on_progress: Callable[[auto.Progress], None] | None = None,
    refine: bool = False,
    stages: int | None = None,
    collectives: str = "auto",
) -> Plan:
    """Plan ``prog`` on a machine.  ``auto`` (the default) asks the solver for the fastest plan
    within ``time_limit`` seconds that fits every device's memory (``memory`` overrides the
    machine's, e.g. ``"9GB"``); ``space="mesh"`` limits it to GSPMD-style plans.  The other
    strategies are the hand-written baselines (replicate, data, megatron, megatron-sp, random);
    with ``refine``, a baseline gets the refinements auto plans get (pipelined in chunks along
    a dim, guarded splits balanced; ``Plan.refined`` says which was kept), within
    ``time_limit``.  Auto plans are always refined.  A program with a repeated module (its
    layers) is solved one layer at a time (:func:`edatalog.solver.policy.solve_layers`), with
    ``stages`` pipeline stages (None: the fewest that fit, from 1).  ``collectives`` (``"auto"``,
    ``"on"``, ``"off"``) says which exchanges run as collective calls, in the plan's predictions
    and its runs (auto: those the machine's library runs faster so)."""
    options = lowering_options(collectives)
    machine = resolve_machine(topology, memory)
    if strategy in strategies.PIPELINED:
        raise EdlError(
            f"{strategy} is a baseline that edl plan compares whole models with on several nodes, priced from one "
            "node's timelines (edatalog.pipelined); there is no plan of it to build or run",
            help=f"plan with {strategy.removesuffix('-pp')}-dp, or with auto",
        )
    if strategy not in STRATEGIES:
        close = did_you_mean(strategy, STRATEGIES)
        known = f"strategies: {', '.join(STRATEGIES)}"
        raise EdlError(f"unknown strategy '{strategy}'", help=f"{close} {known}" if close else known)
    if strategy != "auto":
        if space != "join":
            raise EdlError("--space chooses the solver's search space; it goes with --strategy auto")
        plan = Plan(strategies.build(prog.graph, machine, strategy, seed=seed), prog.graph, machine, reduction, options)
        if refine:
            check = _checker(prog.graph, machine, reduction, options)
            kept, plan_refined = policy.refine_baseline(prog.graph, _Checked(plan), check, time_limit)
            plan = kept.facade
            plan.refined = plan_refined
        return plan
    if stages is not None and (stages < 1 or machine.n % stages):
        raise EdlError(
            f"{stages} pipeline stages do not divide the {machine.n} devices of {machine.name}",
            help="choose a number of stages that divides the device count",
        )
    rep = layers.repeated(prog.graph)
    if rep is not None:
        return _layered(prog.graph, rep, machine, reduction, options, time_limit, seed, space, on_progress, stages)
    if stages not in (None, 1):
        raise EdlError("pipeline stages split a repeated module's layers; this program has none")
    return _solved(prog.graph, machine, reduction, options, time_limit, seed, space, on_progress)


MIN_LAYER_SECONDS = 0.5  # what the layers' solve gets however long the whole-program baselines took


def _layered(
    graph: Graph,
    rep: Repeat,
    machine: Topology,
    reduction: str,
    options: Options,
    time_limit: float,
    seed: int,
    space: str,
    on_progress: Callable[[auto.Progress], None] | None,
    stages: int | None,
) -> Plan:
    """A plan of a program whose repeated module is solved once (see
    :func:`edatalog.solver.policy.solve_layers`), each solve checked in its own timeline."""

    def checker_for(g: Graph, m: Topology) -> Callable[[PlanIR], _Checked]:
        return _checker(g, m, reduction, options)

    made: dict[int, Plan] = {}  # the composed plans checked, kept: synthesizing L layers takes a while

    def fits(ir: PlanIR) -> bool:
        made[id(ir)] = Plan(ir, graph, machine, reduction, options)
        return not made[id(ir)].over_memory()

    whole = stages in (None, 1) and len(graph.nodes) > 2 * rep.count * len(rep.instance(0))
    # The whole-program baselines are checked first, so that the layers' solve gets what they
    # leave of the time limit (each takes a whole-program timeline: seconds for a training step).
    began = time.monotonic()
    baselines = _whole_baselines(graph, machine, reduction, options) if whole else []
    left = max(time_limit - (time.monotonic() - began), MIN_LAYER_SECONDS)
    try:
        lay = policy.solve_layers(graph, machine, checker_for, fits, left, seed, space, on_progress, stages)
    except EdlError as exc:
        if not whole:
            raise
        # No layer plan within the memory (what the rest of the step holds may leave a layer
        # nothing): the whole-program baselines may still fit.
        return _fitting_baseline(exc, baselines, graph, machine)
    plan = made.get(id(lay.plan)) or Plan(lay.plan, graph, machine, reduction, options)
    plan.layered = lay
    plan.solution = lay.layer
    if whole:
        return _against_baselines(plan, baselines)
    return plan


def _whole_baselines(graph: Graph, machine: Topology, reduction: str, options: Options) -> list[tuple[str, Plan]]:
    """The whole-program baselines this program has on ``machine``, each built and checked in
    its timeline: data, zero (ZeRO's shape: what fits when replicated params and optimizer state
    do not) where the program carries state, megatron, and on several nodes megatron inside
    them with data parallelism between them (those it has no shape for fail to build)."""
    built = []
    names = ("data", *(("zero",) if graph.carries else ()), "megatron", *strategies.MULTI_NODE)
    for strategy in names:
        try:
            plan = Plan(strategies.build(graph, machine, strategy), graph, machine, reduction, options)
        except EdlError:
            continue  # no such baseline for this program (megatron without heads)
        plan.over_memory()  # the timeline, now
        built.append((strategy, plan))
    return built


def _fitting_baseline(exc: EdlError, built: list[tuple[str, Plan]], graph: Graph, machine: Topology) -> Plan:
    """The fastest whole-program baseline within memory, when the layers found no plan; else
    an error saying what the leanest of them needs."""
    fitting = [(name, p) for name, p in built if not p.over_memory()]
    if fitting:
        name, best = min(fitting, key=lambda c: c[1].report.seconds)
        best.picked = (
            f"the {name} baseline as built: predicted {best.report.seconds * 1e3:.4g} ms; "
            "the layers solved one at a time found no plan within the memory"
        )
        return best
    if not built:
        raise exc
    name, lean = min(built, key=lambda c: max(c[1].report.peak_memory.values()))
    limit = min(d.memory for d in machine.devices)
    raise EdlError(
        f"no plan of this program fits in {human(limit)}B per device: the leanest, {name}, holds "
        f"{human(max(lean.report.peak_memory.values()))}B at its predicted peak",
        help="give each device more memory (--memory), use more devices, shrink the batch or the sequence"
        + (", or make the backward recompute activations" if graph.carries else ""),
    ) from None


def _against_baselines(plan: Plan, baselines: list[tuple[str, Plan]]) -> Plan:
    """``plan`` (a layer solved alone, composed), or a whole-program baseline the timeline
    predicts faster, within memory.  For programs whose repeated layers are less than half of
    them (a training step: the backward and the update are outside the layers), a layer solved
    alone can choose what the rest then pays for (a forward in tensor parallel, a backward in
    data parallel, and the activations moved between them); the baselines, built whole, do not.
    Checking them takes a whole-program timeline each, affordable at this size."""
    best, why = plan, ""
    over = bool(plan.over_memory())
    for strategy, candidate in baselines:
        if candidate.over_memory():
            continue
        if over or candidate.report.seconds < best.report.seconds:
            solved = f"the layers solved one at a time {plan.report.seconds * 1e3:.4g} ms"
            if over:
                solved += f", over the memory limit ({human(max(plan.report.peak_memory.values()))}B at peak)"
            why = f"the {strategy} baseline as built: predicted {candidate.report.seconds * 1e3:.4g} ms, {solved}"
            best, over = candidate, False
    if best is not plan:
        best.picked, best.solution = why, plan.solution
    return best


class _Checked:
    """A plan as the planning policy sees it (:class:`edatalog.solver.policy.Checked`): checked
    in the timeline, the backend's, as soon as it is made."""

    def __init__(self, plan: Plan) -> None:
        self.facade = plan
        self.fits = not plan.over_memory()  # synthesizes and analyzes the plan

    @property
    def plan(self) -> PlanIR:
        return self.facade.ir

    @property
    def seconds(self) -> float:
        return self.facade.report.seconds

    @property
    def peak(self) -> int:
        return max(self.facade.report.peak_memory.values())


def _checker(graph: Graph, machine: Topology, reduction: str, options: Options) -> Callable[[PlanIR], _Checked]:
    """The planning policy's exact check of a plan on ``machine``: the backend's timeline."""

    def check(ir: PlanIR) -> _Checked:
        return _Checked(Plan(ir, graph, machine, reduction, options))

    return check


def _solved(
    graph: Graph,
    machine: Topology,
    reduction: str,
    options: Options,
    time_limit: float,
    seed: int,
    space: str,
    on_progress: Callable[[auto.Progress], None] | None,
) -> Plan:
    """The plan :func:`edatalog.solver.policy.solve` keeps (solve, check the shortlist, re-solve,
    refine, under one deadline; nested on a machine of several identical nodes), each plan
    checked in the backend's timeline."""

    def checker_for(g: Graph, m: Topology) -> Callable[[PlanIR], _Checked]:
        return _checker(g, m, reduction, options)

    checked, solution = policy.solve_nested(graph, machine, checker_for, time_limit, seed, space, on_progress)
    plan = checked.facade
    plan.solution = solution
    return plan


def resolve_machine(topology: str | Topology, memory: int | str | None = None) -> Topology:
    """The machine of a preset, a file or a :class:`Topology`, with ``memory`` per device if given."""
    machine = machines.resolve(topology)
    if memory is not None:
        machine = machine.with_memory(int(machines.quantity(memory, "B", "memory")))
    return machine


def lowering_options(collectives: str) -> Options:
    choices = [c.value for c in Collectives]
    if collectives not in choices:
        raise EdlError(f"unknown collectives choice '{collectives}'", help=f"choose one of {', '.join(choices)}")
    return Options(Collectives(collectives))


def composed_ms(
    prog: ProgramLike,
    topology: str | Topology,
    strategy: str,
    *,
    reduction: str = "auto",
    memory: int | str | None = None,
    collectives: str = "auto",
) -> tuple[float, Plan]:
    """A baseline's predicted milliseconds for a program with a repeated module, composed as
    solved plans of it are (one layer's timeline times the layers, plus the rest's, each
    checked alone: what ``edl plan`` compares), and the baseline's plan of one layer."""
    rep = layers.repeated(prog.graph)
    assert rep is not None, "a program with a repeated module"
    machine = resolve_machine(topology, memory)
    options = lowering_options(collectives)
    whole = strategies.build(prog.graph, machine, strategy)  # the baseline's tiles of every rule
    parts = []
    for g in (layers.layer_graph(prog.graph, rep), layers.outer_graph(prog.graph, rep)):
        if g is None:
            continue
        tiles = {n.name: whole.node(n.name).tile for n in g.nodes}
        axes = {n.name: whole.node(n.name).reduce_axis for n in g.nodes}
        if strategy in strategies.MULTI_NODE:
            # Each node keeps its own rows, as an auto plan nested across nodes does (gathering
            # a layer's result onto every device would cross InfiniBand at every layer).
            ir = strategies.plan_of(g, machine, strategy, tiles, outputs=False, reduce_axes=axes)
            size, batch = strategies.node_size(machine, strategy), strategies.batch_symbol(prog.graph)
            ir = strategies.per_node_outputs(g, ir, size, len(machine.nodes), batch)
        else:
            ir = strategies.plan_of(g, machine, strategy, tiles, reduce_axes=axes)
        parts.append(Plan(ir, g, machine, reduction, options))
    layer = parts[0]
    # Each part's timeline pays the call's overhead; the whole program pays it once.
    overhead = machine.call_overhead
    per_layer = max(0.0, layer.report.seconds - overhead)
    rest = sum(p.report.seconds for p in parts[1:]) if len(parts) > 1 else overhead
    return (per_layer * rep.count + rest) * 1e3, layer


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


def load_plan(path: str | Path, prog: ProgramLike | None = None) -> Plan:
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
