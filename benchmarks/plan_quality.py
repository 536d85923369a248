"""Plan quality: the solver's plans against the hand-written baselines on transformer blocks.

For every case (a LLaMA-style decoder block, its dims, a machine and a layer count) this plans the
block seven ways and prints what edatalog's cost model predicts for each:

  auto           the Z3 solver over any partition of every join space (space="join")
  mesh           the Z3 solver limited to GSPMD-style mesh plans (space="mesh")
  megatron       Megatron-LM tensor parallelism (hand-written baseline)
  megatron+r     the same, refined as auto plans are (pipelined chunks, balanced splits) if faster
  megatron-sp    Megatron with sequence parallelism (norms and residuals split along S)
  megatron-sp+r  the same, refined
  data           data parallelism (hand-written baseline; with B=1 there is no batch to split)
  best start     the fastest of the solver's starting plans (greedy, one dim split everywhere, the
                 baselines' picks, two-level plans), each timed: what the search must beat

The best baseline of a case is the fastest of the baselines that fit; auto is compared with it.

Every device gets the block's share of an 80 GB GPU: 80 GB x 0.9 / layers.  The solver must fit
in it; baselines are built on the same machine and marked "over memory" where they do not fit.
The block runs in --dtype (default bf16, as these models are served and trained): its bytes and
its kernels' peak FLOP/s are that dtype's.

Times are *predicted* by the simulator's timeline under the machine's cost model, not measured.

  .venv/bin/python benchmarks/plan_quality.py                    # every case, a table
  .venv/bin/python benchmarks/plan_quality.py --cases 7B-S512 --time-limit 3
  .venv/bin/python benchmarks/plan_quality.py --json > results.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import edatalog
from edatalog import EdlError
from edatalog.ir.program import Kernel
from edatalog.solver import auto

PROGRAM = Path(__file__).resolve().parent.parent / "programs" / "llama_block.edl"
GPU_MEMORY = 80e9  # bytes: one 80 GB GPU
MEMORY_SHARE = 0.9  # of it for the layers' weights and activations
STRATEGIES = ("auto", "mesh", "megatron", "megatron+r", "megatron-sp", "megatron-sp+r", "data", "best start")
SOLVED = ("auto", "mesh")
BASELINES = ("megatron", "megatron+r", "megatron-sp", "megatron-sp+r", "data")
REFINED = "+r"  # a baseline's name with this suffix: the baseline refined (edatalog.plan(refine=True))

# LLaMA paper dims (Touvron et al. 2023, table 2): D, H, F, layers.  KVH = H (no GQA).
LLAMA = {
    "7B": (4096, 32, 11008, 32),
    "13B": (5120, 40, 13824, 40),
    "30B": (6656, 52, 17920, 60),
    "65B": (8192, 64, 22016, 80),
}


@dataclass(frozen=True)
class Case:
    """One block on one machine."""

    name: str
    dims: dict[str, int]
    topology: str
    layers: int
    llama: bool = False  # counts in the geometric means

    @property
    def memory(self) -> int:
        """Bytes per device for this block."""
        return int(GPU_MEMORY * MEMORY_SHARE / self.layers)


@dataclass
class Result:
    """One strategy's plan for one case; ``error`` set when there is none."""

    strategy: str
    predicted_ms: float | None = None
    bytes_moved: int | None = None
    peak_memory: int | None = None
    fits: bool | None = None
    solve_seconds: float | None = None  # the last solve (Solution.seconds)
    wall_seconds: float = 0.0  # the whole edatalog.plan call and its simulation
    solver: dict[str, Any] = field(default_factory=dict)
    how: str = ""  # where the plan came from: the solver's own or another shortlisted plan, refinements
    general: dict[str, int] = field(default_factory=dict)  # rule -> kernels on the general path (_general_kernels)
    error: str | None = None


def llama_dims(size: str, seq: int) -> tuple[dict[str, int], int]:
    d, h, f, layers = LLAMA[size]
    return {"B": 1, "S": seq, "D": d, "H": h, "KVH": h, "F": f}, layers


