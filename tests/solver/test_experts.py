"""Plans of a mixture of experts' layer: Megatron finds the experts' FFN columns by structure
(tensor parallelism of every expert), the ``expert`` strategy splits the experts (expert
parallelism with data parallelism), and both the solver and the timeline price a routed rule's
block by the tokens routed to its experts at the expected load (``K/X`` of the tokens' choices
per expert)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import edatalog
from edatalog import EdlError
from edatalog.errors import EdlWarning
from edatalog.solver.structure import transformer_dims

MOE = Path(__file__).resolve().parents[2] / "programs" / "moe_layer.edl"
SMALL = {"T": 16, "D": 32, "F": 48, "X": 8, "K": 2}
ROUTED = ("h1", "h3", "y")


def _compile(**dims: int) -> edatalog.Program:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EdlWarning)
        return edatalog.compile(MOE, dims={**SMALL, **dims})


def _splits(plan: edatalog.Plan, node: str) -> dict[str, int]:
    return {s.index: s.parts for s in plan.ir.node(node).tile.splits}


def test_megatron_splits_every_experts_ffn_columns() -> None:
    prog = _compile()
    assert set(transformer_dims(prog.graph).ffn) == {"F"}
    plan = edatalog.plan(prog, topology="cpux2", strategy="megatron")
    for name in ROUTED:
        assert _splits(plan, name)["f"] == 2 and _splits(plan, name)["e"] == 1, name


def test_the_expert_strategy_splits_the_experts_and_equals_the_reference() -> None:
    prog = _compile()
    plan = edatalog.plan(prog, topology="cpux2", strategy="expert")
    for name in ROUTED:
        assert _splits(plan, name)["e"] == 2, name
    values = prog.random_inputs(seed=4)
    want = prog.run(values)["y"]
    params = {r.name for r in prog.arguments if r.kind == "param"}
    exe = edatalog.executable(prog, plan, backend="torch")
    exe.load({k: torch.tensor(v) for k, v in values.items() if k in params})
    for call in ("interpreted", "recorded", "replayed"):
        got = exe({"x": torch.tensor(values["x"])})["y"].numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=call)


def test_the_expert_strategy_needs_experts() -> None:
    prog = edatalog.compile_string("dim N = 4.\ninput x[N] : f32.\ny[i] = x[i] * 2.0.\n")
    with pytest.raises(EdlError, match="the expert strategy needs a mixture of experts"):
        edatalog.plan(prog, topology="cpux2", strategy="expert")


def test_routed_blocks_are_priced_at_the_expected_load() -> None:
    """Split over the experts, each device's routed work is its share of the expected points:
    the plan's flops are the program's (each point counted once, as on one device), not the
    routed rules' twice over (each block priced at every token's points)."""
    prog = _compile(T=64)
    routed = sum(prog.graph.costs[name].flops for name in ROUTED)
    one = sum(edatalog.plan(prog, topology="cpux2", strategy="replicate").summary()["flops"].values())
    ep = sum(edatalog.plan(prog, topology="cpux2", strategy="expert").summary()["flops"].values())
    assert routed > 0.8 * one
    assert ep == pytest.approx(one, rel=0.03)


@pytest.mark.slow
def test_the_solved_plan_beats_megatron_of_every_expert_at_mixtral_widths() -> None:
    """Predicted, on 8 A100s at Mixtral-8x7B's widths (2048 tokens, bf16)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EdlWarning)
        prog = edatalog.compile(MOE, dtype="bf16")  # its default dims: Mixtral-8x7B's, 2048 tokens
    megatron = edatalog.plan(prog, topology="a100x8", strategy="megatron").report.seconds
    auto = edatalog.plan(prog, topology="a100x8", strategy="auto", time_limit=20.0).report.seconds
    assert auto < megatron


def test_the_solver_prices_a_routed_readers_inputs_by_the_rows_that_travel() -> None:
    """A block over 2 of 8 experts reads a token's row of ``x`` (its K=2 choices: any of them)
    with probability 1 - C(6, 2) / C(8, 2) = 13/28, a (token, choice) cell of the gates with
    2/8; the route itself whole, as exchange synthesis sends them (selective messages)."""
    from edatalog.solver.blocks import Candidate
    from edatalog.solver.costs import routed_shares

    prog = _compile()
    node = prog.graph.node("a")  # a[t, k, f] = silu(h1) * h3 * p / z where route[t, k] = e:X
    accesses = tuple(dict.fromkeys(node.inputs))
    parts = tuple(4 if i.name == "e" else 1 for i in node.indices)
    shares = dict(zip((a.relation for a in accesses), routed_shares(node, Candidate(parts, 1), accesses), strict=True))
    assert shares == pytest.approx({"h1": 0.25, "h3": 0.25, "p": 0.25, "z": 13 / 28, "route": 1.0})
    whole = routed_shares(node, Candidate((1,) * len(node.indices), 1), accesses)
    assert whole == (1.0,) * len(accesses)
    x = prog.graph.node("h1")
    accesses = tuple(dict.fromkeys(x.inputs))
    parts = tuple(4 if i.name == "e" else 1 for i in x.indices)
    got = dict(zip((a.relation for a in accesses), routed_shares(x, Candidate(parts, 1), accesses), strict=True))
    assert got == pytest.approx({"x": 13 / 28, "w1": 1.0, "route": 1.0})
