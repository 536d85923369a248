"""Small rewrites of a traced device program (a ``torch.fx`` graph of ATen ops), run once after
tracing so that a call pays for the arithmetic and little else.

Tracing the interpreter (:mod:`edatalog.backend.running.compiled`) records every torch call it
makes: besides the kernels, many views (a block's inputs as strided views over its join space,
results viewed as their region, broadcasts to the shape they already have) and scalar tensors
made afresh on every call.  Each is a dispatch of a few microseconds, as much as the arithmetic
of a small block.  The passes, each a function of the graph, in the order :func:`simplify` runs
them:

- :func:`fold_views`: a chain of views (``view``, ``expand``, ``permute``, ``slice``,
  ``as_strided``, ...) over one tensor becomes one ``as_strided`` of that tensor with the
  chain's final sizes, strides and storage offset (each node's, as recording the graph found
  them), or the tensor itself when the chain ends where it began.
  Values written in place through a view stay views of the same memory, so aliasing is
  unchanged.  The graph's inputs must then come with the storage offsets they had (the
  compiled runtime passes them at offset 0);
- :func:`fold_constants`: ops that read no graph input (scalars made with ``full``, index
  ranges, tables computed from them) are computed once, at compile time, and kept as
  constants of the graph module, unless something writes into them;
- :func:`share_views`: the same view of the same tensor taken twice is taken once (two views
  of it see the same memory whatever is written into it);
- :func:`share_values`: the same op on the same arguments computed twice is computed once, when
  nothing writes into the memory of its arguments between the two, nor into either result
  (the layers of a model recompute the positions' masks; constants of equal value are one);
- :func:`share_assemblies`: a buffer put together from the same pieces twice (two readers of
  one relation cut into blocks) is put together once;
- :func:`copies_into_fresh`: a fresh buffer filled with a copy of a view and then updated in
  place (``e = empty(s); e.copy_(v); mul(e, c, out=e)``, the interpreter's way to own an array
  it may write) becomes the out-of-place op on the view itself (``mul(v, c)``), where the view
  steps through memory in row-major order (a transposed one would make a transposed result,
  which a later reduction or GEMM reads in another order);
- :func:`copies_only_read`: such a copy that pointwise ops then only read (a fused op reads
  it where a multiplication used to update it) is the view itself;
- :func:`edatalog.backend.running.fxreshape.in_source_shapes`: a pointwise op, a reduction or an
  all-reduce of edatalog's over reshapes of other tensors runs in those tensors' shape (a
  reduction keeping its dims), so that the views around it go (in a tiny GPT-2's graph, 56 of
  its 206 calls);
- :func:`edatalog.backend.running.fxplacing.results_in_place` and
  :func:`~edatalog.backend.running.fxplacing.implied_broadcasts`: a pointwise result computed
  where it is then copied, an operand broadcast by the op rather than by a view;
- :func:`linear_calls`: ``mm(a, t(w))`` is ``linear(a, w)``, one call (ATen's ``linear`` is
  that very ``t`` and ``mm``);
- dead-code elimination: views nobody reads any more, and anything else without an effect;
- :func:`outputs_of_their_own`: an output in a constant's memory is returned as a copy;
- :func:`fast_calls`: each ATen op overload called through torch's public binding of the same
  op (``torch.mul``, ``torch.as_strided``, ``Tensor.view``): the same kernel, reached through
  C++ argument parsing in about a microsecond, where ``torch.ops.aten.mul.Tensor`` goes through
  Python's op-overload machinery in two to seven (``empty``: 9.2 against 2.1 µs, measured).
- :func:`direct_calls` (graphs that are not compiled further): edatalog's own ops, the
  shared-memory and exchange all-reduces, called as the Python functions they wrap, without
  torch's dispatch from C++ back into Python (6-7 µs a call, measured).

Every pass keeps the graph's results bit for bit: they only remove dispatches.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Iterable
from typing import Any

from edatalog.backend.kernels.arrays import torch_module
from edatalog.backend.running.exchange_all_reduce import exchange_all_reduce, exchange_all_reduce_op
from edatalog.backend.running.fxnodes import VIEW_NAMES as _VIEW_NAMES
from edatalog.backend.running.fxnodes import aten_of as _aten
from edatalog.backend.running.fxnodes import attribute as _attr
from edatalog.backend.running.fxnodes import (
    exact_in_any_layout,
    functional_variant,
    in_row_major_order,
    list_writes,
    nodes_in,
    same_layout,
)
from edatalog.backend.running.fxnodes import is_view as _is_view
from edatalog.backend.running.fxnodes import name_of as _name
from edatalog.backend.running.fxnodes import writes as _writes
from edatalog.backend.running.fxplacing import implied_broadcasts, results_in_place
from edatalog.backend.running.fxreshape import in_source_shapes
from edatalog.backend.running.fxreuse import OUT_BINDINGS, REUSED, reuse_buffers
from edatalog.backend.running.shm_all_reduce import shm_all_reduce, shm_all_reduce_op
from edatalog.backend.running.tracer import Geometry

# Views with a fast public binding (``torch.t``, ``Tensor.view``): a single one stays as it is;
# any other (``slice``, ``select``, ``unsqueeze``, ...) becomes an ``as_strided``.
_FAST_VIEWS = frozenset({"view", "expand", "permute", "t"})


def _is_tensor(val: Any) -> bool:
    return isinstance(val, torch_module().Tensor)


def fold_views(graph: Any, shapes: dict[Any, Geometry]) -> int:
    """Replace each chain of views by one view of the chain's base (see the module docstring),
    by the geometry each node's result had when it was recorded; returns how many view nodes
    now read a base directly."""
    torch = torch_module()
    base: dict[Any, Any] = {}  # node -> the non-view node whose memory it views
    changed = 0
    for node in list(graph.nodes):
        written = _writes(node)
        if written is not None:  # returns its out argument: a view of that argument's base
            base[node] = base.get(written, written)
            continue
        if not _is_view(node):
            continue
        source = node.args[0]
        root = base.get(source, source)
        base[node] = root
        if node not in shapes or root not in shapes or shapes[node][3] != shapes[root][3]:
            continue
        same = same_layout(shapes[node], shapes[root])
        if root is source and _name(node) in _FAST_VIEWS and not same:
            continue  # a single view of a base, called fast as it is
        size, stride, offset, _ = shapes[node]
        with graph.inserting_before(node):
            if same:
                replacement = root
            else:
                replacement = graph.call_function(torch.ops.aten.as_strided.default, (root, size, stride, offset))
                replacement.meta = dict(node.meta)
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
        if replacement is not root:
            base[replacement] = root
            shapes[replacement] = shapes[node]
        changed += 1
    return changed


_NO_FOLD = frozenset({"empty", "empty_like", "empty_strided", "new_empty"})  # values are garbage until written


def fold_constants(graph: Any, module: Any) -> int:
    """Compute once the nodes that read no input of the graph and that nothing writes into;
    returns how many became constants.  Tensors made empty are left alone (their contents come
    from writes), and so is anything random."""
    mutated = _mutated(graph.nodes)
    values: dict[Any, Any] = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            values[node] = _attr(module, node.target)
            continue
        aten = _aten(node)
        if node.op != "call_function" or node in mutated or _writes(node) is not None:
            continue
        if aten is not None and (aten[0] in _NO_FOLD or "rand" in aten[0] or node.target._schema.is_mutable):
            continue
        if aten is None and node.target is not operator.getitem:
            continue
        inputs = nodes_in((node.args, node.kwargs))
        if not all(a in values for a in inputs):
            continue
        args = _substitute(node.args, values)
        kwargs = _substitute(node.kwargs, values)
        values[node] = node.target(*args, **kwargs)
    folded = 0
    for node, value in values.items():
        if node.op == "get_attr" or not _is_tensor(value) or not node.users:
            continue
        if all(user in values for user in node.users):
            continue  # only other folded nodes read it
        name = f"_folded_{folded}"
        module.register_buffer(name, value.clone() if value._base is not None else value, persistent=False)
        with graph.inserting_before(node):
            const = graph.get_attr(name)
            const.meta = dict(node.meta)
        node.replace_all_uses_with(const)
        folded += 1
    return folded


def _mutated(nodes: Iterable[Any]) -> set[Any]:
    """Nodes whose memory some op writes: the written node, every view between it and its base,
    and the base (a constant must not change from call to call)."""
    base: dict[Any, Any] = {}
    views_of: dict[Any, list[Any]] = {}
    out: set[Any] = set()
    for node in nodes:
        written = _writes(node)
        if written is not None:
            root = base.get(written, written)
            out |= {written, root, node, *views_of.get(root, [])}
            base[node] = root
            views_of.setdefault(root, []).append(node)
        elif _is_view(node):
            root = base.get(node.args[0], node.args[0])
            base[node] = root
            views_of.setdefault(root, []).append(node)
            if root in out:
                out.add(node)
    # A view made before the write also sees it.
    for root in list(out):
        out |= set(views_of.get(root, []))
    return out


def _substitute(tree: Any, values: dict[Any, Any]) -> Any:
    if hasattr(tree, "op") and hasattr(tree, "users"):
        return values[tree]
    if isinstance(tree, list):
        return [_substitute(x, values) for x in tree]
    if isinstance(tree, tuple):
        return tuple(_substitute(x, values) for x in tree)
    if isinstance(tree, dict):
        return {k: _substitute(v, values) for k, v in tree.items()}
    return tree


_METHODS = frozenset({"view", "expand", "copy_", "fill_", "masked_fill_", "zero_", "contiguous"})  # Tensor methods


def _binding(name: str) -> Any:
    """torch's public C binding of the ATen op ``name``, or None."""
    torch = torch_module()
    for space in (torch, torch._C._nn, torch._C._VariableFunctions):
        f = getattr(space, name, None)
        if f is not None and type(f).__name__ == "builtin_function_or_method":
            return f
    return None


