"""AdamW's update found in a graph by what its rules compute (edatalog/ir/adamw.py): every
param's update of a training step, with its constants; nothing that computes something else."""

from __future__ import annotations

import dataclasses

import pytest

import edatalog
from edatalog.ir.adamw import adamw_updates
from edatalog.ir.graph import Graph
from edatalog.ir.scalar import Const, ScalarExpr
from tests.edatalog.test_training import SGD_MLP


def _step(clip: float, optimizer: edatalog.AdamW | edatalog.SGD) -> tuple[Graph, tuple[str, ...]]:
    prog = edatalog.compile_string(SGD_MLP, name="mlp.edl")
    step, names = edatalog.step_program(prog, optimizer=optimizer, clip=clip)
    return step.graph, names.params


ADAMW = edatalog.AdamW(lr=0.02, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.3)


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_every_param_s_update_is_found_with_its_constants(clip: float) -> None:
    graph, params = _step(clip, ADAMW)
    found = {u.param: u for u in adamw_updates(graph)}
    assert set(found) == set(params)
    for p, u in found.items():
        assert (u.lr, u.beta1, u.beta2, u.eps, u.weight_decay) == (0.02, 0.8, 0.99, 1e-7, 0.3)
        assert u.nodes == (f"next_adam_m_{p}", f"next_adam_v_{p}", f"next_{p}")
        assert (u.first_state, u.second_state, u.step) == (f"adam_m_{p}", f"adam_v_{p}", "step")
        assert u.scale == ("clip_coef" if clip else None)
        assert graph.relation(u.grad).shape == graph.relation(p).shape


def test_sgd_has_no_adamw_update() -> None:
    graph, _ = _step(1.0, edatalog.SGD(lr=0.1, momentum=0.9, weight_decay=0.01))
    assert adamw_updates(graph) == []


def _with_const(graph: Graph, rule: str, old: float, new: float) -> Graph:
    """``graph`` with the constant ``old`` of one rule's scalar function made ``new``."""
    node = graph.node(rule)
    nodes = tuple(Const(new) if isinstance(n, Const) and n.value == old else n for n in node.expr.nodes)
    assert nodes != node.expr.nodes, f"{rule} has no constant {old}"
    changed = dataclasses.replace(node, expr=ScalarExpr(nodes, node.expr.root))
    return dataclasses.replace(graph, nodes=tuple(changed if n.name == rule else n for n in graph.nodes))


@pytest.mark.parametrize(
    ("rule", "old", "new"),
    [
        ("next_w1", 1.0, 0.5),  # the bias corrections are 0.5 - b^t
        ("next_w1", 0.8, 0.7),  # the first correction with another beta than the moment's
        ("next_adam_m_w1", 0.8, 0.7),  # m' = 0.7 m + 0.2 g: not a moving average
        ("next_adam_v_w1", 0.99, 0.9),  # v' = 0.9 v + 0.01 g^2
    ],
)
def test_rules_that_compute_something_else_are_not_updates(rule: str, old: float, new: float) -> None:
    graph, _ = _step(1.0, ADAMW)
    changed = _with_const(graph, rule, old, new)
    assert [u.param for u in adamw_updates(changed)] == ["w2"]


def test_an_update_with_another_epsilon_is_found_with_it() -> None:
    """The constants are read off the rules: a program whose eps differs per param is two
    AdamW updates with their own eps."""
    graph, _ = _step(1.0, ADAMW)
    changed = _with_const(graph, "next_w2", 1e-7, 1e-5)
    eps = {u.param: u.eps for u in adamw_updates(changed)}
    assert eps == {"w1": 1e-7, "w2": 1e-5}
