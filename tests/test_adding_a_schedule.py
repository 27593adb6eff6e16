"""Adding a schedule is a generator and a registry entry: the CLI, the simulator, the planner and the
runtime then take it with no other edit (``docs/contributing/adding-a-schedule.md``, whose example this is)."""

from __future__ import annotations

import json

import pytest
import torch

from pipeweave.cli import main
from pipeweave.config import TrainConfig
from pipeweave.models import ModelSpec
from pipeweave.planner.space import Fixed, configurations
from pipeweave.planner.transformer import Transformer
from pipeweave.runtime.reference import run_reference
from pipeweave.runtime.run.prepare import prepare
from pipeweave.schedule import (
    SCHEDULES,
    Action,
    DataParallel,
    Op,
    Placement,
    PlacementKind,
    Schedule,
    ScheduleInfo,
    format_grid,
    generate,
    validate,
)


def fifo_gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe whose backwards run first in, first out: every F, then every B in microbatch order, then U.

    Legend: ``sFj`` forward of microbatch j on stage s, ``sBj`` its backward, ``sU0`` the update.
    """
    rows = [
        [Action(s, Op.F, j) for j in range(num_microbatches)]
        + [Action(s, Op.B, j) for j in range(num_microbatches)]
        + [Action(s, Op.U, 0)]
        for s in range(num_stages)
    ]
    return Schedule("fifo-gpipe", Placement.straight(num_stages), num_microbatches, tuple(map(tuple, rows)))


ENTRY = ScheduleInfo(
    name="fifo-gpipe",
    generator=fifo_gpipe,
    family="GPipe, backwards first in first out",
    synchronous=True,
    bubble="(D-1)/(T+D-1)",
    activations="T M_a",
    weights="M_theta",
    chunks=1,
    placement=PlacementKind.STRAIGHT,
    splits_backward=False,
    data_parallel=DataParallel.SYNCHRONOUS,
    ties=True,
)

GOLDEN_D2_T3 = """\
rank 0 | 0F0  0F1  0F2  0B0  0B1  0B2  0U0
rank 1 | 1F0  1F1  1F2  1B0  1B1  1B2  1U0"""


@pytest.fixture(autouse=True)
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(SCHEDULES, "fifo-gpipe", ENTRY)


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, object]:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_golden_and_valid() -> None:
    assert format_grid(generate("fifo-gpipe", num_stages=2, num_microbatches=3)) == GOLDEN_D2_T3
    for d in range(1, 6):
        for t in range(1, 9):
            validate(generate("fifo-gpipe", num_stages=d, num_microbatches=t))


def test_the_cli_lists_and_simulates_it(capsys: pytest.CaptureFixture[str]) -> None:
    listed = {r["name"]: r for r in _json(capsys, ["schedules", "--json"])["schedules"]}  # type: ignore[union-attr]
    assert listed["fifo-gpipe"]["placement"] == "straight"
    argv = ["simulate", "--stages", "4", "--microbatches", "8", "--json"]
    ours, gpipe = _json(capsys, [*argv, "-s", "fifo-gpipe"]), _json(capsys, [*argv, "-s", "gpipe"])
    assert ours["bubble_ratio"] == gpipe["bubble_ratio"] == pytest.approx(3 / 11)
    assert ours["peak_activations"] == gpipe["peak_activations"] == [8, 8, 8, 8]


def test_the_planner_sizes_it() -> None:
    model = Transformer(layers=4, hidden=64, heads=4)
    found = list(configurations(model, 4, 8, 2, Fixed(schedule="fifo-gpipe")))
    assert found and {c.schedule for c in found} == {"fifo-gpipe"} and {c.pp for c in found} >= {2, 4}


def test_the_runtime_trains_it_as_gpipe() -> None:
    """Backwards in another order sum the same gradients: the losses are GPipe's."""
    plan = prepare(
        TrainConfig(
            schedule="fifo-gpipe",
            num_stages=2,
            num_microbatches=4,
            steps=2,
            model=ModelSpec(kind="mlp", layers=4, hidden=8),
            batch_size=8,
        )
    )
    spec = plan.config.model
    ours = run_reference(plan.schedule, spec, steps=2, batch_size=8)
    gpipe = run_reference(generate("gpipe", num_stages=2, num_microbatches=4), spec, steps=2, batch_size=8)
    assert torch.allclose(torch.tensor(ours.losses), torch.tensor(gpipe.losses), rtol=1e-6)
