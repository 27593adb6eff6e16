"""Models written as ordinary modules, for ``pipeweave.pipeline``: nothing of pipeweave's layer lists in them.

``looped``: a small transformer whose forward loops over its blocks, its
output head tied to its token embedding (one Parameter). ``sequential``: an
``nn.Sequential``, with no split points. ``plain_factory``: a module factory
with ``loss`` and ``dataset`` beside it, as ``--model FILE.py:NAME`` takes one.
``uneven``: one wide block before three narrow ones, split into 2 parts
balanced by the profiler (``split_points=2``). ``routed``: blocks that run
an expert only where tokens were routed to it (a branch on tensor values,
which ``torch.export`` refuses and ``torch.fx`` keeps whole).
"""

from __future__ import annotations

import torch
from torch import nn

import pipeweave

VOCAB, SEQ, WIDTH = 32, 8, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(x)


class Looped(nn.Module):
    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied: one Parameter

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _tokens(n: int, seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def looped() -> pipeweave.models.LayerModel:
    """Split before every block (the automatic cut): embedding, block 0, block 1, block 2 with the head."""
    return pipeweave.pipeline(Looped(), loss=token_loss, dataset=_tokens(64, 0))


def looped_at_points() -> pipeweave.models.LayerModel:
    return pipeweave.pipeline(
        Looped(), (torch.zeros(2, SEQ, dtype=torch.long),), ["blocks.1"], loss=token_loss, dataset=_tokens(64, 0)
    )


def sequential() -> pipeweave.models.LayerModel:
    net = sequential_module()
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g))
    return pipeweave.pipeline(net, loss=nn.functional.mse_loss, dataset=data)


class Shared(nn.Module):
    """Tied in the middle: block 1 reuses block 0's first linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)])
        self.blocks[2].weight = self.blocks[1].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def shared_in_the_middle() -> pipeweave.models.LayerModel:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 8, generator=g))
    return pipeweave.pipeline(Shared(), loss=nn.functional.mse_loss, dataset=data)


def plain_factory() -> nn.Module:
    return Looped(blocks=2)


loss = token_loss
dataset = _tokens(64, 0)
split_points = ["blocks.1"]


def sequential_module() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def declared() -> pipeweave.models.LayerModel:
    """Two layers declared tied (DeepSpeed's TiedLayerSpec's way): their weights are one parameter."""
    return pipeweave.models.LayerModel(
        layers=[lambda: nn.Linear(4, 4), lambda: nn.Linear(4, 4)],
        loss=nn.functional.mse_loss,
        tied=[["0.weight", "1.weight"]],
        dataset=torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 4)),
    )


def tied_sequential() -> pipeweave.models.LayerModel:
    """An ``nn.Sequential`` whose last layer reuses its first one's weight (one Parameter, found by the split)."""
    net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    net[4].weight = net[0].weight
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 8, generator=g))
    return pipeweave.pipeline(net, loss=nn.functional.mse_loss, dataset=data)


class Uneven(nn.Module):
    """Block 0 is wide (a hidden layer of 16384), blocks 1-3 narrow: on a quiet machine a balanced split cuts after
    block 0 (under load the measured times may say otherwise)."""

    def __init__(self) -> None:
        super().__init__()
        wide = nn.Sequential(nn.Linear(4 * WIDTH, 16384), nn.GELU(), nn.Linear(16384, 4 * WIDTH))
        self.blocks = nn.ModuleList([wide, *(nn.Linear(4 * WIDTH, 4 * WIDTH) for _ in range(3))])
        self.head = nn.Linear(4 * WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x)


def uneven_data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(64, 4 * WIDTH, generator=g), torch.randn(64, 4, generator=g))


def uneven() -> pipeweave.models.LayerModel:
    data = uneven_data()
    return pipeweave.pipeline(Uneven(), (data.tensors[0][:8],), 2, loss=nn.functional.mse_loss, dataset=data)


class Experts(nn.Module):
    """A mixture of two experts: each token goes to its gate's choice, and an expert no token chose is skipped
    (``if routed.any()``, a branch on tensor values: ``torch.export`` cannot trace it)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(WIDTH, 2)
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.gate(x).softmax(-1)
        choice = weights.argmax(-1)
        out = torch.zeros_like(x)
        for k, expert in enumerate(self.experts):
            routed = choice == k
            if routed.any():
                out[routed] = expert(x[routed]) * weights[..., k][routed].unsqueeze(-1)
        return x + out


class Routed(nn.Module):
    """Tokens through three mixture-of-experts blocks: traced by torch.fx, the blocks kept whole."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Experts() for _ in range(3))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(torch.tanh(x))


def routed() -> pipeweave.models.LayerModel:
    return pipeweave.pipeline(Routed(), split_points=["blocks.1"], loss=token_loss, dataset=_tokens(64, 0))
