"""Uneven parts on every placement: an embedding alone, a head alone, parts of different block counts, on
straight, looped (interleaved) and V-shaped schedules, tied or not, train exactly as plain training."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeweave.data import ByteCorpus
from pipeweave.models import ModelSpec
from pipeweave.runtime.plain import TrainResult, run_plain
from pipeweave.runtime.reference import run_reference
from pipeweave.schedule import SCHEDULES, generate

pytestmark = pytest.mark.usefixtures("one_thread")

LLAMA = ModelSpec(kind="llama", layers=5, hidden=16, heads=2, kv_heads=1, seq_len=8, ffn_hidden=24)  # 7 layers
TEXT = bytes(range(256)) * 4
STEPS, BATCH = 2, 9


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
        ("zb-v", None, (2, 1, 3, 1)),  # V-shaped: the embedding's and the head's parts both on rank 0
        ("dualpipe-v", None, (1, 2, 1, 3)),
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
