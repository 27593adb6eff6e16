"""SpecTrain (Chen et al., arXiv 1809.02839, 2018): pipelined model parallelism with weight prediction.

The order is PipeDream's (1F1B without a flush, an update after every
microbatch's backward, the paper's "mini-batch" being our microbatch), but
nothing is stashed: each forward and each backward reads weights predicted for
the version its gradient will be applied to, w_hat = w - s lr v with v the
momentum SGD velocity and s the version distance of that stage and pass
(policy PREDICTION; ``sim.versions.read_versions`` gives s per action,
``weights.prediction`` the prediction, along any optimizer's own next step).
"""

from __future__ import annotations

from pipeweave.schedule.ir import Schedule, WeightPolicy
from pipeweave.schedule.pipedream import async_1f1b
from pipeweave.schedule.stream import DEFAULT_NUM_STEPS


def spectrain(
    num_stages: int, num_microbatches: int, *, num_steps: int = DEFAULT_NUM_STEPS, update_every: int = 1
) -> Schedule:
    """SpecTrain's stream: 1F1B without a flush, predicted weights, an update per microbatch.

    Args:
        num_stages: D.
        num_microbatches: T, microbatches per mini-batch.
        num_steps: mini-batches in the stream (default 4).
        update_every: microbatches per update (paper: 1).

    Example:
        >>> spectrain(3, 3).policy
        <WeightPolicy.PREDICTION: 'prediction'>
    """
    return async_1f1b("spectrain", WeightPolicy.PREDICTION, num_stages, num_microbatches, num_steps, update_every)
