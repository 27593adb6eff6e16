"""What recomputation costs and saves for a part of consecutive layers, from the layer costs (``sim.recompute``).

Per part ``[start, stop)`` and mode:

- **kept** bytes per microbatch from F to the backward: ``none`` its layers'
  ``activation`` and its output; ``selective`` their ``selective_activation``
  and its output; ``full`` only its input (the previous layer's output; the
  first part's data input is left out, a few bytes per sample);
- **replayed** bytes a backward holds on top while it runs: under ``full``,
  what ``none`` keeps less what ``full`` keeps (the replayed forward's
  activations); under ``selective`` none, as measured (each block's attention
  core is replayed inside its backward, after the blocks above freed theirs:
  benchmarks/memory/README.md, "Replayed activations in the simulated peak"),
  as ``sim`` counts it;
- **replay** time before each backward: ``selective`` its layers'
  ``selective_forward``, ``full`` their ``forward``.

Vectorised over the part's possible starts, as the partitioners ask (``balance.PartCost``).
"""

from __future__ import annotations

import numpy as np

from pipeweave.partition.problem import LayerCosts


def kept_bytes(costs: LayerCosts, starts: np.ndarray, stop: int, mode: str) -> np.ndarray:
    """Bytes a microbatch keeps in part ``[start, stop)`` under ``mode``, for every start.

    Example:
        >>> c = LayerCosts(**{**LayerCosts.uniform(3).to_json(), "output": [5.0, 5.0, 5.0]})
        >>> kept_bytes(c, np.array([0, 1]), 3, "none").tolist(), kept_bytes(c, np.array([0, 1]), 3, "full").tolist()
        ([8.0, 7.0], [0.0, 5.0])
    """
    if mode == "full":
        before = np.concatenate(([0.0], np.asarray(costs.output)))
        result: np.ndarray = before[starts]
        return result
    prefix = costs.prefix("selective_activation" if mode == "selective" else "activation")
    result = prefix[stop] - prefix[starts] + costs.output[stop - 1]
    return result


def replayed_bytes(costs: LayerCosts, starts: np.ndarray, stop: int, mode: str) -> np.ndarray:
    """Bytes a backward of the part holds on top while it replays: ``full``'s replayed forward (0 otherwise).

    Example:
        >>> c = LayerCosts(**{**LayerCosts.uniform(3).to_json(), "output": [5.0, 5.0, 5.0],
        ...                   "selective_activation": [0.5, 0.5, 0.5]})  # selective keeps half of each layer's
        >>> [replayed_bytes(c, np.array([0, 1]), 3, mode).tolist() for mode in ("full", "selective", "none")]
        [[8.0, 2.0], [0.0, 0.0], [0.0, 0.0]]
    """
    if mode != "full":
        return np.zeros(len(starts))
    result: np.ndarray = kept_bytes(costs, starts, stop, "none") - kept_bytes(costs, starts, stop, mode)
    return np.maximum(result, 0.0)


def replay_time(costs: LayerCosts, starts: np.ndarray, stop: int, mode: str) -> np.ndarray:
    """Time replayed before each backward of the part under ``mode``, for every start."""
    if mode == "none":
        return np.zeros(len(starts))
    prefix = costs.prefix("selective_forward" if mode == "selective" else "forward")
    result: np.ndarray = prefix[stop] - prefix[starts]
    return result
