"""A custom model's data: mini-batches drawn from a map-style dataset, the same on every rank.

Every rank that needs data (the first stage its inputs, the last its targets)
draws mini-batch ``k`` itself, so nothing but activations travels between
stages. The order is a function of the seed alone: the samples of epoch ``e``
in the order of ``torch.randperm`` seeded by ``(seed, e)``, epochs one after
another, mini-batch ``k`` the samples at positions ``k B .. (k+1) B - 1`` of
that sequence (a batch may straddle two epochs; a dataset smaller than a batch
is fine). So a resumed run goes on with the next batch of the same sequence.
Samples are collated with torch's ``default_collate``; an input (or target)
that is a tuple of tensors stays one (``models.boundary``). With
``min_seq_len`` each microbatch of a step is cut to its own length, as the
gpt's corpus cuts it (``corpus.microbatch_lengths``), for datasets of sequences.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import default_collate

from pipeweave.data.corpus import microbatch_lengths
from pipeweave.errors import UserError
from pipeweave.models.boundary import Boundary, normalize, tensors


class DatasetSource:
    """``batch(step)`` and ``eval_batch(k)`` over map-style datasets of ``(input, target)`` pairs.

    Example:
        >>> data = torch.utils.data.TensorDataset(torch.arange(10.0), torch.arange(10.0) * 2)
        >>> x, y = DatasetSource(data, batch_size=4, seed=0).batch(2)
        >>> bool(torch.equal(y, x * 2)), len(x)
        (True, 4)
    """

    def __init__(
        self, dataset: Any, *, batch_size: int, seed: int = 0, eval_dataset: Any = None, min_seq_len: int | None = None
    ) -> None:
        if batch_size < 1:
            raise UserError(f"batch_size={batch_size} is invalid; give batch_size >= 1")
        self.dataset, self.eval_dataset = dataset, eval_dataset
        self.batch_size, self.seed = batch_size, seed
        self._orders: dict[int, torch.Tensor] = {}
        self.min_seq_len, self.seq_len = min_seq_len, sequence_length(dataset) if min_seq_len is not None else None
        if min_seq_len is not None and not 1 <= min_seq_len <= (self.seq_len or 0):
            raise UserError(
                f"--min-seq-len {min_seq_len} is invalid; give a length in [1, {self.seq_len}] (the "
                "dataset's sequences)"
            )

    def microbatch_lengths(self, step: int, num_microbatches: int) -> list[int] | None:
        """The sequence length of each microbatch of step ``step`` (None: the samples' own), as the gpt's
        corpus draws them (``corpus.microbatch_lengths``): the same on every rank."""
        if self.min_seq_len is None or self.seq_len is None:
            return None
        return microbatch_lengths(self.seed, step, num_microbatches, self.min_seq_len, self.seq_len)

    def _order(self, epoch: int) -> torch.Tensor:
        order = self._orders.get(epoch)
        if order is None:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(len(self.dataset), generator=generator)
            self._orders = {epoch: order}  # batches walk forward: keep the current epoch only
        return order

    def batch(self, step: int) -> tuple[Boundary, Boundary]:
        """The ``(inputs, targets)`` of optimizer step ``step``."""
        n = len(self.dataset)
        indices = []
        for position in range(step * self.batch_size, (step + 1) * self.batch_size):
            epoch, at = divmod(position, n)
            indices.append(int(self._order(epoch)[at]))
        return _collate(self.dataset, indices, "dataset")

    def eval_batch(self, k: int) -> tuple[Boundary, Boundary]:
        """Held-out batch ``k``: the eval dataset's samples ``k B ..`` in order (wrapping around).

        Raises:
            UserError: the model has no eval dataset.
        """
        if self.eval_dataset is None:
            raise UserError("the model has no eval_dataset; give LayerModel(eval_dataset=...) or drop --eval-every")
        n = len(self.eval_dataset)
        indices = [p % n for p in range(k * self.batch_size, (k + 1) * self.batch_size)]
        return _collate(self.eval_dataset, indices, "eval_dataset")


def _collate(dataset: Any, indices: list[int], name: str) -> tuple[Boundary, Boundary]:
    batch = default_collate([dataset[i] for i in indices])
    pair = [normalize(x) for x in batch] if isinstance(batch, (list, tuple)) else []
    if len(pair) != 2 or not all(isinstance(t, torch.Tensor) for x in pair for t in tensors(x)):
        raise UserError(
            f"the model's {name} must give (input, target) pairs, each a tensor or a tuple of "
            f"tensors; sample {indices[0]} collates to {type(batch).__name__}"
        )
    return pair[0], pair[1]


def sequence_length(dataset: Any) -> int:
    """The length of a dataset's sequences: dimension 0 of a sample's input and target (dimension 1 of a batch,
    which ``--min-seq-len`` cuts).

    Raises:
        UserError: a sample whose input or target is not one tensor with that dimension, or whose lengths differ.
    """
    sample = dataset[0]
    pair = list(sample) if isinstance(sample, (tuple, list)) else []
    if (
        len(pair) != 2
        or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in pair)
        or pair[0].shape[0] != pair[1].shape[0]
    ):
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in pair]
        raise UserError(
            f"--min-seq-len cuts sequences (dimension 0 of a sample's input and target); the model's "
            f"samples are {shapes}: give inputs and targets that are sequences of one length, or drop "
            "--min-seq-len"
        )
    return int(pair[0].shape[0])
