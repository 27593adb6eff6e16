"""Exactness and memory of recomputation per part (``--recompute none|selective|full`` or one per part).

Selective and full recomputation replay the very operations of the forward, so
losses and final parameters are plain training's to the last bit (``torch.equal``),
in one process (reference executor) and across gloo ranks (against the same run
without recomputation; that run against plain training within the distributed
tests' tolerance, rtol 1e-5, as elsewhere). The 3-rank grid is marked slow.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from config_defaults import train_config

from pipeweave.config import TrainConfig
from pipeweave.data import ByteCorpus
from pipeweave.errors import UserError
from pipeweave.models import ModelSpec
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.plain import TrainResult, run_plain
from pipeweave.runtime.reference import run_reference
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import prepare
from pipeweave.runtime.run.record import RunRecord
from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.schedule import generate

GPT = ModelSpec(kind="gpt", layers=4, hidden=8, heads=2, seq_len=8)  # 6 layers: D x v up to 3 x 2
LLAMA = ModelSpec(kind="llama", layers=4, hidden=32, heads=4, kv_heads=2, seq_len=8, ffn_hidden=48)
FILE = Path(__file__).resolve().parents[1] / "models" / "tiny_custom.py"
NOISY = ModelSpec(kind="custom", entry=f"{FILE}:noisy_selective")
TEXT = bytes(range(256)) * 8
STEPS = 2
SCHEDULES = ("1f1b", "zb-h1", "interleaved-1f1b")

pytestmark = pytest.mark.usefixtures("one_thread")


def _data(batch: int) -> ByteCorpus:
    return ByteCorpus(TEXT, seq_len=GPT.seq_len, batch_size=batch, seed=3)


@functools.cache
def _plain(spec: ModelSpec, num_microbatches: int, own_text: bool = True) -> TrainResult:
    """Plain training; ``own_text``: on ``TEXT`` (the in-process runs), else on the model's own data (a run's)."""
    batch = 2 * num_microbatches + 1  # does not divide: the last microbatch is smaller
    return run_plain(
        spec,
        steps=STEPS,
        batch_size=batch,
        num_microbatches=num_microbatches,
        data=_data(batch) if spec.is_transformer and own_text else None,
    )


def _assert_bitwise(got: TrainResult, want: TrainResult) -> None:
    assert got.losses == want.losses
    assert got.parameters.keys() == want.parameters.keys()
    for name, value in want.parameters.items():
        assert torch.equal(got.parameters[name], value), name
    assert got.losses[-1] < got.losses[0]  # it trained


def _modes(num_parts: int) -> list[str]:
    """Every mode on every part, and a mix (selective, full, none, ... per part)."""
    mixed = ",".join(("selective", "full", "none")[k % 3] for k in range(num_parts))
    return ["selective", "full", mixed]


@pytest.mark.parametrize("num_stages", [2, 3])
@pytest.mark.parametrize("name", SCHEDULES)
def test_recomputation_per_part_equals_plain_training_bitwise(name: str, num_stages: int) -> None:
    schedule = generate(
        name,
        num_stages=num_stages,
        num_microbatches=2 * num_stages,
        num_chunks=2 if name == "interleaved-1f1b" else None,
    )
    batch = 2 * schedule.num_microbatches + 1
    for mode in _modes(schedule.num_parts):
        result = run_reference(schedule, GPT, steps=STEPS, batch_size=batch, recompute=mode, data=_data(batch))
        _assert_bitwise(result, _plain(GPT, schedule.num_microbatches))


def test_llama_recomputation_per_part_equals_plain_training_bitwise() -> None:
    """Its attention core (grouped-query, on rotated q and k) replayed selectively, its blocks fully, or a mix;
    on zero bubble's split backward."""
    schedule = generate("zb-h1", num_stages=2, num_microbatches=4)
    batch = 2 * schedule.num_microbatches + 1
    for mode in _modes(schedule.num_parts):
        result = run_reference(schedule, LLAMA, steps=STEPS, batch_size=batch, recompute=mode, data=_data(batch))
        _assert_bitwise(result, _plain(LLAMA, schedule.num_microbatches))


def test_selective_replays_dropout_with_the_forwards_masks() -> None:
    """A custom model's selective region (its blocks' MLPs) draws dropout masks: the replay redraws them."""
    schedule = generate("zb-h1", num_stages=2, num_microbatches=4)
    result = run_reference(schedule, NOISY, steps=STEPS, batch_size=9, recompute="selective")
    _assert_bitwise(result, _plain(NOISY, 4))


def _block_bytes(mode: str) -> int:
    """Activation bytes one gpt block (layer 1) keeps for the backward of one microbatch."""
    worker = StageWorker(GPT, range(1, 2), batch_size=4, recompute=mode)
    x = torch.randn(4, GPT.seq_len, GPT.hidden)
    worker.forward(0, x)
    return worker.activation_bytes()