def fast_calls(graph: Any) -> int:
    """Call every ATen op with a public binding through it (see the module docstring); an
    ``alias`` (a view of a whole tensor) is the tensor itself.  Returns how many calls changed."""
    changed = 0
    for node in list(graph.nodes):
        aten = _aten(node)
        if aten is None:
            continue
        name, _ = aten
        if name == "alias" and hasattr(node.args[0], "op"):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            changed += 1
            continue
        if name in _METHODS:
            with graph.inserting_before(node):
                call = graph.call_method(name, node.args, node.kwargs)
                call.meta = dict(node.meta)
            node.replace_all_uses_with(call)
            graph.erase_node(node)
            changed += 1
            continue
        if node.meta.get(REUSED) and name not in OUT_BINDINGS:
            continue  # its public binding may not take ``out=``: the ATen overload does
        f = _binding(name)
        if f is not None:
            node.target = f
            changed += 1
    return changed


def share_values(graph: Any, module: Any) -> int:
    """Compute each pure op on the same arguments once (see the module docstring); returns how
    many nodes went."""
    nodes = list(graph.nodes)
    order = {node: k for k, node in enumerate(nodes)}
    base, writes = _bases_and_writes(nodes, order)
    returned = _returned(nodes, base)
    constants = _constants_by_value(graph, module)
    seen: dict[tuple[Any, ...], Any] = {}
    shared = 0
    for node in nodes:
        if node.op == "get_attr" and node in constants and constants[node] is not node:
            node.replace_all_uses_with(constants[node])
            graph.erase_node(node)
            shared += 1
            continue
        aten = _aten(node)
        if aten is None or _writes(node) is not None or node.target._schema.is_mutable:
            continue
        if aten[0] in _NO_FOLD or aten[0] in _VIEW_NAMES or "rand" in aten[0]:
            continue
        key = (node.target, _key(node.args), _key(node.kwargs))
        first = seen.get(key)
        if first is None:
            seen[key] = node
            continue
        inputs = [base.get(a, a) for a in nodes_in((node.args, node.kwargs))]
        quiet = all(_unwritten(writes.get(b, ()), order[first], order[node]) for b in inputs)
        apart = node in returned and base.get(first, first) in returned  # two outputs, one memory: no
        if quiet and not apart and not writes.get(base.get(first, first)) and not writes.get(base.get(node, node)):
            node.replace_all_uses_with(first)
            graph.erase_node(node)
            shared += 1
    return shared


