"""The pipeline side of a prediction, cached by shape: schedules, activation peaks, simulated timelines.

Thousands of configurations share a few hundred schedule shapes (schedule, D,
T, v): the actions, and so the activation peak in bytes per sample of a
microbatch (``planner.memory``), depend on the shape alone, and configurations that
differ only in ZeRO stage share the very same timeline. What is kept of a
timeline is a ``Summary`` (a few numbers per part), not its events.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeweave.planner.activations import Profile, activation_profile, peaks
from pipeweave.planner.candidate import Config
from pipeweave.planner.costs import Cluster, transformer
from pipeweave.planner.critical import Path, critical_path
from pipeweave.planner.memory import (
    ALLOWANCE_BYTES,
    PARAM_BYTES,
    block_activation_bytes,
    part_activation_bytes,
    part_parameters,
)
from pipeweave.planner.transformer import Transformer
from pipeweave.schedule import generate
from pipeweave.schedule.ir import Op, Schedule, ScheduleError
from pipeweave.sim.cost import CostModel
from pipeweave.sim.parallel import part_holders
from pipeweave.sim.timeline import Timeline, simulate

Times = tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...], float]


@dataclass(frozen=True)
class Summary:
    """What the planner keeps of a simulated timeline."""

    makespan: float
    bubble_ratio: float
    busy: float
    """The busiest rank's compute time."""
    num_parts: int
    last_grad_end: tuple[float, ...]
    """Per part, the end of its last weight gradient (W or B)."""
    last_backward_start: tuple[float, ...]
    """Per part, the start of its last backward (I or B)."""
    update_order: tuple[tuple[int, ...], ...]
    """Per rank, the parts of its ``U`` actions in order."""
    holders: tuple[tuple[int, ...], ...]
    """Per part, the pipeline ranks holding it (``sim.parallel.part_holders``)."""
    last_grad_start: tuple[float, ...] = ()
    """Per part, the start of its last weight gradient (W or B): where its gradients begin to be final, so where
    a reduction overlapped with the backward can begin (a split backward's I produces none)."""
    first_grad_end: tuple[float, ...] = ()
    """Per part, the end of its first weight gradient (W or B): where ZeRO 2, reducing after each, begins."""


def summarise(timeline: Timeline, costs: Times) -> Summary:
    """The ``Summary`` of a simulated timeline under ``costs``' per-part times. Only each row's tail is read
    (its last weight gradients and backwards, its updates); busy time follows from the microbatch counts."""
    schedule = timeline.schedule
    part_of, parts = schedule.placement.stage_part, schedule.num_parts
    f, i, w, _ = costs
    grad_end, bwd_start, grad_start = [0.0] * parts, [0.0] * parts, [0.0] * parts
    order: list[tuple[int, ...]] = []
    busy = [0.0] * schedule.num_ranks
    for stage, rank in enumerate(schedule.placement.stage_rank):
        k = part_of[stage]
        busy[rank] += len(schedule.microbatches_of(stage)) * (f[k] + i[k] + w[k])
    for row, rank_stages in zip(timeline.events, _stages_by_rank(schedule)):
        updates, need_grad, need_bwd = [], set(rank_stages), set(rank_stages)
        for (stage, op, _), start, end in reversed(row):
            part = part_of[stage]
            if op is Op.U:
                updates.append(part)
                continue
            if stage in need_grad and (op is Op.W or op is Op.B):
                grad_end[part] = max(grad_end[part], end)
                grad_start[part] = max(grad_start[part], start)
                need_grad.discard(stage)
            if stage in need_bwd and (op is Op.I or op is Op.B):
                bwd_start[part] = max(bwd_start[part], start)
                need_bwd.discard(stage)
            if not need_grad and not need_bwd:
                break
        order.append(tuple(reversed(updates)))
    first = _first_grad_ends(timeline, parts)
    rows = [row for row in timeline.events if row]
    spans = [row[-1].end - row[0].start for row in rows]
    makespan = max(row[-1].end for row in rows) - min(row[0].start for row in rows)
    ratio = 1.0 - sum(busy) / (len(timeline.events) * max(spans)) if max(spans) > 0 else 0.0
    return Summary(
        makespan,
        ratio,
        max(busy),
        parts,
        tuple(grad_end),
        tuple(bwd_start),
        tuple(order),
        part_holders(schedule),
        tuple(grad_start),
        first,
    )


def _first_grad_ends(timeline: Timeline, parts: int) -> tuple[float, ...]:
    """Per part, the end of its first W or B on any rank (each row read up to its stages' first ones)."""
    part_of = timeline.schedule.placement.stage_part
    first = [math.inf] * parts
    for row, rank_stages in zip(timeline.events, _stages_by_rank(timeline.schedule)):
        need = set(rank_stages)
        for (stage, op, _), _, end in row:
            if stage in need and (op is Op.W or op is Op.B):
                first[part_of[stage]] = min(first[part_of[stage]], end)
                need.discard(stage)
                if not need:
                    break
    return tuple(0.0 if math.isinf(t) else t for t in first)


def _stages_by_rank(schedule: Schedule) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(schedule.num_ranks)]
    for stage, rank in enumerate(schedule.placement.stage_rank):
        out[rank].append(stage)
    return out


