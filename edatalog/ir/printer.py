"""The readable text form of a join-agg graph, one aligned line per node:

q[b,s,h,e] += xn[b,s,d] * wq[(h,e),d]   sum d   2·B·S·D·H·E flops
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from edatalog.ir.affine import Guard
from edatalog.ir.cost import JoinAggLike, NodeCost, flops_formula

# What printing reads of the graph, as protocols that :mod:`edatalog.ir.graph`'s classes have: the
# graph imports this module (for ``str(graph)``), so this one does not import the graph.


class RelationLike(Protocol):
    """A relation (:class:`edatalog.ir.graph.Relation`); ``str()`` gives its declaration."""

    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def axis_names(self) -> tuple[str, ...]: ...

    @property
    def support(self) -> Guard: ...


class GraphLike(Protocol):
    """A join-agg graph (:class:`edatalog.ir.graph.Graph`); ``str()`` of a node gives its rule."""

    @property
    def dims(self) -> Sequence[tuple[str, int]]: ...

    @property
    def consts(self) -> Sequence[tuple[str, float]]: ...

    @property
    def relations(self) -> Sequence[RelationLike]: ...

    @property
    def nodes(self) -> Sequence[JoinAggLike]: ...

    @property
    def outputs(self) -> Sequence[str]: ...

    @property
    def costs(self) -> Mapping[str, NodeCost]: ...


def node_lines(graph: GraphLike) -> list[tuple[str, str, str]]:
    rows = []
    for n in graph.nodes:
        agg = f"{n.agg} {','.join(n.agg_indices)}" if n.agg is not None and n.agg_indices else ""
        rows.append((str(n), agg, f"{flops_formula(n, graph.costs[n.name])} flops"))
    return rows


def render_graph(graph: GraphLike) -> str:
    lines: list[str] = []
    if graph.dims:
        lines.append("dim " + ", ".join(f"{k} = {v}" for k, v in graph.dims))
    if graph.consts:
        lines.append("const " + ", ".join(f"{k} = {v!r}" for k, v in graph.consts))
    for r in graph.relations:
        if r.kind != "derived":
            lines.append(str(r))
    rows = node_lines(graph)
    if rows:
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len(r[1]) for r in rows)
        lines.append("")
        for text, agg, flops in rows:
            lines.append(f"{text:<{w0}}   {agg:<{w1}}   {flops}".rstrip())
    partial = [r for r in graph.relations if r.kind == "derived" and not r.support.is_true]
    if partial:
        lines.append("")
        lines.extend(f"support {r.name}[{','.join(r.axis_names)}]: {r.support}" for r in partial)
    if graph.outputs:
        lines.append("")
        lines.append("output " + ", ".join(graph.outputs))
    return "\n".join(lines)


def human(n: float) -> str:
    """``2.25G``, ``940M``, ``512``: three significant digits and a decimal prefix."""
    for unit in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}E"


def binary(nbytes: float) -> str:
    """``954 GiB``, ``1.5 KiB``, ``12 B``: bytes with a binary prefix, three significant digits."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(nbytes) < 1024 or unit == "PiB":
            return f"{nbytes:.3g} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    raise AssertionError("unreachable")


def runs(numbers: Sequence[int]) -> list[tuple[int, int]]:
    """Ascending numbers as their runs of consecutive ones, first and last: ``[1, 2, 3, 5]`` is
    ``[(1, 3), (5, 5)]`` (devices and layers print as ranges)."""
    out: list[tuple[int, int]] = []
    for x in numbers:
        if out and x == out[-1][1] + 1:
            out[-1] = (out[-1][0], x)
        else:
            out.append((x, x))
    return out