def _returned(nodes: list[Any], base: dict[Any, Any]) -> set[Any]:
    """The nodes whose memory a call returns: each output's base, and the op behind one that is
    an element of a multi-output op's result (``max(x, 1).values``)."""
    out: set[Any] = set()
    for value in (v for node in nodes if node.op == "output" for v in nodes_in(node.args)):
        root = base.get(value, value)
        out.add(root)
        if root.op == "call_function" and root.target is operator.getitem:
            out.add(root.args[0])
    return out


def outputs_of_their_own(graph: Any) -> int:
    """Each output that lies in a constant's memory (a folded value, a view of one, or the one
    constant of equal value that two were shared into) becomes a copy of it, one per place it
    is returned: what a call returns is the caller's, and a write into it must change neither
    a later call nor another output.  Returns how many copies were made."""
    torch = torch_module()
    nodes = list(graph.nodes)
    base, _ = _bases_and_writes(nodes, {node: k for k, node in enumerate(nodes)})
    output = next(node for node in reversed(nodes) if node.op == "output")
    copies = 0

    def own(value: Any) -> Any:
        nonlocal copies
        if base.get(value, value).op != "get_attr":
            return value
        with graph.inserting_before(output):
            copy = graph.call_function(torch.ops.aten.clone.default, (value,))
        copy.meta = dict(value.meta)
        copies += 1
        return copy

    output.args = torch.fx.node.map_arg(output.args, own)
    return copies


