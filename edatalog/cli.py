"""The ``edl`` command line: check, compile and run ``.edl`` programs.

Human-readable tables by default, ``--json`` for machines.  User mistakes print as diagnostics
(``file:line:col: error: ...``) and exit with status 1; they never show a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edatalog import __version__
from edatalog.errors import EdlError
from edatalog.ir import dtypes

_EPILOG_CHECK = """\
examples:
  edl check programs/llama_block.edl
  edl check programs/llama_block.edl --dim S=4096 --json
"""

_EPILOG_COMPILE = """\
Each rule becomes one join-agg: a join of relations on shared indices, a scalar function, and an
aggregation over the indices the head does not keep.  Every line shows the rule as compiled (with
its effective guard), what it aggregates, and its FLOPs over the cells that exist.

examples:
  edl compile programs/attention.edl
  edl compile programs/llama_block.edl --json -o llama.json
"""

_EPILOG_RUN = """\
Inputs come from --inputs (a .npz or .safetensors file whose names match the program's inputs
and params) and/or --random SEED (random values for everything --inputs does not give: inputs
~ N(0,1), matrix params ~ N(0, 1/fan_in), vector params ~ 1 + N(0, 0.1²)).

examples:
  edl run programs/llama_block.edl --dim S=64 --dim D=256 --dim H=4 --dim KVH=2 --dim F=512 --random 0
  edl run programs/mlp.edl --inputs weights.safetensors -o out.npz
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="edl",
        description="edatalog: tensor programs as Datalog rules over tensor relations.\n\n"
        "Write a model as rules in an .edl file; edl checks it, shows the join-agg graph it\n"
        "compiles to, and runs it.  The language reference is docs/language.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="run 'edl COMMAND --help' for the options and examples of each command",
    )
    p.add_argument("--version", action="version", version=f"edatalog {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def common(sp: argparse.ArgumentParser, json_help: str) -> None:
        sp.add_argument("file", metavar="FILE", help="the .edl program")
        sp.add_argument(
            "--dim",
            action="append",
            default=[],
            metavar="K=V",
            help="override a dim (repeatable); derived dims such as E = D / H follow",
        )
        sp.add_argument("--const", action="append", default=[], metavar="K=V", help="override a const (repeatable)")
        sp.add_argument("--json", action="store_true", help=json_help)

    raw = argparse.RawDescriptionHelpFormatter
    c = sub.add_parser(
        "check", help="report errors and warnings, and summarize relations", epilog=_EPILOG_CHECK, formatter_class=raw
    )
    common(c, "print the diagnostics and the summary as JSON")
    k = sub.add_parser(
        "compile", help="print the join-agg graph a program compiles to", epilog=_EPILOG_COMPILE, formatter_class=raw
    )
    common(k, "print the graph as JSON (the same as -o writes) instead of its text form")
    k.add_argument("-o", "--output", metavar="PATH", help="write the graph as JSON to PATH")
    r = sub.add_parser("run", help="run a program and summarize its outputs", epilog=_EPILOG_RUN, formatter_class=raw)
    common(r, "print the output summary as JSON instead of a table")
    r.add_argument("--inputs", metavar="PATH", help="input and param values: a .npz or .safetensors file")
    r.add_argument("--random", metavar="SEED", type=_seed, help="random values for inputs not given by --inputs")
    r.add_argument("-o", "--output", metavar="PATH", help="save the outputs to PATH (.npz or .safetensors)")
    return p


# -- helpers ----------------------------------------------------------------------------------------


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"the seed must be a non-negative integer, not {text!r}")
    return value


def _overrides(items: Sequence[str], what: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        name, eq, text = item.partition("=")
        name, text = name.strip(), text.strip()
        if not eq or not name.isidentifier() or not text:
            raise EdlError(f"bad --{what} '{item}': expected NAME=VALUE, e.g. --{what} S=16")
        try:
            out[name] = int(text) if what == "dim" else float(text)
        except ValueError:
            kind = "an integer" if what == "dim" else "a number"
            raise EdlError(f"bad --{what} '{item}': the value must be {kind}") from None
    return out


def _compile(args: argparse.Namespace) -> Any:
    import warnings

    from edatalog.api import compile as compile_program

    with warnings.catch_warnings():  # the CLI prints warnings itself, as diagnostics
        warnings.simplefilter("ignore")
        return compile_program(args.file, dims=_overrides(args.dim, "dim"), consts=_overrides(args.const, "const"))


def _print_warnings(prog: Any) -> None:
    for w in prog.warnings:
        print(w.render(), file=sys.stderr)


def _human(n: float) -> str:
    for unit in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}E"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> str:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _shape(rel: Any) -> str:
    return "[" + ", ".join(s if s == str(n) else f"{s}={n}" for s, n in zip(rel.symbols, rel.shape, strict=True)) + "]"


# -- commands -----------------------------------------------------------------------------------------


def cmd_check(args: argparse.Namespace) -> int:
    prog = _compile(args)
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
                _shape(rel),
                rel.dtype,
                f"{_human(rel.nbytes)}B",
                str(len(nodes)) if nodes else "",
                bound + _human(flops) if nodes else "",
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
    _print_warnings(prog)
    print(_table(["relation", "kind", "shape", "dtype", "size", "rules", "flops", "support"], rows, right=(4, 5, 6)))
    n_warn = len(prog.warnings)
    print(
        f"\n{args.file}: ok, {len(graph.nodes)} rules, {_human(total)} FLOPs"
        + (f", {n_warn} warning{'s' if n_warn != 1 else ''}" if n_warn else "")
    )
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    prog = _compile(args)
    text = prog.graph.to_json()
    if args.output:
        try:
            Path(args.output).write_text(text + "\n", encoding="utf-8")
        except OSError as exc:
            raise EdlError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    if args.json:
        print(text)
    else:
        _print_warnings(prog)
        print(prog.graph)
        if args.output:
            print(f"\nwrote {args.output}", file=sys.stderr)
    return 0


