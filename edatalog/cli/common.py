"""Helpers shared by the `edl` commands: overrides, tables, progress, array files."""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edatalog.backend.running.compiled import Compile
from edatalog.errors import EdlError
from edatalog.ir import dtypes
from edatalog.rules.sources import pattern

COMPILE_MODES = tuple(mode.value for mode in Compile)  # --compile's choices: the runtime's modes

STARTUP_SECONDS = 2.0  # a process older than this when a command begins was not started for it
_began = time.monotonic()  # when the running command began (set by ``command_began``)


def command_began() -> None:
    """Mark the start of a command: ``seconds_since_start`` counts from here, plus the process's
    own start-up (interpreter and imports) when the process was started for this command."""
    global _began
    _began = time.monotonic()
    up = _process_age()
    if up is not None and up < STARTUP_SECONDS:
        _began -= up


def seconds_since_start() -> float:
    """How long the user has waited for the running command so far."""
    return time.monotonic() - _began


def _process_age() -> float | None:
    """Seconds since this process started (from /proc on Linux; None elsewhere)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime", encoding="ascii") as f:
            return max(0.0, float(f.read().split()[0]) - started)
    except (OSError, ValueError, IndexError):
        return None


def seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"the seed must be a non-negative integer, not {text!r}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, not {text!r}")
    return value


def overrides(items: Sequence[str], what: str) -> dict[str, Any]:
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


def compile_args(args: argparse.Namespace) -> Any:
    import warnings

    from edatalog.api import compile as compile_program

    dims, consts = configured_args(args)
    with warnings.catch_warnings():  # the CLI prints warnings itself, as diagnostics
        warnings.simplefilter("ignore")
        outputs = getattr(args, "outputs", None)
        return compile_program(
            args.file,
            dims=dims,
            consts=consts,
            dtype=args.dtype,
            outputs=[n.strip() for n in outputs.split(",") if n.strip()] if outputs else None,
        )


def configured_args(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The dims and consts of a command: those a ``--weights`` checkpoint's config.json sets
    (where the program names their keys), then ``--dim`` and ``--const``, which win."""
    dims, consts = overrides(args.dim, "dim"), overrides(args.const, "const")
    weights = getattr(args, "weights", None)
    if weights is None:
        return dims, consts
    from edatalog.checkpoint import configured

    if not Path(weights).exists():
        raise EdlError(f"no such checkpoint: {weights}", help="give a .safetensors file or a model directory")
    if not Path(args.file).is_file():
        raise EdlError(f"no such program file: {args.file}")
    got_dims, got_consts = configured(args.file, weights)
    return {**got_dims, **dims}, {**got_consts, **consts}


def print_warnings(prog: Any) -> None:
    for w in prog.warnings:
        print(w.render(), file=sys.stderr)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> str:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def shape_text(rel: Any) -> str:
    return "[" + ", ".join(s if s == str(n) else f"{s}={n}" for s, n in zip(rel.symbols, rel.shape, strict=True)) + "]"


# -- commands -----------------------------------------------------------------------------------------


class Progress:
    """A progress display on stderr for long steps, shown only on a terminal (never in pipes,
    logs or --json output)."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        console = Console(stderr=True)
        self.bar = Progress(
            TextColumn("{task.description:<24}"),
            BarColumn(),
            TextColumn("{task.percentage:>3.0f}%"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            disable=not console.is_terminal,
        )

    def __enter__(self) -> Progress:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.__exit__(None, None, None)

    def task(self, name: str, total: float) -> Any:
        return self.bar.add_task(name, total=max(total, 1))

    def advance(self, task: Any, amount: float) -> None:
        self.bar.advance(task, amount)

    def update(self, task: Any, completed: float, description: str | None = None) -> None:
        if description:
            self.bar.update(task, completed=completed, description=description)
        else:
            self.bar.update(task, completed=completed)


ARRAY_FILES = (".npz", ".safetensors")


def check_writable(path: str) -> None:
    """Fail before any work when an output path cannot be written."""
    parent = Path(path).parent
    if not parent.is_dir():
        raise EdlError(f"cannot write {path}: the directory {parent} does not exist")


def check_array_file(path: str, what: str, must_exist: bool) -> Path:
    """Validate a --inputs or -o path before any work is done."""
    p = Path(path)
    if p.suffix not in ARRAY_FILES:
        raise EdlError(f"unsupported {what} file {path}", help="use a .npz or a .safetensors file")
    if must_exist and not p.is_file():
        raise EdlError(f"no such {what} file: {path}")
    if not must_exist:
        check_writable(path)
    return p


_ARRAYS_HELP = "write inputs with numpy.savez(path, x=x, ...) or safetensors' save_file(tensors, path)"


def load_program_inputs(path: str, prog: Any) -> dict[str, np.ndarray]:
    """``--inputs``: the values of the file whose names are the program's inputs and params.  A
    checkpoint given here (names the program declares as checkpoint names, not as its own; a
    stacked name's tensors too) is an error that says to pass it as ``--weights``."""
    values = load_inputs(path)
    own = {r.name for r in prog.arguments}
    foreign = [k for k in values if k not in own]
    declared = re.compile("|".join(pattern(src, False) for r in prog.arguments for src in r.sources) or "(?!)")
    if foreign and any(declared.fullmatch(k) for k in foreign):
        raise EdlError(
            f"{path} holds checkpoint names ('{foreign[0]}'), not the program's own",
            help=f"pass a checkpoint as --weights {path}: params load by the names the program declares",
        )
    return values


def load_inputs(path: str) -> dict[str, np.ndarray]:
    p = check_array_file(path, "inputs", must_exist=True)
    if p.suffix == ".npz" and not zipfile.is_zipfile(p):
        # np.load would try the file as a pickle and suggest allow_pickle: never do that.
        raise EdlError(
            f"{path} is not an .npz archive (a zip of .npy arrays, as numpy.savez writes)", help=_ARRAYS_HELP
        )
    try:
        if p.suffix == ".npz":
            with np.load(p, allow_pickle=False) as npz:
                return {k: npz[k] for k in npz.files}
        from safetensors.numpy import load_file

        return dict(load_file(str(p)))
    except Exception as exc:  # noqa: BLE001 - any failure to read is a bad file: report, never crash
        if "pickle" in str(exc):  # numpy's message suggests allow_pickle, which would run the file's code
            raise EdlError(
                f"cannot read inputs from {path}: it holds Python objects, and edatalog reads only plain arrays",
                help=_ARRAYS_HELP,
            ) from None
        raise EdlError(f"cannot read inputs from {path}: {exc}", help=_ARRAYS_HELP) from None


# The top-level fields of a plan file (docs/plans.md, "Plan files"), named when one is missing.
def save_outputs(path: str, outputs: dict[str, np.ndarray]) -> None:
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
