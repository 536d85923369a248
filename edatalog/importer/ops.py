"""Core ATen ops as rules: one registry, one handler per op.

A handler takes the import's :class:`Context` (the builder and where the op comes from) and the
op's arguments, with every tensor already a :class:`~edatalog.importer.terms.View`, and returns
the result's view.  Layout ops rewrite views; elementwise ops build terms; contractions,
reductions and normalizations write rules.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from edatalog.importer import terms as T
from edatalog.importer.builder import Builder


@dataclass
class Context:
    """What a handler writes into (the builder) and where its op ran (for rule names)."""

    builder: Builder
    where: str  # the module path of the op (``fc1``, ``layers_0_mlp``), for names

    def name(self, what: str) -> str:
        return f"{self.where}_{what}" if self.where else what


Handler = Callable[..., Any]
OPS: dict[str, Handler] = {}
# The ops that only rearrange or relabel a tensor's cells (registered with ``rearranging``): what
# they make is what they read.
REARRANGING: set[str] = set()


def op(*names: str, rearranging: bool = False) -> Callable[[Handler], Handler]:
    """Registers a handler for the ATen ops ``names`` (``aten.mm.default``) in :data:`OPS`, and in
    :data:`REARRANGING` too where the ops only rearrange cells (views, transposes, copies)."""

    def register(f: Handler) -> Handler:
        for name in names:
            OPS[name] = f
            if rearranging:
                REARRANGING.add(name)
        return f

    return register


# -- layout -----------------------------------------------------------------------------------------


def _dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


@op("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", rearranging=True)
def _view(cx: Context, x: T.View, shape: Sequence[int]) -> T.View:
    size = math.prod(x.shape)
    shape = list(shape)
    if -1 in shape:
        k = shape.index(-1)
        shape[k] = size // math.prod(s for s in shape if s != -1)
    return _folded(cx, x, lambda v: T.reshape(v, shape), "view")


@op("aten.permute.default", rearranging=True)
def _permute(cx: Context, x: T.View, order: Sequence[int]) -> T.View:
    return T.permute(x, [_dim(d, len(x.shape)) for d in order])


@op("aten.t.default", rearranging=True)
def _t(cx: Context, x: T.View) -> T.View:
    return T.permute(x, list(range(len(x.shape)))[::-1])


@op("aten.transpose.int", rearranging=True)
def _transpose(cx: Context, x: T.View, a: int, b: int) -> T.View:
    order = list(range(len(x.shape)))
    a, b = _dim(a, len(order)), _dim(b, len(order))
    order[a], order[b] = order[b], order[a]
    return T.permute(x, order)


@op("aten.unsqueeze.default", rearranging=True)
def _unsqueeze(cx: Context, x: T.View, d: int) -> T.View:
    return T.unsqueeze(x, _dim(d, len(x.shape) + 1))


@op("aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default", rearranging=True)
def _squeeze(cx: Context, x: T.View, dims: int | Sequence[int] | None = None) -> T.View:
    if dims is None:
        dims = range(len(x.shape))
    elif isinstance(dims, int):
        dims = [dims]
    return T.squeeze(x, [_dim(d, len(x.shape)) for d in dims])


@op("aten.expand.default", rearranging=True)
def _expand(cx: Context, x: T.View, shape: Sequence[int], implicit: bool = False) -> T.View:
    return T.expand(x, shape)


@op("aten.slice.Tensor")
def _slice(
    cx: Context, x: T.View, dim: int = 0, start: int | None = None, end: int | None = None, step: int = 1
) -> T.View:
    d = _dim(dim, len(x.shape))
    size = x.shape[d]
    lo = 0 if start is None else (start + size if start < 0 else start)
    hi = size if end is None else (end + size if end < 0 else min(end, size))
    if step != 1:
        raise Unsupported("a slice with a step")
    return _folded(cx, x, lambda v: T.narrow(v, d, lo, hi), "slice")


@op("aten.select.int")
def _select(cx: Context, x: T.View, dim: int, index: int) -> T.View:
    d = _dim(dim, len(x.shape))
    place = index + x.shape[d] if index < 0 else index
    return _folded(cx, x, lambda v: T.select(v, d, place), "select")


@op("aten.split_with_sizes.default")
def _split_with_sizes(cx: Context, x: T.View, sizes: Sequence[int], dim: int = 0) -> list[T.View]:
    d = _dim(dim, len(x.shape))
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    return [_slice(cx, x, d, lo, lo + size) for lo, size in zip(starts, sizes, strict=True)]


@op("aten.split.Tensor")
def _split(cx: Context, x: T.View, size: int, dim: int = 0) -> list[T.View]:
    d = _dim(dim, len(x.shape))
    total = x.shape[d]
    return _split_with_sizes(cx, x, [min(size, total - k) for k in range(0, total, size)], d)


@op("aten._assert_tensor_metadata.default")
def _assert_metadata(cx: Context, *_: Any, **__: Any) -> None:
    return None  # export's check of a dtype; nothing to compute


@op("aten.cat.default")
def _cat(cx: Context, pieces: Sequence[T.View], dim: int = 0) -> T.View:
    d = _dim(dim, len(pieces[0].shape))
    try:
        return cx.builder.concat([p for p in pieces if p.shape[d] > 0], d, cx.name("cat"))
    except T.Unfoldable as exc:
        raise Unsupported(str(exc)) from None


@op("aten.clone.default", "aten.alias.default", "aten.contiguous.default", "aten.detach.default", rearranging=True)
def _same(cx: Context, x: T.View, **_: Any) -> T.View:
    return x


@op("aten.dropout.default")
def _dropout(cx: Context, x: T.View, p: float, train: bool) -> T.View:
    if train:
        raise Unsupported("dropout in training mode", "call module.eval() before importing")
    return x


@op("aten._to_copy.default", rearranging=True)
def _to_copy(cx: Context, x: T.View, dtype: Any = None, **_: Any) -> T.View:
    from edatalog.importer.capture import dtype_name

    return x if dtype is None else T.View(x.term, x.axes, x.extent, dtype_name(dtype))


def _folded(cx: Context, x: T.View, f: Callable[[T.View], T.View], what: str) -> T.View:
    """``f(x)``, or where ``x``'s term cannot take it, ``f`` of ``x`` written as a relation."""
    try:
        return f(x)
    except T.Unfoldable:
        return f(cx.builder.materialize(x, cx.name(what), apart=False))


