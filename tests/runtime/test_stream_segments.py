"""Asynchronous runs in segments: drained where they evaluate or save, resumed exactly from a checkpoint.

``--save-every K`` / ``--eval-every K`` make an asynchronous run one stream
per K mini-batches (``TrainConfig.segments``), the policy state carried from
one to the next (``runtime.stage.policy.StreamCarry``). On 2 gloo ranks, every
asynchronous schedule of the registry (read at test time) and a few variants
must give:

- losses and final parameters equal to the reference executor running the
  same streams one after the other, and to one policy running the run's
  schedule as a single stream whose drains are flushes (no carry at all);
- the versions every F/B/I/W read equal to ``sim.versions.read_versions`` of
  the run's schedule (``schedule.stream.concatenate``: an independent
  derivation from the order alone), and the weight bytes its copies;
- training N steps with a drain after k equal to training k steps, saving,
  and resuming for N - k (PipeMare's velocity, annealing and remaining
  warm-up, AvgPipe's replicas, Adam's moments, the learning-rate schedule);
- held-out losses after each segment, the last one the final weights' loss.

Independent of the policies: on one stage, a segmented stream with one
update per mini-batch is plain training with the same learning rates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from config_defaults import train_config
from torch import nn

from pipeweave.config import TrainConfig
from pipeweave.data import ByteCorpus, stdlib_sources
from pipeweave.models import ModelSpec
from pipeweave.models.build import build_layers
from pipeweave.models.spec import loss_fn
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.plain import run_plain
from pipeweave.runtime.reference import run_stream_reference
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import build_schedule, optimizer_factory, prepare, stream_rates
from pipeweave.runtime.run.record import RunRecord
from pipeweave.runtime.run.streams import stream_schedules
from pipeweave.runtime.stage.policy import PolicyOptions
from pipeweave.schedule import SCHEDULES, Schedule
from pipeweave.schedule.ir import Op
from pipeweave.sim.cost import CostModel
from pipeweave.sim.versions import read_versions, staleness, weight_copies

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.distributed, pytest.mark.timeout(240)]

# a gpt: its batches differ per step (the mlp's do not), so every stream must take up the data where the last
# stopped, and AvgPipe's replicas, fed different mini-batches, differ
MODEL = ModelSpec(kind="gpt", layers=4, hidden=8, heads=2, seq_len=8)
T = 2
AVG = {"avgpipe"}  # P = 2 pipelines: segments of whole rounds
CASES: dict[str, tuple[str, dict[str, object], dict[str, object]]] = {
    # case -> (schedule, generator options, TrainConfig overrides)
    **{name: (name, {}, {}) for name, info in SCHEDULES.items() if not info.synchronous},
    "pipemare+warmup+cosine": (
        "pipemare",
        {"warmup_steps": 3},
        {"lr_schedule": "cosine", "lr_warmup": 1, "momentum": 0.9, "policy": PolicyOptions(anneal_steps=4)},
    ),
    "avgpipe+period3": ("avgpipe", {}, {"policy": PolicyOptions(averaging_period=3)}),
    "spectrain+adamw": ("spectrain", {}, {"optimizer": "adamw", "lr": 1e-2}),
    "xpipe+adamw": ("xpipe", {}, {"optimizer": "adamw", "lr": 1e-2}),
    # the state a prediction reads goes on too: RMSprop's last gradient and square average, AdaBelief's belief
    "xpipe+rmsprop": ("xpipe", {}, {"optimizer": "rmsprop", "lr": 1e-3, "momentum": 0.0}),
    "spectrain+adabelief": ("spectrain", {}, {"optimizer": "adabelief", "lr": 1e-2}),
}


def _text(folder: Path) -> str:
    path = folder / "text.txt"
    if not path.exists():
        path.write_bytes(stdlib_sources(max_bytes=50_000))
    return str(path)


def _config(case: str, folder: Path, steps: int, every: int) -> TrainConfig:
    name, options, overrides = CASES[case]
    fields: dict[str, object] = dict(
        schedule=name,
        num_stages=2,
        num_microbatches=T,
        model=MODEL,
        data=_text(folder),
        batch_size=2 * T + 1,
        steps=steps,
        lr=0.05,
        momentum=0.5,
        collect_parameters=True,
        options=tuple(options.items()),
        save=str(folder / case.replace("+", "-")),
        save_every=every,
    )
    fields.update(overrides)
    return train_config(**fields)  # type: ignore[arg-type]


def _steps(case: str) -> tuple[int, int]:
    """(steps, drain after): whole AvgPipe rounds; the others stop mid-way through their warm-up and steady state."""
    return (10, 4) if CASES[case][0] in AVG else (6, 2)


def _run_all(context: RankContext, configs: list[TrainConfig]) -> list[RunRecord | None]:
    return [run_rank(context, prepare(c)) for c in configs]


def _launch(configs: list[TrainConfig]) -> list[RunRecord]:
    for c in configs:
        prepare(c)
    records = launch(_run_all, configs, 2, LaunchOptions(timeout_s=90))
    assert all(r is not None for r in records)
    return records


@pytest.fixture(scope="module")
def segmented(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[TrainConfig, RunRecord]]:
    folder = tmp_path_factory.mktemp("segmented")
    configs = {case: _config(case, folder, *_steps(case)) for case in CASES}
    return dict(zip(configs, zip(configs.values(), _launch(list(configs.values())))))


def _corpus(config: TrainConfig) -> ByteCorpus:
    assert config.data is not None
    return ByteCorpus(Path(config.data.path).read_bytes(), seq_len=config.model.seq_len, batch_size=config.batch_size)


def _stage_parameters(record: RunRecord) -> dict[tuple[int, str], torch.Tensor]:
    return {(s, name): v for r in record.ranks for s, params in r.parameters.items() for name, v in params.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_segmented_run_equals_its_reference_and_reads_the_concatenated_versions(
    segmented: dict[str, tuple[TrainConfig, RunRecord]], case: str
) -> None:
    config, record = segmented[case]
    segments = stream_schedules(config)
    assert len(segments) == 3  # two drains
    run = build_schedule(config)
    rates = stream_rates(config, run).at if config.lr_scheduled else None
    reference = run_stream_reference(
        segments,
        config.model,
        batch_size=config.batch_size,
        optimizer_factory=optimizer_factory(config),
        options=config.policy,
        lr_at=rates,
        data=_corpus(config),
    )
    # The oracle without StreamCarry: one policy over the run's schedule, its drains mere flushes in one stream.
    one = run_stream_reference(
        run,
        config.model,
        batch_size=config.batch_size,
        optimizer_factory=optimizer_factory(config),
        options=config.policy,
        lr_at=rates,
        data=_corpus(config),
    )
    assert len(record.losses) == config.steps
    for oracle in (reference, one):
        torch.testing.assert_close(record.losses, oracle.losses, rtol=1e-5, atol=1e-6)
        for (stage, name), value in _stage_parameters(record).items():
            torch.testing.assert_close(value, oracle.stage_parameters[stage][name], rtol=1e-5, atol=1e-6)
    expected = {a: (v.version, v.target) for a, v in read_versions(run).items()}
    assert {a: v for r in record.ranks for a, v in r.versions.items()} == expected
    assert reference.versions == expected and one.versions == expected
    part_bytes = [0.0] * run.num_parts
    for s, params in enumerate(reference.stage_parameters):
        part_bytes[run.placement.stage_part[s]] = float(sum(p.numel() * p.element_size() for p in params.values()))
    costs = CostModel(weight=part_bytes).for_parts(num_parts=run.num_parts, num_ranks=run.num_ranks)
    assert [r.weight_bytes for r in record.ranks] == [int(c) for c in weight_copies(run, costs)]


def test_a_drain_changes_the_stream(segmented: dict[str, tuple[TrainConfig, RunRecord]]) -> None:
    """The segments are streams of their own: one unbroken stream of the same steps trains otherwise."""
    config, record = segmented["pipedream"]
    whole = run_stream_reference(
        build_schedule(dataclasses.replace(config, save=None, save_every=None)),
        config.model,
        batch_size=config.batch_size,
        optimizer_factory=optimizer_factory(config),
        data=_corpus(config),
    )
    assert record.losses[:2] == pytest.approx(whole.losses[:2], rel=1e-5)  # the same first stream
    assert record.losses[2:] != pytest.approx(whole.losses[2:], rel=1e-5)


@pytest.mark.parametrize("name", ["pipedream-2bw", "pipemare", "avgpipe"])
def test_one_stage_segmented_stream_is_plain_training_with_its_rates(name: str) -> None:
    """D = 1: no delay, so drains change nothing; the gpt's batches differ per step, so each stream's data must
    go on where the last one stopped, and each update take its step's rate."""
    spec = ModelSpec(kind="gpt", layers=2, hidden=8, heads=2, seq_len=8)
    options = (("num_pipelines", 1),) if name in AVG else ()
    config = train_config(
        schedule=name,
        num_stages=1,
        num_microbatches=3,
        model=spec,
        batch_size=7,
        steps=5,
        lr=0.05,
        momentum=0.9,
        lr_schedule="cosine",
        lr_warmup=1,
        save="unused",
        save_every=2,
        options=options,
    )
    rates = stream_rates(config, build_schedule(config))
    got = run_stream_reference(
        stream_schedules(config), spec, batch_size=7, optimizer_factory=optimizer_factory(config), lr_at=rates.at
    )
    plain = run_plain(
        spec, steps=5, batch_size=7, num_microbatches=3, optimizer_factory=optimizer_factory(config), lr_at=rates.at
    )
    torch.testing.assert_close(got.losses, plain.losses, rtol=1e-5, atol=1e-6)
    for name_, value in plain.parameters.items():
        torch.testing.assert_close(got.parameters[name_], value, rtol=1e-5, atol=1e-6)


