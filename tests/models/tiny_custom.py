"""A small model of its own for the custom-model tests: not one of pipeweave's reference models.

Token sequences are classified by whether their sum is even. The layers mix
what pipeweave swaps (``nn.Linear``, inside other modules too) with what it
leaves to autograd (``nn.Embedding``, ``nn.LayerNorm``, ``nn.Conv1d``), and
the first layer takes integer inputs. ``noisy`` adds dropout and batch norm;
``tuples`` passes tuples between its layers (a bool mask beside one or two
floating-point tensors), from a dataset whose inputs are tuples.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeweave.models import LayerModel

VOCAB, SEQ, WIDTH, CLASSES = 16, 8, 24, 2


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mix = nn.Conv1d(WIDTH, WIDTH, kernel_size=3, padding=1)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        h = self.mix(h.transpose(1, 2)).transpose(1, 2)
        return x + self.mlp(h)


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x.mean(1))


class Noisy(nn.Module):
    """A residual block that draws random numbers (dropout) and keeps running statistics (batch norm)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Dropout(0.25), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x.transpose(1, 2)).transpose(1, 2)
        return x + nn.functional.dropout(self.mlp(h), 0.1, self.training)


class Embed(nn.Module):
    """(tokens, lengths) -> (hidden, mask): the first layer takes a tuple and returns one."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.embed(tokens), torch.arange(SEQ) < lengths.unsqueeze(1)


class Masked(nn.Module):
    """(hidden, mask) -> (hidden, mask): positions past a sequence's length are left alone."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return h + torch.tanh(self.mix(h)) * mask.unsqueeze(-1), mask


class Fork(nn.Module):
    """(hidden, mask) -> (hidden, gate, mask): two floating-point tensors and a bool one cross the next boundary."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return h, torch.sigmoid(self.gate(h)), mask


class Join(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.value = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor, gate: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return h + gate * self.value(h) * mask.unsqueeze(-1), mask


class Pool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(WIDTH, CLASSES)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        kept = mask.unsqueeze(-1).float()
        return self.out((h * kept).sum(1) / kept.sum(1))


class _WithLengths(torch.utils.data.Dataset[tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]]):
    """((tokens, length), label): is the sum of the first ``length`` tokens even."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        self.lengths = torch.randint(1, SEQ + 1, (n,), generator=g)
        kept = torch.arange(SEQ) < self.lengths.unsqueeze(1)
        self.labels = (self.tokens * kept).sum(1) % CLASSES

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        return (self.tokens[i], self.lengths[i]), self.labels[i]


def _pairs(n: int, seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return torch.utils.data.TensorDataset(tokens, tokens.sum(1) % CLASSES)


def model() -> LayerModel:
    return LayerModel(
        layers=[lambda: nn.Embedding(VOCAB, WIDTH)] + [Residual] * 4 + [Head],
        loss=nn.functional.cross_entropy,
        dataset=_pairs(96, 0),
        eval_dataset=_pairs(32, 1),
    )


def noisy() -> LayerModel:
    return LayerModel(
        layers=[lambda: nn.Embedding(VOCAB, WIDTH), Noisy, Residual, Noisy, Head],
        loss=nn.functional.cross_entropy,
        dataset=_pairs(96, 0),
    )


def tuples() -> LayerModel:
    return LayerModel(
        layers=[Embed, Masked, Fork, Join, Masked, Pool],
        loss=nn.functional.cross_entropy,
        dataset=_WithLengths(96, 0),
        eval_dataset=_WithLengths(32, 1),
    )


def returns_list() -> LayerModel:
    return LayerModel(
        layers=[lambda: _AsList(), lambda: nn.Linear(4, 2)],
        loss=nn.functional.mse_loss,
        dataset=torch.utils.data.TensorDataset(torch.randn(4, 4), torch.randn(4, 2)),
    )


def wide_tuple() -> LayerModel:
    return LayerModel(
        layers=[lambda: _Copies(9), lambda: _First()],
        loss=nn.functional.mse_loss,
        dataset=torch.utils.data.TensorDataset(torch.randn(4, 4), torch.randn(4, 4)),
    )


class _Copies(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x,) * self.n


class _First(nn.Module):
    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return xs[0]


class _AsList(nn.Module):
    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x, x]


