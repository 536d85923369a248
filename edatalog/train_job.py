"""``edl train``'s job: a model program trained on a token file from a checkpoint, in one process
or on ``nproc`` ranks, saved and resumed.

- The loss is the mean cross-entropy of the program's ``logits[B, S, V]`` for the inputs
  ``ids[B, S]`` against ``labels[B, S]`` (the next tokens), over all B x S positions: four rules
  appended to the program (:data:`CROSS_ENTROPY`).
- Data is a flat array of token ids: ``.npy`` (any integer dtype), or a raw ``.bin`` as nanoGPT
  writes it (uint16 when the vocabulary fits, else uint32).  Each sequence is a window of S + 1
  tokens (S inputs, the next S as labels); step ``k``'s B windows start at places drawn from
  ``(seed, k)`` alone, so a resumed run sees what an uninterrupted one would.
- ``save`` writes a directory transformers' ``from_pretrained`` reads (``config.json`` copied
  from the weights', ``model.safetensors`` with the params by their checkpoint names, a stacked
  param as the tensors it was read from) and
  ``optimizer.safetensors`` (the optimizer's state and the step count); ``resume`` continues
  from one.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edatalog.api import Program, compile_string
from edatalog.checkpoint import Checkpoint, configured, unstacked
from edatalog.errors import EdlError
from edatalog.lang.parser import parse_file
from edatalog.plans import Plan
from edatalog.rules.optim import AdamW, Optimizer
from edatalog.training import Trainer

CROSS_ENTROPY = """
# edl train's loss: the mean cross-entropy of the logits against the next tokens.
input labels[B, S] : i64.
ce_max[b, s] max= logits[b, s, w].
ce_sum[b, s] += exp(logits[b, s, w] - ce_max[b, s]).
ce_label[b, s] += logits[b, s, w] where labels[b, s] = w.
loss[] += (log(ce_sum[b, s]) + ce_max[b, s] - ce_label[b, s]) / (B * S).
"""
OPTIMIZER_FILE = "optimizer.safetensors"
MODEL_FILE = "model.safetensors"


@dataclass(frozen=True)
class Request:
    """Everything a training job needs, picklable (it goes to every rank)."""

    file: str
    weights: str
    data: str
    steps: int
    batch: int
    seq: int
    optimizer: Optimizer = field(default_factory=AdamW)
    clip: float = 0.0
    dtype: str | None = None
    seed: int = 0
    dims: dict[str, int] = field(default_factory=dict)
    consts: dict[str, float] = field(default_factory=dict)
    backend: str = "torch"
    plan: str | None = None  # a plan file of the step program
    recompute: bool = False  # the backward makes each layer's activations again (memory)
    save: str | None = None
    resume: str | None = None


@dataclass(frozen=True)
class Record:
    """One step, as ``--json`` prints it."""

    step: int
    loss: float
    ms: float  # measured wall time of the step
    predicted_ms: float | None  # the plan's timeline, when there is a plan
    peak_bytes: int | None  # measured: the busiest device's most bytes held (None on the reference)


def loss_program(req: Request) -> Program:
    """The model program with :data:`CROSS_ENTROPY` appended, its dims and consts from the
    checkpoint's ``config.json`` (and ``req.dims``), its sequence and batch the request's."""
    source = Path(req.file)
    if not source.is_file():
        raise EdlError(f"no such program file: {req.file}")
    weights = req.resume or req.weights
    dims, consts = configured(parse_file(str(source)), weights)
    dims = {**dims, **req.dims, "S": req.seq, "B": req.batch}
    prog = compile_string(
        source.read_text(encoding="utf-8") + CROSS_ENTROPY,
        name=str(source),
        dims=dims,
        consts={**consts, **req.consts},
        dtype=req.dtype,
        outputs=["loss"],
    )
    rels = {r.name: r for r in prog.graph.relations}
    if "ids" not in rels or rels["ids"].kind != "input":
        raise EdlError(f"{req.file} has no input ids[B, S]: edl train feeds token ids to it")
    return prog


def check_data(req: Request) -> Path:
    """The data file's path, which must exist (checked before any work: planning takes a while)."""
    path = Path(req.data)
    if not path.is_file():
        raise EdlError(f"no such data file: {req.data}", help="give a .npy of token ids or a nanoGPT .bin")
    return path


