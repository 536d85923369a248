"""``edl run --backend torch``: a program (or a plan) run for real with torch, timed.

Without ``--nproc`` the plan's devices are logical devices of this process (``--device``).
With ``--nproc N`` edl starts N processes itself (torch's elastic launcher) and rank ``r`` runs
device ``r``'s program; under ``torchrun --nproc-per-node N -m edatalog.cli run ...`` this
process is one of the ranks.  Each call starts as the ranks leave a barrier together (through
shared memory where they share it: :func:`edatalog.backend.running.spmd.timed_calls`) and is
timed on the slowest rank;
the median of ``--repeat`` calls is printed beside the plan's predicted time, with each rank's
own median.  ``--trace`` writes the measured run as Chrome trace JSON, laid out like the
predicted trace of ``edl plan --trace`` (one process per device), so the two read side by side.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import edatalog
from edatalog.backend.kernels.arrays import TorchOps
from edatalog.backend.lowering.lowered import Collectives, Lowered, Options
from edatalog.backend.running.launch import as_rank, in_spmd_job, spawn
from edatalog.backend.running.torch_runtime import OpTime, Outputs
from edatalog.errors import EdlError


@dataclass(frozen=True)
class Job:
    """What every rank needs to run the same thing (picklable: it crosses into new processes)."""

    file: str
    dims: dict[str, int]
    consts: dict[str, float]
    dtype: str | None
    plan: str | None
    inputs: str | None
    random: int | None
    device: str | None
    repeat: int
    warmup: int
    record: bool
    collectives: str = "auto"
    compile: str = "auto"
    weights: str | None = None  # a checkpoint: params by their declared checkpoint names
    lowered: str | None = None  # the plan lowered, as JSON: made once, by the launcher or by rank 0


@dataclass
class Result:
    """What rank 0 reports: the outputs (whole, numpy), each call's time (slowest rank), each
    rank's own median, the measured op times of the last call (with ``record``), and the most
    bytes each device held in a timed call."""

    outputs: dict[str, np.ndarray]
    absent: dict[str, int]
    calls_ms: list[float]
    per_rank_ms: list[float]
    op_times: list[OpTime] = field(default_factory=list)
    peak_bytes: dict[int, int] = field(default_factory=dict)


def run(job: Job, nproc: int | None) -> Result:
    """Run ``job`` here (no plan, logical devices, or a rank of torchrun's job) or on ``nproc``
    new processes; the result as rank 0 sees it."""
    if nproc is not None:
        if job.plan is None:
            raise EdlError("--nproc runs a plan, one device per process", help="pass --plan plan.json")
        _, plan = _program_and_plan(job)
        lowered = plan.lowering(Options(Collectives(job.collectives))).to_json()
        results = spawn(nproc, rank_main, (dataclasses.replace(job, lowered=lowered),))
        return results[0]
    if in_spmd_job():
        return as_rank(rank_main, job)
    return _in_process(job)


def _program_and_plan(job: Job) -> tuple[Any, Any]:
    prog = edatalog.compile(job.file, dims=job.dims, consts=job.consts, dtype=job.dtype)
    plan = edatalog.load_plan(job.plan, prog) if job.plan is not None else None
    return prog, plan


def _values(job: Job, prog: Any) -> dict[str, Any]:
    from edatalog.cli.common import load_program_inputs

    values: dict[str, Any] = prog.load_checkpoint(job.weights) if job.weights is not None else {}
    values |= load_program_inputs(job.inputs, prog) if job.inputs is not None else {}
    missing = {r.name for r in prog.arguments if r.name not in values}
    if missing and job.random is None:
        raise EdlError(
            f"no values for {', '.join(sorted(missing))}",
            help="pass --random SEED, --inputs FILE or --weights CHECKPOINT",
        )
    if missing:
        values.update(prog.random_inputs(job.random, names=missing))  # the same on every rank: seeded
    return values


def _split(prog: Any, values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    params = {r.name for r in prog.arguments if r.kind == "param"}
    return {k: v for k, v in values.items() if k in params}, {k: v for k, v in values.items() if k not in params}


def _in_process(job: Job) -> Result:
    prog, plan = _program_and_plan(job)
    params, inputs = _split(prog, _values(job, prog))
    exe = prog.executable(plan, backend="torch", device=job.device, collectives=job.collectives, compile=job.compile)
    exe.load(params)
    inputs = _on_device(prog, inputs, exe.device)
    for _ in range(job.warmup):
        exe(inputs)
    calls = []
    out = None
    for k in range(job.repeat):
        start = time.perf_counter()
        out = exe.run(inputs, record=job.record and k == job.repeat - 1)
        _synchronize(out.values)
        calls.append((time.perf_counter() - start) * 1e3)
    assert out is not None
    outputs, absent = _numpy_outputs(out)
    return Result(outputs, absent, calls, [statistics.median(calls)], list(exe.last_times), exe.peak_memory())


def _on_device(prog: Any, inputs: dict[str, Any], device: Any) -> dict[str, Any]:
    """The inputs as torch tensors on the executable's device, once, as a caller keeping them
    there has them: the timed calls are the program's, not a conversion from numpy or a
    host-to-GPU copy of its inputs every call (about 40 µs a call of a tiny GPT-2 on a rank)."""
    checked = prog.prepare(inputs, kinds=("input",))  # names, shapes and dtypes first, as a call checks them
    return {k: TorchOps().asarray(v).to(device) for k, v in checked.items()}


def rank_main(job: Job) -> Result:
    """One rank: join the group, run the job's plan, time each call from a common start."""
    import torch

    from edatalog.backend.running.spmd import init_group, timed_calls

    torch.set_num_threads(1)  # one thread per rank: ranks share this machine's cores
    device = init_group(job.device)
    dist = torch.distributed
    prog = edatalog.compile(job.file, dims=job.dims, consts=job.consts, dtype=job.dtype)
    if job.plan is None:
        raise EdlError("a torch.distributed job runs a plan, one device per rank", help="pass --plan plan.json")
    lowered = _lowered(job, prog, dist)
    n, world = lowered.n_devices, dist.get_world_size()
    if n != world:  # else each rank would run every device's program by itself, and nothing would be split
        raise EdlError(
            f"the plan has {n} devices, but this job has {world} ranks",
            help=f"start {n} ranks (edl run --nproc {n}, or torchrun --nproc-per-node {n}): "
            "rank r runs device r's program",
        )
    params, inputs = _split(prog, _values(job, prog))
    exe = prog.executable(lowered, backend="torch", device=device, compile=job.compile)
    exe.load(params)
    inputs = _on_device(prog, inputs, exe.device)
    for _ in range(job.warmup):
        exe(inputs, gather=False)
    made = [0]

    def call() -> None:
        made[0] += 1
        exe(inputs, gather=False, record=job.record and made[0] == job.repeat)

    sync = (lambda: torch.cuda.synchronize(device)) if device.startswith("cuda") else (lambda: None)
    own, slowest = timed_calls(call, job.repeat, sync=sync, device=device)
    mine, calls = [t * 1e3 for t in own], [t * 1e3 for t in slowest]
    times = list(exe.last_times)
    peak = exe.peak_memory()  # of a timed call: the gathered one below holds every output whole
    out = exe.run(inputs)  # once more, gathered: every rank gets the outputs whole
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, statistics.median(mine))
    all_times: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(all_times, times)
    peaks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)
    outputs, absent = _numpy_outputs(out)
    flat = [t for ts in all_times for t in ts]
    return Result(
        outputs, absent, calls, [float(t) for t in per_rank], flat, {d: b for p in peaks for d, b in p.items()}
    )


