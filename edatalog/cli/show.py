"""`edl show`: draw a plan, each relation's blocks coloured by the device that holds them."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from edatalog.errors import EdlError, did_you_mean
from edatalog.ir.intervals import Box, Ivs
from edatalog.plans import Plan, load_plan

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.colors import Colormap
    from matplotlib.figure import Figure, SubFigure

EPILOG_SHOW = """\
Every relation is drawn where it lives, over two of its axes: the last two along which its
layout is cut (the last axes when fewer are cut; one axis: a strip).  When the layout is cut
along more axes, each piece along the others gets its own small panel, titled with its ranges,
so that no block hides another.  Blocks are coloured by the device that holds them; a block
held by several devices (replicated) is grey and hatched, with its devices written in it.

examples:
  edl show plan.json -o plan.png
  edl show plan.json sc p o -o attention.svg
"""

PANEL_INCHES = (3.2, 2.8)  # width, height of one relation's panel
PER_ROW = 4
REPLICATED_HATCH = "////"
REPLICATED_COLOR = "#d9d9d9"


def cmd_show(args: argparse.Namespace) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plan = load_plan(args.plan)
    known = [r.name for r in plan.graph.relations]
    for name in args.relations:
        if name not in known:
            raise EdlError(f"no relation '{name}' in this plan's program", help=did_you_mean(name, known))
    fig = figure(plan, args.relations or known)
    try:
        fig.savefig(args.output, dpi=130)
    except (OSError, ValueError) as exc:
        raise EdlError(f"cannot write {args.output}: {exc}") from None
    finally:
        plt.close(fig)
    print(f"wrote {args.output}")
    return 0


def figure(plan: Plan, names: Sequence[str]) -> Figure:
    """The picture of ``names``: one panel per relation, four per row.  Each drawing axes is
    labelled with its relation (``ax.get_label()``: ``NAME``, or ``NAME [ranges]`` for one piece of
    a faceted relation) and each block's patch carries its devices (``gid`` ``device:D`` or
    ``replicated:D,E,...``), so that tests can read the picture without looking at pixels."""
    import matplotlib.pyplot as plt

    cols = min(PER_ROW, len(names))
    rows = math.ceil(len(names) / cols)
    fig = plt.figure(figsize=(PANEL_INCHES[0] * cols, PANEL_INCHES[1] * rows), layout="constrained")
    colors = plt.get_cmap("tab10" if plan.ir.n_devices <= 10 else "tab20")
    cells = fig.subfigures(rows, cols, squeeze=False).ravel()
    for cell, name in zip(cells, names, strict=False):
        _draw_relation(cell, plan, name, colors)
    fig.legend(handles=_legend(plan.ir.n_devices, colors), loc="outside lower center", ncol=6, fontsize=8)
    fig.suptitle(f"{plan.ir.strategy} plan on {plan.topology.name}: where each relation lives", fontsize=10)
    return fig


@dataclass(frozen=True)
class _Block:
    """One piece of a relation's layout: its coordinates per axis and the devices holding it."""

    axes: Box  # per axis, the runs of coordinates the piece covers
    devices: tuple[int, ...]


def _layout(plan: Plan, name: str) -> list[_Block]:
    """Where ``name`` lives once complete (for outputs: at the end of the run)."""
    graph, schedule = plan.graph, plan.schedule
    entries = schedule.outputs.get(name) if name in graph.outputs else schedule.layout.get(name)
    return [_Block(tuple(e.region.axes), tuple(sorted(e.holders))) for e in entries or []]


def drawn_axes(rank: int, blocks: Sequence[_Block]) -> tuple[int | None, int | None, list[int]]:
    """The axes drawn down and across, and the axes faceted into small panels: the last two axes
    along which the layout is cut are drawn (completed with the last uncut axes when fewer are
    cut), and every other cut axis gets one panel per piece, so that no block hides another."""
    cut = [k for k in range(rank) if len({b.axes[k] for b in blocks}) > 1]
    drawn = cut[-2:]
    for k in reversed(range(rank)):
        if len(drawn) == min(2, rank):
            break
        if k not in drawn:
            drawn.append(k)
    drawn.sort()
    facets = [k for k in cut if k not in drawn]
    if not drawn:
        return None, None, facets
    if len(drawn) == 1:
        return None, drawn[0], facets
    return drawn[0], drawn[1], facets


