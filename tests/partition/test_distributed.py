"""Partition, lazy construction and hybrid data x pipeline parallelism on real ranks (gloo, CPU)."""

from __future__ import annotations

import pytest
import torch
from config_defaults import train_config

from pipeweave.models import ModelSpec
from pipeweave.runtime.plain import run_plain
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.lazy import run_rank_recording_builds
from pipeweave.runtime.run.prepare import prepare

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]


def test_dp_x_pp_with_a_partition_equals_plain_training_and_builds_only_own_layers() -> None:
    spec = ModelSpec(kind="mlp", layers=5, hidden=16)
    config = train_config(
        schedule="1f1b",
        num_stages=2,
        num_microbatches=2,
        model=spec,
        batch_size=9,
        steps=3,
        layers_per_part=(3, 2),
        data_parallel=2,
        collect_parameters=True,
    )
    schedule = prepare(config).schedule
    assert schedule.num_ranks == 4
    record, built = launch(run_rank_recording_builds, prepare(config), schedule.num_ranks, LaunchOptions(timeout_s=60))
    plain = run_plain(spec, steps=3, batch_size=9, num_microbatches=4)
    assert record.losses == pytest.approx(plain.losses, rel=1e-5)
    # ranks as a grid: rank p*2 + r holds part r of replica p, and built exactly that part's layers, once
    assert built == [[0, 1, 2], [3, 4], [0, 1, 2], [3, 4]]
    for rank_record in record.ranks:
        for params in rank_record.parameters.values():
            for name, value in params.items():
                torch.testing.assert_close(value, plain.parameters[name], rtol=1e-5, atol=1e-6)
    # host weight memory per rank is its part's share, not the model's
    per_layer = sum(p.numel() * 4 for p in plain.parameters.values()) // 5
    assert [r.weight_bytes for r in record.ranks] == [3 * per_layer, 2 * per_layer] * 2