def all_cases() -> list[Case]:
    """The cases of the plan-quality issue, in order."""
    cases = []
    for size in LLAMA:
        for seq in (512, 2048):
            dims, layers = llama_dims(size, seq)
            cases.append(Case(f"{size}-S{seq}", dims, "a100x8", layers, llama=True))
    dims, layers = llama_dims("7B", 2048)
    for n in (2, 3, 4, 6):
        cases.append(Case(f"7B-S2048-a100x{n}", dims, f"a100x{n}", layers))
    qwen = {"B": 1, "S": 2048, "D": 3584, "H": 28, "KVH": 4, "F": 18944}
    cases.append(Case("Qwen2-7B-S2048", qwen, "a100x8", 28))
    cases.append(Case("7B-S2048-2x4", dims, "2x4", layers))
    return cases


def best_start(prog: edatalog.Program, case: Case) -> Result:
    """The fastest of the solver's starting plans that fits, each timed in the timeline: what
    the search must beat for its plan to be its own."""
    result = Result("best start")
    start = time.monotonic()
    machine = edatalog.topology(case.topology).with_memory(case.memory)
    timed = []
    for ir in auto.starting_plans(prog.graph, machine):
        plan = edatalog.Plan(ir, prog.graph, machine)
        if not plan.over_memory():
            timed.append(plan)
    if timed:
        plan = min(timed, key=lambda p: p.report.seconds)
        result.predicted_ms = plan.report.seconds * 1e3
        result.bytes_moved = int(plan.report.bytes_moved)
        result.peak_memory = int(max(plan.report.peak_memory.values()))
        result.fits = True
        result.how = f"of {len(timed)} starts that fit"
    else:
        result.error = "no starting plan fits"
    result.wall_seconds = time.monotonic() - start
    return result


def run_strategy(prog: edatalog.Program, case: Case, strategy: str, time_limit: float) -> Result:
    """Plan one way and read the simulator's report."""
    if strategy == "best start":
        return best_start(prog, case)
    result = Result(strategy)
    start = time.monotonic()
    try:
        if strategy in SOLVED:
            space = "join" if strategy == "auto" else "mesh"
            plan = edatalog.plan(
                prog, topology=case.topology, memory=case.memory, time_limit=time_limit, space=space, seed=0
            )
        else:
            machine = edatalog.topology(case.topology).with_memory(case.memory)
            refine = strategy.endswith(REFINED)
            base = strategy.removesuffix(REFINED)
            plan = edatalog.plan(prog, topology=machine, strategy=base, refine=refine, time_limit=time_limit)
            if refine:
                result.how = plan.refined or "as built"
        report = plan.report
        result.predicted_ms = report.seconds * 1e3
        result.bytes_moved = int(report.bytes_moved)
        result.peak_memory = int(max(report.peak_memory.values()))
        result.fits = not plan.over_memory()
        result.general = _general_kernels(report)
        if plan.solution is not None:
            sol = plan.solution
            result.solve_seconds = sol.seconds
            result.solver = {
                "estimate_ms": sol.predicted_ms,
                "lower_bound_ms": sol.lower_bound_ms,
                "optimal": sol.optimal,
                "gap": sol.gap,
                "plans_found": sol.plans_found,
                "chosen_by": sol.chosen_by,
                "origin": sol.origin,
                "refined": sol.refined,
            }
            # "search": a plan the Z3 search found that no start is; "start: ...": a starting
            # plan (greedy, one dim split everywhere, a baseline, two-level), kept because
            # the search did not beat it in the timeline; then the refinement kept, if any.
            result.how = ", ".join(p for p in (sol.origin, sol.refined and f"refined: {sol.refined}") if p)
    except EdlError as exc:
        result.error = str(exc).splitlines()[0]
    except Exception as exc:  # noqa: BLE001 - a crash is a result: record it and go on
        traceback.print_exc(file=sys.stderr)
        result.error = f"crash: {type(exc).__name__}: {exc}"
    result.wall_seconds = time.monotonic() - start
    return result


def _general_kernels(report: Any) -> dict[str, int]:
    """The kernels of the schedule as it runs (attention fused where it can be) that the
    runtime evaluates on its general path (attention's rules cut apart, elementwise blocks too
    large for one pass), which the presets do not price (no GPU measured their
    ``general_bandwidth``): a plan with many is predicted too fast.  Per rule, how many."""
    s = report.lowered
    names = [op.node for d, k, op in s.programs.ops() if s.costs[(d, k)].general and isinstance(op, Kernel)]
    return dict(sorted(Counter(names).items()))


def ratio(a: Result, b: Result) -> float | None:
    if a.predicted_ms is None or b.predicted_ms is None:
        return None
    return a.predicted_ms / b.predicted_ms


