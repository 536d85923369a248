"""The examples in ``examples/`` run, and do what their docstrings say."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_train_bytes_learns_the_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("train_bytes", ROOT / "examples" / "train_bytes.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_bytes"] = module
    spec.loader.exec_module(module)
    losses = module.run(tmp_path, 4)
    assert len(losses) == 4 and losses[-1] < losses[0] < 5.6  # from about ln 256
    out = capsys.readouterr().out
    assert "continues 'edatalog ' as:" in out
    assert {p.name for p in (tmp_path / "trained").iterdir()} >= {"model.safetensors", "optimizer.safetensors"}
