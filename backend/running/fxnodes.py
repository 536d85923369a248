"""What a node of a traced device program (a ``torch.fx`` graph of ATen ops) does to memory:
which ATen op it calls, whether its result is a view of an argument, which argument it
writes.  Shared by the graph passes (:mod:`edatalog.backend.running.fxpasses`,
:mod:`edatalog.backend.running.fxreuse`)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

from edatalog.backend.kernels.arrays import torch_module
from edatalog.backend.running.tracer import Geometry

# ATen view ops: their result aliases their first argument's memory.
VIEW_NAMES = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "expand",
        "permute",
        "transpose",
        "t",
        "slice",
        "select",
        "as_strided",
        "alias",
        "unsqueeze",
        "squeeze",
        "diagonal",
        "unfold",
        "narrow",
        "expand_as",
        "view_as",
    }
)

# ATen ops computing each element of their result from the same position of their operands (after
# broadcasting): written in place over an operand of the result's geometry, they give the same.
TENSORS_POINTWISE = frozenset({"mul", "add", "sub", "div", "maximum", "minimum", "pow", "where", "addcmul", "addcdiv"})
UNARY_POINTWISE = frozenset(
    {"exp", "rsqrt", "sqrt", "neg", "cos", "sin", "tanh", "sigmoid", "silu", "gelu", "relu", "log", "abs"}
    | {"reciprocal", "erf"}
)
POINTWISE = TENSORS_POINTWISE | UNARY_POINTWISE
# Reductions by dims whose schema takes ``keepdim`` third: (op, overload).
KEEPS_DIMS = frozenset({("sum", "dim_IntList"), ("amax", "default"), ("amin", "default"), ("mean", "dim")})
# Pointwise ops that give the same bits whatever the strides of their operands and result.
# Others may not: torch's CPU kernels take a vectorized loop over contiguous rows and a scalar
# one otherwise, and for ``sigmoid`` (f32), ``rsqrt`` (bf16, f16) and ``add``/``sub`` with an
# ``alpha`` (bf16, f16) the two differed in the last bit (an AVX2 and an AVX-512 CPU, torch
# 2.13); the ops below agreed on both, in f32, bf16 and f16, over rows of 13 and 24 cells.
LAYOUT_EXACT = frozenset(
    {"mul", "div", "add", "sub", "addcmul", "addcdiv", "maximum", "minimum", "where", "neg", "abs", "exp"}
)


def aten_of(node: Any) -> tuple[str, str] | None:
    """(op name, overload name) of a call to an ATen op overload, else None: ops of other
    namespaces (a functional collective, its wait) are left as they are by every pass."""
    target = node.target
    if node.op != "call_function" or not hasattr(target, "_schema") or not target._schema.name.startswith("aten::"):
        return None
    return target._schema.name.removeprefix("aten::"), target._overloadname


def attribute(module: Any, target: str) -> Any:
    """What a ``get_attr`` node of ``target`` (a dotted path) reads from ``module``."""
    obj = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def name_of(node: Any) -> str | None:
    """The ATen op a node calls (``mul``), else None."""
    aten = aten_of(node)
    return None if aten is None else aten[0]


def nodes_in(tree: Any) -> list[Any]:
    """The graph nodes in a node's arguments (``(node.args, node.kwargs)``), lists and dicts
    opened, in order."""
    found: list[Any] = []

    def visit(x: Any) -> None:
        if hasattr(x, "op") and hasattr(x, "users"):
            found.append(x)
        elif isinstance(x, list | tuple):
            for y in x:
                visit(y)
        elif isinstance(x, dict):
            for y in x.values():
                visit(y)

    visit(tree)
    return found


def exact_in_any_layout(node: Any) -> bool:
    """Whether ``node`` is a pointwise ATen op that gives the same bits whatever the layout of
    its operands and result (:data:`LAYOUT_EXACT`)."""
    name = name_of(node)
    return name in LAYOUT_EXACT and node.kwargs.get("alpha", 1) == 1


# Ops outside ATen whose result is always memory of its own (oneDNN's linear, which the torch
# kernels call for large f32 GEMMs on a CPU): other namespaces are not trusted to say so (a
# functional collective's wait returns its argument under a schema that claims a fresh result).
# edatalog's all-reduces (:func:`all_reduce_op`): elementwise over a tensor of any shape (every
# rank's result is its cells reduced with the same cells of the others').
ALL_REDUCES = frozenset({"edatalog::exchange_all_reduce", "edatalog::shm_all_reduce"})
FRESH_OUTSIDE_ATEN = frozenset({"mkldnn::_linear_pointwise", "edatalog::onednn_linear"}) | ALL_REDUCES


def all_reduce_op(name: str, impl: Callable[[Any, str, str], Any]) -> Any:
    """Register ``edatalog::{name}(Tensor x, str reduce, str group) -> Tensor``, an all-reduce of
    edatalog's own that a recorded graph calls (and inductor compiles around): ``impl`` returns
    the reduction of ``x`` over the registered group of that name as a fresh tensor, ``x`` left
    as it was.  It is registered as having an effect, so no pass drops it as dead code: a rank
    whose graph dropped it would leave the group's other members waiting.  Returns the op."""
    torch = torch_module()

    @torch.library.custom_op(f"edatalog::{name}", mutates_args=(), schema="(Tensor x, str reduce, str group) -> Tensor")
    def op(x: Any, reduce: str, group: str) -> Any:
        return impl(x, reduce, group)

    @op.register_fake
    def _(x: Any, reduce: str, group: str) -> Any:
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    overload = getattr(torch.ops.edatalog, name).default
    torch.fx.node.has_side_effect(overload)
    return overload


