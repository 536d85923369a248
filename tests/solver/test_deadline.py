"""One deadline for a whole solved plan: the solver, the timeline checks of its shortlist and the
refinements share ``time_limit``, report where the time went, and name their phase as they go.
No test here measures a duration against a bound: they check what the phases did."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

import edatalog
from edatalog.solver import auto
from edatalog.solver import topology as machines
from tests.solver.test_scale import FLAT, NORM_PROJECT


def _prog(seq: int = 64) -> edatalog.Program:
    return edatalog.compile_string(NORM_PROJECT, dims={"S": seq})


def test_progress_names_every_phase_in_order() -> None:
    shown: list[auto.Progress] = []
    plan = edatalog.plan(_prog(), topology=machines.from_dict(FLAT), time_limit=10.0, on_progress=shown.append)
    sol = plan.solution
    assert sol is not None
    phases = [p.phase for p in shown]
    assert phases[0] == "building" and "solving" in phases and "checking" in phases
    order = [auto.PHASES.index(p) for p in phases]
    assert order == sorted(order), phases  # building, solving, checking, refining: never back
    assert all(p.elapsed <= q.elapsed for p, q in itertools.pairwise(shown))
    checked = [p.checked_ms for p in shown if p.checked_ms is not None]
    assert checked and checked == sorted(checked, reverse=True)  # the fastest checked only improves
    assert checked[-1] == pytest.approx(plan.report.seconds * 1e3)
    # The summary says where the time went, and the parts add up to no more than the whole.
    s = plan.summary()
    assert s["solve_seconds"] == pytest.approx(s["build_seconds"] + s["search_seconds"])
    assert s["solve_seconds"] + s["check_seconds"] + s["refine_seconds"] <= s["plan_seconds"]
    assert s["unchecked"] == 0 and sol.solves == 1


def test_a_spent_deadline_still_returns_a_plan_checked() -> None:
    """With a limit far below what building the model takes, building stops at once and the
    baselines as built are the shortlist, unsearched: the first alone is checked (a plan is never
    returned unchecked, nor nothing), and the rest and every refinement are skipped."""
    plan = edatalog.plan(_prog(), topology="a100x4", time_limit=1e-3)
    sol = plan.solution
    assert sol is not None and sol.plans_found == 0 and not sol.searched
    assert sol.shortlist and sol.unchecked == len(sol.shortlist) - 1
    assert all(o.startswith("baseline: ") for o in sol.origins)
    assert plan.ir == sol.shortlist[0] and sol.chosen_by == "solver" and sol.refined == ""
    assert sol.refine_seconds == 0.0 and not plan.over_memory()
    assert sol.total_seconds >= sol.seconds + sol.check_seconds


def test_edl_plan_gives_the_solver_what_the_command_has_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """``edl plan --time-limit T`` is what the user waits for: the auto plan gets T less what the
    command has already spent (start-up, compiling, the megatron comparison) and less a moment
    for printing."""
    from edatalog.cli import common, main
    from edatalog.cli import plans as cli_plans

    asked: list[float] = []
    from edatalog.plans import make_plan

    def spy(*args: object, **kwargs: object) -> edatalog.Plan:
        if len(args) < 3 or args[2] == "auto":
            asked.append(float(kwargs["time_limit"]))  # type: ignore[arg-type]
        return make_plan(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cli_plans, "make_plan", spy)
    monkeypatch.setattr(cli_plans, "seconds_since_start", lambda: 3.0)
    program = str(Path(__file__).resolve().parents[2] / "programs" / "mlp.edl")
    assert (
        main(["plan", program, "--dim", "B=4", "--dim", "D=8", "--dim", "F=16", "-t", "a100x2", "--time-limit", "4"])
        == 0
    )
    assert asked == [pytest.approx(4 - 3.0 - cli_plans.OUTPUT_SECONDS)]
    # A process started for the command counts its start-up; an older one (a notebook) does not.
    monkeypatch.setattr(common, "_process_age", lambda: 0.7)
    common.command_began()
    assert common.seconds_since_start() >= 0.7
    monkeypatch.setattr(common, "_process_age", lambda: 100.0)
    common.command_began()
    assert common.seconds_since_start() < 0.7


def test_building_the_model_stops_at_the_deadline_while_it_costs_transfers() -> None:
    """Costing the transfers between every producer's layouts and every reader's needs is most of
    building a model on many devices (minutes on 64 GPUs): it stops once the deadline has passed,
    so that the solve returns the baselines within its time limit instead."""
    from edatalog.solver.blocks import Layout, candidates, dim_order
    from edatalog.solver.costs import Costs

    prog = _prog()
    topo = machines.preset("h100x8x2")
    costs = Costs(prog.graph, topo)
    rank = dim_order(prog.graph)
    options = {
        node.name: [costs.option(node, Layout(node, c, rank)) for c in candidates(node, topo.n)][:4]
        for node in prog.graph.nodes
    }
    auto.Model(prog.graph, costs, options, 1 << 40)  # no deadline: built
    with pytest.raises(auto._OutOfTime):
        auto.Model(prog.graph, costs, options, 1 << 40, deadline=0.0)
