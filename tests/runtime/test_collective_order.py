"""Every collective is issued in one order on every rank of its group (as NCCL needs), with pp x dp x tp.

A recording shim wraps ``torch.distributed``'s collectives on each rank of a
run with two stage ranks, two data-parallel replicas and two tensor-parallel
shards (8 processes, gloo): each call is logged with its group's ranks, its
name and the shape of its tensor. For every group, each of its ranks must have
issued the same sequence of collectives on it. Gloo happens to match calls of
mismatched collectives less strictly than NCCL; NCCL hangs or corrupts.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from config_defaults import train_config

from pipeweave.config import TrainConfig
from pipeweave.models import ModelSpec
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import prepare
from pipeweave.runtime.stage.post_validation import PostValidation

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(400)]

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "barrier",
    "all_to_all_single",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
)

Call = tuple[tuple[int, ...], str, tuple[int, ...]]  # (group's ranks, collective, shape of its first tensor)


def _shape(arguments: dict[str, Any]) -> tuple[int, ...]:
    for value in arguments.values():
        if isinstance(value, torch.Tensor):
            return tuple(value.shape)
        if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
            return (len(value), *value[0].shape)
    return ()


def _recording(name: str, original: Callable[..., Any], calls: list[Call]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        arguments = signature.bind(*args, **kwargs).arguments
        group = arguments.get("group")
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
        calls.append((ranks, name, _shape(arguments)))
        return original(*args, **kwargs)

    return wrapper


def _record_collectives(context: RankContext, config: TrainConfig) -> list[list[Call]]:
    """Train ``config`` logging this rank's collectives; every rank's log, gathered (outside the log)."""
    calls: list[Call] = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES}
    for name, original in originals.items():
        setattr(dist, name, _recording(name, original, calls))
    try:
        run_rank(context, prepare(config))
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    every: list[Any] = [None] * context.world
    dist.all_gather_object(every, calls)
    return every


def test_every_rank_of_a_group_issues_its_collectives_in_one_order() -> None:
    config = train_config(
        schedule="zb-h1",
        num_stages=2,
        num_microbatches=4,
        model=ModelSpec(kind="gpt", layers=2, hidden=16, heads=4, seq_len=8),
        batch_size=15,
        steps=2,
        tensor_parallel=2,
        data_parallel=2,
        post_validation=PostValidation(max_norm=0.5),  # with tp: the norm by all-reduces at U (runtime.clip)
    )
    every = launch(_record_collectives, config, 8, LaunchOptions(transport="gloo", timeout_s=300))
    groups = {ranks for calls in every for ranks, _, _ in calls}
    assert len(groups) >= 4, groups  # the world's, and tp, dp and pp groups at least
    assert any(len(ranks) == 2 for ranks in groups)
    for ranks in groups:
        orders = {rank: [c[1:] for c in every[rank] if c[0] == ranks] for rank in ranks}
        first = orders[ranks[0]]
        assert first, ranks
        for rank, order in orders.items():
            assert order == first, (ranks, rank, order, first)
