"""``edl generate``: greedy generation with a model program, its decode program and a checkpoint."""

from __future__ import annotations

import argparse
import json

from edatalog.cli.common import COMPILE_MODES, overrides
from edatalog.errors import EdlError
from edatalog.ir.dtypes import FLOATS

EPILOG = """\
Runs the model program once over the prompt (the prefill), then its decode program (by default
the same name with _decode: programs/llama_decode.edl) once per new token, taking the most likely
token each time (greedy), over a KV cache.  Dims and consts come from the checkpoint's
config.json where the programs name its keys (dim L = 32 from "num_hidden_layers"), else from
--dim/--const and the programs.  The time reported is measured: new tokens over the wall time of
the prefill and every decode step.

examples:
  edl generate programs/llama.edl --weights model_dir --prompt-ids 1,2,3 --max-new 16
  edl generate programs/llama.edl --weights model_dir --prompt-ids 1,2,3 --nproc 2 --json
  edl generate programs/llama.edl --weights model_dir --prompt-ids 1,2,3 --backend reference
  edl generate programs/llama.edl --weights model_dir --prompt-ids 1 --plan prefill.json --decode-plan step.json

With --nproc N, N processes run the job (torch.distributed; gloo on CPU, NCCL on GPUs): both
programs are planned for N devices (on -t, default cpuxN) unless --plan and --decode-plan give
plan files: the prefill's, made for the model program with its caches as outputs
(edl plan programs/llama.edl --outputs logits,layers.kr,layers.v), and the decode program's.
--json prints {"ids": [...], "tokens_per_second": ..., ...}."""


def add_parser(sub: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]) -> None:  # type: ignore[type-arg]
    g = sub.add_parser("generate", help="greedy generation from a checkpoint", epilog=EPILOG, formatter_class=formatter)
    g.add_argument("file", metavar="FILE", help="the model program (e.g. programs/llama.edl)")
    g.add_argument("--weights", required=True, metavar="PATH", help="the checkpoint: a model directory or .safetensors")
    g.add_argument("--prompt-ids", required=True, metavar="IDS", help="the prompt's token ids, comma-separated")
    g.add_argument("--max-new", type=int, default=16, metavar="N", help="new tokens to generate (default 16)")
    g.add_argument("--decode", metavar="FILE", help="the decode program (default: FILE's name with _decode)")
    g.add_argument("--dim", action="append", default=[], metavar="K=V", help="override a dim (repeatable)")
    g.add_argument("--const", action="append", default=[], metavar="K=V", help="override a const (repeatable)")
    g.add_argument("--dtype", choices=FLOATS, help="re-type the programs' floats (the checkpoint's dtype must match)")
    g.add_argument("--backend", choices=("torch", "reference"), default="torch", help="torch (default) or reference")
    g.add_argument("--device", metavar="DEV", help="torch: where to run (cpu, cuda, cuda:1); default: a GPU if any")
    g.add_argument(
        "--compile",
        choices=COMPILE_MODES,
        default="auto",
        help="torch: how the decode step runs: a traced graph replayed per token (graph; auto off a GPU), that "
        "graph captured as one CUDA graph (cudagraph; auto on one GPU), compiled by inductor (tens of seconds "
        "cold, cached; about 1.6x the tokens per second of graph on a CPU and of cudagraph on an H200: worth it "
        "for long generations), or the interpreter (none)",
    )
    g.add_argument("--plan", metavar="PLAN", help="a plan file for the prefill (see below)")
    g.add_argument("--decode-plan", metavar="PLAN", help="a plan file for the decode program")
    g.add_argument(
        "--nproc", type=int, metavar="N", help="run on N processes (torch.distributed), planned for N devices"
    )
    g.add_argument("--topology", "-t", metavar="T", help="with --nproc: the machine to plan for (default cpuxN)")
    g.add_argument("--time-limit", type=float, default=10.0, metavar="SEC", help="seconds per plan solved (default 10)")
    g.add_argument("--json", action="store_true", help='print JSON: {"ids": [...], "tokens_per_second": ...}')


def _ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise EdlError(f"bad --prompt-ids '{text}'", help="write token ids separated by commas: 1,2,3") from None
    if not ids:
        raise EdlError("--prompt-ids is empty", help="write token ids separated by commas: 1,2,3")
    return ids


def cmd_generate(args: argparse.Namespace) -> int:
    from edatalog.generation import generate

    if args.nproc is not None and args.nproc < 1:
        raise EdlError(f"--nproc must be at least 1, not {args.nproc}")
    gen = generate(
        args.file,
        args.weights,
        _ids(args.prompt_ids),
        args.max_new,
        decode=args.decode,
        dims=overrides(args.dim, "dim"),
        consts=overrides(args.const, "const"),
        dtype=args.dtype,
        backend=args.backend,
        device=args.device,
        plan=args.plan,
        decode_plan=args.decode_plan,
        nproc=args.nproc,
        topology=args.topology,
        time_limit=args.time_limit,
        compile=args.compile,
    )
    if args.json:
        print(
            json.dumps(
                {
                    "ids": gen.ids,
                    "tokens_per_second": gen.tokens_per_second,
                    "prefill_seconds": gen.prefill_seconds,
                    "decode_seconds": gen.decode_seconds,
                }
            )
        )
        return 0
    print(" ".join(str(t) for t in gen.ids))
    print(
        f"{len(gen.ids)} tokens in {gen.seconds:.3f} s: {gen.tokens_per_second:.1f} tokens/s measured "
        f"(prefill {gen.prefill_seconds * 1e3:.1f} ms, "
        f"{len(gen.ids) - 1} decode steps {gen.decode_seconds * 1e3:.1f} ms)"
    )
    return 0
