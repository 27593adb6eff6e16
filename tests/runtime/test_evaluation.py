"""Evaluation through the forward-only pipeline, on every synchronous schedule.

One process group of 2 ranks trains a tiny gpt on each synchronous schedule
of the registry, evaluating after every step. The last held-out loss must be
the loss of the final weights on the held-out batches computed in one
process, and the training losses must be plain training's: evaluating
changes nothing of what is trained.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from config_defaults import train_config
from torch import nn

from pipeweave.config import TrainConfig
from pipeweave.data import ByteCorpus, stdlib_sources
from pipeweave.models import ModelSpec
from pipeweave.models.build import build_layers
from pipeweave.models.spec import loss_fn
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.plain import run_plain
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import prepare
from pipeweave.runtime.run.record import RunRecord
from pipeweave.schedule import SCHEDULES, ScheduleError

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

GPT = ModelSpec(kind="gpt", layers=4, hidden=16, heads=2, seq_len=8)
STEPS, EVAL_BATCHES = 2, 2


def _run_all(context: RankContext, configs: list[TrainConfig]) -> list[RunRecord | None]:
    return [run_rank(context, prepare(c)) for c in configs]


def _cases(text: Path) -> dict[str, TrainConfig]:
    cases = {}
    for name, info in SCHEDULES.items():
        if not info.synchronous:
            continue
        for t in (4, 6, 8):
            config = train_config(
                schedule=name,
                num_stages=2,
                num_microbatches=t,
                model=GPT,
                batch_size=2 * t - 1,
                steps=STEPS,
                data=str(text),
                eval_every=1,
                eval_batches=EVAL_BATCHES,
                num_chunks=2 if info.chunks is None else None,
            )
            try:
                schedule = prepare(config).schedule
            except ScheduleError:
                continue
            if schedule.num_ranks == 2:
                cases[name] = config
                break
    return cases


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[TrainConfig, RunRecord]]:
    text = tmp_path_factory.mktemp("corpus") / "text.txt"
    text.write_bytes(stdlib_sources(max_bytes=200_000))
    cases = _cases(text)
    records = launch(_run_all, list(cases.values()), 2, LaunchOptions(timeout_s=60))
    return dict(zip(cases, zip(cases.values(), records)))


@pytest.mark.parametrize("name", [n for n, info in SCHEDULES.items() if info.synchronous])
def test_held_out_loss_is_the_final_weights_loss_and_training_is_unchanged(
    runs: dict[str, tuple[TrainConfig, RunRecord]], name: str
) -> None:
    if name not in runs:
        pytest.skip(f"{name} does not run on 2 ranks with this model")
    config, record = runs[name]
    assert config.data is not None
    corpus = ByteCorpus(Path(config.data.path).read_bytes(), seq_len=GPT.seq_len, batch_size=config.batch_size)
    plain = run_plain(
        GPT, steps=STEPS, batch_size=config.batch_size, num_microbatches=config.num_microbatches, data=corpus
    )
    torch.testing.assert_close(record.losses, plain.losses, rtol=1e-5, atol=1e-6)
    model = nn.ModuleDict({str(i): layer for i, layer in enumerate(build_layers(GPT, range(GPT.num_layers)))})
    model.load_state_dict(plain.parameters)
    with torch.no_grad():
        held_out = []
        for k in range(EVAL_BATCHES):
            x, y = corpus.eval_batch(k)
            for layer in model.values():
                x = layer(x)
            held_out.append(float(loss_fn(GPT)(x, y)))
    assert [at for at, _ in record.eval_losses] == [1, 2]
    assert record.eval_losses[-1][1] == pytest.approx(sum(held_out) / EVAL_BATCHES, rel=1e-5)
    assert record.eval_losses[0][1] != record.eval_losses[1][1]  # the weights moved between the two


def test_evaluation_is_refused_where_it_cannot_run(tmp_path: Path) -> None:
    from pipeweave.errors import UserError

    with pytest.raises(UserError, match="--eval-every 3 is not a multiple of avgpipe's P=2 pipelines"):
        prepare(train_config(schedule="avgpipe", model=GPT, eval_every=3, steps=8))
    with pytest.raises(UserError, match="--eval-every applies to --model gpt"):
        prepare(train_config(model=ModelSpec(kind="mlp"), eval_every=2))
    short = tmp_path / "short.txt"
    short.write_bytes(b"x" * 15)
    with pytest.raises(UserError, match="too short to hold out a window of seq_len\\+1=9 tokens"):
        prepare(train_config(model=GPT, data=str(short), eval_every=2, batch_size=4))
    with pytest.raises(UserError, match="--eval-batches 0 is invalid"):
        train_config(model=GPT, eval_every=2, eval_batches=0)
