"""Batched point-to-point over real gloo: ``batch_isend_irecv`` groups, one per gap, train like plain training."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from config_defaults import train_config

from pipeweave.config import TrainConfig
from pipeweave.models import ModelSpec
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.plain import run_plain
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import optimizer_factory, prepare
from pipeweave.runtime.transport import p2p
from pipeweave.schedule import lower

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

STEPS = 3
CASES = {"1f1b": None, "zb-h1": None, "interleaved-1f1b": 2}


def _config(name: str, chunks: int | None) -> TrainConfig:
    return train_config(
        schedule=name,
        num_stages=2,
        num_chunks=chunks,
        num_microbatches=4,
        batch_size=7,  # does not divide: the last microbatch is smaller
        steps=STEPS,
        model=ModelSpec(kind="mlp", layers=8, hidden=8),
    )


def _run_counting(context: RankContext, configs: list[TrainConfig]) -> list[tuple[Any, list[list[list[int]]]]]:
    """Each run's record and, per rank, per step, the message count of each ``batch_isend_irecv`` group."""
    original, end_step = p2p.post_group, p2p.P2P.end_step
    out = []
    for config in configs:
        steps: list[list[int]] = [[]]

        def counting(ops: list[p2p.GroupOp], steps: list[list[int]] = steps) -> list[Any]:
            steps[-1].append(len(ops))
            return original(ops)

        def ending(self: p2p.P2P, steps: list[list[int]] = steps) -> None:
            end_step(self)
            steps.append([])

        p2p.post_group, p2p.P2P.end_step = counting, ending  # type: ignore[method-assign]  # this rank's own
        try:
            record = run_rank(context, prepare(config))
        finally:
            p2p.post_group, p2p.P2P.end_step = original, end_step  # type: ignore[method-assign]
        every: list[Any] = [None] * context.world
        dist.all_gather_object(every, steps[:-1])
        out.append((record, every))
    return out


def test_gloo_groups_train_like_plain_training() -> None:
    configs = [_config(name, chunks) for name, chunks in CASES.items()]
    results = launch(_run_counting, configs, 2, LaunchOptions(transport="gloo"))
    for config, (record, every) in zip(configs, results, strict=True):
        sizes = {"batch_size": config.batch_size, "num_microbatches": config.num_microbatches}
        plain = run_plain(config.model, steps=STEPS, optimizer_factory=optimizer_factory(config), **sizes)
        torch.testing.assert_close(record.losses, plain.losses, rtol=1e-5, atol=1e-6, msg=config.schedule)
        lowered = lower(prepare(config).schedule)
        for rank in range(2):
            first, *later = every[rank]
            computes = sum(1 for a in lowered.actions[rank] if a.op.is_compute)
            messages = sum(1 for a in lowered.actions[rank] if a.op.is_comm)
            assert len(later) == STEPS - 1 and sum(first) > messages  # the first step's shapes travel too
            for groups in later:  # shapes known: every gap's messages in one group, each message in one
                assert len(groups) <= computes + 1 and sum(groups) == messages, (config.schedule, rank, groups)
