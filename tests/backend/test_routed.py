"""Routed contractions (:mod:`edatalog.backend.kernels.routed`): a mixture of experts' layer,
each token's rows multiplied by the experts its router picks as one grouped GEMM, against the
numpy reference (which gathers), transformers' ``MixtralSparseMoeBlock``, and under plans that
split the experts across logical devices (expert parallelism: a block over part of the experts
takes the tokens routed there)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import edatalog
from edatalog.backend.running.compiled import CompiledExecutable
from edatalog.errors import EdlWarning
from edatalog.ir import program as ir

MOE = Path(__file__).resolve().parents[2] / "programs" / "moe_layer.edl"
SMALL = {"T": 16, "D": 32, "F": 48, "X": 8, "K": 2}


def _compile(dims: dict[str, int] | None = None, **kw: Any) -> edatalog.Program:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EdlWarning)
        return edatalog.compile(MOE, dims={**SMALL, **(dims or {})}, **kw)


def mixtral_layer_params(gate: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
    """programs/moe_layer.edl's params from transformers' ``MixtralSparseMoeBlock`` tensors (its
    weights, or their gradients): the router, the experts' fused gate-up projection ``[X, 2F,
    D]`` split into ``w1`` (gate) and ``w3`` (up), and the down projection."""
    f = gate_up.shape[1] // 2
    gate_up = gate_up.detach()
    return {
        "wg": gate.detach(),
        "w1": gate_up[:, :f].contiguous(),
        "w3": gate_up[:, f:].contiguous(),
        "w2": down.detach(),
    }


def _split(prog: edatalog.Program, values: dict[str, np.ndarray]) -> tuple[dict[str, Any], dict[str, Any]]:
    params = {r.name for r in prog.arguments if r.kind == "param"}
    return (
        {k: torch.tensor(v) for k, v in values.items() if k in params},
        {k: torch.tensor(v) for k, v in values.items() if k not in params},
    )


@pytest.mark.parametrize(("dtype", "tol"), [("f32", 1e-5), ("f64", 1e-12)])
def test_expert_rules_run_as_grouped_gemms_and_equal_the_reference(
    dtype: str, tol: float, routed_calls: list[str]
) -> None:
    """f32 takes ``torch._grouped_mm``; f64 (which that kernel does not take) loops over the
    experts when interpreted and is recorded with every expert over every row, masked.  Both
    replay their graphs."""
    exe = _equals_the_reference(_compile(dtype=dtype), None, seed=1, tol=tol)
    assert sorted(set(routed_calls)) == ["h1", "h3", "y"]
    assert _replayed(exe)  # f64 too: recorded with every expert over every row, masked


def _equals_the_reference(prog: edatalog.Program, plan: Any, seed: int, tol: float = 1e-5) -> Any:
    """Run ``prog`` (under ``plan``) on torch three times, interpreted, recorded and replayed,
    each against the reference; the executable."""
    values = prog.random_inputs(seed=seed)
    want = prog.run(values)["y"]
    params, inputs = _split(prog, values)
    exe = edatalog.executable(prog, plan, backend="torch")
    exe.load(params)
    for call in ("interpreted", "recorded", "replayed"):
        got = exe(inputs)["y"].numpy()
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max(), err_msg=call)
    return exe


def _replayed(exe: Any) -> bool:
    return isinstance(exe._impl, CompiledExecutable) and bool(exe._impl.replays)


@pytest.mark.parametrize(("machine", "seed"), [("cpux2", 0), ("cpux2", 1), ("a100x4", 2), ("a100x4", 3)])
def test_expert_parallel_blocks_equal_the_reference(machine: str, seed: int, routed_calls: list[str]) -> None:
    """Random plans split the experts (and tokens, and features) unevenly: each block takes
    the points routed to its experts, the others are absent there."""
    prog = _compile()
    plan = edatalog.plan(prog, topology=machine, strategy="random", seed=seed)
    exe = _equals_the_reference(prog, plan, seed=seed)
    assert routed_calls and _replayed(exe)


def test_the_moe_layer_equals_transformers_mixtral_block_in_f64() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral import modeling_mixtral

    t, d, f, e, k = (SMALL[n] for n in ("T", "D", "F", "X", "K"))
    cfg = transformers.MixtralConfig(hidden_size=d, intermediate_size=f, num_local_experts=e, num_experts_per_tok=k)
    torch.manual_seed(0)
    block = modeling_mixtral.MixtralSparseMoeBlock(cfg).double().eval()  # type: ignore[no-untyped-call]
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    params = mixtral_layer_params(block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj)
    x = torch.randn(t, d, dtype=torch.float64)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = block(x[None])[0].numpy()
    prog = _compile(dtype="f64")
    exe = edatalog.executable(prog, None, backend="torch")
    exe.load(params)
    got = exe({"x": x})["y"].numpy()
    # transformers computes the router's softmax in f32 (``dtype=torch.float``): 3e-8 here.
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()
    ref = prog.run({"x": x.numpy(), **{n: v.numpy() for n, v in params.items()}})["y"]
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)


def test_flops_of_the_expert_rules_are_k_over_e_of_the_dense_form() -> None:
    """Each token's rows meet the K experts it is routed to, not all X."""
    prog = _compile(dims={"T": 512, "D": 1024, "F": 2816})
    costs = prog.graph.costs
    routed = sum(costs[n].flops for n in ("h1", "h3", "y"))
    dense = 3 * 2 * 512 * 8 * 2816 * 1024  # three GEMMs of every token by every expert
    assert routed == pytest.approx(2 / 8 * dense, rel=0.10)


