"""A small regression model whose dataset holds one sample with an infinite target.

The mini-batch that draws sample ``BAD`` has an infinite mean-squared loss
and non-finite gradients: with 32 samples and batches of 8, that is one step
of each epoch (which one follows from the data seed, ``data.dataset``).
"""

from __future__ import annotations

import torch
from torch import nn

from pipeweave.models import LayerModel

SAMPLES, WIDTH, BAD = 32, 8, 6


def _pairs() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    inputs, targets = torch.randn(SAMPLES, WIDTH, generator=g), torch.randn(SAMPLES, 2, generator=g)
    targets[BAD] = float("inf")
    return torch.utils.data.TensorDataset(inputs, targets)


def model() -> LayerModel:
    return LayerModel(
        layers=[
            lambda: nn.Linear(WIDTH, 16),
            lambda: nn.Sequential(nn.Tanh(), nn.Linear(16, 16)),
            lambda: nn.Sequential(nn.Tanh(), nn.Linear(16, 16)),
            lambda: nn.Sequential(nn.Tanh(), nn.Linear(16, 2)),
        ],
        loss=nn.functional.mse_loss,
        dataset=_pairs(),
    )
