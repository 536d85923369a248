"""The pipeline flows one way: language -> rules -> solver -> backend.  No stage imports a later
one, nothing imports the stage folders by their bare names (taken on PyPI), and no module of the
package imports itself back through others: not even under ``if TYPE_CHECKING:``."""

from __future__ import annotations

import ast
import itertools
from collections.abc import Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("rules", "solver", "backend")  # top-level folders, linked into the package by these names

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


# The backend's own stages, in the order data flows through them, and what each may import of the
# backend: how one block is computed (kernels), plan to device programs (lowering), what they will
# cost (predicting), running them (running), measuring the machine by running probes (calibrating).
BACKEND_STAGES = {
    "kernels": {"kernels"},
    "lowering": {"kernels", "lowering"},
    "predicting": {"lowering", "predicting"},
    "running": {"kernels", "lowering", "running"},
    "calibrating": {"kernels", "lowering", "predicting", "running", "calibrating"},
}


def test_backend_folders_show_its_flow() -> None:
    """Every module of the backend lives in one of its stages, and imports only earlier ones."""
    loose = sorted(p.name for p in (ROOT / "backend").glob("*.py") if p.name != "__init__.py")
    assert not loose, f"backend modules outside a stage folder: {loose}"
    assert {p.name for p in (ROOT / "backend").iterdir() if p.is_dir() and p.name != "__pycache__"} == set(
        BACKEND_STAGES
    )
    for stage, allowed in BACKEND_STAGES.items():
        for path in sorted((ROOT / "backend" / stage).rglob("*.py")):
            for name in _imports(path):
                if name.startswith("edatalog.backend."):
                    used = name.split(".")[2]
                    assert used in allowed, f"{path.relative_to(ROOT)} ({stage}) imports {name}"


def test_no_bare_stage_imports() -> None:
    for path in sorted(ROOT.glob("**/*.py")):
        if ".venv" in path.parts:
            continue
        for name in _imports(path):
            assert name.split(".")[0] not in ("rules", "solver", "backend"), f"{path} imports {name}"


def test_stage_folders_are_linked_into_the_package() -> None:
    for stage in STAGES:
        link = ROOT / "edatalog" / stage
        assert link.is_symlink() and link.resolve() == (ROOT / stage).resolve()


# -- import cycles ------------------------------------------------------------------------------------

Edges = dict[str, dict[str, int]]  # module -> module it imports -> the line of one such import


def _package_modules(root: Path) -> dict[str, Path]:
    """Every module of the package under ``root`` by its dotted name: ``edatalog/...`` and the stage
    folders under the names they are linked in as (``solver/auto.py`` is ``edatalog.solver.auto``)."""
    trees = [(root / "edatalog", "edatalog"), *((root / s, f"edatalog.{s}") for s in STAGES)]
    modules: dict[str, Path] = {}
    for folder, prefix in trees:
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if prefix == "edatalog" and parts[0] in STAGES:
                continue  # a stage seen through its link: walked from its own folder
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((prefix, *parts))] = path
    return modules


def _import_graph(modules: dict[str, Path]) -> Edges:
    """Which modules of the package each one imports, anywhere in it: at the top, under ``if
    TYPE_CHECKING:``, or inside a function.  An import counts as one of the module it names
    (``from edatalog.solver import auto`` imports ``edatalog.solver.auto``; ``from edatalog.ir.graph
    import Graph`` imports ``edatalog.ir.graph``), relative ones resolved; the packages above it,
    which Python initializes first, are not counted (every module would import its own)."""

    def known(name: str) -> str | None:
        """The module ``name`` is, or the innermost one it lies in."""
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: Edges = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges = graph.setdefault(module, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    above = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*above, *([node.module] if node.module else [])])
                for a in node.names:
                    full = f"{base}.{a.name}"
                    targets.append(full if full in modules else known(base))
            for target in targets:
                if target is not None and target != module:
                    edges.setdefault(target, node.lineno)
    return graph


def _cycles(graph: Edges) -> list[tuple[list[str], list[str]]]:
    """Each group of modules that import each other (a strongly connected component, sorted), with
    one cycle through it: the path of modules, the first repeated at the end."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component: list[str] = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [(_cycle_in(graph, set(c), c[0]), c) for c in components]


def _cycle_in(graph: Edges, component: set[str], start: str) -> list[str]:
    """A shortest path from ``start`` back to itself within ``component``."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    return [*paths[v], start]
                if w in component and w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is in no cycle")


def _describe(cycle: Sequence[str], graph: Edges, modules: dict[str, Path], root: Path) -> str:
    steps = [f"{a} ({modules[a].relative_to(root)}:{graph[a][b]} imports {b})" for a, b in itertools.pairwise(cycle)]
    return " -> ".join([*steps, cycle[-1]])


def _cycle_report(root: Path) -> list[str]:
    modules = _package_modules(root)
    graph = _import_graph(modules)
    out = []
    for cycle, component in _cycles(graph):
        text = _describe(cycle, graph, modules, root)
        if len(component) > len(cycle) - 1:
            text += f" (the group also holds {', '.join(m for m in component if m not in cycle)})"
        out.append(text)
    return sorted(out)


def test_no_import_cycles_not_even_for_type_checking() -> None:
    """Data flows one way, and so do imports: a module lower in the flow that needs a higher one's
    type takes a protocol of its own, or a parameter, rather than importing it back."""
    modules = _package_modules(ROOT)
    assert {"edatalog.api", "edatalog.plans", "edatalog.ir.graph", "edatalog.solver.auto"} <= modules.keys()
    assert modules["edatalog.solver.auto"] == ROOT / "solver" / "auto.py"
    cycles = _cycle_report(ROOT)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_cycle_check_sees_type_checking_relative_and_lazy_imports(tmp_path: Path) -> None:
    """The check itself, on a made-up package: each of these imports closes a cycle."""
    _write(
        tmp_path,
        {
            "edatalog/__init__.py": "",
            "edatalog/ir/__init__.py": "",
            "edatalog/ir/graph.py": "from edatalog.ir.printer import render\n",
            "edatalog/ir/printer.py": "import typing\nif typing.TYPE_CHECKING:\n    from .graph import Graph\n",
            "edatalog/api.py": "from edatalog import plans\n",
            "edatalog/plans.py": "def f():\n    import edatalog.api\n",
            "edatalog/fine.py": "from edatalog.ir import graph\nfrom edatalog.api import Program\n",
            "solver/__init__.py": "",
            "solver/auto.py": "from edatalog.solver import starts\n",
            "solver/starts.py": "from ..solver.auto import Model\n",
            "rules/__init__.py": "",
            "backend/__init__.py": "",
        },
    )
    assert _cycle_report(tmp_path) == [
        "edatalog.api (edatalog/api.py:1 imports edatalog.plans) -> "
        "edatalog.plans (edatalog/plans.py:2 imports edatalog.api) -> edatalog.api",
        "edatalog.ir.graph (edatalog/ir/graph.py:1 imports edatalog.ir.printer) -> "
        "edatalog.ir.printer (edatalog/ir/printer.py:3 imports edatalog.ir.graph) -> edatalog.ir.graph",
        "edatalog.solver.auto (solver/auto.py:1 imports edatalog.solver.starts) -> "
        "edatalog.solver.starts (solver/starts.py:1 imports edatalog.solver.auto) -> edatalog.solver.auto",
    ]