def geomean(values: Sequence[float]) -> float | None:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def best_baseline(results: dict[str, Result]) -> Result | None:
    """The fastest baseline that fits (plain or refined), or None when none does."""
    fitting = [results[s] for s in BASELINES if results[s].predicted_ms is not None and results[s].fits]
    return min(fitting, key=lambda r: r.predicted_ms or math.inf, default=None)


def summarize(cases: list[Case], results: dict[str, dict[str, Result]]) -> dict[str, Any]:
    """Geometric means over the LLaMA cases, and where auto beats or loses to the others."""
    llama = [c.name for c in cases if c.llama]
    means: dict[str, Any] = {}
    for s in STRATEGIES:
        ms = [results[c][s].predicted_ms for c in llama]
        have = [m for m in ms if m is not None]
        means[s] = {"ms": geomean(have), "cases": len(have)}
    best = {c.name: best_baseline(results[c.name]) for c in cases}
    ratios = {c.name: None if (b := best[c.name]) is None else ratio(results[c.name]["auto"], b) for c in cases}
    llama_ratios = [r for c, r in ratios.items() if c in llama and r is not None]
    all_ratios = [r for r in ratios.values() if r is not None]
    join_beats_mesh = [
        c.name for c in cases if (r := ratio(results[c.name]["auto"], results[c.name]["mesh"])) is not None and r < 1
    ]
    # The search's own: auto strictly faster than every start and every baseline, plain or refined.
    rivals = ("best start", *BASELINES)
    by_search = [
        c.name
        for c in cases
        if (a := results[c.name]["auto"].predicted_ms) is not None
        and all(r.predicted_ms is None or not r.fits or a < r.predicted_ms for s in rivals if (r := results[c.name][s]))
    ]
    return {
        "geomean_ms": means,
        "best_baseline": {c: None if b is None else b.strategy for c, b in best.items()},
        "geomean_auto_over_best_baseline_llama": geomean(llama_ratios),
        "geomean_auto_over_best_baseline_all": geomean(all_ratios),
        "auto_over_best_baseline": ratios,
        "auto_worse_than_best_baseline": [c for c, r in ratios.items() if r is not None and r > 1],
        "join_beats_mesh": join_beats_mesh,
        "found_by_search": by_search,
        "found_by_search_llama": [c for c in by_search if c in llama],
        "auto_general_kernels": {c.name: results[c.name]["auto"].general for c in cases},
    }


# -- output -------------------------------------------------------------------------------------


def _bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n}B"


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def _row(case: Case, r: Result, best: Result | None) -> list[str]:
    if r.error is not None:
        return [case.name, r.strategy, "n/a", "", "", "no plan*", "", f"{r.wall_seconds:.1f}", "", "n/a", ""]
    fits = "fits" if r.fits else "over memory"
    gap = ""
    if r.solver:
        gap = "optimal" if r.solver["optimal"] else f"{r.solver['gap']:.0%}"
    return [
        case.name,
        r.strategy,
        _num(r.predicted_ms, ".3f"),
        _bytes(r.bytes_moved),
        _bytes(r.peak_memory),
        fits,
        _num(r.solve_seconds, ".1f") if r.strategy in SOLVED else "",
        f"{r.wall_seconds:.1f}",
        gap,
        _num(None if best is None else ratio(r, best), ".3f") + ("  <- best" if r is best else ""),
        r.how,
    ]


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render(cases: list[Case], results: dict[str, dict[str, Result]], summary: dict[str, Any]) -> str:
    """The human-readable report: one row per case and strategy, then the means."""
    header = ["case", "strategy", "pred ms", "moved", "peak mem", "fits", "solve s", "plan s", "gap"]
    header += ["/best base", "how"]
    rows = []
    for c in cases:
        best = best_baseline(results[c.name])
        rows += [_row(c, results[c.name][s], best) for s in STRATEGIES]
    means = summary["geomean_ms"]
    n_llama = sum(c.llama for c in cases)
    lines = [_table(header, rows), ""]
    errors = [(c.name, r) for c in cases for r in results[c.name].values() if r.error is not None]
    for name, r in errors:
        lines.append(f"* {name} {r.strategy}: {r.error}")
    if errors:
        lines.append("")
    if n_llama:
        lines.append(f"geometric means over the {n_llama} LLaMA cases on a100x8:")
        for s in STRATEGIES:
            m = means[s]
            short = "" if m["cases"] == n_llama else f" (only {m['cases']} cases)"
            lines.append(f"  {s:<13} {_num(m['ms'], '.3f')} ms{short}")
        lines.append(f"  auto/best baseline {_num(summary['geomean_auto_over_best_baseline_llama'], '.3f')}")
    lines.append(f"auto/best baseline over all cases: {_num(summary['geomean_auto_over_best_baseline_all'], '.3f')}")
    worse = summary["auto_worse_than_best_baseline"]
    lines.append(f"auto slower than the best baseline on: {', '.join(worse) or 'none'}")
    found = summary["found_by_search_llama"]
    every = ", ".join(summary["found_by_search"]) or "none"
    lines.append(
        f"auto strictly faster than every start and every baseline (found by the search) on {len(found)} of "
        f"{n_llama} LLaMA cases: {', '.join(found) or 'none'}; of all cases: {every}"
    )
    beats = summary["join_beats_mesh"]
    lines.append(f"join-space plan strictly faster than the mesh-only plan on: {', '.join(beats) or 'none'}")
    general = [
        f"{c} ({', '.join(f'{rule} x{k}' for rule, k in rules.items())})"
        for c, rules in summary["auto_general_kernels"].items()
        if rules
    ]
    lines.append(
        "auto plans with kernels on the runtime's general path (not priced on these GPUs): "
        + (", ".join(general) or "none")
    )
    return "\n".join(lines)


