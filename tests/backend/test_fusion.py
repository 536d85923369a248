"""Attention fusion (:mod:`edatalog.backend.lowering.fusion`): which chains are found, what fused device
programs look like, and that they compute the reference wherever they run.

- :func:`attention_chains` finds the five-rule softmax-attention chain of the LLaMA block (multi-
  head and grouped-query) and of ``attention.edl``, by structure; nothing in programs without one,
  nor in near misses (an intermediate read elsewhere or kept as an output, a softmax without its
  maximum, keys before queries, an unnormalized sum, a guard over a head index...), whose fused
  programs are then the programs themselves.
- :func:`fuse_programs` output verifies and round-trips through JSON, and equals the reference
  on torch (each fused op one ``scaled_dot_product_attention`` call) and on numpy (the simulator
  runs the inner kernels), for megatron, data, random and solved plans; for Megatron every device
  runs exactly one fused op; plans that cut the attention blocks (queries, keys, both) still give
  the reference, fused where a block's queries and keys sit on one device.
- Guards become masks: causal blocks use ``is_causal``, no guard no mask, a sliding window or an
  anti-causal guard an explicit boolean mask; a guard that leaves a query without keys is not fused
  (softmax over nothing is absent in the rules, NaN in the kernel).

The calls to torch's ``scaled_dot_product_attention`` are counted by a spy that passes every call
through to torch: the numbers compared are always computed.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import edatalog
from edatalog.backend.lowering.fusion import KIND, fuse_programs
from edatalog.backend.lowering.lowered import AS_SYNTHESIZED
from edatalog.backend.running import sim
from edatalog.errors import EdlWarning
from edatalog.ir import program as ir
from edatalog.ir.attention import Chain, attention_chains
from edatalog.solver.plan import NodePlan, Placement, Split, Tile
from edatalog.solver.plan import Plan as PlanIR
from edatalog.solver.strategies import place_by_consumers
from edatalog.solver.topology import preset

PROGRAMS = Path(__file__).resolve().parents[2] / "programs"
DIMS = {"B": 2, "S": 16, "D": 64, "H": 4, "F": 96}
HEADS = {"mha": 4, "gqa": 2}
CHAIN = ("sc", "mx", "p", "l", "o")
RTOL, ATOL = 1e-4, 1e-5


def _compile(text: str) -> edatalog.Program:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EdlWarning)
        return edatalog.compile_string(text, name="<attention>")


@functools.cache
def _llama(heads: str) -> edatalog.Program:
    return edatalog.compile(PROGRAMS / "llama_block.edl", dims={**DIMS, "KVH": HEADS[heads]})


@functools.cache
def _values(heads: str) -> dict[str, np.ndarray]:
    return _llama(heads).random_inputs(seed=0)


@functools.cache
def _reference(heads: str) -> dict[str, np.ndarray]:
    return _llama(heads).run(_values(heads))


def _fused_ops(programs: ir.Programs) -> list[list[ir.Fused]]:
    """The fused ops of each device."""
    return [[op for op in p.ops if isinstance(op, ir.Fused)] for p in programs.devices]


def _kernels_of(programs: ir.Programs, nodes: tuple[str, ...]) -> list[tuple[int, ir.Kernel]]:
    """The kernels of ``nodes`` left outside fused ops."""
    return [(d, op) for d, _, op in programs.ops() if isinstance(op, ir.Kernel) and op.node in nodes]


@dataclasses.dataclass
class Spy:
    """Every call of torch's scaled_dot_product_attention: the masks it was given."""

    calls: list[dict[str, Any]]

    def masks(self) -> list[str]:
        """``causal``, ``none`` or ``explicit`` per call."""
        out = []
        for kw in self.calls:
            if kw.get("is_causal"):
                out.append("causal")
            elif kw.get("attn_mask") is None:
                out.append("none")
            else:
                assert kw["attn_mask"].dtype == torch.bool
                out.append("explicit")
        return out


