"""A diverging run stops before it costs the checkpoint, or skips the step (``--on-nonfinite``).

``pipeweave train`` at lr 1e6 stops with one line naming the step (exit code
1, every rank stopped); with ``--save-every 1`` the last good checkpoint
stays. Under ``skip`` the step whose mini-batch holds an infinite target
(``tests/models/poisoned.py``) changes nothing, bitwise -- parameters and
optimizer state, post-validated or not -- and the run equals the reference
executor's training without that batch. A checkpoint of non-finite weights
is refused, by every rank, naming the part.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from config_defaults import train_config

from pipeweave.config import TrainConfig
from pipeweave.data import DataSource, data_source
from pipeweave.errors import Diverged, UserError
from pipeweave.models import ModelSpec
from pipeweave.models.boundary import Boundary
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.reference import run_reference
from pipeweave.runtime.run import checkpoint, checkpoint_files
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, RankFailure, launch
from pipeweave.runtime.run.prepare import optimizer_factory, prepare
from pipeweave.runtime.run.record import RunRecord
from pipeweave.runtime.run.workers import build_workers
from pipeweave.runtime.stage.post_validation import PostValidation

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

POISONED = ModelSpec(kind="custom", entry=f"{Path(__file__).resolve().parent.parent / 'models' / 'poisoned.py'}:model")
BATCH = 8
DIVERGING = (
    "--model",
    "mlp",
    "--layers",
    "4",
    "--hidden",
    "32",
    "--batch",
    "16",
    "--steps",
    "4",
    "--lr",
    "1e6",
    "--quiet",
)


def _cli(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeweave.cli", "train", *argv, "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=tmp_path,
    )


def test_a_nan_loss_stops_the_run_with_one_line(tmp_path: Path) -> None:
    run = _cli(tmp_path, *DIVERGING, "--save", "ck")
    assert run.returncode == 1, run.stderr
    assert run.stderr.splitlines() == [
        "pipeweave: the loss is nan at step 3 (of this run; step 3 of the training); no checkpoint of non-finite "
        "weights was written; lower --lr or use --clip-grad-norm"
    ]
    assert checkpoint_files.checkpoints(tmp_path / "ck") == [] and not (tmp_path / "out" / "train.json").exists()


def test_with_save_every_the_last_good_checkpoint_survives(
    tmp_path: Path, checkpoint_tensors: Callable[[Path], dict[str, torch.Tensor]]
) -> None:
    run = _cli(tmp_path, *DIVERGING, "--save", "ck", "--save-every", "1")
    assert run.returncode == 1, run.stderr
    [line] = run.stderr.splitlines()
    # the loss of step 2 is finite (about 1e29); its update is not: the save after it is refused
    assert line.startswith("pipeweave: the weights of part 0 (layers 0-1)") and "after step 2 of the training" in line
    assert "(ck holds step 1)" in line
    kept = checkpoint_files.checkpoints(tmp_path / "ck")
    assert [c.steps for c in kept] == [1]  # step 1's, and no other: step 2's was refused
    assert not [p for p in (tmp_path / "ck").iterdir() if p.name.startswith(".tmp-")]  # nothing half-written
    parameters = [v for k, v in checkpoint_tensors(kept[0].folder).items() if k.startswith("parameters/")]
    assert parameters and all(torch.isfinite(p).all() for p in parameters)


def poisoned_steps(batch_size: int, steps: int) -> list[int]:
    """The steps (0-based) whose mini-batch holds the poisoned model's infinite target."""
    source = data_source(POISONED, batch_size=batch_size)
    return [k for k in range(steps) if not bool(torch.isfinite(source.batch(k)[1]).all())]


def _config(**changes: Any) -> TrainConfig:
    base = train_config(
        schedule="zb-h1",
        num_stages=2,
        num_microbatches=4,
        model=POISONED,
        batch_size=BATCH,
        optimizer="adamw",
        lr=1e-2,
        collect_parameters=True,
        on_nonfinite="skip",
    )
    return dataclasses.replace(base, **changes)


def _run_all(context: RankContext, configs: list[TrainConfig]) -> list[RunRecord | None]:
    return [run_rank(context, prepare(c)) for c in configs]


def _parameters(record: RunRecord) -> dict[str, torch.Tensor]:
    return {name: value for r in record.ranks for params in r.parameters.values() for name, value in params.items()}


class _Without:
    """A data source without mini-batch ``skipped``: the batches after it move up by one."""

    def __init__(self, source: DataSource, skipped: int) -> None:
        self.source, self.skipped = source, skipped

    def batch(self, step: int) -> tuple[Boundary, Boundary]:
        return self.source.batch(step if step < self.skipped else step + 1)


