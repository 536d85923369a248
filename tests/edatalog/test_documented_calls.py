"""Every call of edatalog's Python API that the docs write inline (```edatalog.f(a, b, k=v)```)
names a function that exists and takes those arguments: as many positional ones (``...`` stands
for any), and keywords it has."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CALL = re.compile(r"`(edatalog(?:\.[A-Za-z_]\w*)+)\((.*?)\)`")


def _calls() -> list[tuple[str, str, str]]:
    out = []
    for doc in DOCS:
        for line_no, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for m in CALL.finditer(line):
                out.append((f"{doc.name}:{line_no}", m.group(1), m.group(2)))
    return out


def _resolve(dotted: str) -> Any:
    """``edatalog.f`` as ``import edatalog; edatalog.f`` finds it (a package's attribute before a
    submodule of the same name), importing submodules where the path needs them."""
    parts = dotted.split(".")
    obj: Any = importlib.import_module(parts[0])
    for k, part in enumerate(parts[1:], 2):
        obj = getattr(obj, part) if hasattr(obj, part) else importlib.import_module(".".join(parts[:k]))
    return obj


def _split(args: str) -> list[str]:
    """Top-level comma-separated arguments."""
    out, depth, cur = [], 0, ""
    for ch in args:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


CALLS = _calls()


def test_the_docs_write_calls() -> None:
    assert len(CALLS) >= 10, "the pattern finds the docs' calls"


@pytest.mark.parametrize(("where", "name", "args"), CALLS, ids=[f"{w} {n}" for w, n, _ in CALLS])
def test_a_documented_call_takes_what_the_docs_say(where: str, name: str, args: str) -> None:
    fn = _resolve(name)
    sig = inspect.signature(fn)
    parts = _split(args)
    keywords = {p.split("=", 1)[0].strip(): None for p in parts if re.match(r"^\w+\s*=", p)}
    positional = [p for p in parts if not re.match(r"^\w+\s*=", p)]
    if "..." in positional:
        sig.bind_partial(**keywords)
    else:
        sig.bind(*(None for _ in positional), **keywords)


def test_configured_takes_a_program_a_path_or_a_syntax_tree(tmp_path: Path) -> None:
    """docs/language.md section 18 calls configured(program, path) with a compiled program."""
    import edatalog
    from edatalog.checkpoint import configured
    from edatalog.lang.parser import parse_file

    (tmp_path / "config.json").write_text('{"hidden_size": 24, "num_hidden_layers": 3, "rms_norm_eps": 1e-6}')
    llama = ROOT / "programs" / "llama.edl"
    want = ({"D": 24, "L": 3}, {"eps": 1e-6})
    assert configured(edatalog.compile(llama), tmp_path) == want
    assert configured(str(llama), tmp_path) == want
    assert configured(parse_file(str(llama)), tmp_path) == want
    with pytest.raises(edatalog.EdlError, match="configured\\(\\) takes a program"):
        configured(42, tmp_path)
