"""A module as users write one, split over tensor-parallel ranks by ``pipeweave.pipeline(..., tp_plan=...)``.

``Attending``: blocks of multi-head attention whose forward reshapes by its
head count as a literal (``self.heads``, written into the traced graph) and
a fused Q/K/V projection cut by ``split(width)``; its MLP up and down. The
file's ``loss``, ``dataset`` and ``tp_plan`` serve ``--model FILE.py:attending``
(``models.pipeline.from_module``); ``sequential_plan`` splits an
``nn.Sequential`` (no tracing) by its children's names.
"""

from __future__ import annotations

import torch
from torch import nn

import pipeweave

VOCAB, SEQ, WIDTH, HEADS = 32, 8, 16, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = HEADS
        self.norm = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, width = x.shape
        q, k, v = self.qkv(self.norm(x)).split(width, dim=-1)
        q, k, v = (t.view(b, s, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        h = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(h.transpose(1, 2).reshape(b, s, width))
        return x + self.down(torch.relu(self.up(x)))


class Attending(nn.Module):
    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _tokens(n: int, seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def attending() -> nn.Module:
    return Attending()


loss = token_loss
dataset = _tokens(64, 0)
tp_plan = {
    "blocks.*.qkv": "colwise_qkv",
    "blocks.*.out": "rowwise",
    "blocks.*.up": "colwise",
    "blocks.*.down": "rowwise",
    "head": "colwise_gather",
}


def sequential_plan() -> pipeweave.models.LayerModel:
    """An ``nn.Sequential`` MLP, its linear layers split by their names (torch's styles)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel(), "3": "colwise", "5": "rowwise"}
    return pipeweave.pipeline(net, split_points=["3"], loss=nn.functional.mse_loss, dataset=data, tp_plan=plan)
