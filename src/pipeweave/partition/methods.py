"""The partitioners selectable with ``--partition``, and their registry ``PARTITIONERS``.

``uniform``, ``parameters`` and ``type:REGEX`` follow DeepSpeed's
``PipelineModule(partition_method=...)``; ``time`` and ``memory`` are exact
dynamic programs (``balance.py``); ``pipedream`` is PipeDream's planner
(``pipedream.py``); ``explicit`` takes the user's layer counts.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pipeweave.errors import UserError
from pipeweave.partition.balance import PartCost, balanced, span_cost
from pipeweave.partition.memory import MemoryProfile
from pipeweave.partition.pipedream import pipedream_plan
from pipeweave.partition.problem import LayerCosts, Partition


@dataclass(frozen=True, kw_only=True)
class PartitionContext:
    """What some partitioners need beyond the costs and the number of parts."""

    regex: str | None = None
    """``type:REGEX``: the layers whose type or name matches are balanced."""
    counts: tuple[int, ...] | None = None
    """``explicit``: the layer count of each part."""
    memory_limit: float | None = None
    """``memory``: bytes one rank may hold."""
    profile: MemoryProfile | None = None
    """``memory``: the schedule's activation and weight profile (default: flat)."""
    bandwidth: float = 1e10
    """``pipedream``: bytes per second between ranks (10 GB/s by default, a PCIe-class link)."""


Partitioner = Callable[[LayerCosts, int, PartitionContext], Partition]


def check_parts(costs: LayerCosts, num_parts: int) -> None:
    """Raise UserError unless ``1 <= num_parts <= num_layers``."""
    if not isinstance(num_parts, int) or num_parts < 1:
        raise UserError(f"num_parts={num_parts!r} is invalid; give at least one part")
    if num_parts > costs.num_layers:
        raise UserError(
            f"{num_parts} parts for a model of {costs.num_layers} layers; "
            f"use at most {costs.num_layers} parts or a deeper model"
        )


def uniform(costs: LayerCosts, num_parts: int, context: PartitionContext) -> Partition:
    """Equal layer counts; the first ``n mod K`` parts get one more (DeepSpeed's ``uniform``).

    Example:
        >>> uniform(LayerCosts.uniform(7), 3, PartitionContext()).counts
        (3, 2, 2)
    """
    check_parts(costs, num_parts)
    size, extra = divmod(costs.num_layers, num_parts)
    return Partition(tuple(size + (1 if k < extra else 0) for k in range(num_parts)))


def _split(costs: LayerCosts, num_parts: int, primary: PartCost, secondary: PartCost) -> Partition:
    check_parts(costs, num_parts)
    result = balanced(costs.num_layers, num_parts, primary, secondary)
    assert result is not None  # unconstrained: always feasible
    return Partition(tuple(result[1]))


def _layer_count() -> PartCost:
    return lambda k, starts, stop: (stop - starts).astype(float)


def time(costs: LayerCosts, num_parts: int, context: PartitionContext) -> Partition:
    """Least slowest-part F + I + W time, exactly (ties: most even layer counts).

    Example:
        >>> c = LayerCosts.uniform(4)
        >>> c = LayerCosts(**{**c.to_json(), "forward": [1, 1, 1, 5]})
        >>> time(c, 2, PartitionContext()).counts
        (3, 1)
    """
    check_parts(costs, num_parts)
    return _split(costs, num_parts, span_cost(costs.prefix("time")), _layer_count())


def parameters(costs: LayerCosts, num_parts: int, context: PartitionContext) -> Partition:
    """Least largest parameter bytes per part, exactly (ties: least slowest part).

    Example:
        >>> c = LayerCosts(**{**LayerCosts.uniform(4).to_json(), "params": [4, 1, 1, 2]})
        >>> parameters(c, 2, PartitionContext()).counts
        (1, 3)
    """
    check_parts(costs, num_parts)
    return _split(costs, num_parts, span_cost(costs.prefix("params")), span_cost(costs.prefix("time")))


def matching(costs: LayerCosts, regex: str) -> np.ndarray:
    """1.0 for each layer whose type or name matches ``regex`` (case-insensitive), else 0.0.

    Raises:
        UserError: the regex is invalid or matches no layer.
    """
    try:
        pattern = re.compile(regex, re.IGNORECASE)
    except re.error as exc:
        raise UserError(f"type:{regex} is not a valid regular expression ({exc}); fix the pattern") from exc
    hits = np.array(
        [1.0 if pattern.search(t) or pattern.search(n) else 0.0 for t, n in zip(costs.types, costs.names)]
    )
    if not hits.any():
        kinds = ", ".join(sorted(set(costs.types)))
        raise UserError(f"type:{regex} matches no layer; the layer types are: {kinds}")
    return hits


