"""The memory actions (``schedule.levers``) in the simulator: their time over a link, and the peaks they leave.

Timing. A memory action moves ``share x M_a`` (its part's activation memory,
compressed if asked) over a link of ``bandwidth`` units of M_a per unit of time.
By default it runs on its rank's own stream, as the CPU runtime does (a copy to a
memory-mapped file on the compute thread, a send to the partner): an
``OFFLOAD``/``EVICT`` lengthens the F before it, a ``RELOAD``/``LOAD`` the
backward after it, so both engines time them without knowing them
(``simulate_parts``' ``extra``). With ``copy_stream`` offload's copies run beside
the compute, as the CUDA runtime's do (``runtime.stage.levers.PinnedStore``: a
side stream): an ``OFFLOAD`` takes nothing from the compute stream, and a
``RELOAD``, started as the rank finishes the action before the backward (it is
prefetched while the rank waits for the gradient), delays the backward only by
what exceeds that wait in the timeline without copies (``stream_extra``).
``stash_events`` splits them out again for plots, traces and the memory walk.

Memory. A rank's own actions change its memory in the order of its row, as in
``sim.metrics.held_peaks`` (F adds M_a, a move away subtracts its share, a move
back adds it, B frees it ...); a BPipe partner holds what it received from the end
of the ``EVICT`` to the end of the ``LOAD``, by the timeline's clock.

Default bandwidth (``DEFAULT_BANDWIDTH``): a GPT layer (hidden h) keeps about
34 h bytes per token for its backward (Korthikanti et al. 2022, without
recomputation) and computes 24 h^2 flops per token forward; at h = 4096 on
300 Tflop/s and a 25 GB/s host link (PCIe 4.0 x16) moving its activations takes
about four forwards: 0.25 M_a per unit of f.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from pipeweave.schedule.ir import Action, Op, Schedule
from pipeweave.schedule.levers import DEFAULT_BANDWIDTH, Stash, StashPlan, check_stash, plan_stash
from pipeweave.sim.cost import CostModel, PartCosts
from pipeweave.sim.metrics import Metrics, compute_metrics
from pipeweave.sim.timeline import Event, Timeline, simulate, simulate_parts


def stash_costs(costs: PartCosts, plan: StashPlan) -> PartCosts:
    """``costs`` with the activation memory a stage keeps under ``plan``'s compression."""
    if plan.kept == 1.0:
        return costs
    return dataclasses.replace(costs, activation=tuple(a * plan.kept for a in costs.activation))


def stash_extra(stash: Stash, costs: PartCosts, bandwidth: float) -> dict[Action, float]:
    """Per compute action, the time of the memory actions folded into it (see the module docstring)."""
    part_of = stash.schedule.placement.stage_part
    extra: dict[Action, float] = {}
    for row in stash.actions:
        waiting: dict[tuple[int, int], float] = {}  # a move back, folded into the backward after it
        for a in row:
            s, op, j = a
            if op.is_memory:
                time = stash.moved(a) * costs.activation[part_of[s]] / bandwidth
                if op in (Op.OFFLOAD, Op.EVICT):
                    extra[Action(s, Op.F, j)] = time
                else:
                    waiting[(s, j)] = time
            elif op.computes_input_grad and (s, j) in waiting:
                extra[a] = waiting.pop((s, j))
    return extra


def simulate_stash(
    schedule: Schedule,
    costs: PartCosts,
    plan: StashPlan,
    *,
    bandwidth: float = DEFAULT_BANDWIDTH,
    copy_stream: bool = False,
    **options: object,
) -> tuple[Timeline, Stash, dict[Action, float]]:
    """Simulate ``schedule`` with ``plan``'s memory actions: the timeline (memory actions folded in),
    the lowered stash and the folded times. ``copy_stream``: offload's copies beside the compute (the
    module docstring). ``options`` go to ``simulate_parts``.

    Raises:
        InvalidSchedule: the schedule or its memory actions break a rule.

    Example:
        >>> from pipeweave.schedule import generate
        >>> from pipeweave.sim.cost import CostModel
        >>> s = generate("1f1b", num_stages=2, num_microbatches=2)
        >>> t, _, _ = simulate_stash(s, CostModel().for_parts(num_parts=2, num_ranks=2),
        ...                          StashPlan(offload=frozenset({0})), bandwidth=2.0)
        >>> [(str(e.action), e.end) for e in t.events[0]][:2]
        [('0F0', 1.5), ('0F1', 3.0)]
    """
    costs = stash_costs(costs, plan)
    shares = balanced_shares(schedule, costs, plan) if plan.balance else None
    stash = plan_stash(schedule, plan, costs.activation, costs.mem_w, shares)
    check_stash(stash)
    extra = stash_extra(stash, costs, bandwidth)
    if copy_stream and plan.offload:
        extra = stream_extra(stash, costs, bandwidth, extra, simulate_parts(schedule, costs, **options))  # type: ignore[arg-type]
    return simulate_parts(schedule, costs, extra=extra, **options), stash, extra  # type: ignore[arg-type]


