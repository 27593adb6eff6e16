"""``simulate``, ``partition`` and ``compare`` refuse a simulation too large to answer in seconds, in one line
naming the counts, the limit and the fix (``commands.simulate.MAX_ACTIONS``), before anything is profiled.

Before, ``partition --stages 1000000000`` profiled the model, then built a billion-stage schedule (a hang);
``simulate --microbatches 1000000`` fitted in memory and ran for minutes; ``compare --stages 1000000000``
tried every approach before saying none could run.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from pipeweave.commands.simulate import MAX_ACTIONS

CliError = Callable[..., str]
QUICK = 10.0
"""Seconds: a guard against a hang, not a speed target."""


@pytest.mark.parametrize(
    ("argv", "counts"),
    [
        (
            ["simulate", "-s", "1f1b", "--stages", "4", "--microbatches", "1000000"],
            "--stages 4 x --microbatches 1000000",
        ),
        (
            ["simulate", "-s", "interleaved-1f1b", "--stages", "4", "--microbatches", "8", "--chunks", "100000"],
            "--stages 4 x --microbatches 8 x 100000 chunks",
        ),
        (
            ["simulate", "-s", "pipedream", "--stages", "64", "--microbatches", "64", "--steps", "1000"],
            "--stages 64 x --microbatches 64 x --steps 1000",
        ),
        (["partition", "--stages", "1000000000"], "--stages 1000000000 x --microbatches 8"),
        (["partition", "--stages", "4", "--microbatches", "1000000"], "--stages 4 x --microbatches 1000000"),
        (
            ["compare", "--stages", "100000", "--microbatches", "4"],
            "--stages 100000 x --microbatches 4 x 2 chunks x --stream-steps 8",
        ),
        (
            ["compare", "--stages", "4", "--microbatches", "1000000", "--batch", "1000000"],
            "--stages 4 x --microbatches 1000000 x 2 chunks x --stream-steps 8",
        ),
    ],
)
def test_a_simulation_too_large_is_one_line_at_once(cli_error: CliError, argv: list[str], counts: str) -> None:
    started = time.perf_counter()
    err = cli_error(argv, "pipeweave.commands.partition.layer_costs", "pipeweave.commands.compare_run.layer_costs")
    assert time.perf_counter() - started < QUICK, err
    assert f"{counts} make up to" in err and "give fewer stages, microbatches or chunks" in err, err
    assert f"more than the {MAX_ACTIONS:.2g} a simulation answers" in err or "GiB free here" in err, err


def test_a_simulation_within_the_limit_runs(capsys: pytest.CaptureFixture[str]) -> None:
    from pipeweave.cli import main

    assert main(["simulate", "-s", "1f1b", "--stages", "4", "--microbatches", "2048", "--json"]) == 0