def test_selective_keeps_all_but_the_attention_cores_own_tensors() -> None:
    """Counted by hand: CPU attention is torch's fused flash kernel, which saves q, k, v (one storage, the qkv
    projection's output, which the checkpoint keeps as its inputs), its output (which the projection after it
    saves too) and a log-sum-exp: selective drops only the log-sum-exp, no s^2 scores are kept to drop."""
    b, s, h, heads = 4, GPT.seq_len, GPT.hidden, GPT.heads
    none, selective, full = _block_bytes("none"), _block_bytes("selective"), _block_bytes("full")
    assert none - selective == 4 * b * heads * s  # the float32 log-sum-exp
    assert full == 4 * b * s * h  # the block's input only


def test_a_model_without_a_selective_region_says_so() -> None:
    with pytest.raises(UserError, match="the mlp has no selective region"):
        prepare(train_config(model=ModelSpec(kind="mlp", layers=4, hidden=8), recompute="selective"))
    plain = ModelSpec(kind="custom", entry=f"{FILE}:noisy")
    with pytest.raises(UserError, match="names no selective region; give its LayerModel a selective list"):
        prepare(train_config(model=plain, recompute="none,selective"))
    with pytest.raises(UserError, match="gives 3 modes for 2 parts"):
        prepare(train_config(model=GPT, recompute="full,none,none"))
    with pytest.raises(UserError, match="--recompute 'sometimes' is invalid"):
        train_config(recompute="sometimes")
    assert train_config(recompute=True).recompute == "full" and train_config(recompute="none,none").recompute == "none"


def _run_all(context: RankContext, configs: list[TrainConfig]) -> list[RunRecord | None]:
    return [run_rank(context, prepare(c)) for c in configs]


def _configs(ranks: int, names: tuple[str, ...]) -> dict[tuple[str, str], TrainConfig]:
    cases = {}
    for name in names:
        chunks = 2 if name == "interleaved-1f1b" else None
        parts = ranks * (chunks or 1)
        for mode in ["none", *_modes(parts)]:
            cases[name, mode] = train_config(
                schedule=name,
                num_stages=ranks,
                num_microbatches=2 * ranks,
                num_chunks=chunks,
                model=GPT,
                batch_size=4 * ranks + 1,
                steps=STEPS,
                recompute=mode,
                collect_parameters=True,
            )
    return cases


def _check_distributed(ranks: int, names: tuple[str, ...]) -> None:
    cases = _configs(ranks, names)
    records = dict(zip(cases, launch(_run_all, list(cases.values()), ranks, LaunchOptions(timeout_s=120))))
    for (name, mode), record in records.items():
        assert record is not None
        stored = records[name, "none"]
        assert stored is not None and record.losses == stored.losses, (name, mode)
        for mine, theirs in zip(record.ranks, stored.ranks):
            for stage, params in mine.parameters.items():
                for key, value in params.items():
                    assert torch.equal(value, theirs.parameters[stage][key]), (name, mode, key)
        plain = _plain(GPT, 2 * ranks, own_text=False)
        torch.testing.assert_close(record.losses, plain.losses, rtol=1e-5, atol=1e-6)
        # Memory measured like time: the process's tensors at peak hold at least its saved activations.
        assert all(r.peak_tensor_bytes >= r.peak_activation_bytes > 0 for r in record.ranks), (name, mode)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_distributed_recomputation_per_part_is_bitwise_the_stored_run() -> None:
    _check_distributed(2, ("zb-h1",))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("ranks", [2, 3])
def test_distributed_recomputation_grid(ranks: int) -> None:
    _check_distributed(ranks, SCHEDULES)


def test_tracked_tensor_bytes_count_each_storage_while_it_lives() -> None:
    from pipeweave.runtime.stage.tensor_bytes import peak_tensor_bytes

    found: list[int] = []
    with peak_tensor_bytes(torch.device("cpu"), found):
        x = torch.ones(256)
        for _ in range(10):  # each round: the last round's x, ones, and the new x alive at once
            x = torch.ones(256) * x
        view = x[:128]  # a view allocates nothing
    assert found == [3 * 1024] and view.untyped_storage().nbytes() == 1024


def test_tracked_tensor_bytes_uncount_a_storage_resized_to_zero() -> None:
    """FSDP2 frees a gathered layer so (its storage object lives on); each gather is counted once, then freed."""
    from pipeweave.runtime.stage.tensor_bytes import TensorBytes

    meter = TensorBytes()
    resize = torch.UntypedStorage.resize_
    with meter:
        layer = torch.ones(256)
        for _ in range(5):  # gather, use, free: one layer alive at a time
            layer.untyped_storage().resize_(1024)
            layer.copy_(torch.ones(256))  # counted again at its new address
            layer.untyped_storage().resize_(0)
    assert (meter.peak, meter.current) == (2 * 1024, 0) and torch.UntypedStorage.resize_ is resize
