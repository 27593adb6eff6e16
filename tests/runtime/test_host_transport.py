"""``--transport host``: messages staged through host buffers (ranks sharing one GPU), exercised on CPU tensors."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import torch
from config_defaults import train_config

from pipeweave.commands.train_run import _check_transport
from pipeweave.errors import UserError
from pipeweave.models import ModelSpec
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import HOST_UNDER_NCCL, LaunchOptions, backend_for, launch
from pipeweave.runtime.run.prepare import prepare
from pipeweave.runtime.transport.host import HostTransport, StagingPool, as_bytes


def _config(name: str = "1f1b", steps: int = 3, **rest: Any) -> Any:
    return train_config(
        schedule=name,
        num_stages=2,
        num_microbatches=3,
        batch_size=7,  # the last microbatch smaller: two message sizes
        steps=steps,
        model=ModelSpec(kind="gpt", layers=2, hidden=16, heads=2, seq_len=8),
        **rest,
    )


def test_staging_buffers_are_reused_once_their_message_is_through() -> None:
    pool = StagingPool(pin=False)
    done = [False]
    first = pool.take(64)
    pool.release(first, lambda: done[0])
    second = pool.take(64)  # the first is still in use
    assert second.data_ptr() != first.data_ptr() and pool.made == 2
    done[0] = True
    assert pool.take(64).data_ptr() == first.data_ptr() and pool.made == 2
    assert pool.take(32).numel() == 32 and pool.made == 3  # another size: its own buffer


def test_a_message_is_its_tensor_s_bytes() -> None:
    x = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    assert as_bytes(x).dtype == torch.uint8 and as_bytes(x).numel() == 12
    assert as_bytes(x).data_ptr() == x.data_ptr()  # a view: no copy
    with pytest.raises(ValueError, match="contiguous"):
        as_bytes(x.t())


def _runs_and_staging(context: RankContext, configs: list[Any]) -> list[Any]:
    """Each run's record (rank 0) and, on every rank, the staging buffers made by the end of each run."""
    assert isinstance(context.transport, HostTransport)
    out = []
    for config in configs:
        record = run_rank(context, prepare(config))
        out.append((record, context.transport.pool.made))
    return out


def _runs(context: RankContext, configs: list[Any]) -> list[Any]:
    return [run_rank(context, prepare(config)) for config in configs]


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_host_staged_runs_equal_gloo_and_stop_allocating_after_the_first_step() -> None:
    configs = [_config(name) for name in ("1f1b", "zb-h1")] + [_config("1f1b", steps=8)]
    staged = launch(_runs_and_staging, configs, 2, LaunchOptions(transport="host"))
    plain = launch(_runs, configs[:2], 2, LaunchOptions(transport="gloo"))
    for (record, _), reference in zip(staged, plain):
        assert record.transport == "host" and reference.transport == "gloo"
        assert record.losses == reference.losses  # the same bytes, another way: bitwise
    made_after_3, made_after_8 = staged[0][1], staged[2][1]
    assert made_after_3 > 0 and made_after_8 == staged[1][1]  # 8 more steps of 1F1B: not one buffer more


def test_host_is_refused_under_torchrun_and_needed_for_more_ranks_than_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = prepare(_config())
    with pytest.raises(UserError, match=f"^{HOST_UNDER_NCCL}$"):
        _check_transport(argparse.Namespace(transport="host"), plan, torchrun=True)
    assert "NCCL" in HOST_UNDER_NCCL and "\n" not in HOST_UNDER_NCCL
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError, match="^2 ranks on 1 GPU.*NCCL refuses two ranks on one GPU; give --transport host"):
        _check_transport(argparse.Namespace(transport="auto"), plan, torchrun=False)
    _check_transport(argparse.Namespace(transport="host"), plan, torchrun=False)  # the harness: allowed
    cuda = torch.device("cuda", 0)
    assert backend_for(cuda, LaunchOptions(transport="host")) == "gloo"
    assert backend_for(cuda, LaunchOptions()) == "nccl" and backend_for(torch.device("cpu"), LaunchOptions()) == "gloo"
