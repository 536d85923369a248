"""Measured runtime of one tensor-parallel LLaMA block on CPU ranks: hand-written baselines and edatalog.

The script starts itself on ``--nproc`` ranks (default 2; one process each, gloo, ``--threads``
threads each, default 1) and times, in one run, one LLaMA-shaped decoder block (default D=1024,
H=16, KVH=16, F=2816, S=512, B=1, f32; ``eps`` and ``theta`` from ``programs/llama_block.edl``)
run by each contender:

  megatron           hand-written Megatron tensor parallelism in plain torch: each rank holds its
                     heads (column-parallel q/k/v, fused; row-parallel o) and its slice of F
                     (column-parallel gate/up, fused; row-parallel down); RMSNorm replicated;
                     RoPE; causal scaled_dot_product_attention; two all_reduce per block
  dtensor            transformers' LlamaDecoderLayer (SDPA attention) under
                     torch.distributed.tensor.parallel.parallelize_module: q/k/v/gate/up
                     ColwiseParallel, o/down RowwiseParallel
  edatalog-megatron  edatalog's Megatron plan of programs/llama_block.edl, run by edatalog's torch
  edatalog-auto      runtime (edatalog.executable); the auto plan is solved on rank 0 and shared.
  edatalog-replicate (the replicate plan computes everything on rank 0: far slower, and predicted
                     so, it checks that the predictions order plans as the clock does.)
                     Their "predicted ms" is the plan's own prediction on --topology (best
                     from `edl calibrate --nproc 2 -o machine.toml` on this machine).  Exchanges
                     run as the runtime's default on gloo: all-reduces through
                     shared memory, the rest as point-to-point messages.

Every contender runs the same weights (made once from --seed, broadcast from rank 0) on the same
input, and must first reproduce the single-process transformers LlamaDecoderLayer (eager
attention, explicit causal mask, the same rotary embeddings) on every rank: the largest error,
over all ranks and elements, relative to the largest |reference|, at most --tol.  A contender that
fails is not timed, and the script exits 1.

The ranks' torch programs, the baselines' included, run their large f32 GEMMs on oneDNN, as
edatalog's runtime runs its own (--baseline-gemms onednn, the default: a baseline gets every trick
edatalog gets; benchmarks/onednn_gemms.py); --baseline-gemms aten leaves torch's kernels (MKL's
sgemm, 2.0-2.3x slower on this project's AMD EPYC) as they ship.

Likewise the baselines' all-reduces (the hand-written block's two, DTensor's row-parallel ones) go
through shared memory between the ranks, as edatalog's runtime runs its own
(--baseline-all-reduce shared-memory, the default; benchmarks/shm_collectives.py);
--baseline-all-reduce gloo leaves gloo's all_reduce (1.2-2.7 ms for the block's 2 MiB in this
project's runs, against 0.15-0.17 through shared memory).

Timing: --warmup calls of each contender, then --repeat rounds; each round calls every contender
once, in turn (so that drift in the machine's load hits all of them alike).  Before each call all
ranks meet at a barrier (through shared memory where they share it, as ``edl run``'s calls meet:
they leave it together and awake); a call's time is the slowest rank's.  The table shows, per contender, the
median, min and max of those times over the rounds, and each rank's own median.

  .venv/bin/python benchmarks/runtime_cpu.py                                  # the full block
  .venv/bin/python benchmarks/runtime_cpu.py --dims D=256,F=704,S=128 --repeat 5   # a quick run
  .venv/bin/python benchmarks/runtime_cpu.py --dims KVH=4                     # grouped-query attention
  .venv/bin/python benchmarks/runtime_cpu.py --contenders megatron,dtensor --json > runtime.json
  torchrun --nproc-per-node 2 benchmarks/runtime_cpu.py                       # also works

Times are measured on this machine, so close everything else first: other processes on the same
cores move these numbers by tens of per cent.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # also when loaded by path (tests/edatalog/test_docs.py)
    sys.path.insert(0, str(HERE))

import llama_weights  # noqa: E402
import onednn_gemms  # noqa: E402
import shm_collectives  # noqa: E402
from llama_weights import PROGRAM, BlockDims  # noqa: E402

ROOT = HERE.parent
BASELINES = ("megatron", "dtensor")
EDATALOG = ("edatalog-megatron", "edatalog-auto", "edatalog-replicate")
CONTENDERS = (*BASELINES, *EDATALOG)
INIT_ENV = "EDL_RUNTIME_CPU_INIT"  # the launcher's rendezvous (a file:// URL) for its workers
EXIT_CHECK_FAILED = 1


# -- arguments ------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="runtime_cpu.py",
        description=(
            "Time one tensor-parallel LLaMA decoder block on CPU ranks (gloo): hand-written Megatron "
            "in plain torch, DTensor on transformers' LlamaDecoderLayer, and edatalog's megatron and auto "
            "plans (once edatalog.executable exists), all on the same weights, each checked against the "
            "single-process transformers layer before it is timed."
        ),
        epilog=(
            "examples:\n"
            "  .venv/bin/python benchmarks/runtime_cpu.py\n"
            "  .venv/bin/python benchmarks/runtime_cpu.py --dims D=256,F=704,S=128 --repeat 5\n"
            "  .venv/bin/python benchmarks/runtime_cpu.py --dims KVH=4 --contenders megatron,dtensor --json\n"
            "\n"
            "A call's time is the slowest rank's (all ranks leave a barrier, then call); 'measured ms' is\n"
            "the median over the --repeat rounds.  Exit status: 0 when every timed contender matched the\n"
            "reference, 1 when one did not, 2 on bad arguments."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nproc", type=int, default=2, help="ranks (processes) to start (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument(
        "--dims",
        default="",
        metavar="NAME=V,...",
        help=f"override the block's dims, named as in the program (default: {BlockDims()}); "
        "e.g. D=256,F=704,S=128 for a quick run, KVH=4 for grouped-query attention",
    )
    p.add_argument("--repeat", type=int, default=20, help="timed rounds (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls of each contender first (default 3)")
    p.add_argument(
        "--contenders",
        default=",".join(CONTENDERS),
        metavar="NAME,...",
        help=f"which to run, comma-separated (default: all of {', '.join(CONTENDERS)})",
    )
    p.add_argument(
        "--topology",
        default=None,
        help="the machine edatalog plans for and predicts on: a preset or a .toml/.json machine file "
        "(the calibrated CPU machine); default cpuxN for N ranks",
    )
    p.add_argument("--time-limit", type=float, default=10.0, help="seconds for the auto plan (default 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the input (default 0)")
    p.add_argument(
        "--tol",
        type=float,
        default=1e-4,
        help="largest error allowed against the reference, relative to its largest |value| (default 1e-4)",
    )
    p.add_argument(
        "--timeout", type=float, default=900.0, help="seconds before a stuck rank is given up on (default 900)"
    )
    p.add_argument(
        "--baseline-gemms",
        choices=("onednn", "aten"),
        default="onednn",
        help="the f32 GEMMs of every torch program in the ranks, baselines included: 'onednn' (default) "
        "routes ATen's large ones to oneDNN as edatalog's runtime runs its own (benchmarks/onednn_gemms.py); "
        "'aten' leaves torch's kernels (MKL) as they ship",
    )
    p.add_argument(
        "--baseline-all-reduce",
        choices=("shared-memory", "gloo"),
        default="shared-memory",
        help="the baselines' all-reduces: 'shared-memory' (default) runs the hand-written block's and "
        "DTensor's through shared memory as edatalog's runtime runs its own (benchmarks/shm_collectives.py); "
        "'gloo' leaves gloo's all_reduce",
    )
    p.add_argument("--json", action="store_true", help="print every number as JSON instead of a table")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # set by the launcher
    args = p.parse_args(argv)

    try:
        args.block = BlockDims().with_text(args.dims)
    except ValueError as exc:
        p.error(str(exc))
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown or not names:
        p.error(f"unknown contender(s) {', '.join(unknown) or '(none given)'}: choose from {', '.join(CONTENDERS)}")
    args.names = [n for n in CONTENDERS if n in names]
    for flag in ("nproc", "threads", "repeat"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be at least 1")
    if args.warmup < 0:
        p.error("--warmup must be at least 0")
    world = int(os.environ["WORLD_SIZE"]) if _under_launcher() else args.nproc
    problems = args.block.problems(world)
    if problems:
        p.error(f"dims {args.block} cannot run on {world} ranks: " + "; ".join(problems))
    if args.topology is None:
        args.topology = f"cpux{world}"
    return args


def _under_launcher() -> bool:
    """Started as one rank: by this script's launcher, or by torchrun."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


