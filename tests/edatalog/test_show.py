"""`edl show`: the picture is read from matplotlib's figure objects (axes, patches, ticks, the
legend), never from pixels.  Plans here are baselines and seeded random plans: no solve against a
clock."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

import edatalog
from edatalog.cli import main
from edatalog.cli.show import EPILOG_SHOW, REPLICATED_COLOR, _Block, _layout, drawn_axes, figure

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "programs" / "llama_block.edl"
ATTN = ROOT / "programs" / "attention.edl"
GQA_DIMS = {"S": 8, "D": 64, "H": 8, "KVH": 2, "F": 48}
ATTN_DIMS = {"B": 2, "S": 8, "D": 16, "H": 2}


@contextlib.contextmanager
def _drawn(plan: edatalog.Plan, names: list[str]) -> Iterator[Figure]:
    import matplotlib.pyplot as plt

    fig = figure(plan, names)
    try:
        yield fig
    finally:
        plt.close(fig)


def _panels(fig: Figure, name: str) -> list[Axes]:
    """The axes that draw ``name``: one, or one per piece of a faceted relation."""
    return [ax for ax in fig.get_axes() if str(ax.get_label()) == name or str(ax.get_label()).startswith(f"{name} [")]


def _blocks(ax: Axes) -> list[tuple[Rectangle, tuple[int, ...], bool]]:
    """The block patches of an axes: each with its devices and whether it is drawn replicated."""
    out = []
    for p in ax.patches:
        gid = p.get_gid() or ""
        kind, _, devices = gid.partition(":")
        if kind in ("device", "replicated") and isinstance(p, Rectangle):
            out.append((p, tuple(int(d) for d in devices.split(",")), kind == "replicated"))
    return out


def _holders(plan: edatalog.Plan, name: str) -> set[int]:
    """The devices where ``name`` lives once complete, as the schedule says."""
    graph, schedule = plan.graph, plan.schedule
    entries = schedule.outputs.get(name) if name in graph.outputs else schedule.layout.get(name)
    return {d for e in entries or [] for d in e.holders}


def _overlap(a: Rectangle, b: Rectangle) -> float:
    (ax0, ay0), (bx0, by0) = a.get_xy(), b.get_xy()
    w = min(ax0 + a.get_width(), bx0 + b.get_width()) - max(ax0, bx0)
    h = min(ay0 + a.get_height(), by0 + b.get_height()) - max(ay0, by0)
    return max(w, 0) * max(h, 0)


def _random_plan_cutting(name: str, axes: int) -> edatalog.Plan:
    """A seeded random plan of the attention program whose layout of ``name`` is cut along at
    least ``axes`` axes (found by trying seeds, as a test of the drawing, not of the planner)."""
    prog = edatalog.compile(ATTN, dims=ATTN_DIMS)
    rank = prog.graph.relation(name).rank
    for seed in range(200):
        plan = edatalog.plan(prog, "a100x4", "random", seed=seed)
        h_axis, w_axis, facets = drawn_axes(rank, _layout(plan, name))
        if h_axis is not None and w_axis is not None and len(facets) >= axes - 2:
            return plan
    raise AssertionError(f"no random plan of 200 cuts {name} along {axes} axes")


def test_every_device_of_a_relation_cut_along_three_axes_is_drawn_and_no_block_hides_another() -> None:
    plan = _random_plan_cutting("sc", 3)
    names = [r.name for r in plan.graph.relations]
    with _drawn(plan, names) as fig:
        for name in names:
            panels = _panels(fig, name)
            assert panels, name
            drawn = {d for ax in panels for _, devices, _ in _blocks(ax) for d in devices}
            assert drawn == _holders(plan, name), name
            for ax in panels:
                rects = [r for r, _, _ in _blocks(ax)]
                for i, a in enumerate(rects):
                    for b in rects[i + 1 :]:
                        assert _overlap(a, b) == 0, f"{name}: two blocks of {ax.get_label()} overlap"
        assert len(_panels(fig, "sc")) > 1  # the third cut axis is faceted into small panels
        assert all(ax.get_title() for ax in _panels(fig, "sc"))  # each titled with its ranges


def test_llama_heads_show_every_device() -> None:
    """Megatron's grouped-query plan: q and the scores are cut by key/value and query head."""
    prog = edatalog.compile(LLAMA, dims=GQA_DIMS)
    plan = edatalog.plan(prog, "a100x8", "megatron")
    with _drawn(plan, ["q", "sc", "p"]) as fig:
        for name in ("q", "sc", "p"):
            drawn = {d for ax in _panels(fig, name) for _, devices, _ in _blocks(ax) for d in devices}
            assert drawn == set(range(8)), name