def tokens(req: Request, vocab: int) -> np.ndarray:
    """The data file's token ids, checked against the vocabulary and the sequence length."""
    path = check_data(req)
    if path.suffix == ".npy":
        try:
            data = np.load(path, allow_pickle=False)
        except ValueError as exc:
            raise EdlError(f"{req.data} is not a .npy array of token ids: {exc}") from None
    elif path.suffix == ".bin":
        data = np.fromfile(path, dtype=np.uint16 if vocab <= 1 << 16 else np.uint32)
    else:
        raise EdlError(
            f"unsupported data file {req.data}", help="give token ids as .npy, or a raw .bin as nanoGPT writes"
        )
    if data.dtype.kind not in "iu":
        raise EdlError(f"{req.data} holds {data.dtype} values, not token ids", help="save integer token ids")
    data = data.reshape(-1).astype(np.int64)
    if len(data) < req.seq + 1:
        raise EdlError(
            f"{req.data} has {len(data)} tokens: a sequence needs {req.seq + 1} (--seq {req.seq} inputs and the next)",
            help="give more tokens or a shorter --seq",
        )
    bad = np.flatnonzero((data < 0) | (data >= vocab))
    if bad.size:
        raise EdlError(
            f"token {int(data[bad[0]])} at position {int(bad[0])} of {req.data} is outside the vocabulary "
            f"(V = {vocab}); {bad.size} token{'s are' if bad.size > 1 else ' is'} out of range",
            help="tokenize with the model's own vocabulary",
        )
    return data


def batch(data: np.ndarray, req: Request, step: int) -> dict[str, np.ndarray]:
    """Step ``step``'s ids and labels: ``req.batch`` windows whose starts depend on the seed and
    the step alone."""
    rng = np.random.default_rng([req.seed, step])
    starts = rng.integers(0, len(data) - req.seq, size=req.batch)  # a file of S + 1 tokens: start 0
    windows = np.stack([data[s : s + req.seq + 1] for s in starts])
    return {"ids": windows[:, :-1], "labels": windows[:, 1:]}


def run(req: Request, on_step: Callable[[Record], None] | None = None, device: Any = None) -> list[Record]:
    """The job in this process (one rank of it inside a torch.distributed group)."""
    check_resume(req)
    prog = loss_program(req)
    vocab = _vocab(prog)
    data = tokens(req, vocab)
    plan = None
    if req.plan is not None:
        req, plan = _planned(req, prog)
    trainer = Trainer(
        prog,
        optimizer=req.optimizer,
        clip=req.clip,
        backend=req.backend,
        plan=plan,
        device=None if device is None else str(device),
        recompute=req.recompute,
    )
    start = _load(trainer, req, prog)
    predicted = plan.report.seconds * 1e3 if plan is not None else None
    records = []
    for k in range(start, start + req.steps):
        began = time.perf_counter()
        loss = trainer.step(batch(data, req, k))
        ms = (time.perf_counter() - began) * 1e3
        peak = trainer.last_peak
        rec = Record(k + 1, loss, ms, predicted, max(peak.values()) if peak else None)
        records.append(rec)
        if on_step is not None:
            on_step(rec)
    if req.save is not None:
        save(trainer, req)
    return records


def check_resume(req: Request) -> None:
    """A directory to resume from holds the optimizer's state (before any work is done)."""
    if req.resume is not None and not (Path(req.resume) / OPTIMIZER_FILE).is_file():
        raise EdlError(
            f"{req.resume} has no optimizer state ({OPTIMIZER_FILE}): it is a model, not a training checkpoint",
            help="resume from a directory that edl train --save wrote, or start from it with --weights",
        )


def _vocab(prog: Program) -> int:
    logits = prog.graph.relation("logits") if "logits" in {r.name for r in prog.graph.relations} else None
    if logits is None or logits.rank != 3:
        raise EdlError(f"{prog.name} has no logits[B, S, V]: edl train's loss reads them")
    return logits.shape[2]


def _load(trainer: Trainer, req: Request, prog: Program) -> int:
    """Params from the weights (or the resumed directory), and the optimizer's state from a
    resumed directory; returns the steps already taken.  A half-typed program trains f32
    master weights: they load from an f32 checkpoint as they are, or from one in the
    program's own type (``prog``'s), widened."""
    source = req.resume or req.weights
    try:
        params = trainer.program.load_checkpoint(source)
    except EdlError:
        if prog.graph.fingerprint() == trainer.program.graph.fingerprint() or not _halves(prog):
            raise
        params = prog.load_checkpoint(source)
    if req.resume is None:
        trainer.load(params)
        return 0
    path = Path(req.resume) / OPTIMIZER_FILE
    from safetensors import safe_open

    state = {}
    with safe_open(str(path), framework="np") as fh:
        meta = fh.metadata() or {}
        stored = set(fh.keys())
        for name, _ in trainer.names.state:
            if name not in stored:
                raise EdlError(f"{path} lacks the optimizer state '{name}'", help="resume with the same --optimizer")
            state[name] = fh.get_tensor(name)
    steps = int(meta.get("step", "0"))
    trainer.load(params, state, steps)
    return steps


def _halves(prog: Program) -> bool:
    return any(r.kind == "param" and r.dtype in ("bf16", "f16") for r in prog.graph.relations)


