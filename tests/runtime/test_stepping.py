"""``pipeweave.Pipeline`` driven one ``step`` at a time equals ``pipeweave train``'s run of the same config.

Two gloo ranks build a ``Pipeline`` per config and drive ``step()`` with
exactly the batches ``pipeweave train`` takes (``data_source(...).batch(k)``);
the losses the last stage's ranks return must be the record's of the train
path (``launch(run_rank, prepare(config))``), to the bit: the same executor
runs the same actions on the same data. A gpt (I/W split), an mlp with
AdamW, Chimera with a learning-rate schedule and plain data parallelism
(both: the last part has a replica on each rank, their loss shares summed
across ranks), and a gpt split by tensor parallelism (each process of the
group returns the loss).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pipeweave import Pipeline
from pipeweave.config import TrainConfig
from pipeweave.data import data_source
from pipeweave.errors import UserError
from pipeweave.models import ModelSpec
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import prepare

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

STEPS = 3
CONFIGS = {
    "gpt-zb-h1": TrainConfig(
        schedule="zb-h1",
        num_stages=2,
        num_microbatches=3,
        steps=STEPS,
        batch_size=6,
        model=ModelSpec(kind="gpt", layers=2, hidden=16, heads=2, seq_len=8),
    ),
    "mlp-1f1b-adamw": TrainConfig(
        schedule="1f1b",
        num_stages=2,
        num_microbatches=4,
        steps=STEPS,
        batch_size=7,
        model=ModelSpec(kind="mlp", layers=4, hidden=8),
        optimizer="adamw",
        lr=1e-2,
    ),
    "mlp-chimera-warmup": TrainConfig(
        schedule="chimera",
        num_stages=2,
        num_microbatches=4,
        steps=STEPS,
        batch_size=8,
        model=ModelSpec(kind="mlp", layers=4, hidden=8),
        lr_warmup=2,
        lr_schedule="cosine",
    ),
    "gpt-tp2": TrainConfig(
        schedule="1f1b",
        num_stages=1,
        tensor_parallel=2,
        num_microbatches=2,
        steps=STEPS,
        batch_size=4,
        model=ModelSpec(kind="gpt", layers=2, hidden=16, heads=2, seq_len=8),
    ),
    "mlp-dp2": TrainConfig(
        schedule="1f1b",
        num_stages=1,
        data_parallel=2,
        num_microbatches=4,
        steps=STEPS,
        batch_size=8,
        model=ModelSpec(kind="mlp", layers=2, hidden=8),
    ),
}

# fp16, step 0 overflowing at 2**40: skipped, not a divergence (under post-validation's 'skipped' outcome too)
CONFIGS["mlp-1f1b-fp16-clip"] = CONFIGS["mlp-1f1b-adamw"].replace(
    precision="fp16", loss_scale=2.0**40, loss_scale_backoff=2.0**-30, clip_grad_norm=1.0
)


def _trained(context: RankContext, configs: list[TrainConfig]) -> list[object]:
    return [run_rank(context, prepare(c)) for c in configs]


def _stepped(context: RankContext, configs: list[TrainConfig]) -> list[list[tuple[bool, list[float | None]]]]:
    """Per config, every rank's ``(has_loss, what step returned)``, gathered to every rank."""
    out = []
    for config in configs:
        pipe = Pipeline(config)
        source = data_source(config.model, batch_size=config.batch_size, seed=config.seed)
        losses = [pipe.step(source.batch(k)) for k in range(config.steps)]
        gathered: list[object] = [None] * context.world
        dist.all_gather_object(gathered, (pipe.has_loss, losses))
        out.append(gathered)
    return out


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[object, list[tuple[bool, list[float | None]]]]]:
    configs = list(CONFIGS.values())
    trained = launch(_trained, configs, 2, LaunchOptions(timeout_s=60))
    stepped = launch(_stepped, configs, 2, LaunchOptions(timeout_s=60))
    return dict(zip(CONFIGS, zip(trained, stepped)))


@pytest.mark.parametrize("case", list(CONFIGS))
def test_step_equals_train(runs: dict[str, tuple[object, list[tuple[bool, list[float | None]]]]], case: str) -> None:
    record, ranks = runs[case]
    with_loss = [losses for has_loss, losses in ranks if has_loss]
    assert with_loss, "no rank holds the last stage"
    for has_loss, losses in ranks:
        if not has_loss:
            assert losses == [None] * STEPS
    for losses in with_loss:
        torch.testing.assert_close(losses, record.losses, rtol=0, atol=0)  # type: ignore[attr-defined]


def test_needs_a_process_group() -> None:
    with pytest.raises(UserError, match="init_process_group"):
        Pipeline(TrainConfig())


@pytest.fixture
def alone(tmp_path: object) -> object:
    """A process group of this one process (gloo), destroyed after the test."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"schedule": "pipedream"}, "pipedream is asynchronous: .* pipeweave.train"),
        ({"save": "checkpoints"}, "--save is an option of a whole run"),
        ({"eval_every": 2}, "--eval-every is an option of a whole run"),
        ({}, "the process group has 1 processes but the run needs 2"),
    ],
)
def test_refusals_are_one_line(alone: object, overrides: dict[str, object], message: str) -> None:
    config = TrainConfig(num_stages=2, model=ModelSpec(kind="mlp", layers=4, hidden=8), **overrides)  # type: ignore[arg-type]
    with pytest.raises(UserError, match=message) as caught:
        Pipeline(config)
    assert "\n" not in str(caught.value)