# -- elementwise -------------------------------------------------------------------------------------


def _broadcast_shape(*shapes: Sequence[int]) -> list[int]:
    n = max(len(s) for s in shapes)
    out = []
    for k in range(n):
        sizes = {s[k - (n - len(s))] for s in shapes if k - (n - len(s)) >= 0} - {1}
        out.append(sizes.pop() if sizes else 1)
    return out


def elementwise(cx: Context, f: Callable[..., T.Term], *args: Any, dtype: str | None = None) -> T.View:
    views = [a for a in args if isinstance(a, T.View)]
    shape = _broadcast_shape(*(v.shape for v in views))
    try:
        terms, axes, extent = T.align(views, shape)
    except T.Unfoldable:  # operands that split an axis in crossing ways: written whole, they do not
        views = [whole(cx, v) for v in views]
        terms, axes, extent = T.align(views, shape)
    it = iter(terms)
    operands = [next(it) if isinstance(a, T.View) else T.Num(float(a)) for a in args]
    return T.View(f(*operands), axes, extent, dtype or views[0].dtype)


def whole(cx: Context, v: T.View) -> T.View:
    """``v`` as a relation read whole, axis by axis: one atom per axis of the view and of the
    relation (written first unless it is one)."""
    direct = isinstance(v.term, T.Read) and all(len(axis) == 1 for axis in v.term.axes)
    if direct and v.is_plain() and all(len(axis) == 1 for axis in v.axes):
        return v
    return cx.builder.materialize(v, cx.name("operand"), apart=False)


def _binary(symbol: str) -> Handler:
    def handler(cx: Context, a: Any, b: Any, alpha: float = 1.0) -> T.View:
        if symbol in "*/" and isinstance(a, T.View) and not isinstance(b, T.View) and b == 1 and alpha == 1:
            return a  # x * 1.0 (transformers' attention_scaling), x / 1

        def make(x: T.Term, y: T.Term) -> T.Term:
            if alpha != 1.0:
                y = T.Binary("*", y, T.Num(alpha))
            return T.Binary(symbol, x, y)

        return elementwise(cx, make, a, b)

    return handler


for _name, _symbol in (("add", "+"), ("sub", "-"), ("mul", "*"), ("div", "/")):
    OPS[f"aten.{_name}.Tensor"] = _binary(_symbol)
    OPS[f"aten.{_name}.Scalar"] = _binary(_symbol)


