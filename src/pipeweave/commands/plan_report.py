"""What ``pipeweave plan`` prints: the table of the best configurations, their JSON, the plot, the explanation."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pipeweave.planner.costs import Cluster
from pipeweave.planner.evaluate import Result
from pipeweave.planner.explain import explain, memory_terms, time_terms
from pipeweave.planner.memory import GIB
from pipeweave.planner.profiled import ProfiledModel
from pipeweave.planner.runnable import command_line, refusal, train_command
from pipeweave.planner.search import AUTO_CELLS, Plan
from pipeweave.planner.split import split_label
from pipeweave.planner.unmodelled import not_modelled


def _split(r: Result) -> str:
    c = r.config
    extra = (f" CP{c.cp}" if c.cp > 1 else "") + (f" EP{c.ep}" if c.ep > 1 else "")
    return f"{c.tp}x{c.pp}x{c.dp}{extra}"


def _schedule(r: Result) -> str:
    c = r.config
    return f"{c.schedule} v={c.chunks}" if c.takes_chunks else c.schedule


def print_table(plan: Plan, cluster: Cluster, args: argparse.Namespace, *, top: int) -> None:
    """The best ``top`` configurations that fit, then one line on how the search went."""
    gpu, model = cluster.gpu, cluster.model
    size = f"{model.parameters / 1e9:.1f}B" if model.parameters >= 1e8 else f"{model.parameters / 1e6:.2f}M"
    title = f"{model.name} ({size}) on {args.gpus} x {gpu.name}, global batch {args.global_batch}"
    table = Table(title=title)
    for name in (
        "#",
        "TPxPPxDP",
        "schedule",
        "blocks/stage",
        "b",
        "T",
        "recompute",
        "ZeRO",
        "step s",
        "TFLOP/s/GPU",
        "MFU",
        "bubble",
        "memory GiB (state+act+allow)",
        "headroom GiB",
    ):
        table.add_column(name, justify="left" if name in ("schedule", "recompute") else "right")
    for k, r in enumerate(plan.best[:top], 1):
        m = r.memory
        state = m.state / GIB
        table.add_row(
            str(k),
            _split(r),
            _schedule(r),
            split_label(r.config.blocks),
            str(r.config.microbatch_size),
            str(r.config.microbatches),
            r.config.recompute,
            str(r.config.zero),
            f"{r.step_time:.4g}",
            f"{r.tflops_per_gpu:.3g}",
            f"{r.mfu:.3f}",
            f"{r.bubble_ratio:.3f}",
            f"{m.total / GIB:.1f} ({state:.1f}+{m.activations / GIB:.1f}+{m.allowance / GIB:.1f})",
            f"{(gpu.memory_bytes - m.total) / GIB:.1f}",
        )
    Console(width=200).print(table)
    print_commands(plan, cluster, args, top=top)
    print(
        f"searched {plan.candidates} configurations in {plan.seconds:.1f} s: {plan.too_big} cannot fit "
        f"(memory bound), {plan.bounded} cannot enter the top {top} (time bound), {plan.refused} shapes the "
        f"schedule refuses, {len(plan.results)} simulated ({plan.simulations} timelines), "
        f"{len(plan.results) - len(plan.best)} of them over {gpu.memory_bytes / GIB:.1f} GiB"
        + (
            f"; {plan.auto_skipped} zb-auto configurations not searched (8 searches at most, of D x v x T <= "
            f"{AUTO_CELLS} cells)"
            if plan.auto_skipped
            else ""
        )
    )
    if plan.unsettled:
        print(
            f"stopped at --time-limit: {plan.unsettled} configurations not simulated, none faster than "
            f"{plan.unsettled_bound:.4g} s a step (--time-limit 0 searches to the exact top)"
        )


def print_commands(plan: Plan, cluster: Cluster, args: argparse.Namespace, *, top: int) -> None:
    """Each row's ``pipeweave train`` command, by its number (``train_run``)."""
    print("each row's run, as pipeweave train runs it:")
    for k, r in enumerate(plan.best[:top], 1):
        command, refused = train_run(r, cluster, args)
        print(f"#{k} {command}" if command else f"#{k} not run by pipeweave train: {refused}")


