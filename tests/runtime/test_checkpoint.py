"""Checkpoints: training N steps equals training k, saving, and resuming for N - k, on any schedule.

Each case trains a tiny mlp straight through, then in two runs joined by a
checkpoint, the second on another schedule, stage count or partition than the
first; the losses of the second run must be the straight run's last ones and
the final parameters the straight run's. Bad ``--resume`` folders are one
line before anything is spawned.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from config_defaults import train_config

from pipeweave.config import TrainConfig
from pipeweave.errors import UserError
from pipeweave.models import ModelSpec
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.run import checkpoint, checkpoint_files, checkpoint_state
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import prepare
from pipeweave.runtime.run.record import RunRecord
from pipeweave.runtime.stage.post_validation import PostValidation
from pipeweave.runtime.stage.worker import StageWorker

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

MLP = ModelSpec(kind="mlp", layers=6, hidden=8)
GPT = ModelSpec(kind="gpt", layers=2, hidden=16, heads=2, seq_len=8, tie_embeddings=True)
STEPS, FIRST = 5, 2


def _train(config: TrainConfig) -> RunRecord:
    plan = prepare(config)
    record = launch(run_rank, plan, plan.num_processes, LaunchOptions(timeout_s=120))
    assert record is not None
    return record


def _parameters(record: RunRecord) -> dict[str, torch.Tensor]:
    return {name: value for r in record.ranks for params in r.parameters.values() for name, value in params.items()}


def _straight_and_resumed(tmp_path: Path, first: TrainConfig, second: TrainConfig) -> tuple[RunRecord, RunRecord]:
    straight = _train(dataclasses.replace(first, steps=STEPS, collect_parameters=True))
    _train(dataclasses.replace(first, steps=FIRST, save=str(tmp_path / "ckpt")))
    resumed = _train(
        dataclasses.replace(second, steps=STEPS - FIRST, resume=str(tmp_path / "ckpt"), collect_parameters=True)
    )
    return straight, resumed


CASES = {
    # (first run, second run): the second changes schedule, stage count or partition
    "sgd-momentum cosine 1f1b D=2 -> zb-h1 D=3": (
        train_config(
            schedule="1f1b",
            num_stages=2,
            num_microbatches=4,
            model=MLP,
            batch_size=7,
            momentum=0.9,
            lr_schedule="cosine",
            lr_warmup=1,
            lr_decay_steps=STEPS,
        ),
        train_config(
            schedule="zb-h1",
            num_stages=3,
            num_microbatches=4,
            model=MLP,
            batch_size=7,
            momentum=0.9,
            lr_schedule="cosine",
            lr_warmup=1,
            lr_decay_steps=STEPS,
        ),
    ),
    "adamw interleaved -> 1f1b uneven parts": (
        train_config(
            schedule="interleaved-1f1b",
            num_stages=2,
            num_chunks=2,
            num_microbatches=4,
            model=MLP,
            batch_size=8,
            optimizer="adamw",
            lr=1e-2,
        ),
        train_config(
            schedule="1f1b",
            num_stages=2,
            num_microbatches=4,
            model=MLP,
            batch_size=8,
            optimizer="adamw",
            lr=1e-2,
            layers_per_part=(2, 4),
        ),
    ),
    "replicated chimera -> gpipe": (
        train_config(schedule="chimera", num_stages=2, num_microbatches=4, model=MLP, batch_size=8, momentum=0.5),
        train_config(schedule="gpipe", num_stages=2, num_microbatches=4, model=MLP, batch_size=8, momentum=0.5),
    ),
    # the gpt's batches change with the step (the mlp's do not): the data must go on where it stopped
    "gpt tied 1f1b -> gpipe": (
        train_config(
            schedule="1f1b", num_stages=2, num_microbatches=2, model=GPT, batch_size=4, optimizer="adamw", lr=1e-2
        ),
        train_config(
            schedule="gpipe", num_stages=2, num_microbatches=2, model=GPT, batch_size=4, optimizer="adamw", lr=1e-2
        ),
    ),
    "post-validated adamw -> torch adamw": (
        train_config(
            schedule="zb-h1",
            num_stages=2,
            num_microbatches=4,
            model=MLP,
            batch_size=8,
            optimizer="adamw",
            lr=1e-2,
            post_validation=PostValidation(max_norm=1e9),
        ),
        train_config(
            schedule="zb-h1", num_stages=2, num_microbatches=4, model=MLP, batch_size=8, optimizer="adamw", lr=1e-2
        ),
    ),
}


def _optimizer_case(optimizer: str, first: tuple[str, int], second: tuple[str, int], **fields: object):
    """(first run, second run) with ``optimizer``, each a (schedule, stages)."""
    common = dict(num_microbatches=4, model=MLP, batch_size=8, optimizer=optimizer, **fields)
    return tuple(train_config(schedule=name, num_stages=d, **common) for name, d in (first, second))


# each optimizer's state goes on exactly: RMSprop's square average (and last gradient), AdaBelief's belief
CASES["rmsprop 1f1b -> gpipe"] = _optimizer_case("rmsprop", ("1f1b", 2), ("gpipe", 2), lr=1e-2)
CASES["adabelief 1f1b D=2 -> zb-h1 D=3"] = _optimizer_case("adabelief", ("1f1b", 2), ("zb-h1", 3), lr=1e-2)
CASES["nesterov gpipe -> 1f1b"] = _optimizer_case("nesterov", ("gpipe", 2), ("1f1b", 2), momentum=0.9)


@pytest.mark.parametrize("case", list(CASES))
def test_resumed_training_equals_straight_training(tmp_path: Path, case: str) -> None:
    first, second = CASES[case]
    straight, resumed = _straight_and_resumed(tmp_path, first, second)
    torch.testing.assert_close(resumed.losses, straight.losses[FIRST:], rtol=1e-5, atol=1e-6)
    want, got = _parameters(straight), _parameters(resumed)
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)


def test_resuming_from_a_checkpoint_is_not_training_from_scratch(
    tmp_path: Path, checkpoint_tensors: Callable[[Path], dict[str, torch.Tensor]]
) -> None:
    """The check above could pass by chance only if resuming did nothing; it must not equal a fresh start."""
    config = train_config(schedule="1f1b", num_stages=2, num_microbatches=4, model=MLP, batch_size=8, momentum=0.9)
    fresh = _train(dataclasses.replace(config, steps=STEPS - FIRST))
    _train(dataclasses.replace(config, steps=FIRST, save=str(tmp_path / "ckpt")))
    resumed = _train(dataclasses.replace(config, steps=STEPS - FIRST, resume=str(tmp_path / "ckpt")))
    assert resumed.losses[0] < fresh.losses[0]
    saved = tmp_path / "ckpt" / "step-000002"
    meta = json.loads((saved / "manifest.json").read_text())
    assert meta["steps"] == FIRST and meta["parts"] == [[0, 3], [3, 6]]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest", "step-000002"]
    assert (tmp_path / "ckpt" / "latest").read_text() == "step-000002\n"
    files = [".metadata", "__0_0.distcp", "__1_0.distcp"]  # DCP's index, and one data file per rank
    assert sorted(p.name for p in saved.iterdir()) == [*files, "manifest.json"]
    assert [(f["name"], f["bytes"], f["sha256"]) for f in meta["files"]] == [
        (p.name, p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest()) for p in (saved / f for f in files)
    ]
    state = checkpoint_tensors(saved)
    assert {k for k in state if k.startswith("optimizer/3.up.weight/")} == {"optimizer/3.up.weight/momentum_buffer"}


def test_a_bad_resume_is_one_line_before_spawning(tmp_path: Path) -> None:
    base = train_config(schedule="1f1b", num_stages=2, num_microbatches=2, model=MLP, batch_size=4, steps=1)
    with pytest.raises(UserError, match="no checkpoint there"):
        prepare(dataclasses.replace(base, resume=str(tmp_path / "nothing")))
    _train(dataclasses.replace(base, save=str(tmp_path / "ckpt")))
    with pytest.raises(UserError, match=r"another model: hidden=8 \(this run 16\)"):
        prepare(
            dataclasses.replace(base, model=ModelSpec(kind="mlp", layers=6, hidden=16), resume=str(tmp_path / "ckpt"))
        )
    with pytest.raises(UserError, match="give --optimizer sgd"):
        prepare(dataclasses.replace(base, optimizer="adamw", resume=str(tmp_path / "ckpt")))
    reseeded = train_config(
        schedule="1f1b", num_stages=2, num_microbatches=2, model=dataclasses.replace(MLP, seed=3), batch_size=4, steps=1
    )
    with pytest.raises(UserError, match=r"run with --data-seed 0 and this run has --data-seed 3 .*give --data-seed 0"):
        prepare(dataclasses.replace(reseeded, resume=str(tmp_path / "ckpt")))  # the data seed follows the model's
    with pytest.raises(UserError, match=r"run with --batch 4 and this run has --batch 8 .*; give --batch 4$"):
        prepare(base.replace(batch_size=8, resume=str(tmp_path / "ckpt")))
    prepare(reseeded.replace(data_seed=0, resume=str(tmp_path / "ckpt")))  # the same data: resumes
    (tmp_path / "ckpt" / "step-000001" / "__1_0.distcp").unlink()
    with pytest.raises(
        UserError,
        match=r"step-000001/__1_0.distcp is missing \(its manifest names it\); no "
        "earlier checkpoint is kept",
    ):
        prepare(dataclasses.replace(base, resume=str(tmp_path / "ckpt")))
    (tmp_path / "ckpt" / "step-000001" / "manifest.json").write_text("{}")
    with pytest.raises(UserError, match="step-000001/manifest.json is missing or unreadable"):
        prepare(dataclasses.replace(base, resume=str(tmp_path / "ckpt")))
    with pytest.raises(
        UserError, match=r"manifest.json is unreadable or not a pipeweave-checkpoint/3 \(or /2\) manifest"
    ):
        prepare(dataclasses.replace(base, resume=str(tmp_path / "ckpt" / "step-000001")))


def test_a_new_checkpoint_replaces_the_old_one_only_once_whole(tmp_path: Path) -> None:
    """A save that died half-way (its staging folder) is no checkpoint: resuming passes it over, the next save
    clears it; the newest --keep-checkpoints of the run are kept, the older ones go, the user's files stay."""
    config = train_config(
        schedule="1f1b", num_stages=3, num_microbatches=3, model=MLP, batch_size=6, steps=1, save=str(tmp_path / "ckpt")
    )
    _train(config)
    died = tmp_path / "ckpt" / ".tmp-step-000007"
    died.mkdir()
    (died / "__0_0.distcp").write_bytes(b"a save that died half-way")
    (died / ".metadata.tmp").write_bytes(b"its index, never renamed")
    (tmp_path / "ckpt" / "notes.txt").write_text("mine")
    resumed = dataclasses.replace(config, resume=str(tmp_path / "ckpt"), num_stages=2, steps=3, save_every=1)
    assert prepare(resumed).steps_done == 1  # step 1's checkpoint, not the half-written one
    _train(resumed)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "latest",
        "notes.txt",
        "step-000003",
        "step-000004",
    ]
    assert checkpoint_files.find(str(tmp_path / "ckpt")).manifest["parts"] == [[0, 3], [3, 6]]
    assert checkpoint_files.find(str(tmp_path / "ckpt")).steps == 4