@op("aten.rsub.Scalar")
def _rsub(cx: Context, a: T.View, b: float, alpha: float = 1.0) -> T.View:
    def make(x: T.Term, y: T.Term) -> T.Term:
        return T.Binary("-", y, T.Binary("*", x, T.Num(alpha)) if alpha != 1 else x)

    return elementwise(cx, make, a, b)


@op("aten.pow.Tensor_Scalar")
def _pow(cx: Context, a: T.View, e: float) -> T.View:
    if e == 2:
        return elementwise(cx, lambda x: T.Binary("*", x, x), a)
    if e == 0.5:
        return elementwise(cx, lambda x: T.Unary("sqrt", x), a)
    if e == -0.5:
        return elementwise(cx, lambda x: T.Unary("rsqrt", x), a)
    return elementwise(cx, lambda x, y: T.Binary("^", x, y), a, e)


@op("aten.neg.default")
def _neg(cx: Context, a: T.View) -> T.View:
    return elementwise(cx, lambda x: T.Unary("-", x), a)


@op("aten.reciprocal.default")
def _reciprocal(cx: Context, a: T.View) -> T.View:
    return elementwise(cx, lambda x: T.Binary("/", T.Num(1.0), x), a)


def _unary(function: str) -> Handler:
    def handler(cx: Context, a: T.View) -> T.View:
        return elementwise(cx, lambda x: T.Unary(function, x), a)

    return handler


