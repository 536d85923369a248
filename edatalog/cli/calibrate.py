"""`edl calibrate`: measure this machine and write it as a machine file for ``--topology``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from edatalog.cli.common import COMPILE_MODES, Progress, table

EPILOG_CALIBRATE = """\
Measures this machine with torch and writes what it measured as a machine file (-o), for
--topology (edl plan, edl run) and edatalog.topology(FILE): plans are then predicted with this
machine's own rates instead of a preset's.

It starts --nproc ranks as the runtime runs them (one process each, gloo on CPU, NCCL on CUDA,
--threads torch threads each) and measures on all of them at once, since they share the machine:

  matmul        FLOP/s per dtype (f32; bf16, f16, f64 where they run at a useful rate) at the
                shapes of a transformer block; the median of --dtype's becomes the device's flops
  copy          a large copy, bytes read + written per second: the device's memory bandwidth
  kernel floor  what a small kernel launch costs in edatalog's torch runtime, run as --compile
  and call      says (as edl run will run it: replayed as a recorded graph by default, or
  overhead      interpreted with --compile none): chains of 16 and 64 small rules (a GEMM, a
                norm, an update, in turn, on 16 x 64 blocks); the difference per launch is the
                floor, the rest of the short chain's time the overhead of a call (torch's own
                dispatch of a 1-element add is recorded as torch_dispatch)
  general       the runtime's general evaluator (blocks no single torch call covers: a maximum
                or a guarded sum cut by its guard, as attention runs when a plan cuts it
                apart): causal scores and their row maxima timed; the maxima's bytes over
                the time beyond the roofline's become device.general_bandwidth
  links         latency (half a 4-byte ping-pong) and bandwidth (every rank sending and
                receiving at once) between ranks; an all-reduce of 4 bytes over its steps
                (a collective's latency per step); on gloo, the same through shared memory as
                the runtime runs it; all_reduce and reduce_scatter bus bandwidth;
                interference: matmuls timed alone and while that exchange runs, the share of
                the transfer's time they lose (near 1 when the computing cores move the bytes)

The file holds rates the ranks reached (the slowest rank's), not peaks, so its efficiency is
1.0; memory is the machine's available memory divided among the ranks (on CUDA, the GPU's).
Every raw number is kept in its [measured] table.  A full run takes a minute or two; --quick
measures tiny sizes in seconds, to check the setup (its numbers predict nothing).  Other
programs running meanwhile slow the machine down: calibrate a quiet machine.

examples:
  edl calibrate -o machine.toml                  # 2 CPU ranks, 1 thread each
  edl calibrate --nproc 4 --threads 2 -o cpu4.toml
  edl calibrate --device cuda --nproc 8 --dtype bf16 -o node.toml
  edl calibrate --nproc 1 --quick --json         # a quick check of the setup
  edl plan programs/llama_block.edl -t machine.toml --dim S=512 -s megatron
"""


def add_parser(sub: Any, formatter: type[argparse.HelpFormatter]) -> None:
    """The ``calibrate`` subcommand and its options."""
    c = sub.add_parser(
        "calibrate",
        help="measure this machine and write it as a machine file for --topology",
        description="Measure this machine (matmul rates, memory bandwidth, kernel floor, links between\n"
        "ranks) and write it as a machine file for --topology.",
        epilog=EPILOG_CALIBRATE,
        formatter_class=formatter,
    )
    c.add_argument("--nproc", type=int, default=2, metavar="N", help="ranks to start and measure (default 2)")
    c.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="what a rank runs on (default cpu)")
    c.add_argument(
        "--threads",
        type=int,
        metavar="T",
        help="torch threads per rank, as the runtime will use (default 1 with several ranks, else torch's)",
    )
    c.add_argument(
        "--dtype",
        choices=("f32", "bf16", "f16", "f64"),
        default="f32",
        help="the programs' dtype: its matmul rate becomes the device's flops (default f32)",
    )
    c.add_argument(
        "--compile",
        choices=COMPILE_MODES,
        default="auto",
        help="how the runtime whose floor is measured runs programs, as edl run --compile (default auto: graph)",
    )
    c.add_argument("--quick", action="store_true", help="tiny sizes, seconds: checks the setup, predicts nothing")
    c.add_argument("-o", "--output", metavar="PATH", help="write the machine file (.toml or .json) to PATH")
    c.add_argument("--json", action="store_true", help="print the machine and every measurement as JSON")


def cmd_calibrate(args: argparse.Namespace) -> int:
    from edatalog.backend.calibrating import calibrate as cal

    if args.output is not None:
        cal.check_output(args.output)  # before minutes of measuring
    opts = cal.Options(
        nproc=args.nproc,
        device=args.device,
        threads=args.threads,
        quick=args.quick,
        dtype=args.dtype,
        probe=probe_graphs(),
        compile=args.compile,
        general_probe=general_probe_graph(),
        class_probes=class_probe_graphs(),
        attention_probe=attention_probe_graph(args.device, args.quick, args.dtype),
    ).resolved()
    with Progress() as progress:
        task = progress.task("calibrating", 1)

        def report(done: float, total: float, what: str) -> None:
            progress.bar.update(task, completed=done, total=max(total, 1), description=what)

        result = cal.calibrate(opts, progress=report)
    if args.output is not None:
        result.save(args.output)
    if args.json:
        doc = {"topology": result.topology.to_dict(), "measured": result.measured, "output": args.output}
        print(json.dumps(doc, indent=1))
    else:
        _print(result, args.output)
    if args.output is None:
        print("note: nothing written; pass -o machine.toml to save the machine file", file=sys.stderr)
    busy = result.measured.get("busy_cores")
    if busy is not None and busy >= cal.BUSY_CORES:
        print(
            f"note: other programs kept {busy:g} of {os.cpu_count()} cores busy when calibration began: these "
            "numbers describe a busier machine than a quiet one; calibrate again when it is idle",
            file=sys.stderr,
        )
    return 0


def probe_graphs() -> tuple[str, str]:
    """The runtime probes (:mod:`edatalog.backend.calibrating.probe`: the short and the long
    chain), compiled: the backend times them, but only this layer may compile ``.edl`` text."""
    from edatalog.api import compile_string
    from edatalog.backend.calibrating.probe import RULES, RULES_LONG, source

    short, long = (compile_string(source(n), name="<calibration probe>").graph.to_json() for n in (RULES, RULES_LONG))
    return short, long


def class_probe_graphs() -> tuple[tuple[str, str, str], ...]:
    """The kernel-class probes (:func:`edatalog.backend.calibrating.probe.class_source`), each
    class's short and long chain, compiled, in the order they are measured."""
    import warnings

    from edatalog.api import compile_string
    from edatalog.backend.calibrating.probe import CLASS_LINKS, CLASS_ORDER, class_source

    out = []
    with warnings.catch_warnings():  # each probe leaves some of the shared declarations unused
        warnings.simplefilter("ignore")
        for cls in CLASS_ORDER:
            short, long = (
                compile_string(class_source(cls, n), name=f"<{cls} probe>").graph.to_json() for n in CLASS_LINKS
            )
            out.append((cls.value, short, long))
    return tuple(out)


def general_probe_graph() -> str:
    """The general-path probe (:func:`edatalog.backend.calibrating.probe.general_source`), compiled."""
    from edatalog.api import compile_string
    from edatalog.backend.calibrating.probe import general_source

    return compile_string(general_source(), name="<general-path probe>").graph.to_json()


def attention_probe_graph(device: str, quick: bool, dtype: str) -> str:
    """The attention probe (:func:`edatalog.backend.calibrating.probe.attention_source`) at the
    device's probe sizes in the programs' dtype, compiled."""
    from edatalog.api import compile_string
    from edatalog.backend.calibrating.calibrate import sizes_for
    from edatalog.backend.calibrating.probe import attention_source

    source = attention_source(*sizes_for(device, quick).attention, dtype=dtype)
    return compile_string(source, name="<attention probe>").graph.to_json()


def _print(result: Any, output: str | None) -> None:
    from edatalog.backend.calibrating.calibrate import rate, seconds, size

    t, m = result.topology, result.measured
    d = t.devices[0]
    ranks = (
        f"{m['ranks']} rank{'s' if m['ranks'] != 1 else ''} x {m['threads']} thread{'s' if m['threads'] != 1 else ''}"
    )
    print(f"{ranks} on {m['device']} ({m['processor']}), torch {m['torch']}")
    if m["quick"]:
        print("--quick: tiny sizes, to check the setup; these numbers predict nothing")
    into = "-> "  # the rows the machine file takes its numbers from
    probe = m["matmul"]["f32"] and next(iter(m["matmul"]["f32"]))
    rows: list[list[str]] = []
    for dtype, entry in m["matmul"].items():
        for key, value in entry.items():
            if isinstance(value, float):
                rows.append([f"matmul {dtype} {key}", rate(value, "FLOP/s"), "probe" if key == probe else ""])
        if "skipped" in entry:
            rows.append([f"matmul {dtype}", "skipped", entry["skipped"]])
        if "too_slow" in entry:
            rows.append([f"matmul {dtype}", "skipped", "too slow at " + ", ".join(entry["too_slow"])])
        if dtype == m["dtype"]:
            rows.append([f"matmul {dtype} median", rate(d.flops, "FLOP/s"), f"{into}device.flops"])
    for k, (nbytes, value) in enumerate(m["copy"].items()):
        rows.append([f"copy {size(int(nbytes))}", rate(value, "B/s"), f"{into}device.bandwidth" if k == 0 else ""])
    mode = m["compile"]
    # this command always passes the probe
    floor_note = f"small rules run by edatalog's torch runtime ({mode}), per launch"
    rows.append(["kernel floor", seconds(t.kernel_floor), f"{floor_note} {into}kernel_floor"])
    for cls, floor in t.kernel_floors:
        rows.append([f"{cls} floor", seconds(floor), f"a small {cls} kernel, per launch {into}kernel_floors.{cls}"])
    rows.append(["call overhead", seconds(t.call_overhead), f"a call beyond its kernel launches {into}call_overhead"])
    rows.append(["torch dispatch", seconds(m["torch_dispatch"]), "a 1-element add: torch alone"])
    if "general" in m:
        g = m["general"]
        note = (
            f"causal row maxima: {seconds(g['seconds'])}, {seconds(g['roofline_seconds'])} by the roofline, "
            f"{size(g['bytes'])} on the general path {into}device.general_bandwidth"
        )
        rows.append(["general path", rate(g["bandwidth"], "B/s"), note])
    if "attention" in m:
        a = m["attention"]
        note = f"one fused causal attention: {seconds(a['seconds'])} a call {into}device.attention_flops"
        rows.append([f"attention {m['dtype']}", rate(a["flops_per_second"], "FLOP/s"), note])
    if "p2p" in m:
        p2p = m["p2p"]
        for k, (nbytes, value) in enumerate(p2p["one_way"].items()):
            note = "one way (half a ping-pong)" + (f" {into}links.intra.latency" if k == 0 else "")
            rows.append([f"p2p {size(int(nbytes))}", seconds(value), note])
        rows.append(["p2p bandwidth", rate(p2p["bandwidth"], "B/s"), "one way, the largest message"])
        ex = m["exchange"]
        note = f"per direction, all ranks at once {into}links.intra.bandwidth"
        rows.append([f"exchange {size(ex['bytes'])}", rate(ex["bandwidth"], "B/s"), note])
        small = m["small_all_reduce"]
        note = f"over its {small['steps']} steps {into}links.intra.collective_latency"
        rows.append([f"all_reduce {size(small['bytes'])}", seconds(small["seconds"]), note])
        if "small_exchange_all_reduce" in m:
            pair = m["small_exchange_all_reduce"]
            note = f"as pairwise exchanges, over its {pair['steps']} steps {into}links.intra.exchange_latency"
            rows.append([f"all_reduce {size(pair['bytes'])}", seconds(pair["seconds"]), note])
        if "small_shared_all_reduce" in m:
            shared = m["small_shared_all_reduce"]
            note = f"through shared memory, less its bytes {into}links.intra.shared_memory_latency"
            rows.append([f"all_reduce {size(shared['bytes'])}", seconds(shared["seconds"]), note])
        for op in ("all_reduce", "reduce_scatter"):
            rows.append([f"{op} {size(m[op]['bytes'])}", rate(m[op]["busbw"], "B/s"), "bus bandwidth"])
        ov = m["overlap"]
        note = (
            f"matmuls {seconds(ov['compute_seconds'])} alone, exchange {seconds(ov['exchange_seconds'])}, "
            f"both {seconds(ov['both_seconds'])} {into}links.intra.interference"
        )
        rows.append(["interference", f"{ov['interference']:.2f}", note])
    print()
    print(table(["measured", "value", "note"], rows, right=(1,)))
    print()
    print(t)
    print(
        f"  per device: {rate(d.flops, 'FLOP/s')} ({m['dtype']} matmul, median), {rate(d.bandwidth, 'B/s')} memory, "
        f"kernel floor {seconds(t.kernel_floor)}, call overhead {seconds(t.call_overhead)}, memory {size(d.memory)}"
        + (f", general path {rate(d.general_bandwidth, 'B/s')}" if d.general_bandwidth else "")
        + "".join(f", attention {rate(r, 'FLOP/s')} ({k})" for k, r in d.attention_peaks)
    )
    if t.n > 1:
        link = f"{rate(t.intra.bandwidth, 'B/s')} per direction, {seconds(t.intra.latency)} latency"
        link += f", {seconds(t.intra.step_latency)} per collective step"
        if t.intra.exchange_latency is not None:
            link += f", {seconds(t.intra.exchange_latency)} per exchange step"
        if t.intra.shared_memory_latency is not None:
            link += f", {seconds(t.intra.shared_memory_latency)} per shared-memory all-reduce"
        link += f", interference {t.intra.interference:.2f}"
        print(f"  link {t.intra.name}: {link}")
    if output is not None:
        print(f"wrote {output}: use it with --topology {output}")
