"""The planning policy: solve, check the shortlist exactly, re-solve under a cut memory budget,
refine, all under one deadline.

:func:`solve` asks :func:`edatalog.solver.auto.solve` for plans, has each shortlisted plan checked
(the fastest that fits wins), solves again under a budget cut by the overshoot when none fits,
and tries refinements (:mod:`edatalog.solver.refine`) of the fastest.  The exact check (in
:mod:`edatalog.plans`: synthesize the exchanges, run the timeline) is the backend's, a later
stage: the caller passes it in, as a :data:`Checker`, so that the solver never imports the
backend.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from edatalog.errors import EdlError
from edatalog.ir.graph import Graph
from edatalog.solver import auto, nested, refine
from edatalog.solver.blocks import guarded_dims
from edatalog.solver.costs import least_bytes
from edatalog.solver.plan import Plan
from edatalog.solver.strategies import baseline_names, build
from edatalog.solver.topology import Topology

SOLVE_SHARE = 0.6  # of the time left, for building and searching; checking, searching the timeline, refining: the rest
# Of the time left, what building the model may take before the baselines are checked instead:
# a model built late is still worth its starting plans (greedy, two-level...), checked in what is left.
BUILD_SHARE = 0.85
REFINE_TRIES = 3  # the fastest shortlisted plans whose refinements are checked
ATTEMPTS = 4  # solves at most: the first, then re-solves under a cut memory budget
TIMELINE_SHARE = 0.6  # of the time left after checking the shortlist, for the search in the timeline
SLACK = 1.15  # a move may be this much slower than the plan it leaves, by the estimate
PROPOSE_SECONDS = 0.3  # the most Z3 may take to propose one move
IMPROVE = 1e-3  # a move is kept when the timeline puts it this much faster
MIN_INNER_SECONDS = 2.0  # what a nested solve's group gets however long the whole machine's checks took
SINGLE_NODE = ("megatron", "megatron-sp")  # baselines not checked on the whole machine of a nested solve
NESTED_RESERVE = 2.0  # times the slowest whole-machine check, kept back for checking the lifted plan


class Checked(Protocol):
    """A plan checked exactly (in the timeline): what a :data:`Checker` returns for it."""

    @property
    def plan(self) -> Plan:
        """The plan checked."""
        ...

    @property
    def seconds(self) -> float:
        """Its predicted time."""
        ...

    @property
    def peak(self) -> int:
        """The most bytes one device holds at any time."""
        ...

    @property
    def fits(self) -> bool:
        """Whether every device's peak is within its memory."""
        ...


C = TypeVar("C", bound=Checked)

# Checks one plan (the work is done by the call, or at the latest on reading the result's fields:
# either way it is timed as the check).  Each plan is checked once; the results are kept for as
# long as the policy needs them.
Checker = Callable[[Plan], C]


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

    def check(self, plan: Plan, check: Checker[C], phase: str, first: bool = False) -> C | None:
        """``plan`` checked, unless the deadline would pass before a check as long as the slowest
        so far ends: then None.  The ``first`` is always checked (a plan is returned only
        checked).  Checks are not interrupted: one overruns by at most its own length, which the
        slowest before it predicts."""
        if not first and time.monotonic() + self.slowest > self.deadline:
            return None
        began = time.monotonic()
        checked = check(plan)
        fits = checked.fits  # the check's work is done by now
        took = time.monotonic() - began
        self.slowest = max(self.slowest, took)
        self.spent[phase] += took
        if fits and (self.checked_ms is None or checked.seconds * 1e3 < self.checked_ms):
            self.checked_ms = checked.seconds * 1e3
        if self.on_progress is not None:
            self.last = dataclasses.replace(self.last, elapsed=self.elapsed(), phase=phase, checked_ms=self.checked_ms)
            self.on_progress(self.last)
        return checked


