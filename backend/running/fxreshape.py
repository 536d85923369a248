"""Pointwise ops and reductions computed in the shapes their operands already have, run by
:func:`edatalog.backend.running.fxpasses.simplify` after the views are folded and shared.

The interpreter gives each kernel its operands in the kernel's own shape: a row's sum of a
``[b, s, d]`` block is taken over a ``[b * s, d]`` view of it, the sum viewed back as
``[b, s]``, scaled, and viewed as ``[b, s, 1]`` for the subtraction; a GEMM's ``[s, h * e]``
result is viewed as ``[b, s, h, e]`` to add a bias viewed as ``[1, 1, h, e]``.  Each view is a
dispatch of about a microsecond, and a tiny GPT-2's graph is two fifths views.  Where an op's
operands are reshapes of tensors of another shape, the op can run in that shape instead, on
the tensors themselves, and its result be viewed in the old shape only where something still
needs that (often nothing: the next view was to undo it).

:func:`in_source_shapes` rewrites, in the graph's order:

- a pointwise op (``fxnodes.POINTWISE``; one writing ``out=`` a reshape too) or an all-reduce of
  edatalog's (elementwise over any shape) to run in the shape of one of its operands, or of the
  tensor one views, when that removes at least as many views as it adds.  Moving a view later
  costs none, and a later op may take it away;
- a reduction over a reshaped contiguous tensor to reduce that tensor itself, keeping its dims
  (``sum(view(x, [16, 32]), [1])`` becomes ``sum(x, [2], keepdim=True)``), and one over a
  contiguous tensor to keep its dims where that saves views or its readers are pointwise ops,
  which may then broadcast it as it is (``x - view(sum(x, [1]), [16, 32], [1, 0])`` becomes
  ``x - sum(x, [1], keepdim=True)``).

The sweep runs on a copy of the graph, kept only if it leaves fewer views than there were.  Views of a
result in another dtype stay views of its old shape, and a tensor an ``out=`` op resized
(whose recorded geometry is the one before) is left alone.  A review's adversarial cases
(dtype views, resized buffers, duplicate views, readers that cannot take a view away) are in
``tests/backend/test_fxreshape.py``.

Bits are kept: a reshape of contiguous memory changes no address any operand reads, and
torch's CPU kernels first merge the dims that memory allows (TensorIterator's coalescing), so
the op runs the very same loop in either shape.  Each rewrite is checked to give a fresh
contiguous result of the same sizes and dtype, as the op did (:func:`_fresh_result`).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from edatalog.backend.kernels.arrays import torch_module
from edatalog.backend.running.fxnodes import (
    ALL_REDUCES,
    KEEPS_DIMS,
    POINTWISE,
    aten_of,
    attribute,
    contiguous_strides,
    is_contiguous,
    is_view,
    name_of,
    nodes_in,
    same_layout,
    schema_name,
    writes,
)
from edatalog.backend.running.fxplacing import broadcasts
from edatalog.backend.running.tracer import Geometry


def in_source_shapes(graph: Any, module: Any, shapes: dict[Any, Geometry]) -> tuple[Any, int]:
    """Run each pointwise op and reduction in its operands' source shape where that saves
    views (see the module docstring).  The rewrites decide one op at a time, and a reduction's
    dims kept for its pointwise readers pay off only if a later op takes the view away: the
    sweep runs on a copy of the graph, which is kept (its nodes' geometries added to
    ``shapes``) only if it has fewer views than ``graph``.  Returns the graph kept and how
    many views went."""
    before = _views(graph)
    copy, copied = _copy(graph, shapes)
    _sweep(copy, module, copied)
    after = _views(copy)
    if after >= before:
        return graph, 0
    shapes.update(copied)
    return copy, before - after


def _sweep(graph: Any, module: Any, shapes: dict[Any, Geometry]) -> None:
    """One pass over the graph in its order (see :func:`in_source_shapes`).  Tensors that an
    ``out=`` op resized are left alone: their recorded geometry is the one they had before."""
    resized = {w for n in graph.nodes if (w := writes(n)) in shapes and n in shapes and shapes[n][0] != shapes[w][0]}
    known = {k: v for k, v in shapes.items() if k not in resized}
    for node in list(graph.nodes):
        if node._erased:  # a view of an op rewritten before it, replaced then
            continue
        if aten_of(node) in KEEPS_DIMS:
            _reduction(graph, node, known, module)
        elif (name_of(node) in POINTWISE and not is_view(node)) or schema_name(node) in ALL_REDUCES:
            _pointwise(graph, node, known, module)
    graph.eliminate_dead_code()
    shapes.update((k, v) for k, v in known.items() if k not in shapes)


def _views(graph: Any) -> int:
    return sum(1 for n in graph.nodes if is_view(n))


def _copy(graph: Any, shapes: dict[Any, Geometry]) -> tuple[Any, dict[Any, Geometry]]:
    """A copy of ``graph`` (the same module's constants) and the geometries of its nodes."""
    torch = torch_module()
    copy = torch.fx.Graph(owning_module=graph.owning_module)
    nodes: dict[Any, Any] = {}
    result = copy.graph_copy(graph, nodes)
    copy.output(result)
    return copy, {nodes[k]: v for k, v in shapes.items() if k in nodes}


# -- geometry ---------------------------------------------------------------------------------------


def _geometry(node: Any, shapes: dict[Any, Geometry], module: Any) -> Geometry | None:
    """A node's geometry as recorded, or a constant's (folded after recording)."""
    if node in shapes:
        return shapes[node]
    if node.op == "get_attr":
        obj = attribute(module, node.target)
        if isinstance(obj, torch_module().Tensor):
            return (tuple(obj.shape), tuple(obj.stride()), int(obj.storage_offset()), obj.dtype)
    return None


def _fresh(sizes: tuple[int, ...], dtype: Any) -> Geometry:
    return (sizes, contiguous_strides(sizes), 0, dtype)


def _reshape_of(node: Any, shapes: dict[Any, Geometry], module: Any) -> Any | None:
    """The tensor ``node`` views as another shape of the same contiguous cells, else None."""
    if not is_view(node) or not node.args or not hasattr(node.args[0], "op"):
        return None
    source = node.args[0]
    mine, theirs = _geometry(node, shapes, module), _geometry(source, shapes, module)
    if mine is None or theirs is None or mine[0] == theirs[0]:
        return None
    if mine[2:] != theirs[2:] or math.prod(mine[0]) != math.prod(theirs[0]) or not math.prod(mine[0]):
        return None
    return source if is_contiguous(mine) and is_contiguous(theirs) else None


def _broadcast_strides(g: Geometry, sizes: tuple[int, ...]) -> tuple[int, ...] | None:
    """The strides with which an op that broadcasts an operand of geometry ``g`` to ``sizes``
    reads it; None if it does not broadcast so."""
    added = len(sizes) - len(g[0])
    if added < 0:
        return None
    out = [0] * added
    for n, s, m in zip(g[0], g[1], sizes[added:], strict=True):
        if n == m:
            out.append(s if m != 1 else 0)
        elif n == 1:
            out.append(0)
        else:
            return None
    return tuple(out)


def _restrided(sizes: tuple[int, ...], strides: tuple[int, ...], wanted: tuple[int, ...]) -> tuple[int, ...] | None:
    """The strides of memory laid out as (``sizes``, ``strides``) viewed as ``wanted`` (the
    same cells, row-major), by torch's own rule; None where no view can."""
    torch = torch_module()
    try:
        return tuple(torch.empty_strided(sizes, strides, device="meta").view(wanted).stride())
    except RuntimeError:
        return None


# -- the rewrites -----------------------------------------------------------------------------------


def _pointwise(graph: Any, node: Any, shapes: dict[Any, Geometry], module: Any) -> None:
    """Run ``node`` in the shape that saves the most views (ties: the first source shape).  An
    op writing ``out=`` a reshape writes the reshaped tensor itself."""
    if node not in shapes or not is_contiguous(shapes[node]) or shapes[node][2] != 0:
        return
    out = node.kwargs.get("out")
    if out is not None and writes(node) is not out:
        return
    if nodes_in({k: v for k, v in node.kwargs.items() if k != "out"}):
        return
    if any(isinstance(a, list | tuple | dict) and nodes_in(a) for a in node.args):
        return
    target = shapes[node]
    operands = list(dict.fromkeys(a for a in (*node.args, out) if hasattr(a, "op")))
    geometries = {o: _geometry(o, shapes, module) for o in operands}
    if not operands or any(g is None for g in geometries.values()):
        return
    candidates: dict[tuple[int, ...], None] = {}
    for o in operands:
        source = _reshape_of(o, shapes, module)
        g = geometries[o]
        assert g is not None
        source_geometry = None if source is None else _geometry(source, shapes, module)
        if source_geometry is not None:
            candidates[source_geometry[0]] = None
        elif g[0] != target[0] and g[0] and math.prod(g[0]) == math.prod(target[0]):
            candidates[g[0]] = None
    best: tuple[int, tuple[int, ...], dict[Any, Any]] | None = None
    for sizes in candidates:
        reads = _reads_in(sizes, target, operands, geometries, shapes, module)
        if reads is None or (out is not None and not _writable(reads[out], sizes, shapes, module)):
            continue
        saving = _views_saved(node, reads, sizes, target, shapes)
        better = saving >= 0 and (best is None or saving > best[0])
        if better and _fresh_result(node, reads, sizes, shapes, module):
            best = (saving, sizes, reads)
    if best is None:
        return
    _, sizes, reads = best
    torch = torch_module()
    made: dict[Any, Any] = {}

    def read(a: Any) -> Any:
        if not hasattr(a, "op"):
            return a
        if not isinstance(reads[a], tuple):
            return reads[a]
        if a not in made:  # a new view: (tensor, geometry)
            tensor, g = reads[a]
            made[a] = graph.call_function(torch.ops.aten.as_strided.default, (tensor, g[0], g[1], g[2]))
            made[a].meta = dict(a.meta)
            shapes[made[a]] = g
        return made[a]

    with graph.inserting_before(node):
        args = tuple(read(a) for a in node.args)
        kwargs = {k: read(v) for k, v in node.kwargs.items()}
        new = graph.call_function(node.target, args, kwargs)
        new.meta = dict(node.meta)
    shapes[new] = _fresh(sizes, target[3])
    _replace(graph, node, new, shapes)


def _reads_in(
    sizes: tuple[int, ...],
    target: Geometry,
    operands: list[Any],
    geometries: dict[Any, Geometry | None],
    shapes: dict[Any, Geometry],
    module: Any,
) -> dict[Any, Any] | None:
    """What each operand becomes when the op runs in ``sizes``: a tensor the op reads as it is,
    or ``(tensor, geometry)`` for a view to take; None if some operand cannot be read so."""
    reads: dict[Any, Any] = {}
    for o in operands:
        g = geometries[o]
        assert g is not None
        if not g[0]:  # a 0-d operand broadcasts to any shape, and promotes types its own way
            reads[o] = o
            continue
        strides = _broadcast_strides(g, target[0])
        restrided = None if strides is None else _restrided(target[0], strides, sizes)
        if restrided is None:
            return None
        wanted: Geometry = (sizes, restrided, g[2], g[3])
        source = _reshape_of(o, shapes, module) if is_view(o) else None
        for tensor in (source, o) if source is not None else (o,):
            tg = _geometry(tensor, shapes, module)
            # an operand the op broadcasts as the view would (not a 0-d one: that promotes types its own way)
            if tg is not None and (same_layout(tg, wanted) or (tg[0] and broadcasts(tg, wanted))):
                reads[o] = tensor
                break
        else:  # a view of the memory o views, if that has o's dtype, else of o
            base = o.args[0] if is_view(o) and hasattr(o.args[0], "op") else o
            bg = _geometry(base, shapes, module)
            reads[o] = (base if bg is not None and bg[3] == g[3] else o, wanted)
    return reads


def _writable(read: Any, sizes: tuple[int, ...], shapes: dict[Any, Geometry], module: Any) -> bool:
    """Whether an op running in ``sizes`` may write ``out=`` the tensor ``read``: one of exactly
    those sizes (an ``out=`` of other sizes, even one that broadcasts, is resized by the op), not
    a new view."""
    if isinstance(read, tuple):
        return False
    g = _geometry(read, shapes, module)
    return g is not None and g[0] == sizes


def _views_saved(
    node: Any, reads: dict[Any, Any], sizes: tuple[int, ...], target: Geometry, shapes: dict[Any, Geometry]
) -> int:
    """Views that go less views that come when ``node`` reads ``reads`` and runs in ``sizes``:
    an operand view only it read goes; a view of its result that is then the result itself
    goes; a new operand view comes, and one view of the result in the old shape for its
    readers that are not views."""
    saving = 0
    for o, read in reads.items():
        if isinstance(read, tuple):
            saving -= 1
        if read is not o and is_view(o) and set(o.users) == {node}:
            saving += 1
    result = _fresh(sizes, target[3])
    others = False
    for user in node.users:
        if _moved_view(user, node, shapes):
            saving += 1 if same_layout(shapes[user], result) else 0
        else:
            others = True
    return saving - (1 if others else 0)


def _fresh_result(
    node: Any, reads: dict[Any, Any], sizes: tuple[int, ...], shapes: dict[Any, Geometry], module: Any
) -> bool:
    """Whether the op on its new operands gives a fresh contiguous result of ``sizes``, as it
    gave one of its old: its operands broadcast to ``sizes`` (an ``out=`` tensor is not one: the
    op sizes it), and each steps through memory outermost dim first where it is not broadcast,
    so that torch lays the result out row-major.  The dtype stays: every operand keeps its own,
    and a 0-d one stays 0-d.  (Found by geometry alone: running the op on meta tensors would
    cost each process a second, the first time, to load torch's meta kernels.)"""
    geometries = []
    for a in nodes_in((node.args, {k: v for k, v in node.kwargs.items() if k != "out"})):
        read = reads[a]
        g = read[1] if isinstance(read, tuple) else _geometry(read, shapes, module)
        if g is None:
            return False
        geometries.append(g)
    try:
        joined = tuple(np.broadcast_shapes(*(g[0] for g in geometries)))
    except ValueError:
        return False
    if joined != sizes:
        return False
    for g in geometries:
        strides = [st for n, st in zip(g[0], g[1], strict=True) if n > 1 and st != 0]
        if any(a <= b for a, b in itertools.pairwise(strides)) or any(st < 0 for st in strides):
            return False
    return True


def _reduction(graph: Any, node: Any, shapes: dict[Any, Geometry], module: Any) -> None:
    """Reduce the tensor a reduction's operand reshapes, keeping dims, or the contiguous
    operand itself keeping dims where its readers are pointwise ops (see the module docstring)."""
    if len(node.args) != 2 or "keepdim" in node.kwargs or nodes_in(node.kwargs) or node not in shapes:
        return
    operand, dims = node.args
    if not hasattr(operand, "op") or not dims or not is_contiguous(shapes[node]) or shapes[node][2] != 0:
        return
    operand_geometry = _geometry(operand, shapes, module)
    if operand_geometry is None or not operand_geometry[0]:
        return
    rank = len(operand_geometry[0])
    source = _reshape_of(operand, shapes, module)
    if source is None:  # the operand itself, if contiguous: its readers may then broadcast the result
        if not is_contiguous(operand_geometry):
            return
        source, sizes, reduced_dims = operand, operand_geometry[0], {d % rank for d in dims}
    else:
        source_geometry = _geometry(source, shapes, module)
        assert source_geometry is not None  # a reshape's source has one
        sizes = source_geometry[0]
        found = _reduced_in(operand_geometry[0], {d % rank for d in dims}, sizes)
        if not found:
            return
        reduced_dims = found
    reduced = sorted(reduced_dims)
    kept = tuple(1 if k in reduced_dims else n for k, n in enumerate(sizes))
    result = _fresh(kept, shapes[node][3])
    others = [u for u in node.users if not _moved_view(u, node, shapes)]
    saving = (1 if source is not operand and set(operand.users) == {node} else 0) - (1 if others else 0)
    saving += sum(1 for u in node.users if u not in others and u in shapes and same_layout(shapes[u], result))
    if saving < 0 and not all(name_of(u) in POINTWISE and writes(u) is None for u in others):
        return
    with graph.inserting_before(node):
        new = graph.call_function(node.target, (source, reduced, True), dict(node.kwargs))
        new.meta = dict(node.meta)
    shapes[new] = result
    _replace(graph, node, new, shapes)


def _reduced_in(view_sizes: tuple[int, ...], reduced: set[int], sizes: tuple[int, ...]) -> set[int] | None:
    """The dims of ``sizes`` that reducing dims ``reduced`` of a row-major reshape of it (to
    ``view_sizes``) reduces, None unless each of its dims is wholly reduced or wholly kept.  A
    dim of ``n`` cells at contiguous stride ``s`` covers the digits ``[s, s * n)`` of the
    cells' positions; a dim of one cell covers none and is kept."""

    def spans(dims: tuple[int, ...]) -> list[tuple[int, int]]:
        return [(s, s * n) for n, s in zip(dims, contiguous_strides(dims), strict=True)]

    covered = sorted(span for k, span in enumerate(spans(view_sizes)) if k in reduced and span[0] < span[1])
    merged: list[list[int]] = []
    for lo, hi in covered:
        if merged and merged[-1][1] == lo:
            merged[-1][1] = hi
        else:
            merged.append([lo, hi])
    out: set[int] = set()
    for k, (lo, hi) in enumerate(spans(sizes)):
        if lo == hi:
            continue
        inside = any(a <= lo and hi <= b for a, b in merged)
        if inside:
            out.add(k)
        elif any(lo < b and a < hi for a, b in merged):
            return None
    return out


def _moved_view(user: Any, node: Any, shapes: dict[Any, Geometry]) -> bool:
    """Whether ``user`` is a view of ``node`` that can become the same view of ``node``'s
    cells in another shape: an ``as_strided`` of them, so not one in another dtype."""
    return (
        is_view(user)
        and user.args[0] is node
        and user in shapes
        and node in shapes
        and writes(user) is None
        and shapes[user][3] == shapes[node][3]
    )


def _replace(graph: Any, old: Any, new: Any, shapes: dict[Any, Geometry]) -> None:
    """Give ``old``'s readers ``new`` (a fresh contiguous tensor of ``old``'s cells in another
    shape): each view of ``old`` becomes the same view of ``new`` (or ``new`` itself where it
    is laid out so), everything else one view of ``new`` in ``old``'s geometry."""
    torch = torch_module()
    as_old = None
    for user in list(old.users):
        if _moved_view(user, old, shapes):
            g = shapes[user]
            if same_layout(g, shapes[new]):
                user.replace_all_uses_with(new)
                graph.erase_node(user)
                continue
            with graph.inserting_before(user):
                made = graph.call_function(torch.ops.aten.as_strided.default, (new, g[0], g[1], g[2]))
                made.meta = dict(user.meta)
            shapes[made] = g
            user.replace_all_uses_with(made)
            graph.erase_node(user)
            continue
        if as_old is None:
            with graph.inserting_after(new):
                g = shapes[old]
                as_old = graph.call_function(torch.ops.aten.as_strided.default, (new, g[0], g[1], g[2]))
                as_old.meta = dict(old.meta)
            shapes[as_old] = g
        user.replace_input_with(old, as_old)
    graph.erase_node(old)
