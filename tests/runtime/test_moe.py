"""A mixture-of-experts gpt and llama (``models.moe``) train on pipelines exactly as plain training does, the
auxiliary loss included: on 2 gloo ranks (1f1b, zb-h1's deferred W, dualpipe-v's V), in process on every
synchronous schedule, and with a router that leaves experts without a token."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from config_defaults import train_config

from pipeweave.config import TrainConfig
from pipeweave.errors import UserError
from pipeweave.models import ModelSpec
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.plain import TrainResult, run_plain
from pipeweave.runtime.reference import run_reference
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import build_schedule, optimizer_factory, prepare
from pipeweave.runtime.run.record import RunRecord
from pipeweave.schedule import SCHEDULES, ScheduleError, generate

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 2
GPT = ModelSpec(kind="gpt", layers=2, hidden=16, heads=2, seq_len=8, moe_experts=4, moe_top_k=2)
LLAMA = ModelSpec(
    kind="llama", layers=2, hidden=16, heads=2, seq_len=8, ffn_hidden=24, moe_experts=4, moe_top_k=2, moe_every=2
)
STARVED = ModelSpec(kind="llama", layers=2, hidden=16, heads=2, seq_len=2, ffn_hidden=24, moe_experts=8, moe_top_k=1)
"""A microbatch of one sample routes 2 tokens to 8 experts: most experts get none."""


def _config(spec: ModelSpec, schedule: str, t: int = 4, **rest: object) -> TrainConfig:
    fields: dict[str, object] = dict(
        schedule=schedule,
        num_stages=2,
        num_microbatches=t,
        model=spec,
        batch_size=2 * t - 1,  # uneven microbatches: each auxiliary loss weighted by its share
        steps=STEPS,
        collect_parameters=True,
    )
    return train_config(**{**fields, **rest})  # type: ignore[arg-type]


CASES = {
    "gpt-1f1b": _config(GPT, "1f1b"),
    "llama-zb-h1": _config(LLAMA, "zb-h1"),
    "gpt-dualpipe-v": _config(dataclasses.replace(GPT, moe_router="sigmoid"), "dualpipe-v"),
    "llama-starved-1f1b-recompute": _config(STARVED, "1f1b", t=4, recompute="full"),
    "gpt-capacity-zb-h1-adamw": _config(dataclasses.replace(GPT, moe_capacity=1.0), "zb-h1", optimizer="adamw"),
    # fp16: the auxiliary losses' gradients carry the loss scale as the main loss's do
    "gpt-1f1b-fp16": _config(GPT, "1f1b", precision="fp16", loss_scale=2.0**10, lr=0.05),
}


PARALLEL = {  # 4 processes: experts split over 2 tensor-parallel ranks as the dense MLP is; 2 data-parallel replicas
    "tp-pp-gpt-1f1b": _config(GPT, "1f1b", tensor_parallel=2),
    "tp-pp-llama-zb-h1-starved": _config(dataclasses.replace(STARVED, seq_len=4), "zb-h1", tensor_parallel=2),
    "dp-pp-gpt-zb-h1": _config(GPT, "zb-h1", data_parallel=2, batch_size=15),
}


def _run_all(context: RankContext, configs: list[TrainConfig]) -> list[RunRecord | None]:
    return [run_rank(context, prepare(c)) for c in configs]


@pytest.fixture(scope="module")
def records() -> dict[str, RunRecord]:
    ran = launch(_run_all, list(CASES.values()), 2, LaunchOptions(timeout_s=120))
    return {name: record for name, record in zip(CASES, ran) if record is not None}


def _plain(config: TrainConfig) -> TrainResult:
    """Plain training of the run's model, batch, optimizer and precision (every replica's microbatches in one
    process; fp16 with GradScaler from the run's scale)."""
    t, factory = config.num_microbatches * config.data_parallel, optimizer_factory(config)
    scaler = torch.amp.GradScaler("cpu", init_scale=config.loss_scale) if config.precision == "fp16" else None
    return run_plain(
        config.model,
        steps=STEPS,
        batch_size=config.batch_size,
        num_microbatches=t,
        optimizer_factory=factory,
        precision=config.precision,
        scaler=scaler,
    )


