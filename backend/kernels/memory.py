"""What evaluating a program will allocate, known before anything is allocated.

``edl run ln_linear.edl --dim S=1000000000`` must not die in numpy's ``_ArrayMemoryError`` after
drawing a terabyte of random inputs.  :func:`check` walks the steps of drawing inputs
(:func:`input_steps`) and of the reference evaluator (:func:`evaluation_steps`) in order, adds
up what each step allocates (inputs drawn at random, each rule's result and presence mask, its
largest temporaries) and frees (relations nobody reads any more), and raises an
:class:`EdlError` naming the first step that would exceed the memory this machine has
available, with the shape and bytes of what it allocates.

The estimate follows :mod:`edatalog.backend.kernels.joinagg` and :mod:`edatalog.backend.kernels.reference`;
it errs high (every temporary of a rule counted at once), never low by more than small arrays.
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from edatalog.backend.kernels.contract import peak_elements
from edatalog.backend.kernels.joinagg import CHUNK_POINTS, factor_indices, prepare
from edatalog.errors import EdlError, Span
from edatalog.ir import dtypes
from edatalog.ir.forms import product_form
from edatalog.ir.graph import Graph, JoinAgg
from edatalog.ir.printer import binary

TEMPORARIES = 4  # arrays of a broadcast chunk alive at once: a value, a mask, the masked copy, a reduction


@dataclass(frozen=True)
class Step:
    """One allocation of an evaluation: what, its biggest buffer, and the bytes it adds."""

    what: str  # "rule 'xc'" or "input 'x'"
    origin: str  # source location, for the error's span
    shape: tuple[int, ...]
    dtype: str
    nbytes: int  # of the biggest buffer
    adds: int  # bytes held after the step minus before it, its temporaries included
    temporaries: int  # bytes held only during the step


def available_bytes() -> int:
    """Memory the machine can give this process now (``MemAvailable`` on Linux)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # unknown: do not refuse


def input_steps(graph: Graph, names: Collection[str] | None = None) -> list[Step]:
    """The allocations of drawing the inputs and params (all, or those in ``names``)."""
    return [
        Step(f"{rel.kind} '{rel.name}'", rel.origin, rel.shape, rel.dtype, rel.nbytes, rel.nbytes, 0)
        for rel in graph.relations
        if rel.kind != "derived" and (names is None or rel.name in names)
    ]


def evaluation_steps(graph: Graph, keep: Collection[str] | None) -> list[Step]:
    """The allocations of evaluating ``graph`` (keeping only ``keep`` to the end, when given),
    in order."""
    steps: list[Step] = []
    last_read = {acc.relation: k for k, node in enumerate(graph.nodes) for acc in node.inputs}
    started: set[str] = set()
    for k, node in enumerate(graph.nodes):
        rel = graph.relation(node.out)
        cdt = dtypes.compute_dtype(rel.dtype)
        held = 0
        buffers = _temporaries(graph, node)
        if node.out not in started:  # the accumulator: data in the compute dtype and a mask
            started.add(node.out)
            cells = math.prod(rel.shape)
            held = cells * (dtypes.itemsize(cdt) + 1)
            buffers += [(rel.shape, cells * dtypes.itemsize(cdt)), (rel.shape, cells)]
        freed = 0
        if keep is not None:
            for name in {a.relation for a in node.inputs}:
                if last_read[name] == k and name not in keep:
                    freed += graph.relation(name).nbytes
        temporaries = sum(n for _, n in buffers) - held
        shape, biggest = max(buffers, key=lambda b: b[1])
        steps.append(Step(f"rule '{node.name}'", node.origin, shape, cdt, biggest, held - freed, temporaries))
    return steps


def _temporaries(graph: Graph, node: JoinAgg) -> list[tuple[tuple[int, ...], int]]:
    """The buffers (shape, bytes) a rule holds only while it runs: its inputs cast to the compute
    dtype or padded for index expressions, its result before it is folded in, and its
    contraction's largest intermediates or its broadcast chunk's arrays."""
    node = prepare(node)
    cdt = dtypes.compute_dtype(node.dtype)
    item = dtypes.itemsize(cdt)
    # A looked-up index takes one value per point: the evaluation gathers along it.
    box = {v: 1 if v in node.looked_up else n for v, n in node.box.items()}
    out: list[tuple[tuple[int, ...], int]] = []
    for acc in node.inputs:
        rel = graph.relation(acc.relation)
        cells = math.prod(rel.shape)
        if rel.dtype != cdt:
            out.append((rel.shape, cells * item))
        if any(not _inside(p.expr.bounds(node.box), p.extent) for ax in acc.axes for p in ax.parts):
            out.append((rel.shape, cells * item))  # the zero-padded copy (a little larger)
    result = tuple(node.box[v] for v in node.out_indices)  # a scatter's head spans its looked-up range
    out += [(result, math.prod(result) * item), (result, math.prod(result))]  # values, presence
    form = product_form(node) if node.agg == "sum" and node.agg_indices else None
    if form is not None:
        ixs = [factor_indices(node, k) for k, _ in form.factors]
        if not node.guard.is_true:
            ixs.append(tuple(i.name for i in node.indices if i.name in node.guard.vars))
        peak, largest = peak_elements(ixs, list(node.out_indices), box)
        out.append((tuple(box[v] for v in largest), peak * item))
    else:
        points = math.prod(box.values())
        longest = max(box, key=lambda v: box[v], default=None)
        step = 1 if longest is None else max(1, box[longest] * CHUNK_POINTS // max(points, 1))
        chunk = tuple(min(step, n) if v == longest else n for v, n in box.items())
        out.append((chunk, TEMPORARIES * math.prod(chunk) * item))
    return out


def _inside(bounds: tuple[int, int], extent: int) -> bool:
    return bounds[0] >= 0 and bounds[1] < extent


def check(steps: Sequence[Step], *, available: int | None = None, spans: Mapping[str, Span] | None = None) -> None:
    """Raise an :class:`EdlError` when ``steps`` would need more memory than is ``available``
    (default: what the machine has now), naming the first step that would not fit."""
    limit = available_bytes() if available is None else available
    held = 0
    for step in steps:
        need = held + step.temporaries + max(step.adds, 0)
        if need > limit:
            dims = ", ".join(str(n) for n in step.shape)
            raise EdlError(
                f"not enough memory: {step.what} needs a [{dims}] {step.dtype} buffer of {binary(step.nbytes)}, "
                f"and {binary(need)} in all by then; this machine has {binary(limit)} available",
                (spans or {}).get(step.origin),
                help="make the dims smaller (--dim, dims={...}), or plan the program across devices "
                "(edl plan) to split every relation",
            )
        held += step.adds
