"""The memory a part needs on its rank under a schedule: activations in flight plus weights and their state.

A part's memory is ``activations[k] x (bytes kept per microbatch, its output included) +
(weights[k] + state) x (parameter bytes)``, where ``activations[k]`` is the peak
number of microbatches whose activations part k holds at once under the
schedule (1F1B: D - r on rank r; GPipe: T), ``weights[k]`` the weight copies
it keeps (PipeDream's stash: more than one), and ``state`` the bytes of
gradients and optimizer state per weight byte (1 for SGD's gradient, 3 for
Adam's gradient and two moments). The counts come from the simulator's
``peak_activations`` and ``weight_versions`` of the chosen schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from pipeweave.errors import UserError
from pipeweave.partition.problem import LayerCosts
from pipeweave.partition.recompute import kept_bytes, replayed_bytes
from pipeweave.schedule.ir import Schedule
from pipeweave.sim.metrics import peak_activations
from pipeweave.sim.timeline import simulate
from pipeweave.sim.versions import weight_copies


@dataclass(frozen=True, kw_only=True)
class MemoryProfile:
    """Per part, how many microbatches of activations and weight copies its rank holds at peak.

    Example:
        >>> from pipeweave.schedule import generate
        >>> MemoryProfile.of_schedule(generate("1f1b", num_stages=4, num_microbatches=8)).activations
        (4.0, 3.0, 2.0, 1.0)
    """

    activations: tuple[float, ...]
    """Peak microbatches in flight, per part (units of M_a)."""
    weights: tuple[float, ...]
    """Peak weight copies, per part (units of M_theta)."""
    state: float = 1.0
    """Bytes of gradients and optimizer state per weight byte (SGD 1, momentum 2, Adam 3)."""
    ranks: tuple[int, ...] = ()
    """Rank of each part (empty: part k on rank k); a rank with several parts sums their memory."""
    weight_share: float = 1.0
    """The fraction of a weight copy one GPU holds: 1/N under N-way tensor parallelism, 1/(N P) under
    ZeRO-3 (``sim.shards.Shares``); ``state`` is then the sharded gradient and optimizer bytes."""

    def __post_init__(self) -> None:
        if len(self.activations) != len(self.weights):
            raise UserError(
                f"memory profile has {len(self.activations)} activation counts and "
                f"{len(self.weights)} weight counts; give one of each per part"
            )
        if self.state < 0:
            raise UserError(f"optimizer state={self.state!r} bytes per weight byte is negative; give >= 0")

    @property
    def num_parts(self) -> int:
        return len(self.activations)

    @property
    def one_part_per_rank(self) -> bool:
        return len(set(self.ranks)) == len(self.ranks)

    @classmethod
    def flat(cls, num_parts: int, *, state: float = 1.0) -> MemoryProfile:
        """One microbatch in flight and one weight copy per part (no schedule known)."""
        return cls(activations=(1.0,) * num_parts, weights=(1.0,) * num_parts, state=state)

    @classmethod
    def of_schedule(cls, schedule: Schedule, *, state: float = 1.0, weight_share: float = 1.0) -> MemoryProfile:
        """The profile of ``schedule``, from one simulation with unit costs.

        The in-flight count of a part is its rank's peak with activation 1 on
        that part and 0 elsewhere, so several parts on one rank are counted
        each at its own peak.

        Raises:
            UserError: the schedule's weight policy has no weight-memory model yet.
        """
        timeline = simulate(schedule)
        costs = timeline.costs
        assert costs is not None
        part_rank: dict[int, int] = {}
        for stage, part in enumerate(schedule.placement.stage_part):
            part_rank.setdefault(part, schedule.placement.stage_rank[stage])
        n = schedule.num_parts
        acts, weights = [], []
        for part in range(n):
            unit = tuple(1.0 if p == part else 0.0 for p in range(n))
            acts.append(peak_activations(timeline, replace(costs, activation=unit))[part_rank[part]])
            try:
                weights.append(weight_copies(schedule, replace(costs, weight=unit))[part_rank[part]])
            except NotImplementedError as exc:
                raise UserError(
                    f"weight memory of policy {schedule.policy} is not modelled ({exc}); "
                    "partition for a synchronous schedule"
                ) from exc
        ranks = tuple(part_rank[p] for p in range(n))
        return cls(activations=tuple(acts), weights=tuple(weights), state=state, ranks=ranks, weight_share=weight_share)

    def part_memory(
        self, costs: LayerCosts, part: int, starts: np.ndarray, stop: int, recompute: str = "none"
    ) -> np.ndarray:
        """Bytes part ``part`` needs when it is layers ``[start, stop)``, for every start.

        A part keeps its layers' activations and its own output (the layers' outputs inside the part
        are counted as the next layer's input), or what ``recompute`` keeps of them
        (``partition.recompute``), plus, recomputing, one microbatch's replayed activations while a
        backward runs.
        """
        par = costs.prefix("params")
        kept = kept_bytes(costs, starts, stop, recompute)
        result: np.ndarray = (
            self.activations[part] * kept
            + replayed_bytes(costs, starts, stop, recompute)
            + (self.weights[part] * self.weight_share + self.state) * (par[stop] - par[starts])
        )
        return result

    def memory_of(self, costs: LayerCosts, part: int, start: int, stop: int, recompute: str = "none") -> float:
        """Bytes part ``part`` needs when it is layers ``[start, stop)``."""
        return float(self.part_memory(costs, part, np.array([start]), stop, recompute)[0])