def _bases_and_writes(nodes: list[Any], order: dict[Any, int]) -> tuple[dict[Any, Any], dict[Any, list[int]]]:
    """Each view's (or write's) base, and the positions of the writes into each base."""
    base: dict[Any, Any] = {}
    writes: dict[Any, list[int]] = {}
    for node in nodes:
        written = _writes(node)
        if written is not None:
            root = base.get(written, written)
            base[node] = root
            writes.setdefault(root, []).append(order[node])
        elif _is_view(node):
            base[node] = base.get(node.args[0], node.args[0])
        for target in list_writes(node):  # a fused optimizer step updating its lists in place
            writes.setdefault(base.get(target, target), []).append(order[node])
    return base, writes


def _unwritten(positions: Iterable[int], after: int, before: int) -> bool:
    return not any(after < k < before for k in positions)


def _constants_by_value(graph: Any, module: Any) -> dict[Any, Any]:
    """Each small constant of the graph by the first constant of equal value (same dtype, shape,
    strides and contents)."""
    torch = torch_module()
    first: dict[tuple[Any, ...], Any] = {}
    out: dict[Any, Any] = {}
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        value = _attr(module, node.target)
        if not isinstance(value, torch.Tensor) or value.numel() > 4096 or value.device.type != "cpu":
            continue
        exact = value.float() if value.dtype == torch.bfloat16 else value  # bf16 has no numpy type; f32 holds it
        raw = exact.contiguous().numpy().tobytes()
        key = (value.dtype, tuple(value.shape), tuple(value.stride()), raw)
        out[node] = first.setdefault(key, node)
    return out


def share_assemblies(graph: Any, shapes: dict[Any, Geometry]) -> int:
    """Put each buffer together once from the same pieces (see the module docstring): ``e =
    empty(s)``, then only copies of whole pieces into views of ``e`` (and reads); a second
    such buffer of the same pieces into the same views, with no piece written between, is the
    first.  Returns how many buffers went."""
    nodes = list(graph.nodes)
    order = {node: k for k, node in enumerate(nodes)}
    base, writes = _bases_and_writes(nodes, order)
    seen: dict[tuple[Any, ...], tuple[Any, int]] = {}
    shared = 0
    for node in nodes:
        aten = _aten(node)
        if aten is None or aten[0] != "empty":
            continue
        fills = []
        copies = []
        for view in node.users:
            if not _is_view(view) or view.args[0] is not node or len(view.users) != 1:
                continue
            (copy,) = view.users
            if _aten(copy) == ("copy_", "default") and copy.args[0] is view and view in shapes:
                fills.append((shapes[view][:3], copy.args[1], order[copy]))
                copies.append(copy)
        if not fills or len(writes.get(node, ())) != len(fills):
            continue  # written otherwise too: not a plain assembly
        began = min(k for _, _, k in fills)
        done = max(k for _, _, k in fills)
        key = (_key(node.args), _key(node.kwargs), tuple(sorted((g, id(src)) for g, src, _ in fills)))
        earlier = seen.get(key)
        if earlier is None:
            seen[key] = (node, began)
            continue
        first, first_began = earlier
        sources = {base.get(src, src) for _, src, _ in fills}
        if not all(_unwritten(writes.get(s, ()), first_began, done) for s in sources):
            continue  # a piece changed between the two: they differ
        for copy in copies:
            view = copy.args[0]
            graph.erase_node(copy)
            graph.erase_node(view)
        node.replace_all_uses_with(first)
        graph.erase_node(node)
        shared += 1
    return shared


def share_views(graph: Any) -> int:
    """Take each distinct view once (see the module docstring); returns how many were shared."""
    seen: dict[tuple[Any, ...], Any] = {}
    shared = 0
    for node in list(graph.nodes):
        if not _is_view(node):
            continue
        key = (node.target, _key(node.args), _key(node.kwargs))
        first = seen.get(key)
        if first is None:
            seen[key] = node
            continue
        node.replace_all_uses_with(first)
        graph.erase_node(node)
        shared += 1
    return shared


