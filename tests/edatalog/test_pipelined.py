"""The pipeline baselines across nodes (megatron-pp, megatron-sp-pp), composed from one node's
timelines: consistent with the other composed baselines, faster with microbatches where the
bubble dominates, deeper where memory asks, and clear errors where there is no pipeline."""

from __future__ import annotations

import pytest

import edatalog
from edatalog.pipelined import pipelined_ms
from edatalog.plans import composed_ms
from edatalog.solver import layers, strategies

DIMS = {"B": 2, "S": 16, "D": 64, "H": 4, "KVH": 4, "F": 128, "L": 4, "V": 64}


@pytest.fixture(scope="module")
def llama() -> edatalog.Program:
    return edatalog.compile("programs/llama.edl", dims=DIMS)


def test_two_stages_of_one_microbatch_take_the_whole_model_on_one_node_and_a_send(llama: edatalog.Program) -> None:
    """One microbatch through two stages runs every layer one after the other, as Megatron on
    one node does, plus one send between the nodes."""
    pipe = pipelined_ms(llama, "h100x8x2", "megatron-pp", stages=2, microbatches=1)
    one_node = composed_ms(llama, "h100x8", "megatron")[0]
    assert (pipe.stages, pipe.replicas, pipe.microbatches) == (2, 1, 1)
    assert pipe.send_ms > 0
    assert pipe.ms == pytest.approx(one_node + pipe.send_ms, rel=0.03)
    assert pipe.ms == pytest.approx(layers.pipeline_seconds(pipe.stage_ms, 1) + 1e3 * _overhead("h100x8x2"))


def test_the_fastest_pipeline_is_kept(llama: edatalog.Program) -> None:
    best = pipelined_ms(llama, "h100x8x4", "megatron-sp-pp")
    for stages in (2, 4):
        for m in (1, 2):
            try:
                other = pipelined_ms(llama, "h100x8x4", "megatron-sp-pp", stages=stages, microbatches=m)
            except edatalog.EdlError:
                continue  # 2 stages leave 2 replicas of 1 row each: no second microbatch
            assert best.ms <= other.ms
    assert str(best).startswith("megatron-sp-pp: ")


def test_microbatches_hide_the_bubble_where_compute_dominates() -> None:
    """At a 70B layer's widths a microbatch's compute dwarfs the launches it adds: two
    microbatches through two stages beat one."""
    big = {"D": 8192, "H": 64, "KVH": 8, "F": 28672, "S": 4096, "B": 2, "L": 4, "V": 128256}
    prog = edatalog.compile("programs/llama.edl", dims=big, dtype="bf16")
    one = pipelined_ms(prog, "h100x8x2", "megatron-sp-pp", microbatches=1)
    two = pipelined_ms(prog, "h100x8x2", "megatron-sp-pp", microbatches=2)
    assert two.ms < 0.9 * one.ms
    assert two.peak < one.peak  # half the rows in flight
    assert pipelined_ms(prog, "h100x8x2", "megatron-sp-pp").microbatches == 2


def test_memory_asks_for_more_stages(llama: edatalog.Program) -> None:
    """Under a limit that two stages of two layers each exceed, four stages of one fit."""
    roomy = pipelined_ms(llama, "h100x8x4", "megatron-pp", stages=2)
    deep = pipelined_ms(llama, "h100x8x4", "megatron-pp", stages=4)
    assert deep.peak < roomy.peak
    limit = (deep.peak + roomy.peak) // 2
    fitted = pipelined_ms(llama, "h100x8x4", "megatron-pp", memory=limit)
    assert fitted.stages == 4 and fitted.peak <= limit
    with pytest.raises(edatalog.EdlError, match="no megatron-pp pipeline of this program fits"):
        pipelined_ms(llama, "h100x8x4", "megatron-pp", memory=deep.peak // 4)


def test_no_pipeline_without_nodes_or_layers(llama: edatalog.Program) -> None:
    with pytest.raises(edatalog.EdlError, match="needs several nodes"):
        pipelined_ms(llama, "h100x8", "megatron-pp")
    block = edatalog.compile("programs/llama_block.edl", dims={k: v for k, v in DIMS.items() if k not in "LV"})
    with pytest.raises(edatalog.EdlError, match="this program has none"):
        pipelined_ms(block, "h100x8x2", "megatron-pp")
    with pytest.raises(edatalog.EdlError, match="not a pipeline baseline"):
        pipelined_ms(llama, "h100x8x2", "megatron-dp")
    with pytest.raises(edatalog.EdlError, match="no plan of it to build or run"):
        edatalog.plan(llama, "h100x8x2", "megatron-pp")


def test_compared_across_nodes_only_for_models() -> None:
    from edatalog.solver import topology

    machine = topology.resolve("h100x8x2")
    assert strategies.compared_with(machine, layered=True) == (*strategies.MULTI_NODE, *strategies.PIPELINED)
    assert strategies.compared_with(machine) == strategies.MULTI_NODE
    assert strategies.compared_with(topology.resolve("h100x8"), layered=True) == ("megatron",)


def _overhead(name: str) -> float:
    from edatalog.solver import topology

    return topology.resolve(name).call_overhead
