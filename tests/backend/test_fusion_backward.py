"""The fused backward of attention (:mod:`edatalog.ir.attention_backward` and the backward groups
of :mod:`edatalog.backend.lowering.fusion`).

- :func:`attention_backwards` finds the eight rules ``edatalog.grad`` writes for each attention
  chain (its scores and normalized probabilities made again from the log-sum-exp the forward
  keeps, the gradients of its rows, probabilities and scores, and those of q, k and v), by
  structure: in the LLaMA training step (one per layer, grouped-query heads) and with only some
  of q, k, v needing a gradient; not after an edit that changes what they compute (a sign, a
  scale, a guard).
- The fused programs verify and round-trip through JSON; a block whose rules sit whole on one
  device becomes one fused op (the gradients of k and v exported beside q's, the forward's
  log-sum-exp beside its output); on torch each forward runs torch's CPU flash attention (which
  returns the log-sum-exp) and each backward its flash backward alone, never the forward again;
  elsewhere (forced here on the CPU) the log-sum-exp from the scores and torch's attention
  forward and backward; on numpy its inner kernels; all equal the reference (f64, every guard
  kind: causal, none, anti-causal, a sliding window; multi-head and grouped-query; one device,
  the batch, the key heads or the queries split; keys split, where the rules run; random plans).

Torch's attention entry points are counted by a spy that passes every call through to torch:
the numbers compared are always computed.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import edatalog
from edatalog.backend.lowering.fusion import KIND_BACKWARD, fuse_programs
from edatalog.backend.lowering.lowered import AS_SYNTHESIZED
from edatalog.backend.running import sim
from edatalog.errors import EdlWarning
from edatalog.ir import program as ir
from edatalog.ir.attention_backward import attention_backwards
from edatalog.ir.graph import Graph
from edatalog.ir.scalar import Const, Op
from edatalog.solver.plan import NodePlan, Placement, Split, Tile
from edatalog.solver.plan import Plan as PlanIR
from edatalog.solver.strategies import place_by_consumers
from edatalog.solver.topology import preset
from edatalog.train_job import CROSS_ENTROPY
from edatalog.training import step_program

PROGRAMS = Path(__file__).resolve().parents[2] / "programs"

# Grouped-query attention (G key heads, R query heads each), a loss weighing every output cell.
ATTENTION = """
dim B = 2, S = 8, D = 16, G = {g}, R = {r}, E = 4.
input x[B, S, D] : f64.
input c[B, S, G, R, E] : f64.
param wq[G * R * E, D] : f64.
param wk[G * E, D] : f64.
{v_kind} wv[G * E, D] : f64.
output loss.
q[b, s, g, r, e] += x[b, s, d] * wq[(g, r, e), d].
k[b, t, g, e] += x[b, t, d] * wk[(g, e), d].
v[b, t, g, e] += x[b, t, d] * wv[(g, e), d].
sc[b, g, r, s, t] += q[b, s, g, r, e] * k[b, t, g, e] / sqrt(E) {guard}.
mx[b, g, r, s] max= sc[b, g, r, s, t].
p[b, g, r, s, t] = exp(sc[b, g, r, s, t] - mx[b, g, r, s]).
l[b, g, r, s] += p[b, g, r, s, t].
o[b, s, g, r, e] += p[b, g, r, s, t] * v[b, t, g, e] / l[b, g, r, s].
loss[] += o[b, s, g, r, e] * c[b, s, g, r, e].
"""
GUARDS = {
    "causal": "where t <= s",
    "none": "",
    "anti-causal": "where t >= s",
    "window": "where t <= s, t >= s - 2",
}
RTOL, ATOL = 1e-9, 1e-11


def _grads(guard: str = "causal", heads: str = "gqa", v_kind: str = "param") -> edatalog.Program:
    g, r = (2, 2) if heads == "gqa" else (4, 1)
    text = ATTENTION.format(g=g, r=r, guard=GUARDS[guard], v_kind=v_kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EdlWarning)
        return edatalog.grad(edatalog.compile_string(text, name="<attention>"))


FORWARD = "_scaled_dot_product_flash_attention_for_cpu"
BACKWARD = f"{FORWARD}_backward"


@dataclasses.dataclass
class Spy:
    calls: dict[str, int] = dataclasses.field(default_factory=dict)


@pytest.fixture
def sdpa(monkeypatch: pytest.MonkeyPatch) -> Spy:
    """Counts the calls of torch's attention and of its CPU flash forward and backward; each one
    is passed to torch's own function."""
    spy = Spy()

    def counting(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            spy.calls[name] = spy.calls.get(name, 0) + 1
            return real(*args, **kwargs)

        return counted

    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting("sdpa", real))
    for name in (FORWARD, BACKWARD):
        monkeypatch.setattr(torch.ops.aten, name, counting(name, getattr(torch.ops.aten, name)))
    return spy


