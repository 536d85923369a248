"""`edl check`, `edl compile` and `edl run`."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from edatalog.backend.kernels import ops
from edatalog.backend.running import sim
from edatalog.backend.running.launch import in_spmd_job
from edatalog.cli import torch_run
from edatalog.cli.common import (
    Progress,
    check_array_file,
    check_writable,
    compile_args,
    configured_args,
    load_program_inputs,
    print_warnings,
    save_outputs,
    shape_text,
    table,
)
from edatalog.errors import EdlError
from edatalog.ir import dtypes
from edatalog.ir.graph import Graph
from edatalog.ir.printer import human
from edatalog.ir.scalar import Op
from edatalog.plans import load_plan

EPILOG_CHECK = """\
examples:
  edl check programs/llama_block.edl
  edl check programs/llama_block.edl --dim S=4096 --json
"""

EPILOG_COMPILE = """\
Each rule becomes one join-agg: a join of relations on shared indices, a scalar function, and an
aggregation over the indices the head does not keep.  Every line shows the rule as compiled (with
its effective guard), what it aggregates, and its FLOPs over the cells that exist.

examples:
  edl compile programs/attention.edl
  edl compile programs/llama_block.edl --json -o llama.json
"""

EPILOG_RUN = """\
Inputs come from --inputs (a .npz or .safetensors file whose names match the program's inputs
and params) and/or --random SEED (random values for everything --inputs does not give: inputs
~ N(0,1), matrix params ~ N(0, 1/fan_in), vector params ~ 1 + N(0, 0.1²)).  --weights takes a
checkpoint (a .safetensors file, or a directory as transformers' save_pretrained writes it):
params load by the checkpoint names the program declares, dims and consts from its config.json
(edl plan takes --weights too, for the same dims).

With --backend torch the program runs for real: on one device without --plan; with --plan, the
plan's devices as logical devices of this process (--device cuda:0,cuda:1 or cpu), or one process
per device with --nproc N (gloo on CPU, NCCL on CUDA; or start it with torchrun yourself).  Each
call is timed (--repeat K, the median, after --warmup W untimed calls) and printed beside the
plan's predicted time.  Each device's program runs as a graph (--compile): interpreted on the
first call, recorded on the second, replayed after; --trace times the last call op by op, on the
interpreter, and writes it as Chrome trace JSON (open in ui.perfetto.dev).  A rank that fails stops
the job; a rank that hangs does so after EDL_DIST_TIMEOUT seconds (default 45).

examples:
  edl run programs/llama_block.edl --dim S=64 --dim D=256 --dim H=4 --dim KVH=2 --dim F=512 --random 0
  edl run programs/mlp.edl --inputs weights.safetensors -o out.npz
  edl run programs/gpt2.edl --weights gpt2_dir --dim S=8 --inputs ids.npz -o logits.npz
  edl plan programs/mlp.edl -t cpux2 -o plan.json
  edl run programs/mlp.edl --plan plan.json --backend torch --nproc 2 --random 0 --repeat 10
  torchrun --nproc-per-node 2 -m edatalog.cli run programs/mlp.edl --plan plan.json --backend torch --random 0
"""


def cmd_check(args: argparse.Namespace) -> int:
    prog = compile_args(args)
    graph = prog.graph
    costs = graph.costs
    rows = []
    data = []
    for rel in graph.relations:
        nodes = graph.producers(rel.name)
        flops = sum(costs[n.name].flops for n in nodes)
        bound = "" if all(costs[n.name].exact for n in nodes) else "≤"
        role = rel.kind + (" (output)" if rel.name in graph.outputs else "")
        support = "" if rel.support.is_true else str(rel.support)
        rows.append(
            [
                rel.name,
                role,
                shape_text(rel),
                rel.dtype,
                f"{human(rel.nbytes)}B",
                str(len(nodes)) if nodes else "",
                bound + human(flops) if nodes else "",
                support,
            ]
        )
        data.append(
            {
                "name": rel.name,
                "kind": rel.kind,
                "output": rel.name in graph.outputs,
                "shape": list(rel.shape),
                "symbols": list(rel.symbols),
                "dtype": rel.dtype,
                "bytes": rel.nbytes,
                "rules": len(nodes),
                "flops": flops,
                "flops_exact": not bound,
                "support": None if rel.support.is_true else str(rel.support),
                "support_exact": rel.support_exact,
            }
        )
    total = sum(c.flops for c in costs.values())
    if args.json:
        out = {
            "file": args.file,
            "ok": True,
            "warnings": [w.render() for w in prog.warnings],
            "relations": data,
            "nodes": [
                {
                    "name": n.name,
                    "rule": str(n),
                    "origin": n.origin,
                    "points": costs[n.name].points,
                    "flops": costs[n.name].flops,
                    "exact": costs[n.name].exact,
                    "bytes_in": costs[n.name].bytes_in,
                    "bytes_out": costs[n.name].bytes_out,
                }
                for n in graph.nodes
            ],
            "total_flops": total,
            "fingerprint": graph.fingerprint(),
        }
        print(json.dumps(out, indent=1))
        return 0
    print_warnings(prog)
    print(table(["relation", "kind", "shape", "dtype", "size", "rules", "flops", "support"], rows, right=(4, 5, 6)))
    n_warn = len(prog.warnings)
    print(
        f"\n{args.file}: ok, {len(graph.nodes)} rules, {human(total)} FLOPs"
        + (f", {n_warn} warning{'s' if n_warn != 1 else ''}" if n_warn else "")
    )
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    prog = compile_args(args)
    text = prog.graph.to_json()
    if args.output:
        try:
            Path(args.output).write_text(text + "\n", encoding="utf-8")
        except OSError as exc:
            raise EdlError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    if args.json:
        print(text)
    else:
        print_warnings(prog)
        print(prog.graph)
        if args.output:
            print(f"\nwrote {args.output}", file=sys.stderr)
    return 0


def _warm_up(graph: Graph) -> None:
    """Load what the program's ops load on first use (torch, for erf and gelu) before the clock
    starts, so that the time and FLOP/s printed are the work's alone."""
    ops.warm_up(n.op for node in graph.nodes for n in node.expr.nodes if isinstance(n, Op))


def cmd_run(args: argparse.Namespace) -> int:
    if args.inputs is None and args.random is None and args.weights is None:
        raise EdlError(
            "no input values", help="pass --inputs FILE (.npz or .safetensors), --weights CHECKPOINT or --random SEED"
        )
    if args.output:
        check_array_file(args.output, "output", must_exist=False)
    if args.trace:
        check_writable(args.trace)
    backend = args.backend or ("sim" if args.plan else "reference")
    if backend == "sim" and not args.plan:
        raise EdlError(
            "the sim backend runs a plan", help="make one with 'edl plan FILE -o plan.json' and pass --plan plan.json"
        )
    if args.trace and not args.plan:
        raise EdlError("--trace needs a plan: the timeline is the plan's", help="pass --plan plan.json")
    if args.plan and backend == "reference":
        raise EdlError("the reference backend evaluates whole tensors", help="run a plan with --backend sim")
    torch_only = [f for f, v in (("--device", args.device), ("--nproc", args.nproc)) if v is not None]
    torch_only += ["--collectives"] if args.collectives != "auto" else []
    torch_only += ["--compile"] if args.compile != "auto" else []
    if backend != "torch" and (torch_only or args.repeat != 1):
        flags = ", ".join(torch_only + (["--repeat"] if args.repeat != 1 else []))
        raise EdlError(f"{flags} go with --backend torch", help="add --backend torch")
    if backend == "torch":
        return _run_torch(args)
    prog = compile_args(args)
    plan = load_plan(args.plan, prog) if args.plan else None
    values: dict[str, Any] = prog.load_checkpoint(args.weights) if args.weights is not None else {}
    values |= load_program_inputs(args.inputs, prog) if args.inputs is not None else {}
    missing = [r for r in prog.arguments if r.name not in values]
    if plan is None:  # before drawing a byte: will the inputs and the evaluation fit?
        prog.check_memory(draw_inputs=args.random is not None and bool(missing))
    with Progress() as progress:
        if args.random is not None and missing:
            task = progress.task("random weights", sum(r.nbytes for r in missing))
            values.update(
                prog.random_inputs(
                    args.random, names={r.name for r in missing}, on_value=lambda _name, n: progress.advance(task, n)
                )
            )
        graph = prog.graph
        prepared = prog.prepare(values)
        _warm_up(graph)
        start = time.perf_counter()
        if plan is not None:
            # The simulator's gathered Values (not Plan.execute's plain arrays): the table counts
            # absent cells, as it does for the reference evaluator's.
            env = sim.run(plan.lowered.verified(), prepared)
        else:
            task = progress.task("evaluating", sum(c.flops for c in graph.costs.values()))
            env = prog.evaluate(
                prepared, on_node=lambda n: progress.advance(task, graph.costs[n.name].flops), keep=prog.outputs
            )
        seconds = time.perf_counter() - start
    if plan is not None and args.trace:
        plan.trace(args.trace)
    outputs = {name: env[name].data for name in prog.outputs}
    if args.output:
        save_outputs(args.output, outputs)
    summary = {name: _summary(env[name].data, _absent(env[name].present)) for name in prog.outputs}
    if args.json:
        extra = {"predicted_ms": plan.report.seconds * 1e3} if plan is not None else {}
        print(
            json.dumps(
                {"file": args.file, "backend": backend, "seconds": seconds, "outputs": summary, **extra}, indent=1
            )
        )
        return 0
    print_warnings(prog)
    _print_outputs(summary)
    if plan is not None:
        r = plan.report
        print(
            f"\nran {sum(len(p.ops) for p in plan.lowered.programs.devices)} ops of the {plan.ir.strategy} plan "
            f"on {plan.ir.n_devices} simulated "
            f"devices in {seconds:.3f} s; predicted {r.seconds * 1e3:.4g} ms on {plan.topology.name}, "
            f"{human(r.bytes_moved)}B moved"
        )
    else:
        flops = sum(c.flops for c in prog.graph.costs.values())
        rate = f", {human(flops / seconds)}FLOP/s" if seconds > 0 and math.isfinite(seconds) else ""
        print(f"\nran {len(prog.graph.nodes)} rules in {seconds:.3f} s on the reference evaluator{rate}")
    for path, what in ((args.output, "outputs"), (args.trace, "trace")):
        if path:
            print(f"wrote {what} {path}")
    return 0


def _run_torch(args: argparse.Namespace) -> int:
    """``--backend torch``: run for real (here, or on --nproc new processes), timed."""
    dims, consts = configured_args(args)
    job = torch_run.Job(
        args.file,
        dims,
        consts,
        args.dtype,
        args.plan,
        args.inputs,
        args.random,
        args.device,
        args.repeat,
        max(0, args.warmup),
        args.trace is not None,
        args.collectives,
        args.compile,
        weights=args.weights,
    )
    prog = compile_args(args)  # errors in the program are reported here, once, not by every rank
    plan = load_plan(args.plan, prog) if args.plan else None
    if args.nproc is not None and plan is not None and args.nproc != plan.ir.n_devices:
        raise EdlError(
            f"--nproc {args.nproc}, but the plan has {plan.ir.n_devices} devices",
            help=f"use --nproc {plan.ir.n_devices}: rank r runs device r's program",
        )
    if in_spmd_job() and os.environ.get("RANK", "0") != "0":
        torch_run.run(job, None)  # another rank of torchrun's job: rank 0 reports
        return 0
    result = torch_run.run(job, args.nproc)
    if args.output:
        save_outputs(args.output, result.outputs)
    if args.trace:
        torch_run.trace(args.trace, result, _predicted(plan))
    predicted = _predicted(plan)
    measured = statistics.median(result.calls_ms)
    summary = {name: _summary(arr, result.absent.get(name, 0)) for name, arr in result.outputs.items()}
    if args.json:
        report = {
            "file": args.file,
            "backend": "torch",
            "nproc": args.nproc or (1 if not in_spmd_job() else int(os.environ["WORLD_SIZE"])),
            "measured_ms": measured,
            "calls_ms": result.calls_ms,
            "per_rank_ms": result.per_rank_ms,
            "peak_memory": {str(d): b for d, b in sorted(result.peak_bytes.items())},
            "predicted_ms": predicted,
            "outputs": summary,
        }
        print(json.dumps(report, indent=1))
        return 0
    print_warnings(prog)
    _print_outputs(summary)
    where = f"{args.nproc} processes" if args.nproc else "this process"
    what = f"the {plan.ir.strategy} plan on {plan.ir.n_devices} devices" if plan else "the program on one device"
    print(
        f"\nran {what} with torch in {where}: {measured:.3f} ms per call "
        f"(median of {len(result.calls_ms)}; min {min(result.calls_ms):.3f}, max {max(result.calls_ms):.3f})"
        + (f"; predicted {predicted:.4g} ms on {plan.topology.name}" if plan is not None else "")
    )
    if len(result.per_rank_ms) > 1:
        print("per rank: " + ", ".join(f"{r}: {t:.3f} ms" for r, t in enumerate(result.per_rank_ms)))
    if result.peak_bytes:
        peaks = ", ".join(f"{d}: {human(b)}B" for d, b in sorted(result.peak_bytes.items()))
        print(f"peak memory per device (measured): {peaks}")
    for path, what in ((args.output, "outputs"), (args.trace, "measured trace")):
        if path:
            print(f"wrote {what} {path}")
    return 0


def _predicted(plan: Any) -> float | None:
    return None if plan is None else plan.report.seconds * 1e3


def _summary(data: np.ndarray, absent: int) -> dict[str, Any]:
    """What the output table shows of one output."""
    arr = data.astype(np.float64)
    return {
        "shape": list(arr.shape),
        "dtype": dtypes.from_numpy(data.dtype),
        "norm": float(np.linalg.norm(arr.ravel())),
        "mean": float(arr.mean()) if arr.size else 0.0,
        "finite": bool(np.isfinite(arr).all()),
        "absent": absent,
    }


def _print_outputs(summary: dict[str, dict[str, Any]]) -> None:
    rows = [
        [
            n,
            str(s["shape"]),
            str(s["dtype"]),
            f"{s['norm']:.6g}",
            f"{s['mean']:.6g}",
            str(s["absent"]),
            "yes" if s["finite"] else "NO",
        ]
        for n, s in summary.items()
    ]
    print(table(["output", "shape", "dtype", "norm", "mean", "absent", "finite"], rows, right=(3, 4, 5)))


def _absent(present: np.ndarray | None) -> int:
    return 0 if present is None else int(present.size - np.count_nonzero(present))
