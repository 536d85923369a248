"""``edl train``: train a model program from a checkpoint on a token file."""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

from edatalog.cli.common import Progress, overrides
from edatalog.errors import EdlError
from edatalog.ir.dtypes import FLOATS
from edatalog.rules.optim import SGD, AdamW, Optimizer
from edatalog.train_job import Record, Request

EPILOG = """\
The loss is the mean cross-entropy of the program's logits[B, S, V] for ids[B, S] against the
next tokens, over all B x S positions (four rules appended to the program).  Each step is one
program: the forward, its gradients, clipping (--clip; 0: none) and the optimizer's update, as
torch computes them (AdamW: eps 1e-8, weight decay on every param; SGD: momentum, weight decay).
--data is a flat array of token ids: .npy, or a raw .bin as nanoGPT writes it (uint16 when the
vocabulary fits, else uint32); each sequence is a window of S + 1 tokens, the windows of step k
drawn from (--seed, k) alone.  Dims and consts come from the checkpoint's config.json.

examples:
  edl train programs/llama.edl --weights model_dir --data tokens.npy --steps 20 --batch 4 --seq 64
  edl train programs/llama.edl --weights model_dir --data tokens.npy --steps 10 --batch 4 --seq 64 --save ckpt
  edl train programs/llama.edl --weights model_dir --data tokens.npy --steps 10 --batch 4 --seq 64 --resume ckpt
  edl train programs/llama.edl --weights model_dir --data tokens.npy --steps 20 --batch 4 --seq 64 --nproc 2 --json
  edl train programs/llama.edl --weights model_dir --data tokens.npy --steps 5 --batch 4 --seq 64 --nproc 2 \\
      --save-plan step.json
  edl explain step.json grad_layers.0.wq
  edl train programs/llama.edl --weights model_dir --data tokens.npy --steps 5 --batch 4 --seq 64 --nproc 2 \\
      --memory 300MB

--save OUT writes a directory transformers' from_pretrained reads (config.json, model.safetensors)
and the optimizer's state (optimizer.safetensors); --resume OUT continues from it, the same as
not stopping.  With --nproc N the step program is planned for N devices (on -t, default cpuxN,
under --memory) unless --plan gives a plan of it, and N processes run it (torch.distributed);
the plan's strategy and predicted step time are printed first, and --save-plan FILE keeps the
plan (edl explain FILE RELATION says why each rule of the step is split as it is; --plan FILE
runs it again without solving).  The params and the optimizer's state stay on the ranks from
step to step, each where the plan makes its next value: replicated under data parallelism,
sharded under a --memory too small for that (the zero plan: each rank updates and keeps its
shard of every param and moment, gradients are reduce-scattered to the shards and params
gathered where the batch's rules read them); when nothing fits even so, the backward recomputes
each layer's activations instead of keeping them.  --json prints one object per step: step, loss,
ms (measured), predicted_ms, peak_bytes (measured, the busiest rank)."""


def add_parser(sub: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]) -> None:  # type: ignore[type-arg]
    t = sub.add_parser("train", help="train a model program on a token file", epilog=EPILOG, formatter_class=formatter)
    t.add_argument("file", metavar="FILE", help="the model program (e.g. programs/llama.edl)")
    t.add_argument("--weights", metavar="PATH", help="the checkpoint to start from: a model directory")
    t.add_argument("--data", required=True, metavar="FILE", help="token ids: .npy, or a raw nanoGPT .bin")
    t.add_argument("--steps", type=int, required=True, metavar="N", help="optimizer steps to take")
    t.add_argument("--batch", type=int, required=True, metavar="B", help="sequences per step")
    t.add_argument("--seq", type=int, required=True, metavar="S", help="tokens per sequence")
    t.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="adamw (default) or sgd")
    t.add_argument("--lr", type=float, default=1e-3, metavar="X", help="learning rate (default 1e-3)")
    t.add_argument("--momentum", type=float, default=0.0, metavar="X", help="sgd: momentum (default 0)")
    t.add_argument("--betas", default="0.9,0.999", metavar="X,Y", help="adamw: betas (default 0.9,0.999)")
    t.add_argument("--weight-decay", type=float, metavar="X", help="default: 0.01 (adamw), 0 (sgd), as torch")
    t.add_argument("--clip", type=float, default=0.0, metavar="X", help="global gradient-norm clipping (0: none)")
    t.add_argument("--dtype", choices=FLOATS, help="re-type the program's floats (the checkpoint's must match)")
    t.add_argument("--seed", type=int, default=0, metavar="K", help="seeds the data windows (default 0)")
    t.add_argument("--dim", action="append", default=[], metavar="K=V", help="override a dim (repeatable)")
    t.add_argument("--const", action="append", default=[], metavar="K=V", help="override a const (repeatable)")
    t.add_argument("--backend", choices=("torch", "reference"), default="torch", help="torch (default) or reference")
    t.add_argument("--plan", metavar="PLAN", help="a plan file of the step program (with --nproc)")
    t.add_argument("--memory", metavar="BYTES", help="with --nproc: plan within this memory per device")
    t.add_argument("--topology", "-t", metavar="T", help="with --nproc: the machine to plan for (default cpuxN)")
    t.add_argument("--time-limit", type=float, default=10.0, metavar="SEC", help="seconds to plan (default 10)")
    t.add_argument(
        "--save-plan", metavar="FILE", help="with --nproc: write the step's plan to FILE (for edl explain, --plan)"
    )
    t.add_argument("--nproc", type=int, metavar="N", help="run on N processes (torch.distributed)")
    t.add_argument("--save", metavar="OUT", help="write the trained model and the optimizer's state to OUT")
    t.add_argument("--resume", metavar="OUT", help="continue from a directory --save wrote")
    t.add_argument("--json", action="store_true", help="print one JSON object per step")


