"""Convergence study: every synchronous and asynchronous schedule, same model, data order, optimizer and samples.

Each schedule trains through the reference executor (``run_reference``; an
asynchronous schedule runs as one stream of ``--steps`` mini-batches,
``runtime.stream``), deterministically, one thread. Every run sees mini-batch
m = the data source's batch m, so the curves are paired: a difference is the
schedule's, not the data's. Time is the survey's t_total = steps x t_bar with
t_bar the simulated time per mini-batch at f = b = w = 1, no communication:
a synchronous step's makespan (it ends in a flush), an asynchronous stream's
steady-state period (``runtime.report.stream_summary.minibatch_period`` on an 8-mini-batch stream).

    python benchmarks/convergence/study.py --task gpt          # the study (~10 min here)
    python benchmarks/convergence/study.py --task mlp          # the fast task (< 1 min)
    python benchmarks/convergence/study.py --task gpt --plot-only
    python benchmarks/convergence/study.py --task gpt --fast --seed 1   # another init and data order
    python benchmarks/convergence/study.py --task gpt --seeds 0 1 2     # vs sync per seed, from the results

Each run is ``pipeweave compare --convergence``'s (``pipeweave.commands.convergence.train_once``), so the
command and this study cannot drift apart: ``pipeweave compare --convergence 100 --model gpt --layers 6
--hidden 32 --heads 2 --seq-len 32`` gives the gpt rows of the README's table. Writes ``results_<task>.json``, ``loss_vs_samples_<task>.png``,
``loss_vs_time_<task>.png`` next to this file and prints the README's table.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from pipeweave.commands.compare_table import classify, seed_summary
from pipeweave.commands.convergence import ADAPTIVE_LR, Setting, final, schedule_for as approach_schedule, train_once
from pipeweave.models import ModelSpec
from pipeweave.runtime.report.stream_summary import minibatch_period
from pipeweave.schedule import SCHEDULES, generate
from pipeweave.sim import simulate

HERE = Path(__file__).parent
D, T = 4, 8  # T = 8 lets every synchronous schedule run at D = 4 (ZB-H2/ZB-V: T >= 2D-1; DualPipe: T >= 2D)
SKIP = ("zb-auto", "zb-v-auto")  # searched: same step as zb-h1/zb-v here, and their search costs minutes
# The training, the held-out evaluation and the convergence class are ``pipeweave compare --convergence``'s
# (``commands.convergence``, ``commands.compare_table.classify``): this script adds the control, the per-seed
# result files and the loss curves.


def task(spec: ModelSpec, batch_size: int, steps: int, lr: float) -> Setting:
    """A study task: ``pipeweave compare --convergence``'s setting at D = 4, T = 8, momentum 0.9."""
    return Setting(spec=spec, batch_size=batch_size, steps=steps, lr=lr, momentum=0.9, num_stages=D,
                   num_microbatches=T, num_chunks=2)


TASKS = {
    # The gpt (6 blocks: 8 layers, so the 2-chunk schedules have a layer per part) on the stdlib corpus.
    "gpt": task(ModelSpec(kind="gpt", layers=6, hidden=32, heads=2, seq_len=32), batch_size=16, steps=100, lr=0.3),
    # Fast tasks (--fast: 1f1b stands for the synchronous schedules, whose losses are all equal):
    # the residual mlp regressing fixed random targets (MSE), and a smaller gpt on fewer samples.
    "mlp": task(ModelSpec(kind="mlp", layers=8, hidden=16), batch_size=16, steps=40, lr=0.05),
    "gpt-small": task(ModelSpec(kind="gpt", layers=6, hidden=16, heads=2, seq_len=16), batch_size=16, steps=40,
                      lr=0.3),
}
# A control for the update count: PipeDream, SpecTrain and AMPNet update after every microbatch (T updates
# per mini-batch, each on 1/T of its gradient); the same stream on ONE stage has no delay at all, so it
# is synchronous training with an update per microbatch. Comparing with it separates staleness from frequency.
CONTROL = "control: 1 stage, update per microbatch"


