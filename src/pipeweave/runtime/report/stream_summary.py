"""What a run of asynchronous streams measured: its timeline, its time per mini-batch, its summary.

A stream has no steps to time one by one (``runtime.stream``): its measured
actions make one ``Timeline`` (``stream_timeline``), the time per mini-batch
is the steady state's period (``minibatch_period``), and ``summarize_stream``
sets the measured bubbles and weight bytes beside the simulator's for the
run's schedule, with its staleness (and a tie's lag: ``staleness_figures``).
Where the run drained its stream to evaluate or save, the pauses between
streams were taken out of its times by the run (``run.record.close_pauses``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pipeweave.models.spec import ModelSpec
from pipeweave.runtime.report.trace import measured_summary, profile_costs
from pipeweave.runtime.run.prepare import layer_ranges
from pipeweave.runtime.run.record import RunRecord
from pipeweave.runtime.run.sizes import part_weight_bytes
from pipeweave.runtime.stage.tied import spans_parts
from pipeweave.runtime.stream import microbatches_per_minibatch
from pipeweave.schedule.ir import Action, Op, Schedule
from pipeweave.schedule.stream import peak_in_flight
from pipeweave.sim import CostModel, Event, Timeline, simulate
from pipeweave.sim.bubble import bubble_metrics
from pipeweave.sim.steady import steady_bubble_ratio
from pipeweave.sim.versions import staleness, tied_lag, weight_copies

_COMPUTE = {op.value for op in Op if op.is_compute}  # records hold op strings


def stream_timeline(schedule: Schedule, record: RunRecord) -> Any:
    """The whole measured stream as one ``Timeline`` of compute actions (seconds on rank 0's clock)."""
    rows = []
    for rank in record.ranks:
        events = [
            Event(Action(s, Op(op), j), t0, t1)
            for group in rank.records
            for s, op, j, t0, t1 in group
            if op in _COMPUTE
        ]
        rows.append(tuple(sorted(events, key=lambda e: e.start)))
    return Timeline(schedule, tuple(rows))


def minibatch_period(timeline: Any, num_microbatches: int) -> float:
    """Time per mini-batch in the steady state: last ends of mini-batches 0 and S-2, over S-2 (S < 3: total / S)."""
    end: dict[int, float] = {}
    for row in timeline.events:
        for e in row:
            if e.action.op is not Op.U:
                m = e.action.microbatch // num_microbatches
                end[m] = max(end.get(m, e.end), e.end)
    s = len(end)
    if s < 3:
        start = min((row[0].start for row in timeline.events if row), default=0.0)
        return (max(end.values()) - start) / max(1, s)
    return (end[s - 2] - end[0]) / (s - 2)


def summarize_stream(schedule: Schedule, record: RunRecord) -> dict[str, Any]:
    """``trace.summarize`` for a stream: bubbles of the whole measured stream, steady state first.

    ``bubble_ratio`` is the steady-state bubble (``sim.steady``), measured and
    simulated with the run's profiled costs; ``bubble_ratio_stream`` includes
    the fill and drain. ``step_time_s`` is the time per mini-batch,
    ``weight_bytes`` the peak of every weight version and buffer per rank,
    beside ``weight_bytes_simulated`` = ``sim.versions.weight_copies`` x each part's bytes; ``staleness``
    (and ``tied_lag``) as ``staleness_figures``, ``in_flight`` as ``in_flight_figures``.
    """
    cost = profile_costs(schedule, record)
    out = measured_summary(schedule, record, cost)  # per-mini-batch times, throughput, profiled costs, memory
    t = microbatches_per_minibatch(schedule)
    measured = stream_timeline(schedule, record)
    predicted = simulate(schedule, cost, check=False)
    alone = simulate(schedule, replace(cost, dispatch=0.0), check=False)
    m, p = bubble_metrics(measured), bubble_metrics(predicted)
    part_bytes = part_weight_bytes(record.config.model, layer_ranges(record.config, schedule))
    out.update(
        {
            "bubble_ratio": steady_bubble_ratio(measured),
            "bubble_ratio_stream": m[3],
            "bubble_ratio_flush": m[4],
            "bubble_overhead": m[5],
            "makespan_s": m[0],
            "bubble_ratio_simulated": steady_bubble_ratio(predicted),
            "bubble_ratio_stream_simulated": p[3],
            "bubble_ratio_simulated_no_dispatch": steady_bubble_ratio(alone),
            "bubble_ratio_flush_simulated": p[4],
            "makespan_simulated_s": minibatch_period(predicted, t),
            "step_time_s": minibatch_period(measured, t),
            "weight_bytes": [r.weight_bytes for r in record.ranks],
            "weight_bytes_simulated": list(
                weight_copies(
                    schedule,
                    CostModel(weight=part_bytes).for_parts(num_parts=schedule.num_parts, num_ranks=schedule.num_ranks),
                )
            ),
        }
    )
    out.update(staleness_figures(schedule, record.config.model, layer_ranges(record.config, schedule)))
    out.update(in_flight_figures(schedule, record))
    out["samples_per_s"] = record.config.data.batch_size / out["step_time_s"]
    if out.get("tokens_per_s"):
        out["tokens_per_s"] = out["samples_per_s"] * record.config.model.seq_len
    return out


def in_flight_figures(schedule: Schedule, record: RunRecord) -> dict[str, int]:
    """``in_flight``: the most microbatches stage 0 held between F and backward in the recorded actions of its
    rank (PipeDream's NOAM), beside ``in_flight_simulated``, the schedule's."""
    stage = schedule.placement.pipelines[0][0]
    rank = schedule.placement.stage_rank[stage]
    recorded = sorted(  # kept per mini-batch (``split_by_minibatch``): back in the order the rank ran them
        (rec for r in record.ranks if r.rank == rank for step in r.records for rec in step), key=lambda rec: rec[3]
    )
    return {
        "in_flight": peak_in_flight(recorded, stage),
        "in_flight_simulated": peak_in_flight(schedule.actions[rank], stage),
    }


def staleness_figures(schedule: Schedule, spec: ModelSpec, parts: Sequence[range]) -> dict[str, list[int]]:
    """A stream's ``staleness`` per stage (``sim.versions.staleness``; a function of the order the run kept),
    and where the model has a tie between parts, ``tied_lag``: per stage, the updates by which its tied
    members lag its other weights (``runtime.stage.tied_stream``), the staleness then counting them.
    Nothing for a synchronous schedule (no staleness)."""
    if schedule.is_synchronous:
        return {}
    tied = spans_parts(spec, parts)
    out = {"staleness": list(staleness(schedule, tied=tied))}
    if tied:
        out["tied_lag"] = list(tied_lag(schedule))
    return out
