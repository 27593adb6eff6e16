"""A model whose rank 1 kills itself once, mid-run: the elastic-restart test's (``tests/runtime/test_torchrun.py``).

Where ``PIPEWEAVE_TEST_DIE_ONCE`` names a file that does not exist yet, the
process of ``RANK`` 1 creates it and SIGKILLs itself at the forward of its
``DIE_AT``-th microbatch (the first of step 5 with 2 microbatches a step),
as a crashed node would; a restarted attempt finds the file and trains on.
Without the variable (plain training, every other test) it is a small MLP.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
from torch import nn

from pipeweave.models import LayerModel

DIE_AT = 9
WIDTH = 8


class DiesOnce(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.forwards += 1
            marker = os.environ.get("PIPEWEAVE_TEST_DIE_ONCE")
            if marker and os.environ.get("RANK") == "1" and self.forwards == DIE_AT and not Path(marker).exists():
                Path(marker).write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)
        return torch.tanh(self.linear(x))


def model() -> LayerModel:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 2, generator=g))
    return LayerModel(
        layers=[
            lambda: nn.Linear(4, WIDTH),
            lambda: nn.Sequential(nn.Tanh(), nn.Linear(WIDTH, WIDTH)),
            DiesOnce,
            lambda: nn.Linear(WIDTH, 2),
        ],
        loss=nn.functional.mse_loss,
        dataset=data,
    )