# -- the launcher ---------------------------------------------------------------------------------


def launch(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Start ``--nproc`` ranks of this script and wait for them; their exit status, the worst first."""
    threads = str(args.threads)
    with tempfile.TemporaryDirectory(prefix="edl-runtime-cpu-") as tmp:
        env = dict(
            os.environ,
            WORLD_SIZE=str(args.nproc),
            LOCAL_WORLD_SIZE=str(args.nproc),
            OMP_NUM_THREADS=threads,
            MKL_NUM_THREADS=threads,
            OPENBLAS_NUM_THREADS=threads,
            # A file rendezvous: no port to choose, so runs side by side cannot collide.
            **{INIT_ENV: Path(tmp, "rendezvous").as_uri()},
        )
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", *argv]
        procs = [subprocess.Popen(cmd, env=env | {"RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(args.nproc)]
        try:
            return _wait(procs, grace=30.0)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


def _wait(procs: list[subprocess.Popen[bytes]], grace: float) -> int:
    """Wait for every rank; once one has failed, give the others ``grace`` seconds (they may be
    blocked in a collective with it), then end them."""
    failed_at: float | None = None
    while True:
        codes = [proc.poll() for proc in procs]
        if all(c is not None for c in codes):
            bad = [c for c in codes if c]
            return max(bad, key=abs) if bad else 0
        if failed_at is None and any(c for c in codes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace:
            for rank, proc in enumerate(procs):
                if proc.poll() is None:
                    print(f"runtime_cpu: ending rank {rank}: another rank failed", file=sys.stderr)
                    proc.kill()
        time.sleep(0.05)


# -- one rank -------------------------------------------------------------------------------------


class Skip(Exception):
    """A contender that cannot run here; its message says why."""


@dataclass
class Contender:
    """One way of running the block: ``call()`` returns this rank's ``y[B, S, D]``, complete."""

    name: str
    call: Callable[[], Any]
    predicted_ms: float | None = None  # the plan's prediction (edatalog rows)
    note: str = ""


@dataclass
class Result:
    contender: str
    ok: bool
    max_err: float  # over ranks and elements, relative to max |reference|
    rel_err: float  # Frobenius norm of the error over the reference's, worst rank
    predicted_ms: float | None
    note: str
    call_ms: list[float] = field(default_factory=list)  # per round: the slowest rank's time
    rank_ms: list[list[float]] = field(default_factory=list)  # [rank][round]

    @property
    def measured_ms(self) -> float | None:
        return statistics.median(self.call_ms) if self.call_ms else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "contender": self.contender,
            "measured_ms": self.measured_ms,
            "min_ms": min(self.call_ms) if self.call_ms else None,
            "max_ms": max(self.call_ms) if self.call_ms else None,
            "predicted_ms": self.predicted_ms,
            "rank_median_ms": [statistics.median(r) for r in self.rank_ms],
            "call_ms": self.call_ms,
            "rank_ms": self.rank_ms,
            "check": {"ok": self.ok, "max_err": self.max_err, "rel_err": self.rel_err},
            "note": self.note,
        }


