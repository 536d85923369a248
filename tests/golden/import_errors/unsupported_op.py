"""An op the importer has no rule for (``cumsum`` on data), inside a submodule: the error names
the op, the module path and the source line."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Scan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Any) -> Any:
        return torch.cumsum(self.fc(x), dim=-1)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Scan()

    def forward(self, x: Any) -> Any:
        return self.block(x).relu()


def make() -> tuple[Any, tuple[Any, ...]]:
    return Model(), (torch.randn(2, 4),)
