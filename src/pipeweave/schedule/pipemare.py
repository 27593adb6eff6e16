"""PipeMare (Yang et al., MLSys 2021): asynchronous 1F1B without stashing, optional synchronous warm-up.

Every stage updates once per mini-batch of T microbatches, as soon as it holds
their gradients, with no flush and no stashed weights: a forward reads the
current version and the backward reads the then-current one, so the two may
differ (policy DISCREPANCY_CORRECTION). The runtime corrects the backward's
weights with ``weights.pipemare`` (extrapolate back by the delay x velocity)
and scales each stage's step size by its delay tau_i, which
``sim.versions.staleness`` computes from this order.

``warmup_steps`` mini-batches first run synchronously (1F1B with each stage's
update after the step's last backward: every F and B of the step reads one
version, i.e. plain SGD), then the stream starts.
"""

from __future__ import annotations

from pipeweave.schedule.ir import Action, Placement, Schedule, ScheduleError, WeightPolicy
from pipeweave.schedule.one_f_one_b import one_f_one_b_order
from pipeweave.schedule.stream import DEFAULT_NUM_STEPS, add_updates, check_stream, every, stream_order


def pipemare(
    num_stages: int,
    num_microbatches: int,
    *,
    num_steps: int = DEFAULT_NUM_STEPS,
    warmup_steps: int = 0,
) -> Schedule:
    """PipeMare's stream: one update per mini-batch, forwards and backwards read the current version.

    Args:
        num_stages: D.
        num_microbatches: T, microbatches per mini-batch.
        num_steps: mini-batches in the stream (default 4).
        warmup_steps: leading mini-batches run synchronously (default 0; the
            paper's optional warm-up "PipeMareW" runs some epochs this way).

    Example:
        >>> s = pipemare(2, 2, num_steps=2, warmup_steps=1)
        >>> [str(a) for a in s.actions[0]]
        ['0F0', '0F1', '0B0', '0B1', '0U0', '0F2', '0F3', '0B2', '0B3', '0U1']
    """
    check_stream(num_stages, num_microbatches, num_steps)
    if not isinstance(warmup_steps, int) or not 0 <= warmup_steps <= num_steps:
        raise ScheduleError(f"warmup_steps={warmup_steps!r} is invalid; give 0 <= warmup_steps <= num_steps")
    d, t = num_stages, num_microbatches
    total, head = num_steps * t, warmup_steps * t
    rows = []
    for r in range(d):
        row = [Action(r, op, k * t + j) for k in range(warmup_steps) for op, j in one_f_one_b_order(r, d, t)]
        row += [Action(r, op, head + j) for op, j in stream_order(d - r - 1, total - head)]
        rows.append(row)
    rows = add_updates(rows, every(t, total))
    return Schedule(
        "pipemare",
        Placement.straight(d),
        total,
        tuple(map(tuple, rows)),
        policy=WeightPolicy.DISCREPANCY_CORRECTION,
        num_steps=num_steps,
    )
