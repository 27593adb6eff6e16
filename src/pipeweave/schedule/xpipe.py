"""XPipe (Guan et al., arXiv 1911.04610, 2019): asynchronous micro-batch pipelining with Adam-based weight prediction.

1F1B without a flush over a stream of mini-batches; each stage updates once
per mini-batch (its T microbatches' gradients accumulated). The first
microbatch of each mini-batch at a stage, the "bellwether", computes the
version distance s and the predicted weights w_hat = w - s lr m_hat /
(sqrt(v_hat) + eps) from Adam's state once per pass; the other microbatches of
that mini-batch reuse them (policy BELLWETHER_PREDICTION; ``weights.xpipe``).
"""

from __future__ import annotations

from pipeweave.schedule.ir import Schedule, WeightPolicy
from pipeweave.schedule.pipedream import async_1f1b
from pipeweave.schedule.stream import DEFAULT_NUM_STEPS


def xpipe(num_stages: int, num_microbatches: int, *, num_steps: int = DEFAULT_NUM_STEPS) -> Schedule:
    """XPipe's stream: 1F1B without a flush, one update per mini-batch, bellwether predictions.

    Example:
        >>> s = xpipe(2, 2, num_steps=2)
        >>> [str(a) for a in s.actions[0]]
        ['0F0', '0F1', '0B0', '0F2', '0B1', '0U0', '0F3', '0B2', '0B3', '0U1']
    """
    return async_1f1b(
        "xpipe",
        WeightPolicy.BELLWETHER_PREDICTION,
        num_stages,
        num_microbatches,
        num_steps,
        update_every=num_microbatches,
    )