def stream_extra(
    stash: Stash, costs: PartCosts, bandwidth: float, extra: dict[Action, float], plain: Timeline
) -> dict[Action, float]:
    """``extra`` with offload's copies on a side stream (module docstring): none for an ``OFFLOAD``, and for
    a ``RELOAD`` what its copy exceeds the rank's wait before the backward in ``plain`` (no copies)."""
    part_of = stash.schedule.placement.stage_part
    out = dict(extra)
    for row, events in zip(stash.actions, plain.events):
        wait = {e.action: e.start - (before.end if before else e.start) for before, e in zip((None, *events), events)}
        for k, a in enumerate(row):
            if a.op is Op.OFFLOAD:
                out.pop(Action(a.stage, Op.F, a.microbatch), None)
            elif a.op is Op.RELOAD:
                back = row[k + 1]
                copy = costs.activation[part_of[a.stage]] / bandwidth
                out[back] = max(0.0, copy - wait[back])
    return out


def balanced_shares(schedule: Schedule, costs: PartCosts, plan: StashPlan, rounds: int = 30) -> tuple[float, ...]:
    """BPipe's share per rank that evens each pair's peaks by the clock: ``evicted_shares`` keeps the owner
    at the pair's mean along its own row, but its partner holds what it was lent while its own peak
    comes, so the pair's larger peak is lowest where the two meet; bisected on ``stash_peaks`` (copies
    taking no time: the shares decide memory, not time).

    Example:
        >>> from pipeweave.schedule import generate
        >>> from pipeweave.sim.cost import CostModel
        >>> s = generate("1f1b", num_stages=4, num_microbatches=8)
        >>> balanced_shares(s, CostModel().for_parts(num_parts=4, num_ranks=4), StashPlan(balance=True))
        (0.428571, 0.2, 0.0, 0.0)
    """
    shares = list(plan_stash(schedule, plan, costs.activation, costs.mem_w).share)
    for rank, share in enumerate(shares):
        if share <= 0:
            continue
        other = schedule.num_ranks - 1 - rank
        lo, hi = 0.0, 1.0
        for _ in range(rounds):
            shares[rank] = (lo + hi) / 2
            stash = plan_stash(schedule, plan, costs.activation, costs.mem_w, shares)
            peaks = stash_peaks(stash, stash_events(stash, simulate_parts(schedule, costs), {}), costs)
            lo, hi = (shares[rank], hi) if peaks[rank] > peaks[other] else (lo, shares[rank])
        shares[rank] = round(hi, 6)
    return tuple(shares)


def stash_events(
    stash: Stash, timeline: Timeline, extra: dict[Action, float], stream: float | None = None
) -> tuple[tuple[Event, ...], ...]:
    """Per rank, its events with the memory actions split out of the F and backwards they were folded into;
    ``stream``: the bandwidth of offload's copies on a side stream (``stream_extra``), each then timed whole
    beside the compute: an ``OFFLOAD`` from its F's end, a ``RELOAD`` up to its backward's compute."""
    rows = []
    for events, lowered in zip(timeline.events, stash.actions):
        timed = {e.action: e for e in events}
        out: list[Event] = []
        for a in lowered:
            s, op, j = a
            copy = (
                None
                if stream is None or op not in (Op.OFFLOAD, Op.RELOAD) or timeline.costs is None
                else timeline.costs.activation[stash.schedule.placement.stage_part[s]] / stream
            )
            if copy is not None and op is Op.OFFLOAD:
                end = timed[Action(s, Op.F, j)].end
                out.append(Event(a, end, end + copy))
            elif copy is not None:
                back = timed.get(Action(s, Op.B, j)) or timed[Action(s, Op.I, j)]
                ready = back.start + extra.get(back.action, 0.0)
                out.append(Event(a, ready - copy, ready))
            elif op in (Op.OFFLOAD, Op.EVICT):
                f = timed[Action(s, Op.F, j)]
                out.append(Event(a, f.end - extra.get(f.action, 0.0), f.end))
            elif op in (Op.RELOAD, Op.LOAD):
                back = timed.get(Action(s, Op.B, j)) or timed[Action(s, Op.I, j)]
                out.append(Event(a, back.start, back.start + extra.get(back.action, 0.0)))
            else:
                e = timed[a]
                cut = extra.get(a, 0.0)
                out.append(
                    Event(a, e.start, e.end - cut)
                    if op is Op.F
                    else Event(a, e.start + cut, e.end)
                    if op.computes_input_grad
                    else e
                )
        rows.append(tuple(out))
    return tuple(rows)


