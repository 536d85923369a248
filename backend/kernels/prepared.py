"""A block's evaluation decided once for the layouts it is called with, for runtimes that run
the same blocks on every call.

:func:`~edatalog.backend.kernels.joinagg.evaluate_node` decides on every call how to evaluate a block:
its views, its path, the order of a contraction, which ops may write in place.  Those decisions
depend only on the block and on its inputs' shapes, dtypes and layouts, and in Python they cost
about 0.1 ms a block: as much as the arithmetic of a small block, and a tenth of a 1024-wide
GEMM's on a CPU.  :func:`prepare_block` takes them once, for the two kinds of block that make up
most programs, and the :class:`Prepared` result runs with a handful of torch calls:

- a sum of the product of two inputs (a GEMM, a batched GEMM, a sum of squares), times
  constants, with no guard;
- an elementwise rule (no aggregated index), its ops in place where an array has no other
  reader, a sum or difference with a product or quotient as one call (``ops.fusions``);
- a convolution (:mod:`edatalog.backend.kernels.convolution`): one call of torch's.

Both need the block's presence decided beforehand (:class:`~edatalog.backend.kernels.joinagg.Known`) and
no input read outside its relation.  Anything else, and every numpy evaluation (the reference),
gets None, and the caller evaluates with ``evaluate_node``; a prepared block computes what
``evaluate_node`` computes, op for op.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from edatalog.backend.kernels import ops
from edatalog.backend.kernels.arrays import Array, ArrayOps, torch_module
from edatalog.backend.kernels.convolution import ConvForm, conv_form, convolve
from edatalog.backend.kernels.joinagg import (
    CHUNK_POINTS,
    Known,
    constant_scale,
    native_arithmetic,
    native_gemm,
    prepare,
    read_once,
)
from edatalog.backend.kernels.operands import index_values, view_spec
from edatalog.ir import dtypes
from edatalog.ir.forms import carried_filter, product_form, routed_form, without_full_filters, without_lookup
from edatalog.ir.graph import JoinAgg
from edatalog.ir.scalar import OPS, Const, IndexValue, Load, Op

Layout = tuple[tuple[int, ...], Any, bool]  # an input's shape, dtype and contiguity


def layout_of(data: Sequence[Array]) -> tuple[Layout, ...]:
    """What a prepared block depends on in its inputs."""
    return tuple((tuple(d.shape), d.dtype, bool(d.is_contiguous())) for d in data)


@dataclass(frozen=True)
class _View:
    """How one input becomes an array over the join space: converted to ``dtype`` (a copy when
    its dtype differs or it is not contiguous), then strided."""

    dtype: Any
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    copies: bool  # the conversion makes a new array, which nothing else holds


def _views(node: JoinAgg, layouts: Sequence[Layout], cdt: Any, order: list[str]) -> list[_View] | None:
    sizes = tuple(node.box[v] for v in order)
    views = []
    for acc, (shape, dtype, contiguous) in zip(node.inputs, layouts, strict=True):
        extents, pads, vshape, strides, offset = view_spec(acc, tuple(order), sizes)
        if any(a or b for a, b in pads) or any(s < 0 for s in strides) or math.prod(shape) != math.prod(extents):
            return None  # padding, reversed axes: the general path
        if not math.prod(shape):
            return None
        views.append(_View(cdt, vshape, strides, offset, dtype != cdt or not contiguous))
    return views


def _converted(torch: Any, data: Array, dtype: Any) -> Array:
    """``data`` in ``dtype`` and contiguous (itself when it is)."""
    if not data.is_contiguous():  # converted and compacted in one pass
        return torch.empty(data.shape, dtype=dtype, device=data.device).copy_(data)
    return data if data.dtype == dtype else data.to(dtype)


def _view(torch: Any, data: Array, v: _View) -> Array:
    data = _converted(torch, data, v.dtype)
    return torch.as_strided(data, v.shape, v.strides, data.storage_offset() + v.offset)


def _merged(view: _View, order: list[str], groups: Sequence[Sequence[str]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The view's axes taken in ``groups``, each group as one axis: its sizes and strides, or
    ``((), ())`` when some group's axes cannot merge into one stride."""
    sizes, strides = [], []
    for group in groups:
        axes = [(view.shape[k], view.strides[k]) for v in group if view.shape[k := order.index(v)] != 1]
        if any(s0 != s1 * n1 for (_, s0), (n1, s1) in itertools.pairwise(axes)):
            return (), ()
        sizes.append(math.prod(n for n, _ in axes))
        strides.append(axes[-1][1] if axes else 0)
    return tuple(sizes), tuple(strides)