# ---- checkpoints --------------------------------------------------------------------------
RESUMED = [
    "pipemare+warmup+cosine",
    "avgpipe+period3",
    "spectrain+adamw",
    "xpipe+adamw",
    "xpipe+rmsprop",
    "spectrain+adabelief",
    "pipedream-2bw",
    "pipedream",
    "wpipe",
]


@pytest.fixture(scope="module")
def resumed(
    tmp_path_factory: pytest.TempPathFactory, segmented: dict[str, tuple[TrainConfig, RunRecord]]
) -> dict[str, RunRecord]:
    folder = tmp_path_factory.mktemp("first")
    firsts = [
        dataclasses.replace(_config(case, folder, _steps(case)[1], _steps(case)[1]), save_every=None)
        for case in RESUMED
    ]
    _launch(firsts)
    seconds = []
    for case, first in zip(RESUMED, firsts):
        steps, k = _steps(case)  # the rest drains where the straight run did (--save-every k)
        seconds.append(
            dataclasses.replace(first, steps=steps - k, save=f"{first.save}-2", save_every=k, resume=first.save)
        )
    return dict(zip(RESUMED, _launch(seconds)))


@pytest.mark.parametrize("case", RESUMED)
def test_resumed_stream_equals_the_run_drained_at_the_checkpoint(
    segmented: dict[str, tuple[TrainConfig, RunRecord]], resumed: dict[str, RunRecord], case: str
) -> None:
    config, straight = segmented[case]
    k = _steps(case)[1]
    got = resumed[case]
    assert got.first_step == k
    torch.testing.assert_close(got.losses, straight.losses[k:], rtol=1e-5, atol=1e-6)
    want = _stage_parameters(straight)
    have = _stage_parameters(got)
    assert set(have) == set(want)
    for key, value in want.items():
        torch.testing.assert_close(have[key], value, rtol=1e-5, atol=1e-6)


