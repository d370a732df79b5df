"""Small models shared by test files (the tests that compare training against a float64
single process)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Conv(nn.Module):
    """A 2-channel 5x5 image -> 3 logits: a convolution, BatchNorm (running statistics to
    average), a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.c, self.bn, self.fc = nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.Linear(36, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.bn(self.c(x))).flatten(1))
