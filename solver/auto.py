"""The placement solver: a partition and devices for every join-agg, chosen by Z3.

The model is pseudo-Boolean.  For every node one candidate is picked (``x[n][i]``); the layout a
relation is left in and the needs its readers have are classes implied by those picks; a pair
(layout, need) costs what :meth:`Costs.transfer` says, and a need shared by several readers (q, k
and v all reading ``xn``) is paid once.  The objective is the sum, in nanoseconds, of compute on
the busiest device per node, reductions and transfers.  Memory is a constraint at every step of
the program: resident inputs and params, plus every relation alive at that step, must fit.

The search starts from plans built without search (a greedy pass, one dim split everywhere, the
baselines, and two-level plans: a dim split across groups of devices, Megatron inside each).  Z3
runs as an iterated solver with a tightening bound, in its own context, with a seed and a
deadline: each model found must beat the best so far by :data:`STEP`.  Two searches run at once,
on two threads (Z3 runs without Python's lock): one in the mesh space (even splits), whose model
is small and quickly built, and one in the join space, once its model is built.  Each
recombines the starting plans, searches neighbourhoods of the best plan and of the next best
starts, then the whole space, where "unsat" proves the best optimal within that step.  On the
deadline the best plan found so far is returned with its gap, and a shortlist (it, each phase's
best, the best starts, the baselines) for the caller to check in the exact timeline, where it
also searches further (:class:`Neighbours`): the estimate adds steps up, the timeline overlaps
them, and the two can rank different structures differently.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import z3

from edatalog.errors import EdlError
from edatalog.ir.graph import Graph
from edatalog.ir.printer import human
from edatalog.solver import starts
from edatalog.solver.blocks import Box, Layout, candidates, dim_order
from edatalog.solver.costs import Costs, Held, Need, Option, held_bytes, least_bytes, need_bytes
from edatalog.solver.plan import Plan, Tile
from edatalog.solver.strategies import baseline_names, build, plan_of
from edatalog.solver.topology import Topology

SPACES = ("join", "mesh")
STEP = 0.002  # each new plan must be this much faster than the last: the optimality tolerance
NS = 1e9  # nanoseconds per second: the objective's finest unit
KB = 1024  # memory constraints count kilobytes at the finest
PB_RANGE = 1 << 30  # Z3's pseudo-Boolean sums wrap past 2**31: every constraint's weights sum below this
WINDOW = 6  # nodes freed at a time while improving the incumbent
WINDOW_SECONDS = 1.0  # the most one neighbourhood may take
MIX_SECONDS = 1.0  # the most one step of recombining the starting plans may take
POLISHED = 3  # starts improved by a search of their own, beside the best plan
BEST_SHARE = 0.4  # of the search time left after recombining, for improving the best plan
POLISH_SHARE = 0.7  # of what is left then, for improving the other starts (the rest: the whole space)
MEMORY_SLACK = 1.25  # shortlisted plans may be this much over the memory limit by the estimate
SHORTLIST = 6  # best starting plans re-checked in the timeline with the solver's best
MESH_LEAST_SECONDS = 2.0  # the least time left after building for the mesh space's search beside

_Term = tuple[str, int]  # literal, weight (units of time or of memory)


PHASES = ("building", "solving", "checking", "refining")  # what a solved plan's time goes to, in order


@dataclass(frozen=True)
class Progress:
    """What a progress display shows while planning: the phase (one of :data:`PHASES`; the
    solver reports building and solving, :mod:`edatalog.solver.policy` checking and refining too), the
    seconds since the start, the solver's best estimate and bound, and once plans are checked in
    the timeline, the fastest that fits so far."""

    elapsed: float
    best_ms: float | None
    bound_ms: float
    plans: int  # improving plans found so far
    phase: str = "solving"
    checked_ms: float | None = None  # the fastest plan checked in the timeline that fits


@dataclass
class Solution:
    plan: Plan
    predicted_ms: float  # the solver's own estimate (steps added up, no overlap)
    lower_bound_ms: float  # no plan in the space is faster than this under the estimate
    optimal: bool  # proved optimal (within STEP)
    seconds: float  # solve time: building and searching (every solve's, after memory re-solves)
    memory_estimate: int  # bytes: the most one device holds at any step, under the estimate
    options: dict[str, list[Option]] = field(repr=False, default_factory=dict)
    chosen: dict[str, int] = field(default_factory=dict)  # node -> index into options[node]
    plans_found: int = 0
    # Plans worth checking in the exact timeline: the solver's best, then the best starting plans
    # and the baselines in its space (its estimate adds steps up, so plans can swap places once
    # overlap is counted).
    shortlist: tuple[Plan, ...] = ()
    origins: tuple[str, ...] = ()  # per shortlisted plan: "search", or "start: greedy", "start: megatron", ...
    chosen_by: str = "solver"  # "solver", or "timeline" when the re-check preferred another shortlisted plan
    origin: str = ""  # set by the caller: the kept plan's entry of ``origins``
    build_seconds: float = 0.0  # of ``seconds``: costing the candidates and building the model
    infeasible: str = ""  # when no plan fits by the estimate: why (the shortlist is the leanest starts)
    refined: str = ""  # set by the caller when a refinement of the plan was kept ("S balanced, S in 2 chunks")
    # Set by the caller (edatalog.solver.policy), which checks and refines under the same deadline:
    check_seconds: float = 0.0  # checking shortlisted plans in the timeline
    refine_seconds: float = 0.0  # checking refinements in the timeline
    total_seconds: float = 0.0  # the whole call: solves, checks, refinements
    unchecked: int = 0  # shortlisted plans the deadline left unchecked
    solves: int = 1  # solves run (more than one after memory re-solves)
    # Per shortlisted plan, its picks of ``options`` (None for a baseline as built), and plans
    # next to a choice of picks: what the caller's search in the timeline moves through.
    picks: tuple[dict[str, int] | None, ...] = field(default=(), repr=False)
    neighbours: Neighbours | None = field(default=None, repr=False)
    # False when building the model took all the time: nothing was searched, the shortlist is
    # the baselines as built, and there is no estimate (``predicted_ms`` and the bound are 0).
    searched: bool = True
    # Set by the caller for a nested solve (edatalog.solver.nested): how the machine was split
    # ("B across 8 groups of 8 devices: ..."); the rest of the fields are the group's solve.
    nested: str = ""
    # Set by the caller when it asked for no search (a machine too large to build the model for
    # in time): why.  ``searched`` is then False.
    skipped: str = ""

    @property
    def gap(self) -> float:
        if self.optimal or not self.searched or self.predicted_ms <= 0:
            return 0.0
        return max(0.0, 1 - self.lower_bound_ms / self.predicted_ms)


def solve(
    graph: Graph,
    topo: Topology,
    memory: int | None = None,
    time_limit: float = 30.0,
    seed: int = 0,
    space: str = "join",
    on_progress: Callable[[Progress], None] | None = None,
    build_limit: float | None = None,
) -> Solution:
    """The fastest plan the solver finds in ``time_limit`` seconds, keeping every device under
    ``memory`` bytes (default: each device's capacity).  The limit covers costing the candidates
    and building the model too.  Building may take up to ``build_limit`` seconds (default
    ``time_limit``; a model built past ``time_limit`` is not searched, but its starting plans are
    shortlisted); when it takes longer, it stops there and the baselines are returned
    unsearched, as built (``searched`` is False), for the caller to check."""
    start = time.monotonic()
    n = topo.n
    limit = memory if memory is not None else min(d.memory for d in topo.devices)
    if on_progress is not None:
        on_progress(Progress(0.0, None, 0.0, 0, "building"))
    need, _ = least_bytes(graph, n)
    cap = memory if memory is not None else max(d.memory for d in topo.devices)
    if need > cap:  # a bound, not an estimate: inputs and params do not fit (checked before building)
        _infeasible(_no_fit(graph, n, limit, space), space)
    try:
        setup = _Setup(graph, topo, limit, space, deadline=start + (time_limit if build_limit is None else build_limit))
    except _OutOfTime:
        return _unsearched(graph, topo, start)
    built = time.monotonic() - start
    # The mesh space's model is built on its thread while this one searches (its Python and this
    # build would share one interpreter lock); it is not built when too little time is left.
    mesh = None
    if space == "join" and time_limit - built >= MESH_LEAST_SECONDS:
        mesh = _MeshSearch(graph, topo, limit, start, time_limit, seed)
    model, options = setup.model, setup.options
    baselines = [c for _, c in setup.baselines]
    starts = [c for _, c in setup.starts]
    fitting = sorted((c for c in starts if model.memory(c) <= limit), key=model.cost)
    warm = fitting[0] if fitting else None
    best, bound, optimal, found, ended = model.search(start, time_limit, seed, warm, on_progress, pool=starts)
    if mesh is not None:
        meshed, mesh_found = mesh.result(setup)
        found += mesh_found
        ended = [*meshed, *ended]
        fits = [c for c in meshed if model.memory(c) <= limit]
        if fits and (best is None or min(map(model.cost, fits)) < model.cost(best)):
            best, optimal = min(fits, key=model.cost), False
    shortlist: tuple[Plan, ...] = ()
    picks: list[dict[str, int]] = []
    extra_origins: tuple[str, ...] = ()  # of shortlisted plans that are no picks: baselines as built
    infeasible = ""
    if best is None:
        # Nothing fits by the estimate, which errs high: hand the leanest starts to the caller to
        # check exactly, with the message to give if none of them fits either.
        starts.sort(key=model.memory)
        infeasible = (
            f"{_no_fit(graph, n, limit, space)}; the leanest plan the solver started from needs about "
            f"{_fmt(model.memory(starts[0]))} by its estimate"
        )
        best = starts[0]
        picks = starts[:3]
        shortlist = tuple(_plan(graph, topo, options, c, space) for c in picks)
    plan = _plan(graph, topo, options, best, space)
    if not shortlist:
        # The solver's best, the best starts and the baselines it can express that fit by the
        # estimate: the exact check keeps the fastest, so auto is never slower than them.
        # The estimate of memory errs high, the check is exact: starts and baselines a little
        # over the limit by the estimate are checked too.
        near = limit * MEMORY_SLACK
        close = sorted((c for c in starts if model.memory(c) <= near), key=model.cost)[:SHORTLIST]
        extra = [*ended, *close, *(c for c in baselines if model.memory(c) <= near)]
        both = [best, *extra]
        picks = [c for k, c in enumerate(both) if c not in both[:k]]
        shortlist = (plan, *(_plan(graph, topo, options, c, space) for c in picks[1:]))
        if space == "join":  # the baselines as built, where the picks did not make them already
            same = {(p.nodes, p.inputs) for p in shortlist}
            # Restamped: a plan the solver returns is the solver's ("auto"); its origin keeps the name.
            exact = [(name, replace(p, strategy="auto")) for name, p in setup.built if (p.nodes, p.inputs) not in same]
            shortlist += tuple(p for _, p in exact)
            extra_origins = tuple(f"baseline: {name}" for name, _ in exact)
    # Where each shortlisted plan came from: a start (the first that makes the same picks), or
    # the search, when it found a plan no start is.
    origins = tuple(next((f"start: {label}" for label, c in setup.starts if c == pick), "search") for pick in picks)
    origins += extra_origins
    cost = model.cost(best)
    return Solution(
        plan,
        model.ms(cost),
        model.ms(min(bound, cost)),
        optimal,
        time.monotonic() - start,
        model.memory(best),
        options,
        best,
        found,
        shortlist,
        build_seconds=built,
        infeasible=infeasible,
        origins=origins,
        picks=(*picks, *(None for _ in extra_origins)),
        neighbours=Neighbours(graph, topo, model, options, space, seed),
    )


class _OutOfTime(Exception):
    """Building a solve's model passed its deadline (caught in :func:`solve`)."""


def _unsearched(graph: Graph, topo: Topology, start: float) -> Solution:
    """A solve whose model could not be built in its time: the baselines as built
    (:func:`baseline_names` where the program has their shape, else everything on one device),
    unsearched, for the caller to check in the timeline.  Costing every candidate of every node
    is what takes the time, and these need none of it."""
    built: list[tuple[str, Plan]] = []
    for name in baseline_names(topo, bool(graph.carries)):
        try:
            built.append((name, replace(build(graph, topo, name), strategy="auto")))
        except EdlError:
            continue
    if not built:
        built.append(("replicate", replace(build(graph, topo, "replicate"), strategy="auto")))
    seconds = time.monotonic() - start
    return Solution(
        built[0][1],
        0.0,
        0.0,
        False,
        seconds,
        0,
        shortlist=tuple(p for _, p in built),
        origins=tuple(f"baseline: {name}" for name, _ in built),
        build_seconds=seconds,
        picks=tuple(None for _ in built),
        searched=False,
    )


class _Setup:
    """What a solve starts from: every node's costed candidates, the model, and starting plans.
    Building stops with :class:`_OutOfTime` once ``deadline`` (a ``time.monotonic()``) passes."""

    def __init__(self, graph: Graph, topo: Topology, limit: int, space: str, deadline: float = math.inf) -> None:
        if space not in SPACES:
            raise EdlError(f"unknown search space '{space}'", help="spaces: join (any partition) or mesh (GSPMD-style)")
        costs = Costs(graph, topo)
        rank = dim_order(graph)
        # No zigzag candidates: they more than double the model (every rule with an S index
        # gets them) for what the balanced refinement does to a finished plan anyway
        # (edatalog.solver.refine.balanced, tried on the fastest plans checked).
        balance: frozenset[str] = frozenset()
        self.options: dict[str, list[Option]] = {}
        # Per node, every candidate's tile -> the option that stands for it.
        self.tiles: dict[str, dict[Tile, int]] = {}
        for node in graph.nodes:
            cands = candidates(node, topo.n, mesh=space == "mesh", balance=balance)
            opts = []
            for c in cands:
                if time.monotonic() > deadline:
                    raise _OutOfTime
                opts.append(costs.option(node, Layout(node, c, rank)))
            self.options[node.name], self.tiles[node.name] = _prune(opts)
        self.model = Model(graph, costs, self.options, limit, deadline)
        if time.monotonic() > deadline:
            raise _OutOfTime
        self.baselines, self.built = starts.baselines(graph, topo, self.tiles)
        self.starts: list[starts.Start] = [
            *starts.simple(graph, self.model, self.baselines),
            *starts.two_level(graph, topo, rank, self.tiles, balance),
        ]

    def picks_of(self, other: _Setup, choice: dict[str, int]) -> dict[str, int] | None:
        """``choice``, a plan of ``other`` (the mesh space's), as picks of this setup's options;
        None if a tile has no option here."""
        out = {}
        for name, i in choice.items():
            k = self.tiles[name].get(other.options[name][i].layout.tile)
            if k is None:
                return None
            out[name] = k
        return out


class _MeshSearch:
    """The mesh space (even splits that divide the extents) searched on a thread beside the
    join space: its model is a fraction of the size, built in a fraction of the time and
    searched much further in the same time, and Z3 runs without Python's lock, so that the two
    searches use two cores.  Its plans then join the join search's shortlist as join picks."""

    def __init__(self, graph: Graph, topo: Topology, limit: int, start: float, time_limit: float, seed: int) -> None:
        self.setup: _Setup | None = None  # built on the thread
        self.plans: list[dict[str, int]] = []  # its best and each phase's, mesh picks
        self.found = 0
        self.error: BaseException | None = None

        def search() -> None:
            try:
                self.setup = _Setup(graph, topo, limit, "mesh")
                model = self.setup.model
                fitting = sorted((c for _, c in self.setup.starts if model.memory(c) <= limit), key=model.cost)
                if fitting:
                    best, _, _, self.found, ended = model.search(
                        start, time_limit, seed + 1, fitting[0], None, pool=fitting, mix=False
                    )
                    if self.found:
                        self.plans = [c for c in (best, *ended) if c is not None]
            except BaseException as exc:  # noqa: BLE001 - re-raised by result(), in the caller's thread
                self.error = exc

        self.thread = threading.Thread(target=search, name="edatalog-mesh-search", daemon=True)
        self.thread.start()

    def result(self, setup: _Setup) -> tuple[list[dict[str, int]], int]:
        """Once the search ends: its improving plans as picks of ``setup`` (the join space's),
        and how many it found."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        mesh = self.setup
        assert mesh is not None, "the thread built it or failed"
        picks = [p for p in (setup.picks_of(mesh, c) for c in self.plans) if p is not None]
        return [p for k, p in enumerate(picks) if p not in picks[:k]], self.found


def starting_plans(graph: Graph, topo: Topology, space: str = "join") -> list[Plan]:
    """The plans a solve starts from and recombines (greedy, one dim split everywhere, the
    baselines, two-level), as plans: for tests and for looking at what the search begins with."""
    setup = _Setup(graph, topo, min(d.memory for d in topo.devices), space)
    return [_plan(graph, topo, setup.options, c, space) for _, c in setup.starts]


def raise_infeasible(solution: Solution, space: str) -> None:
    """The error for a solve where nothing fits, once the exact check agrees."""
    _infeasible(solution.infeasible, space)


def _infeasible(message: str, space: str) -> None:
    raise EdlError(
        message,
        help="give each device more memory (--memory), use more devices, shrink the dims"
        + (", or search the join space (--space join)" if space == "mesh" else ""),
    )


def _no_fit(graph: Graph, n: int, limit: int, space: str) -> str:
    """Why no plan fits in ``limit`` bytes per device: the floor every plan pays."""
    need, top = least_bytes(graph, n)
    heavy = ", ".join(f"{name} {_fmt(b)}" for name, b in top[:3])
    where = "" if space == "join" else " in the mesh space (even splits that divide the extents)"
    return (
        f"no plan{where} fits in {_fmt(limit)} per device: any plan needs at least {_fmt(need)} per device "
        f"for inputs and params split {n} ways ({heavy}), plus live activations"
    )


def _fmt(nbytes: int) -> str:
    return f"{human(nbytes)}B"


def _prune(opts: list[Option]) -> tuple[list[Option], dict[Tile, int]]:
    """Drop candidates no better than another in every respect: the same output layout and the
    same needs, but more time or more memory.  Also says which kept option stands for each tile."""
    best: dict[tuple[object, ...], Option] = {}
    for o in opts:
        key = (o.held, o.needs, o.shares)
        cur = best.get(key)
        if cur is None or (o.compute + o.reduce, o.out_bytes) < (cur.compute + cur.reduce, cur.out_bytes):
            best[key] = o
    kept = list(best.values())
    where = {id(o): k for k, o in enumerate(kept)}
    # Baselines name tiles only (their partials reduce along the longest axis).
    return kept, {
        o.layout.tile: where[id(best[(o.held, o.needs, o.shares)])] for o in opts if o.cand.reduce_axis is None
    }


class Model:
    """The pseudo-Boolean encoding of one solve, written as SMT-LIB for its own Z3 context (far
    faster than building thousands of terms through the Python API).

    Weights are integers in units chosen per model: nanoseconds and kilobytes for small
    programs, coarser where the weights of one constraint would sum past :data:`PB_RANGE` (Z3's
    pseudo-Boolean sums wrap around at 2**31, and a sequence of 10**9 tokens costs seconds and
    terabytes).  Relative precision is then what it is at any size, and the search as fast."""

    def __init__(
        self, graph: Graph, costs: Costs, options: dict[str, list[Option]], memory: int, deadline: float = math.inf
    ) -> None:
        self.graph, self.costs, self.options, self.memory_limit = graph, costs, options, memory
        self.deadline = deadline  # building the model past it raises _OutOfTime (costing transfers is most of it)
        self.x = {name: [f"x{k}_{i}" for i in range(len(opts))] for k, (name, opts) in enumerate(options.items())}
        self.names: list[str] = [v for xs in self.x.values() for v in xs]
        self.terms: list[tuple[str, int]] = []  # objective: (literal, weight in units of ``unit_ns``)
        self.asserts: list[str] = []
        self.held: dict[str, dict[Held, str]] = {}
        self.need: dict[str, dict[tuple[Need, float], str]] = {}  # per relation: (need, share) -> class
        self.step_terms: list[list[_Term]] = []
        self._layouts: dict[tuple[str, int], Held] = {}
        # What a pick implies, by literal: its own, its needs' classes and its output's layout
        # class; and each layout class's transfers (need class, ns).  cost() and memory() read
        # these rather than hashing layouts.
        self.implied: dict[str, list[str]] = {v: [v] for v in self.names}
        self.always: list[str] = []  # the outputs' final placements
        self.pairs: dict[str, list[tuple[str, int]]] = {}
        self.unit_ns = 1.0  # nanoseconds per unit of the objective (set by _encode)
        self.unit_bytes = KB  # bytes per unit of the memory constraints (set by _memory)
        self._encode()
        self.decls = "".join(f"(declare-const {v} Bool)" for v in self.names)
        self.objective = (" ".join(str(ns) for _, ns in self.terms), " ".join(v for v, _ in self.terms))

    def _fresh(self, prefix: str) -> str:
        name = f"{prefix}{len(self.names)}"
        self.names.append(name)
        return name

    def _class(self, classes: dict[Any, str], key: Held | tuple[Need, float], prefix: str) -> str:
        """The literal standing for one layout or need class (made on first use)."""
        lit = classes.get(key)
        if lit is None:
            lit = classes[key] = self._fresh(prefix)
        return lit

    # -- encoding -----------------------------------------------------------------------------------

    def _encode(self) -> None:
        g = self.graph
        seconds: list[tuple[str, float]] = []  # the objective's terms, before choosing its unit
        for name, opts in self.options.items():
            xs = self.x[name]
            self.asserts.append(f"((_ pbeq 1 {' '.join('1' for _ in xs)}) {' '.join(xs)})")
            seconds.extend((v, o.compute + o.reduce) for v, o in zip(xs, opts, strict=True))
        self._tie_producers()
        for rel in g.relations:
            if rel.kind == "derived":
                first = g.producers(rel.name)[0]
                classes = self.held.setdefault(rel.name, {})
                for k, v in enumerate(self.x[first.name]):
                    lit = self._class(classes, self.held_of(rel.name, k), "h")
                    self.asserts.append(f"(=> {v} {lit})")
                    self.implied[v].append(lit)
        for node in g.nodes:
            for v, o in zip(self.x[node.name], self.options[node.name], strict=True):
                for (acc, need), share in zip(o.needs, o.shares, strict=True):
                    lit = self._class(self.need.setdefault(acc.relation, {}), (need, share), "n")
                    self.asserts.append(f"(=> {v} {lit})")
                    self.implied[v].append(lit)
        for name, need in self.costs.replicated_need.items():
            lit = self._class(self.need.setdefault(name, {}), (need, 1.0), "n")
            self.asserts.append(lit)
            self.always.append(lit)
        # Transfers: a (layout, need) pair that both hold costs its transfer.
        pairs: list[tuple[str, str, str, float]] = []  # layout class, need class, literal, seconds
        for rel_name, helds in self.held.items():
            needs = list(self.need.get(rel_name, {}).items())
            for held, h in helds.items():
                if time.monotonic() > self.deadline:
                    raise _OutOfTime
                times = self.costs.transfers(
                    rel_name, held, [need for (need, _), _ in needs], [s for (_, s), _ in needs]
                )
                for (_, lit), sec in zip(needs, times, strict=True):
                    if sec > 0:
                        y = self._fresh("y")
                        self.asserts.append(f"(or (not {h}) (not {lit}) {y})")
                        pairs.append((h, lit, y, sec))
        total = sum(math.ceil(sec * NS) for _, sec in seconds) + sum(math.ceil(sec * NS) for *_, sec in pairs)
        self.unit_ns = max(1.0, total / PB_RANGE)
        self.terms = [(v, self._weight(sec)) for v, sec in seconds]
        for h, lit, y, sec in pairs:
            self.terms.append((y, self._weight(sec)))
            self.pairs.setdefault(h, []).append((lit, self._weight(sec)))
        self._memory()

    def _weight(self, seconds: float) -> int:
        """A time in the objective's units, rounded up."""
        return math.ceil(seconds * NS / self.unit_ns)

    def ms(self, weight: float) -> float:
        """Objective units in milliseconds."""
        return weight * self.unit_ns / NS * 1e3

    def held_of(self, relation: str, k: int) -> Held:
        """The layout of a relation when its (first) producer picks candidate ``k``: tied
        producers each contribute their blocks; an untied one is left out of the estimate.
        Built once per (relation, k): transfer costs are cached by the layout's identity."""
        hit = self._layouts.get((relation, k))
        if hit is None:
            boxes: dict[int, list[Box]] = {}
            producers = self.graph.producers(relation)
            for p in producers if self.tied.get(relation) else producers[:1]:
                for d, bs in self.options[p.name][k].held:
                    boxes.setdefault(d, []).extend(bs)
            hit = self._layouts[(relation, k)] = tuple((d, tuple(bs)) for d, bs in sorted(boxes.items()))
        return hit

    def _tie_producers(self) -> None:
        """Rules that write one relation ('=' pieces, rotary halves) pick the same partition when
        they have the same candidates, so the relation has one layout.  Rules over different join
        spaces choose freely; the relation's layout is then estimated from its first rule."""
        self.tied: dict[str, bool] = {}
        for rel in self.graph.relations:
            producers = self.graph.producers(rel.name) if rel.kind == "derived" else ()
            if len(producers) < 2:
                continue
            first = self.options[producers[0].name]
            same = all([o.cand for o in self.options[p.name]] == [o.cand for o in first] for p in producers[1:])
            self.tied[rel.name] = same
            if same:
                for p in producers[1:]:
                    self.asserts.extend(
                        f"(= {u} {v})" for u, v in zip(self.x[producers[0].name], self.x[p.name], strict=True)
                    )

    def _memory(self) -> None:
        """At every step (node order), resident inputs and params plus the live relations fit.
        Terms are bytes until the unit is known: the finest that keeps every step's sum in range."""
        g = self.graph
        order = {node.name: k for k, node in enumerate(g.nodes)}
        resident: list[_Term] = []
        for rel in g.relations:
            if rel.kind != "derived":
                item = self.costs.itemsize(rel.name)
                for (need, _), lit in self.need.get(rel.name, {}).items():  # rows that came, in place
                    resident.append((lit, need_bytes(need, item)))
        last = {rel.name: -1 for rel in g.relations}
        for node in g.nodes:
            for acc in node.inputs:
                last[acc.relation] = max(last[acc.relation], order[node.name])
        for out in g.outputs:
            last[out] = len(g.nodes) - 1
        for t, node in enumerate(g.nodes):
            live = list(resident)
            for rel_name, helds in self.held.items():
                born = min(order[p.name] for p in g.producers(rel_name))
                if born < t <= last[rel_name]:
                    item = self.costs.itemsize(rel_name)
                    live.extend((lit, held_bytes(held, item)) for held, lit in helds.items())
            for v, o in zip(self.x[node.name], self.options[node.name], strict=True):
                received = sum(b for r, b in o.in_bytes.items() if g.relation(r).kind == "derived")
                live.append((v, o.out_bytes + received))
            self.step_terms.append(live)
        most = max((sum(b for _, b in live) for live in self.step_terms), default=0)
        self.unit_bytes = max(KB, math.ceil(most / PB_RANGE))
        self.step_terms = [[(v, -(-b // self.unit_bytes)) for v, b in live] for live in self.step_terms]
        for live in self.step_terms:
            # A cap above every term's sum holds anyway; clamped, it stays in Z3's range.
            cap = min(self.memory_limit // self.unit_bytes, sum(w for _, w in live))
            self.asserts.append(f"((_ pble {cap} {' '.join(str(w) for _, w in live)}) {' '.join(v for v, _ in live)})")

    # -- search ---------------------------------------------------------------------------------------

    def search(
        self,
        start: float,
        time_limit: float,
        seed: int,
        warm: dict[str, int] | None,
        on_progress: Callable[[Progress], None] | None,
        pool: Sequence[dict[str, int]] = (),
        mix: bool = True,
    ) -> tuple[dict[str, int] | None, float, bool, int, list[dict[str, int]]]:
        """Improve on ``warm``, in phases:

        1. the best mix of the plans in ``pool`` (each node may take any pick one of them
           makes: Z3 recombines, say, one plan's attention with another's MLP);
        2. large-neighbourhood search: one neighbourhood of nodes freed at a time, the rest
           fixed at the best so far;
        3. the whole space at once, where "unsat" proves the best optimal within :data:`STEP`.

        Also returns the best plan the first phase ended with: the estimate adds up what the
        timeline overlaps, so an earlier phase's best can be the faster one there."""
        ctx = z3.Context()
        s = z3.Solver(ctx=ctx)
        s.set("random_seed", seed)
        s.from_string(self.decls + "".join(f"(assert {a})" for a in self.asserts))
        xs = {name: [z3.Bool(v, ctx) for v in lits] for name, lits in self.x.items()}
        run = _Run(self, s, xs, start, time_limit, on_progress)
        if warm is not None and self.memory(warm) <= self.memory_limit:
            run.offer(warm)
            for name, i in warm.items():
                for k, v in enumerate(xs[name]):
                    s.set_initial_value(v, k == i)
            if run.at_bound():  # the start is at the lower bound already
                return run.best, run.bound, True, 0, []
        ended: list[dict[str, int]] = []
        if mix and len(pool) > 1 and run.left() > 0:
            allowed = {name: {c[name] for c in pool if name in c} for name in self.x}
            mixes = [z3.Not(v) for name, vs in xs.items() for k, v in enumerate(vs) if k not in allowed[name]]
            run.whole(mixes, time.monotonic() + MIX_SECONDS)
            if run.best is not None:
                ended.append(run.best)
        optimal = run.at_bound()
        if not optimal and run.left() > 0:
            hoods = self.neighbourhoods()
            others = [c for c in sorted(pool, key=self.cost) if c != run.best and self.memory(c) <= self.memory_limit]
            others = [c for k, c in enumerate(others) if c not in others[:k]][:POLISHED]
            if run.best is not None:
                run.lns(hoods, time.monotonic() + BEST_SHARE * run.left() if others else math.inf)
            ended += self._polish(run, others, hoods)
            optimal = run.at_bound() or run.whole([], math.inf) == z3.unsat
        if optimal and run.best_cost is not None:
            run.bound = max(run.bound, min(run.best_cost, run.best_cost * (1 - STEP)))
        return run.best, run.bound, optimal and run.best is not None, run.found, ended

    def _polish(self, run: _Run, others: list[dict[str, int]], hoods: list[set[str]]) -> list[dict[str, int]]:
        """Each of ``others`` improved by large-neighbourhood search of its own, in a solver
        scope of its own (its bounds are its own), for an equal share of :data:`POLISH_SHARE`
        of the time left; those improved.  The estimate adds up what the timeline overlaps, so
        it ranks different structures (a sequence split across groups against Megatron) less
        well than it ranks a structure's variants: the next best starts, polished, are worth
        checking in the timeline beside the best."""
        out = []
        for k, other in enumerate(others):
            seconds = POLISH_SHARE * run.left() / (len(others) - k)
            if seconds <= 0:
                break
            sub = _Run(self, run.s, run.xs, run.start, run.time_limit, None, run.bound)  # shows the best only
            run.s.push()
            sub.offer(other)
            sub.lns(hoods, time.monotonic() + seconds)
            run.s.pop()
            run.found += sub.found
            if sub.best is not None and sub.best != other:
                out.append(sub.best)
                run.offer(sub.best)
        return out

    def neighbourhoods(self) -> list[set[str]]:
        """The sets of nodes large-neighbourhood search frees at a time, the rest fixed: each
        node with the nodes that make what it reads and the nodes that read what it makes (a
        layout change pays off only when producer and readers change with it: q, k and v with
        the norm they read, attention's scores with the rotations before and the softmax
        after), then windows of :data:`WINDOW` consecutive nodes, overlapping by half."""
        names = list(self.x)
        makers = {n.out: n.name for n in self.graph.nodes}
        readers: dict[str, set[str]] = {}
        for n in self.graph.nodes:
            for acc in n.inputs:
                if acc.relation in makers:
                    readers.setdefault(makers[acc.relation], set()).add(n.name)
        hoods: list[set[str]] = []
        for n in self.graph.nodes:
            hood = {n.name, *readers.get(n.name, ()), *(makers[a.relation] for a in n.inputs if a.relation in makers)}
            if len(hood) > 1 and hood not in hoods:
                hoods.append(hood)
        for k in range(0, len(names), max(1, WINDOW // 2)):
            window = {names[(k + j) % len(names)] for j in range(WINDOW)}
            if window not in hoods:
                hoods.append(window)
        return hoods

    def floor(self) -> float:
        """A lower bound: every node at its cheapest candidate, no transfers."""
        return float(sum(min(self._weight(o.compute + o.reduce) for o in opts) for opts in self.options.values()))

    def _true(self, choice: dict[str, int]) -> set[str]:
        """The literals a choice makes true: its picks, their needs and layouts."""
        out = set(self.always)
        for name, i in choice.items():
            out.update(self.implied[self.x[name][i]])
        return out

    def cost(self, choice: dict[str, int]) -> int:
        """The objective of a choice, in its units (:meth:`ms`), computed directly (not by Z3)."""
        total = sum(self._weight(self.options[n][i].compute + self.options[n][i].reduce) for n, i in choice.items())
        true = self._true(choice)
        return total + sum(ns for h in true if h in self.pairs for lit, ns in self.pairs[h] if lit in true)

    def memory(self, choice: dict[str, int]) -> int:
        """The estimated peak bytes of one device under a choice."""
        true = self._true(choice)
        most = max((sum(w for lit, w in live if lit in true) for live in self.step_terms), default=0)
        return most * self.unit_bytes


class _Run:
    """One incumbent of :meth:`Model.search` and the ways to improve it: each model Z3 finds
    must beat the incumbent by :data:`STEP` under the estimate (a bound asserted in the
    solver's current scope)."""

    def __init__(
        self,
        model: Model,
        solver: z3.Solver,
        xs: dict[str, list[z3.BoolRef]],
        start: float,
        time_limit: float,
        on_progress: Callable[[Progress], None] | None,
        bound: float | None = None,
    ) -> None:
        self.model, self.s, self.xs = model, solver, xs
        self.start, self.time_limit, self.on_progress = start, time_limit, on_progress
        self.bound = model.floor() if bound is None else bound
        self.best: dict[str, int] | None = None
        self.best_cost: int | None = None
        self.found = 0  # improving plans found

    def left(self) -> float:
        """Seconds of search left, keeping a little of the budget for turning the answer into a plan."""
        return self.time_limit * 0.9 - 0.5 - (time.monotonic() - self.start)

    def at_bound(self) -> bool:
        return self.best_cost is not None and self.best_cost <= self.bound

    def offer(self, choice: dict[str, int]) -> None:
        """Take ``choice`` as the incumbent if it is cheaper, and bound the search below it."""
        cost = self.model.cost(choice)
        if self.best_cost is not None and cost >= self.best_cost:
            return
        self.best, self.best_cost = choice, cost
        weights, lits = self.model.objective
        cap = max(0, int(cost * (1 - STEP)) - 1)
        self.s.from_string(f"(assert ((_ pble {cap} {weights}) {lits}))")

    def _check(self, assumptions: list[z3.BoolRef], seconds: float) -> z3.CheckSatResult:
        if self.on_progress is not None:
            best_ms = self.model.ms(self.best_cost) if self.best_cost is not None else None
            self.on_progress(Progress(time.monotonic() - self.start, best_ms, self.model.ms(self.bound), self.found))
        self.s.set("timeout", max(1, int(seconds * 1000)))
        result = self.s.check(*assumptions)
        if result == z3.sat:
            m = self.s.model()
            choice = {
                name: next(i for i, v in enumerate(vs) if z3.is_true(m.eval(v, model_completion=True)))
                for name, vs in self.xs.items()
            }
            self.found += 1
            self.offer(choice)
        return result

    def whole(self, restrict: list[z3.BoolRef], until: float) -> z3.CheckSatResult:
        """Improve within ``restrict`` alone until "unsat" (nothing better there), the time is
        up or the lower bound is reached; the last result."""
        result = z3.unknown
        while not self.at_bound():
            seconds = min(self.left(), until - time.monotonic())
            if seconds <= 0:
                return z3.unknown
            result = self._check(restrict, seconds)
            if result != z3.sat:
                return result
        return result

    def lns(self, hoods: list[set[str]], until: float) -> bool:
        """Large-neighbourhood search: free one neighbourhood at a time, the rest fixed at the
        incumbent, until every neighbourhood in a row has nothing better, the time is up or the
        lower bound is reached.  Whether the neighbourhoods ran out (rather than the time)."""
        quiet, k = 0, 0
        while self.best is not None and quiet < len(hoods) and not self.at_bound():
            seconds = min(self.left(), until - time.monotonic(), WINDOW_SECONDS)
            if seconds <= 0:
                return False
            free = hoods[k % len(hoods)]
            fixed = [self.xs[n][i] for n, i in self.best.items() if n not in free]
            if self._check(fixed, seconds) == z3.sat:
                quiet = 0
            else:
                k += 1
                quiet += 1
        return True


class Neighbours:
    """Plans next to a plan, for a search in the exact timeline (the caller's: the solver never
    runs it): the estimate adds up what the timeline overlaps, so the plan it ranks first is not
    always the fastest there, while its ranking of a plan's close variants is good.  Two kinds
    of neighbour: :meth:`moves`, every plan one pick away, ranked by the estimate; and
    :meth:`propose`, Z3's best plan that differs from a plan only in one neighbourhood of
    nodes, within ``slack`` of it by the estimate."""

    def __init__(
        self, graph: Graph, topo: Topology, model: Model, options: dict[str, list[Option]], space: str, seed: int
    ) -> None:
        self.graph, self.topo, self.model, self.options = graph, topo, model, options
        self.space, self.seed = space, seed
        self._solver: z3.Solver | None = None
        self._xs: dict[str, list[z3.BoolRef]] = {}

    def hoods(self, choice: dict[str, int]) -> list[set[str]]:
        """The model's neighbourhoods, those where ``choice`` spends the most first (by the
        estimate: compute, reductions, and what its nodes' inputs take to arrive)."""
        m = self.model
        true = m._true(choice)
        spent = {n: m._weight(m.options[n][i].compute + m.options[n][i].reduce) for n, i in choice.items()}
        for node in self.graph.nodes:
            o = m.options[node.name][choice[node.name]]
            for (acc, need), share in zip(o.needs, o.shares, strict=True):
                lit = m.need.get(acc.relation, {}).get((need, share))
                producers = self.graph.producers(acc.relation)
                if lit is None or not producers:
                    continue
                held = m.held_of(acc.relation, choice[producers[0].name])
                h = m.held.get(acc.relation, {}).get(held)
                if h is not None and h in true:
                    spent[node.name] += sum(w for need_lit, w in m.pairs.get(h, []) if need_lit == lit)
        return sorted(m.neighbourhoods(), key=lambda hood: -sum(spent[n] for n in hood))

    def moves(self, choice: dict[str, int], slack: float) -> list[dict[str, int]]:
        """Every plan that differs from ``choice`` in one node's pick (and the picks tied to it),
        that the estimate puts at most ``slack`` times ``choice``'s and within the memory limit
        (by the estimate, with :data:`MEMORY_SLACK`: the timeline's check is exact), the
        cheapest by the estimate first.  No Z3: the estimate of a choice is a sum over its
        picks.  These are the search's cheapest moves in the timeline; a pick the estimate
        rates the same (where a rotary table is computed, how a norm is replicated) can still
        change what the timeline overlaps."""
        m = self.model
        cap = m.cost(choice) * slack
        memory = m.memory_limit * MEMORY_SLACK
        ranked: list[tuple[int, int, dict[str, int]]] = []
        for group in self._groups():
            for i in range(len(m.options[group[0]])):
                if i == choice[group[0]]:
                    continue
                new = dict(choice)
                new.update(dict.fromkeys(group, i))
                cost = m.cost(new)
                if cost <= cap and m.memory(new) <= memory:
                    ranked.append((cost, len(ranked), new))
        ranked.sort(key=lambda t: (t[0], t[1]))
        return [new for *_, new in ranked]

    def _groups(self) -> list[tuple[str, ...]]:
        """The nodes whose picks move together: the producers of one relation that the model
        ties (:meth:`Model._tie_producers`), else each node alone."""
        tied: dict[str, tuple[str, ...]] = {}
        for rel, same in self.model.tied.items():
            if same:
                names = tuple(p.name for p in self.graph.producers(rel))
                tied.update(dict.fromkeys(names, names))
        groups = [tied.get(name, (name,)) for name in self.model.x]
        return [g for k, g in enumerate(groups) if g not in groups[:k]]

    def plan(self, choice: dict[str, int]) -> Plan:
        return _plan(self.graph, self.topo, self.options, choice, self.space)

    def propose(self, choice: dict[str, int], hood: set[str], slack: float, seconds: float) -> dict[str, int] | None:
        """The plan the estimate puts fastest among those that differ from ``choice`` in ``hood``
        only, and there in at least one node, that fit, that the estimate puts at most ``slack``
        times ``choice``'s, and that were never proposed before (the caller checks each once);
        None when there is none or Z3 finds none in ``seconds``.  Z3 is asked again under a
        tighter bound while time is left: the first plan it finds is an arbitrary one, the
        estimate's best in a neighbourhood its closest rival there."""
        until = time.monotonic() + seconds
        s = self._ensure()
        x = self.model.x
        weights, lits = self.model.objective
        differ = " ".join(f"(not {x[n][choice[n]]})" for n in sorted(hood))
        fixed = [self._xs[n][i] for n, i in choice.items() if n not in hood]
        cap = int(self.model.cost(choice) * slack)
        best: dict[str, int] | None = None
        s.push()
        try:
            s.from_string(f"(assert (or {differ}))")
            while (left := until - time.monotonic()) > 0:
                s.push()
                s.from_string(f"(assert ((_ pble {cap} {weights}) {lits}))")
                s.set("timeout", max(1, int(left * 1000)))
                found = s.check(*fixed) == z3.sat
                if found:
                    m = s.model()
                    best = {
                        name: next(i for i, v in enumerate(vs) if z3.is_true(m.eval(v, model_completion=True)))
                        for name, vs in self._xs.items()
                    }
                s.pop()
                if not found:
                    break
                assert best is not None
                cap = self.model.cost(best) - 1
        finally:
            s.pop()
        if best is not None:  # never proposed again
            s.from_string(f"(assert (not (and {' '.join(x[n][i] for n, i in sorted(best.items()))})))")
        return best

    def _ensure(self) -> z3.Solver:
        if self._solver is None:
            ctx = z3.Context()
            self._solver = z3.Solver(ctx=ctx)
            self._solver.set("random_seed", self.seed)
            self._solver.from_string(self.model.decls + "".join(f"(assert {a})" for a in self.model.asserts))
            self._xs = {name: [z3.Bool(v, ctx) for v in lits] for name, lits in self.model.x.items()}
        return self._solver


def _plan(graph: Graph, topo: Topology, options: dict[str, list[Option]], choice: dict[str, int], space: str) -> Plan:
    tiles = {name: options[name][i].layout.tile for name, i in choice.items()}
    axes = {name: options[name][i].cand.reduce_axis for name, i in choice.items()}
    return plan_of(graph, topo, "auto" if space == "join" else "mesh", tiles, reduce_axes=axes)
