"""The plan model: splits, tiles, printing, JSON, verification against a program."""

from __future__ import annotations

from pathlib import Path

import pytest

import edatalog
from edatalog.errors import EdlError
from edatalog.solver.plan import Plan, Split, Tile
from edatalog.solver.strategies import build, random_plan
from edatalog.solver.topology import preset

ROOT = Path(__file__).resolve().parents[2]


def _attention() -> edatalog.Program:
    return edatalog.compile(ROOT / "programs" / "attention.edl", dims={"B": 2, "S": 6, "D": 32, "H": 4})


def test_uneven_splits_put_the_larger_parts_first() -> None:
    s = Split.even("s", 100, 3)
    assert [b - a for a, b in s.ranges] == [34, 33, 33]
    assert str(s) == "s:3"
    assert str(Split("s", (0, 10, 55, 100))) == "s:3[10,45,45]"
    assert Split.even("h", 2, 8).parts == 2  # never more parts than cells


def test_tiles_enumerate_blocks_row_major() -> None:
    tile = Tile((Split.even("a", 4, 2), Split.even("b", 3, 3)), tuple((k % 3,) for k in range(6)))
    blocks = list(tile.blocks())
    assert [b.ranges for b in blocks[:4]] == [
        {"a": (0, 2), "b": (0, 1)},
        {"a": (0, 2), "b": (1, 2)},
        {"a": (0, 2), "b": (2, 3)},
        {"a": (2, 4), "b": (0, 1)},
    ]
    assert tile.describe(3) == "a:2 b:3 -> devices [0,1,2,0,1,2]"
    assert Tile.whole({"a": 4}, [0, 1, 2]).describe(3) == "a:1 -> {0..2}"


def test_megatron_plan_prints_like_dtensor() -> None:
    prog = _attention()
    plan = build(prog.graph, preset("a100x4"), "megatron")
    text = str(plan)
    assert "  x     R" in text
    assert "  wq    S(0)" in text
    assert "  wo    S(1)" in text
    assert "  q     b:1 s:1 h:4 e:1 d:1 -> devices 0..3" in text
    assert "  y     b:1 s:1 d:1 h:4 e:1 -> devices 0..3" in text  # h is aggregated: partial sums


def test_json_round_trip_and_version(tmp_path: Path) -> None:
    prog = _attention()
    plan = random_plan(prog.graph, preset("a100x8"), seed=5)
    again = Plan.from_json(plan.to_json(), prog.graph)
    assert again == plan
    data = plan.to_json().replace('"format": 1', '"format": 7')
    with pytest.raises(EdlError, match="format 7"):
        Plan.from_json(data)
    with pytest.raises(EdlError, match="not an edatalog plan"):
        Plan.from_json('{"kind": "something else"}')
    with pytest.raises(EdlError, match="not a valid plan"):
        Plan.from_json("{not json")


def test_plans_are_checked_against_the_program() -> None:
    prog = _attention()
    plan = build(prog.graph, preset("a100x2"), "data")
    other = edatalog.compile(ROOT / "programs" / "attention.edl", dims={"B": 2, "S": 8, "D": 32, "H": 4})
    with pytest.raises(EdlError, match="made for another program"):
        plan.verify(other.graph)
    node = plan.nodes[0]
    bad_split = Tile((Split("b", (0, 1)), *node.tile.splits[1:]), node.tile.devices)
    broken = Plan(plan.program, 2, "a100x2", "x", (type(node)(node.node, bad_split), *plan.nodes[1:]), plan.inputs)
    with pytest.raises(EdlError, match=r"must cut 0\.\.2"):
        broken.verify(prog.graph)
    bad_device = Tile(node.tile.splits, tuple((5,) for _ in node.tile.devices))
    broken = Plan(plan.program, 2, "a100x2", "x", (type(node)(node.node, bad_device), *plan.nodes[1:]), plan.inputs)
    with pytest.raises(EdlError, match=r"in 0\.\.1"):
        broken.verify(prog.graph)
    with pytest.raises(EdlError, match="does not say where"):
        Plan(plan.program, 2, "a100x2", "x", plan.nodes, plan.inputs[1:]).verify(prog.graph)


def test_unknown_strategy_names_the_known_ones() -> None:
    with pytest.raises(EdlError, match="unknown strategy 'megatorn'") as info:
        build(_attention().graph, preset("a100x2"), "megatorn")
    assert "megatron" in str(info.value)


def test_megatron_refuses_programs_without_heads_or_ffn() -> None:
    prog = edatalog.compile(ROOT / "programs" / "softmax.edl")
    with pytest.raises(EdlError, match="needs a transformer"):
        build(prog.graph, preset("a100x2"), "megatron")
