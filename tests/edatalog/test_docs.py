"""The programs in the documentation compile, run, and fail exactly as the documentation says.

Every fenced block in ``docs/language.md`` (and ``README.md``, when there is one) whose info
string starts with ``edl`` is checked:

- ```` ```edl ````: a complete program.  It must compile without warnings (except those it
  announces with ``# warning: MESSAGE`` comments) and run on random inputs at its declared dims,
  which must be small.
- ```` ```edl-error ````: a program the compiler rejects with :class:`edatalog.EdlError`; a
  ``# error: MESSAGE`` comment, if present, must be part of the error's message.
- ```` ```edl-fragment ````: an excerpt, not checked.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import edatalog
from edatalog import EdlError
from edatalog.ir import dtypes

ROOT = Path(__file__).resolve().parents[2]
LANGUAGE = ROOT / "docs" / "language.md"
DOCS = [LANGUAGE, ROOT / "README.md"]
KINDS = ("edl", "edl-error", "edl-fragment")
MAX_CELLS = 1 << 18  # keep documentation examples small, so that this test stays fast

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^\s`]*)")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    info: str
    text: str

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
        indent, fence, info = m.groups()
        end = k + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        body = [ln[len(indent) :] if ln.startswith(indent) else ln.lstrip() for ln in lines[k + 1 : end]]
        out.append(Block(path, k + 1, info, "\n".join(body) + "\n"))
        k = end + 1
    return out


def _edl_blocks() -> list[Block]:
    return [b for doc in DOCS if doc.exists() for b in blocks_of(doc) if b.info.startswith("edl")]


BLOCKS = _edl_blocks()
PROGRAMS = [b for b in BLOCKS if b.info == "edl"]
ERRORS = [b for b in BLOCKS if b.info == "edl-error"]


def _compile(block: Block) -> edatalog.Program:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", edatalog.EdlWarning)
        return edatalog.compile_string(block.text, name=block.id)


def test_the_language_reference_has_examples() -> None:
    assert LANGUAGE.exists()
    assert len(PROGRAMS) >= 10
    assert len(ERRORS) >= 10


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_kind_is_known(block: Block) -> None:
    assert block.info in KINDS, f"{block.id}: unknown info string '{block.info}' (use one of {', '.join(KINDS)})"


@pytest.mark.parametrize("block", PROGRAMS, ids=[b.id for b in PROGRAMS])
def test_program_compiles_and_runs(block: Block) -> None:
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
        assert value.shape == rel.shape, f"{block.id}: output {name}"
        assert value.dtype == dtypes.to_numpy(rel.dtype), f"{block.id}: output {name}"
        assert isinstance(value, np.ndarray)


@pytest.mark.parametrize("block", ERRORS, ids=[b.id for b in ERRORS])
def test_error_example_fails_as_documented(block: Block) -> None:
    with pytest.raises(EdlError) as info:
        _compile(block)
    for want in block.comments("error"):
        assert want in info.value.message, f"{block.id}: the documented message is out of date"
