"""Nested plans for machines of identical nodes: a batch-like dim across groups, one group's
plan solved once and lifted to every group (edatalog.solver.nested)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import edatalog
from edatalog.solver import nested, strategies
from edatalog.solver import topology as machines

DIMS = {"B": 4, "S": 16, "D": 64, "H": 4, "KVH": 2, "F": 128}


@pytest.fixture(scope="module")
def block() -> edatalog.Program:
    return edatalog.compile("programs/llama_block.edl", dims=DIMS)


def test_only_the_batch_is_batch_like(block: edatalog.Program) -> None:
    """D, H, F... are in params (a split across nodes is tensor parallelism over the network);
    S is read by the causal guard (the groups' shares would differ): only B nests."""
    assert nested.batch_like(block.graph) == ["B"]


def test_shrinking_the_batch_is_compiling_with_a_smaller_one(block: edatalog.Program) -> None:
    small = nested.shrink(block.graph, "B", 2)
    want = edatalog.compile("programs/llama_block.edl", dims={**DIMS, "B": 2}).graph
    assert small is not None
    assert small.relations == want.relations
    assert small.nodes == want.nodes
    assert small.dims == want.dims
    assert nested.shrink(block.graph, "B", 3) is None  # 4 rows do not split 3 ways alike


@pytest.mark.parametrize(
    ("machine", "want"),
    [
        ("h100x8", None),  # one node: nothing to nest
        ("h100x8x2", ("B", 2, 8)),
        ("a100x8x4", ("B", 4, 8)),
        ("a100x8x8", ("B", 4, 16)),  # 4 rows: groups of two nodes
        ("h100x8x16", ("B", 4, 8)),  # groups of four nodes would not nest further: one node each, 12 idle
    ],
)
def test_the_batch_splits_across_as_many_nodes_as_it_can(
    block: edatalog.Program, machine: str, want: tuple[str, int, int] | None
) -> None:
    topo = machines.preset(machine)
    how = nested.across(block.graph, topo)
    assert (how and (how.dim, how.groups, how.size)) == want
    assert how is None or how.groups * how.size + how.idle == topo.n


def test_a_lifted_plan_runs_the_group_plan_on_every_group(block: edatalog.Program) -> None:
    """Megatron on one node at B=2, lifted to 2 nodes, is megatron-dp: each node runs it on its
    half of the batch, the rules without the batch (the rotary tables) on both."""
    machine = machines.preset("h100x8x2")
    how = nested.across(block.graph, machine)
    assert how is not None
    small = nested.shrink(block.graph, how.dim, how.groups)
    assert small is not None
    inner = strategies.build(small, nested.group(machine, how), "megatron")
    lifted = nested.lift(block.graph, inner, how, machine)
    lifted.verify(block.graph)
    want = strategies.build(block.graph, machine, "megatron-dp")
    for node in block.graph.nodes:
        assert lifted.node(node.name).tile == want.node(node.name).tile, node.name
    assert {d for ds in lifted.node("rc").tile.devices for d in ds} == set(range(16))


@pytest.mark.parametrize("machine", ["h100x8x2", "a100x8x8"])
def test_nested_auto_plans_equal_the_reference_and_beat_the_baselines(block: edatalog.Program, machine: str) -> None:
    values = block.random_inputs(seed=1)
    want = block.run(values, backend="reference")
    plan = edatalog.plan(block, machine, "auto", time_limit=4.0)
    assert plan.solution is not None and plan.solution.nested.startswith("B across ")
    got = plan.execute(dict(values), backend="sim")
    np.testing.assert_allclose(got["y"], want["y"], rtol=1e-4, atol=1e-5)
    for name in strategies.baseline_names(plan.topology, False):
        base = edatalog.plan(block, machine, name)
        assert plan.report.seconds <= base.report.seconds * (1 + 1e-9), name


def test_edl_plan_says_how_it_nested(block: edatalog.Program, capsys: pytest.CaptureFixture[str]) -> None:
    from edatalog.cli import main

    dims = [f"--dim={k}={v}" for k, v in DIMS.items()]
    assert main(["plan", "programs/llama_block.edl", *dims, "-t", "h100x8x2", "--time-limit", "4"]) == 0
    out = capsys.readouterr().out
    assert "nested: B across 2 groups of 8 devices: each group's plan solved at B=2 on 8 devices" in out


def _lifted_random(prog: edatalog.Program, machine_name: str, seed: int) -> edatalog.Plan:
    """A random plan of one group's share, lifted to every group of the machine."""
    machine = machines.preset(machine_name)
    how = nested.across(prog.graph, machine)
    assert how is not None
    small = nested.shrink(prog.graph, how.dim, how.groups)
    assert small is not None
    inner = strategies.build(small, nested.group(machine, how), "random", seed=seed)
    lifted = nested.lift(prog.graph, inner, how, machine)
    return edatalog.Plan(lifted, prog.graph, machine)


@pytest.mark.parametrize(("machine", "seed"), [("h100x8x2", 0), ("h100x8x2", 1), ("a100x8x8", 2), ("h100x8x16", 3)])
def test_lifted_random_plans_equal_the_reference(block: edatalog.Program, machine: str, seed: int) -> None:
    values = block.random_inputs(seed=seed)
    want = block.run(values, backend="reference")
    got = _lifted_random(block, machine, seed).execute(dict(values), backend="sim")
    np.testing.assert_allclose(got["y"], want["y"], rtol=1e-4, atol=1e-5)


def test_a_lifted_training_step_sums_gradients_across_groups() -> None:
    """A training step nests along its batch too: each group's gradients are partial sums over
    its rows, which the lifted plan reduces across the groups before the update."""
    from tests.edatalog.test_training import SGD_MLP

    prog = edatalog.compile_string(SGD_MLP, name="mlp.edl")
    step, names = edatalog.step_program(prog, optimizer=edatalog.AdamW(lr=0.05, weight_decay=0.1), clip=0.5)
    assert nested.batch_like(step.graph) == ["B"]
    values = prog.random_inputs(seed=1)
    params = {p: values[p] for p in names.params}
    state = {s: np.zeros_like(params[p]) for s, p in names.state}
    inputs: dict[str, Any] = {"x": values["x"], "y": values["y"], **params, **state, "step": np.float64(1)}
    want = step.run(dict(inputs))
    for seed in range(3):
        got = _lifted_random(step, "h100x8x2", seed).execute(dict(inputs), backend="sim")
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=1e-9, err_msg=name)