def _counting_saves(context: RankContext, config: TrainConfig) -> tuple[RunRecord | None, list[int]]:
    saved: list[int] = []
    real = checkpoint.save

    def save(*args: object, **kwargs: object) -> None:
        saved.append(int(args[-1]))  # type: ignore[call-overload]
        real(*args, **kwargs)  # type: ignore[arg-type]

    checkpoint.save = save  # type: ignore[assignment]  # this rank's process only
    return run_rank(context, prepare(config)), saved


def test_save_every_writes_the_checkpoint_during_the_run(tmp_path: Path) -> None:
    config = train_config(
        schedule="1f1b",
        num_stages=2,
        num_microbatches=2,
        model=MLP,
        batch_size=4,
        steps=5,
        save=str(tmp_path / "ckpt"),
        save_every=2,
    )
    prepare(config)
    _, saved = launch(_counting_saves, config, 2, LaunchOptions(timeout_s=60))
    assert saved == [2, 4, 5]
    assert checkpoint_files.find(str(tmp_path / "ckpt")).steps == 5
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest", "step-000004", "step-000005"]
    with pytest.raises(UserError, match="--save-every 2 is invalid; give an integer >= 1 together with --save DIR"):
        dataclasses.replace(config, save=None)


def test_resuming_into_the_checkpoint_folder_itself(tmp_path: Path) -> None:
    """The run reads the checkpoint it resumes before it writes over it: its first step stays the checkpoint's."""
    config = train_config(
        schedule="1f1b",
        num_stages=2,
        num_microbatches=4,
        model=MLP,
        batch_size=8,
        momentum=0.9,
        lr_schedule="cosine",
        lr_warmup=1,
    )
    straight = _train(dataclasses.replace(config, steps=STEPS))
    folder = str(tmp_path / "ckpt")
    _train(dataclasses.replace(config, steps=FIRST, save=folder, lr_decay_steps=STEPS))
    resumed = _train(dataclasses.replace(config, steps=STEPS - FIRST, resume=folder, save=folder))
    assert resumed.first_step == FIRST and checkpoint_files.find(folder).steps == STEPS
    torch.testing.assert_close(resumed.losses, straight.losses[FIRST:], rtol=1e-5, atol=1e-6)


