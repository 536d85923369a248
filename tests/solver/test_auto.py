"""The placement solver (``strategy="auto"``): its plans compute exactly what the program says,
fit the memory they are given, respect their search space, and the solver reports honestly.

Small dims everywhere, and solves of at most 2 s.  At such dims every kernel costs the machine's
kernel floor (5 us), so on the presets the fastest plan is to replicate everything, which checks
little.  Most tests therefore use :func:`_slow`: the preset's devices, nodes and links, with
compute and memory bandwidth 10^4 times slower and no kernel floor, so that a block of a 4-token
LLaMA block weighs what it would in a real model and the solver splits the rules.

Bugs these tests found are kept as regression tests, each saying what it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import io
import itertools
import json
import math
import re
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import edatalog
from edatalog import EdlError
from edatalog.backend.lowering.exchange import synthesize
from edatalog.backend.lowering.lowered import lower
from edatalog.backend.predicting.timeline import analyze
from edatalog.cli import main
from edatalog.solver import auto, policy
from edatalog.solver.topology import Topology, preset
from tests.strategies import GeneratedProgram, example_settings, programs

ROOT = Path(__file__).resolve().parents[2]
LLAMA_PATH = ROOT / "programs" / "llama_block.edl"
LLAMA = LLAMA_PATH.read_text()

# LLaMA-shaped: 4 query heads share 2 key/value heads (G = 2), E = D / H = 8.
SMALL = (("B", 1), ("S", 4), ("D", 32), ("H", 4), ("KVH", 2), ("F", 48))
# Qwen2-shaped: 14 query heads share 2 key/value heads (G = 7), E = 8: 14 heads do not divide 3,
# 6 or 8 devices.  And 6 heads sharing 3 (G = 2) on 4 devices: neither count divides 4.
QWEN14 = (("B", 1), ("S", 4), ("D", 112), ("H", 14), ("KVH", 2), ("F", 48))
QWEN6 = (("B", 1), ("S", 4), ("D", 48), ("H", 6), ("KVH", 3), ("F", 48))
SMALL_ARGS = ["--dim", "S=4", "--dim", "D=32", "--dim", "H=4", "--dim", "KVH=2", "--dim", "F=48"]
RTOL, ATOL = 1e-9, 1e-12


@functools.cache
def _llama(dims: tuple[tuple[str, int], ...]) -> edatalog.Program:
    """The LLaMA block at ``dims``, every relation f64 (so plans must match the reference to
    rounding)."""
    return edatalog.compile_string(LLAMA.replace(": f32", ": f64"), name="llama_block.edl", dims=dict(dims))


@functools.cache
def _slow(name: str, factor: float = 1e4) -> Topology:
    """The preset ``name`` with compute and memory bandwidth ``factor`` times slower and no
    kernel floor (links unchanged)."""
    machine = preset(name)
    devices = tuple(
        dataclasses.replace(d, flops=d.flops / factor, bandwidth=d.bandwidth / factor) for d in machine.devices
    )
    return dataclasses.replace(machine, name=f"slow-{name}", devices=devices, kernel_floor=0.0)


def _machine(name: str, slow: bool) -> Topology:
    return _slow(name) if slow else preset(name)


@functools.cache
def _solved(
    dims: tuple[tuple[str, int], ...],
    topology: str,
    slow: bool = True,
    time_limit: float | None = None,
    space: str = "join",
    memory: int | None = None,
) -> edatalog.Plan:
    """A solved plan, made once per arguments for the whole module.  The time limit must cover
    building the model (a second or two on 8 devices on a 2-core machine, whatever the dims)
    with room to search: by default half a second per device."""
    machine = _machine(topology, slow)
    limit = time_limit if time_limit is not None else max(1.0, 0.5 * machine.n)
    return edatalog.plan(_llama(dims), topology=machine, time_limit=limit, space=space, memory=memory)


def _assert_runs_exactly(prog: edatalog.Program, plan: edatalog.Plan, seed: int = 0) -> None:
    """The plan's simulated outputs equal the reference evaluator's."""
    values = prog.prepare(prog.random_inputs(seed))
    want = prog.evaluate(values)
    got = plan.execute(values)
    for name in prog.outputs:
        np.testing.assert_allclose(got[name], want[name].data, rtol=RTOL, atol=ATOL, err_msg=name)


def _assert_sane_solution(sol: auto.Solution | None) -> auto.Solution:
    assert sol is not None, "a solved plan carries its Solution"
    if not sol.searched:  # a busy machine: building took the time, the baselines were checked instead
        assert sol.origins and all(o.startswith("baseline: ") for o in sol.origins), sol.origins
        return sol
    assert 0 <= sol.lower_bound_ms <= sol.predicted_ms
    assert 0.0 <= sol.gap <= 1.0
    assert sol.memory_estimate >= 0  # 0 when nothing is computed
    return sol


def _splits_something(plan: edatalog.Plan) -> bool:
    return any(n.tile.n_blocks > 1 for n in plan.ir.nodes)


# -- a. solved plans compute what the program says ---------------------------------------------------


@pytest.mark.parametrize("topology", ["a100x1", "a100x2", "a100x3", "a100x4", "a100x6", "a100x8", "2x4"])
def test_llama_block_solved_plans_equal_the_reference(topology: str) -> None:
    plan = _solved(SMALL, topology)
    assert plan.ir.strategy == "auto"
    _assert_sane_solution(plan.solution)
    assert not plan.over_memory()
    if plan.topology.n > 1:
        assert _splits_something(plan), "the solver split nothing: this test would check little"
    _assert_runs_exactly(_llama(SMALL), plan)


@pytest.mark.parametrize("topology", ["a100x1", "a100x4"])
def test_llama_block_on_the_presets_themselves(topology: str) -> None:
    """At these dims the presets' kernel floor makes any split slower than none."""
    plan = _solved(SMALL, topology, slow=False)
    _assert_sane_solution(plan.solution)
    _assert_runs_exactly(_llama(SMALL), plan, seed=1)