@pytest.fixture
def sdpa(monkeypatch: pytest.MonkeyPatch) -> Spy:
    """Counts the calls; each one is passed to torch's own function."""
    real: Callable[..., Any] = torch.nn.functional.scaled_dot_product_attention
    spy = Spy([])

    def counted(*args: Any, **kwargs: Any) -> Any:
        spy.calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    return spy


def _run_torch(prog: edatalog.Program, plan: edatalog.Plan, values: dict[str, Any]) -> tuple[Any, list[str]]:
    """The outputs on torch (logical devices on the CPU), and the labels of the ops it ran."""
    params = {r.name for r in prog.arguments if r.kind == "param"}
    exe = edatalog.executable(prog, plan, backend="torch", device="cpu")
    exe.load({k: v for k, v in values.items() if k in params})
    out = exe.run({k: v for k, v in values.items() if k not in params}, record=True)
    return out, [label for _, label, _, _ in exe.last_times]


def _run_numpy(prog: edatalog.Program, plan: edatalog.Plan, fused: ir.Programs, values: dict[str, Any]) -> Any:
    """The fused programs in the simulator: numpy runs each fused op's inner kernels."""
    return sim.run(dataclasses.replace(plan.lowering(AS_SYNTHESIZED), programs=fused), prog.prepare(values))


def _assert_round_trips(programs: ir.Programs) -> None:
    programs.verify()
    again = ir.Programs.from_json(programs.to_json())
    assert again == programs and again.fingerprint() == programs.fingerprint()


def _check_plan(prog: edatalog.Program, plan: edatalog.Plan, values: dict[str, Any]) -> tuple[ir.Programs, list[str]]:
    """Fused programs of ``plan`` that verify, round-trip, and equal the reference (presence
    included) on torch and on numpy; returned for further checks, with the labels of the ops
    the torch runtime ran."""
    fused = fuse_programs(plan.schedule.programs, prog.graph)
    _assert_round_trips(fused)
    want = prog.evaluate(values, keep=prog.outputs)
    got, labels = _run_torch(prog, plan, values)
    on_numpy = _run_numpy(prog, plan, fused, values)
    n_fused = sum(len(f) for f in _fused_ops(fused))
    assert sum(label.startswith(KIND) for label in labels) == n_fused
    for name in prog.outputs:
        w = want[name]
        mask = np.ones(w.data.shape, dtype=bool) if w.present is None else w.present
        for what, data, present in (
            ("torch", got.values[name], got.present[name]),
            ("numpy", on_numpy[name].data, on_numpy[name].present),
        ):
            if isinstance(data, torch.Tensor):
                data = data.numpy()
                present = None if present is None else present.numpy()
            assert np.array_equal(np.ones(mask.shape, dtype=bool) if present is None else present, mask), (
                f"{name} on {what}: presence"
            )
            np.testing.assert_allclose(data, w.data, rtol=RTOL, atol=ATOL, err_msg=f"{name} on {what}")
            assert np.all(data[~mask] == 0), f"{name} on {what}: absent cells must read 0"
    return fused, labels


# -- finding chains --------------------------------------------------------------------------------