def plan_json(plan: Plan, cluster: Cluster, args: argparse.Namespace, *, top: int) -> dict[str, Any]:
    """One object: the model, the GPU, how the search went, and every simulated configuration, best first."""
    gpu, model = cluster.gpu, cluster.model
    return {
        "model": _model_json(model),
        "gpu": {
            "name": gpu.name,
            "peak_tflops": gpu.peak_flops / 1e12,
            "memory_gib": gpu.memory_bytes / GIB,
            "gpus_per_node": gpu.gpus_per_node,
        },
        "gpus": args.gpus,
        "global_batch": args.global_batch,
        "search": {
            "candidates": plan.candidates,
            "too_big": plan.too_big,
            "bounded": plan.bounded,
            "refused": plan.refused,
            "simulations": plan.simulations,
            "seconds": plan.seconds,
            "auto_skipped": plan.auto_skipped,
            "unsettled": plan.unsettled,
            "unsettled_bound_s": plan.unsettled_bound if plan.unsettled else None,
            "top": top,
        },
        "configurations": [_row_json(r, cluster, args) for r in plan.results],
        "not_modelled": _not_modelled(plan, cluster),
    }


def train_run(r: Result, cluster: Cluster, args: argparse.Namespace) -> tuple[str | None, str | None]:
    """``(command, None)``: the ``pipeweave train`` line that runs ``r``'s configuration
    (``planner.runnable``); ``(None, reason)`` where train refuses it (a dimension fixed to such a value)."""
    reason = refusal(r.config, cluster.model, sequence_parallel=cluster.sequence_parallel)
    if reason is not None:
        return None, reason
    args_ = train_command(
        r.config,
        cluster.model,
        batch=args.global_batch,
        sequence_parallel=cluster.sequence_parallel,
        optimizer=cluster.state.optimizer,
    )
    return command_line(args_), None


def _row_json(r: Result, cluster: Cluster, args: argparse.Namespace) -> dict[str, Any]:
    """``Result.as_dict`` with the run: ``train_command`` (null where train refuses it) and ``refused_by_train``."""
    command, refused = train_run(r, cluster, args)
    return {**r.as_dict(), "train_command": command, "refused_by_train": refused}


def _model_json(model: Any) -> dict[str, Any]:
    """A GPT's shape, or a profiled model's layers and its scaling to the GPU (``planner.profiled``)."""
    if isinstance(model, ProfiledModel):
        return {
            "name": model.name,
            "layers": model.layers,
            "parameters": model.parameters,
            "profile_microbatch_size": model.profile_microbatch,
            "time_scale": model.scale,
        }
    return {
        "name": model.name,
        "layers": model.layers,
        "hidden": model.hidden,
        "heads": model.heads,
        "seq_len": model.seq_len,
        "vocab": model.vocab,
        "kv_heads": model.kv_heads,
        "ffn_hidden": model.ffn_hidden,
        "mlp": model.mlp,
        "attention": model.attention,
        "tied": model.tied,
        "parameters": model.parameters,
    }


def write_plot(plan: Plan, path: Path) -> None:
    """Step time against memory per GPU for every simulated configuration that fits, the Pareto front marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fits = plan.best
    front = pareto_front(fits)
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.scatter(
        [r.memory.total / GIB for r in fits],
        [r.step_time for r in fits],
        s=10,
        c="tab:blue",
        alpha=0.5,
        label="configurations that fit",
    )
    ax.plot(
        [r.memory.total / GIB for r in front], [r.step_time for r in front], "o-", c="tab:red", label="Pareto front"
    )
    shown = -1.0
    for r in front:  # label the front's points a few GiB apart, so that labels do not overlap
        if r.memory.total / GIB - shown >= 4:
            ax.annotate(
                f"{_split(r)} {_schedule(r)} b={r.config.microbatch_size}",
                (r.memory.total / GIB, r.step_time),
                fontsize=7,
                rotation=20,
            )
            shown = r.memory.total / GIB
    ax.set_yscale("log")
    ax.set_xlabel("memory per GPU (GiB)")
    ax.set_ylabel("predicted step time (s, log scale)")
    ax.set_title(f"{len(fits)} simulated configurations that fit (TP x PP x DP)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def pareto_front(results: list[Result]) -> list[Result]:
    """The configurations no other beats in both step time and memory, by memory."""
    front: list[Result] = []
    for r in sorted(results, key=lambda r: (r.memory.total, r.step_time)):
        if not front or r.step_time < front[-1].step_time:
            front.append(r)
    return front


def explain_lines(plan: Plan, cluster: Cluster) -> list[str]:
    """``explain``'s comparison, #1's memory term by term, and what the prediction leaves out."""
    lines = explain(plan.best)
    if plan.best:
        lines.append(time_terms(plan.best[0]))
        lines.append(memory_terms(plan.best[0], cluster.state))
    lines.append("not modelled for this run:")
    lines += [f"- {effect}" for effect in _not_modelled(plan, cluster)]
    return lines


def _not_modelled(plan: Plan, cluster: Cluster) -> list[str]:
    return not_modelled(cluster, plan.best[0].config if plan.best else None)
