"""``pipeweave train`` refuses, in one line and before generating the schedule, sizes that cannot work.

Before, ``train --model mlp --layers 4 --hidden 32 --batch 16 --microbatches 100000000`` grew
by ~90 MB/s with no message (generating a schedule of 10^8 microbatches, before the batch was
found too small for them), and ``--stages 1000000`` hung likewise (a million parts for 4 layers).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from unittest.mock import patch

import pytest
from config_defaults import train_config

from pipeweave.models.spec import ModelSpec
from pipeweave.runtime.run.sizes import action_estimate, part_count
from pipeweave.schedule import SCHEDULES, generate

T = ["train", "--model", "mlp", "--layers", "4", "--hidden", "32", "--batch", "16", "--steps", "1", "--quiet"]
NOTHING_BUILT = (
    "pipeweave.runtime.run.prepare.generate",
    "pipeweave.runtime.run.launch._spawn",
    "pipeweave.commands.profiled.profile_model",
)


def _refused(cli_error: Callable[..., str], argv: list[str]) -> str:
    started = time.perf_counter()
    err = cli_error(argv, *NOTHING_BUILT)
    assert time.perf_counter() - started < 2.0, "a refusal takes no time"
    return err


def test_more_microbatches_than_the_batch_has_samples_is_one_line(cli_error: Callable[..., str]) -> None:
    err = _refused(cli_error, [*T, "--microbatches", "100000000"])
    assert "--batch 16 cannot make 100000000 microbatches; increase --batch or reduce --microbatches" in err, err


def test_more_parts_than_layers_is_one_line(cli_error: Callable[..., str]) -> None:
    err = _refused(cli_error, [*T, "--stages", "1000000"])
    assert (
        "1000000 parts (zb-h1, D=1000000) need at least 1000000 layers, the model has 4; reduce --stages or "
        "increase --layers"
    ) in err, err


def test_the_parts_count_their_chunks(cli_error: Callable[..., str]) -> None:
    err = _refused(cli_error, [*T, "-s", "zb-v", "--stages", "3"])
    assert "6 parts (zb-v, D=3) need at least 6 layers, the model has 4" in err, err


def test_a_schedule_larger_than_free_memory_is_one_line(cli_error: Callable[..., str]) -> None:
    with patch("pipeweave.host.available_memory", return_value=2**30):
        err = _refused(cli_error, [*T, "-s", "1f1b", "--microbatches", "10000000", "--batch", "10000000"])
    assert (
        "--stages 2 x --microbatches 10000000 make up to ~6e+07 actions, ~17 GiB to build and simulate "
        "(300 B each), more than the 1.0 GiB free here; give fewer stages or microbatches "
        "(at most ~3.6e+06 actions fit)"
    ) in err, err


def test_an_asynchronous_stream_counts_its_steps(cli_error: Callable[..., str]) -> None:
    with patch("pipeweave.host.available_memory", return_value=2**30):
        err = _refused(
            cli_error, [*T, "-s", "pipedream", "--microbatches", "16", "--stages", "4", "--steps", "1000000"]
        )
    assert "--stages 4 x --microbatches 16 x --steps 1000000 make up to ~2e+08 actions" in err, err
    assert "give fewer stages or microbatches or steps" in err, err


def test_more_rank_processes_than_fit_is_one_line(cli_error: Callable[..., str]) -> None:
    with patch("pipeweave.host.available_memory", return_value=2**30):
        err = _refused(cli_error, [*T, "--layers", "64", "--stages", "64", "-s", "gpipe", "--microbatches", "1"])
    assert (
        "--stages 64 start 64 rank processes here, ~2 GiB at ~32 MiB each and 320 MiB once before any tensor, "
        "more than the 1.0 GiB free; give fewer stages (at most ~22 ranks fit)"
    ) in err, err


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_parts_and_actions_are_known_before_generating(name: str) -> None:
    """``part_count`` is the generated schedule's, ``action_estimate`` at least its action count."""
    info = SCHEDULES[name]
    chunk_choices = [None] if info.chunks is not None else [None, 3]
    for d, t in ((2, 4), (4, 8), (4, 12)):
        for v in chunk_choices:
            config = train_config(
                schedule=name,
                num_stages=d,
                num_microbatches=t,
                num_chunks=v,
                steps=4,
                batch_size=64,
                model=ModelSpec(kind="mlp", layers=64),
            )
            options = {"num_steps": 4} if not info.synchronous else {}
            if name == "avgpipe":
                options["num_steps"] = 2  # rounds of P = 2 mini-batches: 4 in all, as config.steps
            schedule = generate(name, num_stages=d, num_microbatches=t, num_chunks=v, **options)
            assert part_count(config) == schedule.num_parts, (d, t, v)
            actions = sum(len(row) for row in schedule.actions)
            assert actions <= action_estimate(config, schedule.num_parts), (d, t, v, actions)
