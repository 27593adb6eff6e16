"""``pipeweave train``'s and ``partition``'s flags: a bad value is one line (exit 2) before anything is spawned.

Before, ``--data-parallel 0`` was a ZeroDivisionError, ``--timeout 0`` or ``-1`` ran into
40 lines of c10d logs, ``--layers-per-stage -1,5`` was argparse's "expected one argument",
and ``partition --device banana`` a RuntimeError from torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeweave.cli import main
from pipeweave.runtime.run.save_lock import LOCK, owner_of

TRAIN = ["train", "--model", "mlp", "--layers", "4", "--hidden", "8", "--steps", "1", "--quiet"]
PARTITION = ["partition", "--model", "mlp", "--layers", "4", "--hidden", "8", "--stages", "2"]
NOTHING_DONE = ("pipeweave.runtime.run.launch._spawn", "pipeweave.commands.profiled.profile_model")


TIMEOUT = "is invalid; give the seconds a rank may wait on a peer, > 0 and at most 604800 (a week); default 25"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data-parallel", "0"], "--data-parallel 0 is invalid; give P >= 1 pipeline replicas (1: none)"),
        (["--data-parallel", "-2"], "--data-parallel -2 is invalid; give P >= 1"),
        (["--timeout", "0"], f"--timeout 0 {TIMEOUT}"),
        (["--timeout", "-1"], f"--timeout -1 {TIMEOUT}"),
        (["--timeout", "nan"], f"--timeout nan {TIMEOUT}"),
        (["--timeout", "1e300"], f"--timeout 1e+300 {TIMEOUT}"),
        (
            ["--layers-per-stage", "-1,5"],
            "--layers-per-stage -1,5 has a negative layer count (-1); give every part at least one layer, e.g. 3,2,2,1",
        ),
        (["--layers-per-stage=-1,5"], "--layers-per-stage -1,5 has a negative layer count (-1)"),
        (["--layers-per-stage", "3,-2,3"], "--layers-per-stage 3,-2,3 has a negative layer count (-2)"),
        (["--lr", "inf"], "--lr inf is invalid; give a finite learning rate > 0"),
        (["--lr", "-inf"], "--lr -inf is invalid"),
        (["--repeats", "0", "--partition", "time"], "--repeats 0 is invalid; give an integer >= 1"),
        (["--optimizer-state", "nan"], "--optimizer-state nan is invalid"),
        (
            ["--zero", "1"],
            "--zero 1 shards over the --data-parallel replicas and this run has one; give --data-parallel",
        ),
        (["--zero", "3"], "--zero 3 shards over the --data-parallel replicas"),
        # PipeDream's replicated stages (1F1B-RR): a replication the processes cannot hold, or a schedule without it
        (
            ["-s", "pipedream", "--stage-replicas", "2,1", "--stages", "4"],
            "--stage-replicas 2,1 needs 3 processes but --stages is 4; give --stages 3 or counts summing to 4",
        ),
        (
            ["-s", "pipedream", "--stage-replicas", "2,1", "--microbatches", "3"],
            "3 microbatches do not deal evenly to 2 replicas; give --microbatches a multiple of 2",
        ),
        (["-s", "pipedream", "--stage-replicas", "2,0"], "--stage-replicas 2,0 gives a part no rank; give every part"),
        (
            ["-s", "pipedream", "--stage-replicas", "2,x"],
            "--stage-replicas '2,x' is not a list of integers; write e.g. 2,1",
        ),
        (
            ["-s", "1f1b", "--stage-replicas", "2,1"],
            "--stage-replicas 2,1 deals microbatches to replicated parts, which pipedream's 1F1B-RR runs and 1f1b "
            "(synchronous) cannot; give -s pipedream, or replicate whole pipelines with --data-parallel",
        ),
        (
            ["-s", "pipedream", "--stage-replicas", "2,1", "--model", "gpt", "--tie-embeddings"],
            "--stage-replicas 2,1 routes microbatches through several pipelines, whose ends a tie cannot pair; "
            "drop --tie-embeddings",
        ),
        (
            ["-s", "pipedream", "--stage-replicas", "2,1", "--data-parallel", "2"],
            "--stage-replicas 2,1 runs one process per replica, without --data-parallel 2; drop one of them",
        ),
    ],
)
def test_train_refuses_a_bad_flag_before_spawning(argv: list[str], message: str, cli_error: Callable[..., str]) -> None:
    err = cli_error([*TRAIN, *argv], *NOTHING_DONE)
    assert message in err, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--device", "banana"], "--device banana is not a device; give cpu, or cuda / cuda:N on a machine with a GPU"),
        (["--device", "meta"], "--device meta: pipeweave profiles on cpu or cuda, not meta"),
        (["--layers-per-stage", "-1,5"], "--layers-per-stage -1,5 has a negative layer count (-1)"),
        (
            ["--partition", "explicit", "--layers-per-stage", "-3,7"],
            "--layers-per-stage -3,7 has a negative layer count",
        ),
    ],
)
def test_partition_refuses_a_bad_flag_before_profiling(
    argv: list[str], message: str, cli_error: Callable[..., str]
) -> None:
    err = cli_error([*PARTITION, *argv], *NOTHING_DONE)
    assert message in err, err


def test_partition_on_a_gpu_this_machine_lacks_is_one_line(cli_error: Callable[..., str]) -> None:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    err = cli_error([*PARTITION, "--device", f"cuda:{count}"], *NOTHING_DONE)
    wanted = "this machine has no CUDA GPU torch can use" if count == 0 else f"this machine has {count} CUDA GPU(s)"
    assert f"--device cuda:{count}: {wanted}" in err, err


@pytest.mark.parametrize("words", [["--time-f", "-1,2"], ["--time-w", "-inf"], ["--time-b", "-1e3"]])
def test_a_negative_value_reaches_the_command_not_argparse(
    words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", *words]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"pipeweave simulate: error: {words[0]} ") and "negative time" in err, err
    assert len(err.splitlines()) == 1


def test_two_runs_writing_one_out_folder_at_once_is_one_line(tmp_path: Path, cli_error: Callable[..., str]) -> None:
    """Two runs with the same --out overwrote each other's record without a word."""
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK).write_text(json.dumps(owner_of(os.getpid())) + "\n")  # a live run writes there now
    err = cli_error([*TRAIN, "--out", str(out)], *NOTHING_DONE)
    assert f"--out {out} is in use by another run (pid {os.getpid()} on " in err
    assert "give another --out folder" in err


def test_more_spawned_ranks_than_the_cores_can_serve_is_one_line(
    monkeypatch: pytest.MonkeyPatch, cli_error: Callable[..., str]
) -> None:
    from pipeweave.commands import train_run

    monkeypatch.setattr(train_run, "cpu_cores", lambda: 1)  # 16 processes a core: 2 x 2 x 8 = 32 is too many
    argv = ["--model", "gpt", "--heads", "8", "--hidden", "32", "--layers", "2", "--schedule", "1f1b"]
    err = cli_error([*TRAIN, *argv, "--stages", "2", "--data-parallel", "2", "--tensor-parallel", "8"], *NOTHING_DONE)
    assert "= 32 processes on 1 CPU cores: over 16 a core" in err and "give at most 16 processes here" in err, err
