"""WPipe (Yang et al., ICLR 2022): double-grouped weight updates, the weights side.

Parts 0..D-1 form the first group and D..2D-1 the second (``schedule.wpipe``).
The first group's forwards of the next period run before the current period's
backwards, so its stages double-buffer (``DoubleBuffer``: backward reads the
forward's version, two versions at most); the second group keeps the
synchronous order and needs one version. Both update once per period, at
different times.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipeweave.weights.double_buffer import DoubleBuffer
from pipeweave.weights.stash import WeightStash


def group_of(part: int, num_ranks: int) -> int:
    """0 for parts 0..D-1, 1 for parts D..2D-1.

    Example:
        >>> [group_of(p, 2) for p in range(4)]
        [0, 0, 1, 1]
    """
    if not 0 <= part < 2 * num_ranks:
        raise ValueError(f"part={part} is outside 0..{2 * num_ranks - 1} for {num_ranks} ranks")
    return part // num_ranks


def weights_for_part(part: int, num_ranks: int, params: Sequence[torch.Tensor]) -> WeightStash:
    """The version store of a part: a double buffer in the first group, one version in the second.

    Example:
        >>> type(weights_for_part(0, 2, [torch.zeros(1)])).__name__, weights_for_part(3, 2, []).max_versions
        ('DoubleBuffer', 1)
    """
    if group_of(part, num_ranks) == 0:
        return DoubleBuffer(params)
    return WeightStash(params, max_versions=1)
