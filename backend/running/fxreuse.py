"""Buffer reuse: a traced device program writes each large result into the memory of a result
no op reads any more, instead of into memory allocated afresh.

On a CPU, a fresh buffer of a few megabytes costs more than the arithmetic that fills it: the
allocator hands large blocks back to the kernel when they are freed (glibc's trim and mmap
thresholds), and every 4 KiB page of the next one faults on first touch.  Measured on the
2-core machine of docs/benchmarks.md, single-threaded over the 14.7 M floats of the training
benchmark's params: one pass ``y = x * c`` into fresh buffers took 26 ms; into buffers already
held, 13 ms; in place, 6 ms.  A training step's optimizer makes about fifteen such passes, and
its forward and backward a fresh activation per rule.

:func:`reuse_buffers` is register allocation over the straight-line graph, by intervals:

- a *buffer* is the memory an ATen op makes afresh (a single tensor result whose schema does
  not alias an argument), contiguous, of at least ``min_bytes``.  Its *interval* runs from the
  op to the last node that reads it or anything aliasing it: views, writes into it (``out=``,
  ``x.op_()``), and calls outside ATen (functional collectives, their waits, ``getitem``),
  which are assumed to alias every tensor they read.  A buffer the graph returns, or that
  something it returns aliases, lives to the end;
- walking the graph in order, a buffer whose interval has ended goes to a pool by (bytes,
  dtype); an op making a buffer of a size and dtype in the pool, and having an ``out=``
  overload, writes into a view of the pooled buffer instead (``mul(a, b)`` becomes
  ``mul(a, b, out=view(dead, sizes))``), and the pooled memory stays busy until the new
  buffer's interval ends;
- a pointwise op (``fxnodes.POINTWISE``) one of whose operands' buffer dies at that op prefers
  that buffer's memory: the op runs in place, over data it has just read into the cache.  Only
  when every operand aliasing that buffer reads it in the result's own geometry: each element is
  then read before its own position is written, and no other position reads it (``a * a.t()``
  written over ``a`` would read what it wrote).

Results are bit for bit the same: each op runs the same kernel into memory of the same layout.
Graph inputs (params, carried state) and constants are never reused: their memory is not the
graph's to give.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from typing import Any

from edatalog.backend.running.fxnodes import (
    POINTWISE,
    aliased_args,
    aten_of,
    fresh_outside_aten,
    is_contiguous,
    is_view,
    name_of,
    writes,
)
from edatalog.backend.running.tracer import Geometry

MIN_BYTES = 256 * 1024  # smaller buffers come from the allocator's free lists: a view would cost more than it saves
REUSED = "edl_reused"  # node meta: an ``out=`` call this pass made
# Ops whose public binding (``torch.mul``, ``torch._C._nn.linear``) takes ``out=``: a call this
# pass made goes through it (a microsecond, against several through the ATen overload).
OUT_BINDINGS = frozenset(
    {
        "abs", "add", "addcdiv", "addcmul", "amax", "bmm", "cat", "cos", "div", "erf", "exp", "expm1", "gather",
        "index_select", "linear", "log", "log1p", "maximum", "mean", "minimum", "mm", "mul", "neg", "pow",
        "reciprocal", "rsqrt", "sigmoid", "silu", "sin", "sqrt", "sub", "sum", "tanh", "where",
    }
)  # fmt: skip
# Fresh buffers of no value: a view of dead memory serves as well.
_EMPTY = frozenset({"empty", "empty_strided", "new_empty"})


@functools.cache
def out_variant(overload: Any) -> Any | None:
    """The ``out=`` overload of an ATen functional overload (``mul.Tensor`` -> ``mul.out``):
    the same arguments, by name and type, plus one mutable ``out``; None if it has none."""
    schema = overload._schema
    if len(schema.returns) != 1 or schema.is_mutable:
        return None
    wanted = [(a.name, str(a.type)) for a in schema.arguments]
    packet = overload._overloadpacket
    for name in packet.overloads():
        candidate = getattr(packet, name)
        args = candidate._schema.arguments
        outs = [a for a in args if a.is_out]
        if len(outs) != 1 or outs[0].name != "out":
            continue
        if [(a.name, str(a.type)) for a in args if not a.is_out] == wanted:
            return candidate
    return None


def _fresh(node: Any) -> bool:
    """Whether ``node`` is an ATen call whose one tensor result is memory of its own, or one
    of the few ops outside ATen known to make theirs (``FRESH_OUTSIDE_ATEN``: with no ``out=``
    they always allocate, but what dies after them can be given their memory)."""
    if fresh_outside_aten(node):
        return True
    aten = aten_of(node)
    if aten is None or writes(node) is not None or is_view(node):
        return False
    schema = node.target._schema
    return len(schema.returns) == 1 and schema.returns[0].alias_info is None and str(schema.returns[0].type) == "Tensor"


def _nbytes(geometry: Geometry) -> int:
    sizes, _, _, dtype = geometry
    return math.prod(sizes) * dtype.itemsize


def reuse_buffers(graph: Any, shapes: dict[Any, Geometry], min_bytes: int = MIN_BYTES) -> int:
    """Write large results into dead buffers (see the module docstring); returns how many ops
    now do.  Runs on ATen overloads (before :func:`edatalog.backend.running.fxpasses.fast_calls`)."""
    nodes = list(graph.nodes)
    order = {node: k for k, node in enumerate(nodes)}
    end = len(nodes)
    roots: dict[Any, frozenset[Any]] = {}  # node -> the buffers its result may alias
    for node in nodes:
        if _fresh(node):
            roots[node] = frozenset({node})
        else:
            roots[node] = frozenset().union(*(roots.get(a, frozenset()) for a in aliased_args(node)))
    last: dict[Any, int] = defaultdict(int)
    for node in nodes:
        for r in roots[node]:
            last[r] = max(last[r], order[node])
        for user in node.users:
            reach = end if user.op == "output" else order[user]
            for r in roots[node]:
                last[r] = max(last[r], reach)

    def candidate(node: Any) -> bool:
        g = shapes.get(node)
        return _fresh(node) and g is not None and g[2] == 0 and is_contiguous(g) and _nbytes(g) >= min_bytes

    ending: dict[int, list[tuple[Any, tuple[int, Any]]]] = defaultdict(list)  # position -> memory freed there
    pool: dict[tuple[int, Any], list[Any]] = defaultdict(list)  # (bytes, dtype) -> memory no buffer uses
    memory_of: dict[Any, Any] = {}  # buffer -> the memory it was given
    reused = 0
    for node in nodes:
        k = order[node]
        if candidate(node):
            key = (_nbytes(shapes[node]), shapes[node][3])
            memory = node
            name = name_of(node)
            overload = None if name in _EMPTY else out_variant(node.target)
            dying = _dying_operand(node, k, roots, last, shapes) if overload is not None else None
            if dying is not None and memory_of.get(dying) is not None and (memory_of[dying], key) in ending[k]:
                memory = memory_of[dying]  # in place: the operand is still in the cache
                ending[k].remove((memory, key))
            elif pool[key] and (overload is not None or name in _EMPTY):
                memory = pool[key].pop()
            if memory is not node:
                with graph.inserting_before(node):
                    made = graph.call_function(_view_overload(), (memory, list(shapes[node][0])))
                    if overload is not None:
                        made = graph.call_function(overload, node.args, {**node.kwargs, "out": made})
                    made.meta = {**node.meta, REUSED: True}
                node.replace_all_uses_with(made)
                graph.erase_node(node)
                shapes[made] = shapes.pop(node)
                roots[made] = roots[node]  # later nodes read ``made``: the buffer is still ``node``
                reused += 1
            memory_of[node] = memory
            if last[node] < end:
                ending[last[node]].append((memory, key))
        for memory, key in ending.pop(k, ()):
            pool[key].append(memory)
    return reused


def _dying_operand(
    node: Any, k: int, roots: dict[Any, frozenset[Any]], last: dict[Any, int], shapes: dict[Any, Geometry]
) -> Any | None:
    """The buffer of an operand of pointwise ``node`` (at position ``k``) whose interval ends
    there, if ``node`` may write its result over it: every operand aliasing that buffer reads it
    in the result's own geometry, so that each element is read before its own position is
    written and no other."""
    if name_of(node) not in POINTWISE:
        return None
    geometry = shapes[node]
    operands = node.all_input_nodes
    for a in operands:
        owners = roots.get(a, frozenset())
        if len(owners) != 1 or shapes.get(a) != geometry:
            continue
        (buffer,) = owners
        if last[buffer] != k:
            continue
        if all(shapes.get(b) == geometry for b in operands if buffer in roots.get(b, frozenset())):
            return buffer
    return None


@functools.cache
def _view_overload() -> Any:
    from edatalog.backend.kernels.arrays import torch_module

    return torch_module().ops.aten.view.default