def _lowered(job: Job, prog: Any, dist: Any) -> Lowered:
    """The plan lowered once for every rank: by the launcher (``job.lowered``), or under
    torchrun by rank 0, which sends it to the others; no rank synthesizes it again."""
    text = job.lowered
    if text is None:
        assert job.plan is not None
        box: list[Any] = [None]
        if dist.get_rank() == 0:
            plan = edatalog.load_plan(job.plan, prog)
            box[0] = plan.lowering(Options(Collectives(job.collectives))).to_json()
        dist.broadcast_object_list(box, src=0)
        text = box[0]
    lowered = Lowered.from_json(text)
    if lowered.graph.fingerprint() != prog.graph.fingerprint():
        raise EdlError(
            "this rank compiled another program than the one the plan was lowered for",
            help="give every rank the same .edl file, dims, consts and dtype",
        )
    return lowered


def _synchronize(out: dict[str, Any]) -> None:
    import torch

    if any(getattr(v, "is_cuda", False) for v in out.values()):
        torch.cuda.synchronize()


def _numpy_outputs(out: Outputs) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    from edatalog.backend.kernels.arrays import TORCH

    arrays = {k: TORCH.to_numpy(v) for k, v in out.values.items()}
    absent = {k: 0 if p is None else int((~TORCH.to_numpy(p)).sum()) for k, p in out.present.items()}
    return arrays, absent


def trace(path: str, result: Result, predicted_ms: float | None) -> None:
    """The measured run as Chrome trace JSON: one process per device, its ops on one lane."""
    events: list[dict[str, Any]] = []
    for d in sorted({d for d, _, _, _ in result.op_times}):
        events.append({"name": "process_name", "ph": "M", "pid": d, "args": {"name": f"device {d} (measured)"}})
    for d, name, start, end in result.op_times:
        span = {"ts": start * 1e6, "dur": (end - start) * 1e6}
        events.append({"name": name, "cat": "measured", "ph": "X", "pid": d, "tid": 0, **span})
    other = {"measured_ms": result.calls_ms[-1] if result.calls_ms else None, "predicted_ms": predicted_ms}
    try:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}, fh)
    except OSError as exc:  # a directory of that name, no room, no right to write
        raise EdlError(f"cannot write {path}: {exc.strerror or exc}", help="give --trace a file path") from None