def _key(tree: Any) -> Any:
    """A hashable form of a node's arguments (nodes by identity)."""
    if hasattr(tree, "op") and hasattr(tree, "users"):
        return ("node", id(tree))
    if isinstance(tree, list | tuple):
        return tuple(_key(x) for x in tree)
    if isinstance(tree, dict):
        return tuple(sorted((k, _key(v)) for k, v in tree.items()))
    if isinstance(tree, float) and tree != tree:  # nan
        return ("nan",)
    return (type(tree).__name__, tree) if not isinstance(tree, type) else ("type", tree)


def copies_into_fresh(graph: Any, shapes: dict[Any, Geometry]) -> int:
    """Replace each fresh buffer that is a copy of a view updated in place by the out-of-place
    op on the view (see the module docstring); returns how many buffers went."""
    order: dict[Any, float] = {node: k for k, node in enumerate(graph.nodes)}
    writes = sorted(k for node, k in order.items() if _writes(node) is not None)
    done = 0
    for node in list(graph.nodes):
        copied = _copied_view(node, order, shapes)
        if copied is not None:
            copy, source, (update, *_) = copied
            aten = _aten(update)
            if aten is None or aten[1] != "out" or update.kwargs.get("out") is not node:
                continue
            if not exact_in_any_layout(update) or not update.args or update.args[0] is not node:
                continue  # the op reads the view's layout instead of the buffer's: bits must not move
            if any(a is node for a in update.args[1:]):
                continue
            # The view must still hold what it held at the copy: nothing writes between the two.
            if bisect.bisect_right(writes, order[copy]) != bisect.bisect_left(writes, order[update]):
                continue
            overload = functional_variant(update.target)
            if overload is None:
                continue
            kwargs = {k: v for k, v in update.kwargs.items() if k != "out"}  # addcmul's value, add's alpha
            with graph.inserting_before(update):
                made = graph.call_function(overload, (source, *update.args[1:]), kwargs)
                made.meta = dict(update.meta)
            order[made] = order[update]
            update.replace_all_uses_with(made)
            node.replace_all_uses_with(made)  # later readers of the buffer read the result
            graph.erase_node(update)
            graph.erase_node(copy)
            graph.erase_node(node)
            shapes[made] = shapes[node]
            done += 1
    return done


def copies_only_read(graph: Any, shapes: dict[Any, Geometry]) -> int:
    """Replace each fresh buffer that is a copy of a view and is then only read, as a whole,
    by pointwise ops (``e = empty(s); e.copy_(v); addcmul(a, e, c)``: the interpreter's
    compacted copy of a strided input, whose in-place update a fused op no longer needs) by
    the view itself, when nothing writes into the view's memory while they read; returns how
    many buffers went.  Only for readers that give the same bits whatever their operands'
    strides (:data:`edatalog.backend.running.fxnodes.LAYOUT_EXACT`)."""
    nodes = list(graph.nodes)
    order = {node: k for k, node in enumerate(nodes)}
    base, writes = _bases_and_writes(nodes, order)
    done = 0
    for node in nodes:
        copied = _copied_view(node, order, shapes)
        if copied is None:
            continue
        copy, source, readers = copied
        memory = base.get(source, source)
        if not all(_reads_whole(r, node, memory, base) for r in readers):
            continue
        if not _unwritten(writes.get(memory, ()), order[copy], order[readers[-1]]):
            continue  # the view's memory changes while they read
        for r in readers:
            r.replace_input_with(node, source)
        graph.erase_node(copy)
        graph.erase_node(node)
        done += 1
    return done


def _copied_view(node: Any, order: dict[Any, Any], shapes: dict[Any, Geometry]) -> tuple[Any, Any, list[Any]] | None:
    """For a fresh buffer filled, first thing, with a copy of a node of its sizes and dtype
    (``e = empty(s); e.copy_(v)``): the copy, ``v``, and the buffer's other users in order."""
    if _name(node) != "empty" or len(node.users) < 2:
        return None
    copy, *rest = sorted(node.users, key=order.__getitem__)
    if _aten(copy) != ("copy_", "default") or copy.args[0] is not node or copy.users:
        return None
    source = copy.args[1]
    if source not in shapes or node not in shapes or shapes[source][::3] != shapes[node][::3]:
        return None  # not the same sizes and dtype
    if not in_row_major_order(shapes[source]):
        return None  # ops on the view would make results laid out otherwise than the copy's
    return copy, source, rest


