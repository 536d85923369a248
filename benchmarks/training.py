"""Training steps on 2 gloo CPU ranks: edatalog's planned step against torch DDP and FSDP2.

One LLaMA (transformers' ``LlamaForCausalLM``, random weights saved once), one token file, the
same batches for every contender: --batch sequences of --seq tokens per step (each rank of DDP
and FSDP2 takes its half), the mean cross-entropy over every position, AdamW (betas 0.9/0.95,
weight decay 0.1, eps 1e-8, lr 1e-3) after global-norm clipping at 1.0, f32.  DDP and FSDP2 use
torch's fused AdamW kernel (``fused=True``), as edatalog's step does (``--single-tensor-adamw``:
torch's default on a CPU instead), and their large f32 GEMMs on oneDNN, as edatalog's runtime
runs its own (``--baseline-gemms onednn``, the default: benchmarks/onednn_gemms.py; ``aten``:
MKL's sgemm, as torch ships it).  DDP all-reduces its gradient buckets through shared memory
between the ranks, as edatalog's runtime all-reduces its own (``--baseline-all-reduce
shared-memory``, the default: a communication hook, benchmarks/shm_collectives.py; ``gloo``:
DDP's own, overlapped with the backward); FSDP2's reduce-scatters and all-gathers stay gloo's,
as edatalog's do.

- ``ddp``: ``DistributedDataParallel`` around the model, gradients all-reduced in buckets while
  the backward runs;
- ``fsdp2``: ``fully_shard`` on every decoder layer and on the model (params, gradients and
  AdamW's state sharded; params all-gathered per layer, gradients reduce-scattered);
- ``edatalog``: ``edl train``'s job: programs/llama.edl with the loss, its gradients, clipping and
  AdamW as one step program, planned for --nproc devices of --topology (default cpuxN, or a
  calibrated machine file from ``edl calibrate``), every rank running its device's program.

Every rank uses one torch thread, and the ranks meet at a barrier before each step, outside
its time (every contender alike).  Step times are measured on rank 0 (wall time of a whole
step, data included), the first --warmup steps left out (edatalog interprets its first step
and records its graph on the second); the table gives each contender's median, spread and
ratio to edatalog's, the rounds taking turns (--repeat).  The losses of every step must agree
between contenders (f32: 1e-3 relative), and the table says how far they are apart.
``predicted`` is edatalog's plan's timeline; ``peak RSS`` is the busiest rank's resident memory
at its end (measured, whole process); ``held`` is the most bytes edatalog's busiest rank held
in its program's buffers (params, state, gradients, activations), as the runtime counts them.
``--memory`` asks edatalog's solver for a plan within that much per device (the ``zero`` plan,
sharded like FSDP2, when data parallelism's replicated state does not fit).

    .venv/bin/python benchmarks/training.py                     # the issue's dims (minutes)
    .venv/bin/python benchmarks/training.py --dim 256 --seq 64 --steps 5 --repeat 1   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # also when loaded by path (tests/edatalog/test_docs.py)
    sys.path.insert(0, str(HERE))

import onednn_gemms  # noqa: E402
import shm_collectives  # noqa: E402

ROOT = HERE.parent
PROGRAM = ROOT / "programs" / "llama.edl"
CONTENDERS = ("ddp", "fsdp2", "edatalog")
LR, BETAS, WEIGHT_DECAY, CLIP = 1e-3, (0.9, 0.95), 0.1, 1.0


@dataclass
class Run:
    """One contender's round: every step's loss and milliseconds (rank 0), the ranks' peak RSS."""

    contender: str
    losses: list[float]
    ms: list[float]
    peak_rss: int
    predicted_ms: float | None = None
    notes: dict[str, Any] = field(default_factory=dict)


def make_model(args: argparse.Namespace, out: Path) -> None:
    """The random model (saved as transformers saves it) and the token file."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.dim,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=max(args.seq, 64),
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(out / "model")
    rng = np.random.default_rng(0)
    np.save(out / "tokens.npy", rng.integers(0, args.vocab, size=args.tokens).astype(np.int64))


def _batches(args: argparse.Namespace, data: np.ndarray, steps: int) -> list[dict[str, np.ndarray]]:
    """Every step's batch, as ``edl train`` draws it (the same windows for every contender)."""
    from edatalog import train_job

    req = _request(args, Path("."))
    return [train_job.batch(data, req, k) for k in range(steps)]


