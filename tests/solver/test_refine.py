"""Plan refinements (:mod:`edatalog.solver.refine`): pipelined and balanced plans compute exactly
what the program says, keep every cell of every rule on the devices it had, and pay where the
cost model says they should (long sequences)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import edatalog
from edatalog.plans import Plan
from edatalog.solver import refine, strategies
from edatalog.solver.blocks import guarded_dims
from edatalog.solver.plan import NodePlan, Split, Tile
from edatalog.solver.plan import Plan as PlanIR
from edatalog.solver.topology import preset
from tests.strategies import GeneratedProgram, example_settings, programs

ROOT = Path(__file__).resolve().parents[2]
LLAMA = (ROOT / "programs" / "llama_block.edl").read_text()
SMALL = {"B": 1, "S": 8, "D": 32, "H": 4, "KVH": 2, "F": 48}
RTOL, ATOL = 1e-9, 1e-12

_SETTINGS = example_settings("EDL_REFINE_EXAMPLES", 80)


def _cells_per_device(graph: edatalog.ir.graph.Graph, ir: PlanIR) -> dict[str, Counter[int]]:
    """For every rule, how many join-space cells each device's blocks cover."""
    out: dict[str, Counter[int]] = {}
    for p in ir.nodes:
        count: Counter[int] = Counter()
        for block in p.tile.blocks():
            size = int(np.prod([hi - lo for lo, hi in block.ranges.values()]))
            for d in block.devices:
                count[d] += size
        out[p.node] = count
    return out


def _assert_same_results(prog: edatalog.Program, plan: Plan, inputs: dict[str, np.ndarray]) -> None:
    values = prog.prepare(inputs)
    want = prog.evaluate(values)
    got = plan.execute(values)
    for name in prog.outputs:
        np.testing.assert_allclose(got[name], want[name].data, rtol=RTOL, atol=ATOL, err_msg=name)


@_SETTINGS
@given(
    gen=programs(),
    n=st.sampled_from((4, 3, 8, 2)),
    seed=st.integers(0, 2**16),
    how=st.sampled_from(("pipelined", "balanced")),
    chunks=st.sampled_from((2, 3, 4)),
)
def test_refined_random_plans_equal_the_reference(
    gen: GeneratedProgram, n: int, seed: int, how: str, chunks: int
) -> None:
    """Random programs under random uneven plans, pipelined or balanced along one of their dims."""
    prog = gen.compile()
    graph = prog.graph
    symbols = sorted({i.symbol for node in graph.nodes for i in node.indices})
    assume(symbols)
    dim = symbols[seed % len(symbols)]
    machine = preset(f"a100x{n}")
    base = strategies.random_plan(graph, machine, seed)
    ir = refine.pipelined(graph, base, dim, chunks) if how == "pipelined" else refine.balanced(graph, base, dim)
    assume(ir is not None)
    assert ir is not None
    ir.verify(graph)
    after, before = _cells_per_device(graph, ir), _cells_per_device(graph, base)
    if how == "pipelined":
        assert after == before, "pipelining moved work between devices"
    else:  # balancing deals the cells out anew, on the same devices
        assert {k: set(c) for k, c in after.items()} == {k: set(c) for k, c in before.items()}
    _assert_same_results(prog, Plan(ir, graph, machine), gen.inputs)


@pytest.mark.parametrize("topology", ["a100x4", "a100x8", "2x4"])
def test_refined_megatron_llama_block_equals_the_reference(topology: str) -> None:
    prog = edatalog.compile_string(LLAMA.replace(": f32", ": f64"), name="llama_block.edl", dims=SMALL)
    graph = prog.graph
    machine = preset(topology)
    base = strategies.build(graph, machine, "megatron")
    assert refine.every_rule_dims(graph) == ["S"]
    assert guarded_dims(graph) == {"S"}
    for ir in (refine.pipelined(graph, base, "S", 2), refine.pipelined(graph, base, "S", 4)):
        assert ir is not None
        _assert_same_results(prog, Plan(ir, graph, machine), prog.random_inputs(0))


def test_balanced_splits_deal_parts_out_zigzag() -> None:
    prog = edatalog.compile_string(LLAMA, name="llama_block.edl", dims=SMALL)
    graph = prog.graph
    machine = preset("a100x2")
    data = strategies.build(graph, machine, "data")  # B = 1: nothing split, so nothing to balance
    assert refine.balanced(graph, data, "S") is None
    base = strategies.build(graph, machine, "megatron")
    node = graph.node("sc")
    splits = tuple(Split.even(i.name, i.extent, 2 if i.name == "s" else 1) for i in node.indices)
    nodes = tuple(NodePlan("sc", Tile(splits, ((0,), (1,)))) if p.node == "sc" else p for p in base.nodes)
    ir = refine.balanced(graph, dataclasses.replace(base, nodes=nodes), "S")
    assert ir is not None
    sc = ir.node("sc").tile
    assert [s.cuts for s in sc.splits if s.index == "s"] == [(0, 2, 4, 6, 8)]
    assert sc.devices == ((0,), (1,), (1,), (0,))
    assert ir.node("q").tile == base.node("q").tile  # q splits no S index: unchanged


