"""Convolutions, pooling and batch norm (eval) as rules, with affine index positions
(docs/language.md section 5.1)::

    conv[b, o, y, x] += in[b, c, 2 * y + k - 1, 2 * x + l - 1] * w[o, c, k, l]     (stride 2, padding 1)
    pool[b, c, y, x] max= in[b, c, u, v] where u >= 2 * y, u <= 2 * y + 1, v >= 2 * x, v <= 2 * x + 1

Reads outside the input are absent: zero padding for a convolution's sum, none for a maximum,
as torch pads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from edatalog.importer import terms as T
from edatalog.importer.ops import Context, Unsupported, elementwise, op, whole


@op("aten.convolution.default")
def _convolution(
    cx: Context,
    x: T.View,
    w: T.View,
    bias: T.View | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    output_padding: Sequence[int],
    groups: int,
) -> T.View:
    if transposed or groups != 1:
        raise Unsupported("transposed or grouped convolutions")
    x, w = whole(cx, x), whole(cx, w)
    n = len(x.shape) - 2
    (b,), (c,), *_ = x.axes
    (o,), (wc,), *taps = w.axes
    out = [T.fresh() for _ in range(n)]
    extent = {**x.extent, **w.extent}
    windows: list[tuple[T.Part, ...]] = []
    for k in range(n):
        size, kernel = x.shape[2 + k], w.shape[2 + k]
        extent[out[k]] = (size + 2 * padding[k] - dilation[k] * (kernel - 1) - 1) // stride[k] + 1
        windows.append((T.Window(((out[k], stride[k]), (taps[k][0], dilation[k])), -padding[k]),))
    assert isinstance(x.term, T.Read) and isinstance(w.term, T.Read)
    rows = T.Read(x.term.relation, ((T.Atom(b),), (T.Atom(c),), *windows))
    weights = T.substitute(w.term, {wc: ((c, extent[c]),)})
    head = T.View(T.Binary("*", rows, weights), ((b,), (o,), *((a,) for a in out)), extent, x.dtype)
    result = cx.builder.contract(head, [c, *(t[0] for t in taps)], cx.name("conv"))
    if bias is None:
        return result
    for _ in range(n):
        bias = T.unsqueeze(bias, len(bias.shape))
    return elementwise(cx, lambda y, z: T.Binary("+", y, z), result, bias)


@op("aten.max_pool2d_with_indices.default")
def _max_pool2d(
    cx: Context,
    x: T.View,
    kernel: Sequence[int],
    stride: Sequence[int] = (),
    padding: Sequence[int] = (0, 0),
    dilation: Sequence[int] = (1, 1),
    ceil_mode: bool = False,
) -> tuple[T.View, None]:
    if ceil_mode or any(d != 1 for d in dilation):
        raise Unsupported("max pooling with ceil_mode or dilation")
    kernel = [kernel[0]] * 2 if len(kernel) == 1 else list(kernel)
    stride = list(stride) or kernel
    stride = [stride[0]] * 2 if len(stride) == 1 else stride
    padding = [padding[0]] * 2 if len(padding) == 1 else list(padding)
    x = whole(cx, x)
    *lead, (u,), (v,) = x.axes
    out = [T.fresh(), T.fresh()]
    extent = dict(x.extent)
    guards = []
    for k, place in enumerate((u, v)):
        size = x.shape[-2 + k]
        extent[out[k]] = (size + 2 * padding[k] - kernel[k]) // stride[k] + 1
        start: T.Term = T.Binary("*", T.Num(stride[k]), T.Index(out[k]))
        if padding[k]:
            start = T.Binary("-", start, T.Num(padding[k]))
        guards.append(T.Cmp(">=", T.Index(place), start))
        guards.append(T.Cmp("<=", T.Index(place), T.Binary("+", start, T.Num(kernel[k] - 1))))
    head = T.View(x.term, (*lead, (out[0],), (out[1],)), extent, x.dtype)
    return cx.builder.window_max(head, [u, v], guards, cx.name("pool")), None


@op("aten._native_batch_norm_legit_no_training.default")
def _batch_norm(
    cx: Context, x: T.View, weight: Any, bias: Any, mean: T.View, var: T.View, momentum: float, eps: float
) -> tuple[T.View, None, None]:
    """Eval-mode batch norm: the running statistics, per channel (axis 1)."""
    rest = len(x.shape) - 2

    def channel(v: T.View) -> T.View:
        for _ in range(rest):
            v = T.unsqueeze(v, len(v.shape))
        return v

    out = elementwise(
        cx,
        lambda a, m, s: T.Binary("*", T.Binary("-", a, m), T.Unary("rsqrt", T.Binary("+", s, T.Num(eps)))),
        x,
        channel(mean),
        channel(var),
    )
    if weight is not None:
        out = elementwise(cx, lambda a, g: T.Binary("*", a, g), out, channel(weight))
    if bias is not None:
        out = elementwise(cx, lambda a, h: T.Binary("+", a, h), out, channel(bias))
    return out, None, None