def solve(
    graph: Graph,
    machine: Topology,
    check: Checker[C],
    time_limit: float,
    seed: int = 0,
    space: str = "join",
    on_progress: Callable[[auto.Progress], None] | None = None,
    search: bool = True,
) -> tuple[C, auto.Solution]:
    """Solve, then ``check`` the shortlisted plans: the fastest that fits wins, and refinements
    of the fastest are tried.  All under one deadline: the solver gets :data:`SOLVE_SHARE` of
    the time, checking and refining what is left, stopping when the deadline comes with the best
    plan checked so far.  When none fits (the solver's memory estimate was too low), solve again
    under a budget cut by the overshoot, while time is left.  Without ``search``, the solver's
    model is not built: the baselines are checked and refined.  Returns the plan kept, as checked,
    and the solution, with where the time went."""
    clock = _Clock(time_limit, on_progress)
    limit = min(d.memory for d in machine.devices)
    budget = limit
    solve_seconds = build_seconds = 0.0
    leanest: tuple[C, auto.Solution] | None = None  # the least peak checked, should nothing fit
    for attempt in range(ATTEMPTS):
        clock.solve_began = clock.elapsed()
        left = clock.left()
        build_limit = left * BUILD_SHARE if search else 0.0
        solution = auto.solve(graph, machine, budget, left * SOLVE_SHARE, seed, space, clock.solving, build_limit)
        if not search:
            solution.skipped = f"{machine.n} devices on {len(machine.nodes)} nodes, and no batch-like dim to nest along"
        solve_seconds += solution.seconds
        build_seconds += solution.build_seconds
        checked: list[C] = []
        for ir in solution.shortlist:
            c = clock.check(ir, check, "checking", first=not checked)
            if c is None:
                break
            checked.append(c)
        solution.unchecked = len(solution.shortlist) - len(checked)
        fitting = sorted((c for c in checked if c.fits), key=lambda c: c.seconds)
        if fitting:
            best = fitting[0]
            solution.chosen_by = "solver" if best is checked[0] and not solution.infeasible else "timeline"
            if solution.origins:
                solution.origin = solution.origins[checked.index(best)]
            if space == "join" and solution.neighbours is not None:
                best = _in_timeline(best, checked, solution, check, clock)
            # Refinements leave the mesh space (chunks on one device, zigzag parts): join only.
            refined = _refined(graph, fitting[:REFINE_TRIES], check, clock) if space == "join" else None
            if refined is not None and refined[0].seconds < best.seconds:
                best, solution.refined = refined
            break
        if solution.infeasible and len(checked) == len(solution.shortlist):
            auto.raise_infeasible(solution, space)
        least = min(checked, key=lambda c: c.peak)
        if leanest is None or least.peak < leanest[0].peak:
            leanest = (least, solution)
        peak = max(c.peak for c in checked)
        if attempt == ATTEMPTS - 1:
            raise EdlError(
                f"the solver found no plan that fits in {limit / 1e9:.3g}GB per device once simulated "
                f"(the best needs {peak / 1e9:.3g}GB)",
                help="give each device more memory (--memory), use more devices, or shrink the dims",
            )
        if clock.left() <= 0:
            # Out of time: the leanest plan checked (never nothing), which the summary and edl plan
            # show over memory; a longer time limit may find one that fits.
            best, solution = leanest
            break
        budget = int(budget * limit / peak * 0.97)
    solution.seconds, solution.build_seconds, solution.solves = solve_seconds, build_seconds, attempt + 1
    solution.check_seconds, solution.refine_seconds = clock.spent["checking"], clock.spent["refining"]
    solution.total_seconds = clock.elapsed()
    return best, solution


def solve_nested(
    graph: Graph,
    machine: Topology,
    checker_for: Callable[[Graph, Topology], Checker[C]],
    time_limit: float,
    seed: int = 0,
    space: str = "join",
    on_progress: Callable[[auto.Progress], None] | None = None,
) -> tuple[C, auto.Solution]:
    """:func:`solve`, nested on a machine of identical nodes where the program has a batch-like
    dim (:mod:`edatalog.solver.nested`): one group's share of the program solved on one group
    (itself nested, when a group is several nodes), lifted to every group, and checked on the
    whole machine beside the multi-node baselines as built; the fastest that fits is kept.  The
    baselines are checked first, so that the group's solve gets what they leave, less room for
    checking the lifted plan."""
    how = nested.across(graph, machine)
    if how is None:
        # Several nodes and nothing to nest along: past nested.FLAT_MOST devices the solver's model
        # takes minutes to build (every layout pair's transfer), so the baselines are checked
        # and refined instead of waiting on a build that ends at the deadline anyway.
        search = len(machine.nodes) == 1 or machine.n <= nested.FLAT_MOST
        return solve(graph, machine, checker_for(graph, machine), time_limit, seed, space, on_progress, search)
    clock = _Clock(time_limit, on_progress)
    check = checker_for(graph, machine)
    built: list[tuple[str, C]] = []
    # Not tensor parallelism over every device: its collectives would cross between nodes (and
    # lowering it for hundreds of devices takes minutes); the group's solve has it inside a group.
    across_nodes = [name for name in baseline_names(machine, bool(graph.carries)) if name not in SINGLE_NODE]
    for name in across_nodes:
        try:
            ir = dataclasses.replace(build(graph, machine, name), strategy="auto")
        except EdlError:
            continue  # the program has no such shape (no heads for megatron)
        c = clock.check(ir, check, "checking", first=True)
        assert c is not None, "a first check always runs"
        built.append((f"baseline: {name}", c))
    small = nested.shrink(graph, how.dim, how.groups)
    assert small is not None, "across() splits batch-like dims only"
    inner_time = max(MIN_INNER_SECONDS, clock.left() - NESTED_RESERVE * clock.slowest)
    clock.solve_began = clock.elapsed()
    group = nested.group(machine, how)
    inner, solution = solve_nested(small, group, checker_for, inner_time, seed, space, clock.solving)
    lifted = clock.check(nested.lift(graph, inner.plan, how, machine), check, "checking", first=True)
    assert lifted is not None, "a first check always runs"
    kept, origin = lifted, f"{solution.origin or 'search'}, on each group"
    for name, c in built:
        if c.fits and (not kept.fits or c.seconds < kept.seconds):
            kept, origin = c, name
    solution.nested = f"{how}: each group's plan solved at {how.dim}={dict(small.dims)[how.dim]} on {how.size} devices"
    solution.origin = origin
    if kept is not lifted:
        solution.chosen_by = "timeline"
    solution.check_seconds += clock.spent["checking"]
    solution.total_seconds = clock.elapsed()
    return kept, solution