def test_expert_parallelism_keeps_each_experts_rows_on_its_device(routed_calls: list[str]) -> None:
    """Under the expert strategy the expert rules and the rule between them (which carries the
    route, :mod:`edatalog.rules.routes`) split the experts alike: each device reads only the
    pieces of ``h1``, ``h3`` and ``a`` routed to its own experts, so none of them moves and none
    is reduced.  What crosses the devices is the tokens (``x``, the gates) and ``y``'s partial
    sums.  The run equals the reference, interpreted and replayed."""
    prog = _compile({"T": 24})  # dims of its own: no plan or graph another test made is reused
    plan = edatalog.plan(prog, topology="cpux2", strategy="expert")
    assert all(s.parts == 2 for n in ("h1", "h3", "a", "y") for s in plan.ir.node(n).tile.splits if s.index == "e")
    ops = [op for _, _, op in plan.schedule.programs.ops()]
    moved = {op.relation for op in ops if isinstance(op, ir.Recv)}
    combined = {op.relation for op in ops if isinstance(op, ir.Combine)}
    assert moved and not moved & {"h1", "h3", "a"}, moved
    assert combined == {"y"}, combined
    _equals_the_reference(prog, plan, seed=4)
    assert set(routed_calls) == {"h1", "h3", "y"}  # y reads a's routed pieces: still a grouped GEMM


def test_a_block_that_carries_the_route_over_part_of_the_experts_is_elementwise() -> None:
    """``a``'s block over experts 0..3 is the rule without its filter, masked where the route
    falls elsewhere: no gather (the general path's), and its cells are exactly those."""
    from edatalog.backend.kernels.arrays import TORCH
    from edatalog.backend.kernels.joinagg import evaluate_node
    from edatalog.backend.kernels.prepared import general_path
    from edatalog.ir.rewrite import restrict

    prog = _compile()
    node = prog.graph.node("a")
    block = restrict(node, {**{i.name: (0, i.extent) for i in node.indices}, "e": (0, 4)})
    assert not general_path(block)
    t, k, f = (SMALL[n] for n in ("T", "K", "F"))
    route = torch.randint(0, 8, (t, k))
    data = [torch.randn(t, k, f), torch.randn(t, k, f), torch.rand(t, k), torch.rand(t) + 1, route]
    assert [a.relation for a in node.inputs] == ["h1", "h3", "p", "z", "route"]
    value, present, out_vars = evaluate_node(block, data, [None] * 5, TORCH)
    assert out_vars == ["t", "k", "f"] and present is not None
    np.testing.assert_array_equal(present.expand(t, k, f).numpy(), (route < 4)[:, :, None].expand(t, k, f).numpy())
    h1, h3, p, z = data[:4]
    want = torch.nn.functional.silu(h1) * h3 * (p / z[:, None])[:, :, None]
    np.testing.assert_allclose(torch.where(present, value, 0).numpy(), torch.where(present, want, 0).numpy(), rtol=1e-6)
