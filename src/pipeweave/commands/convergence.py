"""``pipeweave compare --convergence``: each approach trained through the reference executor, same data and samples.

The method of ``benchmarks/convergence`` (whose ``study.py`` calls this module):
every approach trains the same model from the same initialisation on the same
mini-batches in the same order with the same momentum SGD, through
``runtime.reference.run_reference`` (every stage in one process, the
schedule's weight policy applied as the distributed runtime applies it;
deterministic, one thread); an asynchronous approach runs as one stream of
STEPS mini-batches. The trained weights (AvgPipe: its replicas' mean) are
evaluated on held-out batches, the same for every run; the class of each
approach's loss relative to synchronous training follows ``compare_table.classify``.

SpecTrain and XPipe predict weights along the optimizer's own next step
(XGrad), so each gains a row per optimizer of ``OPTIMIZER_ROWS``
(``spectrain+adam``, ...), trained with that optimizer (torch's defaults) at ``ADAPTIVE_LR`` and
compared with synchronous training under the same optimizer.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from pipeweave.commands.compare_table import seed_summary
from pipeweave.data import data_source
from pipeweave.errors import UserError
from pipeweave.models import ModelSpec
from pipeweave.models.build import build_layers
from pipeweave.models.spec import loss_fn
from pipeweave.runtime.reference import run_reference
from pipeweave.runtime.stream import stream_steps
from pipeweave.schedule import SCHEDULES, Schedule, generate
from pipeweave.weights.optimizers import build_optimizer

EVAL_SEED = 12345
"""The held-out batches' seed, the same for every run and seed."""
BASELINE = "1f1b"
"""Synchronous training, run as the baseline when no synchronous approach is compared."""
OPTIMIZER_ROWS = ("adam", "adamw", "rmsprop", "adabelief")
"""The optimizers of the rows of the approaches that predict weights (``WeightPolicy.predicts``; the approach's
own row trains with momentum SGD)."""
ADAPTIVE_LR = 3e-3
"""Their learning rate (train's default for them; ``--lr`` and ``--momentum`` are SGD's: RMSprop runs
without momentum, its step the last gradient over its square average's root)."""


@dataclass(frozen=True, kw_only=True)
class Setting:
    """What every approach of a convergence comparison shares."""

    spec: ModelSpec
    """The model (its seed is replaced by each run's)."""
    batch_size: int
    """Samples per mini-batch."""
    steps: int
    """Mini-batches trained."""
    lr: float
    """SGD learning rate."""
    momentum: float = 0.9
    """SGD momentum."""
    num_stages: int = 4
    """D."""
    num_microbatches: int = 8
    """T."""
    num_chunks: int = 2
    """v of the schedules that take it (interleaved-1f1b)."""
    optimizer: str = "sgd"
    """The optimizer (``weights.optimizers``); sgd with ``momentum`` at ``lr``."""


def schedule_for(name: str, setting: Setting) -> Schedule:
    """The approach's schedule: one synchronous step, or a stream of ``setting.steps`` mini-batches."""
    info = SCHEDULES[name]
    d, t = setting.num_stages, setting.num_microbatches
    if info.synchronous:
        return generate(
            name, num_stages=d, num_microbatches=t, num_chunks=setting.num_chunks if info.chunks is None else None
        )
    return generate(name, num_stages=d, num_microbatches=t, num_steps=stream_steps(name, setting.steps, {}))


def train_once(schedule: Schedule, setting: Setting, seed: int = 0) -> dict[str, Any]:
    """One run: per-mini-batch losses and the final held-out loss; ``seed`` sets the initialisation and data order."""
    task = replace(setting, spec=replace(setting.spec, seed=seed))
    result = run_reference(
        schedule,
        task.spec,
        steps=task.steps,
        batch_size=task.batch_size,
        seed=seed,
        optimizer_factory=lambda ps: build_optimizer(task.optimizer, ps, task.lr, task.momentum),
    )
    return {"losses": result.losses, "eval_loss": evaluate(task, final_parameters(result.stage_parameters))}


