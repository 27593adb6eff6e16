"""Checkpoints: training N steps equals training k, saving, and resuming for N - k, on any schedule.

Each case trains a tiny mlp straight through, then in two runs joined by a
checkpoint, the second on another schedule, stage count or partition than the
first; the losses of the second run must be the straight run's last ones and
the final parameters the straight run's. Bad ``--resume`` folders are one
line before anything is spawned.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from pipeweave.errors import UserError
from pipeweave.models import ModelSpec
from pipeweave.runtime.run import checkpoint
from pipeweave.runtime.run.config import TrainConfig
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.record import RunRecord
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.stage.post_validation import PostValidation
from pipeweave.runtime.run.plan import prepare

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

MLP = ModelSpec(kind="mlp", layers=6, hidden=8)
GPT = ModelSpec(kind="gpt", layers=2, hidden=16, heads=2, seq_len=8, tie_embeddings=True)
STEPS, FIRST = 5, 2


def _train(config: TrainConfig) -> RunRecord:
    schedule = prepare(config).schedule
    record = launch(run_rank, prepare(config), schedule.num_ranks, LaunchOptions(timeout_s=60))
    assert record is not None
    return record


def _parameters(record: RunRecord) -> dict[str, torch.Tensor]:
    return {name: value for r in record.ranks for params in r.parameters.values() for name, value in params.items()}


def _straight_and_resumed(tmp_path: Path, first: TrainConfig, second: TrainConfig) -> tuple[RunRecord, RunRecord]:
    straight = _train(dataclasses.replace(first, steps=STEPS, collect_parameters=True))
    _train(dataclasses.replace(first, steps=FIRST, save=str(tmp_path / "ckpt")))
    resumed = _train(dataclasses.replace(second, steps=STEPS - FIRST, resume=str(tmp_path / "ckpt"),
                                         collect_parameters=True))
    return straight, resumed


CASES = {
    # (first run, second run): the second changes schedule, stage count or partition
    "sgd-momentum cosine 1f1b D=2 -> zb-h1 D=3": (
        TrainConfig(schedule="1f1b", num_stages=2, num_microbatches=4, model=MLP, batch_size=7, momentum=0.9,
                    lr_schedule="cosine", lr_warmup=1, lr_decay_steps=STEPS),
        TrainConfig(schedule="zb-h1", num_stages=3, num_microbatches=4, model=MLP, batch_size=7, momentum=0.9,
                    lr_schedule="cosine", lr_warmup=1, lr_decay_steps=STEPS),
    ),
    "adamw interleaved -> 1f1b uneven parts": (
        TrainConfig(schedule="interleaved-1f1b", num_stages=2, num_chunks=2, num_microbatches=4, model=MLP,
                    batch_size=8, optimizer="adamw", lr=1e-2),
        TrainConfig(schedule="1f1b", num_stages=2, num_microbatches=4, model=MLP, batch_size=8, optimizer="adamw",
                    lr=1e-2, layers_per_part=(2, 4)),
    ),
    "replicated chimera -> gpipe": (
        TrainConfig(schedule="chimera", num_stages=2, num_microbatches=4, model=MLP, batch_size=8, momentum=0.5),
        TrainConfig(schedule="gpipe", num_stages=2, num_microbatches=4, model=MLP, batch_size=8, momentum=0.5),
    ),
    # the gpt's batches change with the step (the mlp's do not): the data must go on where it stopped
    "gpt tied 1f1b -> gpipe": (
        TrainConfig(schedule="1f1b", num_stages=2, num_microbatches=2, model=GPT, batch_size=4, optimizer="adamw",
                    lr=1e-2),
        TrainConfig(schedule="gpipe", num_stages=2, num_microbatches=2, model=GPT, batch_size=4, optimizer="adamw",
                    lr=1e-2),
    ),
    "post-validated adamw -> torch adamw": (
        TrainConfig(schedule="zb-h1", num_stages=2, num_microbatches=4, model=MLP, batch_size=8, optimizer="adamw",
                    lr=1e-2, post_validation=PostValidation(max_norm=1e9)),
        TrainConfig(schedule="zb-h1", num_stages=2, num_microbatches=4, model=MLP, batch_size=8, optimizer="adamw",
                    lr=1e-2),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_resumed_training_equals_straight_training(tmp_path: Path, case: str) -> None:
    first, second = CASES[case]
    straight, resumed = _straight_and_resumed(tmp_path, first, second)
    torch.testing.assert_close(resumed.losses, straight.losses[FIRST:], rtol=1e-5, atol=1e-6)
    want, got = _parameters(straight), _parameters(resumed)
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)


def test_resuming_from_a_checkpoint_is_not_training_from_scratch(tmp_path: Path) -> None:
    """The check above could pass by chance only if resuming did nothing; it must not equal a fresh start."""
    config = TrainConfig(schedule="1f1b", num_stages=2, num_microbatches=4, model=MLP, batch_size=8, momentum=0.9)
    fresh = _train(dataclasses.replace(config, steps=STEPS - FIRST))
    _train(dataclasses.replace(config, steps=FIRST, save=str(tmp_path / "ckpt")))
    resumed = _train(dataclasses.replace(config, steps=STEPS - FIRST, resume=str(tmp_path / "ckpt")))
    assert resumed.losses[0] < fresh.losses[0]
    meta = json.loads((tmp_path / "ckpt" / "meta.json").read_text())
    assert meta["steps"] == FIRST and meta["parts"] == [[0, 3], [3, 6]]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["meta.json", "part-000-step2.pt",
                                                                     "part-001-step2.pt"]
    state = torch.load(tmp_path / "ckpt" / "part-001-step2.pt", weights_only=True)
    assert set(state["optimizer"]["3.up.weight"]) == {"momentum_buffer"}


def test_a_bad_resume_is_one_line_before_spawning(tmp_path: Path) -> None:
    base = TrainConfig(schedule="1f1b", num_stages=2, num_microbatches=2, model=MLP, batch_size=4, steps=1)
    with pytest.raises(UserError, match="no checkpoint there"):
        prepare(dataclasses.replace(base, resume=str(tmp_path / "nothing")))
    _train(dataclasses.replace(base, save=str(tmp_path / "ckpt")))
    with pytest.raises(UserError, match=r"another model: hidden=8 \(this run 16\)"):
        prepare(dataclasses.replace(base, model=ModelSpec(kind="mlp", layers=6, hidden=16), resume=str(tmp_path / "ckpt")))
    with pytest.raises(UserError, match="give --optimizer sgd"):
        prepare(dataclasses.replace(base, optimizer="adamw", resume=str(tmp_path / "ckpt")))
    (tmp_path / "ckpt" / "part-001-step1.pt").unlink()
    with pytest.raises(UserError, match="lacks part-001-step1.pt"):
        prepare(dataclasses.replace(base, resume=str(tmp_path / "ckpt")))
    (tmp_path / "ckpt" / "meta.json").write_text("{}")
    with pytest.raises(UserError, match="not a pipeweave-checkpoint/1 checkpoint"):
        prepare(dataclasses.replace(base, resume=str(tmp_path / "ckpt")))


def test_a_new_checkpoint_replaces_the_old_one_only_once_whole(tmp_path: Path) -> None:
    config = TrainConfig(schedule="1f1b", num_stages=3, num_microbatches=3, model=MLP, batch_size=6, steps=1,
                         save=str(tmp_path / "ckpt"))
    _train(config)
    (tmp_path / "ckpt" / "part-000-step7.pt").write_bytes(b"a save that died half-way")
    prepare(dataclasses.replace(config, save=None, resume=str(tmp_path / "ckpt")))  # meta.json names step 1's parts
    _train(dataclasses.replace(config, num_stages=2, steps=2))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["meta.json", "part-000-step2.pt",
                                                                     "part-001-step2.pt"]
    assert checkpoint.read_meta(str(tmp_path / "ckpt"))["parts"] == [[0, 3], [3, 6]]


def _counting_saves(rank: int, world: int, config: TrainConfig) -> tuple[RunRecord | None, list[int]]:
    saved: list[int] = []
    real = checkpoint.save

    def save(*args: object, **kwargs: object) -> None:
        saved.append(int(args[-1]))  # type: ignore[call-overload]
        real(*args, **kwargs)  # type: ignore[arg-type]

    checkpoint.save = save  # type: ignore[assignment]  # this rank's process only
    return run_rank(rank, world, prepare(config)), saved


def test_save_every_writes_the_checkpoint_during_the_run(tmp_path: Path) -> None:
    config = TrainConfig(schedule="1f1b", num_stages=2, num_microbatches=2, model=MLP, batch_size=4, steps=5,
                         save=str(tmp_path / "ckpt"), save_every=2)
    prepare(config)
    _, saved = launch(_counting_saves, config, 2, LaunchOptions(timeout_s=60))
    assert saved == [2, 4, 5]
    assert checkpoint.read_meta(str(tmp_path / "ckpt"))["steps"] == 5
    with pytest.raises(UserError, match="--save-every 2 is invalid; give an integer >= 1 together with --save DIR"):
        dataclasses.replace(config, save=None)


def test_resuming_into_the_checkpoint_folder_itself(tmp_path: Path) -> None:
    """The run reads the checkpoint it resumes before it writes over it: its first step stays the checkpoint's."""
    config = TrainConfig(schedule="1f1b", num_stages=2, num_microbatches=4, model=MLP, batch_size=8, momentum=0.9,
                         lr_schedule="cosine", lr_warmup=1)
    straight = _train(dataclasses.replace(config, steps=STEPS))
    folder = str(tmp_path / "ckpt")
    _train(dataclasses.replace(config, steps=FIRST, save=folder, lr_decay_steps=STEPS))
    resumed = _train(dataclasses.replace(config, steps=STEPS - FIRST, resume=folder, save=folder))
    assert resumed.first_step == FIRST and checkpoint.read_meta(folder)["steps"] == STEPS
    torch.testing.assert_close(resumed.losses, straight.losses[FIRST:], rtol=1e-5, atol=1e-6)
