"""Exactness of pipeline x tensor x data parallelism on one device mesh (gloo, CPU).

With TP = 2, DP = 2, D = 2 (8 processes) and with each pair of the three
dimensions at 2 (4 processes), synchronous schedules -- 1F1B, ZB-H1 with its
I/W split inside the tensor-parallel layers, interleaved 1F1B -- give the
per-step losses and final parameters of plain single-process training with
gradient accumulation. Tolerance: float32 reduction order, rtol 1e-5 and
atol 1e-6 (a row-parallel layer sums its partial products in another order;
the replicas' gradients are summed by an all-reduce). One process group per
world size runs every configuration, as ``test_distributed`` does.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from config_defaults import train_config

from pipeweave.config import TrainConfig
from pipeweave.data import data_source
from pipeweave.models import ModelSpec
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.plain import TrainResult, run_plain
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import optimizer_factory, prepare
from pipeweave.runtime.run.record import RunRecord
from pipeweave.runtime.stage.post_validation import PostValidation

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

STEPS = 2
GPT = ModelSpec(kind="gpt", layers=2, hidden=16, heads=4, seq_len=8)
MLP = ModelSpec(kind="mlp", layers=4, hidden=8)
WIDE = ModelSpec(kind="gpt", layers=4, hidden=32, heads=4, seq_len=32)
LLAMA = ModelSpec(kind="llama", layers=2, hidden=32, heads=4, kv_heads=2, seq_len=16, ffn_hidden=48)
CUSTOM = f"{Path(__file__).resolve().parent.parent / 'models' / 'tiny_custom.py'}"


def _config(schedule: str, model: ModelSpec, *, tp: int, dp: int, stages: int, **extra: Any) -> TrainConfig:
    fields: dict[str, Any] = dict(
        schedule=schedule,
        num_stages=stages,
        num_microbatches=4,
        model=model,
        batch_size=2 * 4 * dp - 1,
        steps=STEPS,
        collect_parameters=True,
        tensor_parallel=tp,
        data_parallel=dp,
    )
    fields.update(extra)
    return train_config(**fields)


CASES_8 = {  # TP = DP = D = 2: 8 processes
    "gpt-1f1b": _config("1f1b", GPT, tp=2, dp=2, stages=2),
    "gpt-zb-h1": _config("zb-h1", GPT, tp=2, dp=2, stages=2),
    "mlp-interleaved": _config("interleaved-1f1b", MLP, tp=2, dp=2, stages=2, num_chunks=2),
    "gpt-zb-h1-recompute": _config("zb-h1", GPT, tp=2, dp=2, stages=2, recompute=True),
    "gpt-1f1b-zero1": _config("1f1b", GPT, tp=2, dp=2, stages=2, zero=1, momentum=0.9),
    "gpt-zb-h1-bf16": _config("zb-h1", GPT, tp=2, dp=2, stages=2, precision="bf16"),
    # PipeDream's hybrid: P replicas around the stream, each its piece of every microbatch, every update the sum
    # of the replicas' gradients; against its reference executor (one pipeline, whole microbatches).
    "gpt-pipedream": _config("pipedream", GPT, tp=2, dp=2, stages=2, steps=4, batch_size=16),
}
CASES_4 = {  # each pair of the dimensions at 2: 4 processes
    "tp-dp": _config("1f1b", GPT, tp=2, dp=2, stages=1),
    "tp-pp": _config("zb-h1", GPT, tp=2, dp=1, stages=2),
    # Tied embedding and head (against the reference: plain training does not tie them): both whole on every
    # process, their gradients summed with the peer of the same tp coordinate.
    "tp-pp-tied": _config("1f1b", dataclasses.replace(GPT, tie_embeddings=True), tp=2, dp=1, stages=2),
    "dp-pp": _config("zb-h1", GPT, tp=1, dp=2, stages=2),
    # ZeRO-1 with the embedding and head tied across the pipeline: the tie summed whole, then reduce-scattered.
    "dp-pp-tied-zero1": _config(
        "zb-h1", dataclasses.replace(GPT, tie_embeddings=True), tp=1, dp=2, stages=2, zero=1, momentum=0.9
    ),
    "dp-pp-zero1-adamw": _config(
        "1f1b", MLP, tp=1, dp=2, stages=2, zero=1, optimizer="adamw", lr=1e-2, bucket_mb=0.0005
    ),  # buckets of ~500 B: several per part, padded slices
    # AdamW on the mlp: on the gpt it turns the key bias's zero gradient (softmax ignores a shift of every
    # key alike) into full steps of float noise, whose sign the summation order decides.
    "tp-pp-mlp-adamw": _config("1f1b", MLP, tp=2, dp=1, stages=2, optimizer="adamw", lr=1e-2),
    # ZeRO-3: parameters sharded over the replicas, gathered before F, B and I, freed after; W on freed ones.
    "dp-pp-zero3-1f1b": _config(
        "1f1b", GPT, tp=1, dp=2, stages=2, zero=3, momentum=0.9, eval_every=STEPS, eval_batches=1
    ),  # its evaluation gathers the parameters too
    "dp-pp-zero3-zb-h1": _config("zb-h1", GPT, tp=1, dp=2, stages=2, zero=3),
    "dp-pp-zero3-zb-h1-recompute": _config("zb-h1", GPT, tp=1, dp=2, stages=2, zero=3, recompute=True),
    # --clip-grad-norm by one all-reduce at U (norm ~9, clipped to 0.5): shards over tp counted each, whole
    # parameters once per tp group, ZeRO slices over dp each; without ZeRO the reduced gradient once.
    "tp-dp-zero3-clip": _config(
        "1f1b", GPT, tp=2, dp=2, stages=1, zero=3, momentum=0.9, post_validation=PostValidation(max_norm=0.5)
    ),
    "tp-pp-custom-plan": _config(
        "zb-h1", ModelSpec(kind="custom", entry=f"{CUSTOM}:tensor_parallel"), tp=2, dp=1, stages=2
    ),
    # Asynchronous: PipeDream's weight stashing on shards; its own reference, not plain training.
    "tp-pp-pipedream": _config("pipedream", GPT, tp=2, dp=1, stages=2, steps=4, batch_size=8),
    "dp-pp-pipedream-2bw": _config("pipedream-2bw", MLP, tp=1, dp=2, stages=2, steps=4, batch_size=16, momentum=0.9),
    # Evaluated between streams: each replica its piece of every held-out microbatch.
    "dp-pp-pipedream-eval": _config(
        "pipedream", GPT, tp=1, dp=2, stages=2, steps=4, batch_size=16, eval_every=2, eval_batches=2
    ),
    # Sequence parallelism: layer norms and residual adds on half the sequence, their gradients summed over tp.
    "tp-pp-sequence-parallel": _config("zb-h1", GPT, tp=2, dp=1, stages=2, sequence_parallel=True),
    # ... and on a stream cut in two by an evaluation (each piece a new executor: the norms summed once).
    "tp-pp-pipedream-sequence-parallel": _config(
        "pipedream",
        GPT,
        tp=2,
        dp=1,
        stages=2,
        steps=4,
        batch_size=8,
        sequence_parallel=True,
        eval_every=2,
        eval_batches=1,
    ),
    # The llama: 4 query and 2 key/value heads, each rank 2 and 1 of them; SwiGLU's gate and up split apart; its
    # attention cores replayed under sequence parallelism; tied (against the reference).
    "tp-pp-llama": _config("zb-h1", LLAMA, tp=2, dp=1, stages=2),
    "tp-pp-llama-sequence-parallel": _config(
        "zb-h1", LLAMA, tp=2, dp=1, stages=2, sequence_parallel=True, recompute="selective"
    ),
    "tp-pp-llama-tied": _config("1f1b", dataclasses.replace(LLAMA, tie_embeddings=True), tp=2, dp=1, stages=2),
    "tp-pp-llama-pipedream": _config("pipedream", LLAMA, tp=2, dp=1, stages=2, steps=4, batch_size=8),
    # Its memory against TP alone, on a gpt whose blocks (not the vocabulary head) hold most activations.
    "tp-pp-wide": _config("1f1b", WIDE, tp=2, dp=1, stages=2, steps=1),
    "tp-pp-wide-sequence-parallel": _config("1f1b", WIDE, tp=2, dp=1, stages=2, steps=1, sequence_parallel=True),
}
SLOW = {  # (processes, config): further ZeRO-3 and clipping cases, in the slow run
    # ZeRO-3 on all three dimensions: each process keeps half of its tensor-parallel shards.
    "gpt-zb-h1-zero3": (8, _config("zb-h1", GPT, tp=2, dp=2, stages=2, zero=3, momentum=0.9)),
    "dp-pp-zero3-interleaved-adamw": (
        4,
        _config(
            "interleaved-1f1b",
            MLP,
            tp=1,
            dp=2,
            stages=2,
            num_chunks=2,
            zero=3,
            optimizer="adamw",
            lr=1e-2,
            bucket_mb=0.0005,
        ),
    ),
    "dp-pp-clip": (4, _config("zb-h1", GPT, tp=1, dp=2, stages=2, post_validation=PostValidation(max_norm=0.5))),
    # FSDP2 under bfloat16 autocast (bf16 tolerance), and on a custom model's own tensor-parallel plan.
    "dp-pp-zero3-bf16": (4, _config("zb-h1", GPT, tp=1, dp=2, stages=2, zero=3, precision="bf16")),
    "tp-dp-zero3-custom-plan": (
        4,
        _config("zb-h1", ModelSpec(kind="custom", entry=f"{CUSTOM}:tensor_parallel"), tp=2, dp=2, stages=1, zero=3),
    ),
    # Sequence parallelism on 1F1B, on all three dimensions, with recomputation, and clipped (the layer norms'
    # summed gradients counted once per tp group).
    "tp-pp-sequence-parallel-1f1b": (4, _config("1f1b", GPT, tp=2, dp=1, stages=2, sequence_parallel=True)),
    "gpt-zb-h1-sequence-parallel": (8, _config("zb-h1", GPT, tp=2, dp=2, stages=2, sequence_parallel=True)),
    "tp-pp-sequence-parallel-recompute": (
        4,
        _config("zb-h1", GPT, tp=2, dp=1, stages=2, sequence_parallel=True, recompute=True),
    ),
    "tp-dp-sequence-parallel-clip": (
        4,
        _config(
            "1f1b",
            GPT,
            tp=2,
            dp=2,
            stages=1,
            sequence_parallel=True,
            momentum=0.9,
            post_validation=PostValidation(max_norm=0.5),
        ),
    ),
}
MEMORY = ("tp-pp-wide", "tp-pp-wide-sequence-parallel")  # compared with each other
AGAINST_REFERENCE = (
    "tp-pp-llama-tied",
    "tp-pp-llama-pipedream",
    "tp-pp-pipedream",
    "tp-pp-pipedream-sequence-parallel",
    "tp-pp-tied",
    "dp-pp-tied-zero1",
    "dp-pp-pipedream-2bw",
    "gpt-pipedream",
    "dp-pp-pipedream-eval",
)


def _run_all(context: RankContext, configs: list[TrainConfig]) -> list[RunRecord | None]:
    return [run_rank(context, prepare(c)) for c in configs]


@pytest.fixture(scope="module")
def runs_4() -> dict[str, RunRecord]:
    return dict(zip(CASES_4, launch(_run_all, list(CASES_4.values()), 4, LaunchOptions(timeout_s=120))))


@pytest.fixture(scope="module")
def runs_8() -> dict[str, RunRecord]:
    return dict(zip(CASES_8, launch(_run_all, list(CASES_8.values()), 8, LaunchOptions(timeout_s=120))))


def _plain(config: TrainConfig) -> TrainResult:
    """Plain training of ``config``'s model, batch and optimizer (one run for configs differing only in how the
    parallel run shards or recomputes)."""
    return _plain_run(dataclasses.replace(config, zero=0, recompute=False, bucket_mb=25.0, sequence_parallel=False))


@functools.cache
def _plain_run(config: TrainConfig) -> TrainResult:
    factory = optimizer_factory(config)
    if config.post_validation is not None:
        factory = functools.partial(_Clipped, factory, config.post_validation.max_norm)
    return run_plain(
        config.model,
        steps=STEPS,
        batch_size=config.batch_size,
        num_microbatches=config.num_microbatches * config.data_parallel,
        optimizer_factory=factory,
        precision=config.precision,
    )


class _Clipped:
    """Plain training's clipping: ``torch.nn.utils.clip_grad_norm_`` over the whole model, then the step."""

    def __init__(self, factory: Any, max_norm: float, params: Any) -> None:
        self.params, self.max_norm = list(params), max_norm
        self.inner = factory(self.params)
        self.param_groups = self.inner.param_groups

    def step(self) -> None:
        assert float(torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)) > self.max_norm  # it clips
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)


