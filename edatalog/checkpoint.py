"""Checkpoints: a program's params read from safetensors files, by the names they declare.

A checkpoint is one ``.safetensors`` file, or a directory holding ``model.safetensors`` or
shards with their index (``model.safetensors.index.json``, as ``save_pretrained`` writes them).
Each param is found under the first of its declared checkpoint names that the checkpoint has
(``param wq[H * E, D] : f32 from "model.layers.{i}.self_attn.q_proj.weight"``, with ``{i}`` the
layer), or else under its own name; so one small declaration in the program maps a model's
names, not code per model.  What does not match is one error listing everything that differs:
missing names, shapes, dtypes, and a different number of layers or of stacked tensors.

A name with placeholders other than ``{i}`` stacks the param's leading axes from one tensor per
index (``param w1[E, F, D] : f32 from "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight"``:
Mixtral's experts, each ``[F, D]``; see :mod:`edatalog.rules.sources`).  :meth:`Checkpoint.names_for`
gives such a param's name with its placeholders, :meth:`Checkpoint.read` stacks the tensors it
stands for (only those of the slice asked for), and :func:`unstacked` splits a value back into
them for writing a checkpoint that transformers reads.

Tensors are read lazily and by slices (:meth:`Checkpoint.read`), so that each rank of a plan
reads only its blocks.  safetensors files hold raw tensors: nothing is ever unpickled.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
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
from edatalog.rules.sources import PLACEHOLDER, filled, pattern, stacked

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


@dataclass(frozen=True)
class Stack:
    """The tensors a stacked checkpoint name stands for (``experts.{e}.w1.weight``), by their
    indices: one number per placeholder of ``axes``."""

    name: str
    axes: tuple[str, ...]  # its stacked placeholders, in order: the param's leading axes
    members: dict[tuple[int, ...], Tensor]

    @property
    def extents(self) -> tuple[int, ...]:
        """How many indices each axis has, counting from 0 to the highest found."""
        return tuple(max((idx[k] for idx in self.members), default=-1) + 1 for k in range(len(self.axes)))

    @property
    def complete(self) -> bool:
        """Whether every index up to :attr:`extents` has its tensor (no gap)."""
        return len(self.members) == math.prod(self.extents)

    def found(self) -> str:
        """The indices found, per axis: ``{e} = 0 .. 3``, or ``{e} = 0, 1, 3`` with a gap."""
        out = []
        for k, axis in enumerate(self.axes):
            seen = sorted({idx[k] for idx in self.members})
            run = len(seen) > 2 and seen == list(range(seen[-1] + 1))
            out.append(f"{{{axis}}} = " + (f"0 .. {seen[-1]}" if run else ", ".join(map(str, seen))))
        return ", ".join(out)


class Checkpoint:
    """The tensors of a safetensors checkpoint (a file, or a directory of one or of shards)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.tensors: dict[str, Tensor] = {}
        self._stacks: dict[str, Stack] = {}
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
        """The tensor ``name`` (a torch tensor on the CPU), or only ``slices`` of it.  A stacked
        name (``experts.{e}.w1.weight``, as :meth:`names_for` gives it) reads as its tensors
        stacked along its leading axes, only those the slices of those axes take."""
        if stacked(name):
            return self._read_stack(self.stack(name), slices)
        from safetensors import safe_open

        t = self.tensors[name]
        with safe_open(str(t.file), framework="pt", device="cpu") as fh:
            if slices is None:
                return fh.get_tensor(name)
            return fh.get_slice(name)[tuple(slices)]

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds ``name``: a tensor, or for a stacked name at least one
        of its tensors (whether they are all there is a mismatch :meth:`names_for` reports)."""
        return bool(self.stack(name).members) if stacked(name) else name in self.tensors

    def stack(self, name: str) -> Stack:
        """The tensors the stacked name ``name`` stands for (kept: a param asks for them once
        to match and once per slice it reads)."""
        if name not in self._stacks:
            axes = stacked(name)
            regex = re.compile(pattern(name))
            literal = PLACEHOLDER.split(name, maxsplit=1)[0]  # what every name it stands for starts with
            members = {}
            for t in self.tensors.values():
                if t.name.startswith(literal) and (m := regex.fullmatch(t.name)):
                    members[tuple(int(g) for g in m.groups())] = t
            self._stacks[name] = Stack(name, axes, members)
        return self._stacks[name]

    def _read_stack(self, st: Stack, slices: Sequence[slice] | None) -> Any:
        """A stacked name's tensors within ``slices``, stacked: each read by the trailing slices,
        files opened once."""
        import torch
        from safetensors import safe_open

        k = len(st.axes)
        if not st.complete:
            raise EdlError(
                f"the checkpoint {self.path} lacks tensors of {st.name} ({st.found()} found)",
                help="check that this is the model the program describes",
            )
        lead = [range(*(slice(None) if slices is None else slices[a]).indices(n)) for a, n in enumerate(st.extents)]
        rest = None if slices is None or len(slices) == k else tuple(slices[k:])
        picked = list(itertools.product(*lead)) or [(0,) * k]  # nothing taken: one read for the shape
        parts = []
        with contextlib.ExitStack() as files:
            handles: dict[Path, Any] = {}
            for idx in picked:
                t = st.members[idx]
                if t.file not in handles:
                    handles[t.file] = files.enter_context(safe_open(str(t.file), framework="pt", device="cpu"))
                fh = handles[t.file]
                parts.append(fh.get_tensor(t.name) if rest is None else fh.get_slice(t.name)[rest])
        out = torch.stack(parts)
        if not all(lead):
            out = out[:0]
        return out.reshape(*(len(r) for r in lead), *out.shape[1:])

    # -- matching a program ----------------------------------------------------------------------

    def names_for(self, graph: Graph, kinds: tuple[str, ...] = ("param",)) -> dict[str, str]:
        """For every relation of ``kinds``, the checkpoint tensor it loads; an error listing every
        mismatch (a layer count, missing names, shapes, dtypes) when they do not all match."""
        rels = [r for r in graph.relations if r.kind in kinds]
        _check_layers(graph, self)
        found: dict[str, str] = {}
        missing: list[Relation] = []
        for r in rels:
            name = next((n for n in (*r.sources, r.name) if self.has(n)), None)
            if name is None:
                missing.append(r)
            else:
                found[r.name] = name
        if missing:
            lines = []
            for r in missing[:SHOWN]:
                wanted = (*r.sources, r.name) if r.sources else (r.name,)
                close = did_you_mean(filled(wanted[0], dict.fromkeys(stacked(wanted[0]), 0)), self.tensors)
                lines.append(f"{r.name}: none of {', '.join(wanted)}" + (f" ({close})" if close else ""))
            more = f" and {len(missing) - SHOWN} more" if len(missing) > SHOWN else ""
            raise EdlError(
                f"the checkpoint {self.path} lacks {len(missing)} of the program's {len(rels)} params{more}:\n  "
                + "\n  ".join(lines),
                help="declare where each param is found ('param w[..] : f32 from \"name\"'), or check that "
                "this is the model the program describes",
            )
        problems = [p for r in rels if (p := self._mismatch(r, found[r.name])) is not None]
        wrong = [line for line, _ in problems]
        dtypes_seen = {dtype for _, dtype in problems}
        if wrong and len(dtypes_seen) == 1 and None not in dtypes_seen:
            (dt,) = dtypes_seen
            assert dt is not None
            raise EdlError(
                f"the checkpoint {self.path} holds {dt} params, but the program's are "
                f"{self._dtypes_of(rels, found)}: {len(wrong)} differ, e.g.\n  " + "\n  ".join(wrong[:3]),
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

    def _mismatch(self, r: Relation, name: str) -> tuple[str, str | None] | None:
        """How the tensor(s) of ``name`` differ from the param ``r``, if they do: a line of the
        error, and the checkpoint's dtype when only the dtype differs.  A stacked name's tensors
        are counted against the param's leading extents and each compared with its trailing
        shape."""
        if not stacked(name):
            t = self.tensors[name]
            if t.shape != r.shape:
                return f"{r.name} ({t.name}): shape {list(t.shape)} in the checkpoint, {list(r.shape)} here", None
            if t.dtype != r.dtype:
                return f"{r.name} ({t.name}): {t.dtype} in the checkpoint, {r.dtype} here", t.dtype
            return None
        st = self.stack(name)
        k = len(st.axes)
        lead, trail = r.shape[:k], r.shape[k:]
        if st.extents != lead or not st.complete:
            extents = ", ".join(f"{sym} = {n}" for sym, n in zip(r.symbols[:k], lead, strict=True))
            return (
                f"{r.name} ({name}): {len(st.members)} tensors in the checkpoint ({st.found()}), "
                f"{math.prod(lead)} here ({extents})",
                None,
            )
        for t in st.members.values():
            if t.shape != trail:
                return (
                    f"{r.name} ({t.name}): shape {list(t.shape)} in the checkpoint, {list(trail)} here "
                    f"(one of {len(st.members)} stacked as {list(r.shape)})",
                    None,
                )
        dtypes = sorted({t.dtype for t in st.members.values()})
        if dtypes != [r.dtype]:
            return f"{r.name} ({name}): {'/'.join(dtypes)} in the checkpoint, {r.dtype} here", "/".join(dtypes)
        return None

    def _dtype(self, name: str) -> str:
        """The checkpoint's dtype of a name (of a stacked name's first tensor)."""
        if stacked(name):
            return next(iter(self.stack(name).members.values())).dtype
        return self.tensors[name].dtype

    def _dtypes_of(self, rels: list[Relation], found: dict[str, str]) -> str:
        """The program's dtypes of the params whose checkpoint dtype differs."""
        return "/".join(sorted({r.dtype for r in rels if self._dtype(found[r.name]) != r.dtype}))

    def read_all(self, graph: Graph, kinds: tuple[str, ...] = ("param",)) -> dict[str, Any]:
        """Every relation of ``kinds``, whole, as torch tensors (see :meth:`names_for`)."""
        return {rel: self.read(name) for rel, name in self.names_for(graph, kinds).items()}


def unstacked(name: str, value: Any) -> dict[str, Any]:
    """``value`` (an array or tensor) as the checkpoint holds it under ``name``: itself, or for
    a stacked name one tensor per index of its leading axes, by the names they fill in
    (``experts.0.w1.weight``: ``value[0]``, ...), as transformers writes and reads them."""
    axes = stacked(name)
    if not axes:
        return {name: value}
    extents = value.shape[: len(axes)]
    return {
        filled(name, dict(zip(axes, idx, strict=True))): value[idx] for idx in itertools.product(*map(range, extents))
    }


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
    every layer's, its layer number captured (a stacked name's other indices match any); None
    if it names no layer."""
    at = source.find(".0.")
    if at < 0:
        return None
    return re.compile(pattern(source[:at], False) + r"\.(\d+)\." + pattern(source[at + 3 :], False))


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