@pytest.mark.parametrize("heads", sorted(HEADS))
def test_the_chain_of_the_llama_block_is_found(heads: str) -> None:
    (chain,) = attention_chains(_llama(heads).graph)
    graph = _llama(heads).graph
    assert chain.nodes == CHAIN
    sc, o = graph.node("sc"), graph.node("o")
    assert (sc.inputs[chain.q].relation, sc.inputs[chain.k].relation) == ("qr", "kr")
    assert o.inputs[chain.v].relation == "v"
    assert chain.scale == pytest.approx(1 / math.sqrt(DIMS["D"] // DIMS["H"]))


def test_chains_are_found_by_structure_not_by_names() -> None:
    prog = edatalog.compile(PROGRAMS / "attention.edl", dims={"S": 8, "D": 32, "H": 2})
    assert attention_chains(prog.graph) == [Chain("sc", "m", "p", "l", "o", 0, 1, 1, 0.25)]
    renamed = _compile(ATTENTION.format(guard="where t <= s").replace("sc[", "zz[").replace("l[", "norm["))
    (chain,) = attention_chains(renamed.graph)
    assert (chain.scores, chain.sums) == ("zz", "norm")


@pytest.mark.parametrize(("topology", "strategy"), [("cpux1", "replicate"), ("cpux2", "megatron")])
def test_a_chain_with_its_log_sum_exp_exports_it_from_the_fused_block(topology: str, strategy: str) -> None:
    """The rows' log-sum-exp (what a training step keeps for the backward) joins the chain: each
    block's fused op makes it beside ``o``, as torch's flash attention returns it, and both
    equal the reference on torch and on numpy."""
    text = _edit(CAUSAL, "output o.", "output o, lse.") + "lse[b, h, s] = m[b, h, s] + log(l[b, h, s]).\n"
    prog = _compile(text)
    (chain,) = attention_chains(prog.graph)
    assert chain.lse == "lse" and chain.nodes == ("sc", "m", "p", "l", "o", "lse")
    plan = edatalog.plan(prog, topology=topology, strategy=strategy)
    fused, _ = _check_plan(prog, plan, prog.random_inputs(3))
    for ops in _fused_ops(fused):
        assert [len(op.exports) for op in ops] == [1] * len(ops) and ops
        for op in ops:
            assert [k.node for k in op.exported if isinstance(k, ir.Kernel)] == ["lse"] and op.body[-1].buf == op.buf


@pytest.mark.parametrize("name", ["mlp.edl", "softmax.edl"])
def test_programs_without_attention_have_no_chain(name: str) -> None:
    prog = edatalog.compile(PROGRAMS / name, dims={"B": 4, "D": 16, "F": 24} if name == "mlp.edl" else {"C": 10})
    assert attention_chains(prog.graph) == []
    plan = edatalog.plan(prog, topology="cpux2", strategy="random", seed=1)
    assert fuse_programs(plan.schedule.programs, prog.graph) is plan.schedule.programs


# One attention head block over small dims; {guard} is the scores' guard.
ATTENTION = """
dim B = 2, S = 8, D = 32, H = 2, E = D / H.
input x[B, S, D] : f32.
param wq[H * E, D] : f32.
param wk[H * E, D] : f32.
param wv[H * E, D] : f32.
output o.
q[b, s, h, e] += x[b, s, d] * wq[(h, e), d].
k[b, t, h, e] += x[b, t, d] * wk[(h, e), d].
v[b, t, h, e] += x[b, t, d] * wv[(h, e), d].
sc[b, h, s, t] += q[b, s, h, e] * k[b, t, h, e] / sqrt(E) {guard}.
m[b, h, s] max= sc[b, h, s, t].
p[b, h, s, t] = exp(sc[b, h, s, t] - m[b, h, s]).
l[b, h, s] += p[b, h, s, t].
o[b, s, h, e] += p[b, h, s, t] * v[b, t, h, e] / l[b, h, s].
"""
CAUSAL = ATTENTION.format(guard="where t <= s")


def _edit(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new)


NEAR_MISSES = {
    "scores read by another rule": _edit(CAUSAL, "output o.", "output o, z.") + "z[b, h, s] += sc[b, h, s, t].\n",
    "probabilities read by another rule": _edit(CAUSAL, "output o.", "output o, z.")
    + "z[b, h, s] max= p[b, h, s, t].\n",
    "maxima are an output": _edit(CAUSAL, "output o.", "output o, m."),
    "softmax without its maximum": _edit(
        _edit(CAUSAL, "m[b, h, s] max= sc[b, h, s, t].\n", ""),
        "exp(sc[b, h, s, t] - m[b, h, s])",
        "exp(sc[b, h, s, t])",
    ),
    "keys before queries": CAUSAL.replace("h, s, t]", "h, t, s]"),
    "no normalization": _edit(_edit(CAUSAL, "l[b, h, s] += p[b, h, s, t].\n", ""), " / l[b, h, s].", " * 0.5."),
    "scores scaled by a param": _edit(
        _edit(CAUSAL, "param wv[H * E, D] : f32.", "param wv[H * E, D] : f32.\nparam temp[H] : f32."),
        "/ sqrt(E)",
        "* temp[h]",
    ),
    "a guard over the head": ATTENTION.format(guard="where t <= s + h"),
    "maxima and sums read by a difference": _edit(CAUSAL, "output o.", "output o, z.")
    + "z[b, h, s] = m[b, h, s] - log(l[b, h, s]).\n",
    "maxima and sums read by a scaled log-sum-exp": _edit(CAUSAL, "output o.", "output o, z.")
    + "z[b, h, s] = m[b, h, s] + 2.0 * log(l[b, h, s]).\n",
    "two log-sum-exps": _edit(CAUSAL, "output o.", "output o, z, y.")
    + "z[b, h, s] = m[b, h, s] + log(l[b, h, s]).\ny[b, h, s] = m[b, h, s] + log(l[b, h, s]).\n",
    "a maximum over the queries": _edit(
        _edit(CAUSAL, "m[b, h, s] max= sc[b, h, s, t].", "m[b, h, t] max= sc[b, h, s, t]."),
        "exp(sc[b, h, s, t] - m[b, h, s])",
        "exp(sc[b, h, s, t] - m[b, h, t])",
    ),
}


@pytest.mark.parametrize("case", sorted(NEAR_MISSES))
def test_near_misses_are_not_chains_and_run_unchanged(case: str) -> None:
    prog = _compile(NEAR_MISSES[case])
    assert attention_chains(prog.graph) == []
    values = prog.random_inputs(3)
    for topology, strategy in (("cpux1", "replicate"), ("cpux2", "megatron")):
        plan = edatalog.plan(prog, topology=topology, strategy=strategy)
        assert fuse_programs(plan.schedule.programs, prog.graph) is plan.schedule.programs
        fused, _ = _check_plan(prog, plan, values)
        assert _fused_ops(fused) == [[]] * plan.ir.n_devices


# -- fused LLaMA plans --------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("heads", sorted(HEADS))
def test_megatron_runs_one_fused_attention_per_device(heads: str, n: int, sdpa: Spy) -> None:
    """Heads split across devices: each device's attention block is whole on it, fused into one op
    (the five kernels gone), run by one causal SDPA call on torch, by its inner kernels on numpy."""
    prog = _llama(heads)
    plan = edatalog.plan(prog, topology=f"a100x{n}", strategy="megatron")
    fused, labels = _check_plan(prog, plan, _values(heads))
    assert [len(f) for f in _fused_ops(fused)] == [1] * n
    assert _kernels_of(fused, CHAIN) == []
    for (op,) in _fused_ops(fused):
        assert op.kind == KIND and op.relation == "o"
        assert [k.node for k in op.kernels] == list(CHAIN)
    assert sdpa.masks() == ["causal"] * n
    assert labels.count("attention (sc + mx + p + l + o)") == n


@pytest.mark.parametrize(
    ("strategy", "topology"),
    [
        ("megatron", "2x4"),
        ("megatron", "cpux3"),
        ("data", "cpux2"),
        ("data", "cpux3"),
        ("replicate", "cpux2"),
        ("random", "cpux2"),
        pytest.param("random", "cpux3", marks=pytest.mark.slow),
        ("auto", "cpux2"),
    ],
)
@pytest.mark.parametrize("heads", sorted(HEADS))
def test_fused_plans_of_llama_equal_the_reference(heads: str, strategy: str, topology: str) -> None:
    """Whatever the plan, every attention block whose kernels sit whole on one device is fused,
    and the fused programs equal the reference on torch and on numpy."""
    prog = _llama(heads)
    plan = edatalog.plan(prog, topology=topology, strategy=strategy, seed=3, time_limit=1.0)
    fused, _ = _check_plan(prog, plan, _values(heads))
    if strategy in ("megatron", "data", "replicate", "auto"):
        # The chain's rules are never cut along the key index: everything fuses.
        assert _kernels_of(fused, CHAIN) == []
        assert sum(len(f) for f in _fused_ops(fused)) >= 1
    if strategy == "data":  # each device has its own sequence
        assert [len(f) for f in _fused_ops(fused)] == [1] * min(plan.ir.n_devices, DIMS["B"]) + [0] * max(
            0, plan.ir.n_devices - DIMS["B"]
        )


# -- plans that cut attention blocks ------------------------------------------------------------------


def _cut_plan(prog: edatalog.Program, n: int, parts: dict[str, int], nodes: tuple[str, ...]) -> edatalog.Plan:
    """Every rule whole on device 0, except ``nodes``: their indices cut into ``parts``, each
    block on the device given by its pieces (the sum of their numbers, modulo ``n``), so that the
    blocks of different rules over the same pieces (same index names) share a device."""
    graph = prog.graph
    tiles = {}
    for node in graph.nodes:
        if node.name in nodes:
            splits = tuple(Split.even(i.name, i.extent, parts.get(i.name, 1)) for i in node.indices)
            pieces = itertools.product(*(range(s.parts) for s in splits))
            tiles[node.name] = Tile(splits, tuple((sum(p) % n,) for p in pieces))
        else:
            tiles[node.name] = Tile.whole(node.box, [0])
    machine = preset(f"cpux{n}")
    placed = tuple(
        Placement(r.name, place_by_consumers(graph, tiles, r.name, n)) for r in graph.relations if r.kind != "derived"
    )
    plan = PlanIR(
        graph.fingerprint(), n, machine.name, "cut", tuple(NodePlan(k.name, tiles[k.name]) for k in graph.nodes), placed
    )
    return edatalog.Plan(plan, graph, machine)


@pytest.mark.parametrize(
    ("parts", "fused_per_device"),
    [
        ({"s": 2}, [1, 1]),  # queries cut: each half whole on a device, fused
        ({"s": 3, "g": 2}, [3, 3]),  # queries in three, key/value heads in two
        ({"t": 2}, [0, 0]),  # keys cut: partial maxima and sums cross devices, nothing fused
        ({"s": 2, "t": 2}, None),  # both: the block whose keys are all masked is empty
    ],
)
def test_attention_blocks_cut_by_the_plan_still_give_the_reference(
    parts: dict[str, int], fused_per_device: list[int] | None, sdpa: Spy
) -> None:
    prog = _llama("gqa")
    plan = _cut_plan(prog, 2, parts, CHAIN)
    fused, _ = _check_plan(prog, plan, _values("gqa"))
    counts = [len(f) for f in _fused_ops(fused)]
    if fused_per_device is not None:
        assert counts == fused_per_device
    assert len(sdpa.calls) == sum(counts)
    if "s" in parts and "t" not in parts:
        # The later query blocks see keys before their own: a mask that is no plain lower triangle.
        assert "explicit" in sdpa.masks()
    if "t" not in parts:
        assert _kernels_of(fused, CHAIN) == []


# -- guards as masks ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("guard", "mask"),
    [
        ("where t <= s", "causal"),
        ("", "none"),
        ("where t >= s", "explicit"),  # anti-causal: every query has at least itself
        ("where t != s + 1", "explicit"),
        ("where t < s", "causal"),  # the first query, without keys, is cut off the block
    ],
)
@pytest.mark.parametrize(("topology", "strategy"), [("cpux1", "replicate"), ("cpux2", "megatron")])
def test_guards_become_attention_masks(guard: str, mask: str, topology: str, strategy: str, sdpa: Spy) -> None:
    prog = _compile(ATTENTION.format(guard=guard))
    assert len(attention_chains(prog.graph)) == 1
    plan = edatalog.plan(prog, topology=topology, strategy=strategy)
    fused, _ = _check_plan(prog, plan, prog.random_inputs(4))
    assert [len(f) for f in _fused_ops(fused)] == [1] * plan.ir.n_devices
    assert sdpa.masks() == [mask] * plan.ir.n_devices


@pytest.mark.parametrize(("topology", "strategy"), [("cpux1", "replicate"), ("cpux2", "megatron")])
def test_a_sliding_window_becomes_an_explicit_mask(topology: str, strategy: str, sdpa: Spy) -> None:
    """Each query attends to itself and the two keys before it.  The guard is a band, which the
    evaluator walks by an offset index (``t = s + t_off - 2``): the fused kernel must still see
    the chain's plain indices."""
    prog = _compile(ATTENTION.format(guard="where t <= s, t >= s - 2"))
    assert len(attention_chains(prog.graph)) == 1
    plan = edatalog.plan(prog, topology=topology, strategy=strategy)
    fused, _ = _check_plan(prog, plan, prog.random_inputs(4))
    assert [len(f) for f in _fused_ops(fused)] == [1] * plan.ir.n_devices
    assert sdpa.masks() == ["explicit"] * plan.ir.n_devices


def test_a_query_without_keys_inside_a_block_is_not_fused(sdpa: Spy) -> None:
    """With ``2 * t == s`` every odd query has no key: its row of ``o`` is absent, as the rules
    say (SDPA would make it NaN), so no block holding one is fused.  Cut along the queries
    ``0..3`` and ``4..7``, neither block can drop its odd queries: nothing fuses either."""
    prog = _compile(ATTENTION.format(guard="where 2 * t == s"))
    assert len(attention_chains(prog.graph)) == 1
    values = prog.random_inputs(5)
    present = prog.evaluate(values)["o"].present
    assert present is not None
    assert present[:, ::2].all() and not present[:, 1::2].any()
    for plan in (
        edatalog.plan(prog, topology="cpux2", strategy="megatron"),
        _cut_plan(prog, 2, {"s": 2}, ("sc", "m", "p", "l", "o")),
    ):
        fused, _ = _check_plan(prog, plan, values)
        assert _fused_ops(fused) == [[], []]
    assert sdpa.calls == []


def test_a_block_cut_off_its_query_without_keys_is_fused(sdpa: Spy) -> None:
    """With ``t < s`` only query 0 has no key.  Cut along the queries, the first block's kernels
    start at query 1 (the support tightens it) and both blocks fuse, with masks that are no
    plain lower triangle."""
    prog = _compile(ATTENTION.format(guard="where t < s"))
    values = prog.random_inputs(5)
    cut = _cut_plan(prog, 2, {"s": 2}, ("sc", "m", "p", "l", "o"))
    fused, _ = _check_plan(prog, cut, values)
    assert [len(f) for f in _fused_ops(fused)] == [1, 1]
    (first,) = _fused_ops(fused)[0]
    assert first.kernels[0].range_map["s"] == (1, 4)
    # Queries 1..3 over keys 0..2 are a lower triangle again; queries 4..7 over keys 0..6 are not.
    assert sorted(sdpa.masks()) == ["causal", "explicit"]


def test_fused_attention_never_holds_the_scores_and_peak_memory_says_so() -> None:
    """At S=2048 with 2 heads the scores are 2·2048·2048 f32 cells (32 MiB); fused, the
    program's buffers peak far below that (inputs, weights, q, k, v and the output: about
    1 MiB), and ``exe.peak_memory()`` reports it."""
    prog = edatalog.compile(PROGRAMS / "attention.edl", dims={"B": 1, "S": 2048, "D": 32, "H": 2})
    values = prog.random_inputs(0)
    exe = edatalog.executable(prog, backend="torch", device="cpu")
    with pytest.raises(edatalog.EdlError, match="nothing has run yet"):
        exe.peak_memory()
    exe.load({k: v for k, v in values.items() if k != "x"})
    out = exe({"x": values["x"]})["y"]
    np.testing.assert_allclose(out.numpy(), prog.run(values)["y"], rtol=1e-4, atol=1e-5)
    peak = exe.peak_memory()
    scores = 2 * 2048 * 2048 * 4
    everything_else = sum(r.nbytes for r in prog.graph.relations if r.name not in ("sc", "m", "p", "l"))
    assert set(peak) == {0} and 0 < peak[0] <= everything_else < scores // 8, (peak, everything_else)
    assert exe.peak_memory() is not exe.peak_memory()  # a copy: the caller may keep it
