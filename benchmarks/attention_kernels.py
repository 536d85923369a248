"""Causal attention on a CPU: torch's kernel against edatalog's blocks of GEMMs.

For each shape (--shapes: rows x heads x head width, one batch, keys = rows, causal), times in
one process, in turn each round, torch's ``scaled_dot_product_attention`` (its CPU flash
kernel) and ``edatalog.backend.kernels.attention.gemm_attention`` on the same bf16 q, k, v
(laid out as (batch, rows, heads, width), as the rules and transformers' projections lay them
out), and prints medians, their ratio, each one's largest error against f64 attention over the
largest |reference|, and whether edatalog's torch runtime takes the GEMM form for that shape
(``gemm_attention_takes``).  This is the evidence behind ``GEMM_ATTENTION_MIN_ROWS`` and
``GEMM_ATTENTION_SCORES_BYTES``: rerun it on another machine before trusting them there.

  .venv/bin/python benchmarks/attention_kernels.py
  .venv/bin/python benchmarks/attention_kernels.py --shapes 512x16x64,2048x32x128 --repeat 5 --json

Times are measured on this machine: close everything else first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

DEFAULT_SHAPES = "128x4x64,256x16x64,512x4x64,512x16x64,1024x16x64,2048x32x128"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Time causal bf16 attention on a CPU: torch's kernel against edatalog's blocks of GEMMs.",
        epilog="example: .venv/bin/python benchmarks/attention_kernels.py --shapes 512x16x64 --repeat 10",
    )
    p.add_argument(
        "--shapes", default=DEFAULT_SHAPES, help=f"ROWSxHEADSxWIDTH, comma-separated (default {DEFAULT_SHAPES})"
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--repeat", type=int, default=15, help="timed rounds (default 15)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls of each first (default 3)")
    p.add_argument("--json", action="store_true", help="print every number as JSON instead of a table")
    args = p.parse_args(argv)
    try:
        args.parsed = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",") if s]
    except ValueError:
        p.error(f"--shapes takes ROWSxHEADSxWIDTH, e.g. 512x16x64; got {args.shapes!r}")
    if not args.parsed or any(len(s) != 3 or min(s) < 1 for s in args.parsed):
        p.error(f"--shapes takes ROWSxHEADSxWIDTH with positive sizes, e.g. 512x16x64; got {args.shapes!r}")
    return args


def time_shape(rows: int, heads: int, width: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from edatalog.backend.kernels.attention import gemm_attention, gemm_attention_takes

    gen = torch.Generator().manual_seed(rows * heads + width)
    q, k, v = (torch.randn(1, rows, heads, width, generator=gen).to(torch.bfloat16).transpose(1, 2) for _ in range(3))
    scale = width**-0.5
    calls: dict[str, Callable[[], Any]] = {
        "torch sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
        "gemm blocks": lambda: gemm_attention(torch, q, k, v, True, scale),
    }
    scores = q.double() @ k.double().transpose(-1, -2) * scale
    scores = scores.masked_fill(torch.ones(rows, rows, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.softmax(scores, dim=-1) @ v.double()
    top = float(want.abs().max())
    errors = {who: float((call().double() - want).abs().max()) / top for who, call in calls.items()}
    for _ in range(args.warmup):
        for call in calls.values():
            call()
    times: dict[str, list[float]] = {who: [] for who in calls}
    for _ in range(args.repeat):
        for who, call in calls.items():
            start = time.perf_counter()
            call()
            times[who].append(time.perf_counter() - start)
    ms = {who: statistics.median(ts) * 1e3 for who, ts in times.items()}
    return {
        "rows": rows,
        "heads": heads,
        "width": width,
        "ms": ms,
        "ratio": ms["gemm blocks"] / ms["torch sdpa"],
        "error": errors,
        "taken": gemm_attention_takes(q, k, True),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    results = [time_shape(*shape, args) for shape in args.parsed]
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "torch": torch.__version__, "results": results}))
        return 0
    print(f"attention: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}, ", end="")
    print(f"{torch.get_num_threads()} threads; causal, bf16, batch 1; {args.repeat} rounds, medians, measured\n")
    print(f"{'rows':>5} {'heads':>5} {'width':>5}  {'sdpa ms':>8} {'gemm ms':>8} {'gemm/sdpa':>9}  ", end="")
    print(f"{'sdpa err':>8} {'gemm err':>8}  edatalog takes")
    for r in results:
        print(f"{r['rows']:>5} {r['heads']:>5} {r['width']:>5}  {r['ms']['torch sdpa']:>8.3f} ", end="")
        print(f"{r['ms']['gemm blocks']:>8.3f} {r['ratio']:>9.2f}  {r['error']['torch sdpa']:>8.1e} ", end="")
        print(f"{r['error']['gemm blocks']:>8.1e}  {'gemm' if r['taken'] else 'sdpa'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
