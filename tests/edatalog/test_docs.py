"""Every code block of the documentation runs, and prints what the documentation shows.

``README.md``, ``docs/language.md`` and ``docs/plans.md`` are checked block by block, in order.
Each document has its own scratch directory, which is the working directory while its blocks run
(``programs/`` is linked into it): files a block writes, such as ``plan.json``, are there for the
blocks after it, and the Python blocks of a document share one namespace, as in a notebook.

A block's info string says what it is (:data:`KINDS`; an unknown one fails), optionally followed
by a file name: ```` ```edl softmax.edl ```` also saves the program as ``softmax.edl`` and compiles
it under that name, ```` ```toml my-box.toml ```` saves the machine file.

Output is compared where the documentation shows it: a ``text`` block holds what the block
before it printed (stdout and stderr, as a terminal shows them), and a ``console`` block holds
``$ edl ...`` commands, each followed by its output (a command with no lines after it has its
output left out).  A line ``...`` on its own stands for any number of lines.  Only what is
genuinely variable is normalized (:data:`VARIABLE`): wall-clock times and the rates computed from
them, and what a solve under a wall-clock time limit finds (a solved plan's row in the comparison
with Megatron, their ratio, the solver's line); in a block where something was normalized, runs of
spaces and dashes count as one, since table columns widen with their values.

Not run as written: README's ``scripts/setup && ...`` commands run only the part after ``&&``
(creating a virtual environment is out of scope for a test), and ``python -m pytest`` there is
this very suite, so it is collected in a subprocess rather than run (which would recurse).
``docs/benchmarks.md`` is a recorded run of a six-minute benchmark against a wall clock: its
commands are checked by the benchmark's own argument parser, not run, and its output is not
compared.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import re
import shlex
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import edatalog
from edatalog import EdlError, cli
from edatalog.cli import main
from edatalog.ir import dtypes
from edatalog.ir.graph import AGG_NAMES
from edatalog.ir.scalar import COMPARISONS
from edatalog.lang.parser import CONTEXTUAL, KEYWORDS
from edatalog.rules.select import SELECTIONS

ROOT = Path(__file__).resolve().parents[2]
LANGUAGE = ROOT / "docs" / "language.md"
PLANS = ROOT / "docs" / "plans.md"
README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
DOCS = [README, LANGUAGE, PLANS]
MAX_CELLS = 1 << 18  # keep documentation examples small, so that this test stays fast

KINDS = {
    "edl": "a complete program: compiles without warnings (but those its '# warning: MESSAGE' comments "
    "announce) and runs on random inputs at its declared dims; it prints as its join-agg graph",
    "edl-error": "a program the compiler rejects with EdlError; its '# error: MESSAGE' comments are part of the "
    "message; it prints as the error",
    "edl-fragment": "an excerpt of a program, not checked",
    "python": "Python, run",
    "sh": "edl commands, run in-process (README's setup commands: see the module docstring)",
    "console": "'$ edl ...' commands, each followed by its output",
    "text": "what the block before it printed",
    "toml": "a machine file, loaded as a machine",
    "usage": "command synopses: every option named is one the command takes",
    "errors": "rows 'CALL  MESSAGE': a Python call on the program before it ('src' its text, 'prog' it compiled) "
    "or an edl command, failing with MESSAGE",
    "json-outline": "a JSON document in outline (elisions, comments): every key it names exists, its literal "
    "values are the real ones, and at the top level it names every key; of the file named after the info "
    "string, or of what the block before it printed",
    "ebnf": "the grammar: its keywords, types, aggregations and comparisons are the language's",
}

# Wall-clock times and rates, and what a solve under a wall-clock time limit finds: the only
# output that may differ from the documentation's.
VARIABLE = [
    (re.compile(r"\b\d+(?:\.\d+)? s(?![\w:])"), "<time> s"),
    (re.compile(r"\b\d+(?:\.\d+)?[kMGTP]?FLOP/s\b"), "<rate>FLOP/s"),
    (re.compile(r"^((?:auto|mesh) +)\d.*$", re.MULTILINE), r"\1<solved>"),
    (re.compile(r"^(\w+ / megatron:) .*$", re.MULTILINE), r"\1 <ratio>"),
    (re.compile(r"^solver: .*$", re.MULTILINE), "solver: <search>"),
]

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^\s`]*)[ \t]*([^`]*?)\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    info: str
    text: str
    file: str | None = None  # the file name after the info string

    @property
    def id(self) -> str:
        return f"{self.path.name}:{self.line}"

    def comments(self, tag: str) -> list[str]:
        """The texts of the ``# TAG: text`` comment lines of the block."""
        return [m.group(1).strip() for m in re.finditer(rf"^\s*#\s*{tag}:(.*)$", self.text, re.MULTILINE)]


