"""Checkpoints: a program's params read from safetensors files, by the names they declare.

A checkpoint is one ``.safetensors`` file, or a directory holding ``model.safetensors`` or
shards with their index (``model.safetensors.index.json``, as ``save_pretrained`` writes them).
Each param is found under the first of its declared checkpoint names that the checkpoint has
(``param wq[H * E, D] : f32 from "model.layers.{i}.self_attn.q_proj.weight"``, with ``{i}`` the
layer), or else under its own name; so one small declaration in the program maps a model's
names, not code per model.  What does not match is one error listing everything that differs:
missing names, shapes, dtypes, and a different number of layers.

Tensors are read lazily and by slices (:meth:`Checkpoint.read`), so that each rank of a plan
reads only its blocks.  safetensors files hold raw tensors: nothing is ever unpickled.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edatalog.errors import EdlError, Source, did_you_mean
from edatalog.ir.graph import Graph, Relation
from edatalog.lang import ast
from edatalog.lang.parser import parse, parse_file

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# safetensors' dtype names -> edatalog's.
DTYPES = {"F64": "f64", "F32": "f32", "F16": "f16", "BF16": "bf16", "I64": "i64", "I32": "i32", "BOOL": "bool"}
SHOWN = 8  # problems listed in one error, at most


@dataclass(frozen=True)
class Tensor:
    """One tensor of a checkpoint: where it is, its shape and dtype (from the file's header)."""

    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: str  # edatalog's name, or safetensors' when edatalog has none


class Checkpoint:
    """The tensors of a safetensors checkpoint (a file, or a directory of one or of shards)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.tensors: dict[str, Tensor] = {}
        for file in self._files():
            self._scan(file)

    def _files(self) -> list[Path]:
        p = self.path
        if not p.exists():
            raise EdlError(f"no such checkpoint: {p}", help="pass a .safetensors file or the directory of a model")
        if p.is_file():
            return [p]
        index = p / INDEX
        if index.exists():
            try:
                data = json.loads(index.read_text(encoding="utf-8"))
                files = sorted(set(data["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise EdlError(f"{index} is not a safetensors index: {exc}") from None
            return [p / f for f in files]
        if (p / SINGLE).exists():
            return [p / SINGLE]
        found = sorted(p.glob("*.safetensors"))
        if not found:
            raise EdlError(
                f"{p} holds no safetensors checkpoint",
                help=f"expected {SINGLE}, or shards listed in {INDEX} (what save_pretrained writes)",
            )
        return found

    def _scan(self, file: Path) -> None:
        from safetensors import SafetensorError, safe_open

        if not file.exists():
            raise EdlError(f"the checkpoint's index names {file.name}, which is missing", help=f"in {file.parent}")
        try:
            with safe_open(str(file), framework="pt", device="cpu") as fh:
                for name in fh.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    sl = fh.get_slice(name)
                    dtype = sl.get_dtype()
                    self.tensors[name] = Tensor(name, file, tuple(sl.get_shape()), DTYPES.get(dtype, dtype))
        except SafetensorError as exc:
            raise EdlError(f"{file} is not a safetensors file: {exc}") from None

    def read(self, name: str, slices: Sequence[slice] | None = None) -> Any:
        """The tensor ``name`` (a torch tensor on the CPU), or only ``slices`` of it."""
        from safetensors import safe_open

        t = self.tensors[name]
        with safe_open(str(t.file), framework="pt", device="cpu") as fh:
            if slices is None:
                return fh.get_tensor(name)
            return fh.get_slice(name)[tuple(slices)]

    # -- matching a program ----------------------------------------------------------------------

    def names_for(self, graph: Graph, kinds: tuple[str, ...] = ("param",)) -> dict[str, str]:
        """For every relation of ``kinds``, the checkpoint tensor it loads; an error listing every
        mismatch (a layer count, missing names, shapes, dtypes) when they do not all match."""
        rels = [r for r in graph.relations if r.kind in kinds]
        _check_layers(graph, self)
        found: dict[str, str] = {}
        missing: list[Relation] = []
        for r in rels:
            name = next((n for n in (*r.sources, r.name) if n in self.tensors), None)
            if name is None:
                missing.append(r)
            else:
                found[r.name] = name
        if missing:
            lines = []
            for r in missing[:SHOWN]:
                wanted = (*r.sources, r.name) if r.sources else (r.name,)
                close = did_you_mean(wanted[0], self.tensors)
                lines.append(f"{r.name}: none of {', '.join(wanted)}" + (f" ({close})" if close else ""))
            more = f" and {len(missing) - SHOWN} more" if len(missing) > SHOWN else ""
            raise EdlError(
                f"the checkpoint {self.path} lacks {len(missing)} of the program's {len(rels)} params{more}:\n  "
                + "\n  ".join(lines),
                help="declare where each param is found ('param w[..] : f32 from \"name\"'), or check that "
                "this is the model the program describes",
            )
        wrong = []
        dtypes_seen = set()
        for r in rels:
            t = self.tensors[found[r.name]]
            if t.shape != r.shape:
                wrong.append(f"{r.name} ({t.name}): shape {list(t.shape)} in the checkpoint, {list(r.shape)} here")
            elif t.dtype != r.dtype:
                wrong.append(f"{r.name} ({t.name}): {t.dtype} in the checkpoint, {r.dtype} here")
                dtypes_seen.add(t.dtype)
        if wrong and len(dtypes_seen) == 1 and all("shape" not in w for w in wrong):
            (dt,) = dtypes_seen
            raise EdlError(
                f"the checkpoint {self.path} holds {dt} params, but the program's are "
                f"{_dtypes_of(rels, found, self.tensors)}: {len(wrong)} differ, e.g.\n  " + "\n  ".join(wrong[:3]),
                help=f"run the program in the checkpoint's dtype: --dtype {dt} (dtype='{dt}' when compiling)",
            )
        if wrong:
            more = f"\n  and {len(wrong) - SHOWN} more" if len(wrong) > SHOWN else ""
            raise EdlError(
                f"{len(wrong)} param{'s' * (len(wrong) > 1)} of the checkpoint {self.path} "
                f"{'do' if len(wrong) > 1 else 'does'} not match the program:\n  " + "\n  ".join(wrong[:SHOWN]) + more,
                help="set the dims to the model's (--dim D=..., or dims= when compiling), and its dtype "
                "(--dtype, or dtype=)",
            )
        return found

    def read_all(self, graph: Graph, kinds: tuple[str, ...] = ("param",)) -> dict[str, Any]:
        """Every relation of ``kinds``, whole, as torch tensors (see :meth:`names_for`)."""
        return {rel: self.read(name) for rel, name in self.names_for(graph, kinds).items()}


def _dtypes_of(rels: list[Relation], found: dict[str, str], tensors: dict[str, Tensor]) -> str:
    """The program's dtypes of the params whose checkpoint dtype differs."""
    return "/".join(sorted({r.dtype for r in rels if tensors[found[r.name]].dtype != r.dtype}))


def _check_layers(graph: Graph, ckpt: Checkpoint) -> None:
    """A repeated module's params name their layer (``model.layers.{i}.``): the checkpoint must
    have as many layers as the program repeats the module."""
    for rep in graph.repeats:
        patterns = set()
        for r in graph.relations:
            if r.kind == "param" and r.name.startswith(f"{rep.prefix}.0."):
                patterns |= {p for s in r.sources if (p := _pattern(s)) is not None}
        if not patterns:
            continue
        layers: set[int] = set()
        for pat in patterns:
            for name in ckpt.tensors:
                m = pat.fullmatch(name)
                if m:
                    layers.add(int(m.group(1)))
        if layers and (max(layers) + 1 != rep.count or len(layers) != max(layers) + 1):
            have = f"layers 0 .. {max(layers)}" if len(layers) == max(layers) + 1 else f"layers {sorted(layers)}"
            count = dict(graph.dims).get("L")
            fix = f"--dim L={max(layers) + 1} (or dims={{'L': {max(layers) + 1}}})" if count == rep.count else ""
            raise EdlError(
                f"the checkpoint {ckpt.path} has {len(layers)} layer{'s' * (len(layers) > 1)} ({have}), "
                "but the program repeats "
                f"'{rep.module}' {rep.count} times ('{rep.prefix}')",
                help="make the layer count the checkpoint's" + (f": {fix}" if fix else ""),
            )


def _pattern(source: str) -> re.Pattern[str] | None:
    """Layer 0's checkpoint name (``model.layers.0.mlp.up_proj.weight``) as a pattern matching
    every layer's, its layer number captured; None if it names no layer."""
    at = source.find(".0.")
    if at < 0:
        return None
    return re.compile(re.escape(source[:at]) + r"\.(\d+)\." + re.escape(source[at + 3 :]))


CONFIG = "config.json"


def configured(program: Any, path: str | os.PathLike[str]) -> tuple[dict[str, int], dict[str, float]]:
    """The dims and consts that a model's configuration sets (``config.json`` in the
    checkpoint's directory, as ``save_pretrained`` writes it), for the bindings that name their
    key: ``dim L = 32 from "num_hidden_layers"``, ``const theta = 1e4 from
    "rope_parameters.rope_theta", "rope_theta"`` (``a.b``: key ``b`` of ``a``; the first key
    present).  Nothing when there is no configuration.  ``program`` is a compiled program
    (``edatalog.compile(...)``), a ``.edl`` file's path, or its syntax tree."""
    program = _syntax_tree(program)
    where = Path(path)
    file = (where if where.is_dir() else where.parent) / CONFIG
    if not file.exists():
        return {}, {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise EdlError(f"{file} is not a JSON configuration: {exc}") from None
    dims: dict[str, int] = {}
    consts: dict[str, float] = {}
    for stmt in program.statements:
        if not isinstance(stmt, ast.DimDecl | ast.ConstDecl):
            continue
        for b in stmt.items:
            value = next((v for key, _ in b.sources if (v := _key(data, key)) is not None), None)
            if value is None:
                continue
            if isinstance(stmt, ast.DimDecl):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise EdlError(f"{file}: '{b.sources[0][0]}' is {value!r}, not a whole number", b.span)
                dims[b.name] = value
            else:
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise EdlError(f"{file}: '{b.sources[0][0]}' is {value!r}, not a number", b.span)
                consts[b.name] = float(value)
    return dims, consts


def _syntax_tree(program: Any) -> ast.Program:
    """The syntax tree of a program given as a tree, a compiled program or a file's path."""
    if isinstance(program, ast.Program):
        return program
    if isinstance(program, str | os.PathLike):
        return parse_file(str(program))
    source = getattr(program, "source", None)
    if isinstance(source, Source):
        return parse(source.text, source.name)
    raise EdlError(
        "configured() takes a program (edatalog.compile(...)), a .edl path or a syntax tree, "
        f"not {type(program).__name__}"
    )


def _key(data: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data