def test_a_data_parallel_checkpoint_resumes_on_other_grids_and_holds_one_copy(tmp_path: Path) -> None:
    """Issue 18's DCP round trip, without tensor parallelism: saved at P=2, D=2 (4 ranks, 1f1b), resumed at
    P=1, D=4 on zb-h1, at P=1, D=2 on interleaved 1F1B and at P=2, D=2 on GPipe; each goes on as the
    uninterrupted run did (rtol 1e-5, atol 1e-6: float32 sums in another order). The
    replicas saved the same keys on two ranks each: DCP wrote each once, so the P=2 checkpoint is the size of
    the P=1 one (without the deduplication it would be twice that)."""
    mlp = ModelSpec(kind="mlp", layers=8, hidden=32)
    base = train_config(
        schedule="1f1b",
        num_stages=2,
        data_parallel=2,
        num_microbatches=2,
        model=mlp,
        batch_size=8,
        optimizer="adamw",
        lr=1e-2,
        keep_checkpoints=3,
    )
    ck, again = tmp_path / "p2", tmp_path / "p1"
    straight = _train(dataclasses.replace(base, steps=STEPS, save=str(ck), save_every=FIRST, collect_parameters=True))
    others = [
        base.replace(schedule="zb-h1", num_stages=4, data_parallel=1, num_microbatches=4),
        base.replace(schedule="interleaved-1f1b", num_chunks=2, data_parallel=1, num_microbatches=4, save=str(again)),
        base.replace(schedule="gpipe"),
    ]  # into replicas again: each reads the same keys
    for other in others:
        resumed = _train(
            dataclasses.replace(other, steps=STEPS - FIRST, resume=str(ck / "step-000002"), collect_parameters=True)
        )
        torch.testing.assert_close(resumed.losses, straight.losses[FIRST:], rtol=1e-5, atol=1e-6)
        want, got = _parameters(straight), _parameters(resumed)
        assert set(got) == set(want)
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)
    p2, p1 = ([p.stat().st_size for p in (folder / "step-000005").glob("*.distcp")] for folder in (ck, again))
    assert len(p2) == 4 and len(p1) == 2  # every rank wrote a share
    assert abs(sum(p2) - sum(p1)) < 0.02 * sum(p1), (p2, p1)