def _backward_ops(programs: ir.Programs) -> list[list[ir.Fused]]:
    return [[op for op in p.ops if isinstance(op, ir.Fused) and op.kind == KIND_BACKWARD] for p in programs.devices]


# -- finding the backward -------------------------------------------------------------------------


def test_each_layer_of_the_llama_training_step_has_its_backward_found() -> None:
    text = (PROGRAMS / "llama.edl").read_text() + CROSS_ENTROPY
    dims = {"B": 1, "S": 4, "D": 16, "H": 4, "KVH": 2, "F": 24, "V": 11, "L": 2}
    prog = edatalog.compile_string(text, name="llama.edl", dims=dims, outputs=["loss"])
    step, _ = step_program(prog)
    found = attention_backwards(step.graph)
    assert [b.chain.out for b in found] == ["layers.0.o", "layers.1.o"]
    for b in found:
        assert b.grad_q is not None and b.grad_k is not None and b.grad_v is not None
        assert step.graph.node(b.grad_v).out.startswith("grad_layers.") and b.grad_out.endswith(".o")


def test_only_the_gradients_asked_for_are_results() -> None:
    """v from an input: no gradient of v is made, and the backward is still found."""
    (b,) = attention_backwards(_grads(v_kind="input").graph)
    assert b.grad_v is None and b.results == (b.grad_q, b.grad_k)


def _edited(graph: Graph, rule: str, edit: Callable[[Any], Any]) -> Graph:
    nodes = tuple(edit(n) if n.name == rule else n for n in graph.nodes)
    return dataclasses.replace(graph, nodes=nodes)


def test_an_edit_that_changes_what_the_rules_compute_is_not_the_backward() -> None:
    graph = _grads().graph
    (b,) = attention_backwards(graph)

    def minus(n: Any) -> Any:  # grad_sc = p' * (grad_p - grad_l)
        nodes = tuple(Op("sub", x.args) if isinstance(x, Op) and x.op == "add" else x for x in n.expr.nodes)
        return dataclasses.replace(n, expr=dataclasses.replace(n.expr, nodes=nodes))

    def rescaled(n: Any) -> Any:  # grad_q's scale doubled
        nodes = tuple(Const(2.0 * float(x.value)) if isinstance(x, Const) else x for x in n.expr.nodes)
        return dataclasses.replace(n, expr=dataclasses.replace(n.expr, nodes=nodes))

    def unguarded(n: Any) -> Any:  # grad_v over every key
        return dataclasses.replace(n, guard=graph.node(b.chain.out).guard.true())

    assert b.grad_q is not None and b.grad_v is not None
    for rule, edit in ((b.grad_scores, minus), (b.grad_q, rescaled), (b.grad_v, unguarded)):
        assert attention_backwards(_edited(graph, rule, edit)) == [], rule


# -- fused programs -----------------------------------------------------------------------------------


def _check(prog: edatalog.Program, plan: edatalog.Plan) -> ir.Programs:
    """The fused programs of ``plan`` verify, round-trip, and equal the reference on torch and
    on numpy (whose simulator runs each fused op's inner kernels)."""
    fused = fuse_programs(plan.schedule.programs, prog.graph)
    fused.verify()
    assert ir.Programs.from_json(fused.to_json()) == fused
    values = prog.random_inputs(seed=5)
    want = prog.run(values)
    params = {r.name for r in prog.arguments if r.kind == "param"}
    exe = edatalog.executable(prog, plan, backend="torch", device="cpu")
    exe.load({k: v for k, v in values.items() if k in params})
    on_torch = exe.run({k: v for k, v in values.items() if k not in params})
    lowered = dataclasses.replace(plan.lowering(AS_SYNTHESIZED), programs=fused)
    on_numpy = sim.run(lowered, prog.prepare(values))
    for name in prog.outputs:
        np.testing.assert_allclose(np.asarray(on_torch.values[name]), want[name], rtol=RTOL, atol=ATOL, err_msg=name)
        np.testing.assert_allclose(on_numpy[name].data, want[name], rtol=RTOL, atol=ATOL, err_msg=name)
    return fused


