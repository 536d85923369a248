"""Shared test configuration: golden-file regeneration, GPU skipping, and a heap frozen per
module (so that garbage collection never pauses a test for seconds)."""

from __future__ import annotations

import gc
from typing import Any

import pytest


@pytest.fixture(autouse=True, scope="module")
def _frozen_heap() -> None:
    """Late in a full run the suite's heap holds millions of objects (programs, plans, compiled
    graphs that modules cache), and one full garbage collection then pauses the process for
    seconds: a collection before one test took ~3 s, CI saw a 0.2 s solve take 5 s and a 3 s
    one end unsearched, which tests of time limits cannot tell from a slow solver.  Each module
    starts with the heap collected and frozen: later collections scan only what came since."""
    gc.collect()
    gc.freeze()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-goldens",
        action="store_true",
        default=False,
        help="rewrite golden files (expected error messages, plans) from the current output",
    )


@pytest.fixture
def routed_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The rules the torch backend evaluates as routed contractions (dispatch, grouped GEMM,
    combine: ``backend/kernels/routed.py``), in the order it does."""
    from edatalog.backend.kernels import routed

    calls: list[str] = []
    real = routed.evaluate_routed

    def spy(node: Any, *args: Any) -> Any:
        calls.append(node.out)
        return real(node, *args)

    monkeypatch.setattr(routed, "evaluate_routed", spy)
    return calls


@pytest.fixture
def update_goldens(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-goldens"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
