"""PipeDream (Narayanan et al., SOSP 2019) and PipeDream-2BW (Narayanan et al., ICML 2021).

Both run 1F1B without a flush over a stream of mini-batches (``stream.py``):

- ``pipedream``: every stage updates after every microbatch's backward (the
  paper's "minibatch" is our microbatch), and weight stashing makes the
  backward read the version its forward read, so stage s (0-based) keeps the
  D - s versions of its in-flight microbatches (policy STASH). With
  ``vertical_sync`` every stage reads the version stage 0 read for that
  microbatch (policy VERTICAL_SYNC). ``update_every`` > 1 accumulates gradients.
  Stage 0 admits NOAM microbatches before its first backward ("number of
  optimal active minibatches", ceil(workers / replicas of the input stage),
  ``noam``): D on a straight pipeline, the least that keeps every rank busy;
  ``in_flight`` sets another (fewer leave ranks idle, more add nothing on D
  straight stages: stage s still holds at most D - s). ``replicas`` runs part
  k on r_k ranks that take its microbatches in turn (1F1B-RR, ``round_robin``).
- ``pipedream-2bw``: gradients coalesced over the T microbatches of a
  mini-batch, one update per mini-batch; forwards read the newest version and
  backwards the version their forward read, so with T >= D two versions
  suffice (policy DOUBLE_BUFFER): W(t+1) = W(t) - lr grad(W(t-1)).

Stage 3 of 4, one update per microbatch (``pipedream``, steady state)::

    rank 3 | F0 B0 U0 F1 B1 U1 F2 B2 U2 ...
    rank 0 | F0 F1 F2 F3 B0 U0 F4 B1 U1 ...   (F4 reads version 1)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pipeweave.schedule.ir import Placement, Schedule, WeightPolicy, check_positive
from pipeweave.schedule.round_robin import check_replicas, round_robin_placement, round_robin_rows
from pipeweave.schedule.stream import DEFAULT_NUM_STEPS, add_updates, check_stream, every, straight_rows


def noam(num_ranks: int, input_replicas: int = 1) -> int:
    """PipeDream's NOAM: ceil(workers / replicas of the input stage), the microbatches admitted in flight.

    Example:
        >>> noam(4), noam(4, input_replicas=2), noam(3, input_replicas=2)
        (4, 2, 2)
    """
    return -(-num_ranks // input_replicas)


def async_1f1b(
    name: str,
    policy: WeightPolicy,
    num_stages: int,
    num_microbatches: int,
    num_steps: int,
    update_every: int,
    in_flight: int | None = None,
) -> Schedule:
    """1F1B without a flush over ``num_steps`` mini-batches, a U after every ``update_every`` backwards.

    Example:
        >>> s = async_1f1b("x", WeightPolicy.NONE, 2, 2, 2, 1)
        >>> [str(a) for a in s.actions[1]][:4]
        ['1F0', '1B0', '1U0', '1F1']
    """
    check_stream(num_stages, num_microbatches, num_steps)
    check_positive("update_every", update_every, "give update_every >= 1 (microbatches per update)")
    total = num_steps * num_microbatches
    rows = add_updates(straight_rows(num_stages, total, in_flight), every(update_every, total))
    return Schedule(
        name,
        Placement.straight(num_stages),
        total,
        tuple(map(tuple, rows)),
        policy=policy,
        num_steps=num_steps,
    )


def pipedream(
    num_stages: int,
    num_microbatches: int,
    *,
    num_steps: int = DEFAULT_NUM_STEPS,
    vertical_sync: bool = False,
    update_every: int = 1,
    in_flight: int | None = None,
    replicas: Sequence[int] | None = None,
) -> Schedule:
    """PipeDream: 1F1B without a flush, weight stashing, an update per microbatch.

    Args:
        num_stages: D.
        num_microbatches: T, microbatches per mini-batch.
        num_steps: mini-batches in the stream (default 4).
        vertical_sync: every stage reads the version stage 0 read (default False).
        update_every: microbatches whose gradients one update applies (paper: 1).
        in_flight: microbatches stage 0 admits before its first backward (default NOAM = D, ``noam``;
            with ``replicas``, at each input replica: ceil(D / r_0)).
        replicas: per part, the ranks it runs on (PipeDream's planner; ``round_robin``): D = their sum,
            microbatch m on replica m mod r_k of part k; default one each (D parts).

    Raises:
        ScheduleError: ``in_flight`` < 1, or ``replicas`` the ranks cannot hold (``round_robin.check_replicas``).

    Example:
        >>> s = pipedream(4, 4)
        >>> s.policy, s.num_microbatches, [str(a) for a in s.actions[0]][:6]
        (<WeightPolicy.STASH: 'stash'>, 16, ['0F0', '0F1', '0F2', '0F3', '0B0', '0U0'])
    """
    policy = WeightPolicy.VERTICAL_SYNC if vertical_sync else WeightPolicy.STASH
    replicated = replicas is not None and any(r != 1 for r in replicas)
    if replicas is not None:
        check_replicas(replicas, num_stages, num_microbatches)
    best = noam(num_stages, replicas[0] if replicas else 1)
    admitted = best if in_flight is None else in_flight
    check_positive("in_flight", admitted, f"give in_flight >= 1 (microbatches in flight; NOAM is {best})")
    if not replicated:
        return async_1f1b("pipedream", policy, num_stages, num_microbatches, num_steps, update_every, admitted)
    assert replicas is not None
    check_stream(num_stages, num_microbatches, num_steps)
    check_positive("update_every", update_every, "give update_every >= 1 (microbatches per update)")
    total, lines = num_steps * num_microbatches, math.lcm(*replicas)
    rows = round_robin_rows(replicas, total, admitted, update_every)
    return Schedule(
        "pipedream",
        round_robin_placement(replicas),
        total,
        tuple(map(tuple, rows)),
        microbatch_pipeline=tuple(m % lines for m in range(total)) if lines > 1 else (),
        policy=policy,
        num_steps=num_steps,
    )


def pipedream_2bw(num_stages: int, num_microbatches: int, *, num_steps: int = DEFAULT_NUM_STEPS) -> Schedule:
    """PipeDream-2BW: 1F1B without a flush, one update per mini-batch, double-buffered weights.

    Two versions suffice when T >= D (the paper's condition m >= d).

    Example:
        >>> [str(a) for a in pipedream_2bw(2, 2, num_steps=2).actions[1]]
        ['1F0', '1B0', '1F1', '1B1', '1U0', '1F2', '1B2', '1F3', '1B3', '1U1']
    """
    return async_1f1b(
        "pipedream-2bw",
        WeightPolicy.DOUBLE_BUFFER,
        num_stages,
        num_microbatches,
        num_steps,
        update_every=num_microbatches,
    )