def fresh_outside_aten(node: Any) -> bool:
    """Whether ``node`` calls one of :data:`FRESH_OUTSIDE_ATEN`."""
    return schema_name(node) in FRESH_OUTSIDE_ATEN


def schema_name(node: Any) -> str | None:
    """The qualified name of the op a node calls (``edatalog::shm_all_reduce``), else None."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return None if schema is None else str(schema.name)


def aliased_args(node: Any) -> list[Any]:
    """The graph nodes whose memory ``node``'s result may alias."""
    if fresh_outside_aten(node):
        return []
    written = writes(node)
    if written is not None:
        return [written]
    if is_view(node):  # by name: ``_unsafe_view``'s schema claims a fresh result
        first = node.args[0] if node.args else None
        return [first] if hasattr(first, "op") else []
    aten = aten_of(node)
    if aten is not None:
        schema = node.target._schema
        if all(r.alias_info is None for r in schema.returns):
            return []
        aliasing = {a.name for a in schema.arguments if a.alias_info is not None}
        picked = [v for a, v in zip(schema.arguments, node.args, strict=False) if a.name in aliasing]
        picked += [v for k, v in node.kwargs.items() if k in aliasing]
        return [x for x in picked if hasattr(x, "op")]
    if node.op in ("call_function", "call_method"):  # outside ATen: assume it may alias anything it reads
        return list(node.all_input_nodes)
    return []


def contiguous_strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a fresh contiguous tensor of ``sizes``."""
    strides, step = [], 1
    for n in reversed(sizes):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def same_layout(a: Geometry, b: Geometry) -> bool:
    """Whether two geometries address the same cells the same way: equal sizes, offsets and
    dtypes, and equal strides wherever a size is not 1 (a stride along one cell is never used)."""
    if a[0] != b[0] or a[2] != b[2] or a[3] != b[3]:
        return False
    return all(n == 1 or s == t for n, s, t in zip(a[0], a[1], b[1], strict=True))


def is_contiguous(g: Geometry) -> bool:
    """Whether ``g`` is laid out as a fresh contiguous tensor of its sizes (from its offset)."""
    return same_layout(g, (g[0], contiguous_strides(g[0]), g[2], g[3]))


def in_row_major_order(g: Geometry) -> bool:
    """Whether ``g``'s dims of more than one cell step through memory strictly outermost first,
    none broadcast (a contiguous tensor, or a slice of one).  A pointwise op whose first say
    on the result's layout is such an operand makes a fresh contiguous result, as it would from
    a contiguous copy of it: torch lays a fresh result out in its operands' stride order, and
    a transposed operand gives a transposed result, which a later reduction or GEMM reads in
    another order (other bits)."""
    strides = [st for n, st in zip(g[0], g[1], strict=True) if n > 1]
    return all(st > 0 for st in strides) and all(a > b for a, b in itertools.pairwise(strides))


def is_view(node: Any) -> bool:
    aten = aten_of(node)
    return aten is not None and aten[0] in VIEW_NAMES


def writes(node: Any) -> Any | None:
    """The node whose memory ``node`` writes and returns (``out=`` overloads, ``x.op_(...)``,
    ``copy_``), else None."""
    aten = aten_of(node)
    if aten is None:
        return None
    name, overload = aten
    schema = node.target._schema
    if overload == "out" or overload.endswith("_out"):
        out = node.kwargs.get("out")
        return out if hasattr(out, "op") else None
    if name.endswith("_") and schema.arguments and schema.arguments[0].alias_info is not None:
        first = node.args[0] if node.args else None
        return first if hasattr(first, "op") else None
    return None


def list_writes(node: Any) -> tuple[Any, ...]:
    """The nodes an ATen op writes through lists of tensors it mutates (torch's fused optimizer
    kernels update ``Tensor(a!)[]`` arguments), which :func:`writes` does not name: it returns
    one node."""
    aten = aten_of(node)
    if aten is None:
        return ()
    out: list[Any] = []
    for k, arg in enumerate(node.target._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.args[k] if k < len(node.args) else node.kwargs.get(arg.name)
        if isinstance(value, list | tuple):
            out.extend(v for v in value if hasattr(v, "op"))
    return tuple(out)


@functools.cache
def functional_variant(overload: Any) -> Any | None:
    """The functional overload of an ATen ``out=`` overload (``mul.out`` -> ``mul.Tensor``,
    ``addcmul.out`` -> ``addcmul.default``): the same arguments, by name and type, less
    ``out``, returning one fresh tensor; None if there is none."""
    wanted = [(a.name, str(a.type)) for a in overload._schema.arguments if not a.is_out]
    packet = overload._overloadpacket
    for name in packet.overloads():
        schema = getattr(packet, name)._schema
        if schema.is_mutable or len(schema.returns) != 1 or schema.returns[0].alias_info is not None:
            continue
        if [(a.name, str(a.type)) for a in schema.arguments] == wanted:
            return getattr(packet, name)
    return None
