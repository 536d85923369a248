"""Routed contractions: a sum of products whose weight is looked up by a value, as one grouped
matrix product instead of a gather of weights.

    h1[t, k, f] += x[t, d] * w1[e, f, d] where route[t, k] = e.     # a mixture of experts' layer

Every point ``(t, k)`` reads the expert ``e`` that ``route`` names.  The general lookup path
gathers ``w1[route[t, k]]`` at every point (``T·K·F·D`` values: gigabytes at Mixtral's widths)
and multiplies row by row.  Here the points are sorted by expert (dispatch), each expert's rows
multiply its own weight matrix in one grouped GEMM (``torch._grouped_mm`` over offsets; for f64,
which that kernel does not take, a loop of matmuls, or while a graph is recorded every expert
over every row, masked), and the rows are added
back to the head's cells (combine: ``index_add``, which also sums over ``k`` where the head
leaves it out, ``y[t, d] += a[t, k, f] * w2[e, d, f] where route[t, k] = e``).  The work is
that of the points that exist, ``K/E`` of the dense form's, with exact results: nothing is
dropped.  A block over part of the experts (expert parallelism) takes the points routed to its
part; the others are absent there, as on the general path.

The grouped GEMM keeps every shape static (counts and offsets stay on the device), so a
recorded graph replays it for any routing.
"""

from __future__ import annotations

import math
from typing import Any

from edatalog.backend.kernels.arrays import Array, ArrayOps, torch_module
from edatalog.backend.kernels.contract import squeeze
from edatalog.backend.kernels.operands import access_view
from edatalog.ir.forms import RoutedForm
from edatalog.ir.graph import JoinAgg


def evaluate_routed(
    node: JoinAgg,
    form: RoutedForm,
    routes: Array,
    data: list[Array],
    scale: Array | None,
    xp: ArrayOps,
    device: Any,
    mask: Array | None = None,
) -> tuple[Array, Array | None, list[str]]:
    """The node's value over its output indices (join order), its presence (None: every
    cell), and those indices.  ``routes``: the route's values as the node's access reads them
    (i64, range-checked); ``data``: the inputs in the compute dtype; ``mask``: where the
    gathered input has cells (over the join space, as its access reads it; None: everywhere).
    A row of the gathered input with no cell is not dispatched: it adds nothing."""
    torch = torch_module()
    lk = node.lookups[form.lookup]
    order = [i.name for i in node.indices]
    box = node.box
    rows = math.prod(box[v] for v in form.routed)
    experts = box[lk.index]
    # Dispatch: each point's expert within this block's part (the last bucket: elsewhere).
    value = _over(access_view(routes, node.inputs[lk.input], order, box, xp=xp), order, form.routed, box, xp)
    value = value.reshape(rows) - lk.offset
    inside = (value >= 0) & (value < experts)
    if mask is not None:
        has = _over(mask, order, (*form.routed, *form.shared), box, xp).reshape(rows, -1).any(dim=1)
        inside = inside & has
    bucket = torch.where(inside, value, experts)
    perm = torch.argsort(bucket, stable=True)
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=device)
    counts.index_add_(0, bucket, torch.ones_like(bucket))
    if xp.reads_back:
        # Interpreted: the buffers hold the rows routed here, as many as there are (a block
        # over part of the experts gets about its part's share).  A recorded graph keeps every
        # row (static shapes: it replays for any routing); the grouped GEMM skips the rest.
        perm = perm[: int(counts[:experts].sum().item())]
    g = access_view(data[form.gathered], node.inputs[form.gathered], order, box, xp=xp)
    shared = math.prod(box[v] for v in form.shared)
    a = _over(g, order, (*form.routed, *form.shared), box, xp).reshape(rows, shared)
    a = a.index_select(0, perm)
    w = access_view(data[form.weight], node.inputs[form.weight], order, box, xp=xp)
    cols = math.prod(box[v] for v in form.columns)
    # The weight as it lies (a transposed view where its axes are so ordered), never copied.
    b = _over(w, order, (lk.index, *form.shared, *form.columns), box, xp, copy=False).reshape(experts, shared, cols)
    product = _grouped(a, b, counts, bucket.index_select(0, perm), len(perm), experts, xp)
    product = torch.where(inside.index_select(0, perm)[:, None], product, torch.zeros((), dtype=product.dtype))
    if scale is not None:
        product = product * scale
    # Combine: each row to its head cell (summing the points that share one).
    cell = _cell_ids(torch, form, box, device).index_select(0, perm)
    cells = math.prod(box[v] for v in form.kept)
    out = torch.zeros((cells, cols), dtype=product.dtype, device=device)
    out.index_add_(0, cell, product)
    out_vars = [v for v in order if v in form.kept or v in form.columns]
    placed = [*form.kept, *form.columns]
    result = out.reshape([box[v] for v in placed]).permute([placed.index(v) for v in out_vars])
    present = None
    if lk.offset or experts < lk.extent or mask is not None:  # cells with no point here are absent
        hit = torch.zeros(cells, dtype=torch.int64, device=device)
        hit.index_add_(0, cell, inside.index_select(0, perm).to(torch.int64))
        shape = [box[v] if v in form.kept else 1 for v in out_vars]
        kept_order = [v for v in out_vars if v in form.kept]
        present = (hit > 0).reshape([box[v] for v in form.kept]).permute([form.kept.index(v) for v in kept_order])
        present = present.reshape(shape).expand([box[v] for v in out_vars])
    return result, present, out_vars


