"""The public Python API: compile a program, inspect its join-agg graph, run it.

This module is the facade over the pipeline (language -> rules -> backend); it is the only place
besides the CLI that imports every stage.
"""

from __future__ import annotations

import os
import warnings
import zlib
from collections.abc import Callable, Collection, Mapping
from typing import Any

import numpy as np

from edatalog.backend.reference import Value, evaluate
from edatalog.errors import Diagnostic, EdlError, EdlWarning, Note, Span, did_you_mean
from edatalog.ir import dtypes
from edatalog.ir.graph import Graph, JoinAgg, Relation
from edatalog.lang import ast
from edatalog.lang.parser import parse, parse_file
from edatalog.plans import Plan
from edatalog.rules import compile_program


class Program:
    """A compiled ``.edl`` program: its join-agg graph plus everything needed to run it."""

    def __init__(self, graph: Graph, program: ast.Program, diagnostics: list[Diagnostic]) -> None:
        self.graph = graph
        self.source = program.source
        self.warnings: tuple[Diagnostic, ...] = tuple(diagnostics)
        self._decl_spans: dict[str, Span] = {
            s.name: s.name_span for s in program.statements if isinstance(s, ast.RelationDecl)
        }

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def arguments(self) -> tuple[Relation, ...]:
        """Inputs and params: everything ``run`` must be given."""
        return tuple(r for r in self.graph.relations if r.kind in ("input", "param"))

    @property
    def outputs(self) -> tuple[str, ...]:
        return self.graph.outputs

    @property
    def dims(self) -> dict[str, int]:
        return dict(self.graph.dims)

    @property
    def consts(self) -> dict[str, float]:
        return dict(self.graph.consts)

    def __str__(self) -> str:
        return str(self.graph)

    def __repr__(self) -> str:
        return f"<edatalog.Program {self.name}: {len(self.graph.nodes)} rules, outputs {', '.join(self.outputs)}>"

    # -- running ------------------------------------------------------------------------------

    def prepare(self, values: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Check names, shapes and dtypes of the given inputs; convert them to the declared dtypes."""
        expected = {r.name: r for r in self.arguments}
        for name in values:
            if name not in expected:
                raise EdlError(
                    f"'{name}' is not an input or param of {self.name}",
                    help=did_you_mean(name, expected, "inputs") or "the program takes no inputs",
                )
        out: dict[str, np.ndarray] = {}
        for name, rel in expected.items():
            span = self._decl_spans.get(name)
            if name not in values:
                raise EdlError(
                    f"missing value for {rel.kind} '{name}' ({_shape_text(rel)})",
                    span,
                    help="pass every input and param; `edl run --random SEED` makes random ones",
                )
            out[name] = _convert(values[name], rel, span)
        return out

    def evaluate(self, values: Mapping[str, Any], on_node: Callable[[JoinAgg], None] | None = None) -> dict[str, Value]:
        """Every relation's cells and presence masks, by the reference evaluator.
        ``on_node(node)`` is called as each rule finishes, for progress displays."""
        return evaluate(self.graph, self.prepare(values), on_node)

    def run(
        self, values: Mapping[str, Any], *, plan: Plan | None = None, backend: str | None = None
    ) -> dict[str, np.ndarray]:
        """The outputs as numpy arrays (absent cells read as 0).

        ``backend="reference"`` (the default) evaluates whole tensors; ``backend="sim"`` runs the
        per-device programs synthesized for ``plan`` in the simulator."""
        backend = backend or ("sim" if plan is not None else "reference")
        if backend == "sim":
            if plan is None:
                raise EdlError("the sim backend runs a plan", help="pass plan=edatalog.plan(prog, ...)")
            if plan.graph.fingerprint() != self.graph.fingerprint():
                raise EdlError("this plan was made for another program", help="make a plan for this program")
            outs = plan.execute(self.prepare(values))
            return {name: outs[name].data for name in self.outputs}
        if backend != "reference":
            raise EdlError(f"unknown backend '{backend}'", help="available backends: reference, sim")
        if plan is not None:
            raise EdlError("the reference backend evaluates whole tensors", help="run a plan with backend='sim'")
        env = self.evaluate(values)
        # An output that is an input or param would alias the caller's array: hand back a copy.
        return {
            name: env[name].data if self.graph.relation(name).kind == "derived" else env[name].data.copy()
            for name in self.outputs
        }

    def random_inputs(
        self,
        seed: int = 0,
        names: Collection[str] | None = None,
        on_value: Callable[[str, int], None] | None = None,
    ) -> dict[str, np.ndarray]:
        """Random values for the inputs and params (all, or those in ``names``), scaled like a
        freshly initialized model: inputs ~ N(0, 1); matrix params ~ N(0, 1/fan_in) with fan_in the
        last axis (the PyTorch ``Linear`` layout, out x in); vector params ~ 1 + N(0, 0.1²), like
        norm weights.  Each value depends only on the seed and its name, so drawing a subset
        gives the same values as drawing all.  ``on_value(name, nbytes)`` is called after each
        value, for progress displays."""
        if not isinstance(seed, int) or seed < 0:
            raise EdlError(f"the random seed must be a non-negative integer, not {seed!r}")
        out = {}
        for rel in self.arguments:
            if names is None or rel.name in names:
                rng = np.random.default_rng((seed, zlib.crc32(rel.name.encode())))
                out[rel.name] = _random_value(rel, rng)
                if on_value is not None:
                    on_value(rel.name, out[rel.name].nbytes)
        return out


def _random_value(rel: Relation, rng: np.random.Generator) -> np.ndarray:
    shape = rel.shape
    kind = dtypes.kind(rel.dtype)
    if kind == "bool":
        return rng.random(shape) < 0.5
    if kind == "int":
        return rng.integers(0, 16, size=shape).astype(dtypes.to_numpy(rel.dtype))
    gen = np.float64 if rel.dtype == "f64" else np.float32  # draw f32 directly: 7B weights draw in seconds
    arr = rng.standard_normal(shape, dtype=gen)
    if rel.kind == "param" and len(shape) >= 2:
        arr *= gen(1.0 / np.sqrt(shape[-1]))
    elif rel.kind == "param" and len(shape) == 1:
        arr = gen(1.0) + gen(0.1) * arr
    return arr.astype(dtypes.to_numpy(rel.dtype), copy=False)


def _shape_text(rel: Relation) -> str:
    dims = (f"{s}={n}" if s != str(n) else s for s, n in zip(rel.symbols, rel.shape, strict=True))
    return f"[{', '.join(dims)}] : {rel.dtype}"


def _convert(value: Any, rel: Relation, span: Span | None) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except Exception as exc:  # noqa: BLE001 - any failure to convert is the user's value
        raise EdlError(f"value for '{rel.name}' is not an array: {exc}", span) from None
    if arr.shape != rel.shape:
        raise EdlError(
            f"'{rel.name}' must have shape {rel.shape} ({_shape_text(rel)}), but the value has shape {arr.shape}",
            span,
            help="check the dims; override them with dims={...} or --dim K=V if the data is right",
        )
    want = dtypes.to_numpy(rel.dtype)
    if arr.dtype != want:
        ok = np.can_cast(arr.dtype, want, casting="same_kind") or (
            arr.dtype.kind in "iub" and dtypes.kind(rel.dtype) == "float"
        )
        if not ok:
            raise EdlError(
                f"'{rel.name}' is declared {rel.dtype}, but the value has dtype {arr.dtype}",
                span,
                help=f"convert it, e.g. value.astype(np.{want.name})",
            )
        arr = arr.astype(want)
    return arr


def _finish(program: ast.Program, dims: Mapping[str, int] | None, consts: Mapping[str, float] | None) -> Program:
    graph, diagnostics = compile_program(program, dims, consts)
    for d in diagnostics:
        warnings.warn(d.render(), EdlWarning, stacklevel=3)
    return Program(graph, program, diagnostics)


def compile(  # noqa: A001 - the natural name; shadows the builtin only inside this module
    path: str | os.PathLike[str],
    *,
    dims: Mapping[str, int] | None = None,
    consts: Mapping[str, float] | None = None,
) -> Program:
    """Compile the ``.edl`` file at ``path``.  ``dims`` and ``consts`` override declared values
    (derived dims such as ``E = D / H`` follow)."""
    return _finish(parse_file(os.fspath(path)), dims, consts)


def compile_string(
    text: str,
    *,
    name: str = "<string>",
    dims: Mapping[str, int] | None = None,
    consts: Mapping[str, float] | None = None,
) -> Program:
    """Compile program text; ``name`` is used in error locations."""
    return _finish(parse(text, name), dims, consts)


__all__ = ["EdlError", "EdlWarning", "Note", "Program", "compile", "compile_string"]