def test_checkpoint_of_a_stream_holds_its_policy_state(
    tmp_path: Path, checkpoint_tensors: Callable[[Path], dict[str, torch.Tensor]]
) -> None:
    config = dataclasses.replace(_config("pipemare+warmup+cosine", tmp_path, 3, 3), save_every=None)
    _launch([config])
    import json

    assert config.save is not None
    meta = json.loads((Path(config.save) / "step-000003" / "manifest.json").read_text())
    assert meta["steps"] == 3 and meta["updates"] == 3 and meta["annealed"] == 0  # all three were warm-up
    state = checkpoint_tensors(Path(config.save) / "step-000003")
    velocity, parameters = _under(state, "velocity/"), _under(state, "parameters/")
    assert set(velocity) == set(parameters) and not _under(state, "replicas/")
    assert any(bool(v.abs().sum() > 0) for v in velocity.values())
    avg = dataclasses.replace(_config("avgpipe", tmp_path, 4, 4), save_every=None)
    _launch([avg])
    assert avg.save is not None
    state = checkpoint_tensors(Path(avg.save) / "step-000004")
    parameters, other = _under(state, "parameters/"), _under(state, "replicas/1/parameters/")
    assert set(other) == set(parameters) and not _under(state, "replicas/2/") and not _under(state, "velocity/")
    assert any(not torch.equal(other[n], v) for n, v in parameters.items())  # the replicas differ


