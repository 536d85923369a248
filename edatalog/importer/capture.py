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
        # Export names the user's line that raised ("The following call raised this error").
        span, notes = source_span(str(exc))
        raise EdlError(
            f"torch.export could not capture {type(module).__name__}: {first}",
            span,
            help="make the forward traceable (no data-dependent Python control flow; for transformers "
            "models pass use_cache=False), or export it yourself and check torch.export's message",
            notes=tuple(notes),
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


def source_span(trace: str) -> tuple[Span | None, list[Note]]:
    """The user's source line a stack trace (a node's, an exception's) ends in (the last frame
    outside torch), as a span of that file; or a note naming it where the file cannot be read."""
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


# A config's sizes (transformers' attribute names, GPT-2's) and the index name each one's extent
# takes in the imported rules.
_ROLES = (
    (("hidden_size", "n_embd", "d_model"), "d"),
    (("intermediate_size", "n_inner", "ffn_dim"), "f"),
    (("num_attention_heads", "n_head"), "h"),
    (("num_key_value_heads",), "g"),
    (("head_dim",), "e"),
    (("vocab_size",), "v"),
)


def index_hints(module: Any, program: Any) -> dict[int, tuple[str, ...]]:
    """Index names by extent for a transformers model (a module with a config, reading
    ``input_ids``): ``b`` the batch, ``s`` and ``t`` the sequence, ``d`` the hidden size, ``f``
    the feed-forward's, ``h`` heads, ``g`` key/value heads, ``r`` query heads per key/value
    head, ``e`` a head's features, ``v`` the vocabulary.  Extents two roles share list both
    names, in that order.  Empty for other modules: their rules name indices by letter."""
    config = getattr(module, "config", None)
    ids = next((node for node in program.graph.nodes if node.op == "placeholder" and node.name == "input_ids"), None)
    if config is None or ids is None or len(ids.meta["val"].shape) != 2:
        return {}
    batch, seq = (int(n) for n in ids.meta["val"].shape)
    sizes: dict[str, int] = {}
    for attributes, letter in _ROLES:
        value = next((getattr(config, a) for a in attributes if isinstance(getattr(config, a, None), int)), None)
        if value:
            sizes[letter] = value
    if "h" in sizes and "d" in sizes and "e" not in sizes and sizes["d"] % sizes["h"] == 0:
        sizes["e"] = sizes["d"] // sizes["h"]
    if "h" in sizes and sizes.get("g") and sizes["h"] % sizes["g"] == 0:
        sizes["r"] = sizes["h"] // sizes["g"]
    pairs = [(batch, "b"), (seq, "s"), (seq, "t"), *((n, letter) for letter, n in sizes.items() if n > 1)]
    hints: dict[int, tuple[str, ...]] = {}
    for extent, letter in pairs:
        if letter not in hints.get(extent, ()):
            hints[extent] = (*hints.get(extent, ()), letter)
    return hints
