"""A stack of identical layers, written as one module repeated (docs/language.md section 17), so
that the planner solves one layer and reuses it for every instance.

The import writes every rule tagged with the layer its op ran in (``model.layers.3``: a module
whose path ends in an index).  :func:`program_text` folds the layers of the longest such stack
when they are the same rules over renamed relations: each layer reads the previous layer's
result (the first, the embedding's) and relations shared by all of them (rotary tables), writes
one relation read after it, and has params named alike (``model.layers.{i}.mlp.up_proj.weight``).
Where they are not (a layer differs, reads another layer's relation...), the program is written
out layer by layer, as :meth:`Builder.text` writes it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from edatalog.importer.builder import Builder, Declared, Written


def program_text(b: Builder, title: str) -> str:
    """The program's text, its repeated layers as a module where they fold."""
    stacks: dict[str, set[int]] = {}
    for w in b.written:
        if w.layer is not None:
            stacks.setdefault(w.layer[0], set()).add(w.layer[1])
    best = max(stacks, key=lambda p: len(stacks[p]), default=None)
    if best is None or len(stacks[best]) < 2 or stacks[best] != set(range(len(stacks[best]))):
        return b.text(title)
    folded = _fold(b, best, len(stacks[best]), title)
    return folded if folded is not None else b.text(title)


def _fold(b: Builder, prefix: str, count: int, title: str) -> str | None:
    layers = [[w for w in b.written if w.layer == (prefix, k)] for k in range(count)]
    defined = [list(dict.fromkeys(w.name for w in rules)) for rules in layers]
    if len({len(d) for d in defined}) != 1:
        return None
    params = [_layer_params(b.declared, prefix, k) for k in range(count)]
    outside = [w for w in b.written if w.layer is None or w.layer[0] != prefix]
    reads_after: set[str] = set(b.outputs) | {n for w in outside for n in w.reads()}
    outs: list[str] = []
    externals: list[set[str]] = []
    for k, rules in enumerate(layers):
        mine = set(defined[k])
        reads = {n for w in rules for n in w.reads()} - mine - set(params[k])
        externals.append(reads)
        later = reads_after | {n for j in range(count) if j != k for w in layers[j] for n in w.reads()}
        leaving = [n for n in defined[k] if n in later]
        if len(leaving) != 1:
            return None
        outs.append(leaving[0])
    shared_set = externals[1] - {outs[0]}
    if any(externals[k] - {outs[k - 1]} != shared_set for k in range(1, count)) or any(
        outs[k - 1] not in externals[k] for k in range(1, count)
    ):
        return None
    first = externals[0] - shared_set
    if len(first) != 1:
        return None
    (x0,) = first
    shared = sorted(shared_set)
    # Layer 0's names, less the stack's prefix, stand for every layer's.
    stem = prefix.replace(".", "_") + "_0_"
    local = [n.removeprefix(stem) for n in defined[0]]
    local = [("y" if defined[0][j] == outs[0] else n) for j, n in enumerate(local)]
    canon: list[str] = []
    for n in local:
        name = n if n not in canon and n not in shared and n != "x" else f"{n}_"
        canon.append(name)
    texts: list[str] | None = None
    for k in range(count):
        renames = dict(zip(defined[k], canon, strict=True))
        renames |= {name: local_name for name, (local_name, _) in params[k].items()}
        renames[x0 if k == 0 else outs[k - 1]] = "x"
        rewritten = [_renamed(w.text, renames) for w in layers[k]]
        if texts is None:
            texts = rewritten
        elif rewritten != texts:
            return None
    assert texts is not None
    return _text(b, title, prefix, count, layers, params[0], x0, shared, outs[-1], texts)


def _text(
    b: Builder,
    title: str,
    prefix: str,
    count: int,
    layers: Sequence[Sequence[Written]],
    params: Mapping[str, tuple[str, Declared]],
    x0: str,
    shared: Sequence[str],
    result: str,
    texts: Sequence[str],
) -> str:
    module = b.module_names.get(prefix, "layer")
    in_layers = {w for rules in layers for w in rules}
    layer_params = {d.name for d in b.declared if d.kind == "param" and _index_of(d.source, prefix) is not None}
    heads = [d.line() for d in b.declared if d.kind == "input"]
    heads += [d.line() for d in b.declared if d.kind == "param" and d.name not in layer_params]
    body = [f"module {module}."]
    body.append("  " + _input_line("x", *b.shapes[x0]))
    body += ["  " + _input_line(s, *b.shapes[s]) for s in shared]
    first = re.compile(rf"^{re.escape(prefix)}\.0\.")

    def every_layer(source: str) -> str:  # layer 0's checkpoint name, as the module's "{i}" form
        return first.sub(f"{prefix}.{{i}}.", source)

    for local_name, declared in params.values():
        body.append("  " + declared.line(local_name, every_layer))
    body.append("  output y.")
    body += ["  " + t for t in texts]
    body.append("end.")
    hidden = "hidden" if "hidden" not in b.names else result  # the last layer's result, for the rules after
    call = f"{hidden} = {module}({', '.join([x0, *shared])}) repeat {count} as {prefix.rsplit('.', 1)[-1]}."
    rules: list[str] = []
    for w in b.written:
        if w in in_layers:
            if w is layers[0][0]:
                rules.append(call)
            continue
        rules.append(_renamed(w.text, {result: hidden}))
    parts = [f"# {title}", "", *heads, f"output {', '.join(b.outputs)}.", "", *body, "", *rules, ""]
    return "\n".join(parts)


def _input_line(name: str, shape: tuple[int, ...], dtype: str) -> str:
    return f"input {name}[{', '.join(str(s) for s in shape)}] : {dtype}."


def _layer_params(declared: Sequence[Declared], prefix: str, k: int) -> dict[str, tuple[str, Declared]]:
    """Layer ``k``'s params: name -> (its name in the module, its declaration)."""
    out = {}
    for d in declared:
        if d.kind == "param" and _index_of(d.source, prefix) == k:
            assert d.source is not None
            rest = d.source.removeprefix(f"{prefix}.{k}.")
            out[d.name] = (re.sub(r"\W", "_", rest), d)
    return out


def _index_of(source: str | None, prefix: str) -> int | None:
    m = re.match(rf"{re.escape(prefix)}\.(\d+)\.", source or "")
    return int(m.group(1)) if m else None


def _renamed(text: str, renames: Mapping[str, str]) -> str:
    if not renames:
        return text
    pattern = re.compile(r"\b(" + "|".join(re.escape(n) for n in sorted(renames, key=len, reverse=True)) + r")\[")
    return pattern.sub(lambda m: renames[m.group(1)] + "[", text)
