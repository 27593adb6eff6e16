"""PipeDream's partitioner (Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN Training", SOSP 2019, section 3.1).

A dynamic program over layers, machines and replication. ``T(i..j, m)``, one
stage of layers i..j replicated on m ranks that take microbatches in turn, costs

    T(i..j, m) = max(sum of compute over i..j, sync(i..j, m)) / m,
    sync(i..j, m) = 4 (m - 1) |w_i..j| / (m x bandwidth)

(compute is F + I + W; sync is the all-reduce of the stage's weights among its
replicas). ``A(j, m)``, the slowest stage of the best pipeline of layers 0..j-1
on exactly m ranks, is

    A(j, m) = min( T(0..j-1, m),
                   min over 1 <= i < j, 1 <= m' < m of
                       max(A(i, m - m'), 2 C_i, T(i..j-1, m')) )

where ``C_i = output bytes of layer i-1 / bandwidth`` is sending the
activations across the cut (2 C_i: activations forward, gradients back).
Optimality follows as in ``balance.py``: the last stage of any pipeline is some
``(i..j-1, m')`` preceded by a pipeline of layers 0..i-1 on m - m' ranks, and
the objective (a maximum) is monotone in that pipeline's own bottleneck.
"""

from __future__ import annotations

import numpy as np

from pipeweave.errors import UserError
from pipeweave.partition.problem import LayerCosts, Partition


def stage_time(costs: LayerCosts, start: np.ndarray | int, stop: int, replicas: int, bandwidth: float) -> np.ndarray:
    """``T(start..stop-1, replicas)`` for one start or an array of them."""
    starts = np.asarray(start)
    compute = costs.prefix("time")[stop] - costs.prefix("time")[starts]
    weights = costs.prefix("params")[stop] - costs.prefix("params")[starts]
    sync = 4.0 * (replicas - 1) * weights / (replicas * bandwidth)
    result: np.ndarray = np.maximum(compute, sync) / replicas
    return result


def cut_time(costs: LayerCosts, cut: np.ndarray | int, bandwidth: float) -> np.ndarray:
    """``2 C_i``: activations of layer cut-1 forward and their gradients back, per microbatch."""
    out = np.asarray(costs.output)
    result: np.ndarray = 2.0 * out[np.asarray(cut) - 1] / bandwidth
    return result


def pipedream_plan(costs: LayerCosts, num_ranks: int, *, bandwidth: float = 1e10) -> tuple[float, Partition]:
    """PipeDream's optimal pipeline on ``num_ranks`` ranks: its slowest stage time and its plan.

    Args:
        costs: per-layer costs (``time`` and ``params`` and ``output`` are used).
        num_ranks: M, ranks to use, all of them.
        bandwidth: bytes per second between ranks.

    Raises:
        UserError: num_ranks < 1 or bandwidth <= 0.

    Example:
        >>> t, plan = pipedream_plan(LayerCosts.uniform(3), 2, bandwidth=1e12)  # fast links: replicate
        >>> t, plan.counts, plan.replicas
        (4.5, (3,), (2,))
        >>> t, plan = pipedream_plan(LayerCosts.uniform(3), 2, bandwidth=0.1)  # slow links: pipeline
        >>> t, plan.counts, plan.replicas
        (6.0, (1, 2), (1, 1))
    """
    if num_ranks < 1:
        raise UserError(f"num_ranks={num_ranks!r} is invalid; give at least one rank")
    if bandwidth <= 0:
        raise UserError(f"bandwidth={bandwidth!r} is invalid; give bytes per second > 0")
    n, ranks = costs.num_layers, num_ranks
    best = np.full((n + 1, ranks + 1), np.inf)
    # choice[j, m] = (i, m'): the last stage is layers i..j-1 on m' ranks (i = 0: a single stage).
    choice = np.zeros((n + 1, ranks + 1, 2), dtype=np.int64)
    for m in range(1, ranks + 1):
        for j in range(1, n + 1):
            best[j, m] = float(stage_time(costs, 0, j, m, bandwidth))
            choice[j, m] = (0, m)
            starts = np.arange(1, j)
            if not len(starts):
                continue
            comm = cut_time(costs, starts, bandwidth)
            for last in range(1, m):
                values = np.maximum(
                    np.maximum(best[starts, m - last], comm), stage_time(costs, starts, j, last, bandwidth)
                )
                at = int(np.argmin(values))
                if values[at] < best[j, m]:
                    best[j, m], choice[j, m] = values[at], (starts[at], last)
    counts, replicas, j, m = [], [], n, ranks
    while j > 0:
        i, last = (int(x) for x in choice[j, m])
        counts.append(j - i)
        replicas.append(last)
        j, m = i, m - last
    return float(best[n, ranks]), Partition(tuple(counts[::-1]), tuple(replicas[::-1]))


def plan_time(costs: LayerCosts, plan: Partition, *, bandwidth: float = 1e10) -> float:
    """The slowest stage (or cut) of a plan under PipeDream's cost model (what ``pipedream_plan`` minimises)."""
    worst = 0.0
    for (start, stop), replicas in zip(plan.bounds, plan.replicas):
        worst = max(worst, float(stage_time(costs, start, stop, replicas, bandwidth)))
        if start > 0:
            worst = max(worst, float(cut_time(costs, start, bandwidth)))
    return worst