def to_json(cases: list[Case], results: dict[str, dict[str, Result]], summary: dict[str, Any]) -> dict[str, Any]:
    return {
        "cases": [
            {
                "name": c.name,
                "dims": c.dims,
                "topology": c.topology,
                "layers": c.layers,
                "memory_per_device": c.memory,
                "results": {s: vars(results[c.name][s]) for s in STRATEGIES},
            }
            for c in cases
        ],
        **summary,
    }


# -- command line -------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    names = ", ".join(c.name for c in all_cases())
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog=(
            "Strategies: auto (solver, any partition), mesh (solver, GSPMD-style mesh plans only), "
            "megatron, megatron-sp and data (hand-written baselines; +r: refined as auto plans are).  Memory "
            "per device is 80 GB x 0.9 / layers; baselines that exceed it are still timed and marked 'over "
            "memory', and auto is compared with the fastest baseline that fits.  Times are predicted "
            f"by edatalog's cost model, not measured.  Cases: {names}."
        ),
    )
    p.add_argument(
        "--time-limit", type=float, default=10.0, help="seconds per solve, and per baseline's refinement (default 10)"
    )
    p.add_argument(
        "--cases", default="", help="comma-separated substrings; run the cases whose name contains any of them"
    )
    p.add_argument(
        "--dtype",
        default="bf16",
        choices=("bf16", "f16", "f32"),
        help="the block's float dtype: its bytes and its kernels' peak (default bf16; an A100 runs f32 at 1/16)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    wanted = [w for w in args.cases.split(",") if w]
    cases = [c for c in all_cases() if not wanted or any(w in c.name for w in wanted)]
    if not cases:
        print(f"no case matches {args.cases!r}", file=sys.stderr)
        return 2
    start = time.monotonic()
    results: dict[str, dict[str, Result]] = {}
    for i, case in enumerate(cases, 1):
        prog = edatalog.compile(str(PROGRAM), dims=case.dims, dtype=args.dtype)
        results[case.name] = {s: run_strategy(prog, case, s, args.time_limit) for s in STRATEGIES}
        parts = [
            f"{s} "
            + ("n/a" if r.predicted_ms is None else f"{r.predicted_ms:.3f}ms")
            + ("" if r.fits in (True, None) else " (over)")
            for s, r in results[case.name].items()
        ]
        took = sum(r.wall_seconds for r in results[case.name].values())
        print(f"[{i}/{len(cases)}] {case.name}: {', '.join(parts)}  ({took:.0f}s)", file=sys.stderr, flush=True)
    summary = summarize(cases, results)
    wall = time.monotonic() - start
    if args.json:
        data = to_json(cases, results, summary)
        print(json.dumps({"time_limit": args.time_limit, "dtype": args.dtype, "wall_seconds": wall, **data}, indent=1))
    else:
        print(render(cases, results, summary))
        print(f"benchmark wall time: {wall:.0f}s (time limit {args.time_limit:g}s per solve, {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