def test_a_rank_asks_the_checkpoint_for_the_keys_of_its_own_layers_only() -> None:
    whole = StageWorker(MLP, range(0, 6), batch_size=8)
    saved = {key: (value.shape, value.dtype) for key, value in checkpoint_state.stage_state(whole).items()}
    for name, p in whole.named_parameters().items():  # AdamW's state, as torch.optim names it
        saved.update(
            {f"optimizer/{name}/exp_avg": (p.shape, p.dtype), f"optimizer/{name}/step": (torch.Size([]), torch.float32)}
        )
    middle = {1: StageWorker(MLP, range(2, 4), batch_size=8)}
    wanted = checkpoint_state.destinations(saved, middle, "ck")
    assert {key.split("/")[1].split(".")[0] for key in wanted} == {"2", "3"}
    assert {key for key in wanted if "3.up.weight" in key} == {
        "parameters/3.up.weight",
        "optimizer/3.up.weight/exp_avg",
        "optimizer/3.up.weight/step",
    }
    assert all(wanted[key].shape == saved[key][0] for key in wanted)
    saved["parameters/3.up.weight"] = (torch.Size([2, 2]), torch.float32)  # a model changed since it was saved
    with pytest.raises(
        UserError,
        match=r"--resume ck holds parameters/3.up.weight of shape \[2, 2\] and this "
        r"model's is \[\d+, 8\]; resume with the model it was saved with",
    ):
        checkpoint_state.destinations(saved, middle, "ck")


