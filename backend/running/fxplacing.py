"""Two rewrites of a traced device program that remove calls around its kernels, run by
:func:`edatalog.backend.running.fxpasses.simplify` after the views are folded and the values
shared:

- :func:`results_in_place`: the interpreter computes a block of a relation into a fresh tensor
  and then copies it into its place in the relation's buffer (``t = mul(a, b); addcmul(t, c,
  d, out=t); view(e).copy_(t)``: the two halves of a rotary embedding, the pieces of a
  concatenation).  The op writes into that place instead (``mul(a, b, out=view(e))``): one
  tensor and one copy less per block;
- :func:`implied_broadcasts`: a view that only broadcasts a tensor (``as_strided(w, (1, 256),
  (0, 1))`` of ``w[256]``) read by a pointwise op is the tensor itself, which the op
  broadcasts the same way.

All keep every result bit for bit: an op is computed into a strided place only if it gives the
same bits whatever the layout (:data:`edatalog.backend.running.fxnodes.LAYOUT_EXACT`: torch's
CPU kernels run a vectorized loop over contiguous rows and a scalar one elsewhere, and for some
ops the two differ in the last bit), and an operand is left for the op to broadcast only where
the result keeps its layout.
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np

from edatalog.backend.running.fxnodes import (
    POINTWISE,
    aliased_args,
    aten_of,
    exact_in_any_layout,
    is_contiguous,
    is_view,
    name_of,
    nodes_in,
    writes,
)
from edatalog.backend.running.fxreuse import REUSED, out_variant
from edatalog.backend.running.tracer import DEVICE, Geometry

# Views up to this many cells are compared cell by cell to tell whether they overlap; larger
# ones are taken to overlap (a rewrite is then left undone, never made wrong).
_COMPARED_CELLS = 1 << 16


def results_in_place(graph: Any, shapes: dict[Any, Geometry]) -> int:
    """Compute each pointwise result that is copied whole into a view of a fresh buffer in that
    view (see the module docstring); returns how many copies went.

    The result's other users must be in-place updates of it (``out=`` it), and between the op
    and the copy nothing may read or write cells of the buffer that the view covers: the op
    now writes them earlier."""
    nodes = list(graph.nodes)
    order: dict[Any, float] = {node: k for k, node in enumerate(nodes)}  # a node moved: between two
    owners = _owners(nodes)
    touching = _touching(nodes, owners)
    placed_as: dict[Any, Any] = {}  # an op already rewritten: the call that now writes in place
    done = 0
    for copy in nodes:
        if aten_of(copy) != ("copy_", "default") or copy.users:
            continue
        view, made = copy.args[0], copy.args[1]
        placed = _placed(made, view, copy, shapes, order)
        if placed is None:
            continue
        buffer, updates = placed
        positions = touching.get(buffer, [])
        start, stop = bisect.bisect_left(positions, order[made]), bisect.bisect_left(positions, order[copy])
        between = [placed_as.get(nodes[k], nodes[k]) for k in positions[start:stop]]
        if not _untouched(between, view, buffer, owners, shapes):
            continue
        for node in (buffer, view):  # the buffer and its view are made before the op that fills it
            if order[node] > order[made]:
                made.prepend(node)
                order[node] = order[made] - 0.5
        with graph.inserting_before(made):
            into = graph.call_function(out_variant(made.target), made.args, {**made.kwargs, "out": view})
            into.meta = {**made.meta, REUSED: True}  # called through torch's binding where it takes ``out=``
        shapes[into] = shapes[view]
        owners[into] = frozenset({buffer})
        for update in updates:
            update.replace_input_with(made, view)
            owners[update] = frozenset({buffer})
        for k in (int(order[made]), *(int(order[u]) for u in updates)):  # they now touch the buffer
            bisect.insort(positions, k)
        touching[buffer] = positions
        graph.erase_node(copy)  # its write is the new call's, at the op's place
        graph.erase_node(made)
        placed_as[made] = into
        done += 1
    return done


def _touching(nodes: list[Any], owners: dict[Any, frozenset[Any]]) -> dict[Any, list[int]]:
    """For each node owning memory, the positions (in ``nodes``) of the ops that read or write
    it through any of their arguments, in order; views themselves touch nothing."""
    out: dict[Any, list[int]] = {}
    for k, node in enumerate(nodes):
        if is_view(node):
            continue
        for owner in {o for a in nodes_in((node.args, node.kwargs)) for o in owners.get(a, (a,))}:
            out.setdefault(owner, []).append(k)
    return out


def _owners(nodes: list[Any]) -> dict[Any, frozenset[Any]]:
    """For each node whose result may share memory with its arguments' (a view, a write, a
    ``getitem`` of a split, a call outside ATen: :func:`~edatalog.backend.running.fxnodes.aliased_args`),
    the nodes owning that memory."""
    owners: dict[Any, frozenset[Any]] = {}
    for node in nodes:
        aliased = aliased_args(node)
        if aliased:
            owners[node] = frozenset(o for a in aliased for o in owners.get(a, (a,)))
    return owners


def _placed(
    made: Any, view: Any, copy: Any, shapes: dict[Any, Geometry], order: dict[Any, float]
) -> tuple[Any, list[Any]] | None:
    """For ``copy`` (``view.copy_(made)``) that :func:`results_in_place` may rewrite: the fresh
    buffer that ``view`` views and the in-place updates of ``made``; else None."""
    if not hasattr(made, "op") or not exact_in_any_layout(made) or writes(made) is not None:
        return None
    if made.target._schema.is_mutable or out_variant(made.target) is None:
        return None
    if not is_view(view) or not hasattr(view.args[0], "op") or name_of(view.args[0]) != "empty":
        return None
    buffer = view.args[0]
    if made not in shapes or view not in shapes or shapes[made][::3] != shapes[view][::3]:
        return None  # not the same sizes and dtype
    device = made.meta.get(DEVICE)
    if device is None or device != buffer.meta.get(DEVICE):
        return None  # a copy between devices moves the block: no op writes across
    updates = [u for u in made.users if u is not copy]
    for update in updates:
        if not exact_in_any_layout(update) or writes(update) is not made or update.users:
            return None
        if order[update] > order[copy]:
            return None
    return buffer, updates


def _untouched(
    between: list[Any], view: Any, buffer: Any, owners: dict[Any, frozenset[Any]], shapes: dict[Any, Geometry]
) -> bool:
    """Whether no node of ``between`` (the ops touching ``buffer`` between the op and its copy,
    an op already rewritten as its new call) reads or writes cells of ``buffer`` that ``view``
    covers, the op's updates included (what they read besides the result).  A copy already
    removed touches nothing: its write is its op's, which is there.  A call outside ATen, or an
    argument that is not a plain view of the buffer (a ``getitem`` of a split of it), may touch
    any cell."""
    for node in between:
        if node._erased:
            continue
        if aten_of(node) is None:
            return False
        for arg in nodes_in((node.args, node.kwargs)):
            if buffer not in owners.get(arg, (arg,)):
                continue
            if arg is buffer or not is_view(arg) or not _disjoint(shapes.get(arg), shapes[view]):
                return False
    return True


def _disjoint(a: Geometry | None, b: Geometry) -> bool:
    """Whether two views of one storage share no cell (cells counted exactly for small views;
    larger ones are taken to share)."""
    if a is None or a[3] != b[3]:  # cells of another size: offsets in other units
        return False
    if int(np.prod(a[0])) > _COMPARED_CELLS or int(np.prod(b[0])) > _COMPARED_CELLS:
        return False
    return not np.intersect1d(_cells(a), _cells(b)).size


def _cells(g: Geometry) -> np.ndarray:
    sizes, strides, offset, _ = g
    cells = np.full((1,) * len(sizes), offset, dtype=np.int64)
    for k, (n, s) in enumerate(zip(sizes, strides, strict=True)):
        shape = [1] * len(sizes)
        shape[k] = n
        cells = cells + (np.arange(n, dtype=np.int64) * s).reshape(shape)
    return cells.ravel()


def implied_broadcasts(graph: Any, shapes: dict[Any, Geometry]) -> int:
    """Give each pointwise op the tensor a view of its only broadcasts (see the module
    docstring), where the op's result keeps its sizes; returns how many operands changed."""
    changed = 0
    for view in list(graph.nodes):
        if not is_view(view) or not hasattr(view.args[0], "op"):
            continue
        source = view.args[0]
        if source not in shapes or view not in shapes or not broadcasts(shapes[source], shapes[view]):
            continue
        for user in list(view.users):
            if _reads_broadcast(user, view, source, shapes):
                user.replace_input_with(view, source)
                changed += 1
        if not view.users:
            graph.erase_node(view)
    return changed