@pytest.mark.parametrize(
    ("dims", "topology"),
    [(QWEN14, "a100x8"), (QWEN14, "a100x6"), (QWEN14, "a100x3"), (QWEN6, "a100x4")],
    ids=["h14-kvh2-on-8", "h14-kvh2-on-6", "h14-kvh2-on-3", "h6-kvh3-on-4"],
)
def test_qwen_shaped_heads_that_do_not_divide_the_devices(dims: tuple[tuple[str, int], ...], topology: str) -> None:
    plan = _solved(dims, topology)
    _assert_sane_solution(plan.solution)
    assert _splits_something(plan)
    _assert_runs_exactly(_llama(dims), plan)


@pytest.mark.parametrize("topology", ["a100x8", "a100x6", "2x4"])
def test_every_starting_plan_equals_the_reference(topology: str) -> None:
    """The plans the search starts from and recombines, two-level and zigzag ones among them."""
    dims = tuple({**dict(SMALL), "S": 8}.items())
    prog = _llama(dims)
    plans = auto.starting_plans(prog.graph, preset(topology))
    shapes = {str(p) for p in plans}
    assert len(shapes) >= 8, "too few distinct starts to check much"
    if topology != "a100x6":  # 2 key/value heads on groups of 3: Megatron inside uses 2 of 3, not a candidate
        assert any("s:4" in text and "devices [0," in text for text in shapes), "no zigzag two-level start"
    for ir in plans:
        _assert_runs_exactly(prog, edatalog.Plan(ir, prog.graph, preset(topology)))


# -- b. random programs on 1-8 devices ----------------------------------------------------------------

_SETTINGS = example_settings("EDL_AUTO_EXAMPLES", 60)
_DEVICES = (8, 3, 4, 5, 2, 6, 7, 1)  # several devices first: hypothesis favours the first options


