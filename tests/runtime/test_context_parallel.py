"""Context parallelism: ring attention exact against whole-sequence attention, and runs with ``--context-parallel``
equal to plain training (gloo, CPU).

Ring attention (``runtime.stage.context_parallel``) is checked in float64 against
``scaled_dot_product_attention`` on the whole sequence, forward and backward, for multi-head and grouped-query
attention and rings of 2 to 4 ranks. The runs train a causal gpt and llama on sequences of 64 tokens with
CP = 2 on one pipeline stage (2 processes), on 2 pipeline ranks (4 processes) and with TP = 2 (4 processes),
and compare losses and final parameters with plain single-process training (rtol 1e-5, atol 1e-6: float32
attention summed in another order).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from config_defaults import train_config

from pipeweave.config import TrainConfig
from pipeweave.data import data_source
from pipeweave.errors import UserError
from pipeweave.models import ModelSpec
from pipeweave.models.build import build_layers
from pipeweave.models.context_parallel import SequenceShard
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.plain import TrainResult, run_plain
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import optimizer_factory, prepare
from pipeweave.runtime.run.record import RunRecord
from pipeweave.runtime.stage.context_parallel import RingAttention
from pipeweave.runtime.stage.post_validation import PostValidation
from pipeweave.runtime.transport.mesh import ContextParallel, Mesh

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(300)]

STEPS = 2
GPT = ModelSpec(kind="gpt", layers=2, hidden=16, heads=4, seq_len=64)
LLAMA = ModelSpec(kind="llama", layers=2, hidden=16, heads=4, kv_heads=2, seq_len=64, ffn_hidden=24)


def _config(model: ModelSpec, *, cp: int = 2, tp: int = 1, dp: int = 1, stages: int = 1, **extra: Any) -> TrainConfig:
    fields: dict[str, Any] = dict(
        schedule="1f1b",
        num_stages=stages,
        num_microbatches=2,
        model=model,
        batch_size=2 * dp,
        steps=STEPS,
        collect_parameters=True,
        context_parallel=cp,
        tensor_parallel=tp,
        data_parallel=dp,
    )
    fields.update(extra)
    return train_config(**fields)


CASES_2 = {  # CP = 2 on one pipeline stage
    "gpt": _config(GPT),
    "llama": _config(LLAMA),
    "gpt-bf16": _config(GPT, precision="bf16"),  # the ring in float32 under autocast, as on every rank alike
}
CASES_4 = {  # CP = 2 with a second dimension at 2: 4 processes
    "gpt-pp": _config(GPT, stages=2, eval_every=STEPS, eval_batches=1),  # evaluated on slices too
    "llama-pp-zb-h1": _config(LLAMA, stages=2, schedule="zb-h1"),
    "gpt-pp-interleaved": _config(GPT, stages=2, schedule="interleaved-1f1b", num_chunks=2),  # 2 stages a rank
    "llama-pp-dualpipe-v": _config(LLAMA, stages=2, schedule="dualpipe-v", num_microbatches=4, batch_size=4),
    "gpt-tp": _config(GPT, tp=2),
    "llama-tp": _config(LLAMA, tp=2),
    # sequence parallelism inside the cp slice: norms on seq / (C N) tokens, the ring on the slice gathered
    "llama-tp-sequence-parallel": _config(LLAMA, tp=2, sequence_parallel=True),
    "gpt-dp": _config(GPT, dp=2),
    # the attention cores replayed at the backward (their ring too), and the first stage's whole forward
    "gpt-pp-recompute-selective": _config(GPT, stages=2, recompute="selective"),
    "llama-pp-recompute-full": _config(LLAMA, stages=2, recompute="full"),
    # tied embedding and head (against the reference executor: plain training does not tie them)
    "gpt-pp-tied": _config(dataclasses.replace(GPT, tie_embeddings=True), stages=2),
    # the global norm clipped to 0.5, the cp group's summed gradients counted once, the TP shards each
    "gpt-tp-clip": _config(GPT, tp=2, post_validation=PostValidation(max_norm=0.5)),
}


def _run_all(context: RankContext, configs: list[TrainConfig]) -> list[RunRecord | None]:
    return [run_rank(context, prepare(c)) for c in configs]


@pytest.fixture(scope="module")
def runs_2() -> dict[str, RunRecord]:
    return dict(zip(CASES_2, launch(_run_all, list(CASES_2.values()), 2, LaunchOptions(timeout_s=120))))


@pytest.fixture(scope="module")
def runs_4() -> dict[str, RunRecord]:
    return dict(zip(CASES_4, launch(_run_all, list(CASES_4.values()), 4, LaunchOptions(timeout_s=120))))


@functools.cache
def _plain(model: ModelSpec, batch_size: int, microbatches: int, precision: str, clip: float | None) -> TrainResult:
    """Plain training of ``model`` (SGD, lr 0.1: ``config_defaults``), shared by the cases of one model and batch."""
    return run_plain(
        model,
        steps=STEPS,
        batch_size=batch_size,
        num_microbatches=microbatches,
        precision=precision,
        clip_grad_norm=clip,
    )


def _assert_equals_plain(config: TrainConfig, record: RunRecord) -> None:
    clip = None if config.post_validation is None else config.post_validation.max_norm
    plain = _plain(
        config.model, config.batch_size, config.num_microbatches * config.data_parallel, config.precision, clip
    )
    final = {name: value for r in record.ranks for held in r.parameters.values() for name, value in held.items()}
    # bf16: plain training's attention rounds to bfloat16 where the ring computes in float32
    tolerance = dict(rtol=1e-2, atol=1e-3) if config.precision == "bf16" else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(record.losses, plain.losses, **tolerance)
    torch.testing.assert_close(final, plain.parameters, **tolerance)  # every parameter, whole
    assert record.losses[-1] < record.losses[0]  # it trains


@pytest.mark.parametrize("case", list(CASES_2))
def test_context_parallel_equals_plain_training(runs_2: dict[str, RunRecord], case: str) -> None:
    _assert_equals_plain(CASES_2[case], runs_2[case])


@pytest.mark.parametrize("case", [c for c in CASES_4 if c != "gpt-pp-tied"])
def test_context_parallel_with_pipeline_tensor_or_data_parallelism_equals_plain_training(
    runs_4: dict[str, RunRecord], case: str
) -> None:
    _assert_equals_plain(CASES_4[case], runs_4[case])


def test_tied_embeddings_equal_the_reference(runs_4: dict[str, RunRecord], equals_reference: Any) -> None:
    equals_reference(CASES_4["gpt-pp-tied"], runs_4["gpt-pp-tied"])


def test_evaluation_on_slices_is_the_held_out_loss(runs_4: dict[str, RunRecord], held_out_loss: Any) -> None:
    """The held-out loss, each rank its slice of every sequence, is the whole model's on whole sequences."""
    config, record = CASES_4["gpt-pp"], runs_4["gpt-pp"]
    final = {n: v for r in record.ranks for held in r.parameters.values() for n, v in held.items()}
    source = data_source(GPT, batch_size=config.batch_size, seed=config.seed)
    assert record.eval_losses == [(STEPS, pytest.approx(held_out_loss(GPT, final, source, 1), rel=1e-5))]


