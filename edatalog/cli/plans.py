"""`edl plan`, `edl explain` and `edl query`: plans on machines, why, and where everything is."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from edatalog.cli.common import Progress, check_writable, compile_args, print_warnings, seconds_since_start, table
from edatalog.errors import EdlError, did_you_mean
from edatalog.ir import printer
from edatalog.ir.printer import human
from edatalog.ir.regions import Region, runs_text
from edatalog.pipelined import pipelined_ms
from edatalog.plans import Plan, composed_ms, load_plan, make_plan
from edatalog.solver import auto, layers
from edatalog.solver import topology as machines
from edatalog.solver.explain import Priced, explain
from edatalog.solver.strategies import PIPELINED, compared_with

MIN_SOLVE_SECONDS = 0.5  # the least the solver gets, however long the rest took
OUTPUT_SECONDS = 0.5  # kept back from --time-limit for printing and writing the plan

EPILOG_PLAN = """\
A plan splits every rule's join space into blocks and gives each block a device; inputs and
params get a home.  From the plan and the machine, edatalog synthesizes each device's program
(computes, sends, partial reductions) and predicts its time with the machine's cost model.

strategies: auto (default: the Z3 solver chooses every partition and device, minimizing the
predicted time within each device's memory), or a baseline: replicate (device 0 does
everything), data (split the batch), zero (data, with a training step's update and
optimizer state sharded: ZeRO/FSDP), megatron (tensor parallelism for transformers),
megatron-sp (megatron with sequence parallelism: norms and residuals split along the
sequence), megatron-dp and megatron-sp-dp (on several nodes: megatron or megatron-sp inside
each node, the batch split across the nodes), random (seeded random uneven blocks, for
testing).  An auto plan is shown next to the best baseline practitioners run on the machine:
megatron on one node, megatron-dp or megatron-sp-dp across nodes.  --refine gives a baseline
the refinements an auto plan gets (below).
The solver's best plans are checked in the timeline, which overlaps steps its estimate adds
up; there a plan may also be pipelined (blocks cut into chunks along a dim every rule has,
such as the sequence, so that one chunk's exchange overlaps the next one's compute) or
balanced (causal work dealt out evenly), and the fastest that fits is kept: the "refined:"
line says which.

--space mesh limits the solver to what a device mesh can express (GSPMD, Alpa): even splits
that divide every extent.  The default, join, allows any partition of any join space.

examples:
  edl plan programs/llama_block.edl --topology a100x8 --dim S=512
  edl plan programs/llama_block.edl -t a100x8 --memory 2.25GB --time-limit 30 -o plan.json
  edl plan programs/llama_block.edl --topology a100x8 --strategy megatron
  edl plan programs/llama_block.edl -t a100x8 --dim S=2048 --dtype bf16 -s megatron-sp --refine
  edl plan programs/llama_block.edl -t 2x4 --dim S=512 -o plan.json --trace trace.json
  edl plan programs/attention.edl -t my-machine.toml --strategy data --json
"""

EPILOG_EXPLAIN = """\
Every candidate partition of the rules that write RELATION is priced where it stands in the
plan: its compute (busiest device), the reduction of its partial results, bringing its inputs
from their producers' layouts, and bringing its output to its readers.  The plan's choice is
marked; the cheapest other one is the runner-up.  Costs are the solver's estimates.

examples:
  edl explain plan.json attn
  edl explain plan.json qr --json
"""

EPILOG_QUERY = """\
examples:
  edl query plan.json              # per device: FLOPs, memory, traffic; per link: bytes
  edl query plan.json attn         # where the blocks of 'attn' are computed and where they live
  edl query plan.json --json
