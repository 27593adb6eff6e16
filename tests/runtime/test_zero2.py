"""ZeRO-2 (``--zero 2``): the gradients reduce-scattered after every B or W, each of the P = 2 replicas keeping its
slice, train as plain training and as ZeRO 0 and 1 do, and keep half the gradient bytes.

Cases on P = 2 replicas of a D = 2 pipeline (4 processes, gloo): zero-bubble's deferred W (ZB-H1), 1F1B with
AdamW over buckets of ~500 B (several per part, padded slices), and 1F1B with clipping by the global norm; each
accumulates the gradients of T = 4 microbatches per replica. Tolerance as ``test_parallel_3d``'s (rtol 1e-5,
atol 1e-6): a microbatch's gradient is summed over the replicas before the microbatches' are summed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from config_defaults import train_config

from pipeweave.config import TrainConfig
from pipeweave.models import ModelSpec
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.plain import run_plain
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.memory import estimate_memory
from pipeweave.runtime.run.prepare import optimizer_factory, prepare
from pipeweave.runtime.run.record import RunRecord
from pipeweave.runtime.stage.post_validation import PostValidation

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(300)]

GPT = ModelSpec(kind="gpt", layers=2, hidden=16, heads=4, seq_len=8)
MLP = ModelSpec(kind="mlp", layers=4, hidden=8)


def _config(schedule: str, model: ModelSpec, zero: int, **extra: Any) -> TrainConfig:
    fields: dict[str, Any] = dict(
        schedule=schedule,
        num_stages=2,
        num_microbatches=4,
        model=model,
        batch_size=15,  # uneven microbatches: 4 + 4 + 4 + 3 samples on one replica
        steps=2,
        collect_parameters=True,
        data_parallel=2,
        zero=zero,
        momentum=0.9,
    )
    fields.update(extra)
    return train_config(**fields)


ADAMW = dict(optimizer="adamw", lr=1e-2, bucket_mb=0.0005, momentum=None)
CLIP = dict(post_validation=PostValidation(max_norm=0.5))
CASES = {
    **{f"zb-h1-zero{z}": _config("zb-h1", GPT, z) for z in (0, 1, 2)},
    "1f1b-adamw-zero2": _config("1f1b", MLP, 2, **ADAMW),
    "1f1b-clip-zero2": _config("1f1b", GPT, 2, **CLIP),
}


def _run_all(context: RankContext, configs: list[TrainConfig]) -> list[RunRecord | None]:
    return [run_rank(context, prepare(c)) for c in configs]


@pytest.fixture(scope="module")
def runs() -> dict[str, RunRecord]:
    return dict(zip(CASES, launch(_run_all, list(CASES.values()), 4, LaunchOptions(timeout_s=120))))


def _parameters(record: RunRecord) -> dict[str, torch.Tensor]:
    return {n: v for r in record.ranks for params in r.parameters.values() for n, v in params.items()}


@pytest.mark.parametrize("case", [c for c in CASES if "zero2" in c])
def test_zero2_trains_as_plain_training(runs: dict[str, RunRecord], case: str) -> None:
    config = CASES[case]
    plain = run_plain(
        config.model,
        steps=config.steps,
        batch_size=config.batch_size,
        num_microbatches=config.num_microbatches * config.data_parallel,
        optimizer_factory=optimizer_factory(config),
        clip_grad_norm=None if config.post_validation is None else config.post_validation.max_norm,
    )
    record = runs[case]
    torch.testing.assert_close(record.losses, plain.losses, rtol=1e-5, atol=1e-6)
    assert record.losses[-1] < record.losses[0]
    got = _parameters(record)
    assert set(got) == set(plain.parameters)
    for name, value in plain.parameters.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_zero2_equals_zero0_and_zero1_with_deferred_w(runs: dict[str, RunRecord]) -> None:
    """ZB-H1's W adds each microbatch's weight gradient late; ZeRO-2 reduce-scatters it then, as B's."""
    for other in ("zb-h1-zero0", "zb-h1-zero1"):
        torch.testing.assert_close(runs["zb-h1-zero2"].losses, runs[other].losses, rtol=1e-5, atol=1e-6)
        want = _parameters(runs[other])
        for name, value in _parameters(runs["zb-h1-zero2"]).items():
            torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_zero2_keeps_half_the_gradient_bytes_at_two_replicas(runs: dict[str, RunRecord]) -> None:
    """Measured between actions (``RankRecord.gradient_bytes``): ZeRO-0 the part's whole gradient, ZeRO-1 the
    whole and the reduced half beside it at U, ZeRO-2 the half, and the layer norms' gradients an I writes itself
    (its weight GEMMs' wait for W) until the W after it -- 2 x 16 floats a norm, the first stage's two (256 bytes)
    and the last's three (384) -- which the memory estimate's ``gradients`` leaves out; the rest it counts
    exactly."""
    norms = [2 * 16 * 4 * n for n in (2, 3)]  # per stage rank of a replica
    for k, (z0, z1, z2) in enumerate(zip(*(runs[f"zb-h1-zero{z}"].ranks for z in (0, 1, 2)))):
        assert z0.gradient_bytes > 0
        assert z2.gradient_bytes == z0.gradient_bytes / 2 + norms[k % 2]  # every part has an even element count
        assert z1.gradient_bytes == z0.gradient_bytes * 3 / 2
    for z in (0, 1, 2):
        estimate = estimate_memory(prepare(CASES[f"zb-h1-zero{z}"])).gradients
        measured = [r.gradient_bytes for r in runs[f"zb-h1-zero{z}"].ranks]
        assert [m - e for e, m in zip(estimate, measured)] == ([0] * 4 if z < 2 else norms * 2), (z, estimate, measured)


def test_zero2_estimate_keeps_a_part_whole_only_during_its_backward() -> None:
    """The weights term at P = 2, AdamW, one part per rank, in part weights w: ZeRO-1 holds w (parameters) + w
    (whole gradient) + (2 + 2) w / 2 (moments, parameter and gradient slices) = 4w; ZeRO-2 the same slices
    and, during a B or W, the whole gradient and the slice its reduce-scatter returns: w + 2w + 1.5w = 4.5w
    (one part per rank: the saving is between actions, ``gradients``)."""
    config = dataclasses.replace(CASES["zb-h1-zero1"], optimizer="adamw", momentum=None)
    z1 = estimate_memory(prepare(config))
    z2 = estimate_memory(prepare(dataclasses.replace(config, zero=2)))
    for a, b, ga, gb in zip(z1.weights, z2.weights, z1.gradients, z2.gradients):
        assert b / a == pytest.approx(4.5 / 4)
        assert gb / ga == pytest.approx(0.5 / 1.5)
