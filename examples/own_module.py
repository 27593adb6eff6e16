"""Train your own ``nn.Module``, cut into pipeline parts by ``pipeweave.pipeline``, on 2 ranks with zb-h1.

    python examples/own_module.py

The module is written as usual (a loop over its blocks, the head tied to the
embedding); ``pipeweave.pipeline`` traces it and cuts it before ``blocks.2``.
Every rank builds the model by calling ``model()``: the same file, the same seed.
The same run from the command line: ``pipeweave train --model examples/own_module.py:model -s zb-h1``.
"""

import torch
from torch import nn

import tempfile

import pipeweave

STEPS = 12


class Net(nn.Module):
    """A model as written: a loop over its blocks, the head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
                                    for _ in range(4))
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.embed.weight  # one Parameter, trained by the first and the last part

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def model():
    """The pipelined model (every rank calls it)."""
    tokens = torch.randint(0, 64, (256, 17), generator=torch.Generator().manual_seed(0))
    tokens[:, 1:] = (tokens[:, :-1] * 7 + 3) % 64  # a rule to learn: each token from the one before
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return pipeweave.pipeline(Net(), split_points=["blocks.2"], loss=next_token_loss, dataset=data)


if __name__ == "__main__":
    config = pipeweave.TrainConfig(schedule="zb-h1", num_stages=2, num_microbatches=4, batch_size=16, steps=STEPS,
                                   optimizer="adamw", lr=1e-2, model=pipeweave.models.ModelSpec.of(model))
    print("split before:", ", ".join(model().split_points))
    record = pipeweave.train(config, quiet=True, out=tempfile.mkdtemp())
    print(f"loss {record.losses[0]:.3f} -> {record.losses[-1]:.3f} after {STEPS} steps")
