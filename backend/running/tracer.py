"""Recording a function's ATen calls as a ``torch.fx`` graph, by running it once for real.

``make_fx`` traces through fake tensors and proxies; on the device programs of a plan it spends
one to two milliseconds per ATen call (a 3,700-op program of 8 logical devices took 25 s).  The
compiled runtime needs much less: the function it traces (the interpreter running the
programs) is deterministic and straight-line once its inputs' shapes are fixed, and every
decision it takes on values has been removed (:class:`~edatalog.backend.running.compiled.StaticOps`).
So :func:`record` runs it once on the real inputs under a ``TorchDispatchMode`` that computes
every ATen call as usual and appends it to a graph: a few microseconds per call on top of the
call itself, and the outputs of that run are the call's results.

Each tensor the function makes is known by the node that made it (by ``id``, with a finalizer
that drops the entry when the tensor dies, so no id is ever taken for another tensor's); a
tensor it did not make (a cached constant of the interpreter) becomes a constant of the graph
module. Every node records the sizes, strides, storage offset and dtype of what it made
(``Geometry``), which the graph passes (:mod:`edatalog.backend.running.fxpasses`) use to fold
views.

A call whose result depends on values in a way a graph cannot replay is refused with
:class:`TraceError`: reading a value back to Python (``item``, ``bool``, comparisons of whole
tensors) or an output whose shape depends on values (``nonzero``, ``masked_select``).
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from edatalog.backend.kernels.arrays import torch_module

Geometry = tuple[tuple[int, ...], tuple[int, ...], int, Any]  # sizes, strides, storage offset, dtype
DEVICE = "edl_device"  # node meta: the torch device of the tensor the node stands for

# ATen calls a replayed graph cannot honour: they read values back to the host, or their
# outputs' shapes depend on values.
_REFUSED = frozenset(
    {
        "_local_scalar_dense",
        "is_nonzero",
        "equal",
        "allclose",
        "nonzero",
        "nonzero_static",
        "masked_select",
        "unique",
        "_unique",
        "_unique2",
        "unique_consecutive",
        "unique_dim",
        "argwhere",
        "bernoulli",
        "rand",
        "randn",
        "randint",
        "normal",
        "uniform",
        "multinomial",
    }
)


class TraceError(Exception):
    """The function took a decision on values (or made a shape from them): it cannot be
    replayed as a graph."""


class Recording:
    """What :func:`record` made: the graph, the module holding its constants, each node's
    geometry, and the outputs of the run that recorded it."""

    def __init__(self, graph: Any, module: Any, shapes: dict[Any, Geometry], outputs: Any) -> None:
        self.graph, self.module, self.shapes, self.outputs = graph, module, shapes, outputs


_WAIT = "_c10d_functional::wait_tensor"


def record(fn: Callable[..., Any], args: Sequence[Any]) -> Recording:
    """Run ``fn(*args)`` (tensors and ``None``; it returns a list of tensors and ``None``) once,
    recording every ATen call it makes into a graph whose inputs are ``args``."""
    torch = torch_module()
    fx = torch.fx
    graph = fx.Graph()
    module = torch.nn.Module()
    made: dict[int, Any] = {}  # id of a live tensor -> the node that made it
    seen: set[int] = set()  # ids with a finalizer: the entry goes when the tensor does

    def bind(t: Any, node: Any) -> None:
        key = id(t)
        made[key] = node
        if key not in seen:
            seen.add(key)
            weakref.finalize(t, _forget, made, seen, key)

    shapes: dict[Any, Geometry] = {}
    constants: list[Any] = []

    def geometry(t: Any) -> Geometry:
        return (tuple(t.shape), tuple(t.stride()), int(t.storage_offset()), t.dtype)

    def note(node: Any, t: Any) -> None:
        shapes[node] = geometry(t)
        node.meta[DEVICE] = t.device

    for k, a in enumerate(args):
        node = graph.placeholder(f"arg{k}")
        if isinstance(a, torch.Tensor):
            bind(a, node)
            note(node, a)

    def node_of(t: Any) -> Any:
        node = made.get(id(t))
        if node is None:  # made before the run: a constant of the graph
            name = f"_constant{len(constants)}"
            constants.append(t)
            module.register_buffer(name, t, persistent=False)
            node = graph.get_attr(name)
            bind(t, node)
            note(node, t)
        return node

    def as_nodes(tree: Any) -> Any:
        if isinstance(tree, torch.Tensor):
            return node_of(tree)
        if isinstance(tree, list):
            return [as_nodes(x) for x in tree]
        if isinstance(tree, tuple):
            return tuple(as_nodes(x) for x in tree)
        if isinstance(tree, dict):
            return {k: as_nodes(v) for k, v in tree.items()}
        return tree

    mode: Any = torch.utils._python_dispatch.TorchDispatchMode

    class Recorder(mode):  # type: ignore[misc]
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            name = func._schema.name.removeprefix("aten::")
            if name in _REFUSED:
                raise TraceError(f"the traced programs call {func}, which depends on values")
            out = func(*args, **kwargs)
            node = graph.call_function(func, as_nodes(args), as_nodes(kwargs))
            if isinstance(out, torch.Tensor):
                note(node, out)
                # An in-place or out= op returns its argument: still its node.  A wait on a
                # collective returns its argument too, but what reads the result must follow it.
                if id(out) not in made or name == _WAIT:
                    bind(out, node)
            elif isinstance(out, tuple | list):
                for k, o in enumerate(out):
                    if isinstance(o, torch.Tensor):
                        item = graph.call_function(operator.getitem, (node, k))
                        bind(o, item)
                        note(item, o)
            return out

    # torch wraps a mode's dispatch to keep dynamo out of it, importing dynamo (1.8 s) on the
    # first call; nothing here runs under dynamo, so the plain function is used.
    plain = getattr(Recorder.__torch_dispatch__, "__wrapped__", Recorder.__torch_dispatch__)
    setattr(Recorder, "__torch_dispatch__", plain)  # noqa: B010 - mypy refuses assigning to a method
    with torch.no_grad(), Recorder():
        outputs = fn(*args)
    graph.output([node_of(o) if isinstance(o, torch.Tensor) else o for o in outputs])
    return Recording(graph, module, shapes, outputs)


def _forget(made: dict[int, Any], seen: set[int], key: int) -> None:
    made.pop(key, None)
    seen.discard(key)