def blocks_of(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, in order."""
    out: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    k = 0
    while k < len(lines):
        m = _FENCE.match(lines[k])
        if m is None:
            k += 1
            continue
        indent, fence, info, file = m.groups()
        end = k + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        body = [ln[len(indent) :] if ln.startswith(indent) else ln.lstrip() for ln in lines[k + 1 : end]]
        out.append(Block(path, k + 1, info, "\n".join(body) + "\n", file or None))
        k = end + 1
    return out


BLOCKS = [b for doc in DOCS for b in blocks_of(doc)]
# LLaMA-7B widths (solves against a 10 s clock, 7B-sized weights): seconds to tens of seconds each.
_SLOW = re.compile(r"llama_block\.edl [^\n]*--dim S=(?:128|512)\b")


def _param(block: Block) -> Any:
    return pytest.param(block, id=block.id, marks=[pytest.mark.slow] if _SLOW.search(block.text) else [])


# -- one document's run -------------------------------------------------------------------------------


@dataclass
class _Doc:
    """The blocks of one document, run in order in one scratch directory."""

    blocks: list[Block] = field(repr=False)
    workdir: Path
    namespace: dict[str, Any] = field(default_factory=dict, repr=False)
    done: int = 0
    failures: dict[int, BaseException] = field(default_factory=dict, repr=False)
    output: str | None = field(default=None, repr=False)  # what the last block printed, if comparable
    program: str | None = field(default=None, repr=False)  # the text of the last edl block

    def run_through(self, block: Block) -> None:
        """Run every block up to ``block`` not yet run (later blocks may need their files), then
        fail as ``block`` did."""
        k = self.blocks.index(block)
        while self.done <= k:
            b = self.blocks[self.done]
            self.done += 1
            try:
                with contextlib.chdir(self.workdir):
                    RUNNERS[b.info](self, b)
            except (Exception, pytest.fail.Exception) as exc:  # noqa: BLE001 - reported by its own test
                self.failures[self.done - 1] = exc
                self.output = None
        if k in self.failures:
            raise self.failures[k]


_DOCS: dict[Path, _Doc] = {}


@pytest.fixture
def doc(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> _Doc:
    block: Block = request.node.callspec.params["block"]
    if block.path not in _DOCS:
        workdir = tmp_path_factory.mktemp(block.path.stem)
        (workdir / "programs").symlink_to(ROOT / "programs")
        _DOCS[block.path] = _Doc(blocks_of(block.path), workdir)
    return _DOCS[block.path]


@contextlib.contextmanager
def _captured() -> Iterator[io.StringIO]:
    """stdout and stderr together, interleaved as a terminal shows them."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        yield buf


def _edl(command: str) -> tuple[int, str]:
    """Run an ``edl`` command line in-process: its exit status and its output."""
    argv = shlex.split(command, comments=True)
    assert argv and argv[0] in ("edl", ".venv/bin/edl"), f"not an edl command: {command}"
    with _captured() as buf:
        try:
            code = main(argv[1:])
        except SystemExit as exc:  # argparse: --help, or a usage error
            code = exc.code if isinstance(exc.code, int) else 1
    return code, buf.getvalue()


# -- comparing output ---------------------------------------------------------------------------------


def _normalized(text: str) -> tuple[str, bool]:
    out = "\n".join(line.rstrip() for line in text.strip("\n").splitlines())
    changed = False
    for pattern, replacement in VARIABLE:
        out, n = pattern.subn(replacement, out)
        changed |= n > 0
    return out, changed


def _unmatched(want: list[str], got: list[str]) -> list[str] | None:
    """The first run of documented lines that the output lacks, or None when it shows them all.
    Between ``...`` lines, runs of lines must appear in order: the first at the start of the
    output, the last at its end, the others each as early as it can (which finds a match
    whenever there is one)."""
    runs: list[list[str]] = [[]]
    for line in want:
        if line.strip() == "...":
            runs.append([])
        else:
            runs[-1].append(line)
    if len(runs) == 1:
        return None if got == runs[0] else runs[0]
    first, *middle, last = runs
    if got[: len(first)] != first:
        return first
    at = len(first)
    for run in middle:
        found = next((k for k in range(at, len(got) - len(run) + 1) if got[k : k + len(run)] == run), None)
        if found is None:
            return run
        at = found + len(run)
    end = len(got) - len(last)
    return None if end >= at and got[end:] == last else last or ["(the end of the output)"]


def assert_shows(expected: str, actual: str, where: str) -> None:
    """``actual`` is what ``expected`` shows, ``...`` lines standing for any lines."""
    want, w_changed = _normalized(expected)
    got, g_changed = _normalized(actual)
    if w_changed or g_changed:  # columns widen with the values normalized away
        want, got = (re.sub(r"-{2,}", "--", re.sub(r" {2,}", " ", t)) for t in (want, got))
    missing = _unmatched(want.splitlines(), got.splitlines())
    if missing is not None:
        shown = "\n".join(f"  | {line}" for line in missing)
        output = "\n".join(f"  | {line}" for line in got.splitlines())
        pytest.fail(f"{where}: the output does not show the documented lines\n{shown}\nThe output is:\n{output}")


# -- the kinds of block ---------------------------------------------------------------------------------


def _compile(block: Block) -> edatalog.Program:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", edatalog.EdlWarning)
        return edatalog.compile_string(block.text, name=block.file or block.id)


def _save(block: Block) -> None:
    if block.file is not None:
        Path(block.file).write_text(block.text, encoding="utf-8")


def run_program(doc: _Doc, block: Block) -> None:
    _save(block)
    prog = _compile(block)
    announced = block.comments("warning")
    got = [w.message for w in prog.warnings]
    for want in announced:
        assert any(want in g for g in got), f"{block.id}: expected a warning '{want}', got {got}"
    assert len(got) == len(announced), f"{block.id}: unexpected warnings {got}"
    cells = sum(math.prod(r.shape) for r in prog.graph.relations)
    assert cells <= MAX_CELLS, f"{block.id}: {cells} cells; use smaller dims in documentation examples"
    out = prog.run(prog.random_inputs(0))
    assert list(out) == list(prog.outputs)
    for name, value in out.items():
        rel = prog.graph.relation(name)
        assert isinstance(value, np.ndarray)
        assert value.shape == rel.shape, f"{block.id}: output {name}"
        assert value.dtype == dtypes.to_numpy(rel.dtype), f"{block.id}: output {name}"
    doc.output, doc.program = str(prog), block.text


def run_error(doc: _Doc, block: Block) -> None:
    _save(block)
    with pytest.raises(EdlError) as info:
        _compile(block)
    for want in block.comments("error"):
        assert want in info.value.message, f"{block.id}: the documented message is out of date"
    doc.output = str(info.value)


def run_python(doc: _Doc, block: Block) -> None:
    # The repository's own documentation, run as its readers would run it (never user input).
    code = compile(block.text, block.id, "exec")
    with _captured() as buf:
        exec(code, doc.namespace)
    doc.output = buf.getvalue()


def _commands(text: str) -> list[str]:
    """The command lines of a shell block, without comments; of ``scripts/setup && CMD``, CMD."""
    out = []
    for line in text.splitlines():
        command = " ".join(shlex.split(line, comments=True))
        if command:
            setup, sep, rest = command.partition(" && ")
            out.append(rest if sep and setup == "scripts/setup" else command)
    return out


def _collect_the_suite() -> tuple[int, str]:
    """README's test command is this suite: collected in a subprocess, not run (that would recurse)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    return proc.returncode, proc.stdout + proc.stderr


def run_shell(doc: _Doc, block: Block) -> None:
    printed = []
    for command in _commands(block.text):
        if command == ".venv/bin/python -m pytest":
            code, out = _collect_the_suite()
        else:
            code, out = _edl(command)
        assert code == 0, f"{block.id}: '{command}' failed with status {code}:\n{out}"
        printed.append(out)
    doc.output = "".join(printed)


def run_console(doc: _Doc, block: Block) -> None:
    steps: list[tuple[str, list[str]]] = []
    for line in block.text.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        else:
            assert steps, f"{block.id}: a console block starts with a '$ ' command"
            steps[-1][1].append(line)
    for command, shown in steps:
        code, out = _edl(command)
        assert code == (1 if out.startswith("error:") else 0), f"{block.id}: '{command}' exited {code}:\n{out}"
        if "".join(shown).strip():
            assert_shows("\n".join(shown), out, f"{block.id}: $ {command}")
    doc.output = None


def run_text(doc: _Doc, block: Block) -> None:
    assert doc.output is not None, f"{block.id}: a text block shows the output of the block before it, which has none"
    assert_shows(block.text, doc.output, block.id)
    doc.output = None


def run_toml(doc: _Doc, block: Block) -> None:
    assert block.file, f"{block.id}: name the machine file after the info string, e.g. ```toml my-box.toml"
    _save(block)
    edatalog.topology(block.file)
    doc.output = None


def _help(command: str) -> str:
    code, out = _edl(f"edl {command} --help")
    assert code == 0, out
    return out


def run_usage(doc: _Doc, block: Block) -> None:
    for line in block.text.splitlines():
        if not line.startswith("edl "):
            continue
        command = line.split()[1]
        text = _help(command)
        for option in re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", line):
            assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text), f"edl {command} has no {option}"
    doc.output = None


def run_errors(doc: _Doc, block: Block) -> None:
    assert doc.program is not None, f"{block.id}: an errors table follows the program it calls"
    names: dict[str, Any] = {"src": doc.program, "np": np, "compile_string": edatalog.compile_string}
    names["prog"] = edatalog.compile_string(doc.program)
    for row in block.text.splitlines():
        call, message = re.split(r"\s{2,}", row.strip(), maxsplit=1)
        if call.startswith("edl "):
            code, out = _edl(call)
            assert code == 1, f"{call}: exited {code}"
            got = out.splitlines()[0].partition("error: ")[2]
        else:
            with pytest.raises(EdlError) as info:
                # A call written in the repository's own documentation (never user input).
                eval(call, names)
            got = info.value.message
        assert got == message, f"{block.id}: {call} fails with '{got}'"
    doc.output = None


def _json_keys(value: Any) -> dict[str, list[Any]]:
    """Every key of a JSON document, at any depth, with the values it has."""
    out: dict[str, list[Any]] = {}
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            for k, item in v.items():
                out.setdefault(k, []).append(item)
                stack.append(item)
        elif isinstance(v, list):
            stack.extend(v)
    return out


_PAIR = re.compile(r'"([^"]+)":\s*("(?:[^"\\]|\\.)*"|-?\d[\d.eE+-]*|true|false|null)?')


def run_json_outline(doc: _Doc, block: Block) -> None:
    if block.file is not None:
        actual = json.loads(Path(block.file).read_text(encoding="utf-8"))
    else:
        assert doc.output is not None, f"{block.id}: an outline without a file shows the output of the block before"
        actual = json.loads(doc.output)
    keys = _json_keys(actual)
    for key, literal in _PAIR.findall(block.text):
        assert key in keys, f"{block.id}: no key '{key}' in the real document"
        if literal:
            assert json.loads(literal) in keys[key], f"{block.id}: '{key}' is {keys[key]}, not {literal}"
    top = re.findall(r'^ "([^"]+)":', block.text, re.MULTILINE)
    assert sorted(top) == sorted(actual), f"{block.id}: the top-level keys are {sorted(actual)}"
    doc.output = None


def run_ebnf(doc: _Doc, block: Block) -> None:
    terminals = set(re.findall(r'"([^"]+)"', block.text))
    words = {t for t in terminals if re.fullmatch(r"[a-z_][a-z0-9_]*", t)} - {"e"}  # e: a number's exponent
    want = set(KEYWORDS) | set(CONTEXTUAL) | set(dtypes.DTYPES)
    assert words == want, f"{block.id}: keywords and types {sorted(words)}"
    aggops = {t for t in terminals if t.endswith("=") and t not in COMPARISONS}
    assert aggops == set(AGG_NAMES) | set(SELECTIONS), f"{block.id}: aggregations {sorted(aggops)}"
    assert set(COMPARISONS) <= terminals, f"{block.id}: comparisons"
    doc.output = None


def skip(doc: _Doc, block: Block) -> None:
    doc.output = None


RUNNERS: dict[str, Callable[[_Doc, Block], None]] = {
    "edl": run_program,
    "edl-error": run_error,
    "edl-fragment": skip,
    "python": run_python,
    "sh": run_shell,
    "console": run_console,
    "text": run_text,
    "toml": run_toml,
    "usage": run_usage,
    "errors": run_errors,
    "json-outline": run_json_outline,
    "ebnf": run_ebnf,
}
assert RUNNERS.keys() == KINDS.keys()


# -- the tests --------------------------------------------------------------------------------------------


def test_the_language_reference_has_examples() -> None:
    kinds = [b.info for b in BLOCKS if b.path == LANGUAGE]
    assert kinds.count("edl") >= 10
    assert kinds.count("edl-error") >= 10


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_kind_is_known(block: Block) -> None:
    assert block.info in KINDS, f"{block.id}: unknown info string '{block.info}' (use one of {', '.join(KINDS)})"


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS if b.info in KINDS])
def test_block(block: Block, doc: _Doc) -> None:
    doc.run_through(block)


def _benchmark_parser(script: str) -> Callable[[list[str]], Any]:
    path = ROOT / script
    spec = importlib.util.spec_from_file_location(f"_documented_{path.stem}", path)
    assert spec is not None and spec.loader is not None, script
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    parse: Callable[[list[str]], Any] = module.parse_args
    return parse


def test_benchmark_commands_parse() -> None:
    """docs/benchmarks.md records long runs against a wall clock: its commands are not run, but
    the benchmark's parser (or edl's, for the calibration they start from) accepts every one."""
    commands = [c for b in blocks_of(BENCHMARKS) if b.info == "sh" for c in _commands(b.text)]
    assert commands
    for command in commands:
        program, *args = shlex.split(command.partition(">")[0])
        if program == ".venv/bin/edl":
            assert args[0] == "calibrate", command
            cli._parser().parse_args(args)
            continue
        script, *args = args
        assert program == ".venv/bin/python" and script.startswith("benchmarks/"), command
        assert os.path.exists(ROOT / script), command
        _benchmark_parser(script)(args)


def test_elisions_stand_for_any_lines() -> None:
    assert _unmatched(["a", "...", "c"], ["a", "b", "b", "c"]) is None
    assert _unmatched(["a", "...", "c", "...", "e"], list("abde")) == ["c"]
    assert _unmatched(["...", "x", "..."], list("abxcd")) is None
    assert _unmatched(["a"], ["a", "b"]) == ["a"]  # without an elision, nothing more
    assert _unmatched(["a", "..."], ["a", "b"]) is None
