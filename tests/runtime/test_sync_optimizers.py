"""Every synchronous schedule equals plain training with every optimizer of ``--optimizer``.

The grid is the registry's synchronous schedules (read at collection time)
by ``weights.optimizers.OPTIMIZERS`` (RMSprop with and without its momentum
buffer), on a tiny mlp for three steps. The reference executor runs all of
it (tens of milliseconds a case); the distributed runtime runs it on 2 gloo
ranks in one process group, a few schedules of different kinds (1F1B, split
backward, chunks, replicas) by default and the rest with ``-m slow``. Plain
training applies the optimizer to the whole model's accumulated gradient,
the pipeline per part, so equality holds for element-wise optimizers only --
which every entry of the registry is.
"""

from __future__ import annotations

import functools

import pytest
import torch
from config_defaults import train_config

from pipeweave.config import TrainConfig
from pipeweave.models import ModelSpec
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.plain import TrainResult, run_plain
from pipeweave.runtime.reference import run_reference
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import build_schedule, optimizer_factory, prepare
from pipeweave.runtime.run.record import RunRecord
from pipeweave.schedule import SCHEDULES, ScheduleError
from pipeweave.weights.optimizers import OPTIMIZERS

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 3
RANKS = 2
MODEL = ModelSpec(kind="mlp", layers=4, hidden=8)
SYNC = [name for name, info in SCHEDULES.items() if info.synchronous]
SETTINGS: dict[str, dict[str, object]] = {
    # case -> its training fields: rates at which three steps move the weights visibly, not wildly
    "sgd": {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9},
    "nesterov": {"optimizer": "nesterov", "lr": 0.05, "momentum": 0.9},
    "adam": {"optimizer": "adam", "lr": 1e-2},
    "adamw": {"optimizer": "adamw", "lr": 1e-2},
    "rmsprop": {"optimizer": "rmsprop", "lr": 1e-3, "momentum": 0.5},
    "rmsprop-no-momentum": {"optimizer": "rmsprop", "lr": 1e-3, "momentum": 0.0},
    "adabelief": {"optimizer": "adabelief", "lr": 1e-2},
}
FAST = ("1f1b", "zb-h1", "interleaved-1f1b", "chimera")
"""Run by the distributed runtime by default: 1F1B, split backward, chunks, replicated parts."""


def test_the_grid_covers_the_registry() -> None:
    assert {s["optimizer"] for s in SETTINGS.values()} == set(OPTIMIZERS)
    assert set(FAST) <= set(SYNC)


def _config(name: str, case: str) -> TrainConfig | None:
    """``name`` on ``RANKS`` ranks with ``case``'s optimizer, at the first T the schedule takes (None: none)."""
    info = SCHEDULES[name]
    for t in (4, 2, 8):
        config = train_config(
            schedule=name,
            num_stages=RANKS,
            num_microbatches=t,
            model=MODEL,
            batch_size=2 * t + 1,  # the last microbatch is smaller
            steps=STEPS,
            collect_parameters=True,
            num_chunks=2 if info.chunks is None else None,
            **SETTINGS[case],
        )
        try:
            if prepare(config).schedule.num_ranks == RANKS:
                return config
        except ScheduleError:
            continue
    return None


@functools.cache
def _plain(config: TrainConfig) -> TrainResult:
    return run_plain(
        config.model,
        steps=STEPS,
        batch_size=config.batch_size,
        num_microbatches=config.num_microbatches,
        optimizer_factory=optimizer_factory(config),
    )


def _assert_equal(losses: list[float], params: dict[str, torch.Tensor], plain: TrainResult) -> None:
    torch.testing.assert_close(losses, plain.losses, rtol=1e-5, atol=1e-6)
    for name, value in params.items():
        torch.testing.assert_close(value, plain.parameters[name], rtol=1e-5, atol=1e-6, msg=name)


def _checked(name: str, case: str) -> TrainConfig:
    config = _config(name, case)
    if config is None:
        pytest.skip(f"{name} takes no T of 2, 4, 8 on {RANKS} ranks")
    return config


@pytest.mark.parametrize("case", list(SETTINGS))
@pytest.mark.parametrize("name", SYNC)
def test_reference_equals_plain_training(name: str, case: str) -> None:
    config = _checked(name, case)
    plain = _plain(config)
    result = run_reference(
        build_schedule(config),
        config.model,
        steps=STEPS,
        batch_size=config.batch_size,
        optimizer_factory=optimizer_factory(config),
    )
    assert result.losses[-1] < result.losses[0]  # it trained: the comparison is not of two untouched models
    for stage_params in result.stage_parameters:  # every replica of every part
        _assert_equal(result.losses, stage_params, plain)


def _run_all(context: RankContext, configs: list[TrainConfig]) -> list[RunRecord | None]:
    return [run_rank(context, prepare(c)) for c in configs]


def _launch(names: list[str]) -> dict[tuple[str, str], tuple[TrainConfig, RunRecord]]:
    configs = {(n, c): config for n in names for c in SETTINGS if (config := _config(n, c)) is not None}
    records = launch(_run_all, list(configs.values()), RANKS, LaunchOptions(timeout_s=120))
    return {key: (config, record) for (key, config), record in zip(configs.items(), records)}


@pytest.fixture(scope="module")
def fast_runs() -> dict[tuple[str, str], tuple[TrainConfig, RunRecord]]:
    return _launch(list(FAST))


@pytest.fixture(scope="module")
def slow_runs() -> dict[tuple[str, str], tuple[TrainConfig, RunRecord]]:
    return _launch([n for n in SYNC if n not in FAST])


def _assert_run_equals_plain(runs: dict[tuple[str, str], tuple[TrainConfig, RunRecord]], name: str, case: str) -> None:
    if (name, case) not in runs:
        pytest.skip(f"{name} takes no T of 2, 4, 8 on {RANKS} ranks")
    config, record = runs[name, case]
    plain = _plain(config)
    seen = set()
    for rank_record in record.ranks:
        for params in rank_record.parameters.values():
            _assert_equal(record.losses, params, plain)
            seen |= set(params)
    assert seen == set(plain.parameters)


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(SETTINGS))
@pytest.mark.parametrize("name", FAST)
def test_distributed_equals_plain_training(
    fast_runs: dict[tuple[str, str], tuple[TrainConfig, RunRecord]], name: str, case: str
) -> None:
    _assert_run_equals_plain(fast_runs, name, case)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(SETTINGS))
@pytest.mark.parametrize("name", [n for n in SYNC if n not in FAST])
def test_distributed_equals_plain_training_slow(
    slow_runs: dict[tuple[str, str], tuple[TrainConfig, RunRecord]], name: str, case: str
) -> None:
    _assert_run_equals_plain(slow_runs, name, case)