def broadcasts(source: Geometry, view: Geometry) -> bool:
    """Whether ``view`` is ``source`` broadcast to the view's sizes, as an op broadcasts an
    operand: dims added in front, and dims of one cell expanded, each with stride 0."""
    (src_sizes, src_strides, src_offset, src_dtype), (sizes, strides, offset, dtype) = source, view
    added = len(sizes) - len(src_sizes)
    if added < 0 or offset != src_offset or dtype != src_dtype:
        return False
    if any(n != 1 and s != 0 for n, s in zip(sizes[:added], strides[:added], strict=True)):
        return False
    for n, s, m, t in zip(sizes[added:], strides[added:], src_sizes, src_strides, strict=True):
        if m == 1:
            if n != 1 and s != 0:
                return False
        elif n != m or s != t:
            return False
    return True


def _reads_broadcast(user: Any, view: Any, source: Any, shapes: dict[Any, Geometry]) -> bool:
    """Whether ``user`` is a pointwise op that only reads ``view`` as an operand and whose
    result keeps its sizes, dtype and layout when it reads ``source`` instead.  Later views of
    the result address its cells by the recorded strides, and torch lays a fresh result out
    after its operands' strides (dims of one cell included), so that is kept only where it is
    sure: the result goes to an ``out=`` tensor, or every operand is laid out contiguously and
    so is the result."""
    aten = aten_of(user)
    if aten is None or aten[0] not in POINTWISE or is_view(user) or user not in shapes:
        return False
    if writes(user) is view or any(v is view for v in user.kwargs.values()):
        return False
    operands = [source if a is view else a for a in user.args if hasattr(a, "op")]
    if any(a not in shapes for a in operands):
        return False
    if not shapes[source][0] and any(shapes[a][3] != shapes[user][3] for a in operands):
        return False  # a 0-d operand does not take part in type promotion as a 1-cell one does
    try:  # an ``out=`` tensor does not take part: an op resizes it to its operands' broadcast
        joined = tuple(np.broadcast_shapes(*(shapes[a][0] for a in operands)))
    except ValueError:
        return False
    if joined != tuple(shapes[user][0]):
        return False
    if user.kwargs.get("out") is not None:
        return True
    return all(is_contiguous(shapes[a]) for a in [*operands, user])