class Prepared:
    """A block's evaluation for fixed input layouts: ``__call__(data)`` returns what
    ``evaluate_node(block, data, [None] * n, TORCH, known)`` returns."""

    def __call__(self, data: Sequence[Array]) -> tuple[Array, Array | None, list[str]]:
        raise NotImplementedError


def general_path(block: JoinAgg) -> bool:
    """Whether the torch runtime evaluates ``block`` (a rule's block, as ``restrict`` makes it)
    on the general path whatever its inputs' layouts: it looks values up, or aggregates other
    than a sum of a product of two loads under no guard the block's box leaves.  The timeline
    prices that path apart (see ``Device.general_bandwidth``): it materializes masks and passes
    over the block's arrays several times, where a prepared block makes one torch call.  An
    elementwise block too large for one pass is evaluated by the general path too, but in
    chunks of the same torch ops at memory speed (measured on a CPU: 0.95-1.06x torch's own
    expression at 4-8M points), so it is priced as a prepared block: pricing it at the masked
    path's rate made splitting a block under :data:`CHUNK_POINTS` look faster than it is.  A
    routed contraction (``backend/kernels/routed.py``) is a grouped GEMM, not the general path."""
    node = without_full_filters(prepare(block))
    carried = carried_filter(node)
    if carried is not None:  # evaluated as the rule without its filter, masked
        node = without_lookup(node, carried)
    if node.lookups:  # a routed contraction is a grouped GEMM; any other lookup gathers
        return routed_form(node) is None
    if node.agg_indices:
        return _product_loads(node) is None and conv_form(node) is None
    return False


def _product_loads(node: JoinAgg) -> list[Load] | None:
    """The two loads whose product a prepared contraction sums (``out += c * a * b``, no guard),
    or None when ``node`` (prepared) is no such sum."""
    if node.agg != "sum" or not node.guard.is_true:
        return None
    form = product_form(node)
    if form is None or len(form.factors) != 2 or any(power != 1 for _, power in form.factors):
        return None
    loads = [n for k, _ in form.factors if isinstance(n := node.expr.nodes[k], Load)]
    return loads if len(loads) == 2 else None


def prepare_block(
    block: JoinAgg, layouts: Sequence[Layout], xp: ArrayOps, device: Any, known: Known | None
) -> Prepared | None:
    """The block prepared for inputs laid out as ``layouts`` (every cell present), or None
    where only the general evaluation applies."""
    node = without_full_filters(prepare(block))
    if xp.name != "torch" or known is None or node.lookups:
        return None
    if node.agg_indices:
        built = _Contraction.build(node, layouts, xp, device, known)
        return built if built is not None else _Convolution.build(node, layouts, xp, device, known)
    return _Elementwise.build(node, layouts, xp, device, known)


