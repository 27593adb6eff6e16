"""The partitioners selectable with ``--partition``, and their registry ``PARTITIONERS``.

``uniform``, ``parameters`` and ``type:REGEX`` follow DeepSpeed's
``PipelineModule(partition_method=...)``; ``time`` and ``memory`` are exact
dynamic programs (``balance.py``); ``pipedream`` is PipeDream's planner
(``pipedream.py``); ``explicit`` takes the user's layer counts.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pipeweave.errors import UserError
from pipeweave.partition.balance import PartCost, balanced, span_cost
from pipeweave.partition.memory import MemoryProfile
from pipeweave.partition.pipedream import pipedream_plan
from pipeweave.partition.problem import LayerCosts, Partition
from pipeweave.partition.recompute import replay_time
from pipeweave.sim.recompute import RECOMPUTE, per_part


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
    first: int | None = None
    """``uniform``: blocks of the first part (Megatron's first pipeline stage), None: as the others."""
    last: int | None = None
    """``uniform``: blocks of the last part, None: as the others."""
    ends: int = 0
    """Layers the first and the last part hold beyond their blocks: 1 for a transformer (its embedding, its
    head), whose ``first`` and ``last`` count blocks as Megatron-LM counts them; 0 for a stack of layers."""
    recompute: str = "none"
    """Recomputation per part (``sim.recompute``: one mode, or one per part), or ``auto``: ``memory`` chooses
    each part's with the split (the fastest that fits the limit)."""


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
    """Equal layer counts; the first ``n mod K`` parts get one more (DeepSpeed's ``uniform``). With
    ``context.first`` or ``context.last`` those parts take that many blocks and the parts between share the
    rest as evenly (Megatron-LM's ``--decoder-first/last-pipeline-num-layers``, never refused for a count
    that does not divide).

    Example:
        >>> uniform(LayerCosts.uniform(7), 3, PartitionContext()).counts
        (3, 2, 2)
        >>> uniform(LayerCosts.uniform(128), 16, PartitionContext(first=7, last=7, ends=1)).counts[:2]  # Llama 3
        (8, 8)
    """
    check_parts(costs, num_parts)
    if context.first is None and context.last is None:
        return Partition(_even(costs.num_layers, num_parts))
    return Partition(_ends_fixed(costs.num_layers, num_parts, context))


def _even(num_layers: int, num_parts: int) -> tuple[int, ...]:
    size, extra = divmod(num_layers, num_parts)
    return tuple(size + (1 if k < extra else 0) for k in range(num_parts))


def _ends_fixed(num_layers: int, num_parts: int, context: PartitionContext) -> tuple[int, ...]:
    """``uniform``'s counts with the first and/or last part's blocks given (in layers, ends included)."""
    given = {"--first-stage-layers": context.first, "--last-stage-layers": context.last}
    named = " and ".join(f"{flag} {n}" for flag, n in given.items() if n is not None)
    if num_parts < 2:
        raise UserError(f"{named} needs at least 2 parts, not {num_parts}; add stages or drop it")
    blocks = num_layers - 2 * context.ends
    fixed = [n for n in (context.first, context.last) if n is not None]
    for n in fixed:
        if n < 0 or (context.ends == 0 and n < 1):
            raise UserError(f"{named}: {n} is invalid; give at least {1 - context.ends} layer(s)")
    between = num_parts - len(fixed)
    rest = blocks - sum(fixed)
    what = "blocks" if context.ends else "layers"
    if between == 0 and rest != 0:
        raise UserError(
            f"{named} give {sum(fixed)} {what} to the only 2 parts, the model has {blocks}; make them add up to "
            f"{blocks}"
        )
    if rest < between:
        raise UserError(
            f"{named} leave {rest} of the model's {blocks} {what} for the other {between} part(s); make them "
            f"add up to at most {blocks - between} (one or more for each other part)"
        )
    middle = list(_even(rest, between)) if between else []
    first = context.first if context.first is not None else middle.pop(0)
    last = context.last if context.last is not None else middle.pop()
    return (first + context.ends, *middle, last + context.ends)


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
    hits = np.array([1.0 if pattern.search(t) or pattern.search(n) else 0.0 for t, n in zip(costs.types, costs.names)])
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
        raise UserError(
            f"--layers-per-stage {_csv(counts)} gives {len(counts)} parts for {num_parts}; give one count per part"
        )
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
    early parts get fewer layers. With ``context.recompute`` ``auto`` each part
    also takes the fastest recomputation that fits (``partition.recompute``:
    a replayed forward before each backward, fewer bytes kept), chosen with
    the split: a part's time and memory depend only on its own layers and
    mode, so the dynamic program stays exact for this bottleneck.

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
            "--partition memory needs one part per rank; use a schedule with one chunk per rank or --partition time"
        )
    modes = (
        [RECOMPUTE] * num_parts
        if context.recompute == "auto"
        else [(m,) for m in per_part(context.recompute, num_parts)]
    )
    choice = _Choice(costs, profile, modes, context.memory_limit)
    result = balanced(costs.num_layers, num_parts, choice.time, choice.memory, allowed=choice.fits)
    if result is None:
        least = balanced(costs.num_layers, num_parts, choice.least_memory)
        assert least is not None
        how = "any split and recomputation needs" if context.recompute == "auto" else "any split needs"
        raise UserError(
            f"--memory-limit {context.memory_limit:.4g} bytes is below the least {how} ({least[0]:.4g} bytes); "
            + (
                "raise the limit or add stages"
                if context.recompute == "auto"
                else "raise the limit, add stages or recompute activations (--recompute auto)"
            )
        )
    plan = Partition(tuple(result[1]))
    return Partition(
        plan.counts, recompute=tuple(choice.mode(k, start, stop) for k, (start, stop) in enumerate(plan.bounds))
    )