@dataclass
class Context:
    """What every contender is built from: the same on every rank (but ``rank``)."""

    rank: int
    world: int
    args: argparse.Namespace
    dims: BlockDims
    consts: dict[str, float]
    weights: dict[str, Any]  # the program's param names -> full f32 tensors
    x: Any  # [B, S, D]
    cos: Any  # [B, S, E]
    sin: Any
    all_reduce: Callable[[Any], Any]  # the hand-written block's (in place): gloo's, or as edatalog's

    def log(self, message: str) -> None:
        if self.rank == 0:
            print(f"[runtime_cpu] {message}", file=sys.stderr, flush=True)


def build_megatron(ctx: Context) -> Contender:
    """Megatron-LM tensor parallelism, by hand, in plain torch."""
    import torch
    import torch.nn.functional as F

    d, r, n, w = ctx.dims, ctx.rank, ctx.world, ctx.weights
    all_reduce = ctx.all_reduce
    e, hl, kvl, fl = d.E, d.H // n, d.KVH // n, d.F // n
    eps = ctx.consts["eps"]

    def rows(t: torch.Tensor, size: int) -> torch.Tensor:
        return t[r * size : (r + 1) * size]

    def cols(t: torch.Tensor, size: int) -> torch.Tensor:
        return t[:, r * size : (r + 1) * size]

    # Column-parallel: this rank's output rows (its heads, its slice of F), fused into one GEMM
    # each; row-parallel: its input columns.  Megatron-LM fuses q/k/v and gate/up the same way.
    w_qkv = torch.cat([rows(w["wq"], hl * e), rows(w["wk"], kvl * e), rows(w["wv"], kvl * e)]).contiguous()
    w_o = cols(w["wo"], hl * e).contiguous()
    w_gu = torch.cat([rows(w["w_gate"], fl), rows(w["w_up"], fl)]).contiguous()
    w_down = cols(w["w_down"], fl).contiguous()
    g_attn, g_ffn = w["attn_norm"].clone(), w["ffn_norm"].clone()
    cos, sin = ctx.cos[:, None], ctx.sin[:, None]  # [B, 1, S, E]: every head
    x = ctx.x
    b, s, _ = x.shape
    half = e // 2

    def rms(t: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return g * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps))

    def rotary(t: torch.Tensor) -> torch.Tensor:  # rotate-half RoPE, as transformers
        return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin

    def call() -> torch.Tensor:
        qkv = F.linear(rms(x, g_attn), w_qkv)
        q, k, v = torch.split(qkv, [hl * e, kvl * e, kvl * e], dim=-1)
        q = rotary(q.view(b, s, hl, e).transpose(1, 2))
        k = rotary(k.view(b, s, kvl, e).transpose(1, 2))
        v = v.view(b, s, kvl, e).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hl != kvl)
        attn = F.linear(o.transpose(1, 2).reshape(b, s, hl * e), w_o)
        all_reduce(attn)
        h = x + attn
        gate, up = torch.split(F.linear(rms(h, g_ffn), w_gu), fl, dim=-1)
        down = F.linear(F.silu(gate) * up, w_down)
        all_reduce(down)
        return h + down

    return Contender("megatron", call, note="fused qkv and gate/up GEMMs")


