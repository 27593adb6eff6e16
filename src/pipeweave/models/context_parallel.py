"""What a context-parallel rank holds of every sequence: the load-balanced causal layout, and its positions.

Context parallelism (``--context-parallel C``) splits every sequence over C
ranks. Cut in C consecutive pieces, a causal model's work would be uneven:
the last piece's queries see every key, the first piece's only their own. As
Megatron-LM and torchtitan do, the sequence is cut in 2C chunks instead and
CP rank i holds chunks i and 2C-1-i: an early chunk and its mirror late one,
so each rank's queries see about the same number of keys. With C = 2 and a
sequence of 8 tokens, rank 0 holds positions 0 1 6 7 and rank 1 2 3 4 5.

A rank's activations, tokens and targets are its two chunks side by side
(``take``). What reads a token's place in the sequence -- learned position
embeddings, rotary positions, causal masks -- must use its global position
(``positions``), not its index in the rank's slice: the layers that read
positions hold a ``SequenceShard`` in their ``sequence`` attribute (None: the
whole sequence), set by the runtime (``runtime.stage.context_parallel``).

Example:
    >>> shard = SequenceShard(rank=0, size=2)
    >>> shard.positions(4).tolist()
    [0, 1, 6, 7]
    >>> SequenceShard(rank=1, size=2).take(torch.arange(8).view(1, 8)).tolist()
    [[2, 3, 4, 5]]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SEQUENCE = 1
"""The sequence dimension of tokens, targets and activations (``(batch, seq, ...)``)."""


@dataclass(frozen=True)
class SequenceShard:
    """CP rank ``rank`` of ``size``: chunks ``rank`` and ``2 size - 1 - rank`` of every sequence's ``2 size``."""

    rank: int
    size: int

    def chunks(self) -> tuple[int, int]:
        """The indices of the two chunks held, in the order they are held."""
        return self.rank, 2 * self.size - 1 - self.rank

    def positions(self, length: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The global positions (int64) of this rank's ``length`` tokens (two chunks of ``length / 2``)."""
        half = length // 2
        return torch.cat([torch.arange(c * half, (c + 1) * half, device=device) for c in self.chunks()])

    def take(self, whole: torch.Tensor, dim: int = SEQUENCE) -> torch.Tensor:
        """This rank's two chunks of ``whole`` (the whole sequence along ``dim``), side by side."""
        pieces = whole.chunk(2 * self.size, dim=dim)
        return torch.cat([pieces[c] for c in self.chunks()], dim=dim).contiguous()