def by_type(costs: LayerCosts, num_parts: int, context: PartitionContext) -> Partition:
    """Balance the number of layers matching ``context.regex`` (ties: least slowest part).

    Example:
        >>> c = LayerCosts(**{**LayerCosts.uniform(6).to_json(),
        ...                   "types": ["Embed", "Block", "Block", "Block", "Block", "Head"]})
        >>> by_type(c, 2, PartitionContext(regex="block")).counts
        (3, 3)
    """
    check_parts(costs, num_parts)
    if not context.regex:
        raise UserError("--partition type: needs a pattern; write type:REGEX, e.g. type:Block")
    hits = np.concatenate(([0.0], np.cumsum(matching(costs, context.regex))))
    return _split(costs, num_parts, span_cost(hits), span_cost(costs.prefix("time")))


def explicit(costs: LayerCosts, num_parts: int, context: PartitionContext) -> Partition:
    """The user's layer counts, checked.

    Example:
        >>> explicit(LayerCosts.uniform(8), 4, PartitionContext(counts=(3, 2, 2, 1))).counts
        (3, 2, 2, 1)
    """
    check_parts(costs, num_parts)
    counts = context.counts
    if counts is None:
        raise UserError("--partition explicit needs --layers-per-stage, e.g. --layers-per-stage 3,2,2,1")
    if len(counts) != num_parts:
        raise UserError(f"--layers-per-stage {_csv(counts)} gives {len(counts)} parts for {num_parts}; give one count per part")
    if any(c < 1 for c in counts):
        raise UserError(f"--layers-per-stage {_csv(counts)} has an empty part; give every part at least one layer")
    if sum(counts) != costs.num_layers:
        raise UserError(
            f"--layers-per-stage {_csv(counts)} sums to {sum(counts)} layers but the model has "
            f"{costs.num_layers}; make the counts sum to {costs.num_layers}"
        )
    return Partition(tuple(counts))


def memory(costs: LayerCosts, num_parts: int, context: PartitionContext) -> Partition:
    """Least slowest-part time with every part within ``memory_limit`` (ties: least memory), exactly.

    Under 1F1B part k holds D - k microbatches, so when the limit binds the
    early parts get fewer layers.

    Raises:
        UserError: no limit, a profile of another part count, several parts on
            one rank (the constraint would couple them), or a limit too small
            for any split (the message gives the least limit that fits).

    Example:
        >>> c = LayerCosts.uniform(8)
        >>> prof = MemoryProfile(activations=(4.0, 3.0, 2.0, 1.0), weights=(1.0,) * 4, state=0.0)
        >>> memory(c, 4, PartitionContext(memory_limit=9.0, profile=prof)).counts
        (1, 2, 2, 3)
    """
    check_parts(costs, num_parts)
    if context.memory_limit is None or context.memory_limit <= 0:
        raise UserError("--partition memory needs --memory-limit BYTES > 0, the memory one rank may hold")
    profile = context.profile or MemoryProfile.flat(num_parts)
    if profile.num_parts != num_parts:
        raise UserError(f"memory profile of {profile.num_parts} parts for {num_parts}; profile the same schedule")
    if not profile.one_part_per_rank:
        raise UserError(
            "--partition memory needs one part per rank; use a schedule with one chunk per rank "
            "or --partition time"
        )
    limit = context.memory_limit

    def part_memory(k: int, starts: np.ndarray, stop: int) -> np.ndarray:
        return profile.part_memory(costs, k, starts, stop)

    result = balanced(
        costs.num_layers, num_parts, span_cost(costs.prefix("time")), part_memory,
        allowed=lambda k, starts, stop: part_memory(k, starts, stop) <= limit,
    )
    if result is None:
        least = balanced(costs.num_layers, num_parts, part_memory)
        assert least is not None
        raise UserError(
            f"--memory-limit {limit:.4g} bytes is below the least any split needs ({least[0]:.4g} bytes); "
            "raise the limit, add stages or recompute activations"
        )
    return Partition(tuple(result[1]))


def pipedream(costs: LayerCosts, num_parts: int, context: PartitionContext) -> Partition:
    """PipeDream's plan for ``num_parts`` ranks: stages, their layers and replicas (see ``pipedream.py``)."""
    check_parts(costs, num_parts)
    return pipedream_plan(costs, num_parts, bandwidth=context.bandwidth)[1]


def _csv(counts: tuple[int, ...]) -> str:
    return ",".join(map(str, counts))


PARTITIONERS: dict[str, Partitioner] = {
    "uniform": uniform,
    "parameters": parameters,
    "type": by_type,
    "time": time,
    "pipedream": pipedream,
    "memory": memory,
    "explicit": explicit,
}


def partition(method: str, costs: LayerCosts, num_parts: int, context: PartitionContext | None = None) -> Partition:
    """Run the partitioner named ``method`` (``type:REGEX`` carries its pattern).

    Raises:
        UserError: unknown method, or the method's own errors.

    Example:
        >>> partition("type:layer", LayerCosts.uniform(5), 2).counts  # ties: later parts get more
        (2, 3)
    """
    context = context or PartitionContext()
    name, sep, arg = method.partition(":")
    if name not in PARTITIONERS or (sep and name != "type"):
        raise UserError(f"unknown partition method {method!r}; choose one of: {', '.join(PARTITIONERS)} (type:REGEX)")
    if name == "type":
        context = PartitionContext(**{**context.__dict__, "regex": arg})
    return PARTITIONERS[name](costs, num_parts, context)
