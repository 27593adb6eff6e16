"""``pipeweave train --schedule-file``: a schedule written by hand trains exactly as plain training does.

The schedule: 1F1B on 2 ranks with rank 0's third forward moved before its
first backward, and rank 1's backwards split into I and W, its W deferred::

    rank 0 | 0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3
    rank 1 | 1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1F3 1I3 1W2 1W3

written in torch.distributed.pipelining's CSV form (no ``U``: each stage's
update is appended at the end of its rank, as torch does).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
import torch
from torch_orders import TORCH_CLASSES, torch_order, write_torch_csv

from pipeweave.cli import build_parser
from pipeweave.config import TrainConfig
from pipeweave.errors import UserError
from pipeweave.runtime.plain import run_plain
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import optimizer_factory, prepare
from pipeweave.schedule import Action, Op

HAND_WRITTEN = "0F0,0F1,0F2,0B0,0F3,0B1,0B2,0B3\n1F0,1I0,1F1,1I1,1W0,1F2,1I2,1W1,1F3,1I3,1W2,1W3\n"


def _args(path: Path, *extra: str) -> argparse.Namespace:
    return build_parser().parse_args(
        [
            "train",
            "--schedule-file",
            str(path),
            "--model",
            "mlp",
            "--layers",
            "4",
            "--hidden",
            "8",
            "--batch",
            "7",
            "--steps",
            "2",
            *extra,
        ]
    )


def _config(path: Path, *extra: str):  # type: ignore[no-untyped-def]
    from pipeweave.commands.train_run import build_config

    return build_config(_args(path, *extra))


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_hand_written_csv_schedule_trains_as_plain_training(tmp_path: Path) -> None:
    path = tmp_path / "moved.csv"
    path.write_text(HAND_WRITTEN)
    config = dataclasses.replace(_config(path), collect_parameters=True)
    plan = prepare(config)
    assert (config.num_stages, config.num_microbatches) == (2, 4)  # from the file
    assert plan.schedule.actions[0][2:4] == (Action(0, Op.F, 2), Action(0, Op.B, 0))  # as written, run as written
    assert plan.schedule.actions[1][-1] == Action(1, Op.U, 0)
    _trains_as_plain(config)


def test_sizes_come_from_the_file_and_a_conflict_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "moved.csv"
    path.write_text(HAND_WRITTEN)
    assert _config(path, "--stages", "2", "--microbatches", "4").num_microbatches == 4  # agreeing is fine
    for flag, value, own in (("--stages", "3", 2), ("--microbatches", "8", 4)):
        with pytest.raises(
            UserError,
            match=rf"^{flag} {value} conflicts with --schedule-file .*moved.csv, which has "
            rf"{own}; drop {flag} \(the file sets it\)$",
        ):
            _config(path, flag, value)
    with pytest.raises(UserError, match=r"^-s 1f1b and --schedule-file .* both name the schedule; give one"):
        _config(path, "-s", "1f1b")
    with pytest.raises(UserError, match=r"^--schedule-file .*nothere.csv' is not a file"):
        _config(tmp_path / "nothere.csv")


def test_a_deadlocking_csv_is_one_line_and_the_grid_with_the_stuck_step_marked(tmp_path: Path) -> None:
    path = tmp_path / "dead.csv"
    path.write_text("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n")  # rank 1 starts on microbatch 1, rank 0 waits on 0
    with pytest.raises(UserError) as caught:
        _config(path)
    first, *grid = str(caught.value).splitlines()
    assert first.startswith(f"--schedule-file {path} is invalid: deadlock: rank 0 step 1 (0B0) waits for 1B0")
    assert first.endswith("(each rank's stuck step in brackets below); fix the file")
    assert grid == ["rank 0 | 0F0 [0B0] 0F1  0B1  0U0", "rank 1 |[1F1] 1B1  1F0  1B0  1U0"]


def test_the_text_form_and_a_missing_action(tmp_path: Path) -> None:
    text = tmp_path / "grid.txt"  # the grid simulate and the validator print
    text.write_text("rank 0 | 0F0 0F1 0B0 0B1\nrank 1 | 1F0 1B0 1F1 1B1\n")
    assert _config(text).schedule_file.actions[1][:4] == tuple(
        Action(1, op, j) for op, j in ((Op.F, 0), (Op.B, 0), (Op.F, 1), (Op.B, 1))
    )
    text.write_text("rank 0 | 0F0 0F1 0B0 0B1\nrank 1 | 1F0 1B0 1F1\n")
    with pytest.raises(UserError, match=r"is invalid: 1B1 \(or 1I1 \+ 1W1\) is missing; fix the file\nrank 0"):
        _config(text)


def test_simulate_takes_the_same_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from pipeweave.cli import main

    path = tmp_path / "moved.csv"
    path.write_text(HAND_WRITTEN)
    assert main(["simulate", "--schedule-file", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["stages"], out["microbatches"], out["valid"]) == (2, 4, True)


def _trains_as_plain(config: TrainConfig) -> None:
    """``pipeweave train`` with ``config``: every loss and every final weight equal plain training's."""
    plan = prepare(config)
    record = launch(run_rank, plan, plan.num_processes, LaunchOptions(timeout_s=90))
    plain = run_plain(
        config.model,
        steps=config.steps,
        batch_size=config.batch_size,
        num_microbatches=config.num_microbatches,
        optimizer_factory=optimizer_factory(config),
    )
    torch.testing.assert_close(record.losses, plain.losses, rtol=1e-5, atol=1e-6)
    seen = set()
    for rank_record in record.ranks:
        for params in rank_record.parameters.values():
            for name, value in params.items():
                torch.testing.assert_close(value, plain.parameters[name], rtol=1e-5, atol=1e-6)
                seen.add(name)
    assert seen == set(plain.parameters)


TORCH_SLOW = [pytest.param(c, marks=pytest.mark.slow) for c in TORCH_CLASSES if c != "ScheduleDualPipeV"]


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("cls_name", ["ScheduleDualPipeV", *TORCH_SLOW])
def test_torch_own_orders_train_as_plain_training(cls_name: str, tmp_path: Path) -> None:
    """torch's own schedule classes' orders (D=2, two stages a rank, T=4), as its _dump_csv writes them;
    DualPipeV's holds (0F3;3B0)OVERLAP_F_B actions, run as their F then their B."""
    path = tmp_path / f"{cls_name}.csv"
    write_torch_csv(torch_order(cls_name, 2, 4), path)
    assert ("OVERLAP_F_B" in path.read_text()) == (cls_name == "ScheduleDualPipeV")
    _trains_as_plain(dataclasses.replace(_config(path), collect_parameters=True))
