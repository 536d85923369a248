"""Bring your own PyTorch model: ``torch.export`` to readable ``.edl`` rules.

:func:`to_edl` captures a module's forward (:mod:`edatalog.importer.capture`: ``torch.export``,
decomposed to core ATen) and maps it op by op (:mod:`edatalog.importer.ops`) to rules
(:mod:`edatalog.importer.builder`), layout ops folded into index positions and elementwise chains
into one rule (:mod:`edatalog.importer.terms`).  :func:`from_torch` compiles that text;
:func:`torch_params` gives the module's weights by the program's param names.

Names scripts can rely on: the program's inputs are the forward's argument names, its outputs
``y`` (one tensor), ``y0, y1, ...`` (a tuple) or a dict's or transformers output's keys
(``logits``), its params the module's ``state_dict`` names with dots as underscores, each
loading from its ``state_dict`` name (``from "fc1.weight"``).  docs/importing.md has the rest.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import numpy as np

from edatalog.api import Program, compile_string
from edatalog.errors import EdlError
from edatalog.importer import (
    attention,  # noqa: F401 - registers scaled_dot_product_attention in ops.OPS
    capture,
    constants,
    conv,  # noqa: F401 - registers convolutions, pooling and batch norm in ops.OPS
    layers,
    ops,
)
from edatalog.importer import terms as T
from edatalog.importer.builder import Builder


def to_edl(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> str:
    """The ``.edl`` text of ``module``'s forward at the shapes of ``args``.

    The captured graph is imported twice when the first import saw relations' axes read in
    parts (a projection's output, one axis of heads times features, read as ``(h, e)``): the
    second writes those axes apart (``q[b, s, h, e]``), so that plans can split them and
    readers read them plainly."""
    program = capture.export(module, args, kwargs)
    hints = capture.index_hints(module, program)
    b = _import(module, program, {}, hints)
    splits = {key: sizes for key, sizes in b.seen.items() if sizes is not None and len(sizes) > 1}
    if splits:
        b = _import(module, program, splits, hints)
    return layers.program_text(b, f"{type(module).__name__}, imported from PyTorch by edatalog.from_torch")


def _import(
    module: Any, program: Any, splits: dict[tuple[str, int], list[int]], hints: dict[int, tuple[str, ...]]
) -> Builder:
    """One import of the captured ``program``, writing apart the axes ``splits`` says, naming
    indices as ``hints`` says."""
    from torch.export.graph_signature import InputKind, OutputKind

    sig = program.graph_signature
    specs = {spec.arg.name: spec for spec in sig.input_specs}
    b = Builder(splits=dict(splits), hints=hints)
    values: dict[str, Any] = {}  # node -> its view (or a tuple of them, a number)
    folded: dict[str, Any] = {}  # node -> its value, where it depends on shapes (and fixed buffers) only
    nodes = {node.name: node for node in program.graph.nodes}

    # Every name of each tensor: a head tied to the embedding is one param of two names, and a
    # checkpoint (save_pretrained's) keeps one of them.
    names_of: dict[int, list[str]] = {}
    tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for name, tensor in tensors:
        names_of.setdefault(id(tensor), []).append(name)

    def declared(node: Any) -> T.View:
        spec, val = specs[node.name], node.meta["val"]
        shape, dtype = tuple(int(s) for s in val.shape), capture.dtype_name(val.dtype)
        if spec.kind == InputKind.USER_INPUT:
            return b.declare("input", b.name(node.name), shape, dtype)
        tensor = _tensor(module, spec.target)
        aliases = [n for n in names_of.get(id(tensor), []) if n != spec.target]
        return b.declare("param", b.name(spec.target), shape, dtype, spec.target, aliases)

    def view_of(name: str) -> Any:
        """What ops read of node ``name``.  A folded value is written as a term of its indices
        where it has such a form; otherwise the ops that made it are imported after all."""
        if name not in values:
            node, value = nodes[name], folded[name]
            view = constants.as_view(value, capture.dtype_name(value.dtype)) if hasattr(value, "dtype") else None
            if view is not None:
                values[name] = view
            elif isinstance(value, int | float | bool):
                values[name] = value
            elif node.op == "placeholder":
                values[name] = declared(node)
            else:
                values[name] = _call(b, node, view_of)
        return values[name]

    for node in program.graph.nodes:
        if node.op == "placeholder":
            spec = specs[node.name]
            if not hasattr(node.meta["val"], "shape") or not node.users:
                continue  # a constant argument (use_cache=False), or a buffer the forward never reads
            if spec.kind == InputKind.BUFFER and not spec.persistent:
                # Not in the state_dict, so not in checkpoints: computed from the config (rotary
                # frequencies), folded like shapes.
                folded[node.name] = module.get_buffer(spec.target).detach()
            elif spec.kind in (InputKind.USER_INPUT, InputKind.PARAMETER, InputKind.BUFFER):
                values[node.name] = declared(node)
            else:
                raise EdlError(
                    f"{type(module).__name__}'s forward reads a tensor constant ({spec.target}), which is not imported",
                    help="make it a buffer of the module (register_buffer)",
                )
        elif node.op == "call_function":
            if constants.foldable(node, set(folded)):
                try:
                    folded[node.name] = constants.evaluate(node, folded)
                    continue
                except Exception:  # noqa: BLE001 - torch could not run it concretely: import it as an op
                    pass
            values[node.name] = _call(b, node, view_of)
        elif node.op == "output":
            outs = [s for s in sig.output_specs if s.kind == OutputKind.USER_OUTPUT]
            names = capture.output_names(program, len(outs))
            for spec, name in zip(outs, names, strict=True):
                b.output(view_of(spec.arg.name), name)
    return b


def _tensor(module: Any, target: str) -> Any:
    try:
        return module.get_parameter(target)
    except AttributeError:
        return module.get_buffer(target)


def from_torch(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None, name: str = "") -> Program:
    """``module``'s forward at the shapes of ``args`` as a compiled :class:`edatalog.Program`."""
    text = to_edl(module, args, kwargs)
    return compile_string(text, name=name or f"<{type(module).__name__}>")


def torch_params(prog: Program, module: Any) -> dict[str, np.ndarray]:
    """``module``'s params and buffers by the param names of ``prog`` (an imported program):
    each found by the ``state_dict`` names it declares."""
    # Buffers that are not in the state_dict (persistent=False, as rotary frequencies are) too.
    tensors = {**dict(module.named_buffers()), **dict(module.named_parameters()), **module.state_dict()}
    state = {k: v.detach().cpu() for k, v in tensors.items()}
    out = {}
    for rel in prog.graph.relations:
        if rel.kind != "param":
            continue
        found = next((state[n] for n in rel.sources if n in state), None)
        if found is None:
            raise EdlError(f"the module has no tensor for param {rel.name} ({', '.join(rel.sources)})")
        out[rel.name] = found.float().numpy() if str(found.dtype) == "torch.bfloat16" else found.numpy()
    return out


def _call(b: Builder, node: Any, view_of: Any) -> Any:
    import torch.fx

    where = capture.module_path(node)
    if node.target is operator.getitem:  # one result of an op of several (layer norm's output)
        whole, k = node.args
        value = view_of(whole.name)[k]
        b.layer = _layer(node)  # after view_of, which may import what it reads (in another layer)
        return _named(b, node, value, where, None)
    key = str(node.target)
    handler = ops.OPS.get(key)
    if handler is None:
        raise _unsupported(node, key, where, "edatalog has no rule for it yet")
    args = torch.fx.node.map_arg(node.args, lambda n: view_of(n.name))
    kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: view_of(n.name))
    cx = ops.Context(b, where.replace(".", "_"))
    layer = capture.layer_of(node)
    b.layer = _layer(node)  # after the arguments, which may import what they read (in another layer)
    if layer:
        b.module_names.setdefault(layer[0], layer[2])
    try:
        result = handler(cx, *args, **kwargs)
    except ops.Unsupported as exc:
        raise _unsupported(node, key, where, exc.what, exc.hint) from None
    first = args[0] if args else None
    carried = b.preferred_name(first) if isinstance(first, T.View) and key in ops.REARRANGING else None
    return _named(b, node, result, where, carried)