def _request(args: argparse.Namespace, work: Path) -> Any:
    from edatalog import train_job
    from edatalog.rules.optim import AdamW

    return train_job.Request(
        file=str(PROGRAM),
        weights=str(work / "model"),
        data=str(work / "tokens.npy"),
        steps=args.steps,
        batch=args.batch,
        seq=args.seq,
        optimizer=AdamW(lr=LR, betas=BETAS, eps=1e-8, weight_decay=WEIGHT_DECAY),
        clip=CLIP,
        dtype="f32",
    )


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def torch_rank(contender: str, args: argparse.Namespace, work: Path) -> Run:
    """One rank of DDP or FSDP2 (see the module docstring)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    if args.baseline_gemms == "onednn":
        onednn_gemms.route()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = LlamaForCausalLM.from_pretrained(work / "model", torch_dtype=torch.float32)
    model.train()
    if contender == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped: Any = DistributedDataParallel(model)
        if args.baseline_all_reduce == "shared-memory":
            reduce = shm_collectives.route(dist.group.WORLD, 900.0)
            if reduce is not None:  # as edatalog's runtime all-reduces its gradients
                wrapped.register_comm_hook(None, shm_collectives.ddp_comm_hook(reduce, world))
            elif rank == 0:
                print("[training] the ranks cannot share memory: DDP keeps gloo's all-reduce", file=sys.stderr)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        wrapped = fully_shard(model)
    # torch's fused AdamW kernel (one pass per param), as edatalog's step runs its updates.
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=BETAS, eps=1e-8, weight_decay=WEIGHT_DECAY, fused=args.fused
    )
    batches = _batches(args, np.load(work / "tokens.npy"), args.steps)
    per = args.batch // world
    losses, times = [], []
    for b in batches:
        dist.barrier()
        start = time.perf_counter()
        ids = torch.from_numpy(b["ids"][rank * per : (rank + 1) * per])
        labels = torch.from_numpy(b["labels"][rank * per : (rank + 1) * per])
        logits = wrapped(input_ids=ids, use_cache=False).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        times.append((time.perf_counter() - start) * 1e3)
        losses.append(float(mean) / world)
    peak = torch.tensor([_rss()], dtype=torch.int64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return Run(contender, losses, times, int(peak))  # the launcher leaves the group


def edatalog_rank(req: Any) -> Run:
    """One rank of edatalog's planned training job (``edl train --nproc``'s, ``rank_job``), the
    ranks meeting at a barrier before each step as DDP's and FSDP2's do (outside the timed step:
    one rank's lag at a step's start is not charged to the other)."""
    import torch
    import torch.distributed as dist

    from edatalog import train_job

    records = train_job.rank_job(req, on_step=lambda _: dist.barrier())
    peak = torch.tensor([_rss()], dtype=torch.int64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    predicted = records[0].predicted_ms if records else None
    notes = {"program_peak_bytes": max((r.peak_bytes or 0) for r in records)}
    return Run("edatalog", [r.loss for r in records], [r.ms for r in records], int(peak), predicted, notes)


def run_round(contender: str, args: argparse.Namespace, work: Path, plan: str) -> Run:
    from edatalog.backend.running.launch import spawn

    if contender == "edatalog":
        import dataclasses

        req = dataclasses.replace(_request(args, work), plan=plan)
        return spawn(args.nproc, edatalog_rank, (req,))[0]
    return spawn(args.nproc, torch_rank, (contender, args, work))[0]


def solve(args: argparse.Namespace, work: Path) -> tuple[str, float]:
    """edatalog's plan of the step program (saved in ``work``), and the seconds it took: the
    solver's (``--strategy auto``), or a baseline's."""
    from edatalog import train_job
    from edatalog.plans import make_plan
    from edatalog.training import step_program

    start = time.perf_counter()
    topology = args.topology or f"cpux{args.nproc}"
    req = _request(args, work)
    if args.strategy == "auto":
        target = work / "step.plan.json"
        train_job.solved_plan(req, args.nproc, topology, args.memory, args.time_limit, target)
        path = str(target)
    else:
        step, _ = step_program(train_job.loss_program(req), optimizer=req.optimizer, clip=req.clip)
        path = str(work / "step.plan.json")
        make_plan(step, topology=topology, strategy=args.strategy, refine=args.refine).save(path)
    return path, time.perf_counter() - start


def summarize(runs: list[Run], args: argparse.Namespace, solve_s: float) -> dict[str, Any]:
    warm = args.warmup
    by: dict[str, list[Run]] = {}
    for r in runs:
        by.setdefault(r.contender, []).append(r)
    ref = by["edatalog"][0].losses
    rows = {}
    for name, rs in by.items():
        ms = [m for r in rs for m in r.ms[warm:]]
        worst = max(abs(a - b) / abs(b) for r in rs for a, b in zip(r.losses, ref, strict=True))
        rows[name] = {
            "median_ms": statistics.median(ms),
            "min_ms": min(ms),
            "max_ms": max(ms),
            "steps_timed": len(ms),
            "peak_rss_bytes": max(r.peak_rss for r in rs),
            "loss_rel_diff_vs_edatalog": worst,
            "predicted_ms": rs[0].predicted_ms,
            "first_losses": rs[0].losses[:3],
            **rs[0].notes,
        }
    ed = rows["edatalog"]["median_ms"]
    for row in rows.values():
        row["ratio_to_edatalog"] = row["median_ms"] / ed
    return {
        "date": date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "command": " ".join([sys.executable.split("/")[-1], *sys.argv]),
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "solve_seconds": solve_s,
        "contenders": rows,
    }


def table(report: dict[str, Any]) -> str:
    head = ["contender", "median ms", "min-max ms", "x edatalog", "predicted ms", "peak RSS MB", "held MB"]
    head.append("loss rel diff")
    lines = [head]
    for name, r in report["contenders"].items():
        lines.append(
            [
                name,
                f"{r['median_ms']:.0f}",
                f"{r['min_ms']:.0f}-{r['max_ms']:.0f}",
                f"{r['ratio_to_edatalog']:.2f}",
                "" if r["predicted_ms"] is None else f"{r['predicted_ms']:.0f}",
                f"{r['peak_rss_bytes'] / 2**20:.0f}",
                f"{r['program_peak_bytes'] / 2**20:.0f}" if "program_peak_bytes" in r else "",
                f"{r['loss_rel_diff_vs_edatalog']:.1e}",
            ]
        )
    widths = [max(len(row[k]) for row in lines) for k in range(len(head))]
    text = [" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in lines]
    text.insert(1, "-+-".join("-" * w for w in widths))
    c = report["config"]
    text.insert(
        0,
        f"{c['nproc']} gloo ranks, 1 thread each; LLaMA D={c['dim']}, {c['layers']} layers, V={c['vocab']}, "
        f"S={c['seq']}, {c['batch']} sequences/step, f32, AdamW + clip; edatalog's plan: {c['strategy']} on "
        f"{c['topology'] or 'cpux' + str(c['nproc'])}"
        + (f" within {c['memory']} per device" if c.get("memory") else "")
        + f", made in {report['solve_seconds']:.1f} s ({report.get('plan_strategy', '?')}); "
        + f"DDP's and FSDP2's large f32 GEMMs: {'oneDNN' if c.get('baseline_gemms') == 'onednn' else 'ATen (MKL)'}"
        + "; DDP's all-reduces: "
        + ("shared memory (where the ranks share it)" if c.get("baseline_all_reduce") == "shared-memory" else "gloo's"),
    )
    return "\n".join(text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1376)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="sequences per step (all ranks together)")
    p.add_argument("--tokens", type=int, default=200_000, help="length of the random token file")
    p.add_argument("--steps", type=int, default=8, help="steps per round")
    p.add_argument("--warmup", type=int, default=3, help="steps of each round left out of the times")
    p.add_argument("--repeat", type=int, default=2, help="rounds; contenders take turns")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--topology", "-t", help="edatalog plans for this machine (default cpuxN)")
    p.add_argument("--time-limit", type=float, default=20.0, help="seconds edatalog's solver may take")
    p.add_argument("--strategy", default="auto", help="edatalog's plan: auto, or a baseline (data, zero, ...)")
    p.add_argument("--memory", help="edatalog's solver plans within this memory per device (e.g. 150MB)")
    p.add_argument("--refine", action="store_true", help="a baseline gets the solver's refinements")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help="a comma-separated subset")
    p.add_argument(
        "--single-tensor-adamw",
        dest="fused",
        action="store_false",
        help="DDP and FSDP2 step with torch's default AdamW on a CPU (a loop over params) instead of its fused kernel",
    )
    p.add_argument(
        "--baseline-gemms",
        choices=("onednn", "aten"),
        default="onednn",
        help="DDP's and FSDP2's large f32 GEMMs, forward and backward: 'onednn' (default) as edatalog's runtime "
        "runs its own (benchmarks/onednn_gemms.py); 'aten' as torch ships them (MKL)",
    )
    p.add_argument(
        "--baseline-all-reduce",
        choices=("shared-memory", "gloo"),
        default="shared-memory",
        help="DDP's gradient all-reduces: 'shared-memory' (default) between the ranks, as edatalog's runtime "
        "runs its own (benchmarks/shm_collectives.py); 'gloo' as DDP ships them",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    if args.batch % args.nproc:
        p.error("--batch must divide among --nproc ranks")
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    chosen = [c for c in CONTENDERS if c in args.contenders.split(",")]
    if "edatalog" not in chosen:
        chosen.append("edatalog")  # the reference of the ratios and losses
    with tempfile.TemporaryDirectory(prefix="edl-train-bench-") as tmp:
        work = Path(tmp)
        make_model(args, work)
        plan, solve_s = solve(args, work)
        strategy = json.loads(Path(plan).read_text())["strategy"]
        print(f"plan made in {solve_s:.1f} s: {strategy}", file=sys.stderr)
        runs = []
        for k in range(args.repeat):
            for name in chosen:
                run = run_round(name, args, work, plan)
                print(f"round {k + 1} {name}: {[round(m) for m in run.ms]} ms", file=sys.stderr)
                runs.append(run)
    report = {**summarize(runs, args, solve_s), "plan_strategy": strategy}
    print(json.dumps(report, indent=2, default=asdict) if args.json else table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
