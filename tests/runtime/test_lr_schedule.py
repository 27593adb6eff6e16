"""Learning-rate schedules: the rates themselves, and a distributed run equal to plain training with them."""

from __future__ import annotations

import math

import pytest
import torch
from config_defaults import train_config

from pipeweave.config import TrainConfig
from pipeweave.errors import UserError
from pipeweave.models import ModelSpec
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.plain import run_plain
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import learning_rates, optimizer_factory, prepare
from pipeweave.runtime.stage.lr_schedule import MIN_RATIO, LrSchedule
from pipeweave.runtime.stage.post_validation import PostValidation


def test_warmup_then_decay_to_a_tenth() -> None:
    cosine, linear = LrSchedule("cosine", 2.0, 4, 12), LrSchedule("linear", 2.0, 4, 12)
    assert [cosine.at(k) for k in range(4)] == [0.5, 1.0, 1.5, 2.0]
    assert cosine.at(4) == linear.at(4) == 2.0
    assert cosine.at(8) == pytest.approx(2.0 * (MIN_RATIO + (1 - MIN_RATIO) * 0.5))
    assert linear.at(8) == pytest.approx(cosine.at(8))  # both halfway at the middle
    assert linear.at(6) == pytest.approx(2.0 * (MIN_RATIO + (1 - MIN_RATIO) * 0.75))
    assert cosine.at(6) == pytest.approx(2.0 * (MIN_RATIO + (1 - MIN_RATIO) * 0.5 * (1 + math.cos(math.pi / 4))))
    assert cosine.at(12) == cosine.at(100) == linear.at(50) == pytest.approx(2.0 * MIN_RATIO)
    assert LrSchedule("constant", 3.0).at(7) == 3.0 and LrSchedule("constant", 3.0, 2).at(0) == 1.5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "step"}, "--lr-schedule 'step' is unknown"),
        ({"kind": "cosine", "warmup": 5, "decay_steps": 5}, "--lr-decay-steps 5 .* must exceed --lr-warmup 5"),
        ({"kind": "constant", "warmup": -1}, "--lr-warmup -1 is invalid"),
    ],
)
def test_bad_schedules_are_one_line(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(UserError, match=message):
        LrSchedule(lr=1.0, **kwargs)  # type: ignore[arg-type]


def _run_all(context: RankContext, configs: list[TrainConfig]) -> list[object]:
    return [run_rank(context, prepare(c)) for c in configs]


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_distributed_runs_with_a_schedule_equal_plain_training_with_it() -> None:
    mlp = ModelSpec(kind="mlp", layers=4, hidden=8)
    common = dict(
        num_stages=2, num_microbatches=4, model=mlp, batch_size=8, steps=6, collect_parameters=True, lr_warmup=2
    )
    configs = [
        train_config(schedule="1f1b", lr_schedule="cosine", momentum=0.9, **common),  # type: ignore[arg-type]
        train_config(
            schedule="zb-h1",
            lr_schedule="linear",
            optimizer="adamw",
            lr=1e-2,  # type: ignore[arg-type]
            post_validation=PostValidation(max_norm=1e9),
            **common,
        ),
    ]
    for c in configs:
        prepare(c)
    records = launch(_run_all, configs, 2, LaunchOptions(timeout_s=60))
    for config, record in zip(configs, records):
        rates = learning_rates(config)
        plain = run_plain(
            mlp, steps=6, batch_size=8, num_microbatches=4, optimizer_factory=optimizer_factory(config), lr_at=rates.at
        )
        constant = run_plain(
            mlp, steps=6, batch_size=8, num_microbatches=4, optimizer_factory=optimizer_factory(config)
        )
        assert record is not None
        torch.testing.assert_close(record.losses, plain.losses, rtol=1e-5, atol=1e-6)
        assert record.losses[2:] != pytest.approx(constant.losses[2:], rel=1e-4)  # the schedule did something
        for r in record.ranks:
            for params in r.parameters.values():
                for name, value in params.items():
                    torch.testing.assert_close(value, plain.parameters[name], rtol=1e-5, atol=1e-6)