def test_a_checkpoint_resumes_across_tensor_parallel_degrees_and_zero(tmp_path: Path) -> None:
    """Issue 18's DCP round trip: saved at P=2, D=2, N=1 (1f1b, ZeRO-1: the optimizer state sharded over the
    replicas), resumed at P=1, D=2, N=2 (zb-h1: the layers split over two processes) and at P=1, D=4, N=1
    (interleaved); a checkpoint saved with N=2 resumes at N=1 too. Each goes on as the uninterrupted run did
    (rtol 1e-5, atol 1e-6). Shards are saved whole (gathered from their group, written once)."""
    gpt = ModelSpec(kind="gpt", layers=2, hidden=16, heads=4, seq_len=8)
    base = train_config(
        schedule="1f1b",
        num_stages=2,
        data_parallel=2,
        num_microbatches=2,
        model=gpt,
        batch_size=8,
        optimizer="sgd",
        momentum=0.9,
        lr=0.05,
        zero=1,
        keep_checkpoints=3,
    )
    ck, tp = tmp_path / "p2-zero1", tmp_path / "n2"
    straight = _train(dataclasses.replace(base, steps=STEPS, save=str(ck), save_every=FIRST, collect_parameters=True))
    first = str(ck / f"step-{FIRST:06d}")
    others = [
        base.replace(
            schedule="zb-h1", data_parallel=1, zero=0, tensor_parallel=2, num_microbatches=4, save=str(tp), save_every=1
        ),
        base.replace(
            schedule="interleaved-1f1b", num_stages=2, num_chunks=2, data_parallel=1, zero=0, num_microbatches=4
        ),
    ]
    for other in others:
        resumed = _train(dataclasses.replace(other, steps=STEPS - FIRST, resume=first, collect_parameters=True))
        torch.testing.assert_close(resumed.losses, straight.losses[FIRST:], rtol=1e-5, atol=1e-6)
        want, got = _parameters(straight), _parameters(resumed)  # gathered whole from the shards
        assert set(got) == set(want)
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)
    # The N=2 run's own checkpoint (one step later) back at N=1 with ZeRO-3 on two replicas: each takes its
    # slices of the parameters and of the optimizer state.
    again = _train(
        dataclasses.replace(
            base, steps=STEPS - FIRST - 1, resume=str(tp / f"step-{FIRST + 1:06d}"), zero=3, collect_parameters=True
        )
    )
    torch.testing.assert_close(again.losses, straight.losses[FIRST + 1 :], rtol=1e-5, atol=1e-6)
    for name, value in _parameters(straight).items():
        torch.testing.assert_close(_parameters(again)[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_sequence_parallel_checkpoint_resumes_without_it(tmp_path: Path) -> None:
    """Saved with --sequence-parallel at N=2 (the layer norms' momenta from their gradients summed over tp, the
    same on both processes, written once), resumed at N=1 on 1f1b: the straight run's losses and parameters."""
    gpt = dataclasses.replace(GPT, tie_embeddings=False)
    first = train_config(
        schedule="zb-h1",
        num_stages=2,
        num_microbatches=2,
        model=gpt,
        batch_size=4,
        momentum=0.9,
        tensor_parallel=2,
        sequence_parallel=True,
    )
    straight, resumed = _straight_and_resumed(
        tmp_path, first, dataclasses.replace(first, schedule="1f1b", tensor_parallel=1, sequence_parallel=False)
    )
    torch.testing.assert_close(resumed.losses, straight.losses[FIRST:], rtol=1e-5, atol=1e-6)
    want, got = _parameters(straight), _parameters(resumed)
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


ZERO3 = train_config(
    schedule="zb-h1",
    num_stages=2,
    data_parallel=2,
    num_microbatches=2,
    model=MLP,
    batch_size=8,
    optimizer="adamw",
    lr=1e-2,
    zero=3,
    bucket_mb=0.0005,
    keep_checkpoints=3,
)
"""Parameters and AdamW's moments in slices of several buckets per part."""


@pytest.mark.parametrize(
    ("saved_as", "resume_as"),
    [
        (dict(), dict(schedule="1f1b", zero=1)),
        pytest.param(dict(), dict(data_parallel=1, zero=0, num_microbatches=4), marks=pytest.mark.slow),
        (dict(zero=2), dict(schedule="1f1b", zero=1)),
        pytest.param(dict(zero=1), dict(zero=2), marks=pytest.mark.slow),
    ],
    ids=["zero3-as-zero1", "zero3-as-zero0-one-replica", "zero2-as-zero1", "zero1-as-zero2"],
)
def test_a_zero_checkpoint_resumes_at_another_zero_stage(
    tmp_path: Path, saved_as: dict[str, object], resume_as: dict[str, object]
) -> None:
    """Saved at ZeRO-3 (every replica's slices gathered whole, written once) or 2 (the optimizer's slices
    gathered as ZeRO-1's), resumed with ZeRO-1 on two replicas, without ZeRO on one, or at ZeRO-2: the
    uninterrupted run's losses and parameters (rtol 1e-5, atol 1e-6)."""
    saved = dataclasses.replace(ZERO3, **saved_as)  # type: ignore[arg-type]
    straight = _train(
        dataclasses.replace(saved, steps=STEPS, save=str(tmp_path), save_every=FIRST, collect_parameters=True)
    )
    resumed = _train(
        dataclasses.replace(
            saved, steps=STEPS - FIRST, resume=str(tmp_path / f"step-{FIRST:06d}"), collect_parameters=True, **resume_as
        )
    )  # type: ignore[arg-type]
    torch.testing.assert_close(resumed.losses, straight.losses[FIRST:], rtol=1e-5, atol=1e-6)
    want, got = _parameters(straight), _parameters(resumed)
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)


def test_pipedream_with_data_parallel_replicas_saves_and_resumes(tmp_path: Path) -> None:
    """PipeDream's hybrid (P = 2 replicas around the stream): a run drained and saved after step 2 and one
    resumed from that checkpoint give the uninterrupted (drained) run's losses; the replicas' equal keys once."""
    base = train_config(
        schedule="pipedream",
        num_stages=2,
        data_parallel=2,
        num_microbatches=4,
        model=MLP,
        batch_size=16,
        optimizer="sgd",
        momentum=0.9,
    )
    straight = _train(dataclasses.replace(base, steps=4, save=str(tmp_path / "a"), save_every=2))
    _train(dataclasses.replace(base, steps=2, save=str(tmp_path / "b")))
    resumed = _train(dataclasses.replace(base, steps=2, resume=str(tmp_path / "b")))
    torch.testing.assert_close(resumed.losses, straight.losses[2:], rtol=1e-5, atol=1e-6)