@pytest.mark.parametrize("guard", sorted(GUARDS))
@pytest.mark.parametrize(
    ("heads", "topology", "strategy"),
    [
        ("mha", "cpux1", "replicate"),
        ("gqa", "cpux1", "replicate"),
        ("mha", "cpux2", "data"),
        ("gqa", "cpux2", "data"),
    ],
)
def test_whole_blocks_run_one_fused_backward_each(
    guard: str, heads: str, topology: str, strategy: str, sdpa: Spy
) -> None:
    prog = _grads(guard, heads)
    plan = edatalog.plan(prog, topology=topology, strategy=strategy)
    fused = _check(prog, plan)
    ops = _backward_ops(fused)
    assert [len(d) for d in ops] == [1] * plan.ir.n_devices
    for (op,) in ops:
        assert len(op.exports) == 2 and op.internal.isdisjoint(op.exports)
    # Each device: one flash forward (its log-sum-exp kept) and one flash backward alone.
    n = plan.ir.n_devices
    assert sdpa.calls == {FORWARD: n, BACKWARD: n}


def test_without_cpu_flash_entry_points_the_blocks_compute_the_same(monkeypatch: pytest.MonkeyPatch, sdpa: Spy) -> None:
    """Where torch's CPU flash entry points do not serve (a GPU), the forward computes the
    log-sum-exp from the scores and the backward runs torch's attention forward and backward."""
    from edatalog.backend.kernels import attention

    monkeypatch.setattr(attention, "flash_on_cpu", lambda x: False)
    prog = _grads("window", "gqa")
    plan = edatalog.plan(prog, topology="cpux2", strategy="data")
    _check(prog, plan)
    assert sdpa.calls == {"sdpa": 2 * plan.ir.n_devices}


def _cut_plan(prog: edatalog.Program, parts: dict[str, int]) -> edatalog.Plan:
    """Two devices: every rule with an index of ``parts`` cut along it, each block on the device
    its pieces add up to (modulo 2), so that blocks of different rules over the same pieces share
    one; every other rule whole on device 0."""
    graph = prog.graph
    tiles = {}
    for node in graph.nodes:
        if any(i.name in parts for i in node.indices):
            splits = tuple(Split.even(i.name, i.extent, parts.get(i.name, 1)) for i in node.indices)
            pieces = itertools.product(*(range(s.parts) for s in splits))
            tiles[node.name] = Tile(splits, tuple((sum(p) % 2,) for p in pieces))
        else:
            tiles[node.name] = Tile.whole(node.box, [0])
    machine = preset("cpux2")
    placed = tuple(
        Placement(r.name, place_by_consumers(graph, tiles, r.name, 2)) for r in graph.relations if r.kind != "derived"
    )
    nodes = tuple(NodePlan(k.name, tiles[k.name]) for k in graph.nodes)
    return edatalog.Plan(PlanIR(graph.fingerprint(), 2, machine.name, "cut", nodes, placed), graph, machine)


@pytest.mark.parametrize(
    ("parts", "fused_per_device"),
    [
        ({"g": 2}, [1, 1]),  # key heads split: each device's heads whole
        ({"s": 2}, [1, 1]),  # queries split: q's gradient whole, k's and v's partial sums combined
        ({"t": 2}, [0, 0]),  # keys split: partial maxima and sums cross devices, the rules run
    ],
)
def test_plans_cut_along_heads_queries_or_keys(parts: dict[str, int], fused_per_device: list[int]) -> None:
    prog = _grads("causal", "gqa")
    fused = _check(prog, _cut_plan(prog, parts))
    assert [len(d) for d in _backward_ops(fused)] == fused_per_device


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_plans_that_cut_the_blocks_still_give_the_reference(seed: int) -> None:
    """Blocks cut along the keys or the features cannot be one kernel: they run as rules; the
    rest fuse, and everything equals the reference."""
    prog = _grads("causal", "gqa")
    plan = edatalog.plan(prog, topology="cpux2", strategy="random", seed=seed)
    _check(prog, plan)


def test_only_q_and_k_gradients_leave_the_fused_backward() -> None:
    prog = _grads(v_kind="input")
    plan = edatalog.plan(prog, topology="cpux1", strategy="replicate")
    ((op,),) = _backward_ops(_check(prog, plan))
    assert len(op.exports) == 1
