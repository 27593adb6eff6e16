"""``pipeweave simulate``: time a schedule under a cost model and show its timeline and metrics.

Without arguments it simulates 1F1B on 4 stages and 8 microbatches: a text
timeline, then the simulated metrics beside the registry's closed forms.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from pipeweave.commands.layout_options import (
    add_byte_arguments,
    add_layout_arguments,
    layout_from_args,
    layout_report,
    model_bytes,
)
from pipeweave.commands.lever_options import add_stash_arguments, stash_plan
from pipeweave.commands.recompute_options import add_recompute_cost_arguments, recompute_costs
from pipeweave.commands.simulate_report import as_json, print_report
from pipeweave.commands.units import check_cost_flags, parse_values, refuse_memory_limit
from pipeweave.errors import UserError
from pipeweave.host import available_memory as _available_memory
from pipeweave.schedule import InvalidSchedule, Schedule, generate, read_csv, write_csv
from pipeweave.schedule.registry import SCHEDULES, ScheduleInfo, tied_streams
from pipeweave.sim import CostModel, Metrics, compute_metrics, simulate
from pipeweave.sim.levers import simulate_levers
from pipeweave.sim.parallel import simulate_layout
from pipeweave.sim.textline import format_timeline
from pipeweave.sim.timeline import BYTES_PER_ACTION
from pipeweave.sim.validation import check
from pipeweave.sim.versions import staleness, tied_lag

Times = float | list[float]


# An argparse declaration, kept as one list of options (exempt from the 60-line rule for functions).
def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help="simulate a schedule: timeline, bubble, memory",
        description="Simulate a schedule under a cost model; print its timeline and metrics beside "
        "the closed forms. Times: a number, or a comma list with one value per part (uneven stages).",
    )
    p.add_argument("-s", "--schedule", default="1f1b", help="registry name (pipeweave schedules; default 1f1b)")
    p.add_argument("--stages", "-D", type=int, default=4, help="D, pipeline ranks (default 4)")
    p.add_argument(
        "--microbatches",
        "-T",
        type=int,
        default=8,
        help=f"T, microbatches per step (default 8); D x T x chunks x steps at most {MAX_ACTIONS // 3} "
        "(about 10 s of simulation)",
    )
    p.add_argument("--chunks", "-v", type=int, help="v, chunks per rank, for interleaved schedules")
    p.add_argument("--time-f", default="1", metavar="F", help="forward time (default 1)")
    p.add_argument(
        "--time-b", default="1", metavar="B", help="input-gradient time I (default 1); a full backward B takes b + w"
    )
    p.add_argument("--time-w", default="1", metavar="W", help="weight-gradient time W (default 1)")
    p.add_argument(
        "--time-u",
        default="0",
        metavar="U",
        help="optimizer step time U (default 0, as in the papers' bubble formulas)",
    )
    p.add_argument("--time-comm", type=float, default=0.0, metavar="C", help="latency of one hop (default 0)")
    p.add_argument(
        "--comm-rendezvous",
        action="store_true",
        help="a hop's C starts only once its receive is posted (before the action that takes it, or before an "
        "F&B pair's F half), as gloo and NCCL move messages and as --comm-delay-ms runs measure",
    )
    p.add_argument(
        "--time-dispatch",
        type=float,
        default=0.0,
        metavar="G",
        help="a runtime's time between two actions of a rank (default 0; pipeweave train profiles its own)",
    )
    p.add_argument(
        "--activation-limit",
        type=float,
        default=None,
        metavar="K",
        help="zb-auto, zb-v-auto: activation limit per rank, K x the 1F1B peak D x M_a (default 1)",
    )
    p.add_argument("--memory-limit", metavar="BYTES", help=argparse.SUPPRESS)  # K's former name: refused in one line
    p.add_argument(
        "--mem-w", type=float, default=0.5, metavar="R", help="share of M_a still held between I and W (default 0.5)"
    )
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument("--plot", metavar="FILE", help="write a timeline picture (.png, .svg or .pdf)")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome trace (open in ui.perfetto.dev)")
    p.add_argument(
        "--csv",
        metavar="FILE",
        help="export the schedule as the CSV torch.distributed.pipelining's _PipelineScheduleRuntime._load_csv "
        "reads (torchtitan's pipeline_parallel_schedule_csv); a schedule torch cannot run is refused",
    )
    p.add_argument(
        "--csv-format",
        choices=("compute_only", "compute_comms", "pipeweave"),
        default="compute_only",
        help="--csv's form: torch's compute_only (F, B, I, W; default), torch's compute_comms (with "
        "SEND_F/RECV_F/SEND_B/RECV_B, REDUCE_GRAD, and UNSHARD/RESHARD under --zero 3; load it with "
        "format='compute_comms'), or pipeweave's own (updates as U, a header line for what torch cannot carry)",
    )
    p.add_argument(
        "--from-csv",
        "--schedule-file",
        dest="from_csv",
        metavar="FILE",
        help="simulate a hand-written schedule instead of -s: torch's CSV or pipeweave's text form "
        "(as train --schedule-file)",
    )
    p.add_argument("--width", type=int, default=100, help="columns of the text timeline (default 100)")
    from pipeweave.commands.stream_options import add_schedule_arguments

    add_recompute_cost_arguments(p)
    add_layout_arguments(p, sequence_parallel=True)
    add_byte_arguments(p)
    add_stash_arguments(p, stream=True)
    g = p.add_argument_group("asynchronous schedules", "a stream of --steps mini-batches with no flush")
    g.add_argument("--steps", type=int, help="mini-batches in the stream (default 4; avgpipe: rounds of P)")
    g.add_argument(
        "--tied",
        action="store_true",
        help="the model ties its first and last stage (--tie-embeddings): staleness counts the tied "
        "members, and the JSON gives tied_lag (the asynchronous rule: docs/guide/your-model.md, "
        "Tied parameters)",
    )
    add_schedule_arguments(g)
    return p


def parse_times(flag: str, text: str) -> Times:
    """``"1.5"`` -> 1.5, ``"1,2,1"`` -> [1.0, 2.0, 1.0].

    Raises:
        UserError: a value that is not a number >= 0.

    Example:
        >>> parse_times("--time-f", "1,2")
        [1.0, 2.0]
    """
    return parse_values(flag, text)


def _check_counts(args: argparse.Namespace) -> None:
    for flag, value in (
        ("--stages", args.stages),
        ("--microbatches", args.microbatches),
        ("--chunks", args.chunks),
        ("--width", args.width),
    ):
        if value is not None and value < 1:
            raise UserError(f"{flag} {value} is invalid; give {flag} >= 1")
    check_cost_flags(args, (("--time-comm", "latency"), ("--time-dispatch", "time")))
    if not 0.0 <= args.mem_w <= 1.0:
        raise UserError(f"--mem-w {args.mem_w} is invalid; give a fraction in [0, 1]")
    refuse_memory_limit(args, "simulate")
    if args.activation_limit is not None and not args.activation_limit * args.stages >= 1.0 - 1e-9:  # nan too
        raise UserError(
            f"--activation-limit {args.activation_limit:g} holds less than one microbatch per rank; give K >= "
            f"1/{args.stages}, e.g. 1 (ZB-1p) or 2 (ZB-2p), or inf for no limit"
        )
    _check_size(args)


MAX_ACTIONS = 2**21
"""The most actions a simulation is asked for: ~10 s to generate, simulate and report at ~5 us each (the
``--microbatches`` help of simulate, partition and compare says so)."""


def _check_size(args: argparse.Namespace) -> None:
    if args.stages is None or args.microbatches is None or args.schedule not in SCHEDULES:
        return
    chunks = args.chunks or SCHEDULES[args.schedule].chunks or 1
    check_simulation_size(args.stages, args.microbatches, chunks=chunks, steps=getattr(args, "steps", 1) or 1)


def check_simulation_size(
    stages: int, microbatches: int, *, chunks: int = 1, steps: int = 1, steps_flag: str = "--steps"
) -> None:
    """Refuse, in one line, a simulation of more than ``MAX_ACTIONS`` actions (it would run for minutes) or
    larger than this machine's free memory (it would swap, then be killed).

    Raises:
        UserError: naming the counts, the limit and the fix.
    """
    # F, B (or I and W) per microbatch, chunk and stage; U's are few
    actions = 3 * stages * microbatches * chunks * max(1, steps)
    counts = f"--stages {stages} x --microbatches {microbatches}"
    counts += f" x {chunks} chunks" if chunks > 1 else ""
    counts += f" x {steps_flag} {steps}" if steps > 1 else ""
    free = _available_memory()
    if free is not None and actions * BYTES_PER_ACTION > free:
        raise UserError(
            f"{counts} make up to {actions:.2g} actions, ~{actions * BYTES_PER_ACTION / 2**30:.0f} GiB to "
            f"simulate, more than the {free / 2**30:.1f} GiB free here; give fewer stages, microbatches or chunks"
        )
    if actions > MAX_ACTIONS:
        raise UserError(
            f"{counts} make up to {actions:.2g} actions, more than the {MAX_ACTIONS:.2g} a simulation answers "
            f"in about 10 s; give fewer stages, microbatches or chunks (at most {MAX_ACTIONS:.2g} actions)"
        )


def _check_lengths(times: dict[str, Times], num_parts: int) -> None:
    for flag, value in times.items():
        if isinstance(value, list) and len(value) != num_parts:
            raise UserError(
                f"{flag} has {len(value)} values but the schedule has {num_parts} parts; "
                f"give one value per part or a single number"
            )


def _build(args: argparse.Namespace, times: dict[str, Times]) -> tuple[Schedule, ScheduleInfo | None]:
    if args.from_csv:
        path = Path(args.from_csv)
        if not path.is_file():
            raise UserError(f"--from-csv {args.from_csv!r} is not a file; give the path of a CSV schedule")
        return read_csv(path), None
    info = SCHEDULES.get(args.schedule)
    if info is None:
        raise UserError(f"unknown schedule {args.schedule!r}; choose one of: {', '.join(SCHEDULES)}")
    # Searched schedules take the cost model as options: hand them the scalar times.
    cost = CostModel(
        f=times["--time-f"], b=times["--time-b"], w=times["--time-w"], comm=args.time_comm, mem_w=args.mem_w
    )
    options: dict[str, object] = dict(cost.generator_options(info.generator))
    from pipeweave.commands.stream_options import schedule_options

    options.update(schedule_options(args, args.schedule))  # a generator's options (--no-overlap-fb, a stream's)
    if not info.synchronous and getattr(args, "steps", None) is not None:  # the stream's length
        options["num_steps"] = args.steps
    schedule = generate(
        args.schedule, num_stages=args.stages, num_microbatches=args.microbatches, num_chunks=args.chunks, **options
    )
    return schedule, info


def _prepared(args: argparse.Namespace) -> tuple[Schedule, ScheduleInfo | None, CostModel, Any, Any]:
    """The arguments checked: ``(schedule, info, cost, layout, model bytes)``, the schedule not yet validated."""
    _check_counts(args)
    _check_outputs(args)
    times = {
        flag: parse_times(flag, getattr(args, flag[2:].replace("-", "_")))
        for flag in ("--time-f", "--time-b", "--time-w", "--time-u")
    }
    if not args.from_csv:  # the flags refused before the schedule is built (a CSV's D is known once read)
        layout_from_args(args, num_ranks=args.stages)
    schedule, info = _build(args, times)
    _check_lengths(times, schedule.num_parts)
    layout = layout_from_args(args, num_ranks=schedule.placement.ranks_per_pipeline)
    model = model_bytes(args, schedule.num_parts)
    cost = CostModel(
        f=times["--time-f"],
        b=times["--time-b"],
        w=times["--time-w"],
        u=times["--time-u"],
        comm=args.time_comm,
        comm_rendezvous=args.comm_rendezvous,
        dispatch=args.time_dispatch,
        mem_w=args.mem_w,
        **recompute_costs(args),
    )
    cost.for_parts(num_parts=schedule.num_parts, num_ranks=schedule.placement.ranks_per_pipeline)  # lengths checked
    return schedule, info, cost, layout, model


def _timeline(schedule: Schedule, cost: CostModel, layout: Any, model: Any) -> Any:
    """The simulated timeline (on the layout's grid where it is not trivial), the schedule validated on the way:
    ``sim.validation.check`` (``validate``'s rules over arrays), then the simulation, which raises
    ``validate``'s error where the order gets stuck.

    Raises:
        InvalidSchedule: ``validate``'s error, word for word.
    """
    check(schedule)
    return (
        simulate(schedule, cost, check=True)
        if layout.trivial
        else simulate_layout(schedule, cost, layout, model, check=True)
    )


def _levered(
    args: argparse.Namespace, schedule: Schedule, cost: CostModel, layout: Any, model: Any
) -> tuple[Any, Metrics, dict[str, Any]]:
    """The timeline to show, its metrics and the memory levers' JSON (empty without levers)."""
    plan = stash_plan(args, schedule.num_parts)
    if not plan.active:
        timeline = _timeline(schedule, cost, layout, model)
        return timeline, compute_metrics(timeline), {}
    if not layout.trivial:
        raise UserError(
            "--offload, --balance-activations and --compress-activations are simulated on one "
            "pipeline; drop --tensor-parallel/--data-parallel or the memory levers"
        )
    check(schedule)
    costs = cost.for_parts(num_parts=schedule.num_parts, num_ranks=schedule.placement.ranks_per_pipeline)
    metrics, timeline, levers = simulate_levers(schedule, costs, plan, args.host_bandwidth, args.copy_stream)
    return timeline, metrics, levers


def simulated(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    """What ``pipeweave simulate ARGS --json`` prints, and the timeline it comes from (``pipeweave compare``).

    Raises:
        UserError: invalid arguments, or a schedule the validator refuses (its reason).
    """
    schedule, info, cost, layout, model = _prepared(args)
    try:
        timeline = _timeline(schedule, cost, layout, model)
    except InvalidSchedule as exc:
        raise UserError(f"{schedule.name} is invalid: {exc}") from None
    metrics = _tied(args, schedule, compute_metrics(timeline))
    return _tied_json(args, schedule, as_json(schedule, info, cost, metrics, {})), timeline


def _tied(args: argparse.Namespace, schedule: Schedule, metrics: Metrics) -> Metrics:
    """With ``--tied``: the staleness of a model tying its first and last stage
    (``sim.versions.staleness(..., tied=True)``).

    Raises:
        UserError: an asynchronous schedule that does not train a tie.
    """
    if not getattr(args, "tied", False):
        return metrics
    if not schedule.is_synchronous and schedule.name not in tied_streams():
        raise UserError(
            f"--tied: {schedule.name} does not train tied parameters; asynchronous schedules train "
            f"them on {', '.join(tied_streams())} only; choose one or drop --tied"
        )
    return dataclasses.replace(metrics, staleness=staleness(schedule, tied=True))


def _tied_json(args: argparse.Namespace, schedule: Schedule, out: dict[str, Any]) -> dict[str, Any]:
    """With ``--tied``: ``tied_lag``, per stage the updates its tied members lag its other weights."""
    if getattr(args, "tied", False):
        out["tied_lag"] = list(tied_lag(schedule))
    return out


def run(args: argparse.Namespace) -> int:
    schedule, info, cost, layout, model = _prepared(args)
    try:
        timeline, metrics, levers = _levered(args, schedule, cost, layout, model)
    except InvalidSchedule as exc:
        return _report_invalid(args, schedule, exc)
    report = layout_report(schedule, cost, layout, model, metrics.makespan)
    files = _write_files(args, schedule, timeline, stash_plan(args, schedule.num_parts))
    metrics = _tied(args, schedule, metrics)
    if args.json:
        out = _tied_json(args, schedule, as_json(schedule, info, cost, metrics, files))
        if levers:
            out["memory_levers"] = levers
        if report is not None:
            out["layout"] = report[0]
        print(json.dumps(out))
        return 0
    print_report(schedule, info, cost, metrics, format_timeline(timeline, width=args.width), files)
    for line in report[1] if report is not None else ():
        print(line)
    return 0


def _report_invalid(args: argparse.Namespace, schedule: Schedule, exc: InvalidSchedule) -> int:
    if args.json:
        print(
            json.dumps(
                {
                    "schedule": schedule.name,
                    "stages": schedule.num_ranks,
                    "microbatches": schedule.num_microbatches,
                    "valid": False,
                    "reason": exc.reason,
                    "rank": exc.rank,
                    "step": exc.step,
                }
            )
        )
    else:
        print(f"pipeweave simulate: {exc}", file=sys.stderr)
    return 1


def _check_outputs(args: argparse.Namespace) -> None:
    from pipeweave.commands.outputs import output_file, picture_file

    for flag, value in (("--csv", args.csv), ("--trace", args.trace)):
        if value:
            output_file(flag, value)
    if args.plot:
        picture_file("--plot", args.plot)


def _write_csv(args: argparse.Namespace, schedule: Schedule, plan: Any) -> None:
    """``--csv``: pipeweave's form, or torch's (refused in one line naming an action torch cannot carry)."""
    if args.csv_format == "pipeweave":
        write_csv(schedule, args.csv)
        return
    from pipeweave.schedule.levers import plan_stash
    from pipeweave.schedule.torch_form import to_torch_csv

    levered = schedule.with_actions(plan_stash(schedule, plan).actions) if plan.active else schedule
    try:
        text = to_torch_csv(levered, format=args.csv_format, shard=getattr(args, "zero", 0) == 3)
    except UserError as exc:
        raise UserError(f"--csv: {exc}; or give --csv-format pipeweave, pipeweave's own form") from None
    Path(args.csv).write_text(text)


def _write_files(args: argparse.Namespace, schedule: Schedule, timeline: Any, plan: Any) -> dict[str, str]:
    files: dict[str, str] = {}
    if args.csv:
        _write_csv(args, schedule, plan)
        files["csv"] = args.csv
    if args.plot:
        from pipeweave.sim.plot import plot_timeline  # matplotlib only when asked

        files["plot"] = str(plot_timeline(timeline, args.plot))
    if args.trace:
        from pipeweave.sim.trace import write_trace

        files["trace"] = str(write_trace(timeline, args.trace))
    return files