@_SETTINGS
@given(gen=programs(), n=st.sampled_from(_DEVICES), slow=st.booleans(), two_nodes=st.booleans())
def test_random_programs_solved_plans_equal_the_reference(
    gen: GeneratedProgram, n: int, slow: bool, two_nodes: bool
) -> None:
    """Random programs (:mod:`tests.strategies`) on N = 1..8 devices (``2x4`` for some of 8), on
    machines 10^8 times slower than the presets (so that splitting tiny programs pays) or the
    presets themselves.  ``EDL_AUTO_EXAMPLES=500`` runs a longer, random set."""
    name = "2x4" if n == 8 and two_nodes else f"a100x{n}"
    machine = _slow(name, 1e8) if slow else preset(name)
    prog = gen.compile()
    plan = edatalog.plan(prog, topology=machine, time_limit=1.0)  # most end with a proof well before
    _assert_sane_solution(plan.solution)
    values = prog.prepare(gen.inputs)
    want = prog.evaluate(values)
    got = plan.execute(values)
    for out in prog.outputs:
        np.testing.assert_allclose(got[out], want[out].data, rtol=RTOL, atol=ATOL, err_msg=out)


# -- c. memory ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("topology", ["a100x4", "a100x8"])
def test_solved_plans_fit_a_tight_memory(topology: str) -> None:
    """Under 40 KB per device (f64 weights are 66 KB; replicating everything peaks at 68.6 KB), the
    plan must shard, and every device's peak, recomputed from the schedule, fits."""
    limit = 40_000
    # Over the limit replicated (not the unconstrained search's plan: under load, or with more
    # time, it may shard by itself; CI once saw 17 KB).
    replicated = edatalog.plan(_llama(SMALL), topology=_machine(topology, False), strategy="replicate")
    assert max(replicated.report.peak_memory.values()) > limit, "replicating fits: the limit tests nothing"
    plan = _solved(SMALL, topology, slow=False, memory=limit, time_limit=6.0)
    assert all(d.memory == limit for d in plan.topology.devices)
    peak = analyze(lower(synthesize(plan.graph, plan.ir, plan.topology))).peak_memory
    assert set(peak) == set(range(plan.topology.n))
    assert max(peak.values()) <= limit, peak
    assert plan.over_memory() == []
    _assert_runs_exactly(_llama(SMALL), plan)
    # The solver's estimate (a footprint per step, the largest over devices) against the simulated
    # peak.  Measured: 1.19 on a100x4, 1.67 on a100x8 (conservative, never below the peak).
    sol = _assert_sane_solution(plan.solution)
    assert sol.searched, "the model was not built in 6 s: no estimate to compare"
    ratio = sol.memory_estimate / max(peak.values())
    assert 0.5 <= ratio <= 2.0, f"memory estimate {sol.memory_estimate} B, simulated peak {max(peak.values())} B"


def _least_per_device(prog: edatalog.Program, n: int) -> tuple[int, list[str]]:
    """Every input and param split n ways: no plan holds less; and the three largest."""
    sizes = sorted(((math.ceil(r.nbytes / n), r.name) for r in prog.arguments), key=lambda s: -s[0])
    return sum(s for s, _ in sizes), [name for _, name in sizes[:3]]


def test_memory_far_too_small_says_the_least_and_what_dominates(capsys: pytest.CaptureFixture[str]) -> None:
    prog = _llama(SMALL)
    least, top = _least_per_device(prog, 4)
    assert top == ["w_gate", "w_up", "w_down"]
    with pytest.raises(EdlError) as info:
        edatalog.plan(prog, topology="a100x4", memory="1KB", time_limit=1.0)
    message = str(info.value)
    assert "no plan fits in 1KB per device" in message
    assert f"at least {least / 1e3:.3g}KB per device" in message and "split 4 ways" in message  # 15.7KB
    assert "w_gate 3.07KB, w_up 3.07KB, w_down 3.07KB" in message
    assert "--memory" in message  # the help says what to do

    code = main(["plan", str(LLAMA_PATH), *SMALL_ARGS, "-t", "a100x4", "--memory", "1KB", "--time-limit", "1"])
    _, err = capsys.readouterr()
    assert code == 1 and err.startswith("error: no plan fits in 1KB per device") and "Traceback" not in err
    assert "w_gate" in err