def test_the_record_holds_one_process_per_stage_rank(runs_4: dict[str, RunRecord]) -> None:
    assert [r.rank for r in runs_4["gpt-pp"].ranks] == [0, 1]  # 2 stage ranks of 2 context-parallel processes


def _ring_check(context: RankContext, payload: tuple[int, int, int]) -> float:
    """On each rank of the default group: ring attention of this rank's chunks against the whole sequence's
    causal attention (float64), forward and backward; the largest difference."""
    heads, kv_heads, seq = payload
    g = torch.Generator().manual_seed(0)
    q, grad = (torch.randn(2, heads, seq, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, kv_heads, seq, 8, generator=g, dtype=torch.float64) for _ in range(2))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*whole, is_causal=True, enable_gqa=heads != kv_heads)
    out.backward(grad)
    shard = SequenceShard(context.process, context.world)
    mine = [shard.take(t, dim=2).requires_grad_() for t in (q, k, v)]
    y = RingAttention(ContextParallel(dist.group.WORLD, context.process, context.world))(*mine)
    y.backward(shard.take(grad, dim=2))
    errors = [(y.detach() - shard.take(out.detach(), dim=2)).abs().max()]
    errors += [(m.grad - shard.take(w.grad, dim=2)).abs().max() for m, w in zip(mine, whole)]  # type: ignore[operator]
    return float(max(errors))


@pytest.mark.parametrize(("ranks", "heads", "kv_heads", "seq"), [(2, 4, 4, 16), (2, 4, 2, 16), (3, 4, 1, 12)])
def test_ring_attention_equals_whole_sequence_attention(ranks: int, heads: int, kv_heads: int, seq: int) -> None:
    error = launch(_ring_check, (heads, kv_heads, seq), ranks, LaunchOptions(timeout_s=60))
    assert error < 1e-12


def test_load_balanced_layout_holds_an_early_and_a_late_chunk() -> None:
    assert SequenceShard(0, 2).positions(4).tolist() == [0, 1, 6, 7]
    assert SequenceShard(1, 2).positions(4).tolist() == [2, 3, 4, 5]
    held = torch.cat([SequenceShard(r, 3).positions(4) for r in range(3)])
    assert sorted(held.tolist()) == list(range(12))  # every position once