def _under(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {key.removeprefix(prefix): value for key, value in state.items() if key.startswith(prefix)}


# ---- evaluation ------------------------------------------------------------------------------
GPT = ModelSpec(kind="gpt", layers=2, hidden=16, heads=2, seq_len=8)


@pytest.mark.parametrize("name", ["pipedream", "avgpipe"])
def test_evaluation_between_streams_is_the_weights_held_out_loss(tmp_path: Path, name: str) -> None:
    text = tmp_path / "text.txt"
    text.write_bytes(stdlib_sources(max_bytes=100_000))
    config = train_config(
        schedule=name,
        num_stages=2,
        num_microbatches=2,
        model=GPT,
        batch_size=4,
        steps=4,
        data=str(text),
        eval_every=2,
        eval_batches=2,
        collect_parameters=True,
        lr=0.05,
    )
    (record,) = _launch([config])
    assert [at for at, _ in record.eval_losses] == [2, 4]
    reference = run_stream_reference(
        stream_schedules(config),
        GPT,
        batch_size=4,
        optimizer_factory=optimizer_factory(config),
        data=ByteCorpus(text.read_bytes(), seq_len=GPT.seq_len, batch_size=4),
    )
    torch.testing.assert_close(record.losses, reference.losses, rtol=1e-5, atol=1e-6)
    corpus = ByteCorpus(text.read_bytes(), seq_len=GPT.seq_len, batch_size=4)
    first_replica = {
        n: v
        for r in record.ranks
        for s, params in r.parameters.items()
        if s == min(build_schedule(config).placement.replicas(s))
        for n, v in params.items()
    }
    model = nn.ModuleDict({str(i): layer for i, layer in enumerate(build_layers(GPT, range(GPT.num_layers)))})
    model.load_state_dict(first_replica)
    with torch.no_grad():
        held_out = []
        for k in range(2):
            x, y = corpus.eval_batch(k)
            for layer in model.values():
                x = layer(x)
            held_out.append(float(loss_fn(GPT)(x, y)))
    assert record.eval_losses[-1][1] == pytest.approx(sum(held_out) / 2, rel=1e-5)
    assert record.eval_losses[0][1] != record.eval_losses[1][1]


# ---- PipeMare on three stages: its rescheduling depends on the updates made (the delay of stage 0 is 2) ----------
def test_pipemare_warmup_annealing_and_velocity_cross_drains_and_checkpoints(tmp_path: Path) -> None:
    """Warm-up over the first 3 mini-batches, drains every 3, checkpoints after 2, 3 and 6 (T = 1).

    The straight run must equal one policy over its schedule (the annealing count and velocity carried across
    the drains); resuming after 3 and after 6 must go on annealing from the checkpoint's count with its velocity;
    a run resumed after 2 keeps the one warm-up mini-batch left.
    """
    base = train_config(
        schedule="pipemare",
        num_stages=3,
        num_microbatches=1,
        model=MODEL,
        data=_text(tmp_path),
        batch_size=3,
        lr=0.05,
        momentum=0.9,
        options=(("warmup_steps", 3),),
        policy=PolicyOptions(anneal_steps=4),
        collect_parameters=True,
    )
    straight = dataclasses.replace(base, steps=9, save=str(tmp_path / "straight"), save_every=3)
    firsts = [dataclasses.replace(base, steps=k, save=str(tmp_path / f"after{k}")) for k in (2, 3, 6)]
    firsts[2] = dataclasses.replace(firsts[2], save_every=3)
    for c in (straight, *firsts):
        prepare(c)
    records = launch(_run_all, [straight, *firsts], 3, LaunchOptions(timeout_s=90))
    record = records[0]
    assert record is not None
    run = build_schedule(straight)
    assert _flushed(run) == [True] * 3 + [False, False, True] * 2  # the warm-up, the drains
    assert staleness(run)[0] == 2  # stage 0's delay: the rescheduling depends on the updates counted
    one = run_stream_reference(
        run,
        MODEL,
        batch_size=3,
        optimizer_factory=optimizer_factory(straight),
        options=straight.policy,
        data=_corpus(straight),
    )
    torch.testing.assert_close(record.losses, one.losses, rtol=1e-5, atol=1e-6)
    for (stage, name), value in _stage_parameters(record).items():
        torch.testing.assert_close(value, one.stage_parameters[stage][name], rtol=1e-5, atol=1e-6)
    after2 = dataclasses.replace(base, steps=4, resume=firsts[0].save)
    assert _flushed(prepare(after2).schedule) == [True, False, False, True]  # the warm-up left after 2
    resumed = [
        dataclasses.replace(base, steps=9 - k, save=str(tmp_path / f"r{k}"), save_every=3, resume=first.save)
        for k, first in zip((3, 6), firsts[1:])
    ]
    for c in resumed:
        prepare(c)
    again = launch(_run_all, resumed, 3, LaunchOptions(timeout_s=90))
    for got, k in zip(again, (3, 6)):
        assert got is not None and got.first_step == k
        torch.testing.assert_close(got.losses, record.losses[k:], rtol=1e-5, atol=1e-6)
        want, have = _stage_parameters(record), _stage_parameters(got)
        for key, value in want.items():
            torch.testing.assert_close(have[key], value, rtol=1e-5, atol=1e-6)


def _flushed(schedule: Schedule) -> list[bool]:
    """Per mini-batch (T = 1), whether stage 0 updates with it before any later mini-batch's forward."""
    row = schedule.actions[0]
    updates = [i for i, a in enumerate(row) if a.stage == 0 and a.op is Op.U]
    return [not any(a.stage == 0 and a.op is Op.F and a.microbatch > m for a in row[:u]) for m, u in enumerate(updates)]
