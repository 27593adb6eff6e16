"""Variable shapes: microbatches of their own sequence length cross ranks unpadded and train as plain training.

The gpt's corpus with ``min_seq_len`` cuts each microbatch of each step to its
own length (as a dataset without packing gives them); every message then
carries its shape (``transport.p2p``). 1F1B and ZB-H1 (whose input and
weight gradients split the backward) on 2 ranks, through gloo and through the
shared-memory rings, must give plain training's losses and parameters on the
same unpadded microbatches.
"""

from __future__ import annotations

import functools

import pytest
import torch
from config_defaults import train_config

from pipeweave.config import TrainConfig
from pipeweave.data import data_source, step_microbatches
from pipeweave.errors import UserError
from pipeweave.models import ModelSpec
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.plain import TrainResult, run_plain
from pipeweave.runtime.report.trace import microbatch_factors
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import optimizer_factory, prepare
from pipeweave.runtime.run.record import RunRecord

GPT = ModelSpec(kind="gpt", layers=2, hidden=16, heads=2, seq_len=12)
LLAMA = ModelSpec(kind="llama", layers=2, hidden=16, heads=4, kv_heads=2, seq_len=12, ffn_hidden=32)
STEPS, MIN_SEQ_LEN = 3, 3


def _config(schedule: str, model: ModelSpec = GPT) -> TrainConfig:
    return train_config(
        schedule=schedule,
        num_stages=2,
        num_microbatches=3,
        model=model,
        batch_size=5,
        steps=STEPS,
        min_seq_len=MIN_SEQ_LEN,
        collect_parameters=True,
    )


def _run_all(context: RankContext, configs: list[TrainConfig]) -> list[RunRecord | None]:
    return [run_rank(context, prepare(c)) for c in configs]


@functools.cache
def _plain(model: ModelSpec) -> TrainResult:
    config = _config("1f1b", model)
    source = data_source(model, batch_size=config.batch_size, min_seq_len=MIN_SEQ_LEN)
    return run_plain(
        model,
        steps=STEPS,
        batch_size=config.batch_size,
        num_microbatches=config.num_microbatches,
        optimizer_factory=optimizer_factory(config),
        data=source,
    )


def test_the_lengths_vary_from_microbatch_to_microbatch_and_step_to_step() -> None:
    source = data_source(GPT, batch_size=5, min_seq_len=MIN_SEQ_LEN)
    shapes = [[tuple(x.shape) for x in step_microbatches(source, step, 3)[0]] for step in range(STEPS)]
    assert [[n for n, _ in step] for step in shapes] == [[2, 2, 1]] * STEPS  # the samples as the batch splits them
    lengths = [n for step in shapes for _, n in step]
    assert len(set(lengths)) > 2 and all(MIN_SEQ_LEN <= n <= GPT.seq_len for n in lengths)
    assert len({tuple(n for _, n in step) for step in shapes}) == STEPS


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_variable_lengths_on_2_ranks_equal_plain_training(transport: str) -> None:
    configs = [_config("1f1b"), _config("zb-h1"), _config("zb-h1", LLAMA)]  # the llama: rotary on each length
    records = launch(_run_all, configs, 2, LaunchOptions(timeout_s=60, transport=transport))
    for config, record in zip(configs, records):
        plain = _plain(config.model)
        torch.testing.assert_close(record.losses, plain.losses, rtol=1e-5, atol=1e-6)
        seen = set()
        for rank_record in record.ranks:
            for params in rank_record.parameters.values():
                for name, value in params.items():
                    torch.testing.assert_close(
                        value,
                        plain.parameters[name],
                        rtol=1e-5,
                        atol=1e-6,
                        msg=lambda m: f"{config.schedule} {name}: {m}",
                    )
                    seen.add(name)
        assert seen == set(plain.parameters)
    # the report simulates each step with its microbatches' tokens: the lengths the ranks trained on
    schedule = prepare(configs[0]).schedule
    factors = microbatch_factors(schedule, records[0])
    source = data_source(GPT, batch_size=5, min_seq_len=MIN_SEQ_LEN)
    for step in range(STEPS):
        tokens = [x.numel() for x in step_microbatches(source, step, 3)[0]]
        assert factors[step] == pytest.approx([n * 3 / sum(tokens) for n in tokens])


def test_min_seq_len_is_refused_in_one_line_where_it_cannot_apply() -> None:
    with pytest.raises(UserError, match=r"^--min-seq-len 13 is invalid; give a length in \[1, --seq-len 12\]$"):
        train_config(model=GPT, min_seq_len=13)
    with pytest.raises(UserError, match=r"^--min-seq-len applies to models of sequences .*, not mlp; drop "):
        train_config(model=ModelSpec(kind="mlp"), min_seq_len=2)
    with pytest.raises(UserError, match=r"^--min-seq-len applies to synchronous schedules; pipedream is"):
        train_config(schedule="pipedream", model=GPT, min_seq_len=2)