def build_dtensor(ctx: Context) -> Contender:
    """transformers' LlamaDecoderLayer under DTensor tensor parallelism."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    layer = llama_weights.hf_layer(ctx.dims, ctx.consts, ctx.weights, attn_implementation="sdpa")
    mesh = init_device_mesh("cpu", (ctx.world,))
    if ctx.args.baseline_all_reduce == "shared-memory":  # the mesh may make a group of its own
        shm_collectives.route(mesh.get_group(), ctx.args.timeout)
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    parallelize_module(layer, mesh, plan)
    # The colwise outputs are local tensors (use_local_output): each rank sees its own heads.
    # transformers 5 reshapes them with -1 heads; versions that keep head counts on the module
    # need them per rank.  (num_key_value_groups, H / KVH, is the same on every rank.)
    attn = layer.self_attn
    for name in ("num_heads", "num_key_value_heads"):
        if isinstance(getattr(attn, name, None), int):
            setattr(attn, name, getattr(attn, name) // ctx.world)
    x, pos = ctx.x, (ctx.cos, ctx.sin)

    def call() -> torch.Tensor:
        # No mask: transformers' SDPA path then runs the kernel with is_causal=True.
        out = layer(x, position_embeddings=pos)
        return out[0] if isinstance(out, tuple) else out

    return Contender("dtensor", call, note="parallelize_module on transformers' LlamaDecoderLayer (sdpa)")


def build_edatalog(ctx: Context, strategy: str) -> Contender:
    """edatalog's plan of ``programs/llama_block.edl``, run by edatalog's torch runtime as a user
    would: ``edatalog.executable(prog, plan, backend="torch")`` inside the benchmark's process
    group (so SPMD: this rank runs its device's program), ``exe.load(weights)``, then each call
    ``exe({"x": x})``, which returns the whole ``y`` on every rank, as the hand-written contenders do."""
    import torch

    import edatalog

    name = f"edatalog-{strategy}"
    executable = edatalog.executable

    prog = edatalog.compile(PROGRAM, dims=ctx.dims.edl_dims())
    plan = shared_plan(ctx, prog, strategy)
    devices = plan.summary()["devices"]
    if devices != ctx.world:
        raise Skip(f"{name}: skipped: the plan is for {devices} devices, not {ctx.world} ranks (see --topology)")
    exe = executable(prog, plan, backend="torch")
    exe.load(dict(ctx.weights))  # full tensors, by the program's names
    inputs = {"x": ctx.x}

    def call() -> torch.Tensor:
        return torch.as_tensor(exe(inputs)["y"])

    predicted = float(plan.summary()["predicted_ms"])
    return Contender(name, call, predicted_ms=predicted, note=f"plan on {plan.topology.name}")


def shared_plan(ctx: Context, prog: Any, strategy: str) -> Any:
    """The plan, made on rank 0 and sent to the others: the auto solver stops on a wall clock, so
    ranks planning on their own could disagree."""
    import torch.distributed as dist

    import edatalog

    text: list[str | None] = [None]
    if ctx.rank == 0:
        ctx.log(f"planning {strategy} on {ctx.args.topology}")
        plan = edatalog.plan(prog, topology=ctx.args.topology, strategy=strategy, time_limit=ctx.args.time_limit)
        text = [plan.to_json()]
    dist.broadcast_object_list(text, src=0)
    with tempfile.TemporaryDirectory(prefix="edl-plan-") as tmp:
        path = Path(tmp, "plan.json")
        path.write_text(str(text[0]), encoding="utf-8")
        return edatalog.load_plan(path, prog)


BUILDERS: dict[str, Callable[[Context], Contender]] = {
    "megatron": build_megatron,
    "dtensor": build_dtensor,
    "edatalog-megatron": lambda ctx: build_edatalog(ctx, "megatron"),
    "edatalog-auto": lambda ctx: build_edatalog(ctx, "auto"),
    "edatalog-replicate": lambda ctx: build_edatalog(ctx, "replicate"),
}


def check(ctx: Context, out: Any, ref: Any) -> tuple[float, float]:
    """The error of this rank's output against the reference, worst over ranks: (max |error| /
    max |reference|, Frobenius norm of the error / the reference's)."""
    import torch
    import torch.distributed as dist

    if tuple(out.shape) != tuple(ref.shape) or out.dtype != ref.dtype:
        errs = torch.tensor([float("inf"), float("inf")], dtype=torch.float64)
    else:
        diff = (out.detach() - ref).double()
        errs = torch.stack([diff.abs().max() / ref.abs().max(), diff.norm() / ref.double().norm()])
        errs = torch.nan_to_num(errs, nan=float("inf"))
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    return float(errs[0]), float(errs[1])


def time_calls(ctx: Context, contenders: list[Contender]) -> dict[str, list[list[float]]]:
    """Warm up, then time ``--repeat`` rounds; per contender, every rank's times (ms) [rank][round]."""
    import torch
    import torch.distributed as dist

    from edatalog.backend.running.shm_all_reduce import barrier_of
    from edatalog.backend.running.spmd import TIMEOUT_SECONDS

    args = ctx.args
    meet = barrier_of(dist.group.WORLD, TIMEOUT_SECONDS)  # as edl run's calls meet: every contender alike
    for c in contenders:
        ctx.log(f"warming up {c.name} ({args.warmup} calls)")
        for _ in range(args.warmup):
            meet()
            c.call()
    mine: dict[str, list[float]] = {c.name: [] for c in contenders}
    ctx.log(f"timing {', '.join(c.name for c in contenders)}: {args.repeat} rounds")
    for _ in range(args.repeat):
        for c in contenders:
            meet()
            t0 = time.perf_counter()
            c.call()
            mine[c.name].append((time.perf_counter() - t0) * 1e3)
    dist.barrier()
    out = {}
    for c in contenders:
        local = torch.tensor(mine[c.name], dtype=torch.float64)
        every = [torch.empty_like(local) for _ in range(ctx.world)]
        dist.all_gather(every, local)
        out[c.name] = [t.tolist() for t in every]
    return out


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    timeout = datetime.timedelta(seconds=args.timeout)
    if INIT_ENV in os.environ:  # started by launch()
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo", init_method=os.environ[INIT_ENV], rank=rank, world_size=world, timeout=timeout)
    else:  # torchrun
        dist.init_process_group("gloo", init_method="env://", timeout=timeout)
    code = run_rank(args, dist.get_rank(), dist.get_world_size())
    # Every rank done before any tears its group down: a gloo group whose peer has gone can
    # abort in its destructor ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()
    return code


def run_rank(args: argparse.Namespace, rank: int, world: int) -> int:
    import torch
    import torch.distributed as dist

    started, load_start = time.time(), _load()
    if args.baseline_gemms == "onednn":
        onednn_gemms.route()
    all_reduce = None
    if args.baseline_all_reduce == "shared-memory":
        all_reduce = shm_collectives.route(dist.group.WORLD, args.timeout)
        if all_reduce is None and rank == 0:
            print("[runtime_cpu] the ranks cannot share memory: the baselines keep gloo's all_reduce", file=sys.stderr)
    dims: BlockDims = args.block
    consts = llama_weights.program_consts(dims)
    weights = llama_weights.make_weights(dims, args.seed)
    x = llama_weights.make_input(dims, args.seed)
    # Made once: every rank draws the same from the seed, and takes rank 0's to be sure.
    for t in (*weights.values(), x):
        dist.broadcast(t, src=0)
    cos, sin = llama_weights.rope(dims, consts)
    ctx = Context(rank, world, args, dims, consts, weights, x, cos, sin, all_reduce or dist.all_reduce)
    eps, theta = consts["eps"], consts["theta"]
    ctx.log(f"{world} ranks x {args.threads} thread(s); {dims}, E={dims.E}; eps={eps:g} theta={theta:g}")

    with torch.inference_mode():
        ref = llama_weights.reference(
            llama_weights.hf_layer(dims, consts, weights, attn_implementation="eager"), x, cos, sin
        )
        results: list[Result] = []
        skipped: list[dict[str, str]] = []
        timed: list[Contender] = []
        for name in args.names:
            try:
                contender = BUILDERS[name](ctx)
            except Skip as exc:
                ctx.log(str(exc))
                skipped.append({"contender": name, "reason": str(exc)})
                continue
            dist.barrier()
            max_err, rel_err = check(ctx, contender.call(), ref)
            ok = max_err <= args.tol
            ctx.log(f"{name}: max error {max_err:.2e} of max |y|, {rel_err:.2e} relative: {'ok' if ok else 'FAILED'}")
            results.append(Result(name, ok, max_err, rel_err, contender.predicted_ms, contender.note))
            if ok:
                timed.append(contender)
        if timed:
            times = time_calls(ctx, timed)
            for res in results:
                if res.contender in times:
                    res.rank_ms = times[res.contender]
                    res.call_ms = [max(per_rank) for per_rank in zip(*res.rank_ms, strict=True)]

    all_ok = all(r.ok for r in results)
    if rank == 0:
        report = {
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine(load_start),
            "versions": versions(),
            "command": "benchmarks/runtime_cpu.py " + " ".join(a for a in sys.argv[1:] if a != "--worker"),
            "ranks": world,
            "threads": args.threads,
            "dims": dims.edl_dims(),
            "consts": consts,
            "warmup": args.warmup,
            "repeat": args.repeat,
            "tol": args.tol,
            "topology": args.topology,
            "baseline_gemms": args.baseline_gemms,
            "baseline_all_reduce": args.baseline_all_reduce if all_reduce is not None else "gloo",
            "results": [r.to_dict() for r in results],
            "skipped": skipped,
            "seconds": time.time() - started,
        }
        print(json.dumps(report, indent=1) if args.json else table(report), flush=True)
    return 0 if all_ok else EXIT_CHECK_FAILED


# -- reporting ------------------------------------------------------------------------------------


def machine(load_start: list[float] | None) -> dict[str, Any]:
    """What the numbers were measured on; the load averages (1, 5, 15 min) show whether anything
    else ran."""
    cpu = platform.processor() or ""
    mem_gb = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gb = round(int(line.split()[1]) / 1e6, 1)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gb": mem_gb,
        "platform": platform.platform(),
        "load_average_start": load_start,
        "load_average_end": _load(),
        "commit": _git("rev-parse", "--short", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
    }


def _load() -> list[float] | None:
    return [round(v, 2) for v in os.getloadavg()] if hasattr(os, "getloadavg") else None


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def versions() -> dict[str, str]:
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}


