"""Checkpoints are never lost: what ``pipeweave train --save/--resume`` keeps, makes atomic and refuses.

Each test is a bug a user reported with a run of the tiny mlp on 2 ranks:
a second run saving into a folder deleted the first run's checkpoint; a
save deleted the user's own ``part-*.pt`` file; two runs saved into one
folder at once; a full disk at the last save lost the run's record; a
truncated part failed only after the ranks had started, without naming it.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from unittest.mock import patch

import pytest
from config_defaults import train_config
from torch.distributed.checkpoint import FileSystemWriter

from pipeweave.cli import main
from pipeweave.config import TrainConfig
from pipeweave.durable import replacing
from pipeweave.models import ModelSpec
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.plain import run_plain
from pipeweave.runtime.run import checkpoint_files
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import optimizer_factory, prepare
from pipeweave.runtime.run.record import RunRecord
from pipeweave.runtime.run.save_lock import LOCK, owner_of
from pipeweave.side_output import OUTPUT_FAILED

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

SPAWN = "pipeweave.runtime.run.launch._spawn"
MLP = ["--model", "mlp", "--layers", "4", "--hidden", "8", "--batch", "8", "--microbatches", "2", "-s", "1f1b"]


def _train(tmp_path: Path, *more: str) -> list[str]:
    return ["train", *MLP, "--quiet", "--out", str(tmp_path / "out"), *more]


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_second_run_saving_into_a_folder_with_a_checkpoint_is_refused(
    tmp_path: Path, cli_error: Callable[..., str], capsys: pytest.CaptureFixture[str]
) -> None:
    """`--steps 60 --save ck; --steps 2 --save ck` left a 2-step checkpoint: the 60-step one was gone."""
    ck = tmp_path / "ck"
    assert main(_train(tmp_path, "--steps", "4", "--save", str(ck))) == 0
    before = _files(ck)
    err = cli_error(_train(tmp_path, "--steps", "2", "--save", str(ck)), SPAWN)
    assert (
        f"--save {ck} holds a checkpoint of another run (step-000004, 4 steps); resume it with --resume {ck}, "
        "or pass --overwrite to replace it" in err
    )
    assert _files(ck) == before and checkpoint_files.find(str(ck)).steps == 4
    assert main(_train(tmp_path, "--steps", "2", "--save", str(ck), "--overwrite")) == 0
    capsys.readouterr()
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-000002"]  # the other run's, once this one's whole


def test_a_save_deletes_no_file_of_the_user(tmp_path: Path) -> None:
    """The save's cleanup globbed `part-*.pt`: `d/part-final-model.pt`, the user's, was deleted."""
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "part-final-model.pt").write_text("x")
    (folder / "part-001-step9.pt").write_text("also mine")
    (folder / "__0_0.distcp").write_text("named as DCP names its files")  # in DIR: pipeweave writes in step-*/
    assert main(_train(tmp_path, "--steps", "3", "--save", str(folder), "--save-every", "1")) == 0
    assert (folder / "part-final-model.pt").read_text() == "x"
    assert (folder / "part-001-step9.pt").read_text() == "also mine"
    assert (folder / "__0_0.distcp").read_text() == "named as DCP names its files"


def test_a_folder_a_live_run_saves_into_is_refused_a_dead_ones_lock_taken_over(
    tmp_path: Path, cli_error: Callable[..., str]
) -> None:
    """Two runs saving into one folder deleted each other's parts: the second now stops at the lock."""
    ck = tmp_path / "ck"
    ck.mkdir()
    live = subprocess.Popen(["sleep", "60"])
    try:
        (ck / LOCK).write_text(json.dumps(owner_of(live.pid)))
        err = cli_error(_train(tmp_path, "--steps", "2", "--save", str(ck)), SPAWN)
        assert f"--save {ck} is in use by another run (pid {live.pid} on {socket.gethostname()})" in err
    finally:
        live.kill()
        live.wait()
    assert json.loads((ck / LOCK).read_text())["pid"] == live.pid  # its owner's, left alone
    assert main(_train(tmp_path, "--steps", "2", "--save", str(ck))) == 0  # the owner died: the lock is stale
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-000002"]  # taken over, then released