for _fn in ("exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "relu", "abs", "sin", "cos", "erf"):
    OPS[f"aten.{_fn}.default"] = _unary(_fn)
OPS["aten.silu.default"] = _unary("silu")


@op("aten.gelu.default")
def _gelu(cx: Context, a: T.View, approximate: str = "none") -> T.View:
    return elementwise(cx, lambda x: T.Unary("gelu_tanh" if approximate == "tanh" else "gelu", x), a)


def _condition(term: T.Term) -> T.Cmp:
    """A 0/1 term as the comparison it came from (a comparison's value is ``where(c, 1, 0)``)."""
    if isinstance(term, T.Where) and term.then == T.Num(1.0) and term.other == T.Num(0.0):
        return term.cond
    return T.Cmp("!=", term, T.Num(0.0))


_NEGATED = {"<": ">=", "<=": ">", ">": "<=", ">=": "<", "==": "!=", "!=": "=="}


def _compare(symbol: str) -> Handler:
    def handler(cx: Context, a: Any, b: Any) -> T.View:
        return elementwise(cx, lambda x, y: T.Where(T.Cmp(symbol, x, y), T.Num(1.0), T.Num(0.0)), a, b)

    return handler


for _name, _symbol in (("eq", "=="), ("ne", "!="), ("lt", "<"), ("le", "<="), ("gt", ">"), ("ge", ">=")):
    OPS[f"aten.{_name}.Tensor"] = _compare(_symbol)
    OPS[f"aten.{_name}.Scalar"] = _compare(_symbol)


@op("aten.bitwise_and.Tensor", "aten.logical_and.default")
def _and(cx: Context, a: T.View, b: T.View) -> T.View:
    return elementwise(
        cx, lambda x, y: T.Where(_condition(x), T.Where(_condition(y), T.Num(1.0), T.Num(0.0)), T.Num(0.0)), a, b
    )


@op("aten.logical_not.default")
def _logical_not(cx: Context, a: T.View) -> T.View:
    def negate(x: T.Term) -> T.Term:
        c = _condition(x)
        return T.Where(T.Cmp(_NEGATED[c.op], c.left, c.right), T.Num(1.0), T.Num(0.0))

    return elementwise(cx, negate, a)


@op("aten.any.dim", "aten.any.dims")
def _any(cx: Context, x: T.View, dims: Any = None, keepdim: bool = False) -> T.View:
    return cx.builder.aggregate(x, _dims(x, dims), "max=", cx.name("any"), keepdim)


@op("aten.full_like.default")
def _full_like(cx: Context, x: T.View, value: float, **_: Any) -> T.View:
    return T.View(T.Num(float(value)), x.axes, x.extent, x.dtype)


@op("aten.full.default")
def _full(cx: Context, shape: Sequence[int], value: float, **kwargs: Any) -> T.View:
    from edatalog.importer.capture import dtype_name

    ids = [T.fresh() for _ in shape]
    dtype = dtype_name(kwargs["dtype"]) if kwargs.get("dtype") is not None else "f32"
    return T.View(T.Num(float(value)), tuple((i,) for i in ids), dict(zip(ids, shape, strict=True)), dtype)


@op("aten.arange.start_step", "aten.arange.start", "aten.arange.default")
def _arange(cx: Context, *bounds: float, **kwargs: Any) -> T.View:
    from edatalog.importer.capture import dtype_name

    start, end, step = (0, bounds[0], 1) if len(bounds) == 1 else (*bounds[:2], bounds[2] if len(bounds) > 2 else 1)
    count = max(0, math.ceil((end - start) / step))
    a = T.fresh()
    term: T.Term = T.Index(a)
    if step != 1:
        term = T.Binary("*", term, T.Num(float(step)))
    if start:
        term = T.Binary("+", term, T.Num(float(start)))
    dtype = dtype_name(kwargs["dtype"]) if kwargs.get("dtype") is not None else "i64"
    return T.View(term, ((a,),), {a: count}, dtype)


@op("aten.where.self")
def _where(cx: Context, cond: T.View, a: Any, b: Any) -> T.View:
    views = [v for v in (a, b) if isinstance(v, T.View)]
    dtype = views[0].dtype if views else "f32"
    return elementwise(cx, lambda c, x, y: T.Where(_condition(c), x, y), cond, a, b, dtype=dtype)


# -- contractions --------------------------------------------------------------------------------------


Guard = Callable[[dict[str, tuple[int, ...]]], list[T.Cmp]]


def contract(
    cx: Context,
    operands: Sequence[tuple[T.View, str]],
    out: str,
    what: str,
    *,
    scale: float | None = None,
    divisor: int | None = None,
    guard: Guard | None = None,
) -> T.View:
    """An einsum: each operand with one letter per axis, the output's letters; letters not in the
    output are summed.  Operands that are not reads are written as relations first (a
    contraction reads each cell of them many times), and so are all of them where two split an
    axis in crossing ways.  ``scale`` multiplies the product, operand ``divisor`` divides it
    instead of multiplying, and ``guard`` gives comparisons of the rule's atoms (by letter) that
    restrict its points."""
    views = [v if isinstance(v.term, T.Read) else cx.builder.materialize(v, cx.name("operand")) for v, _ in operands]
    specs = [spec for _, spec in operands]
    options = (scale, divisor, guard)
    try:
        return _contract(cx, views, specs, out, what, options)
    except T.Unfoldable:
        return _contract(cx, [whole(cx, v) for v in views], specs, out, what, options)


def _contract(
    cx: Context,
    views: list[T.View],
    specs: list[str],
    out: str,
    what: str,
    options: tuple[float | None, int | None, Guard | None],
) -> T.View:
    scale, divisor, guard = options
    operands = list(zip(views, specs, strict=True))
    letters = sorted({c for _, spec in operands for c in spec})
    tables: list[dict[int, T.Replacement]] = [{} for _ in views]
    shared: dict[str, tuple[int, ...]] = {}
    extent: dict[int, int] = {}
    for c in letters:
        uses = [(j, spec.index(c)) for j, (_, spec) in enumerate(operands) if c in spec]
        size = max(views[j].shape[k] for j, k in uses)
        groups = []
        for j, k in uses:
            if views[j].shape[k] == size and size != 1:
                groups.append((j, [a for a in views[j].axes[k] if views[j].extent[a] != 1]))
            else:
                for a in views[j].axes[k]:
                    tables[j][a] = T.Fixed(0)
        shared[c] = T.share(views, groups, tables, extent)
        if size == 1:  # every operand's axis of 1 read at the head's index: x[b, s] for x[0, s]
            T.one_index([(tables[j], views[j].axes[k]) for j, k in uses], shared[c][0])
    factors = [T.substitute(v.term, t) for v, t in zip(views, tables, strict=True)]
    body = factors[0]
    for k, f in enumerate(factors[1:], start=1):
        body = T.Binary("/" if k == divisor else "*", body, f)
    if scale is not None:
        body = T.Binary("*", body, T.Num(scale))
    head = T.View(body, tuple(shared[c] for c in out), extent, views[0].dtype)
    reduced = [a for c in letters if c not in out for a in shared[c]]
    guards = guard(shared) if guard is not None else []
    return cx.builder.contract(head, reduced, cx.name(what), guards)


@op("aten.mm.default")
def _mm(cx: Context, a: T.View, b: T.View) -> T.View:
    return contract(cx, [(a, "ik"), (b, "kj")], "ij", "mm")


@op("aten.bmm.default")
def _bmm(cx: Context, a: T.View, b: T.View) -> T.View:
    return contract(cx, [(a, "bik"), (b, "bkj")], "bij", "bmm")


@op("aten.addmm.default")
def _addmm(cx: Context, bias: T.View, a: T.View, b: T.View, beta: float = 1.0, alpha: float = 1.0) -> T.View:
    product = contract(cx, [(a, "ik"), (b, "kj")], "ij", "mm" if cx.where else "addmm")
    if alpha != 1.0:
        product = elementwise(cx, lambda x: T.Binary("*", x, T.Num(alpha)), product)
    scaled = bias if beta == 1.0 else elementwise(cx, lambda x: T.Binary("*", x, T.Num(beta)), bias)
    return elementwise(cx, lambda x, y: T.Binary("+", x, y), product, scaled)


@op("aten.einsum.default")
def _einsum(cx: Context, equation: str, operands: Sequence[T.View]) -> T.View:
    inputs, out = equation.replace(" ", "").split("->")
    specs = inputs.split(",")
    if "." in equation or len(specs) != len(operands):
        raise Unsupported(f"einsum '{equation}'")
    return contract(cx, list(zip(operands, specs, strict=True)), out, "einsum")


# -- reductions ---------------------------------------------------------------------------------------


def _dims(x: T.View, dims: int | Sequence[int] | None) -> list[int]:
    if dims is None or (not isinstance(dims, int) and len(dims) == 0):
        return list(range(len(x.shape)))
    if isinstance(dims, int):
        dims = [dims]
    return sorted(_dim(d, len(x.shape)) for d in dims)


@op("aten.sum.dim_IntList")
def _sum(cx: Context, x: T.View, dims: Any, keepdim: bool = False, dtype: Any = None) -> T.View:
    return cx.builder.aggregate(x, _dims(x, dims), "+=", cx.name("sum"), keepdim)


@op("aten.sum.default")
def _sum_all(cx: Context, x: T.View, dtype: Any = None) -> T.View:
    return cx.builder.aggregate(x, _dims(x, None), "+=", cx.name("sum"))


@op("aten.mean.dim")
def _mean(cx: Context, x: T.View, dims: Any, keepdim: bool = False, dtype: Any = None) -> T.View:
    over = _dims(x, dims)
    count = math.prod(x.shape[d] for d in over)
    total = cx.builder.aggregate(x, over, "+=", cx.name("sum"), keepdim)
    return elementwise(cx, lambda t: T.Binary("/", t, T.Num(float(count))), total)


@op("aten.amax.default")
def _amax(cx: Context, x: T.View, dims: Any = (), keepdim: bool = False) -> T.View:
    return cx.builder.aggregate(x, _dims(x, dims), "max=", cx.name("max"), keepdim)


@op("aten.var.correction")
def _var(cx: Context, x: T.View, dims: Any = None, correction: float | None = None, keepdim: bool = False) -> T.View:
    over = _dims(x, dims)
    count = math.prod(x.shape[d] for d in over)
    mean = _mean(cx, x, over, True)
    diff = elementwise(cx, lambda a, m: T.Binary("*", T.Binary("-", a, m), T.Binary("-", a, m)), x, mean)
    total = cx.builder.aggregate(diff, over, "+=", cx.name("var"), keepdim)
    ddof = 1.0 if correction is None else float(correction)
    return elementwise(cx, lambda t: T.Binary("/", t, T.Num(count - ddof)), total)


@op("aten._softmax.default")
def _softmax(cx: Context, x: T.View, dim: int, half_to_float: bool = False) -> T.View:
    d = _dim(dim, len(x.shape))
    x = x if x.is_plain() else cx.builder.materialize(x, cx.name("logits"))
    top = cx.builder.aggregate(x, [d], "max=", cx.name("max"), keep=True)
    e = cx.builder.materialize(
        elementwise(cx, lambda a, m: T.Unary("exp", T.Binary("-", a, m)), x, top), cx.name("exp")
    )
    total = cx.builder.aggregate(e, [d], "+=", cx.name("sum"), keep=True)
    return elementwise(cx, lambda a, s: T.Binary("/", a, s), e, total)


@op("aten._log_softmax.default")
def _log_softmax(cx: Context, x: T.View, dim: int, half_to_float: bool = False) -> T.View:
    d = _dim(dim, len(x.shape))
    x = x if x.is_plain() else cx.builder.materialize(x, cx.name("logits"))
    top = cx.builder.aggregate(x, [d], "max=", cx.name("max"), keep=True)
    e = elementwise(cx, lambda a, m: T.Unary("exp", T.Binary("-", a, m)), x, top)
    total = cx.builder.aggregate(e, [d], "+=", cx.name("sum"), keep=True)
    return elementwise(cx, lambda a, m, s: T.Binary("-", T.Binary("-", a, m), T.Unary("log", s)), x, top, total)


@op("aten.native_layer_norm.default")
def _layer_norm(
    cx: Context, x: T.View, shape: Sequence[int], weight: T.View | None, bias: T.View | None, eps: float
) -> tuple[T.View, None, None]:
    over = list(range(len(x.shape) - len(shape), len(x.shape)))
    x = x if x.is_plain() else cx.builder.materialize(x, cx.name("input"))
    mean = _mean(cx, x, over, True)
    mean = cx.builder.materialize(mean, cx.name("mean"))
    centered = elementwise(cx, lambda a, m: T.Binary("-", a, m), x, mean)
    square = elementwise(cx, lambda c: T.Binary("*", c, c), centered)
    count = math.prod(shape)
    var = cx.builder.aggregate(square, over, "+=", cx.name("var"), keep=True)
    out = elementwise(
        cx,
        lambda c, v: T.Binary(
            "*", c, T.Unary("rsqrt", T.Binary("+", T.Binary("/", v, T.Num(float(count))), T.Num(eps)))
        ),
        centered,
        var,
    )
    if weight is not None:
        out = elementwise(cx, lambda a, w: T.Binary("*", a, w), out, weight)
    if bias is not None:
        out = elementwise(cx, lambda a, b: T.Binary("+", a, b), out, bias)
    return out, None, None


@op("aten.embedding.default")
def _embedding(cx: Context, table: T.View, ids: T.View, padding_idx: int = -1, *_: Any) -> T.View:
    return _rows(cx, table, ids, "embedding")


def _rows(cx: Context, table: T.View, ids: T.View, what: str) -> T.View:
    """The rows (axis 0) of ``table`` that the integers ``ids`` pick."""
    shift = _positions(ids.term)
    if shift is not None and len(table.axes[0]) == 1 and isinstance(table.term, T.Read):
        # Rows by position (an arange): a window of the table, read in place.
        atom, offset = shift
        (row,) = table.axes[0]
        term = T.shift(table.term, row, atom, offset)
        return T.View(term, (*ids.axes, *table.axes[1:]), {**table.extent, **ids.extent}, table.dtype)
    if len(table.axes[0]) != 1 or not isinstance(table.term, T.Read):
        table = cx.builder.materialize(table, cx.name("table"), apart=False)
    if not isinstance(ids.term, T.Read):
        ids = cx.builder.materialize(ids, cx.name("ids"), apart=False)
    return cx.builder.lookup(table, ids, cx.name(what) if not cx.where else cx.where)


@op("aten.index_select.default")
def _index_select(cx: Context, x: T.View, dim: int, index: T.View) -> T.View:
    """Places of ``dim`` picked by the integers ``index``: a lookup, as an embedding's rows."""
    d = _dim(dim, len(x.shape))
    table = T.permute(x, [d, *(k for k in range(len(x.shape)) if k != d)])
    picked = _rows(cx, table, index, "index_select")  # the picked axis first, the others after
    return T.permute(picked, [*range(1, d + 1), 0, *range(d + 1, len(x.shape))])


def _positions(term: T.Term) -> tuple[int, int] | None:
    """``(atom, offset)`` where ``term`` is an atom's place plus a whole number (an arange)."""
    if isinstance(term, T.Index):
        return term.id, 0
    if isinstance(term, T.Binary) and term.op == "+" and isinstance(term.left, T.Index):
        right = term.right
        if isinstance(right, T.Num) and float(right.value).is_integer():
            return term.left.id, int(right.value)
    return None


class Unsupported(Exception):
    """An op (or a form of it) the importer has no rule for: the caller names the op, the module
    and the source line."""

    def __init__(self, what: str, hint: str = "") -> None:
        super().__init__(what)
        self.what, self.hint = what, hint