# -- e. the mesh space -------------------------------------------------------------------------------


def test_mesh_plans_split_evenly_and_join_plans_beat_them_when_heads_do_not_divide() -> None:
    """4 query heads (2 key/value heads) on 3 devices: a mesh cannot split the heads, the join
    space can (2, 1, 1).  Measured: join 0.38 ms, mesh 0.56 ms.  The join search gets 4 s: at the
    default 1.5 s a loaded CI machine once stopped it at an even split."""
    join = _solved(SMALL, "a100x3", time_limit=4.0)
    mesh = _solved(SMALL, "a100x3", space="mesh")
    assert mesh.ir.strategy == "mesh"
    for node in mesh.ir.nodes:
        for split in node.tile.splits:
            assert split.extent % split.parts == 0, f"{node.node}: {split.index} of {split.extent} in {split.parts}"
            step = split.extent // split.parts
            assert split.cuts == tuple(range(0, split.extent + 1, step)), f"{node.node}: {split}"
    assert any(s.extent % s.parts for n in join.ir.nodes for s in n.tile.splits)  # join uses an uneven split
    _assert_runs_exactly(_llama(SMALL), mesh)
    assert join.report.seconds < mesh.report.seconds, (join.report.seconds, mesh.report.seconds)


def test_mesh_space_goes_with_auto_only(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(EdlError, match="--space"):
        edatalog.plan(_llama(SMALL), topology="a100x2", strategy="megatron", space="mesh")
    code = main(["plan", str(LLAMA_PATH), *SMALL_ARGS, "-t", "a100x2", "--space", "mesh", "-s", "megatron"])
    out, err = capsys.readouterr()
    assert code == 1 and out == "" and err.startswith("error: --space") and "Traceback" not in err


# -- f. how the solver reports ----------------------------------------------------------------------


@pytest.mark.parametrize("topology", ["a100x2", "a100x8"])
def test_the_solver_keeps_to_its_time_limit(topology: str) -> None:
    """The limit covers building and searching.  A build that would take longer (8 devices on
    this slow machine take a second or two) stops at the limit, and the baselines as built are
    returned unsearched for the caller to check."""
    graph, topo = _llama(SMALL).graph, _slow(topology)
    for limit in (0.5, 6.0):
        # A full collection of the suite's heap (a gigabyte by now) can pause this process for
        # seconds (CI once saw a 0.2 s build take 5 s): none runs while the clock does.
        cpu = time.process_time()
        gc.disable()
        try:
            sol = auto.solve(graph, topo, time_limit=limit)
        finally:
            gc.enable()
        cpu = time.process_time() - cpu
        took = f"solved in {sol.seconds:.2f} s (built in {sol.build_seconds:.2f} s, {cpu:.2f} s of CPU)"
        assert 0 < sol.build_seconds <= sol.seconds
        assert sol.seconds <= limit + 0.5, f"{took}, limit {limit}"  # slack: one node's candidates, a busy machine
        if sol.searched:
            _assert_sane_solution(sol)
        else:
            assert limit == 0.5 or sol.build_seconds >= 0.85 * limit, f"{took}: stopped building early"
            assert sol.shortlist and all(o.startswith("baseline: ") for o in sol.origins), sol.origins
            assert sol.predicted_ms == 0 and sol.gap == 0 and not sol.neighbours


def test_a_model_not_built_in_time_leaves_the_baselines_checked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Building stops at its limit (here: at once), and the baselines as built, which need no
    model, are what the caller checks: the plan kept is the fastest of them, and says so."""
    prog = _llama(SMALL)
    sol = auto.solve(prog.graph, _slow("a100x8"), time_limit=5.0, build_limit=0.0)
    assert not sol.searched and sol.seconds < 1.0 and sol.neighbours is None
    assert sol.origins[0] == "baseline: megatron" and all(o.startswith("baseline: ") for o in sol.origins)
    assert all(p.strategy == "auto" for p in sol.shortlist) and sol.plan == sol.shortlist[0]
    monkeypatch.setattr(policy, "BUILD_SHARE", 0.0)
    plan = edatalog.plan(prog, topology="a100x8", time_limit=2.0)
    assert plan.solution is not None and not plan.solution.searched
    assert plan.solution.origin.startswith("baseline: ")
    assert plan.summary()["searched"] is False and plan.summary()["solver_estimate_ms"] is None
    _assert_runs_exactly(prog, plan)
    assert main(["plan", str(LLAMA_PATH), *SMALL_ARGS, "-t", "a100x8", "--time-limit", "2"]) == 0
    out = capsys.readouterr().out
    assert "nothing was searched: the fastest baseline checked is kept" in out and "--time-limit" in out


@functools.cache
def _attention(dims: tuple[tuple[str, int], ...]) -> edatalog.Program:
    text = (ROOT / "programs" / "attention.edl").read_text().replace(": f32", ": f64")
    return edatalog.compile_string(text, name="attention.edl", dims=dict(dims))


def test_the_same_seed_gives_the_same_plan() -> None:
    """Attention on 3 devices: the search ends with a proof, well inside its time limit."""
    shown: list[auto.Progress] = []
    prog, machine = _attention((("B", 1), ("S", 4), ("D", 16), ("H", 2))), _slow("a100x3")
    first = edatalog.plan(prog, topology=machine, time_limit=3.0, seed=0, on_progress=shown.append)
    again = edatalog.plan(prog, topology=machine, time_limit=3.0, seed=0)
    a, b = _assert_sane_solution(first.solution), _assert_sane_solution(again.solution)
    assert a.optimal and b.optimal
    assert first.ir.to_json() == again.ir.to_json()
    assert a.predicted_ms == b.predicted_ms and a.memory_estimate == b.memory_estimate
    _assert_runs_exactly(prog, first)
    # Progress: time goes forward, the best plan only improves, the bound never passes it.
    assert shown
    assert all(p.elapsed <= q.elapsed for p, q in itertools.pairwise(shown))
    best = [p.best_ms for p in shown if p.best_ms is not None]
    assert best == sorted(best, reverse=True)
    assert all(p.bound_ms <= p.best_ms * (1 + 1e-9) for p in shown if p.best_ms is not None)


# -- g. the command line ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def auto_plan(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object]]:
    """An auto plan of the small LLaMA block on 2 devices, saved, and what --json printed."""
    path = tmp_path_factory.mktemp("auto") / "plan.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        # Time to build the model on a busy 2-core machine: the summary's estimate needs it.
        argv = ["plan", str(LLAMA_PATH), *SMALL_ARGS, "-t", "a100x2", "--time-limit", "3", "-o", str(path)]
        assert main([*argv, "--json"]) == 0
    data: dict[str, object] = json.loads(out.getvalue())
    return path, data


def test_plan_json_has_the_solver_summary_and_megatron(auto_plan: tuple[Path, dict[str, object]]) -> None:
    path, data = auto_plan
    assert {"summary", "plan", "megatron"} <= set(data)
    summary, megatron = data["summary"], data["megatron"]
    assert isinstance(summary, dict) and isinstance(megatron, dict)
    assert summary["strategy"] == "auto" and megatron["strategy"] == "megatron"
    keys = {"solve_seconds", "build_seconds", "solver_estimate_ms", "lower_bound_ms", "optimal", "gap"}
    keys |= {"memory_estimate", "chosen_by", "origin", "refined"}
    assert keys <= set(summary)
    origin = summary["origin"]
    assert isinstance(origin, str) and origin.startswith(("search", "start: ", "baseline: "))
    assert "solve_seconds" not in megatron
    assert 0 < summary["lower_bound_ms"] <= summary["solver_estimate_ms"]
    assert summary["predicted_ms"] == pytest.approx(edatalog.load_plan(path).report.seconds * 1e3)


def test_plan_prints_auto_next_to_megatron(capsys: pytest.CaptureFixture[str]) -> None:
    # Time to build the model on a busy 2-core machine: the solver line below reports its estimate.
    code = main(["plan", str(LLAMA_PATH), *SMALL_ARGS, "-t", "a100x2", "--time-limit", "3"])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("plan 'auto' for 2 devices (a100x2)")
    assert any(line.split()[:3] == ["plan", "predicted", "ms"] for line in lines if line.strip())
    rows = {line.split()[0] for line in lines if line.split()[:1] in (["auto"], ["megatron"])}
    assert rows == {"auto", "megatron"}
    assert any(line.startswith("auto / megatron: ") for line in lines)
    assert any(line.startswith("solver: ") and "memory estimate" in line for line in lines)


def test_plan_in_the_mesh_space_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", str(LLAMA_PATH), *SMALL_ARGS, "-t", "a100x3", "--space", "mesh", "--time-limit", "0.5"])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("plan 'mesh' for 3 devices (a100x3)")
    assert {line.split()[0] for line in lines if line.split()[:1] in (["mesh"], ["megatron"])} == {"mesh", "megatron"}
    assert any(line.startswith("mesh / megatron: ") for line in lines)


def test_explain_marks_the_choice_and_names_the_runner_up(
    capsys: pytest.CaptureFixture[str], auto_plan: tuple[Path, dict[str, object]]
) -> None:
    path, _ = auto_plan
    plan = edatalog.load_plan(path)
    code = main(["explain", str(path), "attn"])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("rule attn: attn[b,s,d] += ")
    starred = [line for line in lines if line.startswith("*")]
    assert len(starred) == 1
    assert plan.ir.node("attn").tile.describe(2) in starred[0]
    assert any(line.startswith("the plan's choice costs ") and "the runner-up (" in line for line in lines)

    code = main(["explain", str(path), "qr", "--json"])  # two rules write qr
    out, _ = capsys.readouterr()
    priced = json.loads(out)
    assert code == 0 and set(priced) == {"qr#1", "qr#2"}
    for rows in priced.values():
        assert [r["chosen"] for r in rows].count(True) == 1
        totals = [r["total_us"] for r in rows]
        assert totals == sorted(totals)


def test_explain_an_unknown_relation(
    capsys: pytest.CaptureFixture[str], auto_plan: tuple[Path, dict[str, object]]
) -> None:
    path, _ = auto_plan
    code = main(["explain", str(path), "atn"])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert err.startswith("error: ") and "'atn'" in err and "did you mean 'attn'" in err
    assert "Traceback" not in err


# -- regressions ------------------------------------------------------------------------------------


def _program(source: str) -> edatalog.Program:
    return edatalog.compile_string(source, name="<bug>")


def test_a_rule_whose_blocks_are_all_empty() -> None:
    """b's guard never holds, so its need of a is empty: costs.py raised a ValueError of numpy
    (a reshape in ``_overlaps``; fixed in 0c526cb)."""
    prog = _program("dim N = 2.\ninput x[N] : f64.\na[i] = x[i].\nb[i] = a[i] where i < i.\noutput b.\n")
    plan = edatalog.plan(prog, topology="a100x3", time_limit=0.5)
    _assert_runs_exactly(prog, plan)


def test_a_plan_at_the_lower_bound_is_optimal() -> None:
    """Every plan of r costs 0 (its guard never holds), so the first is optimal; the bound on the
    next plan was 0 again and Z3 kept finding 'improving' plans of cost 0 (about 2000 in a second)
    until the deadline.  Attention at S = 8, D = 32 on one device starts at its lower bound (one
    kernel floor per rule, nothing to move) and searched until the time limit too.  (Fixed in
    368624f.)"""
    prog = _program("dim N = 4.\ninput x[N] : f64.\noutput r.\nr[i] = x[i] where i < i.\n")
    plan = edatalog.plan(prog, topology="a100x1", time_limit=1.0)
    sol = _assert_sane_solution(plan.solution)
    assert sol.optimal and sol.plans_found == 0, (sol.optimal, sol.plans_found)
    attention = _attention((("S", 8), ("D", 32)))
    sol = _assert_sane_solution(edatalog.plan(attention, topology="a100x1", time_limit=1.0).solution)
    assert sol.predicted_ms == sol.lower_bound_ms
    assert sol.optimal and sol.plans_found == 0, (sol.optimal, sol.plans_found)  # no search at all


def test_an_output_no_block_writes() -> None:
    """r's guard never holds and its head has a literal slot: pricing the transfer of r's (empty)
    layout to where the output must end raised a ValueError of numpy (broadcast) in
    ``Costs._transfer``.  (Fixed in 368624f.)"""
    prog = _program("dim N = 3.\ninput x[N] : f64.\noutput r.\nr[0, i] = x[i] where i < i.\n")
    plan = edatalog.plan(prog, topology="a100x2", time_limit=0.5)
    _assert_runs_exactly(prog, plan)


@pytest.mark.parametrize("topology", ["a100x1", "a100x2"])
def test_rules_of_one_relation_with_other_join_spaces(topology: str) -> None:
    """Two '+=' rules for r over (i, j) and (i): auto refused them ('the rules for r split
    different join spaces'), even on one device.  (Fixed in 368624f.)"""
    prog = _program("dim N = 4.\ninput x[N] : f64.\noutput r.\nr[i, j] += x[i] * x[j].\nr[i, 0] += x[i].\n")
    plan = edatalog.plan(prog, topology=topology, time_limit=0.5)
    _assert_runs_exactly(prog, plan)


def test_a_rule_with_no_indices_and_a_batch_input() -> None:
    """The data baseline (a warm start of auto) crashed on a rule without indices when an input
    has a batch axis (max() of no splits in strategies._data_tiles).  (Fixed in 368624f.)"""
    prog = _program("dim N = 2.\ninput x[N] : f64.\ninput s[] : f64.\noutput r.\nr[] = s[].\n")
    for strategy in ("auto", "data"):
        plan = edatalog.plan(prog, topology="a100x2", strategy=strategy, time_limit=0.5)
        _assert_runs_exactly(prog, plan)


def test_a_memory_that_a_plan_fits_is_not_called_infeasible() -> None:
    """megatron peaks at 22.3 KB per device (simulated), yet auto under 25 KB said 'no plan fits'
    (its estimate of megatron's footprint is 26.6 KB).  The leanest starts are now checked
    exactly before the solver gives up."""
    prog, limit = _llama(SMALL), 25_000
    witness = edatalog.plan(prog, topology="a100x4", strategy="megatron", memory=limit)
    assert not witness.over_memory()
    plan = edatalog.plan(prog, topology="a100x4", memory=limit, time_limit=1.0)
    assert not plan.over_memory()


def test_every_shortlisted_plan_says_where_it_came_from() -> None:
    """The solver's shortlist names each plan's origin: its own best ("search" when no starting
    plan is it), then starting plans by kind, the baselines by name; the kept plan's is
    ``Solution.origin``."""
    prog = _llama(SMALL)
    solution = auto.solve(prog.graph, preset("a100x2"), time_limit=2, build_limit=30)
    assert len(solution.origins) == len(solution.shortlist)
    assert all(o == "search" or o.startswith(("start: ", "baseline: ")) for o in solution.origins)
    assert any(o == "start: megatron" for o in solution.origins[1:])
    plan = edatalog.plan(prog, topology="a100x2", time_limit=2)
    assert plan.solution is not None
    # The kept plan is a shortlisted one, or one the search in the timeline moved to from it.
    moved = re.fullmatch(r"search: \d+ moves? in the timeline from (.*)", plan.solution.origin)
    assert (moved.group(1) if moved else plan.solution.origin) in plan.solution.origins


def test_a_neighbour_differs_only_in_its_neighbourhood_and_stays_within_the_slack() -> None:
    """What the search in the timeline moves through: each proposal changes the plan only in the
    neighbourhood freed, changes it there, and the estimate puts it within the slack; proposals
    run the reference exactly."""
    prog = _llama(SMALL)
    solution = auto.solve(prog.graph, preset("a100x4"), time_limit=2, build_limit=30)
    neighbours = solution.neighbours
    assert neighbours is not None and solution.picks[0] is not None
    choice = solution.picks[0]
    proposed = 0
    for hood in neighbours.hoods(choice)[:6]:
        other = neighbours.propose(choice, hood, 1.5, 1.0)
        if other is None:
            continue
        proposed += 1
        assert {n for n in choice if other[n] != choice[n]} <= hood
        assert any(other[n] != choice[n] for n in hood)
        assert neighbours.model.cost(other) <= 1.5 * neighbours.model.cost(choice)
        _assert_runs_exactly(prog, edatalog.Plan(neighbours.plan(other), prog.graph, preset("a100x4")))
    assert proposed


def test_a_one_pick_move_changes_one_node_and_the_nodes_tied_to_it() -> None:
    """The cheapest moves of the search in the timeline: each changes one node's pick (with the
    producers tied to it, which must pick alike: the rotary halves), fits by the estimate, stays
    within the slack, and they come cheapest by the estimate first; they run the reference
    exactly."""
    prog = _llama(SMALL)
    solution = auto.solve(prog.graph, preset("a100x4"), time_limit=2, build_limit=30)
    neighbours = solution.neighbours
    assert neighbours is not None and solution.picks[0] is not None
    choice, model = solution.picks[0], neighbours.model
    tied = [tuple(p.name for p in prog.graph.producers(rel)) for rel, same in model.tied.items() if same]
    assert tied, "the rotary halves are tied"
    moves = neighbours.moves(choice, 1.3)
    assert moves
    costs = [model.cost(m) for m in moves]
    assert costs == sorted(costs)
    assert max(costs) <= 1.3 * model.cost(choice)
    for m in moves:
        changed = {n for n in choice if m[n] != choice[n]}
        group = next((g for g in tied if changed & set(g)), None)
        assert changed == set(group) if group else len(changed) == 1
        assert model.memory(m) <= model.memory_limit * auto.MEMORY_SLACK
    for m in moves[:3]:
        _assert_runs_exactly(prog, edatalog.Plan(neighbours.plan(m), prog.graph, preset("a100x4")))


def test_a_neighbourhood_proposes_its_best_first_and_nothing_twice() -> None:
    """Z3 proposes the plan the estimate puts fastest in a neighbourhood (the closest rival of
    the plan there), then, asked again, the next: never a plan it proposed before."""
    prog = _llama(SMALL)
    solution = auto.solve(prog.graph, preset("a100x4"), time_limit=2, build_limit=30)
    neighbours = solution.neighbours
    assert neighbours is not None and solution.picks[0] is not None
    choice, model = solution.picks[0], neighbours.model
    asked = 0
    for hood in neighbours.hoods(choice)[:4]:
        first = neighbours.propose(choice, hood, 1.5, 5.0)
        second = neighbours.propose(choice, hood, 1.5, 5.0)
        if first is None or second is None:
            continue
        asked += 1
        assert first != second
        assert model.cost(first) <= model.cost(second)
    assert asked
