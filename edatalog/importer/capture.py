"""Capturing a ``torch.nn.Module`` as core ATen: ``torch.export`` (non-strict), decomposed, and
what the rest of the import needs of the graph: each node's op, module path and source line."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

from edatalog.errors import EdlError, Note, Source, Span

DTYPES = {
    "torch.float32": "f32",
    "torch.float64": "f64",
    "torch.bfloat16": "bf16",
    "torch.float16": "f16",
    "torch.int64": "i64",
    "torch.int32": "i32",
    "torch.bool": "bool",
}


def dtype_name(dtype: Any) -> str:
    name = DTYPES.get(str(dtype))
    if name is None:
        raise EdlError(f"tensors of {dtype} are not imported", help=f"use one of {', '.join(DTYPES)}")
    return name


def export(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
    """The module's forward as core ATen (``torch.export``, then its default decompositions).
    A model that export cannot capture is an error with export's own message as its cause."""
    import inspect

    import torch

    module = module.eval()
    kwargs = dict(kwargs or {})
    # transformers models return their KV cache unless told not to: the importer tells them.
    params = inspect.signature(module.forward).parameters
    if hasattr(module, "config") and "use_cache" in params and "use_cache" not in kwargs:
        kwargs["use_cache"] = False
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # torch's own deprecation notices about its internals, not the user's code.
            warnings.simplefilter("ignore", FutureWarning)
            program = torch.export.export(module, args, kwargs, strict=False)
            # Attention stays one op: the importer writes it as an attention chain, with its
            # mask as a guard where it is a band (and torch's decomposition of it can fail).
            table = torch.export.default_decompositions()
            for key in [k for k in table if "scaled_dot_product" in str(k)]:
                del table[key]
            return program.run_decompositions(table)
    except Exception as exc:  # export raises many kinds; each becomes the same clear error
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise EdlError(
            f"torch.export could not capture {type(module).__name__}: {first}",
            help="make the forward traceable (no data-dependent Python control flow; for transformers "
            "models pass use_cache=False), or export it yourself and check torch.export's message",
        ) from exc


def output_names(program: Any, count: int) -> list[str]:
    """The outputs' names: ``y`` for one tensor; a dict's or a transformers output's keys
    (``logits``); else ``y0, y1, ...``."""
    spec = program.call_spec.out_spec
    keys = getattr(spec, "context", None)
    names: list[str] = keys if isinstance(keys, list) and all(isinstance(k, str) for k in keys) else []
    children = spec.children() if hasattr(spec, "children") else []
    if len(names) == count and all(getattr(c, "num_leaves", 1) == 1 for c in children):  # one tensor per key
        return [re.sub(r"\W", "_", k) for k in names]
    return ["y"] if count == 1 else [f"y{k}" for k in range(count)]


def module_path(node: Any) -> str:
    """The path of the innermost module the node ran in (``layers.0.mlp.fc1``), or ''."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return re.sub(r"^L\['self'\]\.?", "", str(path))


def layer_of(node: Any) -> tuple[str, int, str] | None:
    """The repeated layer a node ran in: the outermost module of its stack whose path ends in an
    index (``model.layers.3``), as (``model.layers``, 3, its class's name in snake case)."""
    for path, cls in (node.meta.get("nn_module_stack") or {}).values():
        m = re.fullmatch(r"(.+)\.(\d+)", re.sub(r"^L\['self'\]\.?", "", str(path)))
        if m:
            name = str(cls).rsplit(".", 1)[-1]
            snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()
            return m.group(1), int(m.group(2)), snake
    return None


def source_span(node: Any) -> tuple[Span | None, list[Note]]:
    """The user's source line the node came from (the last frame outside torch), as a span of
    that file, and the frames as notes."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', trace)
    user = [f for f in frames if "/torch/" not in f[0] and "site-packages/torch" not in f[0]]
    if not user:
        return None, []
    path, line, _ = user[-1]
    try:
        text = Path(path).read_text()
    except OSError:
        return None, [Note(f"at {path}:{line}")]
    source = Source(path, text)
    lines = text.splitlines(keepends=True)
    k = int(line) - 1
    if k >= len(lines):
        return None, [Note(f"at {path}:{line}")]
    start = sum(len(x) for x in lines[:k])
    body = lines[k].rstrip("\n")
    indent = len(body) - len(body.lstrip())
    return source.span(start + indent, start + len(body)), []