class _Choice:
    """Per part and possible layers, the fastest recomputation mode that fits the limit, its time and memory."""

    def __init__(self, costs: LayerCosts, profile: MemoryProfile, modes: list[tuple[str, ...]], limit: float) -> None:
        self.costs, self.profile, self.modes, self.limit = costs, profile, modes, limit

    def _table(self, k: int, starts: np.ndarray, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(time, memory) per mode of part k (rows) for every start (columns); infeasible times are inf."""
        base = self.costs.prefix("time")[stop] - self.costs.prefix("time")[starts]
        times = np.array([base + replay_time(self.costs, starts, stop, m) for m in self.modes[k]])
        memory = np.array([self.profile.part_memory(self.costs, k, starts, stop, m) for m in self.modes[k]])
        return np.where(memory <= self.limit, times, np.inf), memory

    def _best(self, k: int, starts: np.ndarray, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        times, memory = self._table(k, starts, stop)
        at = np.argmin(times, axis=0)  # the first of equal times: the mode that replays least
        columns = np.arange(len(starts))
        return times[at, columns], memory[at, columns], at

    def time(self, k: int, starts: np.ndarray, stop: int) -> np.ndarray:
        return self._best(k, starts, stop)[0]

    def memory(self, k: int, starts: np.ndarray, stop: int) -> np.ndarray:
        return self._best(k, starts, stop)[1]

    def fits(self, k: int, starts: np.ndarray, stop: int) -> np.ndarray:
        ok: np.ndarray = np.isfinite(self.time(k, starts, stop))
        return ok

    def least_memory(self, k: int, starts: np.ndarray, stop: int) -> np.ndarray:
        least: np.ndarray = self._table(k, starts, stop)[1].min(axis=0)
        return least

    def mode(self, k: int, start: int, stop: int) -> str:
        return self.modes[k][int(self._best(k, np.array([start]), stop)[2][0])]


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
    if context.recompute == "auto" and name != "memory":
        raise UserError(
            f"--recompute auto is chosen by --partition memory under --memory-limit, not by {method}; "
            "give --partition memory or the modes (none, selective, full or one per part)"
        )
    plan = PARTITIONERS[name](costs, num_parts, context)
    if name == "memory":
        return plan
    return dataclasses.replace(plan, recompute=per_part(context.recompute, plan.num_parts))