def test_pipelining_pays_for_long_sequences_and_moves_the_same_bytes() -> None:
    """Megatron on a bf16 LLaMA-7B block at S=2048 on 8 A100s: two chunks along s overlap each
    chunk's reductions with the next chunk's matmuls and move exactly as many bytes.  Where
    overlap is free (a link that takes no compute), the predicted time drops by more than 5%
    (each chunk pays its kernels' launches again);
    on the preset, whose transfers take 20% of their time from the GPUs' compute at both ends,
    the same plan is slower."""
    prog = edatalog.compile_string(LLAMA, name="llama_block.edl", dims={"S": 2048}, dtype="bf16")
    graph = prog.graph
    machine = preset("a100x8")
    free = dataclasses.replace(machine, intra=dataclasses.replace(machine.intra, interference=0.0))
    base = Plan(strategies.build(graph, free, "megatron"), graph, free)
    ir = refine.pipelined(graph, base.ir, "S", 2)
    assert ir is not None
    piped = Plan(ir, graph, free)
    assert piped.report.bytes_moved == base.report.bytes_moved
    assert piped.report.seconds < 0.95 * base.report.seconds
    assert max(piped.report.peak_memory.values()) <= max(base.report.peak_memory.values())
    assert piped.report.seconds < Plan(ir, graph, machine).report.seconds


def test_a_baseline_refined_keeps_the_fastest_refinement(tmp_path: Path) -> None:
    """``plan(..., refine=True)`` gives a baseline what auto plans get: on a machine whose
    transfers run beside compute, Megatron on a bf16 7B block at S=2048 is kept pipelined along
    the sequence (faster, same bytes); on one whose transfers take all of the compute engines'
    time, where pipelining cannot pay, it stays as built.  The CLI says which."""
    prog = edatalog.compile_string(LLAMA, name="llama_block.edl", dims={"S": 2048}, dtype="bf16")
    machine = preset("a100x8")
    free = dataclasses.replace(machine, intra=dataclasses.replace(machine.intra, interference=0.0))
    plain = edatalog.plan(prog, topology=free, strategy="megatron")
    refined = edatalog.plan(prog, topology=free, strategy="megatron", refine=True, time_limit=30)
    assert refined.refined.startswith("S in ") and refined.ir.strategy == "megatron"
    assert refined.report.seconds < plain.report.seconds
    assert refined.report.bytes_moved == plain.report.bytes_moved
    assert refined.summary()["refined"] == refined.refined and "refined" not in plain.summary()
    busy = dataclasses.replace(machine, intra=dataclasses.replace(machine.intra, interference=1.0))
    kept = edatalog.plan(prog, topology=busy, strategy="megatron", refine=True, time_limit=30)
    assert (
        kept.refined == ""
        and kept.report.seconds == edatalog.plan(prog, topology=busy, strategy="megatron").report.seconds
    )


def test_megatron_sp_splits_what_megatron_replicates_along_the_sequence() -> None:
    """Sequence-parallel Megatron: the norms and residuals (and the input) split along s over
    every device, the row-parallel projections reduce-scattered along s, the column-parallel
    ones reading the whole normed activations (so an all-gather each), the rotary tables whole;
    no more bytes than Megatron's all-reduces (a reduce-scatter and an all-gather are one
    all-reduce), and less memory per device."""
    prog = edatalog.compile_string(LLAMA, name="llama_block.edl", dims={"S": 2048}, dtype="bf16")
    machine = preset("a100x8")
    sp = edatalog.plan(prog, topology=machine, strategy="megatron-sp")
    mg = edatalog.plan(prog, topology=machine, strategy="megatron")
    split = {p.node: {s.index: s.parts for s in p.tile.splits if s.parts > 1} for p in sp.ir.nodes}
    for name in ("ss", "xn", "h", "ss2", "hn", "y"):
        assert split[name] == {"s": 8}, name
    assert split["rc"] == {} and split["rs"] == {}
    assert split["q"] == {"g": 8} and split["gate"] == {"f": 8}
    reduce_axis = {p.node: p.reduce_axis for p in sp.ir.nodes}
    assert reduce_axis["attn"] == 1 and reduce_axis["down"] == 1  # attn[b, s, d]: along s
    assert sp.report.bytes_moved <= mg.report.bytes_moved
    assert max(sp.report.peak_memory.values()) < max(mg.report.peak_memory.values())
    small = edatalog.compile_string(LLAMA, name="llama_block.edl", dims=SMALL, dtype="f64")
    values = small.random_inputs(seed=0)
    want = small.run(values)["y"]
    got = edatalog.plan(small, topology="a100x4", strategy="megatron-sp").execute(values)["y"]
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
