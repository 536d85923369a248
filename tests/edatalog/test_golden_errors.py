"""Golden error messages, Soufflé style: every ``tests/golden/errors/NAME.edl`` is a small program
with one mistake, and ``NAME.expected`` holds the exact diagnostic a user sees for it.

The program is compiled under its path relative to the repository root, so the expected text has
stable locations such as ``tests/golden/errors/undefined_relation.edl:3:14``.  Programs named
``warning_*.edl`` must compile and produce warnings instead; their expected text is the rendered
warnings, separated by blank lines.

Overrides are given in leading comment lines, ``# dims: Q=3, N=4`` and ``# consts: eps=0.001``.

After a deliberate change to a message, regenerate with ``pytest --update-goldens`` and review
the diff of the ``.expected`` files like any other change.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

import edatalog

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "errors"
CASES = sorted(GOLDEN.glob("*.edl"))

_HEADER = re.compile(r"#\s*(dims|consts)\s*:(.*)")
_LOCATION = re.compile(r"^(?P<name>\S+):(?P<line>\d+):(?P<col>\d+): (?P<severity>error|warning): \S")
_CARET = re.compile(r"^ +\| [ \t]*\^~*$")


def _overrides(text: str) -> tuple[dict[str, int], dict[str, float]]:
    """``dims`` and ``consts`` overrides from the leading comment lines of a golden program."""
    dims: dict[str, int] = {}
    consts: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        m = _HEADER.match(line)
        if m is None:
            continue
        for item in m.group(2).split(","):
            key, _, value = item.partition("=")
            if m.group(1) == "dims":
                dims[key.strip()] = int(value)
            else:
                consts[key.strip()] = float(value)
    return dims, consts


def _render(path: Path) -> tuple[str, str]:
    """``("error" | "warning" | "none", text)`` for the golden program at ``path``."""
    text = path.read_text(encoding="utf-8")
    name = path.relative_to(ROOT).as_posix()
    dims, consts = _overrides(text)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", edatalog.EdlWarning)
        try:
            prog = edatalog.compile_string(text, name=name, dims=dims, consts=consts)
        except edatalog.EdlError as err:
            _check_error_shape(err, name)
            return "error", str(err)
    rendered = [d.render() for d in prog.warnings]
    # The same diagnostics reach Python's warning machinery, once each.
    assert [str(w.message) for w in caught if issubclass(w.category, edatalog.EdlWarning)] == rendered
    return ("warning" if rendered else "none"), "\n\n".join(rendered)


def _check_error_shape(err: edatalog.EdlError, name: str) -> None:
    """A golden error points into its program: ``file:line:col: error:``, the line, a caret."""
    assert err.span is not None, f"error without a location: {err}"
    lines = str(err).splitlines()
    m = _LOCATION.match(lines[0])
    assert m is not None and m.group("name") == name and m.group("severity") == "error", lines[0]
    assert len(lines) >= 3 and _CARET.match(lines[2]), f"no caret line under the source line:\n{err}"
    assert lines[1].rstrip("\n").endswith(err.span.source.line_text(err.span.line)), lines[1]


def _check_warning_shape(text: str, name: str) -> None:
    for block in text.split("\n\n"):
        lines = block.splitlines()
        m = _LOCATION.match(lines[0])
        assert m is not None and m.group("name") == name and m.group("severity") == "warning", lines[0]
        assert len(lines) >= 3 and _CARET.match(lines[2]), f"no caret line under the source line:\n{block}"


def test_golden_cases_exist() -> None:
    assert len(CASES) >= 40, f"expected the golden error programs in {GOLDEN}"
    orphans = sorted(p.name for p in GOLDEN.glob("*.expected") if not p.with_suffix(".edl").exists())
    assert not orphans, f".expected files without a program: {orphans}"


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_golden_error(path: Path, update_goldens: bool) -> None:
    name = path.relative_to(ROOT).as_posix()
    kind, actual = _render(path)
    is_warning_case = path.stem.startswith("warning_")
    if is_warning_case:
        assert kind == "warning", f"{name} should compile with warnings, but gave: {kind}\n{actual}"
        _check_warning_shape(actual, name)
    else:
        assert kind == "error", (
            f"{name} should fail to compile, but it compiled"
            + (f" with warnings:\n{actual}" if actual else " cleanly")
            + "; only warning_*.edl programs may compile"
        )
    expected_path = path.with_suffix(".expected")
    if update_goldens:
        expected_path.write_text(actual + "\n", encoding="utf-8")
        return
    if not expected_path.exists():
        pytest.fail(f"{expected_path.relative_to(ROOT)} is missing; create it with `pytest --update-goldens`")
    expected = expected_path.read_text(encoding="utf-8")
    assert actual + "\n" == expected, f"diagnostic for {name} changed; rerun with --update-goldens if intended"