def _in_timeline(best: C, checked: list[C], solution: auto.Solution, check: Checker[C], clock: _Clock) -> C:
    """``best`` improved by a search in the timeline, for :data:`TIMELINE_SHARE` of the time
    left: first-improvement local search whose moves the solver's model supplies
    (:class:`edatalog.solver.auto.Neighbours`) and the timeline judges, a move kept when faster
    and within memory.  First the one-pick moves, cheapest by the estimate first (no Z3, one
    check each: the moves the estimate rates alike are where the timeline, which overlaps what
    the estimate adds up, tells plans apart); once they are spent, the plan Z3 proposes for
    each neighbourhood in turn (the estimate's best there within :data:`SLACK`), until every
    neighbourhood in a row has nothing faster.  Starts from the fastest checked plan that is
    picks of the solver's (not a baseline as built)."""
    neighbours = solution.neighbours
    assert neighbours is not None
    ranked = sorted((c for c in checked if c.fits), key=lambda c: c.seconds)
    at = next((checked.index(c) for c in ranked if solution.picks[checked.index(c)] is not None), None)
    if at is None:
        return best
    current, picks = checked[at], solution.picks[at]
    assert picks is not None
    hoods = neighbours.hoods(picks)
    queue = neighbours.moves(picks, SLACK)
    until = time.monotonic() + TIMELINE_SHARE * clock.left()
    seen = {tuple(sorted(picks.items()))}
    moves, quiet, k = 0, 0, 0
    while (left := until - time.monotonic()) > 0:
        if queue:
            choice: dict[str, int] | None = queue.pop(0)
        elif quiet < len(hoods):
            hood = hoods[k % len(hoods)]
            k += 1
            quiet += 1
            choice = neighbours.propose(picks, hood, SLACK, min(left, PROPOSE_SECONDS))
        else:
            break
        if choice is None or (key := tuple(sorted(choice.items()))) in seen:
            continue
        seen.add(key)
        c = clock.check(neighbours.plan(choice), check, "checking")
        if c is None:
            break
        if c.fits and c.seconds < current.seconds * (1 - IMPROVE):
            current, picks, quiet = c, choice, 0
            queue = neighbours.moves(picks, SLACK)
            moves += 1
    if moves and current.seconds < best.seconds:
        solution.origin = f"search: {moves} move{'s' * (moves > 1)} in the timeline from {solution.origins[at]}"
        solution.chosen_by = "timeline"
        return current
    return best


def refine_baseline(graph: Graph, base: C, check: Checker[C], time_limit: float) -> tuple[C, str]:
    """``base`` (a checked plan: a baseline's) or the fastest of its refinements that fits, the
    ones an auto plan gets (see :func:`_refined`), within ``time_limit`` seconds; and what the
    refinement is ("" for ``base``).  A baseline refined so is what the solver's plans are
    measured against: every trick for both."""
    refined = _refined(graph, [base], check, _Clock(time_limit, None))
    if refined is not None and (refined[0].seconds < base.seconds or not base.fits):
        return refined
    return base, ""


def _refined(graph: Graph, plans: list[C], check: Checker[C], clock: _Clock) -> tuple[C, str] | None:
    """The fastest refinement of ``plans`` that fits, and what it is: each plan balanced along
    guarded dims, and each of those pipelined in 2 chunks along a dim every rule has, then 4
    while that keeps helping (see :mod:`edatalog.solver.refine`).  Checked, while the clock
    allows."""
    best: tuple[C, str] | None = None

    def consider(c: C, what: str) -> bool:
        nonlocal best
        if not c.fits:
            return False
        if best is None or c.seconds < best[0].seconds:
            best = (c, what)
        return True

    for base in plans:
        variants = [(base, "")]
        for dim in sorted(guarded_dims(graph)):
            ir = refine.balanced(graph, base.plan, dim)
            if ir is not None:
                balanced = clock.check(ir, check, "refining")
                if balanced is None:
                    return best
                if consider(balanced, f"{dim} balanced"):
                    variants.append((balanced, f"{dim} balanced"))
        for variant, what in variants:
            for dim in refine.every_rule_dims(graph):
                last = variant.seconds
                for chunks in refine.CHUNKS:
                    ir = refine.pipelined(graph, variant.plan, dim, chunks)
                    if ir is None:
                        break
                    piped = clock.check(ir, check, "refining")
                    if piped is None:
                        return best
                    if piped.seconds >= last or not consider(piped, _join(what, f"{dim} in {chunks} chunks")):
                        break
                    last = piped.seconds
    return best