def _final(record: RunRecord) -> dict[str, torch.Tensor]:
    """Every stage's final parameters by global name."""
    return {name: value for r in record.ranks for params in r.parameters.values() for name, value in params.items()}


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_moe_on_two_ranks_equals_plain_training(records: dict[str, RunRecord], case: str) -> None:
    plain, final = _plain(CASES[case]), _final(records[case])
    torch.testing.assert_close(records[case].losses, plain.losses, rtol=1e-5, atol=0)
    assert set(final) == set(plain.parameters) and any(".moe.experts." in name for name in final)
    for name, value in final.items():
        torch.testing.assert_close(value, plain.parameters[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_moe_with_tensor_and_data_parallelism_equals_plain_training() -> None:
    ran = launch(_run_all, list(PARALLEL.values()), 4, LaunchOptions(timeout_s=120))
    for (case, config), record in zip(PARALLEL.items(), ran):
        assert record is not None
        plain, final = _plain(config), _final(record)
        torch.testing.assert_close(record.losses, plain.losses, rtol=1e-5, atol=0, msg=case)
        assert set(final) == set(plain.parameters), case
        for name, value in final.items():
            torch.testing.assert_close(value, plain.parameters[name], rtol=1e-5, atol=1e-6, msg=f"{case}: {name}")


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_experts_without_tokens_train_with_zero_gradients(records: dict[str, RunRecord]) -> None:
    """Experts the router never chose keep their initial weights (SGD of a zero gradient); the others moved."""
    initial = run_plain(STARVED, steps=0, batch_size=7, num_microbatches=4).parameters
    final = _final(records["llama-starved-1f1b-recompute"])
    experts = {name.rsplit(".", 2)[0] for name in final if ".moe.experts.local." in name}  # "1.moe.experts.local.3"
    moved = {
        e for e in experts if any(not torch.equal(v, initial[n]) for n, v in final.items() if n.startswith(e + "."))
    }
    assert moved and experts - moved, moved  # some trained, some never got a token
    assert all(torch.isfinite(v).all() for v in final.values())


def _schedule_config(name: str) -> TrainConfig | None:
    """The MoE gpt on 2 ranks of ``name`` with the first T it accepts (None: no such schedule for 4 layers)."""
    chunks = 2 if SCHEDULES[name].chunks is None else None
    for t in (4, 6, 8):
        config = _config(GPT, name, t=t, num_chunks=chunks)
        try:
            if prepare(config).schedule.num_ranks == 2:
                return config
        except (ScheduleError, UserError):
            continue
    return None


SYNCHRONOUS = [name for name, info in SCHEDULES.items() if info.synchronous]


@pytest.mark.parametrize("name", SYNCHRONOUS)
def test_every_synchronous_schedule_trains_moe_as_plain_training(name: str) -> None:
    """In process (the reference executor): the same losses and weights as plain training, the aux loss in both."""
    config = _schedule_config(name)
    if config is None:
        pytest.skip(f"{name} has no 2-rank schedule for a 4-layer model")
    got = run_reference(build_schedule(config), GPT, steps=STEPS, batch_size=config.batch_size)
    want = _plain(config)
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(want.losses), rtol=1e-5, atol=0)
    for key, value in want.parameters.items():
        torch.testing.assert_close(got.parameters[key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_every_synchronous_schedule_on_two_ranks_equals_plain_training() -> None:
    configs = {name: c for name in SYNCHRONOUS if (c := _schedule_config(name)) is not None}
    ran = launch(_run_all, list(configs.values()), 2, LaunchOptions(timeout_s=300))
    for (name, config), record in zip(configs.items(), ran):
        assert record is not None
        plain = _plain(config)
        torch.testing.assert_close(record.losses, plain.losses, rtol=1e-5, atol=0, msg=name)
        for key, value in _final(record).items():
            torch.testing.assert_close(value, plain.parameters[key], rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")


def test_the_reported_loss_includes_the_auxiliary_loss() -> None:
    """At the first step the weights are the same with and without it: the losses differ by the aux loss alone."""
    with_aux = run_plain(GPT, steps=1, batch_size=7, num_microbatches=4).losses[0]
    without = run_plain(dataclasses.replace(GPT, moe_aux_loss=0.0), steps=1, batch_size=7, num_microbatches=4)
    gap = with_aux - without.losses[0]
    # Switch's loss is coef x E x sum f_i P_i: coef for uniform routing; two MoE blocks, shares summing to 1
    assert 0.5 * 2 * GPT.moe_aux_loss < gap < 2 * 2 * GPT.moe_aux_loss
    reference = run_reference(generate("1f1b", num_stages=2, num_microbatches=4), GPT, steps=1, batch_size=7)
    assert reference.losses[0] == pytest.approx(with_aux, rel=1e-6)
