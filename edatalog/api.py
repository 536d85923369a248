"""The public Python API: compile a program, inspect its join-agg graph, run it.

This module is the facade over the pipeline (language -> rules -> backend); it is the only place
besides the CLI that imports every stage.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
import warnings
import zlib
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np

from edatalog.backend.kernels import memory
from edatalog.backend.kernels.reference import Value, evaluate
from edatalog.backend.lowering.lowered import Lowered
from edatalog.errors import Diagnostic, EdlError, EdlWarning, Note, Span, did_you_mean
from edatalog.executable import Executable
from edatalog.ir import dtypes
from edatalog.ir.graph import Graph, JoinAgg, Relation
from edatalog.lang import ast
from edatalog.lang.parser import parse, parse_file
from edatalog.plans import Plan
from edatalog.rules import compile_program
from edatalog.rules.grad import GradError, gradient


class Program:
    """A compiled ``.edl`` program: its join-agg graph plus everything needed to run it."""

    def __init__(self, graph: Graph, program: ast.Program, diagnostics: list[Diagnostic]) -> None:
        self.graph = graph
        self.source = program.source
        self.warnings: tuple[Diagnostic, ...] = tuple(diagnostics)
        self._decl_spans: dict[str, Span] = {
            s.name: s.name_span for s in program.statements if isinstance(s, ast.RelationDecl)
        }
        # Source locations by the text the IR keeps (``Relation.origin``, ``JoinAgg.origin``).
        self._spans: dict[str, Span] = {str(s.span): s.span for s in program.statements if isinstance(s, ast.Rule)}
        self._spans |= {str(span): span for span in self._decl_spans.values()}
        self._valid: set[tuple[Any, ...]] = set()  # torch input signatures already checked
        self._lookups: dict[str, int] | None = None  # looked-up relation -> the narrowest index it gives

    @property
    def name(self) -> str:
        return self.source.name

    def loss_name(self, loss: str | None = None) -> str:
        """``loss``, or by default the program's one output (an error when it has several)."""
        if loss is not None:
            return loss
        if len(self.outputs) != 1:
            raise EdlError(
                f"the program has {len(self.outputs)} outputs ({', '.join(self.outputs)}): which is the loss?",
                help="name it: loss='loss'",
            )
        return self.outputs[0]

    def with_graph(self, graph: Graph) -> Program:
        """This program's source, spans and warnings with another graph of it (its gradients,
        its training step), whose errors then point into this program's text."""
        graph.verify()
        out = copy.copy(self)
        out.graph = graph
        out._valid, out._lookups = set(), None
        return out

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

    def prepare(
        self, values: Mapping[str, Any], *, kinds: Collection[str] = ("input", "param"), optional: Collection[str] = ()
    ) -> dict[str, Any]:
        """Check names, shapes and dtypes of the given values of the relations of ``kinds``
        (inputs and params: everything a run needs, but the names in ``optional``); convert
        them to the declared dtypes.  Values may be numpy arrays, nested lists, numbers or torch
        tensors (of any device, with or without ``requires_grad``; converted exactly, bf16
        included)."""
        return self._prepare(values, kinds, False, optional)

    def _prepare(
        self, values: Mapping[str, Any], kinds: Collection[str], keep_torch: bool, optional: Collection[str] = ()
    ) -> dict[str, Any]:
        """:meth:`prepare`; with ``keep_torch``, torch tensors stay torch tensors (in the
        declared dtype, on their device), for the torch runtime.  Torch tensors of names,
        shapes and dtypes already found right are checked once per such signature (a decode
        loop calls with the same ones every token); looked-up values, on every call.  Names in
        ``optional`` may be left out (state an executable already holds)."""
        _check_mapping(values)
        sig = _torch_signature(values, (*kinds, *sorted(optional))) if keep_torch else None
        if sig is not None and sig in self._valid:
            out = {k: v.detach() for k, v in values.items()}
            self._check_lookups(out)
            return out
        out = self._prepare_checked(values, kinds, keep_torch, optional)
        declared = {r.name: r.dtype for r in self.arguments}
        if sig is not None and all(_torch_dtype_name(v) == declared[k] for k, v in values.items()):
            self._valid.add(sig)  # found right, in the declared dtypes: passed as they are next time
        return out

    def _prepare_checked(
        self, values: Mapping[str, Any], kinds: Collection[str], keep_torch: bool, optional: Collection[str] = ()
    ) -> dict[str, Any]:
        expected = {r.name: r for r in self.arguments if r.kind in kinds}
        for name in values:
            if name not in expected:
                what = " and ".join(f"{k}s" for k in kinds)
                kind = " or ".join(kinds)
                raise EdlError(
                    f"'{name}' is not {'an' if kind[0] in 'aeiou' else 'a'} {kind} of {self.name}",
                    help=did_you_mean(name, expected, what) or f"the program takes no such {what}",
                )
        out: dict[str, Any] = {}
        for name, rel in expected.items():
            span = self._decl_spans.get(name)
            if name not in values and name in optional:
                continue
            if name not in values:
                raise EdlError(
                    f"missing value for {rel.kind} '{name}' ({_shape_text(rel)})",
                    span,
                    help="pass every input and param; `edl run --random SEED` makes random ones",
                )
            if keep_torch and _is_torch_tensor(values[name]):
                out[name] = _torch_value(values[name], rel, span)
            else:
                out[name] = _convert(values[name], rel, span)
        self._check_lookups(out)
        return out

    def _check_lookups(self, values: Mapping[str, Any]) -> None:
        """Every value of an input or param that a rule looks up names a place of the index it
        gives: an out-of-range token id is an error here, with where it is, never a wrong row.
        One vectorized test per looked-up relation against the narrowest index it gives; the
        rule and cell are found only when a value fails it."""
        if self._lookups is None:
            narrowest: dict[str, int] = {}
            for node in self.graph.nodes:
                for lk in node.lookups:
                    name = node.inputs[lk.input].relation
                    narrowest[name] = min(lk.extent, narrowest.get(name, lk.extent))
            self._lookups = narrowest
        if not any(name in values and not _in_range(values[name], n) for name, n in self._lookups.items()):
            return
        for node in self.graph.nodes:
            for lk in node.lookups:
                name = node.inputs[lk.input].relation
                if name not in values:
                    continue
                arr = values[name]
                if _is_torch_tensor(arr):
                    arr = arr.detach().cpu().numpy()
                bad = np.argwhere((np.asarray(arr) < 0) | (np.asarray(arr) >= lk.extent))
                if len(bad):
                    at = tuple(int(i) for i in bad[0])
                    value = int(np.asarray(arr)[at])
                    raise EdlError(
                        f"{name}[{', '.join(map(str, at))}] = {value} is out of range: rule '{node.out}' looks it up "
                        f"as index '{lk.index}', which runs 0 .. {lk.extent - 1}",
                        self._decl_spans.get(name),
                        help=f"every value of '{name}' must be below {lk.extent} and not negative "
                        f"({len(bad)} value{'s are' if len(bad) > 1 else ' is'} not)",
                    )

    def evaluate(
        self,
        values: Mapping[str, Any],
        on_node: Callable[[JoinAgg], None] | None = None,
        keep: Collection[str] | None = None,
    ) -> dict[str, Value]:
        """Every relation (inputs, params and intermediates too; or only those in ``keep``, the
        others freed as soon as no rule needs them) as a :class:`Value`: its cells (0 where
        absent) and its presence mask, by the reference evaluator.  This is the detailed API,
        for inspecting a program; :meth:`run` (like :meth:`Plan.execute`) returns only the
        outputs, as plain arrays.  ``on_node(node)`` is called as each rule finishes, for progress
        displays."""
        prepared = self.prepare(values)
        memory.check(memory.evaluation_steps(self.graph, keep), spans=self._spans)
        return evaluate(self.graph, prepared, on_node, keep)

    def check_memory(self, *, draw_inputs: bool = False, keep_all: bool = False) -> None:
        """Raise an :class:`EdlError` if running the program (after drawing random inputs, with
        ``draw_inputs``; keeping every relation, with ``keep_all``, as :meth:`evaluate` does)
        would need more memory than this machine has available: it names the input or rule that
        would not fit, with its shape and bytes.  :meth:`run`, :meth:`evaluate` and
        :meth:`random_inputs` check this before allocating anything."""
        steps = memory.input_steps(self.graph) if draw_inputs else []
        steps += memory.evaluation_steps(self.graph, None if keep_all else self.outputs)
        memory.check(steps, spans=self._spans)

    def run(
        self,
        values: Mapping[str, Any],
        *,
        plan: Plan | None = None,
        backend: str | None = None,
        device: str | Sequence[str] | None = None,
    ) -> dict[str, Any]:
        """The outputs (absent cells read as 0), as numpy arrays, or torch tensors on the torch
        backend.  :meth:`evaluate` gives every relation with its presence mask instead.

        ``backend`` is one of ``edatalog.backend.running.runtime.RUNTIMES``: ``"reference"`` (the
        default without a plan) evaluates whole tensors on numpy; ``"sim"`` (the default with
        one) simulates the plan's device programs; ``"torch"`` runs on torch ``device`` (one, or
        one per device of the plan).  The same as ``self.executable(plan, backend, device)``,
        loaded with the params in ``values`` and called on the inputs."""
        _check_mapping(values)
        backend = backend or ("sim" if plan is not None else "reference")
        exe = self.executable(plan, backend=backend, device=device)
        checked = self._prepare(values, ("input", "param"), keep_torch=exe.runtime.arrays == "torch")
        if backend == "reference":
            self.check_memory()
        params = {r.name for r in self.arguments if r.kind == "param"}
        exe.load({k: v for k, v in checked.items() if k in params})
        return exe({k: v for k, v in checked.items() if k not in params})

    def executable(
        self,
        plan: Plan | Lowered | None = None,
        *,
        backend: str = "torch",
        device: str | Sequence[str] | None = None,
        collectives: str | None = None,
        compile: str | None = None,
    ) -> Executable:
        """This program (with ``plan``, or on one device) ready to run on ``backend`` many times:
        ``exe.load(params)`` once, then ``exe(inputs)``; see :mod:`edatalog.executable`.
        ``collectives`` (``"auto"``, ``"on"``, ``"off"``) says which exchanges of the plan run as
        collective calls (auto: those the plan's machine runs faster so); a plan already lowered
        (``plan.lowering(...)``) runs as it is.  ``compile`` says how the torch backend runs the
        programs: ``"graph"`` (traced once per input signature into a graph of torch calls,
        replayed), ``"cudagraph"`` (that graph captured as a CUDA graph: one GPU), ``"inductor"``
        (that graph compiled by torch.compile's inductor) or ``"none"`` (the interpreter, op by
        op); ``"auto"``: cudagraph on one GPU, graph elsewhere."""
        return Executable(self.graph, self._prepare, plan, backend, device, collectives, compile)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
        """The program's params from a safetensors checkpoint (a file, or a model's directory of
        one file or of shards with their index), each found by the checkpoint names it declares
        (see :mod:`edatalog.checkpoint`), as numpy arrays for :meth:`run`.  A name, shape, dtype
        or layer count that does not match is an error listing every difference."""
        from edatalog.checkpoint import Checkpoint

        ckpt = Checkpoint(path)
        tensors = ckpt.read_all(self.graph)
        return {
            name: _from_torch(t, self.graph.relation(name), self._decl_spans.get(name)) for name, t in tensors.items()
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
        memory.check(memory.input_steps(self.graph, names), spans=self._spans)
        out = {}
        # Integers a rule looks up are drawn within the index they give (token ids below V).
        bound: dict[str, int] = {}
        for node in self.graph.nodes:
            for lk in node.lookups:
                name = node.inputs[lk.input].relation
                bound[name] = min(bound.get(name, lk.extent), lk.extent)
        for rel in self.arguments:
            if names is None or rel.name in names:
                rng = np.random.default_rng((seed, zlib.crc32(rel.name.encode())))
                out[rel.name] = _random_value(rel, rng, bound.get(rel.name, 16))
                if on_value is not None:
                    on_value(rel.name, out[rel.name].nbytes)
        return out


def _random_value(rel: Relation, rng: np.random.Generator, int_bound: int = 16) -> np.ndarray:
    shape = rel.shape
    kind = dtypes.kind(rel.dtype)
    if kind == "bool":
        return rng.random(shape) < 0.5
    if kind == "int":
        return rng.integers(0, int_bound, size=shape).astype(dtypes.to_numpy(rel.dtype))
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


def _check_mapping(values: object) -> None:
    """``run(None)`` or ``run([x, w])`` would fail deep inside with a bare TypeError: say what
    the values must be instead."""
    if not isinstance(values, Mapping):
        raise EdlError(
            f"the values must be a mapping from input and param names to arrays, not {type(values).__name__}",
            help="pass a dict such as {'x': x, 'w': w}, or prog.random_inputs(seed=0)",
        )


def _is_torch_tensor(value: object) -> bool:
    """Whether ``value`` is a torch tensor (or a subclass, such as a ``Parameter``), without
    importing torch: a tensor exists only if torch was imported already."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _from_torch(tensor: Any, rel: Relation, span: Span | None) -> np.ndarray:
    """A torch tensor as a numpy array with the same values, exactly: detached, on the host, and
    for bf16 (which numpy lacks) the same 16-bit patterns viewed as ``ml_dtypes.bfloat16``."""
    import torch

    try:
        t = tensor.detach().to("cpu").resolve_conj().resolve_neg()
        if t.layout != torch.strided:
            t = t.to_dense()
        if t.dtype == torch.bfloat16:
            return t.contiguous().view(torch.int16).numpy().view(dtypes.to_numpy("bf16"))
        return np.asarray(t.numpy())
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        raise EdlError(
            f"cannot read the torch tensor for '{rel.name}' ({tensor.dtype} on {tensor.device}): {exc}",
            span,
            help=f"pass a tensor of one of the types edatalog has ({', '.join(dtypes.DTYPES)}) that holds data",
        ) from None


def _torch_signature(values: Mapping[str, Any], kinds: tuple[str, ...]) -> tuple[Any, ...] | None:
    """Names, shapes, dtypes and devices of ``values`` when all are torch tensors, else None."""
    if not all(_is_torch_tensor(v) for v in values.values()):
        return None
    return (kinds, *((k, tuple(v.shape), v.dtype, v.device) for k, v in sorted(values.items())))


def _torch_dtype_name(tensor: Any) -> str:
    from edatalog.backend.kernels.arrays import TorchOps

    names = {TorchOps().dtype(d): d for d in dtypes.DTYPES}
    return names.get(tensor.dtype, "")


def _in_range(value: Any, extent: int) -> bool:
    """Whether every value is in 0 .. extent - 1 (numpy or torch, on its device)."""
    if _is_torch_tensor(value):
        if value.numel() == 1:  # a decode step's token and position: one read, no kernels
            return 0 <= int(value) < extent
        return not bool(((value < 0) | (value >= extent)).any())
    arr = np.asarray(value)
    return not bool(((arr < 0) | (arr >= extent)).any())


def _torch_value(tensor: Any, rel: Relation, span: Span | None) -> Any:
    """A torch tensor checked like an array (:func:`_convert`) and cast to the declared type, on
    its own device: no trip through numpy."""
    from edatalog.backend.kernels.arrays import TorchOps

    if tuple(tensor.shape) != rel.shape:
        raise EdlError(
            f"'{rel.name}' must have shape {rel.shape} ({_shape_text(rel)}), "
            f"but the value has shape {tuple(tensor.shape)}",
            span,
            help="check the dims; override them with dims={...} or --dim K=V if the data is right",
        )
    if tensor.dtype.is_floating_point and dtypes.kind(rel.dtype) != "float":
        raise EdlError(
            f"'{rel.name}' is declared {rel.dtype}, but the value has dtype {tensor.dtype}",
            span,
            help="a float value does not cast to an integer or bool relation; convert it",
        )
    return tensor.detach().to(TorchOps().dtype(rel.dtype))


def _convert(value: Any, rel: Relation, span: Span | None) -> np.ndarray:
    if _is_torch_tensor(value):
        value = _from_torch(value, rel, span)
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


def _finish(
    program: ast.Program,
    dims: Mapping[str, int] | None,
    consts: Mapping[str, float] | None,
    dtype: str | None,
    outputs: Sequence[str] | None = None,
) -> Program:
    if dtype is not None:
        program = retyped(program, dtype)
    if outputs is not None:
        program = with_outputs(program, outputs)
    graph, diagnostics = compile_program(program, dims, consts)
    for d in diagnostics:
        warnings.warn(d.render(), EdlWarning, stacklevel=3)
    return Program(graph, program, diagnostics)


def compile(  # noqa: A001 - the natural name; shadows the builtin only inside this module
    path: str | os.PathLike[str],
    *,
    dims: Mapping[str, int] | None = None,
    consts: Mapping[str, float] | None = None,
    dtype: str | None = None,
    outputs: Sequence[str] | None = None,
) -> Program:
    """Compile the ``.edl`` file at ``path``.  ``dims`` and ``consts`` override declared values
    (derived dims such as ``E = D / H`` follow); ``dtype`` (``"bf16"``, ``"f16"``, ``"f32"``,
    ``"f64"``) re-types every float input and param, and so every float rule; ``outputs``
    replaces the program's outputs (``("logits", "layers.kr")``: the logits and every layer's
    keys, as a prefill for generation wants)."""
    return _finish(parse_file(os.fspath(path)), dims, consts, dtype, outputs)


def compile_string(
    text: str,
    *,
    name: str = "<string>",
    dims: Mapping[str, int] | None = None,
    consts: Mapping[str, float] | None = None,
    dtype: str | None = None,
    outputs: Sequence[str] | None = None,
) -> Program:
    """Compile program text; ``name`` is used in error locations; the rest as :func:`compile`."""
    return _finish(parse(text, name), dims, consts, dtype, outputs)


def with_outputs(program: ast.Program, outputs: Sequence[str]) -> ast.Program:
    """``program`` with ``outputs`` as its outputs, in place of its own output statements."""
    if isinstance(outputs, str) or not outputs:
        raise EdlError("outputs= takes a non-empty list of relation names", help="e.g. outputs=['logits']")
    at = program.source.span(0, 0)
    statements = tuple(s for s in program.statements if not isinstance(s, ast.OutputDecl))
    return dataclasses.replace(program, statements=(*statements, ast.OutputDecl(tuple((n, at) for n in outputs), at)))


def retyped(program: ast.Program, dtype: str) -> ast.Program:
    """``program`` with every float input and param declared ``dtype`` (a float type); int and
    bool relations keep theirs.  Rules take their types from what they read, so every float
    rule follows."""
    if dtype not in dtypes.FLOATS:
        raise EdlError(
            f"dtype {dtype!r} is not a float type", help=f"use one of {', '.join(dtypes.FLOATS)} (re-types the floats)"
        )

    def one(s: ast.Statement) -> ast.Statement:
        if isinstance(s, ast.RelationDecl) and dtypes.kind(s.dtype) == "float":
            return dataclasses.replace(s, dtype=dtype)
        if isinstance(s, ast.Module):
            return dataclasses.replace(s, statements=tuple(one(t) for t in s.statements))
        return s

    return dataclasses.replace(program, statements=tuple(one(s) for s in program.statements))


def grad(prog: Program, loss: str | None = None, wrt: Sequence[str] | None = None) -> Program:
    """``prog`` with the gradient of its scalar ``loss`` (default: its one output) by each
    relation of ``wrt`` (default: every float param), as more rules of the same program
    (:mod:`edatalog.rules.grad`): its outputs are the loss, then ``grad_<name>`` per name, and it
    is planned and run as any program is."""
    loss = prog.loss_name(loss)
    try:
        return prog.with_graph(gradient(prog.graph, loss, wrt))
    except GradError as exc:  # the IR keeps locations as text: the program knows their spans
        raise EdlError(
            exc.text, prog._spans.get(exc.origin) or prog._decl_spans.get(loss), help=exc.help_text
        ) from None


def executable(
    prog: Program,
    plan: Plan | Lowered | None = None,
    *,
    backend: str = "torch",
    device: str | Sequence[str] | None = None,
    collectives: str | None = None,
    compile: str | None = None,
) -> Executable:
    """``prog`` (with ``plan``, or on one device) ready to run on ``backend``:
    ``exe = edatalog.executable(prog, plan)``, ``exe.load(params)``, ``out = exe(inputs)``."""
    return prog.executable(plan, backend=backend, device=device, collectives=collectives, compile=compile)


__all__ = ["EdlError", "EdlWarning", "Note", "Program", "compile", "compile_string", "executable", "grad"]
