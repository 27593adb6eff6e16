"""Expert parallelism trains a mixture-of-experts gpt and llama exactly as plain training does (gloo, CPU).

With E = 4 experts, top-2 routing, ``--expert-parallel 2`` over ``--data-parallel 2`` on 2 pipeline ranks (4
processes: each process holds 2 of every layer's experts, tokens exchanged by all-to-all within its ``ep``
group), 1F1B, ZB-H1 (the experts' W deferred) and DualPipe-V (two stages of the V on each rank, replicas
inside the pipeline) give plain training's losses and final weights; so does ``--data-parallel 4`` with
``--expert-parallel 2`` on one stage, where each share of the experts is held twice and summed over its own
group of 2, and is clipped to the same global norm; so does EP = 2 with TP = 2 (each expert split over
``tp`` as the dense MLP is, each ``tp`` coordinate exchanging its shards' tokens). A router that leaves experts without a token (8 experts, one token per microbatch and rank) still
trains, replayed under recomputation: no hang, those experts' gradients zero. Tolerance as
``test_parallel_3d``'s: float32 reduction order, rtol 1e-5.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from config_defaults import train_config

from pipeweave.config import TrainConfig
from pipeweave.data import data_source
from pipeweave.errors import UserError
from pipeweave.models import ModelSpec
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.plain import run_plain
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import prepare
from pipeweave.runtime.run.record import RunRecord
from pipeweave.runtime.run.resolve import resolve
from pipeweave.runtime.stage.post_validation import PostValidation

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_parallel_3d import _plain  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.distributed,
    pytest.mark.timeout(300),
    pytest.mark.usefixtures("one_thread"),
]

STEPS = 2
DELAY_MS = 20.0
GPT = ModelSpec(kind="gpt", layers=2, hidden=16, heads=2, seq_len=8, moe_experts=4, moe_top_k=2)
LLAMA = ModelSpec(kind="llama", layers=2, hidden=16, heads=2, seq_len=8, ffn_hidden=24, moe_experts=4, moe_top_k=2)
STARVED = ModelSpec(kind="llama", layers=2, hidden=16, heads=2, seq_len=1, ffn_hidden=24, moe_experts=8, moe_top_k=1)
"""Each microbatch of a replica routes one token per sample: most experts get none from a rank, some from any."""


def _config(spec: ModelSpec, schedule: str, *, dp: int = 2, stages: int = 2, **rest: Any) -> TrainConfig:
    fields: dict[str, Any] = dict(
        schedule=schedule,
        num_stages=stages,
        num_microbatches=4,
        model=spec,
        batch_size=2 * 4 * dp - 1,  # uneven microbatches: each auxiliary loss weighted by its share
        steps=STEPS,
        collect_parameters=True,
        data_parallel=dp,
        expert_parallel=2,
    )
    return train_config(**{**fields, **rest})


CASES = {
    "gpt-1f1b": _config(GPT, "1f1b", eval_every=STEPS, eval_batches=2),  # evaluated at the end, experts split
    "llama-zb-h1": _config(LLAMA, "zb-h1"),
    "gpt-dualpipe-v": _config(dataclasses.replace(GPT, moe_router="sigmoid"), "dualpipe-v"),
    "gpt-dp4-zb-h1": _config(GPT, "zb-h1", dp=4, stages=1, momentum=0.9),
    # --clip-grad-norm by one all-reduce: each share of the experts counted once, on its first holder.
    "gpt-dp4-1f1b-clip": _config(GPT, "1f1b", dp=4, stages=1, post_validation=PostValidation(max_norm=0.5)),
    "llama-starved-1f1b-recompute": _config(STARVED, "1f1b", recompute="full"),
    # With tensor parallelism: each tp coordinate its own ep group, its experts' shards exchanging tokens.
    "llama-tp2-zb-h1": _config(LLAMA, "zb-h1", stages=1, tensor_parallel=2),
    # --comm-delay-ms (a testing aid, transport.delay): every all-to-all of the experts waits the delay too.
    "gpt-1f1b-delayed": _config(GPT, "1f1b", comm_delay_ms=DELAY_MS, transport="gloo"),
}


def _run_all(context: RankContext, configs: list[TrainConfig]) -> list[RunRecord | None]:
    return [run_rank(context, prepare(c)) for c in configs]


@pytest.fixture(scope="module")
def records() -> dict[str, RunRecord]:
    return dict(zip(CASES, launch(_run_all, list(CASES.values()), 4, LaunchOptions(timeout_s=120))))


def _final(record: RunRecord) -> dict[str, list[torch.Tensor]]:
    """Every process's final parameters by global name (a name held by several replicas: each one's)."""
    final: dict[str, list[torch.Tensor]] = {}
    for r in record.ranks:
        for params in r.parameters.values():
            for name, value in params.items():
                final.setdefault(name, []).append(value)
    return final


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_training_equals_plain_training(records: dict[str, RunRecord], case: str) -> None:
    plain, final = _plain(CASES[case]), _final(records[case])
    torch.testing.assert_close(records[case].losses, plain.losses, rtol=1e-5, atol=0)
    assert set(final) == set(plain.parameters)
    for name, values in final.items():
        for value in values:  # every replica of it
            torch.testing.assert_close(value, plain.parameters[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("case", ["gpt-1f1b", "gpt-dp4-zb-h1"])
def test_each_process_holds_its_share_of_the_experts(records: dict[str, RunRecord], case: str) -> None:
    """Per layer, each ``ep`` rank holds 2 of the 4 experts and receives rows only for those; the other share's
    on the other rank of its group."""
    dp = CASES[case].data_parallel
    for r in records[case].ranks:
        names = [n for p in r.parameters.values() for n in p if ".moe.experts.local." in n]
        experts = {n.split(".moe.experts.local.")[1].split(".")[0] for n in names}
        share = (r.rank // (len(records[case].ranks) // dp)) % 2
        assert experts == {str(2 * share), str(2 * share + 1)}, (r.rank, experts)
        assert len(r.expert_rows) == STEPS and len(r.all_to_all_s) == STEPS
        for layers in r.expert_rows:
            assert all(set(rows) == {2 * share, 2 * share + 1} for rows in layers.values())
        assert all(s > 0 for s in r.all_to_all_s)


def test_the_replicas_evaluate_the_held_out_loss_of_the_trained_weights(
    records: dict[str, RunRecord], held_out_loss: Any
) -> None:
    """An evaluation exchanges tokens as training does: the replicas' shares sum to the loss of the final
    weights computed whole in one process."""
    config, record = CASES["gpt-1f1b"], records["gpt-1f1b"]
    final = {name: values[0] for name, values in _final(record).items()}
    source = data_source(GPT, batch_size=config.batch_size, seed=config.seed)
    assert [at for at, _ in record.eval_losses] == [STEPS]
    assert record.eval_losses[0][1] == pytest.approx(held_out_loss(GPT, final, source, 2), rel=1e-5)


def test_the_injected_delay_slows_every_all_to_all(records: dict[str, RunRecord]) -> None:
    """``--comm-delay-ms``: each of a step's all-to-alls (dispatch and combine, F and backward, per MoE layer
    and microbatch) takes at least the delay."""
    config = CASES["gpt-1f1b-delayed"]
    for r in records["gpt-1f1b-delayed"].ranks:
        exchanges = 4 * config.num_microbatches * len(r.expert_rows[0])
        assert all(s >= exchanges * DELAY_MS / 1000 for s in r.all_to_all_s), (r.rank, r.all_to_all_s)


def test_experts_without_tokens_train_with_zero_gradients(records: dict[str, RunRecord]) -> None:
    """Experts no rank routed a token to keep their initial weights (SGD of a zero gradient); the others moved."""
    config = CASES["llama-starved-1f1b-recompute"]
    initial = run_plain(STARVED, steps=0, batch_size=config.batch_size, num_microbatches=8).parameters
    final = {name: values[0] for name, values in _final(records["llama-starved-1f1b-recompute"]).items()}
    experts = {name.rsplit(".", 2)[0] for name in final if ".moe.experts.local." in name}
    moved = {
        e for e in experts if any(not torch.equal(v, initial[n]) for n, v in final.items() if n.startswith(e + "."))
    }
    assert moved and experts - moved, moved  # some trained, some never got a token
    unrouted = {
        (layer, expert)
        for r in records["llama-starved-1f1b-recompute"].ranks
        for layer, rows in r.expert_rows[0].items()
        for expert, n in rows.items()
        if n == 0
    }
    assert unrouted  # the first step left some expert without a row on every rank of its group


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(data_parallel=2, expert_parallel=3), "--expert-parallel 3 splits the experts over that many of the "),
        (dict(data_parallel=2, expert_parallel=2, zero=1), "--zero 1 does not shard expert-parallel experts"),
        (dict(schedule="pipedream", data_parallel=2, expert_parallel=2), "needs a synchronous schedule"),
    ],
)
def test_expert_parallelism_the_fields_refuse_is_one_line(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(UserError, match=message) as caught:
        train_config(model=GPT, **fields)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (dataclasses.replace(GPT, moe_experts=None), "--model gpt has none; give --moe-experts"),
        (dataclasses.replace(GPT, moe_experts=6), "--moe-experts 6 is not divisible by --expert-parallel 4"),
    ],
)
def test_expert_parallelism_the_model_refuses_is_one_line(model: ModelSpec, message: str) -> None:
    ep = 2 if model.moe_experts is None else 4
    config = train_config(model=model, data_parallel=4, expert_parallel=ep, num_microbatches=2, batch_size=8)
    with pytest.raises(UserError, match=message) as caught:
        prepare(config)
    assert "\n" not in str(caught.value)


def test_the_command_lines_configuration_resolves_with_expert_parallelism() -> None:
    """``resolve`` finds the parts on one replica (``--data-parallel 1``): expert parallelism goes with it."""
    config = resolve(train_config(model=GPT, data_parallel=2, expert_parallel=2, num_microbatches=2, batch_size=8))
    assert config.parallel.expert_parallel == 2


def _run_one(context: RankContext, config: TrainConfig) -> RunRecord | None:
    return run_rank(context, prepare(config))


@pytest.mark.slow
@pytest.mark.parametrize("resumed_ep", [2, 1])
def test_a_checkpoint_resumes_with_the_experts_split_or_whole(tmp_path: Path, resumed_ep: int) -> None:
    """Each ``ep`` rank saves its share under the experts' global names (DCP): 2 steps, saved, then 2 more
    resumed -- with the experts split alike, or whole on every replica -- end where 4 steps straight do."""
    base = _config(GPT, "1f1b", num_microbatches=2, batch_size=8, momentum=0.9)
    options = LaunchOptions(timeout_s=120)
    whole = launch(_run_one, base.replace(steps=4), 4, options)
    launch(_run_one, base.replace(save=str(tmp_path)), 4, options)
    resumed = launch(_run_one, base.replace(resume=str(tmp_path), expert_parallel=resumed_ep), 4, options)
    torch.testing.assert_close(resumed.losses, whole.losses[2:], rtol=1e-6, atol=0)
    final, expected = _final(resumed), _final(whole)
    assert set(final) == set(expected)
    for name, values in final.items():
        for value in values:
            torch.testing.assert_close(value, expected[name][0], rtol=1e-5, atol=1e-7, msg=name)
