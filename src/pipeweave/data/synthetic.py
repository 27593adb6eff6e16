"""The mlp's data: one fixed batch of random inputs and random regression targets."""

from __future__ import annotations

import torch

from pipeweave.errors import UserError


class RandomRegression:
    """Fixed random inputs and targets of width ``hidden``: the same batch every step.

    The mlp learns to map them (a memorisation task), so the loss falls steadily,
    which is what a schedule's convergence check needs.

    Example:
        >>> data = RandomRegression(hidden=4, batch_size=3, seed=0)
        >>> x, y = data.batch(0)
        >>> tuple(x.shape), bool(torch.equal(y, data.batch(7)[1]))
        ((3, 4), True)
    """

    def __init__(self, *, hidden: int, batch_size: int, seed: int = 0) -> None:
        if batch_size < 1:
            raise UserError(f"batch_size={batch_size} is invalid; give batch_size >= 1")
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(batch_size, hidden, generator=generator)
        self.targets = torch.randn(batch_size, hidden, generator=generator)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(inputs, targets)`` of optimizer step ``step`` (always the same batch)."""
        del step
        return self.inputs, self.targets