def _over(
    view: Array, order: list[str], want: tuple[str, ...], box: dict[str, int], xp: ArrayOps, copy: bool = True
) -> Array:
    """``view`` (over the join space) as an array over ``want``, in that order, expanded to the
    box where it does not vary (contiguous with ``copy``, else a view)."""
    arr, ix = squeeze(view, order, xp)
    for v in want:
        if v not in ix:
            arr, ix = arr.unsqueeze(-1), (*ix, v)
    arr = arr.permute([ix.index(v) for v in want]).expand([box[v] for v in want])
    return arr.contiguous() if copy else arr


def _cell_ids(torch: Any, form: RoutedForm, box: dict[str, int], device: Any) -> Array:
    """Per routed point (row-major over ``form.routed``), the flat number of its head cell."""
    ids = torch.zeros([box[v] for v in form.routed], dtype=torch.int64, device=device)
    stride = 1
    for v in reversed(form.kept):
        axis = form.routed.index(v)
        shape = [box[v] if k == axis else 1 for k in range(len(form.routed))]
        ids = ids + torch.arange(box[v], device=device).reshape(shape) * stride
        stride *= box[v]
    return ids.reshape(-1)


def _grouped(a: Array, b: Array, counts: Array, buckets: Array, rows: int, experts: int, xp: ArrayOps) -> Array:
    """Rows of ``a`` (sorted by expert, ``counts`` each, ``buckets`` naming each row's; the last
    count: rows of no expert here) times their expert's matrix of ``b``."""
    torch = torch_module()
    if _grouped_mm_takes(a):
        # Rows of 16-byte multiples: a block of an odd width (a plan's uneven split) is padded
        # with zeros, which add nothing to the products.
        align = 16 // a.element_size()
        inner, cols = (-a.shape[1]) % align, (-b.shape[-1]) % align
        if inner:
            a = torch.nn.functional.pad(a, (0, inner))
            b = torch.nn.functional.pad(b, (0, 0, 0, inner))
        if cols:
            b = torch.nn.functional.pad(b, (0, cols))
        offsets = torch.cumsum(counts[:experts], 0).to(torch.int32)
        out = torch._grouped_mm(a, b, offs=offsets)
        return out[:, : out.shape[1] - cols] if cols else out
    out = torch.zeros((rows, b.shape[-1]), dtype=a.dtype, device=a.device)
    if not xp.reads_back:
        # Recording a graph (f64, which the grouped kernel does not take): every expert's matrix
        # times every row, each row kept for its own expert.  Static shapes, E times the work:
        # a precision path, not a fast one.
        for e in range(experts):
            out += torch.where((buckets == e)[:, None], a @ b[e], torch.zeros((), dtype=a.dtype))
        return out
    start = 0
    for e in range(experts):
        n = int(counts[e].item())  # the counts read back: each expert multiplies its own rows only
        if n:
            torch.matmul(a[start : start + n], b[e], out=out[start : start + n])
        start += n
    return out


def _grouped_mm_takes(a: Array) -> bool:
    """``torch._grouped_mm`` takes f32, bf16 and f16 (not f64)."""
    torch = torch_module()
    return hasattr(torch, "_grouped_mm") and a.dtype in (torch.float32, torch.bfloat16, torch.float16)
