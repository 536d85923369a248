"""All-reduces between CPU ranks of one machine: gloo's own against edatalog's two routes.

Starts --nproc gloo ranks (one torch thread each) and, for each size (--sizes, bytes of f32),
times in turn each round a loop of ``--ops`` x (--kernels small matmuls, then an all-reduce),
as a tensor-parallel program meets its all-reduces: with ``dist.all_reduce``; through shared
memory (``edatalog.backend.running.shm_all_reduce``: each rank writes its slot of a segment
the ranks share, and reduces them all); as pairwise exchanges
(``edatalog.backend.running.exchange_all_reduce``: recursive doubling over blocking messages, a
power-of-two number of ranks); and the loop without the all-reduces.  Prints the median per
all-reduce of each, beyond the loop's kernels, their ratios to gloo's, and the route edatalog's
runtime takes between ranks of one machine (``all_reduce_route``; across machines it takes the
exchanges up to ``EXCHANGE_ALL_REDUCE_MAX_BYTES``): the evidence behind both rules, to rerun on
another machine before trusting them there.

  .venv/bin/python benchmarks/small_all_reduce.py
  .venv/bin/python benchmarks/small_all_reduce.py --nproc 4 --sizes 2048,65536 --repeat 5 --json

Times are measured on this machine: close everything else first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

DEFAULT_SIZES = "2048,16384,65536,131072,262144,2097152"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Time all-reduces between gloo CPU ranks: gloo's against edatalog's shared memory and "
        "pairwise exchanges.",
        epilog="example: .venv/bin/python benchmarks/small_all_reduce.py --sizes 2048,65536 --repeat 5",
    )
    p.add_argument("--nproc", type=int, default=2, help="ranks, a power of two (default 2)")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"bytes, comma-separated (default {DEFAULT_SIZES})")
    p.add_argument("--ops", type=int, default=4, help="all-reduces per loop (default 4)")
    p.add_argument("--kernels", type=int, default=40, help="small matmuls before each (default 40)")
    p.add_argument("--loops", type=int, default=50, help="loops per timed round (default 50)")
    p.add_argument("--repeat", type=int, default=5, help="timed rounds (default 5)")
    p.add_argument("--json", action="store_true", help="print every number as JSON instead of a table")
    args = p.parse_args(argv)
    if args.nproc < 2 or args.nproc & (args.nproc - 1):
        p.error(f"--nproc must be a power of two of at least 2 (the exchanges pair ranks), not {args.nproc}")
    try:
        args.parsed = [int(s) for s in args.sizes.split(",") if s]
    except ValueError:
        p.error(f"--sizes takes byte counts, e.g. 2048,65536; got {args.sizes!r}")
    if not args.parsed or min(args.parsed) < 4:
        p.error(f"--sizes takes byte counts of at least 4; got {args.sizes!r}")
    for name in ("ops", "kernels", "loops", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    return args


def rank_main(options: dict[str, Any]) -> dict[str, Any]:
    """One rank: each size's rounds, each contender once a round in turn; seconds per loop,
    the slowest rank's."""
    import torch
    import torch.distributed as dist

    from edatalog.backend.running import shm_all_reduce as shm
    from edatalog.backend.running.exchange_all_reduce import exchange_all_reduce_
    from edatalog.backend.running.spmd import init_group

    torch.set_num_threads(1)
    init_group("cpu")
    a, w = torch.randn(16, 32), torch.randn(32, 128)
    group = dist.group.WORLD
    if not shm.register(group, 300.0):
        raise SystemExit("the ranks cannot share memory here (not x86-64, or no /dev/shm)")
    out: dict[str, Any] = {}
    for nbytes in options["sizes"]:
        x = torch.ones(nbytes // 4)
        reduce = {
            "none": lambda: None,
            "gloo": lambda x=x: dist.all_reduce(x),
            "exchanges": lambda x=x: exchange_all_reduce_(x, "sum", group),
            "shared_memory": lambda x=x: shm.shm_all_reduce_(x, "sum", group.group_name),
        }

        def loop(name: str, reduce: Any = reduce) -> None:
            for _ in range(options["ops"]):
                for _ in range(options["kernels"]):
                    torch.mm(a, w)
                reduce[name]()

        times: dict[str, list[float]] = {name: [] for name in reduce}
        for name in reduce:  # warm-up
            loop(name)
        for _ in range(options["repeat"]):
            for name in reduce:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(options["loops"]):
                    loop(name)
                elapsed = torch.tensor([(time.perf_counter() - t0) / options["loops"]], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times[name].append(float(elapsed))
        out[str(nbytes)] = times
    return out


def summarize(times: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> list[dict[str, Any]]:
    from edatalog.solver.costmodel import all_reduce_route
    from edatalog.solver.topology import Library

    rows = []
    for nbytes, per in times.items():
        base = statistics.median(per["none"])
        each = {k: (statistics.median(per[k]) - base) / args.ops for k in ("gloo", "exchanges", "shared_memory")}

        def ratio(k: str, each: dict[str, float] = each) -> float:
            return each[k] / each["gloo"] if each["gloo"] > 0 else float("nan")

        rows.append(
            {
                "bytes": int(nbytes),
                "gloo_ms": each["gloo"] * 1e3,
                "exchanges_ms": each["exchanges"] * 1e3,
                "shared_memory_ms": each["shared_memory"] * 1e3,
                "ratio": ratio("exchanges"),
                "shared_memory_ratio": ratio("shared_memory"),
                "edatalog_takes": str(all_reduce_route(Library.GLOO, int(nbytes), args.nproc, one_node=True)),
                "rounds": per,
            }
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from edatalog.backend.running.launch import spawn

    options = {k: getattr(args, k) for k in ("ops", "kernels", "loops", "repeat")} | {"sizes": args.parsed}
    print(f"[small_all_reduce] {args.nproc} gloo ranks x 1 thread; sizes {args.parsed}", file=sys.stderr)
    got = spawn(args.nproc, rank_main, (options,))
    rows = summarize(got[0], args)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(
        f"{args.nproc} gloo ranks, 1 thread each; a loop of {args.ops} x ({args.kernels} matmuls 16x32x128, "
        f"then an f32 all-reduce); medians of {args.repeat} rounds of {args.loops} loops, the slowest rank's, "
        "less the loop without all-reduces, per all-reduce"
    )
    header = ("bytes", "gloo ms", "shared ms", "exchanges ms", "shared / gloo", "exchanges / gloo", "edatalog takes")
    table = [
        (
            str(r["bytes"]),
            f"{r['gloo_ms']:.3f}",
            f"{r['shared_memory_ms']:.3f}",
            f"{r['exchanges_ms']:.3f}",
            f"{r['shared_memory_ratio']:.2f}",
            f"{r['ratio']:.2f}",
            r["edatalog_takes"],
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(t[k]) for t in table)) for k, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for t in table:
        print("  ".join(c.ljust(w) for c, w in zip(t, widths, strict=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
