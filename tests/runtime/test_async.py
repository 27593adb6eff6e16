"""Asynchronous streams at run time: distributed = reference, versions = the simulator's, weight bytes = its copies.

For every asynchronous schedule of the registry (read at test time) and a few
option variants, on 2 and 3 gloo ranks, one process group per rank count runs
every case (``runtime.stream``: ``--steps N`` is one stream of N mini-batches).
Each case must give:

- per-mini-batch losses and final parameters equal to the reference executor's;
- the version each F/B/I/W read, as recorded by ``runtime.stage.policy`` on every
  rank, equal to ``sim.versions.read_versions`` (an independent derivation from
  the order alone);
- the peak weight bytes each rank held equal to ``sim.versions.weight_copies``
  x each part's bytes (PipeDream D - r versions, 2BW/WPipe 2, AvgPipe P, ...).

Independent oracles without the simulator: on one stage a stream with one
update per mini-batch is plain training; a prediction swaps in exactly
w - s lr v, and with any other optimizer its own look-ahead (``weights.optimizers``,
itself checked against each optimizer's published rule in tests/weights). A synchronous schedule in the same group records no versions and
still equals the reference.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from config_defaults import train_config

from pipeweave.config import TrainConfig
from pipeweave.models import ModelSpec
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.plain import run_plain
from pipeweave.runtime.reference import run_reference, run_stream_reference
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import build_schedule, learning_rates, optimizer_factory, prepare
from pipeweave.runtime.run.record import RunRecord
from pipeweave.runtime.stage.policy import PolicyOptions, RankPolicy
from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.runtime.stream import stream_steps, stream_updates
from pipeweave.schedule import SCHEDULES, generate
from pipeweave.schedule.ir import Action, Op
from pipeweave.sim.cost import CostModel
from pipeweave.sim.versions import read_versions, weight_copies
from pipeweave.weights.optimizers import build_optimizer
from pipeweave.weights.prediction import predict_weights, update_direction

RANKS = (2, 3)
STEPS = 4  # mini-batches: warm-up, two steady, drain
T = 4
VARIANTS: dict[str, tuple[str, dict[str, object], dict[str, object]]] = {
    # case -> (schedule, generator options, TrainConfig overrides)
    **{name: (name, {}, {}) for name, info in SCHEDULES.items() if not info.synchronous},
    "pipedream+vertical-sync": ("pipedream", {"vertical_sync": True}, {}),
    "pipemare+warmup": ("pipemare", {"warmup_steps": 1}, {}),
    "xpipe+adamw": ("xpipe", {}, {"optimizer": "adamw", "lr": 1e-2}),
    "spectrain+adamw": ("spectrain", {}, {"optimizer": "adamw", "lr": 1e-2}),
    # XGrad: prediction along each optimizer's own next step (RMSprop without momentum: its square average)
    "xpipe+adam": ("xpipe", {}, {"optimizer": "adam", "lr": 1e-2}),
    "spectrain+adam": ("spectrain", {}, {"optimizer": "adam", "lr": 1e-2}),
    "xpipe+rmsprop": ("xpipe", {}, {"optimizer": "rmsprop", "lr": 1e-2, "momentum": 0.0}),
    "spectrain+rmsprop": ("spectrain", {}, {"optimizer": "rmsprop", "lr": 1e-2, "momentum": 0.0}),
    "xpipe+adabelief": ("xpipe", {}, {"optimizer": "adabelief", "lr": 1e-2}),
    "spectrain+adabelief": ("spectrain", {}, {"optimizer": "adabelief", "lr": 1e-2}),
    "spectrain+nesterov": ("spectrain", {}, {"optimizer": "nesterov"}),
    "pipedream+bf16": ("pipedream", {}, {"precision": "bf16"}),
    "pipedream+cosine": ("pipedream", {}, {"lr_schedule": "cosine", "lr_warmup": 1}),
    "pipemare+linear": ("pipemare", {"warmup_steps": 1}, {"lr_schedule": "linear", "lr_warmup": 2}),
    "1f1b (synchronous)": ("1f1b", {}, {"steps": 2}),
}

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.distributed, pytest.mark.timeout(240)]


def _config(case: str, ranks: int) -> TrainConfig:
    name, options, overrides = VARIANTS[case]
    fields: dict[str, object] = dict(
        schedule=name,
        num_stages=ranks,
        num_microbatches=T,
        model=ModelSpec(kind="mlp", layers=4 * ranks, hidden=8),
        batch_size=2 * T - 1,
        steps=STEPS,
        lr=0.05,
        momentum=0.9,
        collect_parameters=True,
        options=tuple(options.items()),
    )
    fields.update(overrides)
    return train_config(**fields)  # type: ignore[arg-type]


def _run_all(context: RankContext, configs: list[TrainConfig]) -> list[RunRecord | None]:
    return [run_rank(context, prepare(c)) for c in configs]


@pytest.fixture(scope="module", params=RANKS, ids=lambda r: f"{r}ranks")
def runs(request: pytest.FixtureRequest) -> dict[str, tuple[TrainConfig, RunRecord]]:
    configs = {case: _config(case, request.param) for case in VARIANTS}
    for config in configs.values():
        prepare(config)
    records = launch(_run_all, list(configs.values()), request.param, LaunchOptions(timeout_s=60))
    return {case: (configs[case], record) for case, record in zip(configs, records)}


def _part_bytes(
    config: TrainConfig, stage_parameters: list[dict[str, torch.Tensor]], part_of: tuple[int, ...]
) -> list[float]:
    out = [0.0] * (max(part_of) + 1)
    for s, params in enumerate(stage_parameters):
        out[part_of[s]] = float(sum(p.numel() * p.element_size() for p in params.values()))
    return out


@pytest.mark.parametrize("case", list(VARIANTS))
def test_stream_distributed_equals_reference_versions_and_weight_bytes(
    runs: dict[str, tuple[TrainConfig, RunRecord]], case: str
) -> None:
    config, record = runs[case]
    schedule = build_schedule(config)
    rates = None
    if config.lr_scheduled:
        rates = learning_rates(config, updates=stream_updates(schedule) if config.is_stream else None).at
    reference = run_reference(
        schedule,
        config.model,
        steps=config.steps,
        batch_size=config.batch_size,
        optimizer_factory=optimizer_factory(config),
        precision=config.precision,
        lr_at=rates,
    )
    assert len(record.losses) == config.steps
    torch.testing.assert_close(record.losses, reference.losses, rtol=1e-5, atol=1e-6)
    for rank_record in record.ranks:
        for stage, params in rank_record.parameters.items():
            for name, value in params.items():
                torch.testing.assert_close(value, reference.stage_parameters[stage][name], rtol=1e-5, atol=1e-6)
    if schedule.is_synchronous:
        assert all(not r.versions for r in record.ranks)  # no policy hook on the synchronous path
        return
    expected = {a: (v.version, v.target) for a, v in read_versions(schedule).items()}
    recorded = {a: v for r in record.ranks for a, v in r.versions.items()}
    assert recorded == expected  # every F/B/I/W, on the rank that ran it
    assert reference.versions == expected
    part_bytes = _part_bytes(config, reference.stage_parameters, schedule.placement.stage_part)
    costs = CostModel(weight=part_bytes).for_parts(num_parts=schedule.num_parts, num_ranks=schedule.num_ranks)
    simulated = [int(c) for c in weight_copies(schedule, costs)]
    assert [r.weight_bytes for r in record.ranks] == simulated
    assert reference.weight_bytes == simulated


def test_pipedream_weight_bytes_follow_the_survey(runs: dict[str, tuple[TrainConfig, RunRecord]]) -> None:
    """PipeDream: rank r of D holds D - r versions; 2BW 2 (last rank 1: its B follows its F); AvgPipe P."""
    config, record = runs["pipedream"]
    d = config.num_stages
    one = [r.weight_bytes for r in runs["ampnet"][1].ranks]  # a single copy per rank
    assert [r.weight_bytes for r in record.ranks] == [(d - r) * one[r] for r in range(d)]
    assert [r.weight_bytes for r in runs["pipedream-2bw"][1].ranks] == [2 * b for b in one[:-1]] + [one[-1]]
    assert [r.weight_bytes for r in runs["avgpipe"][1].ranks] == [2 * b for b in one]


@pytest.mark.parametrize("name", ["pipedream-2bw", "pipemare", "xpipe", "avgpipe"])
def test_one_stage_stream_with_an_update_per_minibatch_is_plain_training(name: str) -> None:
    """With D = 1 there is no delay: F and B read the live weights, corrections and predictions vanish."""
    spec = ModelSpec(kind="mlp", layers=2, hidden=8)
    options = {"num_pipelines": 1} if name == "avgpipe" else {}
    schedule = generate(name, num_stages=1, num_microbatches=3, num_steps=stream_steps(name, 3, options), **options)
    factory = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    got = run_stream_reference(schedule, spec, batch_size=7, optimizer_factory=factory)
    plain = run_plain(spec, steps=3, batch_size=7, num_microbatches=3, optimizer_factory=factory)
    torch.testing.assert_close(got.losses, plain.losses, rtol=1e-6, atol=1e-7)
    for name_, value in plain.parameters.items():
        torch.testing.assert_close(got.parameters[name_], value, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["pipedream-2bw", "pipemare"])
def test_one_stage_stream_follows_the_lr_schedule_of_plain_training(name: str) -> None:
    """--lr-schedule on a stream: each stage's k-th update takes step k's rate (D = 1: plain training's steps)."""
    from pipeweave.runtime.stage.lr_schedule import LrSchedule

    spec = ModelSpec(kind="mlp", layers=2, hidden=8)
    schedule = generate(name, num_stages=1, num_microbatches=3, num_steps=stream_steps(name, 4, {}))
    assert stream_updates(schedule) == 4
    rates = LrSchedule("cosine", lr=0.2, warmup=1, decay_steps=4)
    factory = lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9)  # noqa: E731
    got = run_stream_reference(schedule, spec, batch_size=7, optimizer_factory=factory, lr_at=rates.at)
    plain = run_plain(spec, steps=4, batch_size=7, num_microbatches=3, optimizer_factory=factory, lr_at=rates.at)
    constant = run_stream_reference(schedule, spec, batch_size=7, optimizer_factory=factory)
    torch.testing.assert_close(got.losses, plain.losses, rtol=1e-6, atol=1e-7)
    assert got.losses[1:] != constant.losses[1:]  # the rates took effect
    for name_, value in plain.parameters.items():
        torch.testing.assert_close(got.parameters[name_], value, rtol=1e-6, atol=1e-7)