def stash_peaks(stash: Stash, events: Sequence[Sequence[Event]], costs: PartCosts) -> tuple[float, ...]:
    """Per rank, its peak activation memory with the memory actions (``stash_events``' events, in units of
    ``costs.activation``, already compressed: ``stash_costs``), a recomputing backward's replay on top while
    it runs (``costs.replayed``)."""
    placement = stash.schedule.placement
    num_ranks = stash.schedule.num_ranks
    changes: list[list[tuple[float, int, float, float]]] = [[] for _ in range(num_ranks)]
    for rank, row in enumerate(events):
        for k, (a, start, end) in enumerate(row):
            s, op, _ = a
            held = costs.activation[placement.stage_part[s]]
            moved = stash.moved(a) * held if op.is_memory else 0.0
            own = {
                Op.F: (start, held),
                Op.B: (end, -held),
                Op.I: (end, held * (costs.mem_w - 1)),
                Op.W: (end, -held * costs.mem_w),
                Op.OFFLOAD: (end, -moved),
                Op.EVICT: (end, -moved),
                Op.RELOAD: (start, moved),
                Op.LOAD: (start, moved),
            }.get(op)
            if own is not None:
                changes[rank].append((own[0], 1, k, own[1]))
            replayed = costs.replayed[placement.stage_part[s]] if costs.replayed and op in (Op.B, Op.I) else 0.0
            if replayed:  # held while the backward runs (its start before its own end at equal times)
                changes[rank] += [(start, 1, k - 0.5, replayed), (end, 1, k, -replayed)]
            if op in (Op.EVICT, Op.LOAD):  # the partner holds it from the send's start to the return's end
                other = num_ranks - 1 - rank
                changes[other].append((start, 0, k, moved) if op is Op.EVICT else (end, 2, k, -moved))
    peaks = []
    for rank_changes in changes:
        now = peak = 0.0
        for _, _, _, delta in sorted(rank_changes):
            now += delta
            peak = max(peak, now)
        peaks.append(round(peak, 9))
    return tuple(peaks)


def plan_dict(plan: StashPlan, shares: tuple[float, ...], bandwidth: float) -> dict[str, Any]:
    """The levers as ``--json`` reports them."""
    return {
        "offload": sorted(plan.offload),
        "balance_activations": plan.balance,
        "compress_activations": plan.compress,
        "host_bandwidth": bandwidth,
        "moved_share": list(shares),
    }


def simulate_levers(
    schedule: Schedule, costs: PartCosts, plan: StashPlan, bandwidth: float | None = None, copy_stream: bool = False
) -> tuple[Metrics, Timeline, dict[str, Any]]:
    """Metrics with ``plan`` applied (``peak_activations`` per rank with the memory actions), the timeline
    to show (memory actions as their own events) and the levers' JSON; ``copy_stream``: offload's copies
    beside the compute (CUDA's side stream; the module docstring).

    Example:
        >>> from pipeweave.schedule import generate
        >>> from pipeweave.sim.cost import CostModel
        >>> s = generate("1f1b", num_stages=4, num_microbatches=8)
        >>> m, _, _ = simulate_levers(s, CostModel().for_parts(num_parts=4, num_ranks=4), StashPlan(balance=True))
        >>> m.peak_activations
        (2.714287, 2.6, 2.6, 2.714284)
    """
    bandwidth = bandwidth or DEFAULT_BANDWIDTH
    comm = costs.comm
    timeline, stash, extra = simulate_stash(
        schedule,
        costs,
        plan,
        bandwidth=bandwidth,
        copy_stream=copy_stream,
        hop=(lambda src, dst: comm) if comm else None,
    )
    shown = Timeline(schedule, stash_events(stash, timeline, extra, bandwidth if copy_stream else None), timeline.costs)
    assert timeline.costs is not None
    metrics = compute_metrics(timeline)
    metrics = dataclasses.replace(metrics, peak_activations=stash_peaks(stash, shown.events, timeline.costs))
    return metrics, shown, {**plan_dict(plan, stash.share, bandwidth), "copy_stream": copy_stream}


def levered_activations(schedule: Schedule, activations: tuple[float, ...], plan: StashPlan) -> tuple[float, ...]:
    """Per part, the peak microbatches its rank holds (``partition.memory.MemoryProfile.activations``) with
    ``plan`` applied: each part scaled by its rank's simulated peak with the levers over the peak without
    (uniform M_a), so that the ``memory`` partitioner splits for the memory the levers leave.

    Example:
        >>> from pipeweave.schedule import generate
        >>> levered_activations(generate("1f1b", num_stages=4, num_microbatches=8), (4.0, 3.0, 2.0, 1.0),
        ...                     StashPlan(offload=frozenset({0})))
        (1.0, 3.0, 2.0, 1.0)
    """
    if not plan.active:
        return activations
    costs = CostModel().for_parts(num_parts=schedule.num_parts, num_ranks=schedule.placement.ranks_per_pipeline)
    before = compute_metrics(simulate(schedule, CostModel(), check=False)).peak_activations
    after = simulate_levers(schedule, costs, plan)[0].peak_activations
    rank_of = schedule.placement.stage_rank
    stage_of = {part: stage for stage, part in enumerate(schedule.placement.stage_part)}
    return tuple(
        round(a * after[rank_of[stage_of[k]]] / before[rank_of[stage_of[k]]], 9) if before[rank_of[stage_of[k]]] else a
        for k, a in enumerate(activations)
    )