def _limit_file_size() -> None:
    """A disk that fills up at 150 kB per file: every file write past it fails (EFBIG) instead of killing."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (150_000, 150_000))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE and SIGXFSZ as on Linux")
def test_a_full_disk_at_the_last_save_keeps_the_record_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    """The last save failed with `unexpected pos`, and the run's JSON record, trace and plot were lost."""
    out, ck = tmp_path / "out", tmp_path / "ck"
    argv = [
        sys.executable,
        "-m",
        "pipeweave.cli",
        "train",
        "--model",
        "mlp",
        "--layers",
        "4",
        "--hidden",
        "64",
        "--batch",
        "8",
        "--microbatches",
        "2",
        "-s",
        "1f1b",
        "--steps",
        "2",
        "--quiet",
        "--out",
        str(out),
        "--save",
        str(ck),
        "--transport",
        "gloo",
    ]  # each part ~260 kB: over the limit; the record, trace and plot under it
    done = subprocess.run(argv, preexec_fn=_limit_file_size, capture_output=True, text=True, timeout=150, cwd=tmp_path)
    lines = [line for line in done.stderr.splitlines() if "pipeweave" in line]
    assert done.returncode == OUTPUT_FAILED, done.stderr  # trained; an output missing
    assert len(lines) == 1 and lines[0].startswith("pipeweave train: error: cannot write "), done.stderr
    assert f"{ck}/.tmp-step-000002" in lines[0], lines
    assert lines[0].endswith(f": File too large; no checkpoint is kept in {ck}"), lines
    assert "Traceback" not in done.stderr and "unexpected pos" not in done.stderr
    record = json.loads((out / "train.json").read_text())
    assert len(record["losses"]) == 2 and record["save_failures"] == [lines[0].removeprefix("pipeweave train: error: ")]
    assert (out / "trace.json").stat().st_size > 0 and (out / "timeline.png").stat().st_size > 0
    assert sorted(p.name for p in out.iterdir()) == ["timeline.png", "trace.json", "train.json"]
    assert list(ck.iterdir()) == []  # no half-written part, no staging folder, no lock


def test_a_truncated_or_damaged_part_is_one_line_before_any_rank_starts(
    tmp_path: Path, cli_error: Callable[..., str]
) -> None:
    """`truncate -s 20000 part; --resume` failed on the ranks with EOFError, naming no file."""
    ck = tmp_path / "ck"
    assert main(_train(tmp_path, "--steps", "4", "--save", str(ck), "--save-every", "2")) == 0
    part = sorted(ck.rglob("__1_0.distcp"))[-1]  # the newest checkpoint's data of rank 1
    whole = part.read_bytes()
    part.write_bytes(whole[:2000])
    err = cli_error(_train(tmp_path, "--steps", "2", "--resume", str(ck)), SPAWN)
    assert (
        f"--resume {ck}: {part} is 2000 bytes, its manifest says {len(whole)} (truncated or overwritten); "
        f"resume the previous checkpoint with --resume {ck / 'step-000002'}" in err
    )
    part.write_bytes(whole[:1000] + bytes(b ^ 0xFF for b in whole[1000:1100]) + whole[1100:])
    err = cli_error(_train(tmp_path, "--steps", "2", "--resume", str(ck)), SPAWN)
    assert f"{part} does not match the sha256 of its manifest (damaged)" in err and "weights_only" not in err
    part.write_bytes(whole)
    assert main(_train(tmp_path, "--steps", "1", "--resume", str(ck))) == 0