def save(trainer: Trainer, req: Request) -> None:
    """Write ``req.save``: config.json, the params by their checkpoint names, the optimizer's
    state.  Every rank gathers them (their shards travel between ranks); rank 0 writes."""
    from safetensors.numpy import save_file

    params, state = trainer.params, trainer.state
    if not _is_rank_zero():
        return
    out = Path(req.save or "")
    out.mkdir(parents=True, exist_ok=True)
    source = Path(req.resume or req.weights)
    config = source / "config.json" if source.is_dir() else source.with_name("config.json")
    if config.is_file() and config.resolve() != (out / "config.json").resolve():
        shutil.copyfile(config, out / "config.json")
    names = Checkpoint(source).names_for(trainer.program.graph)
    # A stacked param (Mixtral's experts.{e}) goes back as the tensors it was read from.
    tensors = {
        k: np.ascontiguousarray(t)
        for p, v in params.items()
        if p in names
        for k, t in unstacked(names[p], _numpy(v)).items()
    }
    with tempfile.TemporaryDirectory(dir=out) as tmp:  # written whole, then moved: never half a file
        save_file(tensors, str(Path(tmp) / MODEL_FILE), metadata={"format": "pt"})
        meta = {"step": str(trainer.steps), "optimizer": json.dumps(dataclasses.asdict(req.optimizer))}
        save_file({k: _numpy(v) for k, v in state.items()}, str(Path(tmp) / OPTIMIZER_FILE), metadata=meta)
        for name in (MODEL_FILE, OPTIMIZER_FILE):
            (Path(tmp) / name).replace(out / name)


def _numpy(value: Any) -> np.ndarray:
    arr = value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)
    return np.ascontiguousarray(arr)


def _is_rank_zero() -> bool:
    import os

    return os.environ.get("RANK", "0") == "0"


def _planned(req: Request, prog: Program) -> tuple[Request, Plan]:
    """The request's plan file, loaded for its step program: the one the request says, or the
    same step recomputing activations (a plan solved under a tight --memory may be of that)."""
    from edatalog.plans import load_plan
    from edatalog.training import step_program

    assert req.plan is not None
    try:
        step, _ = step_program(prog, optimizer=req.optimizer, clip=req.clip, recompute=req.recompute)
        return req, load_plan(req.plan, step)
    except EdlError as exc:
        other, _ = step_program(prog, optimizer=req.optimizer, clip=req.clip, recompute=not req.recompute)
        try:
            return dataclasses.replace(req, recompute=not req.recompute), load_plan(req.plan, other)
        except EdlError:
            raise exc from None


def solved_plan(
    req: Request, nproc: int, topology: str, memory: str | None, time_limit: float, path: Path
) -> tuple[Request, str]:
    """The step program's plan for ``nproc`` devices, solved and saved at ``path``; the request
    to run it (its ``plan`` that file), and a line saying what it is (its strategy, predicted
    step time, and why a baseline was kept).  When no plan of the step fits ``memory``, the
    step that recomputes each layer's activations in the backward is planned instead."""
    from edatalog.plans import make_plan
    from edatalog.training import step_program

    prog = loss_program(req)
    try:
        step_prog, _ = step_program(prog, optimizer=req.optimizer, clip=req.clip, recompute=req.recompute)
        plan = make_plan(step_prog, topology=topology, memory=memory, time_limit=time_limit)
    except EdlError as exc:
        if memory is None or req.recompute or not any(r.count > 1 for r in prog.graph.repeats):
            raise
        req = dataclasses.replace(req, recompute=True)
        step_prog, _ = step_program(prog, optimizer=req.optimizer, clip=req.clip, recompute=True)
        try:
            plan = make_plan(step_prog, topology=topology, memory=memory, time_limit=time_limit)
        except EdlError:
            raise exc from None
    if plan.ir.n_devices != nproc:
        raise EdlError(f"the topology {topology} has {plan.ir.n_devices} devices, not {nproc}")
    plan.save(path)
    what = f"the step's plan on {plan.topology.name}: {plan.ir.strategy}, predicted {plan.report.seconds * 1e3:.4g} ms"
    if req.recompute:
        what += ", activations recomputed in the backward (nothing fits the memory without)"
    return dataclasses.replace(req, plan=str(path)), what + (f" ({plan.picked})" if plan.picked else "")


def rank_job(req: Request, on_step: Callable[[Record], None] | None = None) -> list[Record]:
    """One rank of a training job: its devices' part of every step, the same losses as every
    rank (``on_step`` as :func:`run`'s)."""
    import torch

    from edatalog.backend.running.spmd import init_group

    torch.set_num_threads(1)  # ranks share this machine's cores
    return run(req, on_step, device=init_group(None))