class _Progress:
    """A progress display on stderr for long steps, shown only on a terminal (never in pipes,
    logs or --json output)."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        console = Console(stderr=True)
        self.bar = Progress(
            TextColumn("{task.description:<15}"),
            BarColumn(),
            TextColumn("{task.percentage:>3.0f}%"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            disable=not console.is_terminal,
        )

    def __enter__(self) -> _Progress:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.__exit__(None, None, None)

    def task(self, name: str, total: float) -> Any:
        return self.bar.add_task(name, total=max(total, 1))

    def advance(self, task: Any, amount: float) -> None:
        self.bar.advance(task, amount)


_ARRAY_FILES = (".npz", ".safetensors")


def _check_array_file(path: str, what: str, must_exist: bool) -> Path:
    """Validate a --inputs or -o path before any work is done."""
    p = Path(path)
    if p.suffix not in _ARRAY_FILES:
        raise EdlError(f"unsupported {what} file {path}", help="use a .npz or a .safetensors file")
    if must_exist and not p.is_file():
        raise EdlError(f"no such {what} file: {path}")
    if not must_exist and not p.parent.is_dir():
        raise EdlError(f"cannot write {path}: the directory {p.parent} does not exist")
    return p


def _load_inputs(path: str) -> dict[str, np.ndarray]:
    p = _check_array_file(path, "inputs", must_exist=True)
    try:
        if p.suffix == ".npz":
            with np.load(p, allow_pickle=False) as npz:
                return {k: npz[k] for k in npz.files}
        from safetensors.numpy import load_file

        return dict(load_file(str(p)))
    except Exception as exc:  # noqa: BLE001 - any failure to read is a bad file: report, never crash
        raise EdlError(f"cannot read inputs from {path}: {exc}") from None


def _save_outputs(path: str, outputs: dict[str, np.ndarray]) -> None:
    p = Path(path)
    try:
        if p.suffix == ".safetensors":
            from safetensors.numpy import save_file

            save_file({k: np.ascontiguousarray(v) for k, v in outputs.items()}, str(p))
            return
        arrays = {}
        for k, v in outputs.items():
            if dtypes.from_numpy(v.dtype) == "bf16":  # npz has no bfloat16: f32 holds it exactly
                print(f"note: {k} is bf16, saved to {path} as float32", file=sys.stderr)
                v = v.astype(np.float32)
            arrays[k] = v
        savez: Any = np.savez  # numpy's stub types **arrays as the allow_pickle flag
        savez(p, **arrays)
    except OSError as exc:
        raise EdlError(f"cannot write {path}: {exc.strerror or exc}") from None


def cmd_run(args: argparse.Namespace) -> int:
    if args.inputs is None and args.random is None:
        raise EdlError("no input values", help="pass --inputs FILE (.npz or .safetensors) or --random SEED")
    if args.output:
        _check_array_file(args.output, "output", must_exist=False)
    prog = _compile(args)
    values: dict[str, Any] = _load_inputs(args.inputs) if args.inputs is not None else {}
    with _Progress() as progress:
        missing = [r for r in prog.arguments if r.name not in values]
        if args.random is not None and missing:
            task = progress.task("random weights", sum(r.nbytes for r in missing))
            values.update(
                prog.random_inputs(
                    args.random, names={r.name for r in missing}, on_value=lambda _name, n: progress.advance(task, n)
                )
            )
        graph = prog.graph
        total_flops = sum(c.flops for c in graph.costs.values())
        task = progress.task("evaluating", total_flops)
        start = time.perf_counter()
        env = prog.evaluate(values, on_node=lambda n: progress.advance(task, graph.costs[n.name].flops))
        seconds = time.perf_counter() - start
    outputs = {name: env[name].data for name in prog.outputs}
    if args.output:
        _save_outputs(args.output, outputs)
    summary = {}
    for name in prog.outputs:
        val = env[name]
        arr = val.data.astype(np.float64)
        summary[name] = {
            "shape": list(arr.shape),
            "dtype": dtypes.from_numpy(val.data.dtype),
            "norm": float(np.linalg.norm(arr.ravel())),
            "mean": float(arr.mean()) if arr.size else 0.0,
            "finite": bool(np.isfinite(arr).all()),
            "absent": 0 if val.present is None else int((~val.present).sum()),
        }
    if args.json:
        print(json.dumps({"file": args.file, "seconds": seconds, "outputs": summary}, indent=1))
        return 0
    _print_warnings(prog)
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
    print(_table(["output", "shape", "dtype", "norm", "mean", "absent", "finite"], rows, right=(3, 4, 5)))
    flops = sum(c.flops for c in prog.graph.costs.values())
    rate = f", {_human(flops / seconds)}FLOP/s" if seconds > 0 and math.isfinite(seconds) else ""
    print(f"\nran {len(prog.graph.nodes)} rules in {seconds:.3f} s on the reference evaluator{rate}")
    if args.output:
        print(f"wrote {args.output}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handler = {"check": cmd_check, "compile": cmd_compile, "run": cmd_run}[args.command]
    try:
        return handler(args)
    except EdlError as err:
        print(err, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
