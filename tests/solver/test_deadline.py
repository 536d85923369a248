"""One deadline for a whole solved plan: the solver, the timeline checks of its shortlist and the
refinements share ``time_limit``, report where the time went, and name their phase as they go.
No test here measures a duration against a bound: they check what the phases did."""

from __future__ import annotations

import itertools

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


def test_a_spent_deadline_still_returns_the_solvers_plan_checked() -> None:
    """With a limit far below what building the model takes, the solver returns its best start
    unsearched, that plan alone is checked (a plan is never returned unchecked, nor nothing), and
    the rest of the shortlist and every refinement are skipped."""
    plan = edatalog.plan(_prog(), topology="a100x4", time_limit=1e-3)
    sol = plan.solution
    assert sol is not None and sol.plans_found == 0
    assert len(sol.shortlist) > 1 and sol.unchecked == len(sol.shortlist) - 1
    assert plan.ir == sol.shortlist[0] and sol.chosen_by == "solver" and sol.refined == ""
    assert sol.refine_seconds == 0.0 and not plan.over_memory()
    assert sol.total_seconds >= sol.seconds + sol.check_seconds
