"""Plans on multi-node presets (nodes of 8 GPUs, a NIC per GPU) run as the reference computes:
their exchanges between nodes are synthesized, simulated and priced like those inside one."""

from __future__ import annotations

import numpy as np
import pytest

import edatalog
from edatalog.ir import program as ir

DIMS = {"B": 2, "S": 16, "D": 64, "H": 4, "KVH": 4, "F": 128}


@pytest.fixture(scope="module")
def block() -> tuple[edatalog.Program, dict[str, np.ndarray], dict[str, np.ndarray]]:
    prog = edatalog.compile("programs/llama_block.edl", dims=DIMS)
    values = prog.random_inputs(seed=0)
    return prog, values, prog.run(values, backend="reference")


@pytest.mark.parametrize("machine", ["h100x8x2", "a100x8x8"])
@pytest.mark.parametrize("strategy", ["auto", "random", "megatron", "megatron-dp", "megatron-sp-dp"])
def test_plans_across_nodes_equal_the_reference(
    block: tuple[edatalog.Program, dict[str, np.ndarray], dict[str, np.ndarray]], machine: str, strategy: str
) -> None:
    prog, values, want = block
    plan = edatalog.plan(prog, machine, strategy, time_limit=1.0)
    got = plan.execute(dict(values), backend="sim")
    np.testing.assert_allclose(got["y"], want["y"], rtol=1e-4, atol=1e-5)
    assert plan.report.seconds > 0


def test_a_split_across_nodes_moves_bytes_between_them(
    block: tuple[edatalog.Program, dict[str, np.ndarray], dict[str, np.ndarray]],
) -> None:
    """Megatron over all 16 GPUs of 2 nodes (4 heads: the other splits reach across nodes)
    runs collectives that span both nodes, which the timeline prices on the NICs: the plan is
    predicted slower than on one node of 8, with twice the devices."""
    prog, _, _ = block
    plan = edatalog.plan(prog, "h100x8x2", "megatron")
    groups = [op.group for _, _, op in plan.lowered.programs.ops() if isinstance(op, ir.Collective)]
    assert any({d // 8 for d in group} == {0, 1} for group in groups)
    assert plan.report.seconds > edatalog.plan(prog, "h100x8", "megatron").report.seconds


def test_tensor_parallel_inside_nodes_data_parallel_between() -> None:
    """megatron-dp on 2 nodes of 8: each node runs Megatron on its half of the batch, so its
    collectives stay inside a node; the outputs are then gathered onto every device."""
    prog = edatalog.compile("programs/llama_block.edl", dims=DIMS)
    plan = edatalog.plan(prog, "h100x8x2", "megatron-dp")
    groups = [op.group for _, _, op in plan.lowered.programs.ops() if isinstance(op, ir.Collective)]
    assert groups and all(len({d // 8 for d in group}) == 1 for group in groups)
    q = plan.ir.node("q").tile
    assert {d // 8 for block in q.blocks() if block.ranges["b"] == (0, 1) for d in block.devices} == {0}
    assert {d // 8 for block in q.blocks() if block.ranges["b"] == (1, 2) for d in block.devices} == {1}


@pytest.mark.parametrize("strategy", ["megatron-dp", "megatron-sp-dp"])
def test_strategies_across_nodes_need_several(strategy: str) -> None:
    prog = edatalog.compile("programs/llama_block.edl", dims=DIMS)
    with pytest.raises(edatalog.EdlError, match=f"the {strategy} strategy needs several nodes"):
        edatalog.plan(prog, "h100x8", strategy)


def test_edl_plan_compares_with_the_best_baseline_across_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    """Across nodes, ``edl plan`` shows auto against the faster of megatron-dp and
    megatron-sp-dp, never against Megatron over all 16 GPUs."""
    from edatalog.cli import main

    dims = [f"--dim={k}={v}" for k, v in DIMS.items()]
    assert main(["plan", "programs/llama_block.edl", *dims, "-t", "h100x8x2", "--time-limit", "3"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("auto / "))
    assert line.split(":")[0] in ("auto / megatron-dp", "auto / megatron-sp-dp")
    assert not any(row.split()[:1] == ["megatron"] for row in out.splitlines())  # no row of plain megatron


@pytest.mark.parametrize("strategy", ["megatron-dp", "megatron-sp-dp"])
def test_composed_baselines_across_nodes_keep_each_nodes_rows_on_the_node(strategy: str) -> None:
    """A whole model's baseline composed per layer: each layer's result stays on the node that
    made it (its batch rows), as a nested auto plan leaves it, instead of being gathered onto
    every device over InfiniBand at every layer."""
    from edatalog.plans import composed_ms

    prog = edatalog.compile("programs/llama.edl", dims={**DIMS, "L": 2, "V": 64})
    ms, layer = composed_ms(prog, "h100x8x2", strategy)
    assert ms > 0
    for placed in layer.ir.outputs:
        for block in placed.tile.blocks():
            assert len({d // 8 for d in block.devices}) == 1, (placed.relation, block)
    links = layer.summary()["bytes_per_link"]
    assert links and not [k for k in links if len({int(d) // 8 for d in k.split("->")}) > 1]  # nothing crosses


def test_one_layer_of_a_model_is_split_by_its_batch_across_nodes() -> None:
    """One layer as a graph of its own reads the rotary tables (``rc[S, ...]``) before the
    hidden state (``x0[B, S, D]``): the baselines across nodes still split the batch there."""
    from edatalog.solver import layers, strategies

    prog = edatalog.compile("programs/llama.edl", dims={**DIMS, "L": 2, "V": 64})
    rep = layers.repeated(prog.graph)
    assert rep is not None
    layer = layers.layer_graph(prog.graph, rep)
    assert strategies.batch_symbol(layer) == "B"
    plan = strategies.build(layer, edatalog.topology("h100x8x2"), "megatron-dp")
    q = plan.node("layers.0.q").tile
    assert {block.ranges["b"]: {d // 8 for d in block.devices} for block in q.blocks()} == {(0, 1): {0}, (1, 2): {1}}