def _draw_relation(cell: SubFigure, plan: Plan, name: str, colors: Colormap) -> None:
    rel = plan.graph.relation(name)
    blocks = _layout(plan, name)
    h_axis, w_axis, facet_axes = drawn_axes(rel.rank, blocks)
    groups: dict[Box, list[_Block]] = {}
    for b in blocks:
        groups.setdefault(tuple(b.axes[k] for k in facet_axes), []).append(b)
    pieces = sorted(groups.values(), key=lambda bs: tuple(bs[0].axes[k] for k in facet_axes))
    cols = math.ceil(math.sqrt(len(pieces))) if pieces else 1
    axes = cell.subplots(math.ceil(max(len(pieces), 1) / cols), cols, squeeze=False).ravel()
    cell.suptitle(f"{name} [{', '.join(rel.symbols)}]", fontsize=9)
    names = rel.axis_names
    for ax in axes[len(pieces) :]:
        ax.axis("off")
    for k, (ax, piece) in enumerate(zip(axes, pieces or [[]], strict=False)):
        where = ", ".join(_ranges_text(names[a], piece[0].axes[a]) for a in facet_axes) if piece else ""
        ax.set_label(f"{name} [{where}]" if where else name)
        if where:
            ax.set_title(where, fontsize=6)
        for b in piece:
            _draw_block(ax, b, h_axis, w_axis, colors)
        ax.set_xlim(0, rel.shape[w_axis] if w_axis is not None else 1)
        ax.set_ylim(rel.shape[h_axis] if h_axis is not None else 1, 0)
        _integer_ticks(ax, h_axis is not None, w_axis is not None)
        if k // cols == (len(pieces) - 1) // cols:
            ax.set_xlabel(names[w_axis] if w_axis is not None else "", fontsize=8)
        if k % cols == 0:
            ax.set_ylabel(names[h_axis] if h_axis is not None else "", fontsize=8)


def _draw_block(ax: Axes, block: _Block, h_axis: int | None, w_axis: int | None, colors: Colormap) -> None:
    """A block in its device's colour.  A replicated block has its own look, never a device's
    colour (it would read as that device's): grey, hatched, with its holders written in it."""
    from matplotlib.patches import Rectangle

    replicated = len(block.devices) > 1
    for y0, y1 in block.axes[h_axis] if h_axis is not None else [(0, 1)]:
        for x0, x1 in block.axes[w_axis] if w_axis is not None else [(0, 1)]:
            rect = Rectangle(
                (x0, y0),
                x1 - x0,
                y1 - y0,
                facecolor=REPLICATED_COLOR if replicated else colors(block.devices[0] % colors.N),
                edgecolor="black",
                linewidth=0.4,
                hatch=REPLICATED_HATCH if replicated else None,
            )
            rect.set_gid(("replicated:" if replicated else "device:") + ",".join(map(str, block.devices)))
            ax.add_patch(rect)
            if replicated:
                text = ax.text((x0 + x1) / 2, (y0 + y1) / 2, _devices_text(block.devices), fontsize=6)
                text.set(ha="center", va="center", bbox={"facecolor": "white", "linewidth": 0, "pad": 1})
                text.set_clip_path(rect)


def _devices_text(devices: Sequence[int]) -> str:
    """``0-3,6``: runs of consecutive devices."""
    runs: list[list[int]] = []
    for d in devices:
        if runs and runs[-1][1] == d - 1:
            runs[-1][1] = d
        else:
            runs.append([d, d])
    return ",".join(f"{a}-{b}" if b > a + 1 else ",".join(map(str, range(a, b + 1))) for a, b in runs)


def _integer_ticks(ax: Axes, rows: bool, cols: bool) -> None:
    """Cell coordinates are whole numbers: an axis of extent 1 ticks 0 and 1, never 0.2, 0.4."""
    from matplotlib.ticker import MaxNLocator

    for axis, drawn in ((ax.xaxis, cols), (ax.yaxis, rows)):
        if drawn:
            axis.set_major_locator(MaxNLocator(nbins=4, integer=True, min_n_ticks=1))
        else:
            axis.set_ticks([])  # a strip or a scalar: no axis to number
    ax.tick_params(labelsize=6)


def _legend(n_devices: int, colors: Colormap) -> list[Any]:
    from matplotlib.patches import Patch

    handles: list[Any] = [Patch(facecolor=colors(d % colors.N), label=f"device {d}") for d in range(n_devices)]
    replicated = "replicated (on the devices named)"
    handles.append(Patch(facecolor=REPLICATED_COLOR, edgecolor="black", hatch=REPLICATED_HATCH, label=replicated))
    return handles


def _ranges_text(name: str, runs: Ivs) -> str:
    return f"{name} " + ",".join(f"{a}:{b}" for a, b in runs)
