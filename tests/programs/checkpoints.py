"""What the whole-model tests share: a transformers model saved once per module, the model
program compiled in float64 with its dims and consts read from that checkpoint's config.json,
and the reference logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import edatalog
from edatalog.checkpoint import configured
from edatalog.lang.parser import parse_file


def randomized(model: Any) -> Any:
    """``model`` with weights large enough that every part matters: matrices (and the experts'
    stacks of them, ``[X, out, in]``) ~ N(0, 1.5^2 / fan_in), vectors (norm weights) ~
    N(1, 0.5^2), drawn in the order of ``named_parameters``."""
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 1.5 / p.shape[-1] ** 0.5)
            else:
                p.normal_(1.0, 0.5)
    return model


def save(tmp_path_factory: pytest.TempPathFactory, model: Any, name: str) -> Path:
    """``model`` written by ``save_pretrained`` into a fresh directory."""
    where = tmp_path_factory.mktemp(name)
    model.save_pretrained(where)
    return where


def compile_configured(
    program: Path, weights: Path, seq: int, dims: dict[str, int] | None = None, **kw: Any
) -> edatalog.Program:
    """``program`` in float64 over ``seq`` tokens, its dims and consts from ``weights``'
    config.json (``dims``: more dims, set as well)."""
    found, consts = configured(parse_file(str(program)), weights)
    return edatalog.compile(program, dims={**found, "S": seq, **(dims or {})}, consts=consts, dtype="f64", **kw)


def reference_logits(model: Any, ids: list[int]) -> np.ndarray:
    """transformers' logits for one sequence, without its KV cache."""
    with torch.no_grad():
        out: np.ndarray = model(torch.tensor([ids]), use_cache=False).logits.numpy()
    return out