def shallow() -> LayerModel:
    return LayerModel(
        layers=[lambda: nn.Embedding(VOCAB, WIDTH), Residual, Head],
        loss=nn.functional.cross_entropy,
        dataset=_pairs(96, 0),
    )


not_a_model = 3


def returns_tuple() -> LayerModel:
    return LayerModel(
        layers=[lambda: nn.LSTM(4, 4), lambda: nn.Linear(4, 4)],
        loss=nn.functional.mse_loss,
        dataset=torch.utils.data.TensorDataset(torch.randn(4, 2, 4), torch.randn(4, 2, 4)),
    )


def raises() -> LayerModel:
    raise RuntimeError("no data here")


def wrong_width() -> LayerModel:
    return LayerModel(
        layers=[lambda: nn.Linear(4, 8), lambda: nn.Linear(5, 2)],
        loss=nn.functional.mse_loss,
        dataset=torch.utils.data.TensorDataset(torch.randn(4, 4), torch.randn(4, 2)),
    )


def wrong_targets() -> LayerModel:
    return LayerModel(
        layers=[lambda: nn.Linear(4, 8), lambda: nn.Linear(8, 2)],
        loss=nn.functional.mse_loss,
        dataset=torch.utils.data.TensorDataset(torch.randn(4, 4), torch.randn(4, 3)),
    )


class Peak(nn.Module):
    """A block with a persistent buffer its forward updates: the largest input magnitude seen in training."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Residual()
        self.register_buffer("peak", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.peak = torch.maximum(self.peak, x.detach().abs().max())
        return self.block(x)


def with_buffer() -> LayerModel:
    return LayerModel(
        layers=[lambda: nn.Embedding(VOCAB, WIDTH), Peak, Head], loss=nn.functional.cross_entropy, dataset=_pairs(96, 0)
    )


class SequenceFirst(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1)


def batch_second() -> LayerModel:
    return LayerModel(
        layers=[lambda: nn.Embedding(VOCAB, WIDTH), SequenceFirst, Head],
        loss=nn.functional.cross_entropy,
        dataset=_pairs(8, 0),
    )


SPLIT_MLP = {"mlp.0": "colwise", "mlp.2": "rowwise"}  # the residual block's two linear layers, Megatron's MLP


def tensor_parallel() -> LayerModel:
    """``model``'s layers with a tensor-parallel plan for its residual blocks (the rest whole on every rank)."""
    return LayerModel(
        layers=[lambda: nn.Embedding(VOCAB, WIDTH), Residual, Residual, Head],
        loss=nn.functional.cross_entropy,
        dataset=_pairs(96, 0),
        tp_plan=[None, SPLIT_MLP, SPLIT_MLP, None],
    )


def bad_tp_plan() -> LayerModel:
    return LayerModel(
        layers=[lambda: nn.Embedding(VOCAB, WIDTH), Residual, Head],
        loss=nn.functional.cross_entropy,
        dataset=_pairs(96, 0),
        tp_plan=[None, {"mlp.5": "rowwise"}, None],
    )


def noisy_selective() -> LayerModel:
    """``noisy`` naming its blocks' MLPs (dropout inside) for ``--recompute selective``."""
    return LayerModel(
        layers=[lambda: nn.Embedding(VOCAB, WIDTH), Noisy, Residual, Noisy, Head],
        loss=nn.functional.cross_entropy,
        dataset=_pairs(96, 0),
        selective=[None, ["mlp"], ["mlp"], ["mlp"], None],
    )
