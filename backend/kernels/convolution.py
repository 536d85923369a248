"""Sums over affine indices recognized as convolutions, and run as the vendor's convolution.

``y[b, o, i, j] += x[b, c, i + p - 1, j + q - 1] * w[o, c, p, q]`` is a 2-d convolution with
padding 1.  The general evaluator computes it as well (a strided im2col view of ``x`` times
``w``, with the guard that keeps ``i + p - 1`` inside ``x`` as a 0/1 factor), but that copies
the view, multiplies by the mask and sums in several passes: 5-8x ``F.conv2d``'s time.  Here
such a rule is recognized once per block, statically (:func:`conv_form`), and runs as one call
of ``torch.nn.functional.conv{1,2,3}d``.

A rule is a convolution when it is a sum of ``c * x[...] * w[...]`` (constants ``c``), and:

- each index of the rule has one role: *batch* (in ``x`` and the result), *input channel*
  (in ``x`` and ``w``, summed), *output channel* (in ``w`` and the result), or one of a
  *spatial pair*: an output index ``i`` and a kernel index ``p`` (summed, in ``w``) that meet in
  one axis of ``x`` as ``s * i + d * p + k`` (stride ``s > 0``, dilation ``|d|``; ``d < 0``
  reads the kernel backwards, which is the kernel flipped);
- every other axis of ``x`` and ``w`` is a plain index, and there are one to three spatial
  pairs;
- its guard says no more than that ``x`` is read inside its extent: the points it excludes
  read the zeros of the padding, whose product with a finite weight is zero.

That last point is the one place where the convolution and the rule's semantics may differ:
a point outside ``x`` is no point of the rule, while the convolution multiplies a weight by
the padding's zero.  For a finite weight both give zero; a weight that is ``inf`` or ``nan``
makes the border cells it reaches ``nan``, as every framework's convolution does.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from edatalog.backend.kernels.arrays import torch_module
from edatalog.ir.affine import Affine, Constraint
from edatalog.ir.forms import product_form
from edatalog.ir.graph import Access, JoinAgg
from edatalog.ir.scalar import Load


@dataclass(frozen=True)
class Spatial:
    """One spatial pair: output index ``out`` and kernel index ``kernel`` meeting in axis
    ``axis`` of ``x`` as ``stride * out + dilation * kernel' + start`` (``kernel'`` the kernel
    index, reversed when ``flip``), with the padding (or cropping, when negative) that makes
    the convolution read exactly ``x``'s cells."""

    axis: int  # of x
    out: str
    kernel: str
    kernel_axis: int  # of w
    stride: int
    dilation: int
    flip: bool
    pad_lo: int  # zeros before x's first cell; negative: cells of x skipped
    pad_hi: int  # zeros after the last cell read; negative: cells of x beyond what is read


@dataclass(frozen=True)
class ConvForm:
    """How a block runs as a convolution: ``x`` (input ``data``) laid out as (batch, channels,
    spatial...), ``w`` (input ``weight``) as (out channels, channels, kernel...), the result
    laid out back over the rule's output indices."""

    data: int
    weight: int
    batch: tuple[int, ...]  # axes of x
    channels: tuple[int, ...]  # axes of x
    channels_w: tuple[int, ...]  # the same indices' axes of w
    out_channels: tuple[int, ...]  # axes of w
    spatial: tuple[Spatial, ...]
    sizes: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # batch, channel, out channel extents
    out_order: tuple[str, ...]  # the result's indices as the convolution makes them
    out_vars: tuple[str, ...]  # the rule's output indices, in join order

    @property
    def dims(self) -> int:
        return len(self.spatial)

    @property
    def permutation(self) -> tuple[int, ...]:
        """From the convolution's output layout to the rule's."""
        return tuple(self.out_order.index(v) for v in self.out_vars)


@functools.lru_cache(maxsize=1024)
def conv_form(node: JoinAgg) -> ConvForm | None:
    """``node`` (prepared: see :func:`edatalog.backend.kernels.joinagg.prepare`) as a
    convolution, or None when it is none (see the module docstring)."""
    if node.agg != "sum" or not node.agg_indices or node.lookups or len(node.inputs) != 2:
        return None
    form = product_form(node)
    if form is None or len(form.factors) != 2 or any(power != 1 for _, power in form.factors):
        return None
    loads = [n for k, _ in form.factors if isinstance(n := node.expr.nodes[k], Load)]
    if len(loads) != 2 or loads[0].input == loads[1].input:
        return None
    for data, weight in ((loads[0].input, loads[1].input), (loads[1].input, loads[0].input)):
        found = _form(node, data, weight)
        if found is not None and _guard_only_keeps_reads_inside(node):
            return found
    return None


def _plain(acc: Access) -> list[str] | None:
    """The index of each axis of ``acc``, when every axis is a plain index; else None."""
    out = []
    for ax in acc.axes:
        if len(ax.parts) != 1 or ax.parts[0].index is None:
            return None
        out.append(ax.parts[0].index)
    return out if len(set(out)) == len(out) else None


