"""Planning does not depend on the sizes of the dims: a sequence of 10^9 tokens is planned as a
sequence of 10^3 is, with the same plan.  Blocks, needs, layouts and regions are interval
arithmetic, and the solver's integer weights are scaled to stay in Z3's range, so a test that
finishes at all at 10^9 (any array over a whole axis would need terabytes) plus the structure
equality below is the proof; no test here times anything."""

from __future__ import annotations

from pathlib import Path

import pytest

import edatalog
from edatalog.backend.lowering.exchange import Schedule
from edatalog.ir import program as ir
from edatalog.ir.regions import Region
from edatalog.plans import Plan
from edatalog.solver import auto
from edatalog.solver import topology as machines
from edatalog.solver.plan import Tile

ROOT = Path(__file__).resolve().parents[2]

NORM_PROJECT = """\
dim B = 1, S = 128, D = 256, F = 512.
input x[B, S, D] : f32.
param g[D] : f32.
param w[F, D] : f32.
param bias[F] : f32.
output y.
mu[b, s] += x[b, s, d] / D.
xc[b, s, d] = x[b, s, d] - mu[b, s].
var[b, s] += xc[b, s, d] * xc[b, s, d] / D.
xn[b, s, d] = xc[b, s, d] * rsqrt(var[b, s] + 0.00001) * g[d].
h[b, s, f] += xn[b, s, d] * w[f, d].
y[b, s, f] = h[b, s, f] + bias[f].
"""

SMALL, HUGE = 10**3, 10**9

# No latencies or kernel floors, links fast enough that splitting the sequence pays at any size,
# and memory for 10^9 tokens: the cost model is then (nearly) proportional to S, so the best plan
# is the same at both sizes, and the solver proves it at once (no time limit decides anything).
FLAT = {
    "name": "flat",
    "nodes": [4],
    "device": {"memory": "1000PB"},
    "links": {"intra": {"bandwidth": "3000GB/s", "latency": "0s"}},
    "kernel_floor": 0,
}


def _plan(seq: int, space: str) -> Plan:
    prog = edatalog.compile_string(NORM_PROJECT, dims={"S": seq})
    plan = edatalog.plan(prog, topology=machines.from_dict(FLAT), time_limit=10.0, space=space)
    assert plan.solution is not None and plan.solution.optimal
    assert not plan.over_memory()
    return plan