def _join(*parts: str) -> str:
    return ", ".join(p for p in parts if p)


LAYER_SHARE = 0.75  # of a layered solve's time, for the layer (the rest of the program is small)
STAGES_TRIED = (1, 2, 4, 8)  # pipeline stages tried in turn until a plan fits, when none is asked
FIRST_SHARE = 0.7  # of the time left, for the next number of stages tried


@dataclasses.dataclass
class Layered:
    """A plan composed from one solved layer (see :mod:`edatalog.solver.layers`): the whole
    graph's plan, the layer's solution and the rest's, and the stages."""

    plan: Plan
    layer: auto.Solution
    outer: auto.Solution | None
    stages: int
    layer_ms: float  # the layer's predicted time, as solved alone, less the call's overhead
    outer_ms: float  # the rest's, with the call's overhead (paid once per call)
    count: int
    # The most bytes a device holds running the whole program is at most this: every layer it
    # runs at its own peak as solved alone (inputs, outputs gathered, weights), plus the rest's.
    peak_bound: int = 0
    checked_layer: Any = None  # the layer's plan, as checked (its timeline)


def solve_layers(
    graph: Graph,
    machine: Topology,
    checker_for: Callable[[Graph, Topology], Checker[C]],
    fits: Callable[[Plan], bool],
    time_limit: float,
    seed: int = 0,
    space: str = "join",
    on_progress: Callable[[auto.Progress], None] | None = None,
    stages: int | None = None,
) -> Layered:
    """A plan of ``graph``, whose repeated module is solved once: the layer (instance 0) on one
    pipeline stage's devices, under its share of each device's memory (the devices of a stage
    hold ``L / stages`` layers), and the rest of the program on every device; composed, every
    instance takes the layer's plan.  With ``stages`` None, 1 stage, then more while the composed
    plan does not fit (``fits``: the exact check of the whole)."""
    from edatalog.solver import layers

    rep = layers.repeated(graph)
    assert rep is not None, "a graph with a repeated module"
    start = time.monotonic()
    limit = min(d.memory for d in machine.devices)
    layer_g, outer_g = layers.layer_graph(graph, rep), layers.outer_graph(graph, rep)
    outer_bytes = least_bytes(outer_g, machine.n)[0] if outer_g is not None else 0
    tried = [stages] if stages is not None else [s for s in STAGES_TRIED if machine.n % s == 0 and s <= rep.count]
    last: Layered | None = None
    for k, s in enumerate(tried):
        left = time_limit - (time.monotonic() - start)
        # Most of the time to the fewest stages (they usually fit); the rest for more, if not.
        share = left * FIRST_SHARE if stages is None and k < len(tried) - 1 else left
        devices = layers.stage_devices(machine.n, s)[0]
        per_layer = max(1, (limit - outer_bytes) * s // rep.count)
        stage = machine.subset(devices).with_memory(per_layer)
        layer_checked, layer_sol = solve_nested(
            layer_g, stage, checker_for, share * LAYER_SHARE, seed, space, on_progress
        )
        # A call's overhead is paid once per call, not per part: the layer's time is without it,
        # the rest's (or, with nothing else, the overhead alone) with it.
        overhead_ms = machine.call_overhead * 1e3
        outer_plan, outer_sol, outer_ms, outer_peak = None, None, overhead_ms, 0
        if outer_g is not None:
            outer_time = max(0.5, share * (1 - LAYER_SHARE))
            outer_checked, outer_sol = solve_nested(outer_g, machine, checker_for, outer_time, seed, space)
            outer_plan, outer_ms, outer_peak = outer_checked.plan, outer_checked.seconds * 1e3, outer_checked.peak
        plan = layers.compose(graph, rep, layer_checked.plan, outer_plan, machine, s)
        bound = layer_checked.peak * -(-rep.count // s) + outer_peak
        layer_ms = max(0.0, layer_checked.seconds * 1e3 - overhead_ms)
        last = Layered(plan, layer_sol, outer_sol, s, layer_ms, outer_ms, rep.count, bound, layer_checked)
        # The bound decides without lowering the whole model; only when it is too loose does the
        # whole model's timeline (the exact check) decide.
        if stages is not None or bound <= limit or fits(plan):
            return last
    assert last is not None
    return last
