"""The pipeline flows one way: language -> rules -> solver -> backend.  No stage imports a later
one, and nothing imports the stage folders by their bare names (taken on PyPI)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Each stage and what it may import from edatalog.
ALLOWED = {
    "edatalog/lang": {"edatalog.errors", "edatalog.lang"},
    "edatalog/ir": {"edatalog.errors", "edatalog.ir"},
    "rules": {"edatalog.errors", "edatalog.lang", "edatalog.ir", "edatalog.rules"},
    "solver": {"edatalog.errors", "edatalog.lang", "edatalog.ir", "edatalog.rules", "edatalog.solver"},
    "backend": {"edatalog.errors", "edatalog.ir", "edatalog.solver", "edatalog.backend"},
}


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


@pytest.mark.parametrize("stage", sorted(ALLOWED))
def test_stages_import_only_earlier_stages(stage: str) -> None:
    files = sorted((ROOT / stage).rglob("*.py"))
    assert files
    for path in files:
        for name in _imports(path):
            if name == "edatalog" or name.startswith("edatalog."):
                ok = any(name == a or name.startswith(a + ".") for a in ALLOWED[stage])
                assert ok, f"{path.relative_to(ROOT)} imports {name}"


def test_no_bare_stage_imports() -> None:
    for path in sorted(ROOT.glob("**/*.py")):
        if ".venv" in path.parts:
            continue
        for name in _imports(path):
            assert name.split(".")[0] not in ("rules", "solver", "backend"), f"{path} imports {name}"


def test_stage_folders_are_linked_into_the_package() -> None:
    for stage in ("rules", "solver", "backend"):
        link = ROOT / "edatalog" / stage
        assert link.is_symlink() and link.resolve() == (ROOT / stage).resolve()
