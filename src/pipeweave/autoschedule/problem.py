"""A zero-bubble scheduling instance (Qi et al., ICLR 2024, section 3): stages, times, memory.

The instance is what the automatic schedulers of the zero-bubble paper take as
input: D ranks, T microbatches, a straight or V-shaped placement, per-part
times of F, I (the paper's B) and W, a per-hop communication time, the
activation memory M_a of a microbatch (M_W of it held from I until W) and a
per-rank activation limit. Costs are resolved exactly as the simulator resolves
them (``CostModel.for_parts``), so a schedule's simulated times are the times
the searches reason about.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from pipeweave.schedule.ir import Action, Op, Placement, ScheduleError
from pipeweave.schedule.levers import DEFAULT_BANDWIDTH
from pipeweave.sim.cost import CostModel, PartCosts

# Tolerance of memory comparisons: limits are sums of floats such as 0.5 x 8.
MEMORY_EPS = 1e-9


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One instance of automatic zero-bubble scheduling.

    Example:
        >>> p = Problem(num_stages=4, num_microbatches=8, activation_limit=1.0)
        >>> p.limit, p.start_offset
        ((4.0, 4.0, 4.0, 4.0), (0.0, 1.0, 2.0, 3.0))
    """

    num_stages: int
    """D: pipeline depth in ranks."""
    num_microbatches: int
    """T: microbatches per step."""
    vshape: bool = False
    """Two chunks per rank in a V (ZB-V) instead of one straight stage per rank."""
    cost: CostModel = field(default_factory=CostModel)
    """Times and memory; a scalar is the cost of one D-th of the model."""
    activation_limit: float = 1.0
    """K: per-rank activation limit as a multiple of the 1F1B peak D x M_a (``math.inf``: none)."""
    offload: frozenset[int] = frozenset()
    """Parts whose saved activations go to host memory after F and come back before I (``schedule.levers``):
    such a part holds M_a only while its F or I runs, and M_W from I to W; its F and I each take the copy
    of its M_a at ``host_bandwidth`` on top, as the simulator charges them (``sim.levers``)."""
    host_bandwidth: float = DEFAULT_BANDWIDTH
    """Units of M_a the offload copies move per unit of time."""
    placement: Placement = field(init=False, repr=False, compare=False)
    costs: PartCosts = field(init=False, repr=False, compare=False)
    peak_limit: tuple[float, ...] = field(init=False, repr=False, compare=False)
    """Per rank, the activation limit in the cost model's units: what the simulated peak may reach."""
    limit: tuple[float, ...] = field(init=False, repr=False, compare=False)
    """Per rank, what the activations held for backwards may reach: ``peak_limit`` less the largest replay
    of the rank's parts (``PartCosts.replayed``), which a recomputing backward holds on top while it runs;
    ``peak_limit`` itself where nothing is replayed. The search's own accounting checks this one."""
    start_offset: tuple[float, ...] = field(init=False, repr=False, compare=False)
    """Per rank, the earliest start of its first action (F of microbatch 0)."""

    def __post_init__(self) -> None:
        for name in ("num_stages", "num_microbatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ScheduleError(f"{name}={value!r} is invalid; give an integer >= 1")
        d = self.num_stages
        placement = Placement.vshape(d) if self.vshape else Placement.straight(d)
        costs = _with_copies(
            self.cost.for_parts(num_parts=placement.num_parts, num_ranks=d), self.offload, self.host_bandwidth
        )
        object.__setattr__(self, "placement", placement)
        object.__setattr__(self, "costs", costs)
        # K counts in microbatches kept without recomputation: the same bytes whatever the parts recompute.
        plain = replace(self.cost, recompute="none").for_parts(num_parts=placement.num_parts, num_ranks=d)
        per_mb = [sum(plain.activation[s] for s in placement.stages_on(r)) for r in range(d)]
        replay = [
            max((costs.replayed[s] for s in placement.stages_on(r)), default=0.0) if costs.replayed else 0.0
            for r in range(d)
        ]
        stored = [self._least_held(costs, r) + x for r, x in enumerate(replay)]
        limit = tuple(self.activation_limit * d * m for m in per_mb)
        if not all(x >= m * (1.0 - MEMORY_EPS) for x, m in zip(limit, stored)) or math.isnan(self.activation_limit):
            least = max((m / (d * p) for m, p in zip(stored, per_mb) if p > 0), default=1.0 / d)
            raise ScheduleError(
                f"activation_limit={self.activation_limit!r} holds less than one microbatch per rank; "
                f"give activation_limit >= {least:.4g}" + (f" (1/{d})" if least == 1.0 / d else "")
            )
        object.__setattr__(self, "peak_limit", limit)
        object.__setattr__(self, "limit", tuple(x - y for x, y in zip(limit, replay)))
        object.__setattr__(self, "start_offset", tuple(self._first_start(r) for r in range(d)))

    @property
    def num_ranks(self) -> int:
        return self.num_stages

    @property
    def num_parts(self) -> int:
        return self.placement.num_parts

    def stages_on(self, rank: int) -> tuple[int, ...]:
        return self.placement.stages_on(rank)

    def rank_of(self, stage: int) -> int:
        return self.placement.stage_rank[stage]

    def hop(self, stage: int, other: int | None) -> float:
        """Communication time from ``stage`` to ``other`` (0 on the same rank)."""
        if other is None or self.rank_of(other) == self.rank_of(stage):
            return 0.0
        return self.costs.comm

    def duration(self, stage: int, op: Op) -> float:
        if op is Op.F:
            return self.costs.f[stage]
        if op is Op.I:
            return self.costs.b[stage]
        if op is Op.W:
            return self.costs.w[stage]
        raise ValueError(f"op {op} has no duration in a zero-bubble instance")

    def work(self, rank: int) -> float:
        """Busy time of a rank in one step: T x (f + b + w) of its stages."""
        c = self.costs
        return self.num_microbatches * sum(c.f[s] + c.b[s] + c.w[s] for s in self.stages_on(rank))

    def actions_on(self, rank: int) -> list[Action]:
        """Every F, I, W of a rank (in no particular order)."""
        return [
            Action(s, op, j)
            for s in self.stages_on(rank)
            for op in (Op.F, Op.I, Op.W)
            for j in range(self.num_microbatches)
        ]

    def _least_held(self, costs: PartCosts, rank: int) -> float:
        """What ``rank`` holds with one microbatch in flight: every stage's M_a, but an offloaded stage's
        only while it runs (the largest of them)."""
        stages = self.placement.stages_on(rank)
        kept = sum(costs.activation[s] for s in stages if s not in self.offload)
        moved = [costs.activation[s] for s in stages if s in self.offload]
        return kept + max(moved, default=0.0)

    def _first_start(self, rank: int) -> float:
        # F of microbatch 0 on the rank's first stage, after the forward chain before it.
        first = min(self.stages_on(rank))
        t, s = 0.0, 0
        while s != first:
            nxt = self.placement.next_stage(s)
            assert nxt is not None
            t += self.costs.f[s] + self.hop(s, nxt)
            s = nxt
        return t


def _with_copies(costs: PartCosts, offload: frozenset[int], bandwidth: float) -> PartCosts:
    """``costs`` with each offloaded part's F and I lengthened by the copy of its M_a (``sim.levers.stash_extra``)."""
    if not offload:
        return costs
    copy = [costs.activation[s] / bandwidth if s in offload else 0.0 for s in range(len(costs.f))]
    return replace(costs, f=tuple(x + c for x, c in zip(costs.f, copy)), b=tuple(x + c for x, c in zip(costs.b, copy)))


def problem_from_times(
    num_stages: int,
    num_microbatches: int,
    *,
    vshape: bool = False,
    time_f: float = 1.0,
    time_b: float = 1.0,
    time_w: float = 1.0,
    time_comm: float = 0.0,
    activation_limit: float = 1.0,
    mem_w: float = 0.5,
) -> Problem:
    """An instance from scalar times (per D-th of the model), as the CLI takes them.

    Raises:
        UserError: a negative time, mem_w outside [0, 1], or a limit below one microbatch.

    Example:
        >>> problem_from_times(8, 24, time_f=18.522, activation_limit=2).limit[0]
        16.0
    """
    if isinstance(activation_limit, float) and math.isnan(activation_limit):
        raise ScheduleError("activation_limit=nan is invalid; give a number such as 1 or 2")
    cost = CostModel(f=time_f, b=time_b, w=time_w, comm=time_comm, mem_w=mem_w)
    return Problem(
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        vshape=vshape,
        cost=cost,
        activation_limit=activation_limit,
    )
