"""The residual MLP of the issue: L blocks ``x + Linear(4h,h)(GELU(Linear(h,4h)(LayerNorm(x))))``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeweave.models.layers import LayerNorm, Linear
from pipeweave.models.spec import ModelSpec


class MLPBlock(nn.Module):
    """One residual block of width h with a 4h hidden layer."""

    def __init__(self, hidden: int, *, generator: torch.Generator) -> None:
        super().__init__()
        self.norm = LayerNorm(hidden)
        self.up = Linear(hidden, 4 * hidden, generator=generator)
        self.down = Linear(4 * hidden, hidden, generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def build_layer(spec: ModelSpec, index: int, generator: torch.Generator) -> nn.Module:
    """Layer ``index`` of the mlp: every layer is one block."""
    del index  # all blocks are alike; the generator makes them differ
    return MLPBlock(spec.hidden, generator=generator)
