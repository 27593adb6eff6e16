"""Measured timelines: per-step ``Timeline``s, the simulator's metrics on them, Chrome traces.

Every rank records each action's start and end on rank 0's clock
(``transport.clock.align_clocks``). The measured step becomes a
``pipeweave.sim.Timeline`` of the compute actions and goes through the same
``bubble_metrics`` as a simulation; per-part F/I/W times profiled from the same
run feed ``pipeweave.sim.simulate`` for the predicted figures beside them.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pipeweave.data import longest_sequence
from pipeweave.data.corpus import microbatch_lengths
from pipeweave.runtime.run.record import RunRecord
from pipeweave.runtime.run.sizes import microbatch_sizes, step_tokens
from pipeweave.runtime.run.streams import segments
from pipeweave.schedule.ir import Action, Op, Schedule
from pipeweave.sim import CostModel, Event, Timeline, simulate
from pipeweave.sim.bubble import bubble_metrics
from pipeweave.sim.timeline import simulate_parts

_COMPUTE = {op.value for op in Op if op.is_compute}  # records hold op strings
_RECV = {op.value for op in Op if op.is_recv}
_MEMORY = {op.value for op in Op if op.is_memory}  # OFFLOAD, RELOAD, EVICT, LOAD (schedule.levers)
_PER_MICROBATCH = {op.value for op in (Op.F, Op.B, Op.I, Op.W)}  # what a microbatch's length scales


def step_timeline(schedule: Schedule, record: RunRecord, step: int) -> Timeline:
    """Step ``step`` of a run as a Timeline of its compute actions, times in seconds."""
    events = []
    for rank in record.ranks:
        row = [Event(Action(s, Op(op), j), t0, t1) for s, op, j, t0, t1 in rank.records[step] if op in _COMPUTE]
        events.append(tuple(row))
    return Timeline(schedule, tuple(events))


def rebased(timeline: Timeline, scale: float = 1e3) -> Timeline:
    """The same timeline starting at 0, times multiplied by ``scale`` (default: seconds to ms)."""
    origin = min((row[0].start for row in timeline.events if row), default=0.0)
    events = tuple(
        tuple(Event(e.action, (e.start - origin) * scale, (e.end - origin) * scale) for e in row)
        for row in timeline.events
    )
    return Timeline(timeline.schedule, events, timeline.costs)


def measured_steps(config_steps: int) -> range:
    """The steps that count: all but the first (warm-up) when there are several."""
    return range(1 if config_steps > 1 else 0, config_steps)


def recorded_steps(record: RunRecord) -> range:
    """The measured steps whose every action the record kept (``RankRecord.records``: the first
    ``LoggingConfig.trace_steps`` of a longer synchronous run): those of ``measured_steps`` among them."""
    return measured_steps(window(record))


def window(record: RunRecord) -> int:
    """How many steps, from the first, the record kept every action of (all of a stream's)."""
    return min(len(r.records) for r in record.ranks)


def step_times(record: RunRecord) -> list[float]:
    """Per step (every step, beyond the recorded window), seconds from the previous step's last end (first step:
    its first start) to its last end."""
    steps = record.config.training.steps
    ends = [max(_ends(r)[k] for r in record.ranks) for k in range(steps)]
    first = min(row[0][3] for r in record.ranks for row in r.records if row)  # AvgPipe: a rank skips steps
    return [ends[0] - first] + [b - a for a, b in zip(ends, ends[1:])]


def _ends(rank: Any) -> list[float]:
    """A rank's ``step_ends``; a record built without them (all its steps kept): its rows' last ends."""
    return rank.step_ends or [row[-1][4] if row else float("-inf") for row in rank.records]


def microbatch_factors(schedule: Schedule, record: RunRecord) -> list[list[float]] | None:
    """Per step, per microbatch, its tokens over the step's mean (sequences of variable length,
    ``TrainConfig.min_seq_len``); None where every microbatch of a step has one shape but for its samples."""
    config = record.config
    if config.data.min_seq_len is None or config.is_stream:
        return None
    t, sizes, longest = schedule.num_microbatches, microbatch_sizes(config), longest_sequence(config.model)
    out = []
    for k in range(config.training.steps):
        lengths = microbatch_lengths(config.data.data_seed, record.first_step + k, t, config.data.min_seq_len, longest)
        tokens = [n * length for n, length in zip(sizes, lengths)]
        mean = statistics.fmean(tokens)
        out.append([x / mean for x in tokens])
    return out


def profile_costs(schedule: Schedule, record: RunRecord, comm: float | None = None) -> CostModel:
    """Per-part mean F, I (or B), W and U durations of the measured steps, as a CostModel.

    The mean, not the median: the simulator charges every action its part's
    value, so the total work it simulates is what the run measured, including
    actions that are slower by design (XPipe's bellwether predicts for its
    mini-batch) or by circumstance (the first actions after a long wait). A part run
    with a full backward gets ``b`` = its B time and ``w`` = 0, so a simulated
    B (= b + w) takes what it measured. Where microbatches vary in length
    (``microbatch_factors``) each F, B, I and W counts its time over its
    microbatch's factor: the times of a microbatch of the mean's tokens. ``comm`` is the hop
    latency (default ``hop_latency``), ``dispatch`` the runtime's own time
    between actions (``dispatch_time``).
    """
    durations: dict[tuple[int, str], list[float]] = {}
    part_of = schedule.placement.stage_part
    factors = microbatch_factors(schedule, record)
    for rank in record.ranks:
        for k in recorded_steps(record):
            for s, op, j, t0, t1 in rank.records[k]:
                scale = factors[k][j] if factors is not None and op in _PER_MICROBATCH else 1.0
                durations.setdefault((part_of[s], op), []).append((t1 - t0) / scale)

    def mean(part: int, op: str) -> float | None:
        values = durations.get((part, op))
        return statistics.fmean(values) if values else None

    f, b, w, u = [], [], [], []
    for part in range(schedule.num_parts):
        f.append(mean(part, "F") or 0.0)
        i_time = mean(part, "I")
        b.append(i_time if i_time is not None else (mean(part, "B") or 0.0))
        w.append(mean(part, "W") or 0.0 if i_time is not None else 0.0)
        u.append(mean(part, "U") or 0.0)
    return CostModel(
        f=f,
        b=b,
        w=w,
        u=u,
        comm=comm if comm is not None else hop_latency(schedule, record),
        dispatch=dispatch_time(record),
    )


def dispatch_time(record: RunRecord) -> float:
    """Mean host time between two consecutive compute actions of a rank, receive waits excluded.

    Everything a rank does between the end of one compute action and the
    start of its next -- posting sends and receives, copying messages,
    bookkeeping -- except the time inside its receives (which is where it
    waits for a peer; the simulator derives waits from the dataflow). The
    mean, not the median: the total over a step is what lengthens it.
    """
    # A synchronous step's actions are one stretch of a rank's time (the gap between
    # steps is the loop's, not the executor's); a stream's mini-batches interleave,
    # so each stream's records are put back in time order first (between two streams
    # of a run a rank waits for the others to drain: not dispatch).
    if record.config.is_stream:
        stretches = [
            sorted((a for m in range(first, first + steps) for a in rank.records[m]), key=lambda a: a[3])
            for rank in record.ranks
            for first, steps in segments(record.config)
        ]
    else:
        stretches = [rank.records[k] for rank in record.ranks for k in recorded_steps(record)]
    gaps: list[float] = []
    for stretch in stretches:
        last_end: float | None = None
        waited = 0.0
        for _, op, _, t0, t1 in stretch:
            if op in _COMPUTE:
                if last_end is not None:
                    gaps.append(max(0.0, t0 - last_end - waited))
                last_end, waited = t1, 0.0
            elif op in _RECV or op in _MEMORY:  # the copies are timed on their own (``copy_times``)
                waited += t1 - t0
    return statistics.fmean(gaps) if gaps else 0.0


def copy_times(schedule: Schedule, record: RunRecord) -> dict[str, dict[str, float]]:
    """Per stage, the mean seconds of each memory action the run measured (its copies' write and read, on the
    rank's own time: ``runtime.stage.levers``); empty without memory actions."""
    durations: dict[tuple[int, str], list[float]] = {}
    for rank in record.ranks:
        for k in recorded_steps(record):
            for s, op, _, t0, t1 in rank.records[k]:
                if op in _MEMORY:
                    durations.setdefault((s, op), []).append(t1 - t0)
    out: dict[str, dict[str, float]] = {}
    for (s, op), values in sorted(durations.items()):
        out.setdefault(str(s), {})[op] = statistics.fmean(values)
    return out


def copy_extra(schedule: Schedule, copies: dict[str, dict[str, float]]) -> dict[Action, float]:
    """``copies`` folded into the compute actions as the simulator times them (``sim.levers``): a stage's move
    away into its F, its move back into its backward (B or I)."""
    extra: dict[Action, float] = {}
    for row in schedule.actions:
        for a in row:
            ops = ("OFFLOAD", "EVICT") if a.op is Op.F else ("RELOAD", "LOAD") if a.op.computes_input_grad else ()
            time = sum(copies.get(str(a.stage), {}).get(op, 0.0) for op in ops)
            if time:
                extra[a] = time
    return extra


def _simulated(schedule: Schedule, cost: CostModel, extra: dict[Action, float]) -> Timeline:
    """``simulate`` with the measured copies folded in (``copy_extra``)."""
    if not extra:
        return simulate(schedule, cost, check=False)
    costs = cost.for_parts(num_parts=schedule.num_parts, num_ranks=schedule.placement.ranks_per_pipeline)
    comm = costs.comm
    return simulate_parts(schedule, costs, check=False, hop=(lambda src, dst: comm) if comm else None, extra=extra)


def hop_latency(schedule: Schedule, record: RunRecord) -> float:
    """The smallest observed send-start to receive-end delay between ranks (0 without messages)."""
    sends: dict[tuple[int, str, int], float] = {}
    recvs: dict[tuple[int, str, int], float] = {}
    placement = schedule.placement
    for rank in record.ranks:
        for k in recorded_steps(record):
            for s, op, j, t0, t1 in rank.records[k]:
                if op == "SEND_F":
                    sends[(k, f"F{s}", j)] = t0
                elif op == "SEND_B":
                    sends[(k, f"B{s}", j)] = t0
                elif op == "RECV_F":
                    recvs[(k, f"F{placement.prev_stage(s)}", j)] = t1
                elif op == "RECV_B":
                    recvs[(k, f"B{placement.next_stage(s)}", j)] = t1
    delays = [recvs[key] - sends[key] for key in sends if key in recvs]
    return max(0.0, min(delays)) if delays else 0.0


def summarize(schedule: Schedule, record: RunRecord) -> dict[str, Any]:
    """Measured and simulated figures of a run (the JSON record's numbers).

    Memory actions (offload, BPipe) are timed on their own (``copy_times``, ``profiled_copies_s``: the
    copies' write and read as measured) and charged where the runtime runs them, on the rank's own time
    beside its F and backward (``copy_extra``), not spread over every action as dispatch.
    Microbatches of variable length: every measured step is simulated with its own microbatches' factors
    (``microbatch_factors``), and each simulated figure is the median over those steps, as the measured one.
    """
    cost = profile_costs(schedule, record)
    factors = microbatch_factors(schedule, record)
    costs = [cost] if factors is None else [replace(cost, microbatch=factors[k]) for k in recorded_steps(record)]
    copies = copy_times(schedule, record)
    extra = copy_extra(schedule, copies)
    sims = [bubble_metrics(_simulated(schedule, c, extra)) for c in costs]
    alones = [bubble_metrics(_simulated(schedule, replace(c, dispatch=0.0), extra)) for c in costs]
    sim = [statistics.median(m[i] for m in sims) for i in (0, 3, 4)]
    return {
        **measured_summary(schedule, record, cost),
        "makespan_simulated_s": sim[0],
        "bubble_ratio_simulated": sim[1],
        "bubble_ratio_flush_simulated": sim[2],
        "bubble_ratio_simulated_no_dispatch": statistics.median(m[3] for m in alones),
        **({"profiled_copies_s": copies} if copies else {}),
    }


def measured_summary(schedule: Schedule, record: RunRecord, cost: CostModel) -> dict[str, Any]:
    """The measured figures of a run, per step, beside the costs profiled from it (``cost``)."""
    config = record.config
    per_step = [bubble_metrics(step_timeline(schedule, record, k)) for k in recorded_steps(record)]
    steps = measured_steps(config.training.steps)
    times = step_times(record)
    step_time = statistics.median(times[k] for k in steps)
    samples = config.data.batch_size / step_time
    tokens = samples * _mean_length(schedule, record) if config.model.is_transformer else None
    return {
        "step_time_s": step_time,
        "step_times_s": times,
        "samples_per_s": samples,
        "tokens_per_s": tokens,
        "makespan_s": statistics.median(m[0] for m in per_step),
        "bubble_ratio": statistics.median(m[3] for m in per_step),
        "bubble_ratio_flush": statistics.median(m[4] for m in per_step),
        "bubble_overhead": statistics.median(m[5] for m in per_step),
        "profiled_costs_s": {
            "f": list(_values(cost.f)),
            "b": list(_values(cost.b)),
            "w": list(_values(cost.w)),
            "u": list(_values(cost.u)),
            "comm": cost.comm,
            "dispatch": cost.dispatch,
        },
        "peak_activation_bytes": [r.peak_activation_bytes for r in record.ranks],
        "peak_tensor_bytes": [r.peak_tensor_bytes for r in record.ranks],
        "peak_tensor_bytes_source": "cuda max_memory_allocated" if on_cuda(record) else "cpu tracked tensors",
        "weight_bytes": [r.weight_bytes for r in record.ranks],
        **device_figures(record, times, steps),
    }


def on_cuda(record: RunRecord) -> bool:
    """Whether the run's ranks ran on CUDA (they recorded the allocator's peaks, ``transport.timing``)."""
    return any(r.cuda_allocated for r in record.ranks)


def device_figures(record: RunRecord, times: Sequence[float], steps: range) -> dict[str, Any]:
    """Where the times come from; on CUDA, per rank and step, the allocator's peak allocated and reserved bytes;
    with ``--compile``, the compile time: the first step's time beyond the median of the others (the step time
    leaves the first step out)."""
    figures: dict[str, Any] = {"timing_source": "cuda events" if on_cuda(record) else "host clock"}
    if on_cuda(record):
        figures["cuda_peak_allocated_bytes"] = [r.cuda_allocated for r in record.ranks]
        figures["cuda_peak_reserved_bytes"] = [r.cuda_reserved for r in record.ranks]
    if record.config.training.compile:
        later = [times[k] for k in steps if k > 0]
        figures["compile_s"] = max(0.0, times[0] - statistics.median(later)) if later else times[0]
    return figures


def _mean_length(schedule: Schedule, record: RunRecord) -> float:
    """The gpt's tokens per sample over the run: ``seq_len``, or the mean of variable lengths (per sample)."""
    config = record.config
    tokens = [
        step_tokens(config, schedule.num_microbatches, record.first_step + k) or 0 for k in range(config.training.steps)
    ]
    return sum(tokens) / (config.data.batch_size * config.training.steps)


def _values(value: float | Sequence[float]) -> Sequence[float]:
    return [value] if isinstance(value, (int, float)) else value


def chrome_trace(schedule: Schedule, record: RunRecord) -> dict[str, Any]:
    """Every recorded action of every recorded step as Chrome trace events (one process row per rank; AvgPipe's
    averaging all-reduces on a row of their own); its ``otherData`` says which steps (``steps``: the first and
    last, 1-based, of ``of``)."""
    events: list[dict[str, Any]] = []
    origin = min(row[0][3] for r in record.ranks for row in r.records if row)
    for rank in record.ranks:
        events.append({"name": "process_name", "ph": "M", "pid": rank.rank, "args": {"name": f"rank {rank.rank}"}})
        for k, step in enumerate(record.ranks[rank.rank].records):
            for s, op, j, t0, t1 in step:
                events.append(
                    {
                        "name": f"{s}{op}{j}",
                        "cat": "compute" if op in _COMPUTE else "comm",
                        "ph": "X",
                        "pid": rank.rank,
                        "tid": 0 if op in _COMPUTE else 1,
                        "ts": (t0 - origin) * 1e6,
                        "dur": (t1 - t0) * 1e6,
                        "args": {"step": k},
                    }
                )
    events += _averaging_events(record, origin) + _pair_events(schedule, record, origin)
    kept = {"steps": [1, window(record)], "of": record.config.training.steps}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"schedule": schedule.name, **kept}}