def _assert_equals_plain(config: TrainConfig, record: RunRecord) -> None:
    plain = _plain(config)
    # bf16: a row-parallel layer rounds each partial output to bfloat16 before the sum (as Megatron's do),
    # where the whole layer rounds once: bfloat16's 8 bits, not float32's order of summation.
    tolerance = dict(rtol=1e-2, atol=1e-3) if config.precision == "bf16" else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(record.losses, plain.losses, **tolerance)
    if config.model.kind != "custom":  # (the custom model's batches differ more than 2 steps of training)
        assert record.losses[-1] < record.losses[0]  # it trains
    seen = set()
    for rank_record in record.ranks:
        for params in rank_record.parameters.values():
            for name, value in params.items():  # gathered whole from the tensor-parallel shards
                torch.testing.assert_close(value, plain.parameters[name], **tolerance, msg=name)
                seen.add(name)
    assert seen == set(plain.parameters)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SLOW))
def test_further_zero3_and_clipping_cases_equal_plain_training(case: str) -> None:
    processes, config = SLOW[case]
    (record,) = launch(_run_all, [config], processes, LaunchOptions(timeout_s=120))
    _assert_equals_plain(config, record)


@pytest.mark.parametrize("case", [c for c in CASES_4 if c not in AGAINST_REFERENCE + MEMORY])
def test_two_of_the_three_dimensions_equal_plain_training(runs_4: dict[str, RunRecord], case: str) -> None:
    _assert_equals_plain(CASES_4[case], runs_4[case])