def test_global_positions_reach_the_position_table() -> None:
    """A context-parallel slice's learned positions are its global ones, in the forward and in the gradient."""
    (embedding,) = build_layers(GPT, [0])
    tokens = torch.randint(0, GPT.vocab, (2, 64))
    whole = embedding(tokens)
    whole.sum().backward()
    expected = embedding.position.grad.clone()
    embedding.position.grad = None
    total = None
    for rank in range(2):
        embedding.sequence = SequenceShard(rank, 2)
        shard = embedding(SequenceShard(rank, 2).take(tokens))
        torch.testing.assert_close(shard, SequenceShard(rank, 2).take(whole.detach()))
        shard.sum().backward()
    total = embedding.position.grad
    torch.testing.assert_close(total, expected)


def test_process_numbering_puts_cp_between_pp_and_tp() -> None:
    """Process ((dp*D + pp)*C + cp)*N + tp; messages between the stage ranks' processes of one (cp, tp)."""
    mesh = Mesh(1, 2, 2, process=7, context_parallel=2)  # D = 2, N = 2, C = 2: pp 1, cp 1, tp 1
    assert (mesh.stage_rank, mesh.cp_rank, mesh.tp_rank, mesh.dp_rank) == (1, 1, 1, 0)
    assert mesh.process_of(0) == 3
    assert Mesh(2, 2, 1, process=5, context_parallel=2).dp_rank == 1


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            dict(model=dataclasses.replace(GPT, seq_len=30)),
            "--seq-len 30 is not divisible by 2 x --context-parallel 2 = 4 (the load-balanced chunks); give a "
            "sequence length that is a multiple of 4",
        ),
        (
            dict(model=ModelSpec(kind="mlp", layers=2, hidden=8)),
            "--context-parallel 2 splits the sequence of the gpt's or the llama's attention; --model mlp has no "
            "such attention: drop --context-parallel",
        ),
        (dict(context_parallel=0), "--context-parallel 0 is invalid; give C >= 1"),
        (dict(schedule="pipedream"), "--context-parallel 2 with the asynchronous pipedream is not supported yet"),
        (dict(dp=2, zero=1), "--context-parallel 2 with --zero 1 is not supported yet; use --zero 0"),
        (dict(compile=True), "--context-parallel 2 with --compile is not supported yet; drop --compile"),
        (
            dict(model=dataclasses.replace(GPT, moe_experts=4)),
            "--context-parallel 2 with --moe-experts 4 is not supported yet; drop --context-parallel",
        ),
    ],
)
def test_bad_context_parallel_input_is_one_line(fields: dict[str, Any], message: str) -> None:
    model = fields.pop("model", GPT)
    with pytest.raises(UserError) as caught:
        _config(model, **fields)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.slow
def test_a_context_parallel_checkpoint_resumes_with_and_without_context_parallelism(tmp_path: Path) -> None:
    """Saved at CP = 2 after 2 of 4 steps (AdamW: its state too), resumed at CP = 2 and at CP = 1 on 2 pipeline
    ranks: each goes on as plain training of the 4 steps does. The CP ranks save the same keys, DCP each once."""
    base = _config(LLAMA, optimizer="adamw", lr=1e-2)  # (no key bias, whose zero gradient AdamW makes noise)
    straight = run_plain(
        LLAMA, steps=4, batch_size=base.batch_size, num_microbatches=2, optimizer_factory=optimizer_factory(base)
    )
    _train(base.replace(save=str(tmp_path / "ck")))
    for other in (base, base.replace(context_parallel=1, num_stages=2)):
        resumed = _train(other.replace(steps=2, resume=str(tmp_path / "ck")))
        torch.testing.assert_close(resumed.losses, straight.losses[STEPS:], rtol=1e-5, atol=1e-6)
        final = {n: v for r in resumed.ranks for held in r.parameters.values() for n, v in held.items()}
        torch.testing.assert_close(final, straight.parameters, rtol=1e-5, atol=1e-6)


def _train(config: TrainConfig) -> RunRecord:
    plan = prepare(config)
    record = launch(run_rank, plan, plan.num_processes, LaunchOptions(timeout_s=120))
    assert record is not None
    return record


def test_sequence_parallelism_needs_the_slice_divisible_by_tp() -> None:
    config = _config(dataclasses.replace(GPT, seq_len=12), tp=4, sequence_parallel=True)
    with pytest.raises(
        UserError, match=r"^--seq-len 12 / --context-parallel 2 = 6 is not divisible by --tensor-parallel 4"
    ):
        prepare(config)
