"""``pipeweave.train(config)`` is ``pipeweave train`` from Python: the README's default run gives the same losses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import pipeweave
from pipeweave.cli import main
from pipeweave.errors import UserError


def _both(tmp_path: Path, steps: int) -> tuple[list[float], list[float]]:
    record = pipeweave.train(pipeweave.TrainConfig(steps=steps, quiet=True, out=str(tmp_path / "python")))
    assert main(["train", "--steps", str(steps), "--quiet", "--out", str(tmp_path / "cli")]) == 0
    return list(record.losses), json.loads((tmp_path / "cli" / "train.json").read_text())["losses"]


def test_the_default_run_from_python_equals_the_command(tmp_path: Path) -> None:
    from_python, from_cli = _both(tmp_path, 3)
    assert from_python == from_cli and len(from_python) == 3


@pytest.mark.slow
def test_the_whole_default_run_from_python_equals_the_command(tmp_path: Path) -> None:
    from_python, from_cli = _both(tmp_path, 30)
    assert from_python == from_cli and len(from_python) == 30


def test_fields_given_by_name_change_the_run(tmp_path: Path) -> None:
    record = pipeweave.train(
        model=pipeweave.ModelSpec(kind="mlp", layers=2, hidden=8),
        schedule="gpipe",
        steps=2,
        batch_size=4,
        quiet=True,
        out=str(tmp_path),
        transport="gloo",
    )
    assert len(record.losses) == 2 and record.config.schedule.name == "gpipe"


def test_a_bad_configuration_is_a_user_error_before_anything_spawns() -> None:
    with pytest.raises(UserError, match="--tensor-parallel 0 is invalid"):
        pipeweave.train(tensor_parallel=0)