@pytest.mark.parametrize("case", [c for c in AGAINST_REFERENCE if c in CASES_4])
def test_asynchronous_schedules_and_tied_weights_equal_the_reference(
    runs_4: dict[str, RunRecord], case: str, equals_reference: Any
) -> None:
    equals_reference(CASES_4[case], runs_4[case])


@pytest.mark.parametrize("case", [c for c in CASES_8 if c not in AGAINST_REFERENCE])
def test_pipeline_tensor_and_data_parallel_together_equal_plain_training(
    runs_8: dict[str, RunRecord], case: str
) -> None:
    _assert_equals_plain(CASES_8[case], runs_8[case])


def test_pipedream_on_all_three_dimensions_equals_its_reference(
    runs_8: dict[str, RunRecord], equals_reference: Any
) -> None:
    equals_reference(CASES_8["gpt-pipedream"], runs_8["gpt-pipedream"])


def test_the_record_holds_one_process_per_stage_rank_with_shards_weights(runs_8: dict[str, RunRecord]) -> None:
    record = runs_8["gpt-1f1b"]
    assert [r.rank for r in record.ranks] == [0, 1, 2, 3]  # P x D stage ranks; their TP groups ran alike
    whole = _plain(CASES_8["gpt-1f1b"]).parameters
    # Each process holds its shard of the split layers: less than the stage's whole weights.
    for r in record.ranks:
        stage_whole = sum(p.numel() * p.element_size() for ps in r.parameters.values() for p in ps.values())
        assert r.weight_bytes < stage_whole
    assert sum(p.numel() for p in whole.values()) > 0