def optimizer_of(args: argparse.Namespace) -> Optimizer:
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise EdlError(f"--lr must be a positive number, not {args.lr:g}")
    if args.optimizer == "sgd":
        return SGD(lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay or 0.0)
    try:
        b1, b2 = (float(x) for x in args.betas.split(","))
    except ValueError:
        raise EdlError(f"bad --betas '{args.betas}'", help="two numbers: --betas 0.9,0.95") from None
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise EdlError(f"--betas must be in [0, 1), not {args.betas}")
    wd = 0.01 if args.weight_decay is None else args.weight_decay
    return AdamW(lr=args.lr, betas=(b1, b2), weight_decay=wd)


def cmd_train(args: argparse.Namespace) -> int:
    from edatalog.train_job import check_data, check_resume, run

    if args.weights is not None and args.resume is not None:
        raise EdlError("give --weights (a checkpoint to start from) or --resume (a directory --save wrote), not both")
    if args.weights is None and args.resume is None:
        raise EdlError(
            "training starts from a checkpoint: give --weights (a model directory, as save_pretrained "
            "writes it) or --resume (a directory --save wrote)",
            help="to start from random weights, save a freshly initialized model first",
        )
    for flag in ("steps", "batch", "seq"):
        if getattr(args, flag) < 1:
            raise EdlError(f"--{flag} must be at least 1, not {getattr(args, flag)}")
    if args.nproc is not None and args.nproc < 1:
        raise EdlError(f"--nproc must be at least 1, not {args.nproc}")
    if args.nproc is None and (args.memory is not None or args.topology is not None or args.save_plan is not None):
        raise EdlError(
            "--memory, -t and --save-plan plan the step for --nproc processes", help="add --nproc N, or drop them"
        )
    if args.save and Path(args.save).exists() and not Path(args.save).is_dir():
        raise EdlError(f"--save {args.save} is a file", help="give a directory to write the checkpoint into")
    req = Request(
        file=args.file,
        weights=args.weights or args.resume,
        data=args.data,
        steps=args.steps,
        batch=args.batch,
        seq=args.seq,
        optimizer=optimizer_of(args),
        clip=args.clip,
        dtype=args.dtype,
        seed=args.seed,
        dims=overrides(args.dim, "dim"),
        consts=overrides(args.const, "const"),
        backend=args.backend,
        plan=args.plan,
        save=args.save,
        resume=args.resume,
    )

    check_resume(req)
    check_data(req)

    def show(rec: Record) -> None:
        if args.json:
            print(json.dumps(rec.__dict__), flush=True)

    if args.nproc is None:
        with Progress() as progress:
            task = progress.task("training", args.steps)
            done = [0]

            def step(rec: Record) -> None:
                show(rec)
                done[0] += 1
                tokens = args.batch * args.seq / (rec.ms / 1e3)
                predicted = "" if rec.predicted_ms is None else f" (predicted {rec.predicted_ms:.0f})"
                text = f"step {rec.step}: loss {rec.loss:.4g}, {tokens:.0f} tokens/s, {rec.ms:.0f} ms{predicted}"
                progress.update(task, done[0], text)

            records = run(req, step)
    else:
        records = _spawned(req, args)
        for rec in records:
            show(rec)
    if not args.json:
        _table(records)
    return 0


def _spawned(req: Request, args: argparse.Namespace) -> list[Record]:

    from edatalog.train_job import rank_job, solved_plan

    if req.backend != "torch":
        raise EdlError("--nproc runs on the torch backend", help="drop --backend reference, or --nproc")
    from edatalog.backend.running.launch import spawn

    with tempfile.TemporaryDirectory() as tmp:
        if req.plan is None:
            topology = args.topology or f"cpux{args.nproc}"
            target = Path(args.save_plan) if args.save_plan else Path(tmp) / "step.plan.json"
            req, what = solved_plan(req, args.nproc, topology, args.memory, args.time_limit, target)
            if not args.json:
                print(what + (f"; wrote {target}" if args.save_plan else ""), file=sys.stderr)
        elif args.save_plan:
            shutil.copyfile(req.plan, args.save_plan)
        return list(spawn(args.nproc, rank_job, (req,))[0])


def _table(records: list[Record]) -> None:
    from edatalog.cli.common import table

    rows = [
        [
            str(r.step),
            f"{r.loss:.6g}",
            f"{r.ms:.1f}",
            "-" if r.predicted_ms is None else f"{r.predicted_ms:.1f}",
            "-" if r.peak_bytes is None else str(r.peak_bytes),
        ]
        for r in records
    ]
    print(table(["step", "loss", "ms (measured)", "predicted ms", "peak bytes"], rows, right=(0, 1, 2, 3, 4)))
