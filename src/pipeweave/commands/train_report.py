"""What a finished ``pipeweave train`` run writes and prints: its JSON record, trace, plot and summary table.

``commands.train`` parses, checks and launches; this module turns the
gathered ``RunRecord`` into the JSON record (``build_report``: configuration,
losses, every measured figure beside the simulator's), writes it with the
Chrome trace and the timeline plot (``write_outputs``, to paths checked
before the run by ``output_paths``) and prints the summary table.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pipeweave.commands.outputs import output_file, output_folder, picture_file
from pipeweave.commands.split_names import split_fields
from pipeweave.commands.units import format_bytes
from pipeweave.config import TrainConfig
from pipeweave.config.toml import dumps as dump_toml
from pipeweave.durable import remove_stale_temporaries, replacing, write_atomic
from pipeweave.errors import UserError
from pipeweave.runtime.report.stream_summary import stream_timeline, summarize_stream
from pipeweave.runtime.report.trace import chrome_trace, rebased, step_timeline, summarize, window
from pipeweave.runtime.run.checkpoint_files import newest
from pipeweave.runtime.run.memory import MemoryEstimate
from pipeweave.runtime.run.prepare import layer_ranges, learning_rates, stream_rates
from pipeweave.runtime.run.record import RunRecord
from pipeweave.runtime.run.streams import segments
from pipeweave.runtime.stream import stream_updates
from pipeweave.schedule import Schedule
from pipeweave.schedule.pipedream import noam
from pipeweave.side_output import SideOutput
from pipeweave.sim.plot import plot_timeline


def build_report(schedule: Schedule, record: RunRecord, memory: MemoryEstimate | None = None) -> dict[str, Any]:
    """The JSON record: configuration, losses and every measured and simulated figure, and the memory
    estimated per rank before the run (``runtime.run.memory``) beside the peaks measured."""
    config = record.config
    return {
        "schedule": config.schedule.name,
        "stages": config.schedule.num_stages,
        "microbatches": config.schedule.num_microbatches,
        "chunks": schedule.num_chunks,
        "ranks": schedule.num_ranks,
        "steps": config.training.steps,
        "data_parallel": config.parallel.data_parallel,
        "tensor_parallel": config.parallel.tensor_parallel,
        "context_parallel": config.parallel.context_parallel,
        "zero": config.parallel.zero,
        "sequence_parallel": config.parallel.sequence_parallel,
        "processes": schedule.num_ranks * config.parallel.per_stage_rank,
        "batch": config.data.batch_size,
        "model": asdict(config.model),
        "optimizer": config.training.optimizer,
        "lr": config.training.lr,
        "recompute": config.memory.recompute,
        "precision": config.training.precision,
        "first_step": record.first_step,
        "losses": record.losses,
        "skipped_steps": record.skipped_steps,
        **_loss_scaling(record),
        "config": dump_toml(config),  # the run's TOML: pipeweave train --config train.json reruns it
        "eval_losses": [{"step": at, "loss": loss} for at, loss in record.eval_losses],
        "lr_schedule": config.training.lr_schedule,
        "lrs": _learning_rates(config, schedule, record),
        "wall_s": record.wall_s,
        "paused_s": record.paused_s,
        **({"streams": len(segments(config))} if config.is_stream else {}),
        **_replication(config),
        "transport": record.transport,
        **({"save_failures": record.save_failures} if record.save_failures else {}),
        **(summarize(schedule, record) if schedule.is_synchronous else summarize_stream(schedule, record)),
        "traced_steps": window(record),
        **(memory.as_dict() if memory is not None else {}),
        **split_fields(config.model, layer_ranges(config, schedule)),  # a model cut at module names
    }


def _replication(config: TrainConfig) -> dict[str, Any]:
    """pipedream: ``noam``, the microbatches its input replicas admit by default (ceil(D / r_0)), and with
    replicated parts (1F1B-RR) ``stage_replicas``, the ranks of each part."""
    if config.schedule.name != "pipedream":
        return {}
    replicas = config.schedule.stage_replicas
    out: dict[str, Any] = {"noam": noam(config.schedule.num_stages, replicas[0] if replicas else 1)}
    if replicas is not None:
        out["stage_replicas"] = list(replicas)
    return out


def _learning_rates(config: TrainConfig, schedule: Schedule, record: RunRecord) -> list[float]:
    """The learning rate of each step of the run; a stream's: of each stage's k-th update (before PipeMare's).

    What the resumed checkpoint had done comes from the record (read when the
    run started): a run that saved into the folder it resumed from rewrote it.
    """
    if config.is_stream:
        first = record.first_update
        rates = stream_rates(config, schedule, first)
        return [rates.at(first + k) for k in range(stream_updates(schedule))]
    first_step = record.first_step
    rates = learning_rates(config, first_step)
    return [rates.at(first_step + k) for k in range(config.training.steps)]


def output_paths(config: TrainConfig) -> dict[str, Path]:
    """Where the JSON record, the Chrome trace and the timeline plot go: checked writable, folders created.

    Raises:
        UserError: a path that cannot be written (``commands.outputs``).
    """
    args = config.logging
    out = Path(args.out)
    if not (args.json and args.trace and args.plot):
        output_folder("--out", out)
    paths = {
        "json": output_file("--json", args.json) if args.json else output_file("--out", out / "train.json"),
        "trace": output_file("--trace", args.trace) if args.trace else output_file("--out", out / "trace.json"),
        "plot": picture_file("--plot", args.plot) if args.plot else output_file("--out", out / "timeline.png"),
    }
    for folder in {path.parent for path in paths.values()}:
        remove_stale_temporaries(folder)  # what a killed run was writing there
    return paths


def write_outputs(
    schedule: Schedule, record: RunRecord, report: dict[str, Any], config: TrainConfig
) -> tuple[dict[str, str], list[SideOutput]]:
    """Write the Chrome trace, the timeline plot and the JSON record, each whole or not at all (``side_output``).

    The record is written last and lists, beside the run's failed saves, every output that could not be written
    (``output_failures``: these files', the log's).

    Returns:
        The paths written (and the newest checkpoint's), and the outputs that could not be written (each with
        its ``failure``: the path and the OS's reason).
    """
    try:
        paths = output_paths(config)  # checked again: a folder removed in the run is made again
    except UserError as exc:  # nothing can be written there now
        folder = SideOutput(config.logging.out)
        folder.failure = str(exc)
        return {}, [folder]
    outputs = {key: SideOutput(path) for key, path in paths.items()}
    outputs["trace"].attempt(lambda: write_atomic(paths["trace"], json.dumps(chrome_trace(schedule, record))))
    if outputs["plot"].attempt(lambda: _plot(schedule, record, report, paths["plot"])) is False:
        del outputs["plot"]  # no matplotlib: no plot, and nothing failed
    failed = [o for o in outputs.values() if o.failure is not None]
    lines = [line for line in (record.log_failure, *(o.failure for o in failed)) if line is not None]
    if lines:
        report = {**report, "output_failures": lines}
    outputs["json"].attempt(lambda: write_atomic(paths["json"], json.dumps(report, indent=2) + "\n"))
    failed = [o for o in outputs.values() if o.failure is not None]
    written = {key: str(paths[key]) for key, output in outputs.items() if output.failure is None}
    if record.config.checkpoint.save is not None:
        saved = newest(Path(record.config.checkpoint.save))
        if saved is not None:
            written["checkpoint"] = str(saved.folder)
    return written, failed


def _plot(schedule: Schedule, record: RunRecord, report: dict[str, Any], path: Path) -> bool:
    """Draw the measured timeline with ``pipeweave.sim.plot``, whole or not at all; False without matplotlib.

    Raises:
        OSError: the file could not be written.
    """
    if schedule.is_synchronous:
        last = window(record)  # the last step whose every action the record kept
        timeline = rebased(step_timeline(schedule, record, last - 1))
        what = "last step" if last == record.config.training.steps else f"step {last}"
    else:
        timeline, what = rebased(stream_timeline(schedule, record)), "stream"
    title = (
        f"{report['schedule']}  D={report['stages']}  T={report['microbatches']}  measured {what} (ms), "
        f"bubble {report['bubble_ratio']:.3f} (simulated {report['bubble_ratio_simulated']:.3f})"
    )
    try:
        with replacing(path) as tmp:
            plot_timeline(timeline, tmp, title=title)
    except ImportError:
        return False
    return True


def print_summary(report: dict[str, Any], paths: dict[str, str]) -> None:
    """The run's summary table (measured beside simulated), then what else the user should know, and the files."""
    console = Console()
    console.print(_summary_table(report))
    _print_notes(console, report)
    for kind, path in paths.items():
        console.print(f"{kind}: {path}")


def _summary_table(report: dict[str, Any]) -> Table:
    """The measures of the run beside the simulator's, one row each, and the memory of every rank."""
    losses = report["losses"]
    model = report["model"]["entry"] or report["model"]["kind"]
    grid = "".join(
        f"  {k}={report[key]}"
        for k, key in (("P", "data_parallel"), ("C", "context_parallel"), ("N", "tensor_parallel"))
        if report.get(key, 1) > 1
    )
    grid += " SP" if report.get("sequence_parallel") else ""
    if report.get("stage_replicas"):  # PipeDream's replicated parts, one process per replica (1F1B-RR)
        grid += f"  replicas {','.join(map(str, report['stage_replicas']))} (1F1B-RR)"
    table = Table(
        title=f"{report['schedule']}  D={report['stages']}{grid}  T={report['microbatches']}  "
        f"{model}  {report['steps']} steps  ({report['transport']}"
        f"{_autocast.get(report.get('precision', ''), '')})",
        show_header=True,
    )
    table.add_column("measure")
    table.add_column("measured", justify="right")
    table.add_column("simulated", justify="right")
    table.add_row("loss first -> last", f"{losses[0]:.4f} -> {losses[-1]:.4f}", "")
    evals = report.get("eval_losses")
    if evals:
        table.add_row(
            f"held-out loss (step {evals[0]['step']} -> {evals[-1]['step']})",
            f"{evals[0]['loss']:.4f} -> {evals[-1]['loss']:.4f}",
            "",
        )
    per = "step time" if "weight_bytes_simulated" not in report else "time per mini-batch"
    table.add_row(per, _ms(report["step_time_s"]), _ms(report["makespan_simulated_s"]))
    rate = f"{report['samples_per_s']:.1f} samples/s"
    if report.get("tokens_per_s"):
        rate += f"  ({report['tokens_per_s']:.0f} tokens/s)"
    table.add_row("throughput", rate, "")
    if "compile_s" in report:
        table.add_row("compile (first step over the rest)", f"{report['compile_s']:.2f} s", "")
    table.add_row("bubble ratio", f"{report['bubble_ratio']:.3f}", f"{report['bubble_ratio_simulated']:.3f}")
    table.add_row(
        "bubble ratio (flush)", f"{report['bubble_ratio_flush']:.3f}", f"{report['bubble_ratio_flush_simulated']:.3f}"
    )
    table.add_row("dispatch per action", f"{report['profiled_costs_s']['dispatch'] * 1e6:.0f} us", "")
    table.add_row("bubble, schedule alone", "", f"{report['bubble_ratio_simulated_no_dispatch']:.3f}")
    if "in_flight" in report:  # streams: the microbatches stage 0 admits (PipeDream's NOAM)
        replicas = (report.get("stage_replicas") or [1])[0]
        noam = f" (NOAM ceil({report['stages']}/{replicas}) = {report['noam']})" if "noam" in report else ""
        table.add_row(f"in flight at stage 0{noam}", str(report["in_flight"]), str(report["in_flight_simulated"]))
    for key, what in (("staleness", "staleness / stage"), ("tied_lag", "tied lag / stage")):
        if key in report:  # streams (runtime.report.stream_summary.staleness_figures), in updates
            table.add_row(what, "", " ".join(str(n) for n in report[key]))
    _memory_rows(table, report)
    return table


_autocast = {"bf16": ", bf16 autocast", "fp16": ", fp16 autocast, loss scaled"}
"""What the summary's title says of a run's precision."""


def _loss_scaling(record: RunRecord) -> dict[str, Any]:
    """``--precision fp16``: each step's loss scale and the steps whose gradients overflowed (``runtime.loss_scale``)."""
    if record.config.training.precision != "fp16" or not record.ranks:
        return {}
    return {"loss_scales": list(record.ranks[0].loss_scales), "overflow_steps": record.overflow_steps}


def _print_notes(console: Console, report: dict[str, Any]) -> None:
    """What else the user should know: time spent between streams, skipped updates, where a resumed run began."""
    if report.get("streams", 1) > 1:
        console.print(
            f"{report['streams']} streams, drained between them to evaluate or save: "
            f"{report['paused_s']:.2f} s spent there, not in the times above"
        )
    skipped = report.get("skipped_steps")
    if skipped:
        steps = ", ".join(str(k + 1) for k in skipped)
        console.print(
            f"skipped the update of {len(skipped)} of {report['steps']} steps (loss or gradient norm not "
            f"finite; --on-nonfinite skip): step {steps} of this run"
        )
    overflowed = report.get("overflow_steps")
    if overflowed:
        console.print(
            f"fp16: the gradients of {len(overflowed)} of {report['steps']} steps overflowed, their update skipped "
            f"and the loss scale lowered; the last step's scale: {report['loss_scales'][-1]:g}"
        )
    traced = report.get("traced_steps", report["steps"])
    if traced < report["steps"]:
        console.print(
            f"trace: steps 1-{traced} of {report['steps']} (bubble, dispatch and profiled costs over them; "
            f"losses, step time and throughput over every step; --trace-steps N)"
        )
    if report.get("first_step"):
        console.print(
            f"resumed after step {report['first_step']}: steps {report['first_step'] + 1}-"
            f"{report['first_step'] + report['steps']} of the training"
        )


def _memory_rows(table: Table, report: dict[str, Any]) -> None:
    """Per rank, the activation and weight bytes measured beside those estimated before the run and simulated."""
    simulated = report.get("weight_bytes_simulated")
    estimated = report.get("memory_estimate", {}).get("activations")
    tensors = report.get("peak_tensor_bytes") or [0] * len(report["weight_bytes"])
    for r, (act, weight) in enumerate(zip(report["peak_activation_bytes"], report["weight_bytes"])):
        predicted = ([f"act {_bytes(estimated[r])}"] if estimated else []) + (
            [f"weights {_bytes(simulated[r])}"] if simulated else []
        )
        peak = f"  peak {_bytes(tensors[r])}" if tensors[r] else ""  # the process's tensors (stage.tensor_bytes)
        peak += _cuda_peaks(report, r)
        table.add_row(f"rank {r} memory", f"act {_bytes(act)}  weights {_bytes(weight)}{peak}", "  ".join(predicted))


def _cuda_peaks(report: dict[str, Any], r: int) -> str:
    """Rank ``r``'s largest peak allocated and reserved bytes of a step, from the CUDA allocator (CUDA runs)."""
    allocated, reserved = report.get("cuda_peak_allocated_bytes"), report.get("cuda_peak_reserved_bytes")
    if not allocated or not allocated[r]:
        return ""
    return f"  cuda allocated {_bytes(max(allocated[r]))} reserved {_bytes(max(reserved[r]))}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _bytes(n: float) -> str:
    return format_bytes(n, 1)
