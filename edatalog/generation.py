"""Greedy generation: a prefill with the model program, then decode steps over a KV cache.

    gen = edatalog.generate("programs/llama.edl", "model_dir", [1, 2, 3], max_new=16)
    gen.ids                      # the 16 new token ids
    gen.tokens_per_second        # measured: new tokens over the wall time of prefill and decode

Two programs do it (``programs/llama.edl`` and ``programs/llama_decode.edl``); what ties them
is one convention, not code per model:

- the model program takes ``ids[B, S]`` and computes ``logits[B, S, V]``;
- the decode program (by default the model's file name with ``_decode``) takes ``ids[B]`` (the
  newest token), ``pos[]`` (its position) and, per instance of a repeated module, caches
  ``P.k.NAME_cache[B, T, ...]`` whose first ``pos`` rows hold the entries of the tokens before;
  it computes ``logits[B, V]`` and each cache's entry for the new token, ``P.k.NAME_new[B, ...]``;
- the model program's instance relation ``P.k.NAME[B, S, ...]`` is the prefill's cache.

So a prefill computes the prompt's logits and caches; each step takes the most likely token
(greedy), writes the step's new entries at row ``pos`` and runs the decode program again.  Dims
and consts follow the checkpoint's ``config.json`` where the programs name its keys (``dim L = 32
from "num_hidden_layers"``); the cache holds ``T`` positions: ``len(prompt) + max_new``, rounded up to a bucket
(:func:`cache_positions`), so that nearby lengths share one compiled decode step.

With ``nproc``, the job runs on that many processes (torch.distributed, gloo on CPU): both
programs are planned for ``nproc`` devices (solved here, unless plans are given), and every
rank runs its device's programs, reading only its slices of the checkpoint.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from edatalog.errors import EdlError

CACHE, NEW = "_cache", "_new"


@dataclass(frozen=True)
class Request:
    """What every process needs to generate the same tokens (picklable: it crosses into ranks)."""

    program: str
    decode: str
    weights: str
    prompt: tuple[int, ...]
    max_new: int
    dims: dict[str, int] = field(default_factory=dict)
    consts: dict[str, float] = field(default_factory=dict)
    dtype: str | None = None
    backend: str = "torch"
    device: str | None = None
    prefill_plan: str | None = None
    decode_plan: str | None = None
    compile: str | None = None  # the torch runtime's compile mode (None: auto)
    buckets: bool = True  # prompt and cache lengths rounded up (False: plan files made for the exact ones)


@dataclass
class Generation:
    """The new token ids and the measured time: the prefill, then every decode step."""

    ids: list[int]
    prefill_seconds: float
    decode_seconds: float

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def tokens_per_second(self) -> float:
        return len(self.ids) / self.seconds if self.seconds > 0 else float("inf")


def generate(
    program: str | os.PathLike[str],
    weights: str | os.PathLike[str],
    prompt_ids: Sequence[int],
    max_new: int = 16,
    *,
    decode: str | os.PathLike[str] | None = None,
    dims: Mapping[str, int] | None = None,
    consts: Mapping[str, float] | None = None,
    dtype: str | None = None,
    backend: str = "torch",
    device: str | None = None,
    plan: str | os.PathLike[str] | None = None,
    decode_plan: str | os.PathLike[str] | None = None,
    nproc: int | None = None,
    topology: str | None = None,
    time_limit: float = 10.0,
    compile: str | None = None,
) -> Generation:
    """Greedy decoding of ``max_new`` tokens after ``prompt_ids`` (see the module docstring).
    ``backend`` is ``"reference"`` (numpy, one device) or ``"torch"``; with ``plan`` and
    ``decode_plan`` (plan files of the prefill, as :func:`prefill_program` compiles it, and of
    the decode program) the torch runtime runs them; with ``nproc``, on that many processes,
    planned on ``topology`` (default ``cpuxN``) within ``time_limit`` seconds each when no plan
    files are given.  ``compile`` is the torch runtime's compile mode (None or ``"auto"``:
    ``"cudagraph"`` on one GPU, ``"graph"`` elsewhere; ``"inductor"``; ``"none"``: the
    interpreter): the decode step is compiled once, at its second call, and replayed for every
    later token."""
    req = request(program, weights, prompt_ids, max_new, decode, dims, consts, dtype, backend, device)
    req = replace(_with_plans(req, plan, decode_plan), compile=compile)
    if nproc is None:
        if req.prefill_plan is None:
            gen = Generator(program, weights, decode=decode, dims=dims, consts=consts, dtype=dtype)
            gen.configure(backend=backend, device=device, compile=compile)
            return gen(prompt_ids, max_new)
        return _generate(req)
    from edatalog.backend.running.launch import spawn

    if backend != "torch":
        raise EdlError("--nproc runs on the torch backend", help="drop --backend reference, or --nproc")
    with tempfile.TemporaryDirectory(prefix="edatalog-generate-") as tmp:
        req = _planned(req, nproc, topology or f"cpux{nproc}", time_limit, Path(tmp))
        return spawn(nproc, _rank, (req,))[0]


def request(
    program: str | os.PathLike[str],
    weights: str | os.PathLike[str],
    prompt_ids: Sequence[int],
    max_new: int,
    decode: str | os.PathLike[str] | None = None,
    dims: Mapping[str, int] | None = None,
    consts: Mapping[str, float] | None = None,
    dtype: str | None = None,
    backend: str = "torch",
    device: str | None = None,
) -> Request:
    """A checked :class:`Request`; the decode program defaults to ``<model>_decode.edl``."""
    prompt = tuple(prompt_ids)
    if not prompt or not all(isinstance(t, int | np.integer) and not isinstance(t, bool) for t in prompt):
        raise EdlError("the prompt must be one or more token ids (integers)", help="e.g. --prompt-ids 1,2,3")
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
        raise EdlError(f"max_new must be a positive number of tokens, not {max_new!r}", help="e.g. --max-new 16")
    if backend not in ("reference", "torch"):
        raise EdlError(f"unknown backend '{backend}' for generation", help="use reference or torch")
    path = Path(program)
    decode_path = Path(decode) if decode is not None else path.with_name(f"{path.stem}_decode{path.suffix}")
    if not decode_path.exists():
        raise EdlError(
            f"no decode program {decode_path}",
            help=f"generation runs {path.name} once over the prompt and a decode program for each new token; "
            "pass it with --decode (see programs/llama_decode.edl)",
        )
    return Request(
        str(path),
        str(decode_path),
        os.fspath(weights),
        tuple(int(t) for t in prompt),
        max_new,
        dict(dims or {}),
        dict(consts or {}),
        dtype,
        backend,
        device,
    )


def _with_plans(req: Request, plan: Any, decode_plan: Any) -> Request:
    if (plan is None) != (decode_plan is None):
        raise EdlError(
            "generation needs a plan for both programs, or for neither",
            help="pass --plan (the prefill's) and --decode-plan, or let --nproc plan both",
        )
    if plan is None:
        return req
    # Plan files are made for the programs' exact dims: no buckets.
    return replace(req, prefill_plan=os.fspath(plan), decode_plan=os.fspath(decode_plan), buckets=False)


# -- the programs -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Programs:
    """The prefill (the model, with its caches as outputs) and the decode program, compiled for
    one prompt length, and the caches that tie them: ``(prefill relation, decode input, decode
    output)`` per cache."""

    prefill: Any
    decode: Any
    caches: tuple[tuple[str, str, str], ...]


CACHE_BUCKET = 64  # the fewest positions a KV cache holds
CACHE_STEP = 2048  # past this, caches grow by whole steps of it


PROMPT_BUCKET = 16  # the fewest positions a prefill runs over


def cache_positions(needed: int, buckets: bool = True) -> int:
    """How many positions the KV cache holds for ``needed`` (prompt and new tokens): the next
    power of two from :data:`CACHE_BUCKET`, then whole multiples of :data:`CACHE_STEP` (without
    ``buckets``: ``needed``).  Decode programs are compiled per cache length, so generations of
    nearby lengths share one compiled step; rows past the tokens written are masked
    (``t < pos``), never read as values."""
    return _bucket(needed, CACHE_BUCKET) if buckets else needed


def prompt_positions(req: Request) -> int:
    """How many positions the prefill runs over: the prompt's length rounded up as the cache's
    is, from :data:`PROMPT_BUCKET` (without ``req.buckets``: the prompt's length).  The prompt
    is padded at its end: in a causal model no position reads a later one, so the logits and
    cache entries of the prompt's own positions are what they would be without the padding."""
    return _bucket(len(req.prompt), PROMPT_BUCKET) if req.buckets else len(req.prompt)


def _bucket(needed: int, least: int) -> int:
    if needed <= CACHE_STEP:
        return max(least, 1 << (needed - 1).bit_length())
    return -(-needed // CACHE_STEP) * CACHE_STEP


def programs(req: Request) -> Programs:
    from edatalog.api import compile as compile_program
    from edatalog.checkpoint import configured
    from edatalog.lang import ast
    from edatalog.lang.parser import parse_file

    s, t = prompt_positions(req), cache_positions(len(req.prompt) + req.max_new, req.buckets)
    model, step = parse_file(req.program), parse_file(req.decode)
    dims_p, consts_p = configured(model, req.weights)
    dims_d, consts_d = configured(step, req.weights)
    # A dim the decode program does not declare is the model program's alone (the capacity C of
    # programs/mixtral_capacity.edl, whose steps run programs/mixtral_decode.edl).
    declared = {b.name for st in step.statements if isinstance(st, ast.DimDecl) for b in st.items}
    decode = compile_program(
        req.decode,
        dims={**dims_d, **{k: v for k, v in req.dims.items() if k in declared}, "B": 1, "T": t},
        consts={**consts_d, **req.consts},
        dtype=req.dtype,
    )
    caches = _caches(decode)
    outputs = ("logits", *dict.fromkeys(f"{prefix}.{name}" for prefix, name in _cache_names(decode)))
    prefill = prefill_program(
        req.program, {**dims_p, **req.dims, "B": 1, "S": s}, {**consts_p, **req.consts}, req.dtype, outputs
    )
    for rel, _, _ in caches:
        if rel not in {r.name for r in prefill.graph.relations}:
            raise EdlError(f"the model program has no relation '{rel}' for the decode program's cache")
    return Programs(prefill, decode, caches)


def prefill_program(
    path: str, dims: Mapping[str, int], consts: Mapping[str, float], dtype: str | None, outputs: Sequence[str]
) -> Any:
    """The model program with its logits and caches as outputs: what a generation's prefill
    runs (``edl plan --outputs`` makes a plan for it)."""
    from edatalog.api import compile as compile_program

    return compile_program(path, dims=dims, consts=consts, dtype=dtype, outputs=outputs)


def _cache_names(decode: Any) -> list[tuple[str, str]]:
    """(prefix, NAME) of every cache input ``prefix.k.NAME_cache`` of the decode program."""
    out = []
    for rep in decode.graph.repeats:
        for r in decode.graph.relations:
            head = f"{rep.prefix}.0."
            if r.kind == "input" and r.name.startswith(head) and r.name.endswith(CACHE):
                out.append((rep.prefix, r.name[len(head) : -len(CACHE)]))
    if not out:
        raise EdlError(
            "the decode program has no cache inputs",
            help="a decode program's repeated module takes inputs named NAME_cache (see programs/llama_decode.edl)",
        )
    return out


def _caches(decode: Any) -> tuple[tuple[str, str, str], ...]:
    counts = {rep.prefix: rep.count for rep in decode.graph.repeats}
    names = {r.name for r in decode.graph.relations}
    out = []
    for prefix, name in _cache_names(decode):
        for k in range(counts[prefix]):
            new = f"{prefix}.{k}.{name}{NEW}"
            if new not in names or new not in decode.graph.outputs:
                raise EdlError(f"the decode program does not output '{new}', the new entry of its cache '{name}'")
            out.append((f"{prefix}.{k}.{name}", f"{prefix}.{k}.{name}{CACHE}", new))
    for want in ("ids", "pos"):
        if want not in names:
            raise EdlError(f"the decode program has no input '{want}'", help="it takes ids[B] and pos[]")
    return tuple(out)


# -- running ------------------------------------------------------------------------------------


class Generator:
    """A model ready to generate, one process, no plan: its two programs compiled per prompt and
    cache bucket (:func:`prompt_positions`, :func:`cache_positions`), the weights read once
    and shared by every program (on the torch backend: torch tensors on the device), and the
    torch runtime's compiled steps kept from call to call.

        gen = edatalog.Generator("programs/llama.edl", "model_dir")
        gen([1, 2, 3], max_new=16).ids

    Its first call of a bucket interprets the prefill and the first decode step and compiles the
    decode step at the second; the next call of the bucket compiles the prefill too.  From then
    on a call replays graphs only (:mod:`edatalog.backend.running.compiled`)."""

    def __init__(
        self,
        program: str | os.PathLike[str],
        weights: str | os.PathLike[str],
        *,
        decode: str | os.PathLike[str] | None = None,
        dims: Mapping[str, int] | None = None,
        consts: Mapping[str, float] | None = None,
        dtype: str | None = None,
        backend: str = "torch",
        device: str | None = None,
        compile: str | None = None,
    ) -> None:
        self._base = request(program, weights, (0,), 1, decode, dims, consts, dtype, backend, device)
        self._base = replace(self._base, compile=compile)
        self._runs: dict[tuple[int, int], tuple[Programs, Any, Any]] = {}
        self._weights: dict[str, Any] | None = None

    def configure(self, *, backend: str, device: str | None, compile: str | None) -> None:
        """Another backend, device or compile mode (before the first call)."""
        if self._runs:
            raise EdlError("a generator is configured before its first call")
        checked = request(self._base.program, self._base.weights, (0,), 1, self._base.decode, backend=backend)
        self._base = replace(self._base, backend=checked.backend, device=device, compile=compile)

    def __call__(self, prompt_ids: Sequence[int], max_new: int = 16) -> Generation:
        b = self._base
        req = request(
            b.program, b.weights, prompt_ids, max_new, b.decode, b.dims, b.consts, b.dtype, b.backend, b.device
        )
        req = replace(req, compile=b.compile)
        key = (prompt_positions(req), cache_positions(len(req.prompt) + req.max_new))
        if key not in self._runs:
            progs = programs(req)
            prefill = progs.prefill.executable(None, backend=req.backend, device=req.device, compile=req.compile)
            step = progs.decode.executable(None, backend=req.backend, device=req.device, compile=req.compile)
            if req.backend == "torch":
                # One device: both programs take their params whole, so one copy of the weights
                # serves both, and every bucket (the executables keep the very tensors given).
                if self._weights is None:
                    self._weights = _read_weights(progs, req.weights, step)
                prefill.load(self._weights)
                step.load(self._weights)
            else:
                prefill.load(req.weights)
                step.load(req.weights)
            self._runs[key] = (progs, prefill, step)
        progs, prefill, step = self._runs[key]
        if req.backend == "torch":
            return decode_loop_torch(req, progs, prefill, step)
        return decode_loop(req, progs, lambda v: _numpy(prefill(v)), lambda v: _numpy(step(v)))


def _generate(req: Request, device: Any = None) -> Generation:
    """One generation with plan files (or on a rank of an SPMD job, planned for it)."""
    from edatalog.plans import load_plan

    progs = programs(req)
    prefill_plan = load_plan(req.prefill_plan, progs.prefill) if req.prefill_plan else None
    decode_plan = load_plan(req.decode_plan, progs.decode) if req.decode_plan else None
    if req.backend == "reference" and prefill_plan is not None:
        raise EdlError("plans run on the torch backend", help="use --backend torch with --plan")
    where = device if device is not None else req.device
    prefill = progs.prefill.executable(prefill_plan, backend=req.backend, device=where, compile=req.compile)
    step = progs.decode.executable(decode_plan, backend=req.backend, device=where, compile=req.compile)
    prefill.load(req.weights)  # each rank reads only its slices
    step.load(req.weights)
    if req.backend == "torch":
        return decode_loop_torch(req, progs, prefill, step)
    return decode_loop(req, progs, lambda v: _numpy(prefill(v)), lambda v: _numpy(step(v)))


def _read_weights(progs: Programs, weights: str, step: Any) -> dict[str, Any]:
    """Every param of both programs from the checkpoint, once, as torch tensors on the device
    the decode step computes on."""
    from edatalog.backend.kernels.arrays import TorchOps
    from edatalog.checkpoint import Checkpoint

    ckpt = Checkpoint(weights)
    names = {**ckpt.names_for(progs.prefill.graph), **ckpt.names_for(progs.decode.graph)}
    target = step.device
    xp = TorchOps(target)
    decode_relations = {r.name for r in progs.decode.graph.relations}
    out = {}
    for rel, name in names.items():
        graph = progs.decode.graph if rel in decode_relations else progs.prefill.graph
        out[rel] = xp.asarray(ckpt.read(name), xp.dtype(graph.relation(rel).dtype), target).contiguous()
    return out


def _padded(req: Request, positions: int) -> list[int]:
    """The prompt padded at its end (with token 0) to the prefill's positions."""
    return [*req.prompt, *([0] * (positions - len(req.prompt)))]


def decode_loop(
    req: Request,
    progs: Programs,
    prefill: Callable[[dict[str, Any]], dict[str, np.ndarray]],
    step: Callable[[dict[str, Any]], dict[str, np.ndarray]],
) -> Generation:
    """Prefill, then greedy steps, on numpy: ``prefill`` and ``step`` run the two programs."""
    n, t = len(req.prompt), cache_positions(len(req.prompt) + req.max_new, req.buckets)
    begin = time.perf_counter()
    out = prefill({"ids": np.asarray([_padded(req, prompt_positions(req))], dtype=np.int64)})
    caches = {}
    for rel, cache, _ in progs.caches:
        entries = out[rel]
        shape = (entries.shape[0], t, *entries.shape[2:])
        buf = np.zeros(shape, dtype=entries.dtype)
        buf[:, :n] = entries[:, :n]
        caches[cache] = buf
    token = int(np.argmax(out["logits"][0, n - 1]))
    ids = [token]
    prefilled = time.perf_counter()
    for pos in range(n, n + req.max_new - 1):
        out = step({"ids": np.asarray([token], dtype=np.int64), "pos": np.asarray(pos, dtype=np.int64), **caches})
        for _, cache, new in progs.caches:
            caches[cache][:, pos] = out[new]
        token = int(np.argmax(out["logits"][0]))
        ids.append(token)
    done = time.perf_counter()
    return Generation(ids, prefilled - begin, done - prefilled)


def decode_loop_torch(req: Request, progs: Programs, prefill: Any, step: Any) -> Generation:
    """Prefill, then greedy steps, with every tensor on the device: the caches are allocated
    once (``T`` positions, :func:`cache_positions`) and written in place, one row per step; the
    decode step has one input signature, so it is compiled once and replayed for every later
    token.  The host only reads the next id."""
    import torch

    n, t = len(req.prompt), cache_positions(len(req.prompt) + req.max_new, req.buckets)
    begin = time.perf_counter()
    out = prefill({"ids": torch.tensor([_padded(req, prompt_positions(req))], dtype=torch.int64)})
    caches = {}
    for rel, cache, _ in progs.caches:
        entries = out[rel]
        buf = torch.zeros((entries.shape[0], t, *entries.shape[2:]), dtype=entries.dtype, device=entries.device)
        buf[:, :n] = entries[:, :n]
        caches[cache] = buf
    token = int(torch.argmax(out["logits"][0, n - 1]))
    ids = [token]
    prefilled = time.perf_counter()
    for pos in range(n, n + req.max_new - 1):
        inputs = {"ids": torch.tensor([token], dtype=torch.int64), "pos": torch.tensor(pos, dtype=torch.int64)}
        out = step({**inputs, **caches})
        for _, cache, new in progs.caches:
            caches[cache][:, pos] = out[new]
        token = int(torch.argmax(out["logits"][0]))
        ids.append(token)
    done = time.perf_counter()
    return Generation(ids, prefilled - begin, done - prefilled)


def _numpy(values: Mapping[str, Any]) -> dict[str, np.ndarray]:
    from edatalog.backend.kernels.arrays import TORCH

    out = {}
    for k, v in values.items():
        out[k] = TORCH.to_numpy(v) if not isinstance(v, np.ndarray) else v
    return out


def _planned(req: Request, nproc: int, topology: str, time_limit: float, tmp: Path) -> Request:
    """``req`` with both programs planned for ``nproc`` devices, unless it has plans."""
    from edatalog.plans import make_plan

    if req.prefill_plan is not None:
        return req
    progs = programs(req)
    paths = []
    for name, prog in (("prefill", progs.prefill), ("decode", progs.decode)):
        plan = make_plan(prog, topology=topology, time_limit=time_limit)
        if plan.ir.n_devices != nproc:
            raise EdlError(f"the topology {topology} has {plan.ir.n_devices} devices, not {nproc}")
        path = tmp / f"{name}.plan.json"
        plan.save(path)
        paths.append(str(path))
    return replace(req, prefill_plan=paths[0], decode_plan=paths[1])


def _rank(req: Request) -> Generation:
    """One rank of a generation job: its devices' programs, the same tokens as every rank."""
    import torch

    from edatalog.backend.running.spmd import init_group

    torch.set_num_threads(1)  # ranks share this machine's cores
    device = init_group(req.device)
    return _generate(req, device=device)
