"""``pipeweave search``: an automatic zero-bubble schedule under a memory limit, with its bound and gap."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any

from pipeweave.commands.layout_options import (
    add_byte_arguments,
    add_layout_arguments,
    has_report,
    layout_from_args,
    layout_report,
    model_bytes,
)
from pipeweave.commands.lever_options import add_stash_arguments, stash_plan
from pipeweave.commands.recompute_options import AUTO, add_recompute_cost_arguments, recompute_costs
from pipeweave.errors import UserError
from pipeweave.host import available_memory
from pipeweave.schedule.levers import DEFAULT_BANDWIDTH
from pipeweave.sim.bubble import bubble_metrics
from pipeweave.sim.cost import CostModel
from pipeweave.sim.levers import simulate_levers
from pipeweave.sim.parallel import Layout, layout_times, simulate_layout
from pipeweave.sim.recompute import spelled
from pipeweave.sim.traffic import ModelBytes


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "search",
        help="search a zero-bubble schedule under a memory limit",
        description="Heuristic and exact (CP-SAT or HiGHS) zero-bubble search; prints bubble, bound, gap.",
    )
    p.add_argument("--stages", type=int, required=True, help="D, ranks")
    p.add_argument("--microbatches", type=int, required=True, help="T")
    p.add_argument("--chunks", type=int, choices=(1, 2), default=1, help="2: V placement (zb-v-auto)")
    p.add_argument("--v-shape", action="store_true", help="same as --chunks 2")
    for op, text in (("f", "forward"), ("b", "input-gradient (I)"), ("w", "weight-gradient (W)")):
        p.add_argument(f"--time-{op}", type=float, default=1.0, help=f"{text} time of one D-th of the model")
    p.add_argument("--time-comm", type=float, default=0.0, help="one hop between ranks")
    p.add_argument(
        "--activation-limit",
        type=float,
        default=1.0,
        metavar="K",
        help="activations per rank as a multiple of 1F1B's peak D x M_a; 1 ZB-1p, 2 ZB-2p",
    )
    p.add_argument("--memory-limit", metavar="BYTES", help=argparse.SUPPRESS)  # K's former name: refused in one line
    p.add_argument("--mem-w", type=float, default=0.5, help="M_W / M_a held between I and W (default 0.5)")
    p.add_argument(
        "--time-limit",
        type=float,
        default=10.0,
        help="seconds for the whole search; the solver stops then with its best so far",
    )
    p.add_argument(
        "--work-limit",
        type=float,
        default=None,
        help="CP-SAT deterministic seconds; with --workers 1 the result is the same on every run",
    )
    p.add_argument("--workers", type=int, default=0, help="solver threads (0: the solver's default)")
    p.add_argument("--solver", choices=("cpsat", "highs", "heuristic"), default="cpsat")
    p.add_argument("--csv", metavar="FILE", help="write the schedule as CSV")
    p.add_argument("--plot", metavar="FILE", help="write a timeline plot")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_recompute_cost_arguments(p, auto=True)
    add_layout_arguments(p, sequence_parallel=True)
    add_byte_arguments(p)
    add_stash_arguments(p, auto=True)
    return p


def run(args: argparse.Namespace) -> int:
    from pipeweave.autoschedule import exact
    from pipeweave.commands.outputs import output_file, picture_file

    layout, model = _check_arguments(args)
    if args.csv:
        output_file("--csv", args.csv)
    if args.plot:
        picture_file("--plot", args.plot)
    f, b, w, comm = _times(args, layout, model)
    levers = stash_plan(args, args.stages * (2 if args.v_shape or args.chunks == 2 else 1), auto=True)
    if (levers.active or args.offload == AUTO) and not layout.trivial:
        raise UserError(
            "--offload, --balance-activations and --compress-activations are searched on one pipeline; "
            "drop --tensor-parallel/--data-parallel or the memory levers"
        )
    # Compressed activations take kept x M_a: the same limit holds 1/kept as many.
    problem, chosen = _problem(args, f, b, w, comm, args.activation_limit / levers.kept, levers.offload)
    levers = dataclasses.replace(levers, offload=levers.offload | problem.offload)
    result = exact(
        problem, solver=args.solver, time_limit=args.time_limit, workers=args.workers, work_limit=args.work_limit
    )
    _write_files(args, result.schedule, problem.cost)
    modes = problem.costs.recompute or ("none",) * problem.num_parts
    report = _layout_report(args, result.schedule, layout, model, modes)
    levered = _levered(args, result.schedule, problem.cost, levers)
    if args.json:
        print(
            json.dumps(
                {
                    **result.as_dict(),
                    "recompute": spelled(modes),
                    "recompute_chosen": chosen and args.recompute == AUTO,
                    "offload": sorted(problem.offload),
                    "offload_chosen": args.offload == AUTO,
                    **({"layout": report[0]} if report else {}),
                    **levered,
                }
            )
        )
        return 0
    _print_found(args, result, problem, modes, chosen, levered)
    for line in report[1] if report else ():
        print(line)
    return 0


def _write_files(args: argparse.Namespace, schedule: Any, cost: CostModel) -> None:
    """``--csv`` and ``--plot``: the found schedule, and its simulated timeline."""
    from pipeweave.schedule.text import write_csv

    if args.csv:
        write_csv(schedule, args.csv)
    if args.plot:
        from pipeweave.sim import simulate
        from pipeweave.sim.plot import plot_timeline

        plot_timeline(simulate(schedule, cost), args.plot)


def _print_found(
    args: argparse.Namespace, result: Any, problem: Any, modes: tuple[str, ...], chosen: bool, levered: dict[str, Any]
) -> None:
    """The found schedule in a few lines: its solver, the levers chosen, bubble, span and peaks."""
    print(
        f"{result.schedule.name}: D={args.stages} T={args.microbatches} K={args.activation_limit} "
        f"solver={result.solver} ({result.status}, {result.solver_time:.2f} s)"
    )
    if set(modes) != {"none"} or args.recompute == AUTO:
        print(f"  recompute {spelled(modes)}" + (" (chosen per part with the schedule)" if chosen else ""))
    if args.offload == AUTO:
        shown = ",".join(map(str, sorted(problem.offload))) or "none"
        print(
            f"  offload {shown} (chosen per part with the schedule, copies at {problem.host_bandwidth:g} M_a "
            "per time unit)"
        )
    print(f"  bubble ratio {result.bubble_ratio:.4f}  (bound {result.bubble_bound:.4f})")
    print(f"  max span {result.span:.4f}  lower bound {result.lower_bound:.4f}  gap {100 * result.gap:.2f} %")
    print(f"  peak activations {list(result.metrics.peak_activations)} (limit {problem.peak_limit[0]:g})")
    if levered:
        print(
            f"  with the memory levers: makespan {levered['makespan']:g}, peak activations "
            f"{levered['peak_activations']} (M_a of uncompressed activations)"
        )
    if args.plot:
        print(f"  plot written to {args.plot}")


def _problem(
    args: argparse.Namespace,
    f: float,
    b: float,
    w: float,
    comm: float,
    activation_limit: float,
    offload: frozenset[int],
) -> tuple[Any, bool]:
    """The instance of the flags, and whether its recomputation or offload per part was chosen (``--recompute
    auto``, ``autoschedule.recompute``; ``--offload auto``, ``autoschedule.offload``: with the heuristic's schedules; the
    exact search then refines the chosen one). ``offload``: the parts ``--offload`` names, searched with
    their memory and copies (``Problem.offload``)."""
    from pipeweave.autoschedule import Problem
    from pipeweave.autoschedule.offload import choose_offload, offload_problem
    from pipeweave.autoschedule.recompute import choose_recompute, recompute_problem, with_recompute

    cost = CostModel(f=f, b=b, w=w, comm=comm, mem_w=args.mem_w, **recompute_costs(args, auto=True))
    vshape = args.v_shape or args.chunks == 2
    bandwidth = args.host_bandwidth or DEFAULT_BANDWIDTH
    if args.offload == AUTO:
        if args.recompute == AUTO:
            raise UserError(
                "--recompute auto and --offload auto are chosen one at a time; give one of them a "
                "value (e.g. --recompute none)"
            )
        problem = offload_problem(
            args.stages,
            args.microbatches,
            vshape=vshape,
            cost=cost,
            activation_limit=activation_limit,
            host_bandwidth=bandwidth,
        )
        return dataclasses.replace(problem, offload=choose_offload(problem)[0]), True
    if args.recompute != AUTO:
        return Problem(
            num_stages=args.stages,
            num_microbatches=args.microbatches,
            vshape=vshape,
            cost=cost,
            activation_limit=activation_limit,
            offload=offload,
            host_bandwidth=bandwidth,
        ), False
    problem = recompute_problem(
        args.stages, args.microbatches, vshape=vshape, cost=cost, activation_limit=activation_limit
    )
    return with_recompute(problem, choose_recompute(problem)[0]), True


def _levered(args: argparse.Namespace, schedule: Any, cost: CostModel, levers: Any) -> dict[str, Any]:
    """The found schedule with the memory levers applied (``sim.levers``): its makespan, peaks and levers."""
    if not levers.active:
        return {}
    costs = cost.for_parts(num_parts=schedule.num_parts, num_ranks=schedule.placement.ranks_per_pipeline)
    metrics, _, json_ = simulate_levers(schedule, costs, levers, args.host_bandwidth)
    return {"makespan": metrics.makespan, "peak_activations": list(metrics.peak_activations), "memory_levers": json_}


def _times(args: argparse.Namespace, layout: Layout, model: ModelBytes) -> tuple[float, float, float, float]:
    """The searched times: the flags' on one GPU, with the layout's TP split, collectives and links."""
    if layout.trivial:
        return args.time_f, args.time_b, args.time_w, args.time_comm
    assert isinstance(model.message, float) and isinstance(model.tp_collectives, float)  # _check_arguments
    return layout_times(
        layout,
        f=args.time_f,
        b=args.time_b,
        w=args.time_w,
        comm=args.time_comm,
        message=model.message,
        tp_collectives=model.tp_collectives,
        num_ranks=args.stages,
    )


def _layout_report(
    args: argparse.Namespace, schedule: Any, layout: Layout, model: ModelBytes, modes: tuple[str, ...]
) -> tuple[dict[str, Any], list[str]] | None:
    """The found schedule on the layout, its hops on their own links and the DP reductions added."""
    if not has_report(layout, model):
        return None
    cost = CostModel(
        f=args.time_f,
        b=args.time_b,
        w=args.time_w,
        comm=args.time_comm,
        mem_w=args.mem_w,
        **{**recompute_costs(args, auto=True), "recompute": modes},
    )
    timeline = simulate_layout(schedule, cost, layout, model, check=False)
    makespan = bubble_metrics(timeline)[0]
    json_, lines = layout_report(schedule, cost, layout, model, makespan) or ({}, [])
    json_["makespan"] = makespan
    return json_, [f"  step on the layout {makespan:g} (DP reductions and each hop on its own link)", *lines]


def _check_arguments(args: argparse.Namespace) -> tuple[Layout, ModelBytes]:
    """Every flag's value, then the problem's size, in one line each before any work."""
    from pipeweave.commands.units import check_cost_flags, refuse_memory_limit

    for flag in ("--stages", "--microbatches"):
        value = getattr(args, flag[2:])
        if value < 1:
            raise UserError(f"{flag} {value} is invalid; give {flag} >= 1")
    check_cost_flags(
        args, (("--time-f", "time"), ("--time-b", "time"), ("--time-w", "time"), ("--time-comm", "latency"))
    )
    if not 0.0 <= args.mem_w <= 1.0:
        raise UserError(f"--mem-w {args.mem_w} is invalid; give a fraction in [0, 1]")
    refuse_memory_limit(args, "search")
    low = args.activation_limit * args.stages < 1.0 - 1e-9 and args.recompute == "none" and args.offload != AUTO
    if math.isnan(args.activation_limit) or low:
        raise UserError(
            f"--activation-limit {args.activation_limit:g} holds less than one microbatch per rank; give K >= "
            f"1/{args.stages}, e.g. 1 (ZB-1p) or 2 (ZB-2p), or inf for no limit"
        )
    if not args.time_limit > 0:
        raise UserError(f"--time-limit {args.time_limit} is invalid; give seconds > 0")
    if args.work_limit is not None and not args.work_limit > 0:
        raise UserError(f"--work-limit {args.work_limit} is invalid; give deterministic seconds > 0")
    if args.workers < 0:
        raise UserError(f"--workers {args.workers} is invalid; give 0 (the solver's default) or more")
    _check_size(args)
    layout = layout_from_args(args, num_ranks=args.stages)
    model = model_bytes(args, args.stages * (2 if args.v_shape or args.chunks == 2 else 1))
    for flag, value, text in (
        ("--message-bytes", model.message, args.message_bytes),
        ("--tp-collectives", model.tp_collectives, args.tp_collectives),
    ):
        if not isinstance(value, float):
            raise UserError(f"{flag} {text} is a list; the search takes one value for every part: give a single number")
    return layout, model


BYTES_PER_ACTION = 400
"""Memory the search takes per action (F, I or W of one stage and microbatch), measured with the heuristic,
which always runs: D=256 T=1024 (786 k actions) peaks at 296 MB."""
SECONDS_PER_ACTION = 40e-6
"""Time the parts of a search that --time-limit cannot stop take per action (the heuristic, then checking and
simulating the result), measured on 2 cores: D=256 T=1024 takes 33 s."""
MIN_UNSTOPPABLE_S = 60.0
"""A search the time limit cannot stop is refused only when it would overrun 10 x --time-limit and this."""


def _check_size(args: argparse.Namespace) -> None:
    """Refuse, in one line, a search too large for this machine's free memory or far beyond its --time-limit.

    The solver stops at --time-limit with its best so far, but the heuristic it starts from, and the
    checks of the result, run to their end whatever the limit: their memory and time grow with the
    actions, 3 x D x T x chunks.
    """
    chunks = 2 if args.v_shape or args.chunks == 2 else 1
    actions = 3 * args.stages * args.microbatches * chunks
    size = f"--stages {args.stages} x --microbatches {args.microbatches}{' x 2 chunks' if chunks == 2 else ''}"
    free = available_memory()
    if free is not None and actions * BYTES_PER_ACTION > free:
        raise UserError(
            f"{size} make {actions:.2g} actions, ~{_gib(actions * BYTES_PER_ACTION)} to search "
            f"({BYTES_PER_ACTION} B each), more than the {free / 2**30:.1f} GiB free here; give fewer "
            f"stages or microbatches (at most ~{free // BYTES_PER_ACTION:.2g} actions fit)"
        )
    seconds = actions * SECONDS_PER_ACTION
    allowed = max(10 * args.time_limit, MIN_UNSTOPPABLE_S)
    if seconds > allowed:
        raise UserError(
            f"{size} make {actions:.2g} actions, ~{_duration(seconds)} of search that --time-limit "
            f"cannot stop (~{SECONDS_PER_ACTION * 1e6:.0f} us each), more than "
            f"{_duration(allowed)} (10 x --time-limit {args.time_limit:g}, at least "
            f"{MIN_UNSTOPPABLE_S:.0f} s); give fewer stages or microbatches "
            f"(at most ~{allowed / SECONDS_PER_ACTION:.2g} actions) or a larger --time-limit"
        )


def _gib(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30)):
        if n >= size:
            return f"{n / size:.0f} {unit}"
    return f"{n / 2**20:.0f} MiB"


def _duration(seconds: float) -> str:
    for unit, size in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"