def _reads_whole(reader: Any, buffer: Any, memory: Any, base: dict[Any, Any]) -> bool:
    """Whether ``reader`` is a pointwise ATen op that reads ``buffer`` as an operand and writes
    nothing of ``memory`` (``base``: each view's or write's memory), and gives the same bits
    reading the view's layout instead of the buffer's."""
    if not exact_in_any_layout(reader) or _is_view(reader):
        return False
    target = _writes(reader)
    if target is buffer or (target is not None and base.get(target, target) is memory):
        return False
    return any(a is buffer for a in reader.args) and all(v is not buffer for v in reader.kwargs.values())


def linear_calls(graph: Any, shapes: dict[Any, Geometry] | None = None) -> int:
    """``mm(a, t(w))`` as one ``linear(a, w)`` call (its geometry in ``shapes``, the mm's);
    returns how many."""
    torch = torch_module()
    done = 0
    for node in list(graph.nodes):
        if _aten(node) != ("mm", "default"):
            continue
        a, b = node.args
        if _aten(b) != ("t", "default"):
            continue
        with graph.inserting_before(node):
            made = graph.call_function(torch.ops.aten.linear.default, (a, b.args[0]))
            made.meta = dict(node.meta)
        if shapes is not None and node in shapes:
            shapes[made] = shapes[node]
        node.replace_all_uses_with(made)
        graph.erase_node(node)
        if not b.users:
            graph.erase_node(b)
        done += 1
    return done


def direct_calls(graph: Any) -> int:
    """Call edatalog's own ops as the Python functions they wrap (see the module docstring);
    returns how many calls changed."""
    torch = torch_module()
    direct = {exchange_all_reduce_op(): exchange_all_reduce, shm_all_reduce_op(): shm_all_reduce}
    for function in direct.values():  # as the ops are: never dead code (a rank must not drop one)
        torch.fx.node.has_side_effect(function)
    changed = 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target in direct:
            node.target = direct[node.target]
            changed += 1
    return changed


def simplify(
    module: Any, graph: Any, shapes: dict[Any, Geometry], reuse: bool = False, direct: bool = False
) -> tuple[Any, dict[str, int]]:
    """Every pass of the module docstring, in order, on ``graph`` (whose constants ``module``
    holds; ``shapes``: each node's geometry, as recorded); the graph module made of them (its
    Python code generated once, here), and what each pass did.  With ``reuse``, large results
    are written into dead buffers (:func:`edatalog.backend.running.fxreuse.reuse_buffers`:
    for a CPU, whose allocator returns large blocks to the kernel; inductor and CUDA's caching
    allocator plan memory themselves).  With ``direct``, edatalog's own ops are called as Python
    functions (:func:`direct_calls`: for a graph replayed as it is, not one inductor compiles)."""
    torch = torch_module()
    before = len(graph.nodes)
    graph.eliminate_dead_code()
    views = fold_views(graph, shapes)
    constants = fold_constants(graph, module)
    shared = share_views(graph)
    fresh = copies_into_fresh(graph, shapes)
    fresh += copies_only_read(graph, shapes)
    graph.eliminate_dead_code()
    assemblies = share_assemblies(graph, shapes)
    values = share_values(graph, module)
    graph.eliminate_dead_code()
    shared += share_views(graph)  # views of values share_values made one
    graph, reshaped = in_source_shapes(graph, module, shapes)
    shared += share_views(graph)
    placed = results_in_place(graph, shapes)
    broadcasts = implied_broadcasts(graph, shapes)
    linear = linear_calls(graph, shapes)
    graph.eliminate_dead_code()
    reused = reuse_buffers(graph, shapes) if reuse else 0
    owned = outputs_of_their_own(graph)
    calls = fast_calls(graph)  # last: dead-code elimination cannot tell torch.mul(..., out=) has an effect
    calls += direct_calls(graph) if direct else 0
    graph.lint()
    gm = torch.fx.GraphModule(module, graph)
    return gm, {
        "nodes_before": before,
        "views_folded": views,
        "constants": constants,
        "views_shared": shared,
        "copies_removed": fresh,
        "assemblies_shared": assemblies,
        "values_shared": values,
        "views_reshaped": reshaped,
        "results_placed": placed,
        "broadcasts_implied": broadcasts,
        "linear": linear,
        "buffers_reused": reused,
        "outputs_copied": owned,
        "fast_calls": calls,
        "nodes": len(graph.nodes),
    }