class _Contraction(Prepared):
    """``out += c * a[...] * b[...]``: a matmul (or a dot product per batch) of two views, as
    ``contract`` pairs them."""

    @staticmethod
    def build(node: JoinAgg, layouts: Sequence[Layout], xp: ArrayOps, device: Any, known: Known) -> Prepared | None:
        loads = _product_loads(node)
        if loads is None:
            return None
        native = native_gemm(node, [None] * len(layouts), xp, device)
        if native and any(dtype != xp.dtype(node.dtype) for _, dtype, _ in layouts):
            return None
        cdt = xp.dtype(node.dtype if native else dtypes.compute_dtype(node.dtype))
        order = [i.name for i in node.indices]
        views = _views(node, layouts, cdt, order)
        if views is None:
            return None
        inputs = [n.input for n in loads]
        ixs = [tuple(v for v, n in zip(order, views[k].shape, strict=True) if n != 1) for k in inputs]
        out_vars = [v for v in order if v not in node.agg_indices]
        if not any(v in ixs[1] and v not in out_vars for v in ixs[0]):
            return None  # nothing summed between them: an outer product, the general path's
        return _Contraction(node, xp, device, known, views, cdt, inputs, ixs, out_vars, order)

    def __init__(
        self,
        node: JoinAgg,
        xp: ArrayOps,
        device: Any,
        known: Known,
        views: list[_View],
        cdt: Any,
        inputs: list[int],
        ixs: list[tuple[str, ...]],
        out_vars: list[str],
        order: list[str],
    ) -> None:
        self.torch, self.xp, self.views, self.inputs, self.cdt = torch_module(), xp, views, inputs, cdt
        self.present, self.out_vars = known.present, out_vars
        box, out = node.box, set(out_vars)
        self.squeezed = [tuple(box[v] for v in ix) for ix in ixs]
        # Indices only one operand has, and the result does not, are summed out first.
        self.private = [tuple(k for k, v in enumerate(a) if v not in out and v not in b) for a, b in (ixs, ixs[::-1])]
        ix, iy = (tuple(v for v in a if v in out or v in b) for a, b in (ixs, ixs[::-1]))
        batch = [v for v in ix if v in iy and v in out]
        shared = [v for v in ix if v in iy and v not in out]
        rows = [v for v in ix if v not in iy]
        cols = [v for v in iy if v not in ix]
        self.perm_x = [ix.index(v) for v in (*batch, *rows, *shared)]
        self.perm_y = [iy.index(v) for v in (*batch, *shared, *cols)]
        self.nb, self.nr, self.ns, self.nc = (math.prod(box[v] for v in g) for g in (batch, rows, shared, cols))
        made = (*batch, *rows, *cols)
        self.made_shape = [box[v] for v in made]
        self.final_perm = [made.index(v) for v in out_vars if v in made]
        spanned = set(ixs[0]) | set(ixs[1])
        self.repeat = math.prod(box[v] for v in node.agg_indices if v not in spanned and box[v] != 1)
        self.shape = [box[v] if v in made else 1 for v in out_vars]
        self.full = [box[v] for v in out_vars]
        self.scale = constant_scale(node, cdt, xp, device)
        self.identity = self.final_perm == sorted(self.final_perm) and self.shape == self.full
        # The operands as (batch, rows, shared) and (batch, shared, cols) strided views of the
        # inputs, when their groups of axes merge (they do for GEMMs over row-major relations).
        self.strided: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        if not any(self.private):
            dot, gemm = self.nr == 1 and self.nc == 1, self.nb == 1
            gx = [batch, shared] if dot else [rows, shared] if gemm else [batch, rows, shared]
            gy = [batch, shared] if dot else [shared, cols] if gemm else [batch, shared, cols]
            merged = [_merged(views[k], order, g) for k, g in zip(inputs, (gx, gy), strict=True)]
            if all(sizes for sizes, _ in merged):
                self.strided = merged

    def __call__(self, data: Sequence[Array]) -> tuple[Array, Array | None, list[str]]:
        torch, xp = self.torch, self.xp
        (i, j), (sx, sy) = self.inputs, self.squeezed
        if self.strided:
            return self._strided(data)
        x = _view(torch, data[i], self.views[i])
        y = x if j == i else _view(torch, data[j], self.views[j])  # x * x: one conversion
        x, y = x.reshape(sx), y.reshape(sy)
        if self.private[0]:
            x = x.sum(dim=self.private[0])
        if self.private[1]:
            y = y.sum(dim=self.private[1])
        nb, nr, ns, nc = self.nb, self.nr, self.ns, self.nc
        lhs = x.permute(self.perm_x).reshape(nb, nr, ns)
        rhs = y.permute(self.perm_y).reshape(nb, ns, nc)
        if nr == 1 and nc == 1:  # a dot product per batch
            result = (lhs.reshape(nb, ns) * rhs.reshape(nb, ns)).sum(dim=1)
        elif nb == 1:
            result = xp.matmul(lhs.reshape(nr, ns), rhs.reshape(ns, nc))
        else:
            result = xp.matmul(lhs, rhs)
        return self._finish(result)

    def _strided(self, data: Sequence[Array]) -> tuple[Array, Array | None, list[str]]:
        """Both operands straight as the 2-d or 3-d views the product takes: no reshapes."""
        torch, xp = self.torch, self.xp
        (i, j), ((sx, tx), (sy, ty)) = self.inputs, self.strided
        dx = _converted(torch, data[i], self.cdt)
        dy = dx if j == i else _converted(torch, data[j], self.cdt)  # x * x: one conversion
        lhs = torch.as_strided(dx, sx, tx, dx.storage_offset() + self.views[i].offset)
        rhs = torch.as_strided(dy, sy, ty, dy.storage_offset() + self.views[j].offset)
        if self.nr == 1 and self.nc == 1:  # a dot product per batch (a sum of squares: x * x)
            mine = self.views[i].copies and lhs.is_contiguous()  # a converted copy: multiply in place
            return self._finish((lhs.mul_(rhs) if mine else lhs * rhs).sum(dim=1))
        return self._finish(xp.matmul(lhs, rhs))

    def _finish(self, result: Array) -> tuple[Array, Array | None, list[str]]:
        """The product laid out over the output indices, times its constants."""
        xp = self.xp
        if self.identity:
            value = result.reshape(self.full)
        else:
            value = result.reshape(self.made_shape).permute(self.final_perm).reshape(self.shape).broadcast_to(self.full)
        if self.repeat != 1:
            value = value * self.repeat
        if self.scale is not None:
            value = value * self.scale
        return xp.cast(value, self.cdt), self.present, self.out_vars