def _form(node: JoinAgg, data: int, weight: int) -> ConvForm | None:
    x, w = node.inputs[data], node.inputs[weight]
    w_ix = _plain(w)
    if w_ix is None:
        return None
    agg = set(node.agg_indices)
    order = [i.name for i in node.indices]
    out_vars = tuple(v for v in order if v not in agg)
    box = node.box
    batch: list[int] = []
    channels: list[int] = []
    spatial: list[Spatial] = []
    seen: set[str] = set()
    for k, ax in enumerate(x.axes):
        if len(ax.parts) != 1:
            return None
        part = ax.parts[0]
        if part.index is not None:
            v = part.index
            if v in agg and v in w_ix:
                channels.append(k)
            elif v not in agg and v not in w_ix:
                batch.append(k)
            else:
                return None  # a group index (in x, w and the result), or a sum over x alone
            seen.add(v)
            continue
        pair = _spatial(part.expr, part.extent, k, agg, w_ix, box)
        if pair is None:
            return None
        spatial.append(pair)
        seen.update((pair.out, pair.kernel))
    out_channels = [k for k, v in enumerate(w_ix) if v not in agg]
    seen.update(w_ix[k] for k in out_channels)
    if not 1 <= len(spatial) <= 3 or seen != set(order) or len(seen) != len(order):
        return None
    x_ix = {k: ax.parts[0].index or "" for k, ax in enumerate(x.axes)}  # plain axes: batch, channels
    channel_names = [x_ix[k] for k in channels]
    made = (
        *(x_ix[k] for k in batch),
        *(w_ix[k] for k in out_channels),
        *(s.out for s in spatial),
    )
    if set(made) != set(out_vars):
        return None
    return ConvForm(
        data,
        weight,
        tuple(batch),
        tuple(channels),
        tuple(w_ix.index(v) for v in channel_names),
        tuple(out_channels),
        tuple(spatial),
        (
            tuple(box[x_ix[k]] for k in batch),
            tuple(box[v] for v in channel_names),
            tuple(box[w_ix[k]] for k in out_channels),
        ),
        made,
        out_vars,
    )


def _spatial(
    expr: Affine, extent: int, axis: int, agg: set[str], w_ix: list[str], box: Mapping[str, int]
) -> Spatial | None:
    """An axis of ``x`` read as ``s * i + d * p + k`` (see :class:`Spatial`), or None."""
    if len(expr.terms) != 2:
        return None
    (a, ca), (b, cb) = expr.terms
    if a in agg:
        (a, ca), (b, cb) = (b, cb), (a, ca)
    out, stride, kernel, dilation = a, ca, b, cb
    if out in agg or kernel not in agg or kernel not in w_ix or out in w_ix or stride <= 0:
        return None
    size, width = box[out], box[kernel]
    start = expr.const
    flip = dilation < 0
    if flip:  # d * p = d * (K - 1) + |d| * (K - 1 - p): the kernel read backwards
        start += dilation * (width - 1)
        dilation = -dilation
    last = stride * (size - 1) + dilation * (width - 1) + start  # the last cell read
    return Spatial(axis, out, kernel, w_ix.index(kernel), stride, dilation, flip, -start, last - (extent - 1))


def _guard_only_keeps_reads_inside(node: JoinAgg) -> bool:
    """Whether every constraint of ``node``'s guard is one of its inputs' range constraints
    (those that keep each index expression inside its axis): the padding's zeros then stand in
    for the points the guard excludes."""
    guard = node.guard
    if guard.is_true:
        return True
    if len(guard.conjs) != 1:
        return False
    ranges: set[Constraint | bool] = set()
    for acc in node.inputs:
        for ax in acc.axes:
            for conj in ax.range_guard().conjs:
                ranges.update(c.normalized() for c in conj.constraints)
    return all(c.normalized() in ranges for c in guard.conjs[0].constraints)


def convolve(form: ConvForm, x: Any, w: Any) -> Any:
    """The convolution of ``x`` and ``w`` (torch tensors, laid out as the rule's accesses read
    them, of the compute dtype), laid out over the rule's output indices."""
    torch = torch_module()
    functional = torch.nn.functional

    nb, nc, no = (math.prod(s) for s in form.sizes)
    sp = form.spatial
    x = x.permute(*form.batch, *form.channels, *(s.axis for s in sp))
    x = x.reshape(nb, nc, *x.shape[len(form.batch) + len(form.channels) :])
    crops = [(max(0, -s.pad_lo), x.shape[2 + k] - max(0, -s.pad_hi)) for k, s in enumerate(sp)]
    if any(lo or hi != x.shape[2 + k] for k, (lo, hi) in enumerate(crops)):
        x = x[(slice(None), slice(None), *(slice(lo, hi) for lo, hi in crops))]
    pads = [(max(0, s.pad_lo), max(0, s.pad_hi)) for s in sp]
    padding: tuple[int, ...] | int = 0
    if all(lo == hi for lo, hi in pads):
        padding = tuple(lo for lo, _ in pads)
    else:
        x = functional.pad(x, [n for lo, hi in reversed(pads) for n in (lo, hi)])
    w = w.permute(*form.out_channels, *form.channels_w, *(s.kernel_axis for s in sp))
    w = w.reshape(no, nc, *w.shape[len(form.out_channels) + len(form.channels_w) :])
    flips = [2 + k for k, s in enumerate(sp) if s.flip]
    if flips:
        w = torch.flip(w, flips)
    conv = (functional.conv1d, functional.conv2d, functional.conv3d)[form.dims - 1]
    y = conv(x, w, stride=tuple(s.stride for s in sp), padding=padding, dilation=tuple(s.dilation for s in sp))
    y = y.reshape(*form.sizes[0], *form.sizes[2], *y.shape[2:])
    perm = form.permutation
    return y if perm == tuple(range(len(perm))) else y.permute(*perm)