def _ms(v: float | None) -> str:
    if v is None:
        return ""
    return f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def table(report: dict[str, Any]) -> str:
    m, dims = report["machine"], report["dims"]
    lines = [
        f"runtime_cpu: {report['date']}, commit {m['commit']}{' (dirty)' if m['dirty'] else ''}",
        f"machine: {m['cpu']}, {m['cores']} cores, {m['memory_gb']} GB; load average (1/5/15 min) "
        f"{m['load_average_start']} at the start, {m['load_average_end']} at the end",
        "versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
        f"block: {' '.join(f'{k}={v}' for k, v in dims.items())}, f32; "
        f"{report['ranks']} ranks x {report['threads']} thread(s), gloo; "
        f"{report['warmup']} warm-up calls, {report['repeat']} rounds; ATen's large f32 GEMMs: "
        + ("oneDNN, as edatalog's" if report.get("baseline_gemms") == "onednn" else "as torch ships them")
        + "; the baselines' all-reduces: "
        + ("shared memory, as edatalog's" if report.get("baseline_all_reduce") == "shared-memory" else "gloo's"),
        "",
    ]
    header = ["contender", "measured ms", "min", "max", "predicted ms", "per rank (median ms)", "check"]
    rows = []
    for r in report["results"]:
        c = r["check"]
        verdict = f"{'ok' if c['ok'] else 'FAILED'} ({c['max_err']:.1e})"
        per_rank = " ".join(_ms(v) for v in r["rank_median_ms"])
        times = [_ms(r[k]) for k in ("measured_ms", "min_ms", "max_ms", "predicted_ms")]
        rows.append([r["contender"], *times, per_rank, verdict])
    for s in report["skipped"]:
        rows.append([s["contender"], "", "", "", "", "", "skipped"])
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    right = {1, 2, 3, 4}

    def fmt(row: list[str]) -> str:
        pairs = enumerate(zip(row, widths, strict=True))
        cells = [str(v).rjust(w) if i in right else str(v).ljust(w) for i, (v, w) in pairs]
        return "  ".join(cells).rstrip()

    lines += [fmt(header), "  ".join("-" * w for w in widths), *map(fmt, rows)]
    notes = [f"{r['contender']}: {r['note']}" for r in report["results"] if r["note"]]
    notes += [s["reason"] for s in report["skipped"]]
    if notes:
        lines += ["", *notes]
    lines.append(
        f"\n'measured ms': median over rounds of the slowest rank's call; check: max |y - reference| / max |reference| "
        f"<= {report['tol']:g}; wall time {report['seconds']:.0f} s"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker or _under_launcher():
        return worker(args)
    return launch(args, [a for a in argv if a != "--worker"])


if __name__ == "__main__":
    sys.exit(main())
