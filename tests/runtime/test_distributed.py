"""Exactness of the distributed executor: every synchronous schedule equals plain training.

For each synchronous schedule of the registry (read at test time), with and
without activation recomputation, on 2 and 3 gloo ranks, the per-step losses
and every stage's final parameters of a real multi-process run must equal
those of plain single-process training with gradient accumulation and of the
reference executor. One process group per rank count runs every
configuration, since starting ranks costs more than these tiny runs.
The batch does not divide by T, so the last microbatches are smaller and the
shape handshake's per-microbatch sizes are exercised.
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
from pipeweave.runtime.run.sizes import microbatch_sizes
from pipeweave.schedule import SCHEDULES, ScheduleError

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

RANKS = (2, 3)
STEPS = 2


def _run_all(context: RankContext, configs: list[TrainConfig]) -> list[RunRecord | None]:
    return [run_rank(context, prepare(c)) for c in configs]


def _config(name: str, ranks: int, recompute: bool, **overrides: object) -> TrainConfig | None:
    """A tiny mlp run of ``name`` on ``ranks`` ranks with the first T the schedule accepts."""
    info = SCHEDULES[name]
    for t in (4, 6, 8):
        fields: dict[str, object] = dict(
            schedule=name,
            num_stages=ranks,
            num_microbatches=t,
            model=ModelSpec(kind="mlp", layers=4 * ranks, hidden=8),
            batch_size=2 * t - 1,
            steps=STEPS,
            recompute=recompute,
            collect_parameters=True,
            num_chunks=2 if info.chunks is None else None,
        )
        fields.update(overrides)
        config = train_config(**fields)  # type: ignore[arg-type]
        try:
            schedule = prepare(config).schedule
        except ScheduleError:
            continue
        if schedule.num_ranks == ranks:
            return config
    return None


def _cases(ranks: int) -> dict[str, TrainConfig]:
    cases: dict[str, TrainConfig] = {}
    for name, info in SCHEDULES.items():
        if not info.synchronous:
            continue
        for recompute in (False, True):
            config = _config(name, ranks, recompute)
            if config is not None:
                cases[f"{name}{'+recompute' if recompute else ''}"] = config
    # the llama (grouped-query attention, rotary, SwiGLU) on zero bubble's split backward, with selective
    # recomputation of its attention cores
    cases["llama-zb-h1"] = train_config(
        schedule="zb-h1",
        num_stages=ranks,
        num_microbatches=2 * ranks,
        model=ModelSpec(kind="llama", layers=2, hidden=16, heads=4, kv_heads=2, seq_len=16, ffn_hidden=32),
        batch_size=4 * ranks - 1,
        steps=STEPS,
        recompute="selective",
        collect_parameters=True,
    )
    if ranks == 2:  # a transformer (3-d activations, int64 tokens in), and AdamW, once each
        gpt = ModelSpec(kind="gpt", layers=2, hidden=16, heads=2, seq_len=8)
        cases["gpt-1f1b"] = train_config(
            schedule="1f1b",
            num_stages=2,
            num_microbatches=3,
            model=gpt,
            batch_size=5,
            steps=STEPS,
            collect_parameters=True,
        )
        adamw = _config("1f1b", ranks, False, optimizer="adamw", lr=1e-2)
        assert adamw is not None
        cases["1f1b-adamw"] = adamw
        for name, optimizer, fields in OPTIMIZER_CASES:  # the registry's others, over split backward and chunks
            config = _config(name, ranks, False, optimizer=optimizer, **fields)
            assert config is not None
            cases[f"{name}-{optimizer}"] = config
        cases["gpt-zb-h1-bf16"] = train_config(
            schedule="zb-h1",
            num_stages=2,
            num_microbatches=3,
            model=gpt,
            batch_size=5,
            steps=STEPS,
            collect_parameters=True,
            precision="bf16",
            optimizer="adamw",
            lr=1e-2,
        )
    for name, recompute in BF16:  # mixed precision: the same autocast as plain training's
        bf16 = _config(name, ranks, recompute, precision="bf16")
        if bf16 is not None:
            cases[_bf16_case(name, recompute)] = bf16
    return cases


OPTIMIZER_CASES = (
    ("gpipe", "nesterov", {"lr": 0.05, "momentum": 0.9}),
    ("1f1b", "adam", {"lr": 1e-2}),
    ("zb-h1", "rmsprop", {"lr": 1e-3, "momentum": 0.5}),
    ("interleaved-1f1b", "adabelief", {"lr": 1e-2}),
)
"""Every other optimizer of ``weights.optimizers``, each on one schedule (2 ranks)."""

BF16 = (("1f1b", False), ("zb-h1", True), ("interleaved-1f1b", False), ("chimera", False))
"""Schedules also checked under ``--precision bf16``: split backward, recomputation, chunks, replicas."""


def _bf16_case(name: str, recompute: bool) -> str:
    return f"{name}-bf16{'+recompute' if recompute else ''}"


@pytest.fixture(scope="module", params=RANKS, ids=lambda r: f"{r}ranks")
def runs(request: pytest.FixtureRequest) -> tuple[int, dict[str, tuple[TrainConfig, RunRecord]]]:
    cases = _cases(request.param)
    records = launch(_run_all, list(cases.values()), request.param, LaunchOptions(timeout_s=60))
    return request.param, dict(zip(cases, zip(cases.values(), records)))


@functools.cache
def _plain(
    model: ModelSpec,
    batch_size: int,
    num_microbatches: int,
    optimizer: str,
    lr: float,
    precision: str = "fp32",
    momentum: float = 0.0,
) -> TrainResult:
    """Plain training, shared by the schedules that run the same model and batch."""
    config = train_config(optimizer=optimizer, lr=lr, momentum=momentum)
    return run_plain(
        model,
        steps=STEPS,
        batch_size=batch_size,
        num_microbatches=num_microbatches,
        optimizer_factory=optimizer_factory(config),
        precision=precision,
    )


def _names() -> list[str]:
    names = [n for n, info in SCHEDULES.items() if info.synchronous]
    return (
        [f"{n}{suffix}" for n in names for suffix in ("", "+recompute")]
        + ["gpt-1f1b", "1f1b-adamw", "llama-zb-h1"]
        + [f"{name}-{optimizer}" for name, optimizer, _ in OPTIMIZER_CASES]
        + [_bf16_case(n, r) for n, r in BF16]
        + ["gpt-zb-h1-bf16"]
    )


@pytest.mark.parametrize("case", _names())
def test_distributed_run_equals_plain_training_and_reference(
    runs: tuple[int, dict[str, tuple[TrainConfig, RunRecord]]], case: str
) -> None:
    ranks, results = runs
    if case not in results:
        pytest.skip(f"{case} cannot run on {ranks} ranks (see its ScheduleError)")
    config, record = results[case]
    schedule = build_schedule(config)
    optimizer = optimizer_factory(config)
    plain = _plain(
        config.model,
        config.batch_size,
        config.num_microbatches,
        config.optimizer,
        config.lr,
        config.precision,
        config.momentum,
    )
    reference = run_reference(
        schedule,
        config.model,
        steps=STEPS,
        batch_size=config.batch_size,
        optimizer_factory=optimizer,
        recompute=config.recompute,
        precision=config.precision,
    )
    torch.testing.assert_close(record.losses, plain.losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(record.losses, reference.losses, rtol=1e-5, atol=1e-6)
    assert record.losses[-1] < record.losses[0]  # it trains
    seen = set()
    for rank_record in record.ranks:
        assert set(rank_record.parameters) == set(schedule.placement.stages_on(rank_record.rank))
        for stage, params in rank_record.parameters.items():
            for name, value in params.items():
                torch.testing.assert_close(value, plain.parameters[name], rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(value, reference.stage_parameters[stage][name], rtol=1e-5, atol=1e-6)
                seen.add(name)
    assert seen == set(plain.parameters)  # every parameter of the model lives on some rank


def test_replicas_of_a_part_stay_bitwise_equal(runs: tuple[int, dict[str, tuple[TrainConfig, RunRecord]]]) -> None:
    """Replicated parts (Chimera, GEMS, DualPipe) sum gradients in one order everywhere."""
    _, results = runs
    checked = 0
    for config, record in results.values():
        placement = build_schedule(config).placement
        params = {s: p for r in record.ranks for s, p in r.parameters.items()}
        for stage in range(placement.num_stages):
            for other in placement.replicas(stage):
                if other != stage:
                    checked += 1
                    for name, value in params[stage].items():
                        assert torch.equal(value, params[other][name]), (config.schedule, stage, other, name)
    if not checked:
        pytest.skip("no schedule with replicated parts on this many ranks")


def test_microbatches_are_uneven_and_measurements_are_sane(
    runs: tuple[int, dict[str, tuple[TrainConfig, RunRecord]]],
) -> None:
    from pipeweave.runtime.report.trace import summarize

    _, results = runs
    config, record = results["1f1b"]
    sizes = microbatch_sizes(config)
    assert sizes[-1] < sizes[0] and sum(sizes) == config.batch_size
    report = summarize(build_schedule(config), record)
    assert 0.0 <= report["bubble_ratio"] < 1.0 and 0.0 <= report["bubble_ratio_simulated"] < 1.0
    assert report["step_time_s"] > 0 and report["samples_per_s"] == pytest.approx(
        config.batch_size / report["step_time_s"]
    )
    # 1F1B: rank r keeps min(D - r, T) microbatches in flight, so rank 0 holds the most.
    peaks = report["peak_activation_bytes"]
    assert all(p > 0 for p in peaks) and peaks[0] > peaks[-1]
    held = [
        sum(p.numel() * p.element_size() for ps in r.parameters.values() for p in ps.values()) for r in record.ranks
    ]
    assert report["weight_bytes"] == held
    # Recomputation keeps only stage inputs: less activation memory on every rank.
    recomputed = summarize(build_schedule(config), results["1f1b+recompute"][1])["peak_activation_bytes"]
    assert all(r < p for r, p in zip(recomputed, peaks))


def test_bf16_is_mixed_precision(runs: tuple[int, dict[str, tuple[TrainConfig, RunRecord]]]) -> None:
    """``--precision bf16`` computes in bfloat16 (other losses, smaller activations), keeps float32 parameters."""
    from pipeweave.runtime.report.trace import summarize

    _, results = runs
    (config, fp32), (_, bf16) = results["1f1b"], results["1f1b-bf16"]
    assert config.batch_size == results["1f1b-bf16"][0].batch_size
    assert bf16.losses[0] != fp32.losses[0]
    torch.testing.assert_close(bf16.losses, fp32.losses, rtol=2e-2, atol=1e-3)  # bfloat16's 8 bits of mantissa
    for rank_record in bf16.ranks:
        for params in rank_record.parameters.values():
            assert all(p.dtype == torch.float32 for p in params.values())
    schedule = build_schedule(config)
    peaks = [summarize(schedule, r)["peak_activation_bytes"] for r in (fp32, bf16)]
    assert all(b < f for f, b in zip(*peaks))  # the linear layers keep their inputs in bfloat16