def test_sequence_parallelism_holds_fewer_activation_bytes(runs_4: dict[str, RunRecord]) -> None:
    """The layer norms' inputs held from F to B are half the sequence; so is the message between the stages."""
    whole, sharded = runs_4["tp-pp-wide"], runs_4["tp-pp-wide-sequence-parallel"]
    torch.testing.assert_close(sharded.losses, whole.losses, rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(sharded.ranks, whole.ranks):
        assert mine.peak_activation_bytes < theirs.peak_activation_bytes
        assert mine.peak_tensor_bytes < theirs.peak_tensor_bytes


def test_pipedream_replicas_evaluate_the_held_out_loss_of_the_trained_weights(
    runs_4: dict[str, RunRecord], held_out_loss: Any
) -> None:
    """The replicas' shares of the evaluation sum to the held-out loss of the final weights (the reference
    executor's, checked above), computed whole in one process."""
    config, record = CASES_4["dp-pp-pipedream-eval"], runs_4["dp-pp-pipedream-eval"]
    assert [at for at, _ in record.eval_losses] == [2, 4]
    final = {n: v for r in record.ranks for params in r.parameters.values() for n, v in params.items()}
    source = data_source(GPT, batch_size=config.batch_size, seed=config.seed)
    assert record.eval_losses[-1][1] == pytest.approx(held_out_loss(GPT, final, source, config.eval_batches), rel=1e-5)
    assert record.eval_losses[0][1] != record.eval_losses[1][1]


def test_zero3_evaluates_the_held_out_loss_of_the_trained_weights(
    runs_4: dict[str, RunRecord], held_out_loss: Any
) -> None:
    config, record = CASES_4["dp-pp-zero3-1f1b"], runs_4["dp-pp-zero3-1f1b"]
    final = {n: v for r in record.ranks for params in r.parameters.values() for n, v in params.items()}
    source = data_source(GPT, batch_size=config.batch_size, seed=config.seed)
    assert record.eval_losses == [(STEPS, pytest.approx(held_out_loss(GPT, final, source, 1), rel=1e-5))]


def test_zero3_keeps_half_of_each_part_between_actions(runs_4: dict[str, RunRecord]) -> None:
    """FSDP2's shards: each replica the rows ``ceil(rows / 2)`` of every parameter (padded as FSDP pads); the
    activations held are those of the unsharded run (no freed parameter's address mistaken for a weight)."""
    for r, whole in zip(runs_4["dp-pp-zero3-zb-h1"].ranks, runs_4["dp-pp"].ranks):
        assert r.peak_activation_bytes == whole.peak_activation_bytes
        params = [p for ps in whole.parameters.values() for p in ps.values()]
        assert whole.weight_bytes == sum(p.numel() * 4 for p in params)
        assert r.weight_bytes == sum(-(-p.shape[0] // 2) * p[0].numel() * 4 for p in params)
        assert whole.weight_bytes / 2 <= r.weight_bytes < whole.weight_bytes * 0.6


TINY = [
    "train",
    "--model",
    "gpt",
    "--layers",
    "2",
    "--hidden",
    "16",
    "--heads",
    "4",
    "--seq-len",
    "8",
    "--batch",
    "8",
    "--steps",
    "1",
    "--quiet",
]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--tensor-parallel", "3"],
            "--heads 4 is not divisible by --tensor-parallel 3; give a tensor-parallel degree",
        ),
        (["--tensor-parallel", "0"], "--tensor-parallel 0 is invalid; give N >= 1"),
        (["--zero", "4"], "--zero 4 is invalid; choose one of: 0, 1, 2, 3"),
        (
            ["--data-parallel", "2", "--zero", "2", "--tie-embeddings"],
            "--zero 2 with tied parameters (0.token, 3.out.weight) is not supported; use --zero 1",
        ),
        (
            ["--data-parallel", "2", "--zero", "2", "--precision", "fp16"],
            "--zero 2 with --precision fp16 is not supported; use --zero 1 or --precision bf16",
        ),
        (
            ["-s", "pipedream", "--data-parallel", "2", "--zero", "3"],
            "--zero 3 with the asynchronous pipedream is not supported",
        ),
        (
            ["--data-parallel", "2", "--zero", "3", "--tie-embeddings"],
            "--zero 3 with tied parameters (0.token, 3.out.weight) is not supported",
        ),
        (["--bucket-mb", "0"], "--bucket-mb 0.0 is invalid; give MiB > 0"),
        (
            ["-s", "chimera", "--data-parallel", "2", "--zero", "1"],
            "--zero 1 shards data-parallel replicas; chimera replicates parts inside its pipeline",
        ),
        (
            ["--tensor-parallel", "2", "--clip-grad-norm", "1", "-s", "interleaved-1f1b", "--layers", "4"],
            "--clip-grad-norm with --tensor-parallel/--data-parallel needs one stage per rank; interleaved-1f1b",
        ),
        (
            ["-s", "pipemare", "--data-parallel", "2"],
            "--data-parallel with the asynchronous pipemare is not supported; use one of pipedream, pipedream-2bw",
        ),
        (
            ["--tensor-parallel", "2", "--model", f"{CUSTOM}:bad_tp_plan"],
            "tp_plan[1]: the TP plan names 'mlp.5', which is not a linear layer of it; give one of mlp.0, mlp.2",
        ),
        (["--tensor-parallel", "2", "--model", f"{CUSTOM}:model"], "has no tp_plan; give its LayerModel a tp_plan"),
        (
            ["--sequence-parallel"],
            "--sequence-parallel shards activations over the tensor-parallel group; give --tensor-parallel N > 1",
        ),
        (
            ["--sequence-parallel", "--tensor-parallel", "2", "--seq-len", "7"],
            "--seq-len 7 is not divisible by --tensor-parallel 2",
        ),
        (
            ["--sequence-parallel", "--tensor-parallel", "2", "--model", "mlp", "--hidden", "8"],
            "--sequence-parallel applies to the gpt and the llama (a sequence to shard); --model mlp has none",
        ),
        (
            ["--sequence-parallel", "--tensor-parallel", "2", "--data-parallel", "2", "--zero", "1"],
            "--sequence-parallel with --zero 1 is not supported; drop one of them",
        ),
        (
            ["--tensor-parallel", "2", "--model", "llama", "--heads", "4", "--kv-heads", "1"],
            "--kv-heads 1 is not divisible by --tensor-parallel 2; give a tensor-parallel degree that divides it",
        ),
        (
            ["--tensor-parallel", "4", "--model", "llama", "--heads", "4", "--ffn-hidden", "6"],
            "--ffn-hidden 6 is not divisible by --tensor-parallel 4",
        ),
    ],
    ids=[
        "heads",
        "zero-degree",
        "zero-4",
        "zero2-tied",
        "zero2-fp16",
        "zero3-async",
        "zero3-tied",
        "bucket",
        "zero-chimera",
        "tp-clip",
        "async-dp",
        "plan-name",
        "no-plan",
        "sp-no-tp",
        "sp-seq-len",
        "sp-mlp",
        "sp-zero",
        "llama-kv-heads",
        "llama-ffn",
    ],
)
def test_bad_parallel_input_is_one_line_before_spawning(
    cli_error: Any, argv: list[str], message: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    base = ["train", "--batch", "8", "--steps", "1", "--quiet"] if "--model" in argv else TINY  # custom: its own sizes
    err = cli_error([*base, *argv], "pipeweave.runtime.run.launch._spawn")
    assert message in err, err


def test_a_torchrun_world_other_than_p_x_d_x_n_is_one_line(
    cli_error: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for name, value in {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    err = cli_error(
        [*TINY, "--stages", "2", "--tensor-parallel", "2", "--data-parallel", "2"],
        "pipeweave.commands.train_run.launch",
    )
    assert (
        "torchrun started 4 processes but --data-parallel 2 x 2 stage ranks x --tensor-parallel 2 need 8; "
        "give --nnodes x --nproc-per-node = 8"
    ) in err, err


def test_clipping_with_tensor_parallelism_counts_a_tied_pair_once() -> None:
    # Oracle: the same tied gpt on one process per stage, clipped by post-validation (which passes whole
    # stages' norms down the pipeline); with TP the norm is one all-reduce (runtime.clip). Both must count
    # the tied embedding and head once, as clip_grad_norm_ counts a shared parameter (both counted them
    # twice or crashed before this test: the norm here is ~9, clipped to 0.5, so a double count shows).
    tied = dataclasses.replace(GPT, tie_embeddings=True)
    clip = PostValidation(max_norm=0.5)
    with_tp = _config("1f1b", tied, tp=2, dp=1, stages=2, momentum=0.9, post_validation=clip)
    without = dataclasses.replace(with_tp, tensor_parallel=1)
    (sharded,) = launch(_run_all, [with_tp], 4, LaunchOptions(timeout_s=120))
    (whole,) = launch(_run_all, [without], 2, LaunchOptions(timeout_s=120))
    torch.testing.assert_close(sharded.losses, whole.losses, rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(sharded.ranks, whole.ranks):
        for stage, params in mine.parameters.items():
            for name, value in params.items():
                torch.testing.assert_close(value, theirs.parameters[stage][name], rtol=1e-5, atol=1e-6, msg=name)