def _pair_events(schedule: Schedule, record: RunRecord, origin: float) -> list[dict[str, Any]]:
    """Each F&B pair of each recorded step (tid 3): from its F half's start to its B half's end; ``exposed_us`` is
    the time between the halves (the B half's message still on its way: what the pair did not hide)."""
    second = {(f.stage, f.op.value, f.microbatch): (b.stage, b.op.value, b.microbatch) for f, b in schedule.pairs}
    out = []
    for rank in record.ranks:
        for k, step in enumerate(rank.records):
            at = {(s, op, j): (t0, t1) for s, op, j, t0, t1 in step}
            for (f, b), ((f0, f1), (b0, b1)) in (
                (p, (at[p[0]], at[p[1]])) for p in second.items() if p[0] in at and p[1] in at
            ):
                name = f"F&B {''.join(map(str, f))};{''.join(map(str, b))}"
                out.append(
                    _span(name, "F&B", rank.rank, 3, f0 - origin, b1 - origin, step=k, exposed_us=(b0 - f1) * 1e6)
                )
    return out


def _span(name: str, cat: str, pid: int, tid: int, start: float, end: float, **args: Any) -> dict[str, Any]:
    """A complete trace event from ``start`` to ``end`` (seconds from the trace's origin)."""
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": start * 1e6,
        "dur": (end - start) * 1e6,
        "args": args,
    }


def _averaging_events(record: RunRecord, origin: float) -> list[dict[str, Any]]:
    """AvgPipe on ranks of their own: each averaging's all-reduce, from its start to its mean in hand (tid 2)."""
    return [
        _span(f"{s}AVG{n}", "comm", rank.rank, 2, t0 - origin, t1 - origin, **{"averaging round": n})
        for rank in record.ranks
        for s, n, t0, t1 in rank.averaging
    ]
