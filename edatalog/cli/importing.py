"""``edl import``: a PyTorch module's forward as an ``.edl`` program (edatalog.importer)."""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path
from typing import Any

from edatalog.api import compile_string
from edatalog.cli.common import check_writable
from edatalog.errors import EdlError
from edatalog.importer import capture, to_edl

EPILOG = """\
examples:
  edl import mymodels:make_mlp --shape 2x5x16 -o mlp.edl
  edl import mymodels:make_classifier --shape 4x3x32x32 --shape 4:i64 -o clf.edl
  edl check mlp.edl
  edl import ./my-llama --shape 1x128 -o llama.edl

SPEC is package.module:factory: a callable (importable from the current directory) that
returns a torch.nn.Module, or a (module, example_args) pair; or a directory that transformers'
save_pretrained wrote (config.json and safetensors weights) of a causal LM, whose token ids
--shape gives (default 1x16): the program reads input_ids, writes logits, and loads that very
directory (edl run model.edl --weights DIR).  Given a module alone, --shape
gives each positional argument of its forward, in order: extents joined by x, and a dtype after
a colon (f32 by default; i64 arguments are drawn in [0, --high)).  The program's inputs are the
forward's argument names, its output y (y0, y1, ... for a tuple), and its params the module's
state_dict names with dots as underscores, each loading from its state_dict name, so the
module's saved weights load by name.  The importer runs torch.export; an op it has no rule for
is an error naming the op, the module and the source line (docs/importing.md lists the ops)."""


def add_parser(sub: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]) -> None:  # type: ignore[type-arg]
    i = sub.add_parser(
        "import", help="a PyTorch module's forward as an .edl program", epilog=EPILOG, formatter_class=formatter
    )
    i.add_argument("spec", metavar="SPEC", help="package.module:factory, or a save_pretrained directory (see below)")
    i.add_argument("--shape", action="append", default=[], metavar="SHAPE", help="an example argument: 2x5x16, 2x7:i64")
    i.add_argument("--high", type=int, default=2, metavar="N", help="integer example arguments are in [0, N)")
    i.add_argument("--seed", type=int, default=0, help="seed of the example arguments' values")
    i.add_argument("-o", "--output", metavar="PATH", help="write the program to PATH (default: print it)")


def cmd_import(args: argparse.Namespace) -> int:
    if args.output:
        check_writable(args.output)
    if Path(args.spec).is_dir():
        module, ids = _pretrained(Path(args.spec), args.shape, args.seed)
        text = to_edl(module, (), {"input_ids": ids})
    else:
        module, given = _load(args.spec)
        if given is not None and args.shape:
            raise EdlError(f"{args.spec} returns its example arguments; --shape is not taken", help="drop --shape")
        example = given if given is not None else tuple(_examples(args.shape, args.high, args.seed))
        text = to_edl(module, example)
    if args.output:
        try:
            Path(args.output).write_text(text, encoding="utf-8")
        except OSError as exc:  # a directory of that name, no room, no right to write
            raise EdlError(f"cannot write {args.output}: {exc.strerror or exc}", help="give -o a file path") from None
        graph = compile_string(text, name=args.output).graph  # as edl check counts them
        repeated = "".join(f", module {r.module} repeated {r.count} times" for r in graph.repeats)
        print(f"wrote {args.output}: {len(graph.nodes)} rules{repeated}", file=sys.stderr)
    else:
        print(text, end="")
    return 0


def _pretrained(path: Path, shapes: list[str], seed: int) -> tuple[Any, Any]:
    """A transformers causal LM saved by ``save_pretrained`` (its config.json and safetensors
    weights), and example token ids: ``--shape`` (default 1x16), drawn below its vocabulary."""
    if not (path / "config.json").is_file():
        raise EdlError(f"{path} has no config.json", help="give a directory that save_pretrained wrote")
    import torch
    import transformers

    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, use_safetensors=True)
    except (OSError, ValueError) as exc:
        raise EdlError(f"transformers cannot load {path}: {str(exc).splitlines()[0]}") from exc
    if len(shapes) > 1:
        raise EdlError("a causal LM takes one argument, its token ids", help="give one --shape, e.g. 1x16")
    (ids,) = _examples(shapes or ["1x16:i64"], int(model.config.vocab_size), seed)
    return model, ids.to(torch.int64)


def _load(spec: str) -> tuple[Any, tuple[Any, ...] | None]:
    """The module (and example arguments, if the factory gives them) of ``package.module:factory``."""
    name, _, attr = spec.partition(":")
    if not name or not attr:
        raise EdlError(f"'{spec}' is not package.module:factory", help="e.g. mymodels:make_mlp")
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        mod = importlib.import_module(name)
    except ImportError as exc:
        raise EdlError(f"cannot import {name}: {exc}", help="run edl import from the directory that has it") from exc
    factory = getattr(mod, attr, None)
    if not callable(factory):
        raise EdlError(f"{name} has no callable {attr}", help="name a function that returns the module")
    made = factory()
    import torch

    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module):
        return made[0], tuple(made[1])
    if not isinstance(made, torch.nn.Module):
        raise EdlError(f"{spec}() returned {type(made).__name__}, not a torch.nn.Module")
    return made, None


def _examples(shapes: list[str], high: int, seed: int) -> list[Any]:
    import torch

    if not shapes:
        raise EdlError("the factory gives no example arguments", help="give each with --shape, e.g. --shape 2x5x16")
    gen = torch.Generator().manual_seed(seed)
    out = []
    for text in shapes:
        m = re.fullmatch(r"(\d+(?:x\d+)*)(?::(\w+))?", text.strip())
        if m is None:
            raise EdlError(f"bad --shape '{text}'", help="extents joined by x, then an optional dtype: 2x5x16, 2x7:i64")
        extents = [int(x) for x in m.group(1).split("x")]
        dtype = m.group(2) or "f32"
        torch_dtype = {v: k for k, v in capture.DTYPES.items()}.get(dtype)
        if torch_dtype is None:
            raise EdlError(f"bad dtype '{dtype}' in --shape", help=f"one of {', '.join(capture.DTYPES.values())}")
        kind = getattr(torch, torch_dtype.removeprefix("torch."))
        if kind.is_floating_point:
            out.append(torch.randn(extents, generator=gen, dtype=kind))
        else:
            out.append(torch.randint(0, high, extents, generator=gen, dtype=kind))
    return out