def final_parameters(stage_parameters: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The trained model: each parameter, averaged over the stages holding it (AvgPipe's replicas' mean)."""
    values: dict[str, list[torch.Tensor]] = {}
    for params in stage_parameters:
        for k, v in params.items():
            values.setdefault(k, []).append(v)
    return {k: torch.stack(v).mean(0) for k, v in values.items()}


@torch.no_grad()
def evaluate(setting: Setting, parameters: dict[str, torch.Tensor], batches: int = 4) -> float:
    """Mean loss of the final model: gpt on the corpus's held-out windows (``ByteCorpus.eval_batch``, never
    trained on), mlp on its one fixed batch (it memorises)."""
    spec = setting.spec
    model = torch.nn.ModuleDict({str(i): layer for i, layer in enumerate(build_layers(spec, range(spec.num_layers)))})
    for k, p in model.named_parameters():
        p.copy_(parameters[k])
    memorise = spec.kind == "mlp"
    source = data_source(spec, batch_size=setting.batch_size, seed=spec.seed if memorise else EVAL_SEED)
    batches = 1 if memorise else batches
    total = 0.0
    for m in range(batches):
        x, y = source.batch(m) if memorise else source.eval_batch(m)
        for layer in model.values():
            x = layer(x)
        total += float(loss_fn(spec)(x, y))
    return total / batches


def final(losses: list[float]) -> float:
    """The training loss at the end: the mean of the last 10 % (at least 5) of the mini-batch losses."""
    tail = max(5, len(losses) // 10)
    values = losses[-tail:]
    return sum(values) / len(values) if all(math.isfinite(v) for v in values) else math.inf


def relative(eval_losses: dict[str, float], synchronous: list[str]) -> dict[str, float]:
    """Each approach's final held-out loss over the synchronous approaches' mean, minus 1."""
    base = sum(eval_losses[n] for n in synchronous) / len(synchronous)
    return {name: loss / base - 1 for name, loss in eval_losses.items()}


def convergence_rows(rows: list[dict[str, Any]], args: argparse.Namespace, spec: ModelSpec) -> None:
    """Add each row's convergence columns: per seed its held-out and training loss, and the summary over seeds."""
    torch.set_num_threads(1)
    setting = Setting(
        spec=spec,
        batch_size=args.batch,
        steps=args.convergence,
        lr=args.lr,
        momentum=args.momentum,
        num_stages=args.stages,
        num_microbatches=args.microbatches,
        num_chunks=args.chunks,
    )
    rows.extend(optimizer_rows(rows))
    for optimizer in dict.fromkeys(r.get("optimizer", "sgd") for r in rows):
        group = [r for r in rows if r.get("optimizer", "sgd") == optimizer]
        task = setting if optimizer == "sgd" else replace(setting, optimizer=optimizer, lr=ADAPTIVE_LR, momentum=0.0)
        _fill(group, task, args.seeds)


def optimizer_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A row per optimizer of ``OPTIMIZER_ROWS`` for each predicting approach: its simulated columns, named
    ``<approach>+<optimizer>`` (its own measurement, if any, is the SGD row's and not copied)."""
    return [
        {
            **{k: v for k, v in row.items() if not k.startswith("measured")},
            "name": f"{row['name']}+{optimizer}",
            "approach": row["name"],
            "optimizer": optimizer,
        }
        for row in rows
        if "optimizer" not in row and _predicts(row["name"])
        for optimizer in OPTIMIZER_ROWS
    ]


def _predicts(name: str) -> bool:
    """Whether approach ``name`` predicts weights along the optimizer's next step (a row per optimizer each)."""
    if name not in SCHEDULES:
        return False
    try:
        return generate(name, num_stages=2, num_microbatches=4).policy.predicts
    except UserError:  # a schedule that has no D = 2 form predicts nothing here either
        return False


def _fill(rows: list[dict[str, Any]], setting: Setting, seeds: int) -> None:
    """The convergence columns of ``rows``, all trained with ``setting``'s optimizer, relative to synchronous
    training with it."""
    approach = {r["name"]: r.get("approach", r["name"]) for r in rows}
    names = list(approach)
    synchronous = [r["name"] for r in rows if r["synchronous"]] or [BASELINE]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in dict.fromkeys([*names, *synchronous])}
    first = setting.spec.seed
    for seed in range(first, first + seeds):
        for name in runs:
            runs[name].append(train_once(schedule_for(approach.get(name, name), setting), setting, seed))
    per_seed = [relative({n: r[k]["eval_loss"] for n, r in runs.items()}, synchronous) for k in range(seeds)]
    for row in rows:
        name = row["name"]
        summary = seed_summary([rel[name] for rel in per_seed])
        row.update(
            {
                "convergence_eval_loss": [r["eval_loss"] for r in runs[name]],
                "convergence_train_loss": [final(r["losses"]) for r in runs[name]],
                "convergence_relative": summary["relative"],
                "convergence_mean": summary["mean"],
                "convergence_spread": summary["spread"],
                "convergence_classes": summary["classes"],
                "convergence_unstable": summary["unstable"],
                "convergence_class": summary["class"],
            }
        )
