"""Memory levers in training (schedule.levers, runtime.stage.levers): offload to a memory-mapped file on CPU
leaves losses and final parameters bitwise those of the same run without it (and plain training's within the
float32 tolerance of tests/runtime/test_distributed.py); bf16-compressed activations stay within a stated bound."""

from __future__ import annotations

import pytest
import torch
from config_defaults import train_config

from pipeweave.config import TrainConfig
from pipeweave.errors import UserError
from pipeweave.models import ModelSpec
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.plain import run_plain
from pipeweave.runtime.run.job import lowered, run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import optimizer_factory, prepare
from pipeweave.runtime.run.record import RunRecord
from pipeweave.schedule.ir import Op

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

STEPS = 2
GPT = ModelSpec(kind="gpt", layers=2, hidden=16, heads=2, seq_len=8)
COMPRESSION_BOUND = 2e-3
"""Largest relative difference of a loss of the gpt below with bf16-compressed activations (measured 1e-4
to 4e-4 over its steps: bf16 keeps 8 bits of mantissa, so each stashed value is off by up to 2^-9)."""


def _run_all(context: RankContext, configs: list[TrainConfig]) -> list[RunRecord | None]:
    return [run_rank(context, prepare(c)) for c in configs]


def _cases(ranks: int, names: tuple[str, ...], levers: tuple[str, ...]) -> dict[str, TrainConfig]:
    cases = {}
    for name in names:
        chunks = 2 if name == "interleaved-1f1b" else None
        t = 2 * ranks if chunks else 4
        base = dict(
            schedule=name,
            num_stages=ranks,
            num_microbatches=t,
            num_chunks=chunks,
            steps=STEPS,
            model=ModelSpec(kind="mlp", layers=4 * ranks, hidden=8),
            batch_size=2 * t - 1,
            collect_parameters=True,
        )
        cases[name] = train_config(**base)  # type: ignore[arg-type]
        if "offload" in levers:
            cases[f"{name}+offload"] = train_config(**base, offload="all")  # type: ignore[arg-type]
        if "bpipe" in levers:
            cases[f"{name}+bpipe"] = train_config(**base, balance_activations=True)  # type: ignore[arg-type]
    return cases


def _parameters(record: RunRecord) -> dict[str, torch.Tensor]:
    return {name: value for r in record.ranks for params in r.parameters.values() for name, value in params.items()}


def _check_levers(
    ranks: int, names: tuple[str, ...], levers: tuple[str, ...] = ("offload", "bpipe"), gpt: bool = False
) -> None:
    cases = _cases(ranks, names, levers)
    if gpt:  # the gpt: int64 tokens in, 3-d activations, and compressed activations
        gpt = dict(
            schedule="zb-h1",
            num_stages=2,
            num_microbatches=3,
            model=GPT,
            batch_size=5,
            steps=3,
            collect_parameters=True,
        )
        cases.update(
            {
                "gpt": train_config(**gpt),
                "gpt+offload": train_config(**gpt, offload="0"),  # type: ignore[arg-type]
                "gpt+bf16": train_config(**gpt, compress_activations="bf16"),
            }
        )  # type: ignore[arg-type]
    records = dict(zip(cases, launch(_run_all, list(cases.values()), ranks, LaunchOptions(timeout_s=60))))
    for name, lever in [(n, lever) for n in cases if "+" not in n for lever in ("offload", "bpipe")]:
        exact, moved = records[name], records.get(f"{name}+{lever}")
        if moved is None:
            continue  # not asked (the gpt's BPipe: in the memory benchmark)
        assert exact is not None
        assert moved.losses == exact.losses, (name, lever)  # bitwise
        for key, value in _parameters(exact).items():
            assert torch.equal(_parameters(moved)[key], value), (name, lever, key)
        config = cases[name]
        plain = run_plain(
            config.model,
            steps=config.steps,
            batch_size=config.batch_size,
            num_microbatches=config.num_microbatches,
            optimizer_factory=optimizer_factory(config),
        )
        torch.testing.assert_close(moved.losses, plain.losses, rtol=1e-5, atol=1e-6)
        # Offload: rank 0 holds one microbatch at a time. BPipe: the last rank holds what rank 0 lends it (rank
        # 0's own peak falls on the gpt, benchmarks/memory; on this mlp its W's leftovers are as large as F's).
        first, last = moved.ranks[0].peak_activation_bytes, moved.ranks[-1].peak_activation_bytes
        if lever == "offload":
            assert first < exact.ranks[0].peak_activation_bytes, name
        elif any(a.op is Op.EVICT for a in lowered(prepare(cases[f"{name}+bpipe"]))[0].actions[0]):
            assert last > exact.ranks[-1].peak_activation_bytes, name
    if "gpt+bf16" in records:
        exact, small = records["gpt"], records["gpt+bf16"]
        assert exact is not None and small is not None
        assert small.losses[0] == exact.losses[0]  # the first forward is exact: compression acts on backwards
        assert small.losses != exact.losses
        assert all(abs(a - b) <= COMPRESSION_BOUND * abs(b) for a, b in zip(small.losses, exact.losses))
        assert small.ranks[0].peak_activation_bytes < exact.ranks[0].peak_activation_bytes


def test_offload_and_bpipe_are_bitwise_the_run_without_them_at_2_ranks_and_compression_within_its_bound() -> None:
    _check_levers(2, ("zb-h1",), ("offload",), gpt=True)
    _check_levers(2, ("1f1b",), ("bpipe",))


@pytest.mark.slow
def test_offload_and_bpipe_are_bitwise_the_run_without_them_on_the_other_schedules_at_2_ranks() -> None:
    _check_levers(2, ("1f1b", "interleaved-1f1b"), ("offload",))
    _check_levers(2, ("zb-h1", "interleaved-1f1b"), ("bpipe",))  # zb-h1's pair is balanced already: no EVICT


@pytest.mark.slow
def test_offload_and_bpipe_are_bitwise_the_run_without_them_at_3_ranks() -> None:
    _check_levers(3, ("1f1b", "zb-h1", "interleaved-1f1b"))


def test_levers_the_runtime_cannot_run_are_one_line_before_anything_spawns() -> None:
    with pytest.raises(UserError, match="--offload 5: '5' is not a part; give all, none or part numbers 0..1"):
        prepare(train_config(offload="5"))
    with pytest.raises(UserError, match="--offload with --recompute"):
        prepare(train_config(offload="all", recompute=True))
    with pytest.raises(UserError, match="asynchronous"):
        prepare(train_config(schedule="pipedream", compress_activations="bf16"))
