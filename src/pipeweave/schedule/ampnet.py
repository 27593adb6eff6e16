"""AMPNet (Gaunt et al., arXiv 1705.09786, 2017): asynchronous model-parallel training with no correction.

Each stage applies an update once it holds ``min_update_frequency`` local
gradients, and at most ``max_active_keys`` microbatches are in flight. Nothing
is stashed or corrected: a forward and the backward of the same microbatch
read whatever version is current, which may differ (policy NONE).

Defaults: AMPNet tunes both per task; here ``min_update_frequency = 1``
(update on every gradient, the most asynchronous setting, as PipeDream) and
``max_active_keys = D``, the least that keeps every rank busy (a smaller bound
leaves bubbles, a larger one adds nothing on a straight pipeline).
"""

from __future__ import annotations

from pipeweave.schedule.ir import Schedule, WeightPolicy, check_positive
from pipeweave.schedule.pipedream import async_1f1b
from pipeweave.schedule.stream import DEFAULT_NUM_STEPS


def ampnet(
    num_stages: int,
    num_microbatches: int,
    *,
    num_steps: int = DEFAULT_NUM_STEPS,
    min_update_frequency: int = 1,
    max_active_keys: int | None = None,
) -> Schedule:
    """AMPNet's stream: 1F1B without a flush, bounded in-flight microbatches, no weight correction.

    Args:
        num_stages: D.
        num_microbatches: T, microbatches per mini-batch.
        num_steps: mini-batches in the stream (default 4).
        min_update_frequency: local gradients per update (default 1).
        max_active_keys: microbatches in flight at once (default D).

    Example:
        >>> [str(a) for a in ampnet(3, 2, num_steps=1, max_active_keys=1).actions[0]]
        ['0F0', '0B0', '0U0', '0F1', '0B1', '0U1']
    """
    keys = num_stages if max_active_keys is None else max_active_keys
    check_positive("max_active_keys", keys, "give max_active_keys >= 1 (microbatches in flight)")
    return async_1f1b("ampnet", WeightPolicy.NONE, num_stages, num_microbatches, num_steps, min_update_frequency, keys)
