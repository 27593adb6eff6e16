"""The residual MLP of the issue: L blocks ``x + Linear(4h,h)(GELU(Linear(h,4h)(LayerNorm(x))))``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeweave.models.layers import LayerNorm, Linear
from pipeweave.models.spec import ModelSpec
from pipeweave.models.tensor_parallel import check_divisible


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


SELECTIVE_NONE = (
    "the mlp has no selective region: its blocks are two GEMMs around a GELU, nothing both cheap to "
    "replay and large to keep; give --recompute full or none"
)
"""Why ``--recompute selective`` is refused on the mlp (``models.build.selective_plan``)."""


def check_tensor_parallel(spec: ModelSpec, size: int) -> None:
    """One line if ``size`` ranks cannot split the blocks' 4h hidden layer evenly."""
    check_divisible([("4 x --hidden", 4 * spec.hidden)], size)


def tensor_parallel_plan(spec: ModelSpec, layer: nn.Module) -> dict[str, str]:
    """A block's up projection split column-wise, its down projection row-wise (Megatron's MLP)."""
    del spec, layer
    return {"up": "colwise", "down": "rowwise"}