def _tile_shape(tile: Tile, seq: set[str], scale: int) -> tuple[object, ...]:
    """A tile with the cuts of the splits named in ``seq`` (those of the dim S) divided by ``scale``."""
    splits = tuple((s.index, tuple(c // scale for c in s.cuts) if s.index in seq else s.cuts) for s in tile.splits)
    return splits, tile.devices


def _seq(plan: Plan, name: str) -> set[str]:
    """The indices of a rule, or the axes of a relation, that run over the sequence dim S."""
    g = plan.graph
    if name in {n.name for n in g.nodes}:
        return {i.name for i in g.node(name).indices if i.symbol == "S"}
    rel = g.relation(name)
    return {a for a, sym in zip(rel.axis_names, rel.symbols, strict=True) if sym == "S"}


def _schedule_shape(s: Schedule, scale: int) -> list[tuple[object, ...]]:
    """Every op: its kind, device and place, what it moves or computes, and its region or block
    with the sequence axis (axis 1 of every relation that has one) divided by ``scale``."""

    def region(r: Region, relation: str) -> tuple[object, ...]:
        seq_axis = 1 if s.graph.relation(relation).symbols[1:2] == ("S",) else None
        return tuple(
            tuple((lo // scale, hi // scale) for lo, hi in ax) if k == seq_axis else ax for k, ax in enumerate(r.axes)
        )

    out: list[tuple[object, ...]] = []
    for d, k, op in s.programs.ops():
        if isinstance(op, ir.Load | ir.Recv | ir.Combine):
            out.append((type(op).__name__, d, k, op.relation, region(op.region, op.relation)))
        elif isinstance(op, ir.Kernel):
            block = tuple((i, lo // scale, hi // scale) if i == "s" else (i, lo, hi) for i, lo, hi in op.ranges)
            out.append(("kernel", d, k, op.node, block))
        elif isinstance(op, ir.Send):
            out.append(("send", d, k, op.peer))
        else:
            out.append(("free", d, k))
    return out


def test_a_billion_tokens_get_the_plan_a_thousand_get() -> None:
    """The 6-rule norm-and-project program at S = 10^3 and 10^9 in the mesh space: the same tiles
    (cuts scaled), the same placements, the same synthesized tasks on the same devices, and the
    bytes moved scaled exactly (only the output's rows move)."""
    small, huge = _plan(SMALL, "mesh"), _plan(HUGE, "mesh")
    scale = HUGE // SMALL
    for a, b in zip(small.ir.nodes, huge.ir.nodes, strict=True):
        assert (a.node, a.reduce_axis) == (b.node, b.reduce_axis)
        seq = _seq(small, a.node)
        assert _tile_shape(a.tile, seq, 1) == _tile_shape(b.tile, seq, scale), a.node
    for p, q in zip((*small.ir.inputs, *small.ir.outputs), (*huge.ir.inputs, *huge.ir.outputs), strict=True):
        seq = _seq(small, p.relation)
        assert p.relation == q.relation and _tile_shape(p.tile, seq, 1) == _tile_shape(q.tile, seq, scale), p.relation
    assert any(s.parts > 1 for n in huge.ir.nodes for s in n.tile.splits), "nothing is split: the test tests little"
    assert _schedule_shape(small.schedule, 1) == _schedule_shape(huge.schedule, scale)
    assert huge.report.bytes_moved == scale * small.report.bytes_moved > 0


def test_the_join_space_solves_a_billion_tokens_as_a_thousand() -> None:
    """In the default space the solver's own plan is the same at both sizes; what the timeline then
    keeps may be refined differently (pipelining pays off by how the constant costs, such as
    reading the weights, compare with the sequence's), so only the solver's plan is compared."""
    small, huge = _plan(SMALL, "join"), _plan(HUGE, "join")
    assert small.solution is not None and huge.solution is not None
    solver_small, solver_huge = small.solution.shortlist[0], huge.solution.shortlist[0]
    scale = HUGE // SMALL
    for a, b in zip(solver_small.nodes, solver_huge.nodes, strict=True):
        seq = _seq(small, a.node)
        assert _tile_shape(a.tile, seq, 1) == _tile_shape(b.tile, seq, scale), a.node
    summary = huge.summary()
    assert summary["plan_seconds"] >= summary["solve_seconds"] >= summary["build_seconds"] > 0


def test_a_billion_tokens_of_causal_attention_is_refused_at_once() -> None:
    """The LLaMA block at S = 10^9 cannot fit any machine here (its inputs alone exceed the
    devices' memory, and its causal scores are 10^18 cells per head): a clear error, from a
    solver that costs it as quickly as it costs 512 tokens."""
    prog = edatalog.compile(str(ROOT / "programs" / "llama_block.edl"), dims={"S": HUGE})
    with pytest.raises(edatalog.EdlError, match=r"no plan fits in .* per device: any plan needs at least"):
        edatalog.plan(prog, topology="a100x8", time_limit=5.0)


def test_the_solvers_weights_stay_in_z3s_range() -> None:
    """At 10^9 tokens a plan costs seconds (10^10 ns) and terabytes: Z3's pseudo-Boolean sums wrap
    past 2^31, which once made each 'better' plan worse.  Weights are scaled to stay in range, and
    the search's best only improves."""
    prog = edatalog.compile_string(NORM_PROJECT, dims={"S": HUGE})
    topo = machines.preset("a100x4")
    model = auto._Setup(prog.graph, topo, 10**18, "join").model
    assert model.unit_ns > 1 and model.unit_bytes > 1024
    assert sum(w for _, w in model.terms) < 2**31
    assert all(sum(w for _, w in live) < 2**31 for live in model.step_terms)
    shown: list[auto.Progress] = []
    sol = auto.solve(prog.graph, topo, memory=10**18, time_limit=10.0, on_progress=shown.append)
    best = [p.best_ms for p in shown if p.best_ms is not None]
    assert best == sorted(best, reverse=True)
    assert sol.optimal and sol.predicted_ms == pytest.approx(best[-1])