def test_spectrain_swaps_in_w_minus_s_lr_v_and_restores_the_live_weights() -> None:
    schedule = generate("spectrain", num_stages=2, num_microbatches=2, num_steps=2)
    worker = StageWorker(
        ModelSpec(kind="mlp", layers=2, hidden=4),
        range(1),
        batch_size=2,
        optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9),
    )
    p = next(worker.module.parameters())
    p.grad = torch.ones_like(p)
    worker.optimizer.step()  # momentum buffer = 1, w -= 0.5
    live = p.detach().clone()
    policy = RankPolicy(schedule, {0: worker})
    a = Action(0, Op.F, 1)  # stage 0's forward of microbatch 1: read at version 0, applied by U(0, 1)
    policy.enter(a)
    assert policy.versions[a] == (0, 1)
    torch.testing.assert_close(p.detach(), live - 1 * 0.5 * 1.0)  # s = 1, lr = 0.5, v = 1
    policy.exit(a)
    assert torch.equal(p.detach(), live)


@pytest.mark.parametrize("optimizer", ["nesterov", "adam", "adamw", "rmsprop", "adabelief"])
def test_a_prediction_swaps_in_the_optimizers_own_look_ahead(optimizer: str) -> None:
    """XGrad: the weights a predicted F reads are ``predict_weights`` (the optimizer's next step s times)."""
    schedule = generate("spectrain", num_stages=2, num_microbatches=2, num_steps=2)
    worker = StageWorker(
        ModelSpec(kind="mlp", layers=2, hidden=4),
        range(1),
        batch_size=2,
        optimizer_factory=lambda ps: build_optimizer(
            optimizer, ps, lr=0.5, momentum=0.9 if optimizer == "nesterov" else 0
        ),
    )
    params = list(worker.module.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    worker.optimizer.step()
    live = [p.detach().clone() for p in params]
    want = predict_weights(worker.optimizer, params, 1)
    policy = RankPolicy(schedule, {0: worker})
    a = Action(0, Op.F, 1)
    policy.enter(a)
    for p, w, before in zip(params, want, live):
        torch.testing.assert_close(p.detach(), w, rtol=0, atol=0)
        assert not torch.equal(w, before)
    policy.exit(a)
    assert all(torch.equal(p.detach(), before) for p, before in zip(params, live))


def test_update_direction_of_adam_is_lr_m_hat_over_sqrt_v_hat() -> None:
    p = torch.nn.Parameter(torch.tensor([1.0]))
    opt = torch.optim.Adam([p], lr=0.1, betas=(0.5, 0.5), eps=0.0)
    p.grad = torch.tensor([2.0])
    opt.step()  # m = 1, v = 2; m_hat = 2, v_hat = 4: direction 0.1 x 2 / 2
    assert update_direction(opt, [p])[0].item() == pytest.approx(0.1)


def test_train_cli_runs_a_stream_with_its_options(tmp_path: Path) -> None:
    """``pipeweave train -s pipemare --warmup-steps 1``: N mini-batch losses = the reference's, weights = simulated."""
    record = tmp_path / "record.json"
    argv = [
        "-s",
        "pipemare",
        "--stages",
        "2",
        "--microbatches",
        "4",
        "--model",
        "mlp",
        "--layers",
        "4",
        "--hidden",
        "8",
        "--batch",
        "8",
        "--steps",
        "4",
        "--warmup-steps",
        "1",
        "--anneal-steps",
        "2",
        "--lr",
        "0.05",
        "--quiet",
    ]
    run = subprocess.run(
        [sys.executable, "-m", "pipeweave.cli", "train", *argv, "--out", str(tmp_path), "--json", str(record)],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(record.read_text())
    schedule = generate("pipemare", num_stages=2, num_microbatches=4, num_steps=4, warmup_steps=1)
    reference = run_stream_reference(
        schedule,
        ModelSpec(kind="mlp", layers=4, hidden=8),
        batch_size=8,
        optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.05),
        options=PolicyOptions(anneal_steps=2),
    )
    assert report["losses"] == pytest.approx(reference.losses, rel=1e-5)
    assert report["weight_bytes"] == report["weight_bytes_simulated"] == reference.weight_bytes
    assert 0.0 <= report["bubble_ratio"] < 1.0 and report["bubble_ratio_stream"] >= 0.0
    bad = subprocess.run(
        [sys.executable, "-m", "pipeweave.cli", "train", "-s", "pipedream", "--warmup-steps", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert bad.returncode == 2 and bad.stderr.strip().endswith(
        "--warmup-steps applies to pipemare, not pipedream; drop it"
    )


def test_pipemare_steps_with_the_rescheduled_lr_after_its_warmup() -> None:
    """D = 3, T = 1: stage 0's gradients lag tau = 2 updates; K = 2. Hand values of alpha / tau^(1 - k/K)."""
    schedule = generate("pipemare", num_stages=3, num_microbatches=1, num_steps=5, warmup_steps=1)
    seen: dict[int, list[float]] = {}

    def factory(params: object) -> torch.optim.Optimizer:
        opt = torch.optim.SGD(params, lr=0.1)  # type: ignore[arg-type]
        log = seen.setdefault(len(seen), [])
        step = opt.step

        def logged(*args: object, **kwargs: object) -> object:
            log.append(opt.param_groups[0]["lr"])
            return step(*args, **kwargs)  # type: ignore[arg-type]

        opt.step = logged  # type: ignore[method-assign]
        return opt

    run_stream_reference(
        schedule,
        ModelSpec(kind="mlp", layers=3, hidden=4),
        batch_size=2,
        optimizer_factory=factory,
        options=PolicyOptions(anneal_steps=2),
    )
    # Update 0 is the synchronous warm-up (lr); then k = 0, 1, 2, 3: 0.1/2, 0.1/sqrt(2), 0.1, 0.1.
    assert seen[0] == pytest.approx([0.1, 0.05, 0.1 / 2**0.5, 0.1, 0.1])
    assert seen[1] == pytest.approx([0.1] * 5) and seen[2] == pytest.approx([0.1] * 5)  # tau <= 1: alpha


@pytest.mark.parametrize("name", [n for n, info in SCHEDULES.items() if not info.synchronous])
def test_every_stage_of_a_stream_makes_stream_updates_updates(name: str) -> None:
    """What a stream's learning-rate schedule counts: stage 0's updates stand for every stage's."""
    schedule = generate(name, num_stages=3, num_microbatches=T, num_steps=stream_steps(name, 6, {}))
    counts = [
        sum(1 for row in schedule.actions for a in row if a.op is Op.U and a.stage == s)
        for s in range(schedule.placement.num_stages)
    ]
    assert counts == [stream_updates(schedule)] * len(counts) and counts[0] > 0
