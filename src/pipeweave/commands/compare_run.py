"""``pipeweave compare``, once parsed (``commands.compare``): costs, the simulated rows, then the deeper ones.

Every number comes from the code that computes it for one approach alone: the
registry's closed forms (as ``pipeweave schedules`` prints them), ``pipeweave
simulate`` (``commands.simulate.simulated``) under the model's profiled
per-part costs, ``pipeweave train --json`` (``commands.compare_measure``) and
the reference executor (``commands.convergence``).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from pipeweave.commands.compare_output import emit, output_paths
from pipeweave.commands.compare_table import LITERATURE, choose, recommend
from pipeweave.commands.model_options import model_spec
from pipeweave.commands.partition import part_costs
from pipeweave.commands.simulate import add_parser as add_simulate_parser
from pipeweave.commands.simulate import check_simulation_size, simulated
from pipeweave.commands.simulate_report import evaluate
from pipeweave.commands.units import memory_bytes
from pipeweave.errors import UserError
from pipeweave.host import cpu_cores
from pipeweave.models.spec import uniform_parts
from pipeweave.partition import LayerCosts, Partition
from pipeweave.runtime.report.stream_summary import minibatch_period
from pipeweave.runtime.stage.tied import spans_parts
from pipeweave.runtime.stage.tied_stream import check_stream_ties
from pipeweave.schedule.registry import SCHEDULES
from pipeweave.sim import CostModel
from pipeweave.sim.metrics import peak_activations

# The default gpt: train's (4 layers of blocks would leave the 2-chunk schedules at D = 4 without a layer
# per part), so 6 blocks, 8 layers with the embedding and the head, as the convergence study's.
DEFAULT_GPT = {"layers": 6, "hidden": 128, "heads": 4, "seq_len": 64}


def compare(args: argparse.Namespace) -> int:
    """``pipeweave compare ARGS``: the rows at the asked depth, then the outputs; the exit code."""
    limit = activation_limit(args)
    output_paths(args)  # a file that cannot be written is one line before any profiling or run
    rows, skipped, spec = simulated_comparison(args)
    if limit is not None and limit[1] == "M_a":
        recommend(rows, limit)  # a limit nothing fits: one line before anything runs (M_a do not depend on a run)
    if args.measure is not None:
        from pipeweave.commands.compare_measure import measure

        measure(rows, args)
    if args.convergence is not None:
        from pipeweave.commands.convergence import convergence_rows

        convergence_rows(rows, args, spec)
    emit(rows, args, limit, skipped)
    return 0


def simulated_comparison(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, str]], Any]:
    """The simulated depth of ``pipeweave compare ARGS`` (``pipeweave.compare``): the chosen approaches' rows
    under the model's per-layer costs (profiled, or ``--costs``), the approaches skipped with their reasons,
    and the model's ``ModelSpec``.

    Raises:
        UserError: a count or name that is invalid, or a setting no approach can serve.
    """
    names = choose(args.schedules, args.all, list(SCHEDULES))
    _check(args)
    spec = model_spec(args, DEFAULT_GPT)
    return (*simulated_rows(names, args, layer_costs(args, spec), spec), spec)


def simulated_rows(
    names: list[str], args: argparse.Namespace, costs: LayerCosts, spec: Any = None
) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """The rows of the approaches that can serve D, T and the model (``spec``: its ties; None: untied), and each
    other one with its reason.

    An approach named with ``-s`` that cannot is an error; of the default set (or ``--all``) it is skipped.

    Raises:
        UserError: a named approach's reason, or none of the default set can serve the setting.
    """
    rows, skipped = [], []
    for name in names:
        try:
            rows.append(simulated_row(name, args, costs, spec))
        except UserError as exc:
            if args.schedules is not None:
                raise
            skipped.append({"name": name, "reason": str(exc)})
    if not rows:
        raise UserError(
            f"no approach can run D = {args.stages}, T = {args.microbatches} on this model "
            f"({skipped[0]['name']}: {skipped[0]['reason']})"
        )
    return rows, skipped


DEPENDENT = {
    "rounds": ("measure", 1),
    "seeds": ("convergence", 1),
    "lr": ("convergence", 0.3),
    "momentum": ("convergence", 0.9),
    "memory_limit": ("recommend", None),
    "activation_limit": ("recommend", None),
}
"""Options that only one mode of compare reads: dest -> (the mode's dest, the default once it is given)."""


def activation_limit(args: argparse.Namespace) -> tuple[float, str] | None:
    """``--recommend``'s limit: ``(K x D, "M_a")`` from ``--activation-limit K``, ``(bytes, "bytes")`` from
    ``--memory-limit BYTES``, or None.

    Raises:
        UserError: both given, a K that is not > 0, or bytes that are not a size (K under its former name too).
    """
    if args.activation_limit is not None and args.memory_limit is not None:
        raise UserError(
            f"--activation-limit {args.activation_limit:g} and --memory-limit {args.memory_limit} both limit "
            "--recommend; give one of them"
        )
    if args.memory_limit is not None:
        return memory_bytes(args.memory_limit), "bytes"
    if args.activation_limit is None:
        return None
    if not (args.activation_limit > 0 and math.isfinite(args.activation_limit)):
        raise UserError(f"--activation-limit {args.activation_limit} is invalid; give K > 0, e.g. 1 (ZB-1p) or 2")
    return args.activation_limit * args.stages, "M_a"


def _check(args: argparse.Namespace) -> None:
    """Each count, one line, before anything is profiled or run; an option given without the one it serves."""
    for dest, (owner, default) in DEPENDENT.items():
        value = getattr(args, dest)
        if value is not None and not getattr(args, owner):
            flag, needs = "--" + dest.replace("_", "-"), "--" + owner
            raise UserError(f"{flag} {value} applies to {needs} only; give {needs} too, or drop {flag}")
        setattr(args, dest, default if value is None else value)
    for flag, value, least in (
        ("--stages", args.stages, 1),
        ("--microbatches", args.microbatches, 1),
        ("--chunks", args.chunks, 1),
        ("--batch", args.batch, 1),
        ("--stream-steps", args.stream_steps, 3),
        ("--measure", args.measure, 1),
        ("--rounds", args.rounds, 1),
        ("--convergence", args.convergence, 1),
        ("--seeds", args.seeds, 1),
        ("--repeats", args.repeats, 1),
    ):
        if value is not None and value < least:
            raise UserError(f"{flag} {value} is invalid; give {flag} >= {least}")
    check_simulation_size(
        args.stages, args.microbatches, chunks=args.chunks or 2, steps=args.stream_steps, steps_flag="--stream-steps"
    )
    if args.batch % args.microbatches:
        raise UserError(
            f"--batch {args.batch} is not divisible by --microbatches {args.microbatches}; give a "
            "multiple of the microbatch count"
        )
    if args.measure is not None:
        cores = cpu_cores()
        if args.stages > cores:
            raise UserError(
                f"--measure runs {args.stages} ranks but this machine has {cores} cores; give "
                f"--stages {cores} or fewer, or drop --measure"
            )
    args.precision = "fp32"  # the profiler's, as train's default


def layer_costs(args: argparse.Namespace, spec: Any) -> LayerCosts:
    """``--costs FILE``, or the model profiled on the CPU with one thread per rank, as train's ranks run (cached)."""
    if args.costs:
        costs = LayerCosts.load(args.costs)
    else:
        from pipeweave.commands.profiled import profiled_costs

        costs = profiled_costs(args, spec, args.batch // args.microbatches, "cpu", threads=1)
    if costs.num_layers != spec.num_layers:
        raise UserError(f"--costs has {costs.num_layers} layers for a model of {spec.num_layers}; profile this model")
    return costs


def num_parts(name: str, args: argparse.Namespace) -> int:
    """Parts of the approach's schedule: D per chunk (replicas are stages of the same parts)."""
    return args.stages * (SCHEDULES[name].chunks or args.chunks)


def simulate_argv(
    name: str,
    args: argparse.Namespace,
    times: dict[str, list[float]],
    comm: float = 0.0,
    dispatch: float = 0.0,
    tied: bool = False,
) -> list[str]:
    """The ``pipeweave simulate`` command line of one approach under per-part times (``tied``: ``--tied``)."""
    argv = ["-s", name, "--stages", str(args.stages), "--microbatches", str(args.microbatches), "--json"]
    argv += ["--tied"] if tied else []
    argv += [f"--time-{k}={','.join(repr(t) for t in times[k])}" for k in ("f", "b", "w")]
    argv += [f"--time-comm={comm!r}", f"--time-dispatch={dispatch!r}"]
    if SCHEDULES[name].chunks is None:
        argv += ["--chunks", str(args.chunks)]
    if not SCHEDULES[name].synchronous:
        argv += ["--steps", str(args.stream_steps)]
    return argv


def run_simulate(argv: list[str]) -> tuple[dict[str, Any], Any]:
    """``pipeweave simulate ARGV --json``'s object and timeline, parsed by simulate's own parser."""
    parser = argparse.ArgumentParser(prog="pipeweave")
    add_simulate_parser(parser.add_subparsers())
    return simulated(parser.parse_args(["simulate", *argv]))


def simulated_row(name: str, args: argparse.Namespace, costs: LayerCosts, spec: Any = None) -> dict[str, Any]:
    """One approach at the simulated depth: literature, closed forms and simulate's values; on a stream, a tie
    of ``spec`` between parts counted as ``simulate --tied`` counts it (its staleness, ``tied_lag``).

    Raises:
        UserError: a tied model on a stream that does not train ties (``runtime.stage.tied_stream``).
    """
    info = SCHEDULES[name]
    parts = uniform_parts(costs.num_layers, num_parts(name, args))
    times = part_costs(costs, Partition(tuple(len(r) for r in parts)))
    stream = spec is not None and not info.synchronous
    if stream:
        check_stream_ties(spec, name, lr_scheduled=False)  # as train refuses it
    tied = stream and spans_parts(spec, parts)
    out, timeline = run_simulate(simulate_argv(name, args, times, tied=tied))
    step = out["makespan"] if info.synchronous else minibatch_period(timeline, args.microbatches)
    part_bytes = CostModel(activation=times["activation"]).for_parts(num_parts=len(parts), num_ranks=args.stages)
    row = {
        "name": name,
        "family": info.family,
        "synchronous": info.synchronous,
        **literature(name, args),
        "closed_bubble": out["closed_form"]["bubble"],
        "closed_bubble_value": out["closed_form"]["bubble_value"],
        "closed_activations": info.activations,
        "closed_weights": info.weights,
        "bubble_ratio": out["steady_bubble_ratio"] if not info.synchronous else out["bubble_ratio"],
        "bubble_ratio_flush": out["bubble_ratio_flush"],
        **{k: out[k] for k in ("peak_activations", "weight_versions", "staleness", "inconsistency")},
        "peak_activation_bytes": list(peak_activations(timeline, part_bytes)),
        "step_time_s": step,
        "samples_per_s": args.batch / step,
        **({"tied_lag": out["tied_lag"]} if tied else {}),
    }
    if args.time_comm is not None or args.time_dispatch is not None:
        comm, _ = run_simulate(simulate_argv(name, args, times, args.time_comm or 0.0, args.time_dispatch or 0.0, tied))
        row["bubble_ratio_comm"] = comm["steady_bubble_ratio"] if not info.synchronous else comm["bubble_ratio"]
    return row


def literature(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The papers' claims for ``name`` (``compare_table.LITERATURE``), the bubble evaluated where it is arithmetic."""
    bubble, convergence, weights, activations, extra = LITERATURE.get(name, ("-",) * 5)
    names = {"D": float(args.stages), "T": float(args.microbatches), "v": float(args.chunks)}
    return {
        "lit_bubble": bubble,
        "lit_bubble_value": evaluate(bubble, names),
        "lit_convergence": convergence,
        "lit_weights": weights,
        "lit_activations": activations,
        "lit_extra": extra,
    }
