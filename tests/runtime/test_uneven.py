"""Uneven parts on every placement: an embedding alone, a head alone, parts of different block counts, on
straight, looped (interleaved) and V-shaped schedules, tied or not, train exactly as plain training."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from config_defaults import train_config

from pipeweave.config import TrainConfig
from pipeweave.data import ByteCorpus
from pipeweave.models import ModelSpec
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.plain import TrainResult, run_plain
from pipeweave.runtime.reference import run_reference
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import prepare
from pipeweave.runtime.run.record import RunRecord
from pipeweave.schedule import SCHEDULES, generate

pytestmark = pytest.mark.usefixtures("one_thread")

LLAMA = ModelSpec(kind="llama", layers=5, hidden=16, heads=2, kv_heads=1, seq_len=8, ffn_hidden=24)  # 7 layers
TEXT = bytes(range(256)) * 4
STEPS, BATCH = 2, 9
TP = dict(num_stages=2, num_microbatches=4, batch_size=7, steps=STEPS, collect_parameters=True, tensor_parallel=2)


def _ranges(counts: tuple[int, ...]) -> list[range]:
    stops = [sum(counts[: k + 1]) for k in range(len(counts))]
    return [range(stop - n, stop) for stop, n in zip(stops, counts)]


def _data() -> ByteCorpus:
    return ByteCorpus(TEXT, seq_len=LLAMA.seq_len, batch_size=BATCH, seed=3)


def _reference(name: str, counts: tuple[int, ...], spec: ModelSpec, chunks: int | None = None) -> TrainResult:
    schedule = generate(name, num_stages=2, num_microbatches=4, num_chunks=chunks)
    assert schedule.num_parts == len(counts)
    return run_reference(schedule, spec, steps=STEPS, batch_size=BATCH, data=_data(), parts=_ranges(counts))


@pytest.mark.parametrize(
    ("name", "chunks", "counts"),
    [
        ("1f1b", None, (1, 6)),  # the embedding alone on the first stage
        ("zb-h1", None, (6, 1)),  # the head alone on the last
        ("interleaved-1f1b", 2, (1, 3, 2, 1)),  # looped: ranks 0, 1, 0, 1
        pytest.param("zb-v", None, (2, 1, 3, 1), marks=pytest.mark.slow),  # V: embedding and head on rank 0
        pytest.param("dualpipe-v", None, (1, 2, 1, 3), marks=pytest.mark.slow),
    ],
)
def test_uneven_parts_equal_plain_training(name: str, chunks: int | None, counts: tuple[int, ...]) -> None:
    if name not in SCHEDULES:
        pytest.skip(f"{name} not registered")
    got = _reference(name, counts, LLAMA, chunks)
    want = run_plain(LLAMA, steps=STEPS, batch_size=BATCH, num_microbatches=4, data=_data())
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(want.losses), rtol=1e-5, atol=0)
    for key, value in want.parameters.items():
        torch.testing.assert_close(got.parameters[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert got.losses[-1] < got.losses[0]


@pytest.mark.parametrize(("name", "counts"), [("1f1b", (1, 6)), ("zb-v", (1, 3, 2, 1))])
def test_tied_embedding_and_head_with_uneven_parts_equal_the_even_split(name: str, counts: tuple[int, ...]) -> None:
    tied = dataclasses.replace(LLAMA, tie_embeddings=True)
    even = (4, 3) if len(counts) == 2 else (2, 2, 2, 1)
    got, want = _reference(name, counts, tied), _reference(name, even, tied)
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(want.losses), rtol=1e-5, atol=0)
    untied = _reference(name, counts, LLAMA)
    assert got.losses[-1] != pytest.approx(untied.losses[-1], rel=1e-5)  # the tie changed the training


TP_CASES = {  # tensor parallelism 2 x 2 stages (4 processes), every part its own size
    # looped: the embedding alone on rank 0, 2 blocks on rank 1, 1 block on rank 0, the head alone on rank 1
    "interleaved": train_config(
        schedule="interleaved-1f1b",
        num_chunks=2,
        model=dataclasses.replace(LLAMA, layers=3, heads=4, kv_heads=2),
        layers_per_part=(1, 2, 1, 1),
        **TP,
    ),
    # V-shaped and tied: the embedding's and the head's parts both on rank 0 (against the reference executor)
    "zb-v-tied": train_config(
        schedule="zb-v",
        model=dataclasses.replace(LLAMA, layers=3, heads=4, kv_heads=2, tie_embeddings=True),
        layers_per_part=(1, 1, 2, 1),
        **TP,
    ),
}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_uneven_parts_under_tensor_parallelism(equals_reference: Any) -> None:
    records = launch(_run_all, list(TP_CASES.values()), 4, LaunchOptions(timeout_s=120))
    untied, tied = (dict(zip(TP_CASES, records))[k] for k in ("interleaved", "zb-v-tied"))
    config = TP_CASES["interleaved"]
    plain = run_plain(config.model, steps=STEPS, batch_size=config.batch_size, num_microbatches=4)
    torch.testing.assert_close(untied.losses, plain.losses, rtol=1e-5, atol=1e-6)
    for rank_record in untied.ranks:
        for params in rank_record.parameters.values():
            for name, value in params.items():  # gathered whole from the tensor-parallel shards
                torch.testing.assert_close(value, plain.parameters[name], rtol=1e-5, atol=1e-6, msg=name)
    equals_reference(TP_CASES["zb-v-tied"], tied)


def _run_all(context: RankContext, configs: list[TrainConfig]) -> list[RunRecord | None]:
    return [run_rank(context, prepare(c)) for c in configs]