@pytest.mark.parametrize("schedule", ["zb-h1", "chimera"])  # chimera: replicated parts, a loss on both ranks
def test_a_skipped_step_equals_training_without_its_batch(one_thread: None, schedule: str) -> None:
    steps = 3
    [k] = poisoned_steps(BATCH, steps)
    assert 0 < k < steps - 1  # trained before and after it
    config = _config(steps=steps, schedule=schedule)
    [record] = launch(_run_all, [config], 2, LaunchOptions(timeout_s=60))
    assert record is not None and record.skipped_steps == [k] and math.isinf(record.losses[k])
    plan = prepare(config)
    reference = run_reference(
        plan.schedule,
        POISONED,
        steps=steps - 1,
        batch_size=BATCH,
        parts=list(plan.parts),
        optimizer_factory=optimizer_factory(config),
        data=_Without(data_source(POISONED, batch_size=BATCH), k),
    )
    assert record.losses[:k] + record.losses[k + 1 :] == pytest.approx(reference.losses, rel=1e-6)
    got = _parameters(record)
    assert set(got) == set(reference.parameters)
    for name, value in reference.parameters.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("post_validated", [False, True], ids=["torch-adamw", "post-validated-adamw"])
def test_a_skipped_update_leaves_weights_and_optimizer_state_bitwise(
    tmp_path: Path, post_validated: bool, checkpoint_tensors: Callable[[Path], dict[str, torch.Tensor]]
) -> None:
    [k] = poisoned_steps(BATCH, 2)
    options = PostValidation(max_norm=1.0) if post_validated else None
    before = _config(steps=k, save=str(tmp_path / "before"), post_validation=options)
    after = _config(steps=k + 1, save=str(tmp_path / "after"), post_validation=options)
    records = launch(_run_all, [before, after], 2, LaunchOptions(timeout_s=60))
    assert records[1].skipped_steps == [k] and records[0].skipped_steps == []
    old, new = (
        checkpoint_tensors(_newest(tmp_path / "before", k)),
        checkpoint_tensors(_newest(tmp_path / "after", k + 1)),
    )
    assert old.keys() == new.keys() and any(key.startswith("optimizer/") for key in old)
    for key, value in old.items():  # parameters, and the optimizer's state (steps included)
        assert torch.equal(new[key], value), key


def test_a_nonfinite_gradient_norm_stops_a_post_validated_run() -> None:
    mlp = ModelSpec(kind="mlp", layers=4, hidden=8)
    config = train_config(
        schedule="zb-h1",
        num_stages=2,
        num_microbatches=4,
        model=mlp,
        batch_size=8,
        steps=3,
        post_validation=PostValidation(max_norm=1.0, fault=(1, 1)),
    )  # a NaN gradient at step 2
    with pytest.raises(RankFailure) as failure:
        launch(run_rank, prepare(config), 2, LaunchOptions(timeout_s=60, quiet_errors=True))
    assert failure.value.cause == (
        "the gradient norm is nan at step 2 (of this run; step 2 of the training); no "
        "checkpoint of non-finite weights was written; lower --lr or --clip-grad-norm, "
        "or give --on-nonfinite skip"
    )


def test_an_asynchronous_run_stops_at_its_drain_and_cannot_skip(tmp_path: Path) -> None:
    config = train_config(
        schedule="pipedream",
        num_stages=2,
        num_microbatches=4,
        model=ModelSpec(kind="mlp", layers=4, hidden=32),
        batch_size=16,
        steps=4,
        lr=1e6,
        save=str(tmp_path / "ck"),
        save_every=2,
    )
    with pytest.raises(RankFailure, match=r"^the loss is nan at step 1 \(of this run; step 1 of the training\)"):
        launch(run_rank, prepare(config), 2, LaunchOptions(timeout_s=60, quiet_errors=True))
    assert checkpoint_files.checkpoints(tmp_path / "ck") == []
    with pytest.raises(UserError, match="--on-nonfinite skip applies to synchronous schedules; pipedream is"):
        prepare(dataclasses.replace(config, on_nonfinite="skip"))


def _save_twice(context: RankContext, folder: str) -> str:
    """Save a checkpoint, make one parameter of rank 1's part infinite, save again: what the second save says."""
    rank = context.process
    mlp = ModelSpec(kind="mlp", layers=6, hidden=8)
    plan = prepare(
        train_config(schedule="1f1b", num_stages=2, num_microbatches=2, model=mlp, batch_size=4, save=folder)
    )
    workers, placement = build_workers(plan, rank, torch.device("cpu")), plan.schedule.placement
    checkpoint.save(plan.config, plan.parts, placement, workers, 1)
    if rank == 1:
        with torch.no_grad():
            next(iter(workers[1].module.parameters())).view(-1)[0] = math.inf
    try:
        checkpoint.save(plan.config, plan.parts, placement, workers, 2)
    except Diverged as exc:
        return str(exc)
    return "saved"


def test_a_checkpoint_of_nonfinite_weights_is_refused_on_every_rank(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    said = launch(_save_twice, str(folder), 2, LaunchOptions(timeout_s=60))  # rank 0's part is finite: it refuses too
    assert said == (
        f"the weights of part 1 (layers 3-5) are not finite after step 2 of the training; no checkpoint "
        f"of non-finite weights was written ({folder} holds step 1); lower --lr or use --clip-grad-norm"
    )
    assert [c.steps for c in checkpoint_files.checkpoints(folder)] == [1]  # step 1's, step 2's refused
    assert not [p for p in folder.iterdir() if p.name.startswith(".tmp-")]  # nothing half-written


def _newest(root: Path, steps: int) -> Path:
    """The folder of the newest checkpoint in ``root``, checked to hold ``steps`` steps."""
    newest = checkpoint_files.newest(root)
    assert newest is not None and newest.steps == steps
    return newest.folder