def schedule_for(name: str, steps: int) -> Any:
    if name == CONTROL:
        return generate("pipedream", num_stages=1, num_microbatches=T, num_steps=steps)
    return approach_schedule(name, replace(TASKS["gpt"], steps=steps))


def time_per_minibatch(name: str) -> float:
    """t_bar at f = b = w = 1: makespan of a synchronous step, steady period of a stream (control: naive's)."""
    schedule = schedule_for("naive" if name == CONTROL else name, 8)
    timeline = simulate(schedule, check=False)
    if schedule.is_synchronous:
        return max(e.end for row in timeline.events for e in row) - min(row[0].start for row in timeline.events if row)
    return minibatch_period(timeline, T)


def run(task: Setting, name: str, seed: int = 0) -> dict[str, Any]:
    """One schedule's run (``commands.convergence.train_once``); ``seed`` sets the initialisation and data order."""
    started = time.perf_counter()
    schedule = schedule_for(name, task.steps)
    generated = time.perf_counter() - started
    result = train_once(schedule, task, seed)
    return {"schedule": name, "synchronous": schedule.is_synchronous and name != CONTROL, "losses": result["losses"],
            "eval_loss": result["eval_loss"], "t_bar": time_per_minibatch(name), "generate_s": generated,
            "wall_s": time.perf_counter() - started}


