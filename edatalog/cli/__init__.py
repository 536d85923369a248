"""The ``edl`` command line: check, compile and run ``.edl`` programs; plan them on many devices,
query and draw the plans.

Human-readable tables by default, ``--json`` for machines.  User mistakes print as diagnostics
(``file:line:col: error: ...``) and exit with status 1; they never show a traceback.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence

from edatalog import __version__
from edatalog.backend.running.launch import rank_exit
from edatalog.backend.running.runtime import RUNTIMES
from edatalog.cli import calibrate, generate, importing, plans, programs, show, train
from edatalog.cli.common import COMPILE_MODES, command_began, positive_int, seed
from edatalog.errors import EdlError, show_notices
from edatalog.ir.dtypes import FLOATS

_RAW = argparse.RawDescriptionHelpFormatter


WEIGHTS_HELP = (
    "a checkpoint (a .safetensors file, or a model directory as save_pretrained writes it): params load by "
    "the checkpoint names the program declares, dims and consts from its config.json where the program names keys"
)


def _program_args(sp: argparse.ArgumentParser, json_help: str) -> None:
    sp.add_argument("file", metavar="FILE", help="the .edl program")
    sp.add_argument(
        "--dim",
        action="append",
        default=[],
        metavar="K=V",
        help="override a dim (repeatable); derived dims such as E = D / H follow",
    )
    sp.add_argument("--const", action="append", default=[], metavar="K=V", help="override a const (repeatable)")
    sp.add_argument(
        "--dtype",
        choices=FLOATS,
        help="re-type every float input and param (and so every float rule), e.g. bf16 for a program written in f32",
    )
    sp.add_argument("--json", action="store_true", help=json_help)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="edl",
        description="edatalog: tensor programs as Datalog rules over tensor relations.\n\n"
        "Write a model as rules in an .edl file; edl checks it, shows the join-agg graph it\n"
        "compiles to, runs it, and plans it on many devices.  The language reference is\n"
        "docs/language.md; plans and machines are described in docs/plans.md.",
        formatter_class=_RAW,
        epilog="run 'edl COMMAND --help' for the options and examples of each command",
    )
    p.add_argument("--version", action="version", version=f"edatalog {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    c = sub.add_parser(
        "check",
        help="report errors and warnings, and summarize relations",
        epilog=programs.EPILOG_CHECK,
        formatter_class=_RAW,
    )
    _program_args(c, "print the diagnostics and the summary as JSON")

    k = sub.add_parser(
        "compile",
        help="print the join-agg graph a program compiles to",
        epilog=programs.EPILOG_COMPILE,
        formatter_class=_RAW,
    )
    _program_args(k, "print the graph as JSON (the same as -o writes) instead of its text form")
    k.add_argument("-o", "--output", metavar="PATH", help="write the graph as JSON to PATH")

    r = sub.add_parser(
        "run", help="run a program and summarize its outputs", epilog=programs.EPILOG_RUN, formatter_class=_RAW
    )
    _program_args(r, "print the output summary as JSON instead of a table")
    r.add_argument("--inputs", metavar="PATH", help="input and param values: a .npz or .safetensors file")
    r.add_argument("--weights", metavar="PATH", help=WEIGHTS_HELP)
    r.add_argument("--random", metavar="SEED", type=seed, help="random values for inputs not given by --inputs")
    r.add_argument("-o", "--output", metavar="PATH", help="save the outputs to PATH (.npz or .safetensors)")
    r.add_argument("--plan", metavar="PLAN", help="run this plan (a file from 'edl plan -o')")
    r.add_argument(
        "--backend",
        choices=tuple(RUNTIMES),
        help="reference: whole tensors on numpy (default without --plan); sim: the plan's devices simulated "
        "(default with --plan); torch: for real, on --device, one process or --nproc",
    )
    r.add_argument(
        "--device",
        metavar="DEV",
        help="torch: cpu, cuda or cuda:N, or one per plan device, comma-separated (default: cuda if there is one)",
    )
    r.add_argument(
        "--nproc", type=positive_int, metavar="N", help="torch: start N processes, rank r running the plan's device r"
    )
    r.add_argument(
        "--collectives",
        choices=("auto", "on", "off"),
        default="auto",
        help="torch, with --plan: run exchanges that are all-reduces, reduce-scatters or all-gathers as one "
        "collective call (auto: the kinds the plan's machine runs faster so: every kind on NCCL, all-reduces "
        "only on gloo)",
    )
    r.add_argument(
        "--compile",
        choices=COMPILE_MODES,
        default="auto",
        help="torch: how each device's program runs: recorded once as a graph and replayed (graph; auto off a "
        "GPU), that graph captured as one CUDA graph (cudagraph; auto on one GPU), compiled by inductor (tens "
        "of seconds cold, cached), or interpreted op by op (none); the first call is interpreted, the second "
        "records",
    )
    r.add_argument("--repeat", type=positive_int, default=1, metavar="K", help="torch: time K calls (the median)")
    r.add_argument(
        "--warmup", type=int, default=2, metavar="W", help="torch: untimed calls first (default 2: interpret, record)"
    )
    r.add_argument(
        "--trace",
        metavar="PATH",
        help="with --plan: the timeline as Chrome trace JSON (predicted on sim; measured on torch)",
    )

    pl = sub.add_parser(
        "plan", help="plan a program on a machine and predict its cost", epilog=plans.EPILOG_PLAN, formatter_class=_RAW
    )
    _program_args(pl, "print the summary and the plan as JSON")
    pl.add_argument(
        "--weights", metavar="PATH", help="a checkpoint whose config.json sets the dims and consts (as edl run's)"
    )
    pl.add_argument(
        "--topology",
        "-t",
        metavar="T",
        default="a100x4",
        help="a preset (a100x8, h100x4, 2x4, ...) or a .toml/.json file (default a100x4)",
    )
    pl.add_argument(
        "--strategy",
        "-s",
        metavar="S",
        default="auto",
        help="auto (the solver, default), or a baseline: replicate, data, zero, megatron, megatron-sp, random",
    )
    pl.add_argument(
        "--refine",
        action="store_true",
        help="give a baseline the refinements auto plans get (pipelined chunks, balanced splits), kept if faster",
    )
    pl.add_argument(
        "--memory",
        "-m",
        metavar="BYTES",
        help="memory per device for this program, e.g. 9GB (default: the machine's); auto plans fit it",
    )
    pl.add_argument(
        "--time-limit",
        type=float,
        default=10.0,
        metavar="SEC",
        help="seconds for the whole command (default 10): auto's solver, checks and refinements get what "
        "starting, compiling and the megatron comparison leave; a baseline's --refine gets all of it",
    )
    pl.add_argument(
        "--space",
        choices=("join", "mesh"),
        default="join",
        help="auto's search space: join (any partition, default) or mesh (GSPMD/Alpa-style only)",
    )
    pl.add_argument("--seed", type=seed, default=0, help="seed of the solver and of the random strategy")
    pl.add_argument(
        "--reduction",
        choices=("auto", "direct", "hierarchical"),
        default="auto",
        help="how partial results spanning nodes are combined (auto: directly where the machine's library runs "
        "them as collectives, else inside each node first when the links between nodes are slower)",
    )
    pl.add_argument(
        "--full",
        action="store_true",
        help="print every rule's tile and every pair of devices' bytes (by default the layers of a repeated "
        "module tiled like its first are shown once, and many pairs are summed up per kind of link)",
    )
    pl.add_argument(
        "--collectives",
        choices=("auto", "on", "off"),
        default="auto",
        help="run exchanges that are all-reduces, reduce-scatters or all-gathers as one collective call "
        "(auto: the kinds the machine's library runs faster so: every kind on NCCL, all-reduces only on gloo)",
    )
    pl.add_argument(
        "--stages",
        type=positive_int,
        metavar="K",
        help="auto, a program with repeated layers: split them into K pipeline stages (default: the fewest that fit)",
    )
    pl.add_argument(
        "--outputs",
        metavar="NAMES",
        help="plan the program with these outputs instead of its own, comma-separated (layers.kr: every layer's kr)",
    )
    pl.add_argument("-o", "--output", metavar="PATH", help="save the plan (with its machine and program) to PATH")
    pl.add_argument("--trace", metavar="PATH", help="write the predicted timeline as Chrome trace JSON")

    ex = sub.add_parser(
        "explain",
        help="why the solver split a rule as it did: its cost, and the runner-up's",
        epilog=plans.EPILOG_EXPLAIN,
        formatter_class=_RAW,
    )
    ex.add_argument("plan", metavar="PLAN", help="a plan file from 'edl plan -o'")
    ex.add_argument("relation", metavar="RELATION", help="a relation (or rule, such as qr#1) of the program")
    ex.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")

    q = sub.add_parser(
        "query",
        help="where is everything: blocks, devices, links, time",
        epilog=plans.EPILOG_QUERY,
        formatter_class=_RAW,
    )
    q.add_argument("plan", metavar="PLAN", help="a plan file from 'edl plan -o'")
    q.add_argument("relation", metavar="RELATION", nargs="?", help="show where this relation's blocks are")
    q.add_argument("--json", action="store_true", help="print machine-readable JSON instead of tables")

    sh = sub.add_parser(
        "show",
        help="draw a plan: each relation's blocks coloured by device",
        epilog=show.EPILOG_SHOW,
        formatter_class=_RAW,
    )
    sh.add_argument("plan", metavar="PLAN", help="a plan file from 'edl plan -o'")
    sh.add_argument("relations", metavar="RELATION", nargs="*", help="the relations to draw (default: all)")
    sh.add_argument("-o", "--output", metavar="PATH", required=True, help="the picture to write (.png, .svg or .pdf)")

    calibrate.add_parser(sub, _RAW)
    generate.add_parser(sub, _RAW)
    train.add_parser(sub, _RAW)
    importing.add_parser(sub, _RAW)
    return p


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "check": programs.cmd_check,
    "compile": programs.cmd_compile,
    "run": programs.cmd_run,
    "plan": plans.cmd_plan,
    "query": plans.cmd_query,
    "explain": plans.cmd_explain,
    "show": show.cmd_show,
    "calibrate": calibrate.cmd_calibrate,
    "generate": generate.cmd_generate,
    "train": train.cmd_train,
    "import": importing.cmd_import,
}


# Options whose values may look negative (`--memory -5GB`): argparse would take the value for an
# option and say only "expected one argument"; glued to the option, it reaches the command, which
# says what is wrong with it.
_SIGNED_OPTIONS = ("--memory", "-m", "--time-limit")


def _glue_signed_values(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    k = 0
    while k < len(argv):
        arg = argv[k]
        value = argv[k + 1] if k + 1 < len(argv) else ""
        if arg in _SIGNED_OPTIONS and re.match(r"-[0-9.]", value):
            out.append(f"{'--memory' if arg == '-m' else arg}={value}")
            k += 2
        else:
            out.append(arg)
            k += 1
    return out


def main(argv: Sequence[str] | None = None) -> int:
    command_began()
    show_notices()
    args = _parser().parse_args(_glue_signed_values(sys.argv[1:] if argv is None else argv))
    return rank_exit(_command(args))  # a rank of torchrun's job exits with it, its way


def _command(args: argparse.Namespace) -> int:
    try:
        return COMMANDS[args.command](args)
    except EdlError as err:
        print(err, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