"""


def _plan_summary_rows(plan: Plan) -> list[list[str]]:
    r = plan.report
    return [
        [
            str(d),
            human(r.flops[d]),
            f"{human(r.peak_memory[d])}B",
            f"{human(r.sent[d])}B",
            f"{human(r.received[d])}B",
        ]
        for d in range(plan.ir.n_devices)
    ]


LINKS_SHOWN = 16  # more pairs of devices than this are summed up per kind of link (--full: every one)


def _print_summary(plan: Plan, full: bool = False, footer: bool = True) -> None:
    r = plan.report
    print(table(["device", "flops", "peak memory", "sent", "received"], _plan_summary_rows(plan), right=(1, 2, 3, 4)))
    links = sorted(r.bytes_per_link.items())
    if links and (full or len(links) <= LINKS_SHOWN):
        print()
        rows = [[f"{a} -> {b}", plan.topology.link(a, b).name, f"{human(v)}B"] for (a, b), v in links]
        print(table(["link", "kind", "bytes"], rows, right=(2,)))
    elif links:
        print()
        kinds: dict[str, list[tuple[tuple[int, int], int]]] = {}
        for pair, v in links:
            kinds.setdefault(plan.topology.link(*pair).name, []).append((pair, v))
        rows = []
        for kind, pairs in kinds.items():
            (a, b), most = max(pairs, key=lambda pv: pv[1])
            total = sum(v for _, v in pairs)
            rows.append([kind, str(len(pairs)), f"{human(total)}B", f"{a} -> {b}: {human(most)}B"])
        print(table(["links", "pairs", "bytes", "busiest pair"], rows, right=(1, 2)))
        print(f"({len(links)} pairs of devices exchange data; --full lists each)")
    if not footer:
        return
    print(
        f"\npredicted {r.seconds * 1e3:.4g} ms on {plan.topology.name}, {human(r.bytes_moved)}B moved, "
        f"peak memory {human(max(r.peak_memory.values()))}B"
    )
    idle = [d for d in range(plan.ir.n_devices) if r.flops[d] == 0]
    if idle and plan.ir.n_devices > 1:
        print(f"note: device{'s' if len(idle) > 1 else ''} {_runs(idle)} compute nothing in this plan")
    over = plan.over_memory()
    if over:
        cap = plan.topology.devices[over[0]].memory
        print(
            f"warning: the plan does not fit: device{'s' if len(over) > 1 else ''} {', '.join(map(str, over))} "
            f"need{'' if len(over) > 1 else 's'} more than {human(cap)}B at peak"
        )


def _check_plan_args(args: argparse.Namespace) -> None:
    """Numbers that no plan can honour, refused before any work (argparse takes ``-1`` as a
    number; ``--memory -5GB`` reaches here glued to its option, see ``cli.main``)."""
    if not (math.isfinite(args.time_limit) and args.time_limit > 0):
        raise EdlError(
            f"--time-limit must be a positive number of seconds, not {args.time_limit:g}",
            help="give the solver time to search, e.g. --time-limit 10 (the default)",
        )
    if args.stages is not None and args.strategy != "auto":
        raise EdlError(
            "--stages splits the layers the solver plans; it goes with --strategy auto",
            help="drop --strategy, or --stages",
        )
    if args.memory is not None and machines.quantity(args.memory, "B", "--memory") <= 0:
        raise EdlError(
            f"--memory must be positive: it is the memory of each device, not {args.memory!r}",
            help="give a size such as --memory 9GB or --memory 80GiB, or leave it out for the machine's",
        )


def cmd_plan(args: argparse.Namespace) -> int:
    _check_plan_args(args)
    for path in (args.output, args.trace):
        if path:
            check_writable(path)
    prog = compile_args(args)
    baseline = None
    baseline_name = "megatron"
    # A model with repeated layers is reported as its solve composes it (a layer's timeline times
    # the layers, plus the rest's), unless the whole model's timeline is asked for.
    composed = layers.repeated(prog.graph) is not None and not (args.full or args.trace or args.json)
    composed_baselines: list[tuple[str, float, str]] = []  # each baseline composed: name, predicted ms, its shape
    if args.strategy == "auto":
        began = seconds_since_start()
        # The best of the baselines a practitioner would run on this machine (tensor parallelism
        # inside a node; across nodes, with data parallelism between them, and for a model,
        # pipeline stages across them too), built and timed here, before the solver's budget is
        # set.  None: not a transformer.
        best_ms: float | None = None
        options = {"reduction": args.reduction, "memory": args.memory, "collectives": args.collectives}
        for name in compared_with(machines.resolve(args.topology), layered=composed):
            shape = ""
            try:
                if name in PIPELINED:  # priced from one node's timelines; never built whole
                    pipe = pipelined_ms(prog, args.topology, name, **options)
                    ms, built, shape = pipe.ms, None, pipe.shape
                elif composed:  # a layer's timeline times the layers, plus the rest's
                    ms, built = composed_ms(prog, args.topology, name, **options)[0], None
                else:
                    built = make_plan(prog, args.topology, name, **options)
                    ms = built.report.seconds * 1e3
            except EdlError:
                continue
            if composed:
                composed_baselines.append((name, ms, shape))
            if best_ms is None or ms < best_ms:
                best_ms, baseline_name, baseline = ms, name, built
        # --time-limit is what the user waits for the whole command: the solver gets what starting,
        # compiling and the baseline left, less a moment for printing.  When a model with repeated
        # layers will be timed whole, about what the baseline's whole-model timeline took is kept
        # back for it too.
        whole = baseline is not None and layers.repeated(prog.graph) is not None
        whole_check = seconds_since_start() - began if whole else 0.0
        limit = max(MIN_SOLVE_SECONDS, args.time_limit - seconds_since_start() - OUTPUT_SECONDS - whole_check)
        with Progress() as progress:
            task = progress.task("building", limit)

            def show(p: auto.Progress) -> None:
                # The phase, and the best plan so far: the solver's estimate while it searches,
                # the fastest checked in the timeline once checking starts.
                if p.phase == "building":
                    text = "building the model"
                elif p.phase == "solving":
                    text = f"solving: best {p.best_ms:.4g} ms" if p.best_ms is not None else "solving"
                else:
                    text = f"{p.phase}: best {p.checked_ms:.4g} ms" if p.checked_ms is not None else p.phase
                progress.update(task, p.elapsed, text)

            plan = make_plan(
                prog,
                args.topology,
                seed=args.seed,
                reduction=args.reduction,
                memory=args.memory,
                time_limit=limit,
                space=args.space,
                on_progress=show,
                stages=args.stages,
                collectives=args.collectives,
            )
    else:
        plan = make_plan(
            prog,
            args.topology,
            args.strategy,
            seed=args.seed,
            reduction=args.reduction,
            memory=args.memory,
            space=args.space,
            time_limit=args.time_limit,
            refine=args.refine,
            collectives=args.collectives,
        )
    if args.output:
        plan.save(args.output)
    if args.trace:
        plan.trace(args.trace)
    if args.json:
        data = {"summary": plan.summary(), "plan": json.loads(plan.ir.to_json())}
        if baseline is not None:
            data[baseline_name] = baseline.summary()
        print(json.dumps(data, indent=1))
        return 0
    print_warnings(prog)
    print(plan.ir if args.full else plan.ir.describe(plan.graph))
    print(f"\n{plan.topology}\n")
    if composed and plan.layered is not None:
        _print_composed(plan, composed_baselines)
    else:
        _print_summary(plan, args.full)
        if plan.solution is not None:
            _print_solve(plan, baseline, baseline_name)
    if plan.picked:
        print(f"picked: {plan.picked}")
    if plan.solution is None and args.refine:
        print(f"refined: {plan.refined}" if plan.refined else "refined: no refinement was faster; the plan as built")
    for path, what in ((args.output, "plan"), (args.trace, "trace")):
        if path:
            print(f"wrote {what} {path}")
    return 0


def _print_composed(plan: Plan, baselines: list[tuple[str, float, str]]) -> None:
    """A plan of a model with repeated layers, as its solve composed it: one layer's timeline
    (its devices' table), the prediction composed from it, and each baseline composed alike
    (name, predicted ms, its shape where it has one to tell)."""
    lay = plan.layered
    sol = plan.solution
    assert lay is not None and sol is not None
    layer_plan = lay.checked_layer.facade
    rep = layers.repeated(plan.graph)
    assert rep is not None
    print(f"one layer ({rep.prefix}.0), as solved alone on {layer_plan.topology.name} (its outputs on every device):")
    _print_summary(layer_plan, False, footer=False)
    ms = lay.layer_ms * lay.count + lay.outer_ms
    print(
        f"\npredicted {ms:.4g} ms on {plan.topology.name}: a layer {lay.layer_ms:.4g} ms x {lay.count} layers"
        + (f" ({lay.stages} pipeline stages)" if lay.stages > 1 else "")
        + f" + the rest {lay.outer_ms:.4g} ms (and the call's overhead), each timed alone"
        + " (--full times the whole model); "
        f"peak memory at most {human(lay.peak_bound)}B per device"
    )
    rows = [["auto", f"{ms:.4g}", f"{sol.seconds:.1f}", ""]]
    rows += [[name, f"{b_ms:.4g}", "-", shape] for name, b_ms, shape in sorted(baselines, key=lambda b: b[1])]
    print()
    print(table(["plan", "predicted ms", "solve s", "shape"], rows, right=(1, 2)))
    if baselines:
        name, b_ms, _ = min(baselines, key=lambda b: b[1])
        print(f"auto / {name}: {ms / b_ms:.3f} (all composed per layer)")
    _print_solver(sol)


def _print_solve(plan: Plan, baseline: Plan | None, baseline_name: str) -> None:
    """The solved plan next to the best baseline, and how the solve went."""
    sol = plan.solution
    assert sol is not None
    rows = []
    for name, p in (("auto" if plan.ir.strategy == "auto" else plan.ir.strategy, plan), (baseline_name, baseline)):
        if p is None:
            continue
        r = p.report
        solve = f"{p.solution.seconds:.1f}" if p.solution is not None else "-"
        rows.append(
            [
                name,
                f"{r.seconds * 1e3:.4g}",
                f"{human(r.bytes_moved)}B",
                f"{human(max(r.peak_memory.values()))}B",
                solve,
            ]
        )
    print()
    print(table(["plan", "predicted ms", "moved", "peak memory", "solve s"], rows, right=(1, 2, 3, 4)))
    if baseline is not None:
        ratio = plan.report.seconds / baseline.report.seconds
        print(f"{plan.ir.strategy} / {baseline_name}: {ratio:.3f}")
    _print_solver(sol)


def _runs(numbers: list[int]) -> str:
    """Ascending numbers with their runs folded: ``0, 2..5, 9`` (512 devices stay one line)."""
    return ", ".join(str(a) if a == b else f"{a}, {b}" if b == a + 1 else f"{a}..{b}" for a, b in printer.runs(numbers))


def _print_solver(sol: auto.Solution) -> None:
    """How the solve went: its time, gap, memory estimate, where the kept plan came from."""
    if sol.nested:
        print(f"nested: {sol.nested}; the solver's figures below are that group's")
    if not sol.searched and sol.skipped:
        print(
            f"solver: not searched ({sol.skipped}: its model would take minutes to build): the fastest "
            f"baseline checked is kept; planned in {sol.total_seconds:.1f} s (checking {sol.check_seconds:.1f}, "
            f"refining {sol.refine_seconds:.1f})"
        )
        if sol.origin:
            print(f"origin: {sol.origin}")
        return
    if not sol.searched:
        print(
            f"solver: building the model took the {sol.build_seconds:.1f} s the time limit left, so nothing "
            f"was searched: the fastest baseline checked is kept; planned in {sol.total_seconds:.1f} s "
            f"(checking {sol.check_seconds:.1f}, refining {sol.refine_seconds:.1f})"
            + (f", {sol.unchecked} baselines unchecked at the time limit" if sol.unchecked else "")
            + "\nhint: give --time-limit a few seconds more to search"
        )
        if sol.origin:
            print(f"origin: {sol.origin}")
        return
    proof = "optimal" if sol.optimal else f"gap at most {sol.gap:.0%} (lower bound {sol.lower_bound_ms:.4g} ms)"
    print(
        f"solver: {sol.plans_found} improving plan{'s' if sol.plans_found != 1 else ''} in {sol.seconds:.1f} s, "
        f"estimate {sol.predicted_ms:.4g} ms, {proof}; memory estimate {human(sol.memory_estimate)}B per device; "
        f"planned in {sol.total_seconds:.1f} s (building {sol.build_seconds:.1f}, searching "
        f"{sol.seconds - sol.build_seconds:.1f}, checking {sol.check_seconds:.1f}, refining {sol.refine_seconds:.1f})"
        + (f", {sol.unchecked} shortlisted unchecked at the time limit" if sol.unchecked else "")
    )
    if sol.infeasible:
        print(
            "note: by the solver's memory estimate (which errs high) no plan fitted; checked exactly in "
            "the simulator's accounting, this starting plan does"
        )
    elif sol.chosen_by == "timeline":
        print(
            "note: another plan on the solver's shortlist (a starting plan, or a baseline in its space) ran "
            "faster in the timeline, which overlaps steps the solver's estimate adds up; it is the one kept"
        )
    if sol.origin:
        if sol.origin == "search":
            found = "the search found it (no starting plan is it)"
        elif sol.origin.startswith("search: "):
            found = f"the search in the timeline found it ({sol.origin.removeprefix('search: ')})"
        else:
            found = f"a {sol.origin}"
        print(f"origin: {found}")
    if sol.refined:
        print(
            f"refined: {sol.refined} (checked in the timeline: chunks let one chunk's exchange overlap the "
            "next one's compute; a balanced split deals guarded work out evenly)"
        )


def cmd_explain(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    graph = plan.graph
    placed = {p.relation: p for p in plan.ir.inputs}
    if args.relation in placed:
        return _explain_placed(plan, args.relation, placed[args.relation].dtensor(plan.ir.n_devices), args.json)
    relations, rule_names = [r.name for r in graph.relations], [n.name for n in graph.nodes]
    if args.relation not in relations and args.relation not in rule_names:
        raise EdlError(
            f"no relation or rule '{args.relation}' in this plan's program",
            help=did_you_mean(args.relation, [*relations, *rule_names]) or f"relations: {', '.join(relations)}",
        )
    rules = [n.name for n in graph.producers(args.relation)] or [args.relation]  # or a rule, such as qr#1
    out: dict[str, Any] = {}
    for rule in rules:
        priced = explain(graph, plan.topology, plan.ir, rule)
        out[rule] = priced
    n = plan.ir.n_devices
    if args.json:
        print(json.dumps({rule: [_priced_json(p, n) for p in ps] for rule, ps in out.items()}, indent=1))
        return 0
    for rule, priced in out.items():
        chosen = next(p for p in priced if p.chosen)
        runner = next((p for p in priced if not p.chosen), None)
        shown = priced[:12] if chosen in priced[:12] else [*priced[:12], chosen]
        rows = [_priced_row(p, n) for p in shown]
        print(f"rule {rule}: {graph.node(rule)}")
        print(
            table(
                ["", "partition", "compute us", "reduce us", "in us", "out us", "total us"], rows, right=(2, 3, 4, 5, 6)
            )
        )
        if runner is not None:
            verdict = "cheaper than" if chosen.total <= runner.total else "dearer than"
            print(
                f"the plan's choice costs {chosen.total * 1e6:.1f} us, {verdict} the runner-up "
                f"({runner.describe(n)}) at {runner.total * 1e6:.1f} us"
            )
        if chosen.selective:
            rows_of = ", ".join(f"{name} {share:.0%}" for name, share in chosen.selective)
            print(
                f"the plan's blocks hold part of the routed range: of these inputs only the rows routed to "
                f"a block travel to it (an all-to-all; expected share of the rows: {rows_of})"
            )
        print()
    return 0


def _explain_placed(plan: Plan, name: str, placement: str, as_json: bool) -> int:
    """An input or param has no rule to price: the plan puts it somewhere at the start, so show
    where (its placement, and its blocks with their devices, as ``edl query`` does)."""
    view = {**_relation_view(plan, name), "placement": placement}
    if as_json:
        print(json.dumps(view, indent=1))
        return 0
    rel = plan.graph.relation(name)
    print(f"{rel.kind} {name} {list(rel.shape)} : {rel.dtype} is placed, not computed: {placement} from the start")
    print(f"(edl explain prices the rules that write a relation; {rel.kind}s have none)")
    _print_relation(plan, name, view, header=False)
    return 0


def _priced_row(p: Priced, n_devices: int) -> list[str]:
    costs = (p.compute, p.reduce, p.inbound, p.outbound, p.total)
    return ["*" if p.chosen else "", p.describe(n_devices), *(f"{v * 1e6:.1f}" for v in costs)]


def _priced_json(p: Priced, n_devices: int) -> dict[str, Any]:
    return {
        "partition": p.describe(n_devices),
        "reduce_axis": p.reduce_axis,
        "splits": {s.index: list(s.cuts) for s in p.tile.splits},
        "devices": [list(ds) for ds in p.tile.devices],
        "compute_us": p.compute * 1e6,
        "reduce_us": p.reduce * 1e6,
        "inbound_us": p.inbound * 1e6,
        "outbound_us": p.outbound * 1e6,
        "total_us": p.total * 1e6,
        "chosen": p.chosen,
        "selective": dict(p.selective),  # input -> expected share of its rows that travel
    }


def _relation_view(plan: Plan, name: str) -> dict[str, Any]:
    graph = plan.graph
    rel = graph.relation(name)
    computed = []
    for node in graph.producers(name):
        done = plan.schedule.blocks.get(node.name, set())
        for block in plan.ir.node(node.name).tile.blocks():
            computed.append(
                {
                    "rule": node.name,
                    "block": block.index,
                    "ranges": _ranges_json(block.ranges),
                    "devices": list(block.devices),
                    "empty": block.index not in done,
                }
            )
    layout = plan.schedule.outputs.get(name) if name in graph.outputs else plan.schedule.layout.get(name)
    lives = [{"region": _region_json(rel.axis_names, e.region), "devices": sorted(e.holders)} for e in layout or []]
    return {"relation": name, "kind": rel.kind, "shape": list(rel.shape), "computed": computed, "lives": lives}


def _region_json(names: tuple[str, ...], region: Region) -> dict[str, Any]:
    """Per axis ``{"start": a, "stop": b}`` for a range, ``{"runs": [[a, b], ...]}`` otherwise:
    as many entries as runs, however long the axis."""
    out: dict[str, Any] = {}
    for name, runs in zip(names, region.axes, strict=True):
        if len(runs) == 1:
            out[name] = {"start": runs[0][0], "stop": runs[0][1]}
        else:
            out[name] = {"runs": [[lo, hi] for lo, hi in runs]}
    return out


def _ranges_json(ranges: dict[str, tuple[int, int]]) -> dict[str, Any]:
    return {k: {"start": lo, "stop": hi} for k, (lo, hi) in ranges.items()}


def _region_text(region: dict[str, Any]) -> str:
    parts = []
    for name, r in region.items():
        if "runs" in r:
            parts.append(f"{name} {runs_text(tuple((lo, hi) for lo, hi in r['runs']))}")
        else:
            parts.append(f"{name} {r['start']}:{r['stop']}")
    return ", ".join(parts) or "(scalar)"


def _print_relation(plan: Plan, name: str, view: dict[str, Any], header: bool = True) -> None:
    """A relation's blocks, how each is computed, and where the relation lives once complete."""
    rel = plan.graph.relation(name)
    if header:
        print(f"{rel.kind} {rel.name} {list(rel.shape)} : {rel.dtype}")
    if view["computed"]:
        print("\ncomputed as")
        rows = [
            [
                c["rule"],
                str(c["block"]),
                _region_text(c["ranges"]),
                ",".join(map(str, c["devices"])),
                "skipped (empty)" if c["empty"] else "",
            ]
            for c in view["computed"]
        ]
        print(table(["rule", "block", "ranges", "devices", ""], rows))
    print("\nlives at" + (" (the end of the run)" if rel.name in plan.graph.outputs else ""))
    rows = [[_region_text(e["region"]), ",".join(map(str, e["devices"]))] for e in view["lives"]]
    print(table(["region", "devices"], rows))


def cmd_query(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    if args.relation is not None:
        names = [r.name for r in plan.graph.relations]
        if args.relation not in names:
            raise EdlError(
                f"no relation '{args.relation}' in this plan's program",
                help=did_you_mean(args.relation, names, "relations"),
            )
        view = _relation_view(plan, args.relation)
        if args.json:
            print(json.dumps(view, indent=1))
            return 0
        _print_relation(plan, args.relation, view)
        return 0
    summary = plan.summary()
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(plan)
    print(f"\n{plan.topology}\n")
    _print_summary(plan, full=True)
    return 0