def table(results: list[dict[str, Any]]) -> str:
    """Final model loss (``evaluate``) and training loss (last 10 %) relative to synchronous training."""
    sync = [r for r in results if r["synchronous"]]
    base_eval = sum(r["eval_loss"] for r in sync) / len(sync)
    base_train = sum(final(r["losses"]) for r in sync) / len(sync)
    lines = ["| schedule | kind | final model loss | vs sync | training loss (last 10 %) | vs sync | t_bar | "
             "time to end | convergence |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in sorted(results, key=lambda r: (not r["synchronous"], r["eval_loss"])):
        rel = r["eval_loss"] / base_eval - 1
        f = final(r["losses"])
        kind = "control" if r["schedule"] == CONTROL else ("sync" if r["synchronous"] else "async")
        lines.append(f"| {r['schedule']} | {kind} | {r['eval_loss']:.4f} | "
                     f"{rel:+.2%} | {f:.4f} | {f / base_train - 1:+.2%} | {r['t_bar']:g} | "
                     f"{r['t_bar'] * len(r['losses']):g} | {classify(rel)} |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], task: str, task_spec: Setting) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(xs: list[float], k: int = 5) -> list[float]:
        return [sum(xs[max(0, i - k + 1): i + 1]) / len(xs[max(0, i - k + 1): i + 1]) for i in range(len(xs))]

    palette = plt.get_cmap("tab20").colors
    color = {r["schedule"]: palette[i % len(palette)] for i, r in enumerate(results)}
    sync_done = False
    for kind, xlabel in (("samples", "samples"), ("time", "simulated time (t_bar x mini-batches, f = b = w = 1)")):
        fig, ax = plt.subplots(figsize=(9, 5.5))
        for r in results:
            if r["synchronous"] and kind == "samples" and sync_done:
                continue  # synchronous curves coincide against samples: draw one
            label = "synchronous (all, identical)" if r["synchronous"] and kind == "samples" else r["schedule"]
            if r["schedule"] == CONTROL and kind == "time":
                continue  # not a pipeline schedule: no time of its own
            sync_done = sync_done or (r["synchronous"] and kind == "samples")
            n = len(r["losses"])
            xs = [(m + 1) * (task_spec.batch_size if kind == "samples" else r["t_bar"]) for m in range(n)]
            style = "-" if not r["synchronous"] else "--"
            c = "black" if r["synchronous"] and kind == "samples" else color[r["schedule"]]
            ax.plot(xs, smooth(r["losses"]), style, color=c, label=label, linewidth=1.4 if not r["synchronous"] else 1.0)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("mini-batch loss (moving average of 5)")
        ax.set_title(f"{task}: D={D}, T={T}, momentum SGD lr={task_spec.lr}, same data order")
        ax.legend(fontsize=7, ncol=2)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(HERE / f"loss_vs_{kind}_{task}.png", dpi=110)
        plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="gpt")
    parser.add_argument("--plot-only", action="store_true", help="redraw from results_<task>.json")
    parser.add_argument("--only", nargs="*", help="these schedules only (appended to existing results)")
    parser.add_argument("--fast", action="store_true", help="1f1b for the synchronous schedules (equal losses)")
    parser.add_argument("--seed", type=int, default=0, help="model initialisation and data order (default 0)")
    parser.add_argument("--seeds", nargs="+", type=int, help="print the per-seed table of these seeds' results")
    parser.add_argument("--optimizer", default="sgd", help="sgd (the task's lr, momentum 0.9) or an adaptive one of "
                        f"weights.optimizers at compare's lr {ADAPTIVE_LR:g}, no momentum (default sgd)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    task = with_optimizer(TASKS[args.task], args.optimizer)
    if args.seeds:
        print(seeds_table(args.task, args.seeds, args.optimizer))
        return
    path = results_path(args.task, args.seed, args.optimizer)
    results: list[dict[str, Any]] = json.loads(path.read_text())["runs"] if path.exists() else []
    if not args.plot_only:
        names = args.only or [n for n in SCHEDULES if n not in SKIP and (not args.fast or n == "1f1b"
                                                                       or not SCHEDULES[n].synchronous)] + [CONTROL]
        results = [r for r in results if r["schedule"] not in names]
        for name in names:
            r = run(task, name, args.seed)
            results.append(r)
            print(f"{name:18s} final {final(r['losses']):.4f}  wall {r['wall_s']:.1f} s "
                  f"(generate {r['generate_s']:.1f} s)", flush=True)
            path.write_text(json.dumps({"task": args.task, "D": D, "T": T, "seed": args.seed, "runs": results},
                                       indent=1))
    if args.seed == 0 and args.optimizer == "sgd":
        plot(results, args.task, task)
    print(table(results))


def with_optimizer(task: Setting, optimizer: str) -> Setting:
    """``task`` trained with ``optimizer``: SGD as the task says, any other as ``pipeweave compare
    --convergence`` trains its optimizer rows (``ADAPTIVE_LR``, no momentum: RMSprop's step is then its last
    gradient over its square average's root)."""
    if optimizer == "sgd":
        return task
    return replace(task, optimizer=optimizer, lr=ADAPTIVE_LR, momentum=0.0)


def results_path(task: str, seed: int, optimizer: str = "sgd") -> Path:
    name = task if optimizer == "sgd" else f"{task}_{optimizer}"
    return HERE / (f"results_{name}.json" if seed == 0 else f"results_{name}_seed{seed}.json")


def seeds_table(task: str, seeds: list[int], optimizer: str = "sgd") -> str:
    """Per schedule, its final model loss vs synchronous training of the same seed and optimizer, for each seed;
    their mean and spread (max - min) and the classes (``compare_table.seed_summary``)."""
    rel: dict[str, list[float]] = {}
    for seed in seeds:
        runs = json.loads(results_path(task, seed, optimizer).read_text())["runs"]
        sync = [r["eval_loss"] for r in runs if r["synchronous"]]
        base = sum(sync) / len(sync)
        for r in runs:
            if not r["synchronous"]:
                rel.setdefault(r["schedule"], []).append(r["eval_loss"] / base - 1)
    lines = [f"| schedule | vs sync, seeds {' / '.join(map(str, seeds))} | mean | spread | class per seed | "
             "class of the mean |", "|---|---|---:|---:|---|---|"]
    for name, values in sorted(rel.items(), key=lambda kv: sum(kv[1]) / len(kv[1])):
        if len(values) != len(seeds):
            continue
        summary = seed_summary(values)
        lines.append(f"| {name} | {' / '.join(f'{v:+.2%}' for v in values)} | {summary['mean']:+.2%} | "
                     f"{summary['spread']:.2%} | {' / '.join(summary['classes'])} | {summary['class']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