class _Convolution(Prepared):
    """A convolution (see :func:`conv_form`): its inputs converted to the compute dtype, one
    call of torch's convolution, its result laid out over the output indices."""

    @staticmethod
    def build(node: JoinAgg, layouts: Sequence[Layout], xp: ArrayOps, device: Any, known: Known) -> Prepared | None:
        form = conv_form(node)
        if form is None:
            return None
        half = node.dtype in ("bf16", "f16") and xp.native_matmul(node.dtype, device)
        cdt = xp.dtype(node.dtype if half else dtypes.compute_dtype(node.dtype))
        shapes = []
        for acc, (shape, _, _) in zip(node.inputs, layouts, strict=True):
            extents = tuple(p.extent for ax in acc.axes for p in ax.parts)
            if math.prod(shape) != math.prod(extents) or not math.prod(extents):
                return None
            shapes.append(extents)
        return _Convolution(form, xp, known, cdt, shapes, constant_scale(node, cdt, xp, device))

    def __init__(
        self, form: ConvForm, xp: ArrayOps, known: Known, cdt: Any, shapes: list[tuple[int, ...]], scale: Any
    ) -> None:
        self.torch, self.xp, self.form, self.cdt, self.shapes, self.scale = torch_module(), xp, form, cdt, shapes, scale
        self.present, self.out_vars = known.present, list(form.out_vars)

    def __call__(self, data: Sequence[Array]) -> tuple[Array, Array | None, list[str]]:
        torch, form = self.torch, self.form
        x = _converted(torch, data[form.data], self.cdt).reshape(self.shapes[form.data])
        w = _converted(torch, data[form.weight], self.cdt).reshape(self.shapes[form.weight])
        value = convolve(form, x, w)
        if self.scale is not None:
            value = value * self.scale
        return value, self.present, self.out_vars