def test_replication_has_its_own_look_and_legend_entry() -> None:
    prog = edatalog.compile(LLAMA, dims=GQA_DIMS)
    plan = edatalog.plan(prog, "a100x8", "megatron")  # y ends replicated; k on {0..3} and {4..7}
    with _drawn(plan, ["y", "k", "q"]) as fig:
        (y,) = _panels(fig, "y")
        blocks = _blocks(y)
        assert blocks and all(rep and devices == tuple(range(8)) for _, devices, rep in blocks)
        assert all(r.get_facecolor()[:3] == pytest.approx((0xD9 / 255,) * 3) for r, _, _ in blocks)
        assert all(r.get_hatch() for r, _, _ in blocks)
        assert {t.get_text() for t in y.texts} == {"0-7"}  # the holders, written in the block
        assert {devices for _, devices, _ in _blocks(_panels(fig, "k")[0])} == {(0, 1, 2, 3), (4, 5, 6, 7)}
        q_blocks = _blocks(_panels(fig, "q")[0])
        assert not any(rep for _, _, rep in q_blocks) and not any(r.get_hatch() for r, _, _ in q_blocks)
        colors = {r.get_facecolor() for r, _, _ in q_blocks}
        assert len(colors) == 8  # one colour per device, none of them the replicated grey
        labels = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
        assert [f"device {d}" for d in range(8)] == labels[:8]
        assert any(label.startswith("replicated") for label in labels)
        handle = fig.legends[0].legend_handles[-1]
        assert isinstance(handle, Patch) and handle.get_hatch()
        assert REPLICATED_COLOR == "#d9d9d9"


def test_ticks_are_whole_cells() -> None:
    """An axis of extent 1 (the batch) ticks 0 and 1, not 0.0, 0.2, ..."""
    prog = edatalog.compile(LLAMA, dims=GQA_DIMS)
    plan = edatalog.plan(prog, "a100x8", "megatron")
    names = [r.name for r in plan.graph.relations]
    with _drawn(plan, names) as fig:
        (ss,) = _panels(fig, "ss")  # ss[b, s] with B = 1
        assert list(ss.get_yticks()) == [0, 1]
        for ax in fig.get_axes():
            for ticks in (ax.get_xticks(), ax.get_yticks()):
                assert np.all(np.asarray(ticks) == np.round(ticks)), ax.get_label()


def test_drawn_axes_are_the_last_two_cut_ones_as_help_says() -> None:
    def block(*axes: tuple[int, int]) -> _Block:
        return _Block(tuple(((a, b),) for a, b in axes), (0,))

    whole = (0, 4)
    # cut along axes 1, 2 and 3 of four: draw 2 and 3, facet 1
    blocks = [block(whole, (0, 2), (0, 2), (0, 2)), block(whole, (2, 4), (2, 4), (2, 4))]
    assert drawn_axes(4, blocks) == (2, 3, [1])
    # cut along axis 0 only: draw it with the last uncut axis
    assert drawn_axes(3, [block((0, 2), whole, whole), block((2, 4), whole, whole)]) == (0, 2, [])
    # nothing cut: the last two axes; one axis: a strip; a scalar: one cell
    assert drawn_axes(3, [block(whole, whole, whole)]) == (1, 2, [])
    assert drawn_axes(1, [block(whole)]) == (None, 0, [])
    assert drawn_axes(0, [block()]) == (None, None, [])
    assert "the last two along which its" in " ".join(EPILOG_SHOW.split())


def test_show_writes_a_picture_of_the_right_size(tmp_path: Path) -> None:
    import matplotlib.image

    plan_path, picture = tmp_path / "plan.json", tmp_path / "plan.png"
    edatalog.plan(edatalog.compile(LLAMA, dims=GQA_DIMS), "a100x8", "megatron").save(plan_path)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(["show", str(plan_path), "wq", "y", "-o", str(picture)]) == 0
    assert out.getvalue().strip() == f"wrote {picture}"
    assert matplotlib.image.imread(str(picture)).shape == (364, 832, 4)  # two panels of 3.2 x 2.8 inches at 130 dpi
    everything = tmp_path / "all.png"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["show", str(plan_path), "-o", str(everything)]) == 0
    rows = -(-len(edatalog.load_plan(plan_path).graph.relations) // 4)
    assert matplotlib.image.imread(str(everything)).shape == (round(rows * 2.8 * 130), round(4 * 3.2 * 130), 4)


def test_show_mistakes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plan_path = tmp_path / "plan.json"
    edatalog.plan(edatalog.compile(LLAMA, dims=GQA_DIMS), "a100x8", "megatron").save(plan_path)
    for argv, message in (
        (["qq", "-o", str(tmp_path / "x.png")], "no relation 'qq'"),
        (["y", "-o", str(tmp_path / "x.xyz")], "cannot write"),
        (["y", "-o", str(tmp_path / "no" / "x.png")], "cannot write"),
    ):
        assert main(["show", str(plan_path), *argv]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and "Traceback" not in err
