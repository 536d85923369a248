"""A forward torch.export cannot capture (Python control flow on a tensor's value): the error
gives export's reason, and export's exception is its cause."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Model(nn.Module):
    def forward(self, x: Any) -> Any:
        if x.sum() > 0:
            return x
        return -x


def make() -> tuple[Any, tuple[Any, ...]]:
    return Model(), (torch.randn(3),)