class _Elementwise(Prepared):
    """A rule with no aggregated index: its scalar ops in turn over the views, each writing
    into an argument only it reads where that argument is a dense array of the result's shape
    (see ``_eval_dag``)."""

    @staticmethod
    def build(node: JoinAgg, layouts: Sequence[Layout], xp: ArrayOps, device: Any, known: Known) -> Prepared | None:
        if math.prod(node.box.values()) > CHUNK_POINTS:
            return None  # the general path evaluates it in chunks
        native = native_arithmetic(node, [dtype for _, dtype, _ in layouts], [None] * len(layouts), xp)
        cdt = xp.dtype(node.dtype if native else dtypes.compute_dtype(node.dtype))
        order = [i.name for i in node.indices]
        views = _views(node, layouts, cdt, order)
        if views is None:
            return None
        return _Elementwise(node, xp, device, known, views, cdt, order)

    def __init__(
        self, node: JoinAgg, xp: ArrayOps, device: Any, known: Known, views: list[_View], cdt: Any, order: list[str]
    ) -> None:
        self.torch, self.xp, self.views, self.cdt = torch_module(), xp, views, cdt
        self.present, self.order = known.present, order
        self.full = [node.box[v] for v in order]
        expr = node.expr
        single = read_once(expr)
        self.root = expr.root
        self.constants: dict[int, Array] = {}
        self.steps: list[tuple[int, str | int | ops.Fused, tuple[int, ...], int | None]] = []  # node, what, args, into
        shapes: dict[int, tuple[int, ...]] = {}
        for k in expr.live():
            n = expr.nodes[k]
            if isinstance(n, Load):
                shapes[k] = views[n.input].shape
            elif isinstance(n, Const):
                self.constants[k] = xp.scalar(n.value, xp.bool_ if isinstance(n.value, bool) else cdt, device)
                shapes[k] = ()
            elif isinstance(n, IndexValue):
                self.constants[k] = index_values(order, node.box, n.index, cdt, xp, 0, device)
                shapes[k] = tuple(self.constants[k].shape)
            else:
                assert isinstance(n, Op)
                shapes[k] = xp.broadcast_shape([shapes[a] for a in n.args])
        fused = ops.fusions(expr) if ops.fuses(cdt, xp) else {}
        fused = {k: f for k, f in fused.items() if f.pays([shapes[a] for a in f.args], xp)}
        folded = {f.inner for f in fused.values()}
        mine: set[int] = set()  # nodes whose array this evaluation made
        for k in expr.live():
            n = expr.nodes[k]
            if isinstance(n, Load):
                self.steps.append((k, n.input, (), None))
                if views[n.input].copies:
                    mine.add(k)
            elif isinstance(n, Op) and k not in folded:
                f = fused.get(k)
                reads = f.args if f is not None else n.args
                into = None
                if f is not None or ops.writes_into(n.op, xp):
                    into = next((a for a in reads if a in single and a in mine and shapes[a] == shapes[k]), None)
                self.steps.append((k, f if f is not None else n.op, reads, into))
                if OPS[n.op].result != "bool" and n.op not in ("not", "and", "or"):
                    mine.add(k)

    def __call__(self, data: Sequence[Array]) -> tuple[Array, Array | None, list[str]]:
        torch, xp, cdt = self.torch, self.xp, self.cdt
        values = dict(self.constants)
        for k, what, args, into in self.steps:
            if isinstance(what, int):
                values[k] = _view(torch, data[what], self.views[what])
                continue
            out = values[into] if into is not None else None
            if out is not None and not out.is_contiguous():
                out = None
            if isinstance(what, ops.Fused):
                values[k] = what.apply([values[a] for a in args], cdt, xp, out=out)
            else:
                values[k] = ops.apply_op(what, [values[a] for a in args], cdt, xp, out=out)
        return xp.broadcast_to(xp.asarray(values[self.root]), self.full), self.present, self.order