def _named(b: Builder, node: Any, result: Any, where: str, carried: str | None) -> Any:
    """``result`` (a view the op made) written out where several ops read it (an elementwise
    chain is written once, not recomputed in each), or one in another layer or outside them (so
    that layers stay alike).  Its name: ``carried`` (a view of a module's result is still that
    result), else the module's where it is what the module returns, as one tensor
    (``input_layernorm``; the rotary module's cos and sin keep their ops' names), else the op's.
    Not written out, it keeps that name for an op after it that writes it (a contraction's
    operand)."""
    if not isinstance(result, T.View) or isinstance(result.term, T.Read):
        return result
    readers = _readers(node)
    module = where.replace(".", "_")
    leaves = where and _leaving(node.graph).get(where) == 1 and not any(_inside(u, where) for u in readers)
    name = carried or (module if leaves else None)
    if len(readers) > 1 or any(_layer(u) != b.layer for u in readers):
        return b.materialize(result, name or (f"{module}_{node.name}" if module else node.name))
    if name:
        b.prefer(result, name)
    return result


def _readers(node: Any) -> list[Any]:
    """The ops that read ``node``'s result (export's dtype checks left out)."""
    return [u for u in node.users if "_assert_tensor_metadata" not in str(u.target)]


def _inside(node: Any, module: str) -> bool:
    path = capture.module_path(node)
    return path == module or path.startswith(module + ".")


@functools.lru_cache(maxsize=4)
def _leaving(graph: Any) -> dict[str, int]:
    """How many ops of each module (by its path) are read outside it: its results."""
    counts: dict[str, int] = {}
    for node in graph.nodes:
        where = capture.module_path(node) if node.op == "call_function" else ""
        if where and any(not _inside(u, where) for u in _readers(node)):
            counts[where] = counts.get(where, 0) + 1
    return counts


def _layer(node: Any) -> tuple[str, int] | None:
    layer = capture.layer_of(node)
    return (layer[0], layer[1]) if layer else None


def _unsupported(node: Any, key: str, where: str, what: str, hint: str = "") -> EdlError:
    span, notes = capture.source_span(node.meta.get("stack_trace") or "")
    at = f" in module '{where}'" if where else ""
    return EdlError(
        f"cannot import {key}{at}: {what}",
        span,
        help=hint
        or "rewrite this part of the forward with supported ops (docs/importing.md lists them), "
        "or open an issue with the op",
        notes=notes,
    )