@dataclass
class Pipeline:
    """The caches (module docstring)."""

    schedules: dict[tuple[object, ...], Schedule | None] = field(default_factory=dict)
    summaries: dict[tuple[object, ...], Summary] = field(default_factory=dict)
    profiles: dict[int, Profile] = field(default_factory=dict)
    """Per schedule (by id: the schedules are kept), its activation profile."""
    references: dict[tuple[object, ...], Path] = field(default_factory=dict)
    """Per shape, the critical path of its first simulation (``path_bound``)."""
    simulations: int = 0
    """Timelines simulated (cache misses)."""
    dispatch: float = 0.0
    """Seconds a rank spends between two of its actions (``sim.cost.CostModel.dispatch``): 0 for a GPU
    cluster, the runtime's measured overhead for a profiled model on the machine that profiled it."""

    @staticmethod
    def schedule_key(config: Config, options: dict[str, object]) -> tuple[object, ...]:
        """The cache key of the configuration's schedule, built with the generator's ``options``
        (``auto_options`` for a searched schedule, none for the others)."""
        return config.shape + tuple(sorted(options.items()))

    def has_schedule(self, config: Config, options: dict[str, object]) -> bool:
        """Whether the configuration's schedule is built already (a zb-auto search done)."""
        return self.schedule_key(config, options) in self.schedules

    def schedule(self, config: Config, options: dict[str, object]) -> Schedule | None:
        """The configuration's schedule, None where its family refuses the shape."""
        key = self.schedule_key(config, options)
        if key not in self.schedules:
            chunks = config.chunks if config.takes_chunks else None
            try:
                self.schedules[key] = generate(
                    config.schedule,
                    num_stages=config.pp,
                    num_microbatches=config.microbatches,
                    num_chunks=chunks,
                    **options,
                )
            except ScheduleError:
                self.schedules[key] = None
        return self.schedules[key]

    def summary(self, config: Config, schedule: Schedule, times: Times) -> Summary:
        """The simulated timeline's summary, once per (schedule, times)."""
        key = (id(schedule),) + times
        found = self.summaries.get(key)
        if found is None:
            f, i, w, hop = times
            self.simulations += 1
            timeline = simulate(schedule, CostModel(f=f, b=i, w=w, comm=hop, dispatch=self.dispatch), check=False)
            found = self.summaries[key] = summarise(timeline, times)
            if not config.searched and config.shape not in self.references:
                self.references[config.shape] = critical_path(timeline)
        return found

    def path_bound(self, config: Config, times: Times) -> float:
        """A bound on the makespan of ``config``'s shape under ``times``: the critical path of a simulation of
        the same shape under other times (``planner.critical``), 0 if there is none yet."""
        path = self.references.get(config.shape)
        return 0.0 if path is None else path.length(*times)

    def peaks(
        self, config: Config, schedule: Schedule, model: Transformer, sequence_parallel: bool = False
    ) -> tuple[float, ...]:
        """Per rank, activation bytes per sample of a microbatch (``planner.memory.activation_peaks``), from the
        schedule's profile walked once (``planner.activations``)."""
        key = id(schedule)
        if key not in self.profiles:
            self.profiles[key] = activation_profile(schedule)
        sizes = part_activation_bytes(
            model, schedule.num_parts, config.tp, config.recompute, sequence_parallel, config.blocks, config.cp
        )
        return peaks(self.profiles[key], **sizes)

    @staticmethod
    def tp_rank_param_bytes(config: Config, model: Transformer, num_parts: int) -> Sequence[float]:
        """Per part, the BF16 parameter (and gradient) bytes one TP rank holds (of the experts, its EP rank's)."""
        return [p * PARAM_BYTES / config.tp for p in part_parameters(model, num_parts, config.blocks, config.ep)]


def auto_options(config: Config, cluster: Cluster, times: Times) -> dict[str, object]:
    """zb-auto's options: the parts' mean times in units of F, to one decimal (so that configurations of
    like proportions share one search; the simulation then takes their exact times), M_W / M_a, and the
    memory limit K (1 to 2, by halves) that the GPU's memory leaves room for beside the model state."""
    parts = config.pp * config.chunks
    f, i, w, hop = times
    model, gpu = transformer(cluster), cluster.gpu
    held, stash, _ = block_activation_bytes(
        model, tp=config.tp, recompute=config.recompute, sequence_parallel=cluster.sequence_parallel, cp=config.cp
    )
    per_rank = model.layers / config.pp * held * config.microbatch_size  # M_a of one D-th
    state = (
        max(part_parameters(model, parts, config.blocks, config.ep))
        * config.chunks
        * cluster.state.per_parameter
        / config.tp
    )
    room = gpu.memory_bytes - state - ALLOWANCE_BYTES
    limit = max(1.0, min(2.0, int(2 * room / (config.pp * per_rank)) / 2)) if per_rank else 2.0
    unit = sum(f) / parts
    return {
        "time_f": 1.0,
        "time_b": round(sum(i) / parts / unit, 1),
        "time_w": round(sum(w) / parts / unit, 1),
        "time_comm": round(hop / unit, 1),
        "activation_limit": limit,
        "mem_w": round(min(1.0, stash / held), 1),
    }
