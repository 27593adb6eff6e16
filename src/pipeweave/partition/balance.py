"""Exact min-max partitioning of a sequence of layers into consecutive parts (a dynamic program).

The bottleneck problem: cut layers ``0..n-1`` into ``K`` non-empty consecutive
parts so that the largest part cost is least, where a part's cost may depend
on its position ``k`` (memory of 1F1B's early stages) and a part may be
forbidden (a memory limit). This is the linear-partition problem of the
torchgpipe balancer and of DeepSpeed's ``partition_balanced``, solved here by
dynamic programming rather than by bisection so that position-dependent costs
and constraints fit.

Optimality. Let ``OPT(k, j)`` be the least bottleneck over splits of layers
``[0, j)`` into ``k`` allowed parts, and ``R(k, j) = min over k-1 <= i < j of
max(R(k-1, i), cost(k-1, i, j))`` over allowed last parts ``[i, j)``, with
``R(0, 0) = 0`` and ``R(0, j>0) = inf``. Claim ``R = OPT``, by induction on k.
(<=) any split of ``[0, j)`` into k parts ends with some allowed part ``[i, j)``
and begins with a split of ``[0, i)`` into k-1 parts whose bottleneck is
``>= OPT(k-1, i) = R(k-1, i)``, so its value ``>=`` the term for that i.
(>=) the minimising i, followed after an optimal split of ``[0, i)``, is a
split with value exactly ``R(k, j)``. Costs and constraints depend only on
``(k, i, j)``, never on the earlier cuts, which is what the induction needs.
Time ``O(K n^2)``, vectorised over i.

Ties are broken lexicographically by a second cost (``balanced``): first the
least bottleneck of the primary cost, then, among the splits that reach it,
the least bottleneck of the secondary one.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# cost(k, starts, stop) -> the cost of part k = layers [start, stop) for every start in ``starts``.
PartCost = Callable[[int, np.ndarray, int], np.ndarray]
# allowed(k, starts, stop) -> whether part k may be layers [start, stop), for every start.
Allowed = Callable[[int, np.ndarray, int], np.ndarray]


def span_cost(prefix: np.ndarray) -> PartCost:
    """The part cost ``prefix[stop] - prefix[start]`` (a plain sum of per-layer costs)."""

    def cost(k: int, starts: np.ndarray, stop: int) -> np.ndarray:
        result: np.ndarray = prefix[stop] - prefix[starts]
        return result

    return cost


def min_max_split(
    num_layers: int, num_parts: int, cost: PartCost, allowed: Allowed | None = None
) -> tuple[float, list[int]] | None:
    """The least bottleneck and the layer counts that reach it, or None if no split is allowed.

    Args:
        num_layers: n, layers to cut (n >= num_parts >= 1).
        num_parts: K, parts to cut them into (each non-empty).
        cost: position-dependent part cost (see ``PartCost``).
        allowed: which parts are allowed (default: all).

    Example:
        >>> min_max_split(4, 2, span_cost(np.array([0.0, 1, 2, 3, 7])))
        (4.0, [3, 1])
    """
    n, parts = num_layers, num_parts
    best = np.full((parts + 1, n + 1), np.inf)
    choice = np.zeros((parts + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for k in range(1, parts + 1):
        # part k-1 (0-based) ends at j; the k-1 parts before it need k-1 layers, the parts after it n-j.
        for j in range(k, n - (parts - k) + 1):
            starts = np.arange(k - 1, j)
            values = np.maximum(best[k - 1, starts], cost(k - 1, starts, j))
            if allowed is not None:
                values = np.where(allowed(k - 1, starts, j), values, np.inf)
            at = int(np.argmin(values))
            best[k, j], choice[k, j] = values[at], starts[at]
    if not np.isfinite(best[parts, n]):
        return None
    counts, stop = [], n
    for k in range(parts, 0, -1):
        start = int(choice[k, stop])
        counts.append(stop - start)
        stop = start
    return float(best[parts, n]), counts[::-1]


def balanced(
    num_layers: int,
    num_parts: int,
    primary: PartCost,
    secondary: PartCost | None = None,
    allowed: Allowed | None = None,
) -> tuple[float, list[int]] | None:
    """Least bottleneck of ``primary``; among the splits reaching it, least bottleneck of ``secondary``.

    Example:
        >>> time = span_cost(np.array([0.0, 1, 2, 3, 4]))   # four layers of time 1
        >>> layers = span_cost(np.arange(5.0))
        >>> balanced(4, 2, time, layers)
        (2.0, [2, 2])
    """
    first = min_max_split(num_layers, num_parts, primary, allowed)
    if first is None or secondary is None:
        return first
    bound = first[0] + 1e-9 * max(1.0, abs(first[0]))  # the same sums recomputed: equal up to rounding

    def within(k: int, starts: np.ndarray, stop: int) -> np.ndarray:
        ok: np.ndarray = primary(k, starts, stop) <= bound
        return ok if allowed is None else ok & allowed(k, starts, stop)

    second = min_max_split(num_layers, num_parts, secondary, within)
    assert second is not None  # the first pass's split is allowed
    return first[0], second[1]