def test_resume_auto_starts_afresh_then_resumes_the_newest_then_has_nothing_left(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--resume auto` with `--steps` counting the whole training: a restarted command ends where one run would."""
    ck, records = tmp_path / "ck", [tmp_path / "first.json", tmp_path / "second.json"]
    auto = ["--save", str(ck), "--resume", "auto", "--save-every", "1"]
    assert main(_train(tmp_path, "--steps", "2", *auto, "--json", str(records[0]))) == 0
    assert main(_train(tmp_path, "--steps", "5", *auto, "--json", str(records[1]))) == 0
    first, second = (json.loads(r.read_text()) for r in records)
    plain = run_plain(ModelSpec(kind="mlp", layers=4, hidden=8), steps=5, batch_size=8, num_microbatches=2)
    assert first["first_step"] == 0 and second["first_step"] == 2 and second["steps"] == 3
    assert first["losses"] + second["losses"] == pytest.approx(plain.losses, rel=1e-5)
    capsys.readouterr()
    with patch(SPAWN, side_effect=AssertionError("started ranks")):
        assert main(_train(tmp_path, "--steps", "5", *auto)) == 0
    assert "holds 5 steps of --steps 5; nothing is left to train" in capsys.readouterr().err


def _failing_once(context: RankContext, config: TrainConfig) -> RunRecord | None:
    """Rank 1 cannot write its share of the checkpoint of step 1 (a full disk, freed before the next save)."""
    rank = context.process
    real = FileSystemWriter.write_data

    def write_data(self: FileSystemWriter, plan: object, planner: object) -> object:
        if rank == 1 and Path(self.path).name == ".tmp-step-000001":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(Path(self.path) / "__1_0.distcp"))
        return real(self, plan, planner)  # type: ignore[arg-type]

    FileSystemWriter.write_data = write_data  # type: ignore[method-assign]  # this rank's process only
    return run_rank(context, prepare(config))


def test_a_save_one_rank_cannot_write_is_abandoned_by_all_and_the_run_goes_on(tmp_path: Path) -> None:
    config = train_config(
        schedule="1f1b",
        num_stages=2,
        num_microbatches=2,
        model=ModelSpec(kind="mlp", layers=4, hidden=8),
        batch_size=8,
        steps=3,
        save=str(tmp_path / "ck"),
        save_every=1,
    )
    prepare(config)
    record = launch(_failing_once, config, 2, LaunchOptions(timeout_s=60))
    assert record.save_failures == [
        f"cannot write {tmp_path}/ck/.tmp-step-000001/__1_0.distcp: No space left on "
        f"device; no checkpoint is kept in {tmp_path}/ck"
    ]
    assert record.final_save_failure is None
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["latest", "step-000002", "step-000003"]


def test_an_output_is_replaced_whole_or_not_at_all(tmp_path: Path) -> None:
    record = tmp_path / "train.json"
    record.write_text("old")
    with pytest.raises(OSError), replacing(record) as tmp:
        tmp.write_text("half")
        raise OSError(28, "No space left on device")
    assert record.read_text() == "old" and os.listdir(tmp_path) == ["train.json"]


PART_FILES = Path(__file__).parent / "fixtures" / "checkpoint-v2"
"""A checkpoint of the part-file format (pipeweave-checkpoint/2), written by pipeweave before DCP (commit 70cc231):
the mlp below, trained 2 steps with SGD momentum 0.9 on 1f1b at D=2, one ``part-NNN.pt`` per part."""
PART_FILES_RUN = train_config(
    schedule="1f1b",
    num_stages=2,
    num_microbatches=2,
    model=ModelSpec(kind="mlp", layers=4, hidden=8),
    batch_size=8,
    steps=2,
    momentum=0.9,
)


def test_a_checkpoint_of_part_files_resumes_on_another_partition_and_saves_with_dcp(tmp_path: Path) -> None:
    """pipeweave-checkpoint/2 (``part-000.pt``, ``part-001.pt``) resumes on 3 stages; the next save is DCP's."""
    ck = tmp_path / "ck"
    shutil.copytree(PART_FILES, ck)
    before = _files(ck)
    resumed = dataclasses.replace(PART_FILES_RUN, num_stages=3, layers_per_part=(1, 1, 2), resume=str(ck), save=str(ck))
    record = launch(run_rank, prepare(resumed), 3, LaunchOptions(timeout_s=60))
    plain = run_plain(
        PART_FILES_RUN.model,
        steps=4,
        batch_size=8,
        num_microbatches=2,
        optimizer_factory=optimizer_factory(PART_FILES_RUN),
    )
    assert record.first_step == 2 and record.losses == pytest.approx(plain.losses[2:], rel=1e-5)
    assert {k: v for k, v in _files(ck).items() if k.startswith("step-000002/")} == before  # kept (K = 2)
    assert sorted(p.name for p in (ck / "step-000004").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "__2_0.distcp",
        "manifest.json",
    ]


def test_a_checkpoint_of_the_first_format_is_resumed_and_kept(tmp_path: Path) -> None:
    """`meta.json` beside `part-000-step2.pt` in DIR itself (pipeweave-checkpoint/1): resumed, never removed."""
    old = tmp_path / "old"
    old.mkdir()
    saved = checkpoint_files.find(str(PART_FILES))
    names = [f"part-{p:03d}-step2.pt" for p in range(2)]
    for entry, name in zip(saved.files, names):
        shutil.copy(saved.folder / entry["name"], old / name)
    meta = {k: v for k, v in saved.manifest.items() if k not in ("run", "serial", "saved")}
    (old / "meta.json").write_text(json.dumps({**meta, "format": "pipeweave-checkpoint/1", "files": names}))
    before = _files(old)
    resumed = dataclasses.replace(PART_FILES_RUN, save=str(old), resume=str(old), save_every=1)
    record = launch(run_rank, prepare(resumed), 2, LaunchOptions(timeout_s=60))
    plain = run_plain(
        PART_FILES_RUN.model,
        steps=4,
        batch_size=8,
        num_microbatches=2,
        optimizer_factory=optimizer_factory(PART_FILES_RUN),
    )
    assert record.first_step == 2 and record.losses == pytest.approx(plain.losses[2:], rel=1e-5)
    assert {k: v for k, v in _files(old).items() if "/" not in k and k != "latest"} == before
    assert checkpoint_files.find(str(old)).folder == old / "step-000004"
