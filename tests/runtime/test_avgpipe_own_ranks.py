"""AvgPipe as published: P pipelines on P x D processes, averaged by an all-reduce, equal to the reference.

P = 2 pipelines of D = 2 stages on 4 processes (gloo), the gpt on a corpus so that the two pipelines'
mini-batches differ and the averaging moves the replicas. The distributed run and the one-process
reference (``runtime.stage.averaging.LocalExchange``) give the same losses and the same weights of every
replica; each rank holds one replica (M_theta), the machine P of each part.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from config_defaults import train_config

from pipeweave.config import TrainConfig
from pipeweave.config.policy import PolicyOptions
from pipeweave.data.corpus import ByteCorpus, stdlib_sources
from pipeweave.models import ModelSpec
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.reference import run_stream_reference
from pipeweave.runtime.report.trace import chrome_trace
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import build_schedule, optimizer_factory, prepare
from pipeweave.runtime.run.record import RunRecord
from pipeweave.sim.cost import CostModel
from pipeweave.sim.versions import read_versions, weight_copies

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.distributed, pytest.mark.timeout(240)]

MODEL = ModelSpec(kind="gpt", layers=4, hidden=8, heads=2, seq_len=8)
CASES = {"every round": 1, "every second round": 2}


def _config(folder: Path, every: int) -> TrainConfig:
    text = folder / "text.txt"
    if not text.exists():
        text.write_bytes(stdlib_sources(max_bytes=50_000))
    return train_config(
        schedule="avgpipe",
        num_stages=2,
        num_microbatches=2,
        model=MODEL,
        data=str(text),
        batch_size=5,
        steps=8,
        lr=0.05,
        momentum=0.5,
        collect_parameters=True,
        options=(("own_ranks", True),),
        policy=PolicyOptions(averaging_period=every),
    )


def _run_all(context: RankContext, configs: list[TrainConfig]) -> list[RunRecord | None]:
    return [run_rank(context, prepare(c)) for c in configs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[TrainConfig, RunRecord]]:
    folder = tmp_path_factory.mktemp("avgpipe")
    configs = {case: _config(folder, every) for case, every in CASES.items()}
    for c in configs.values():
        assert prepare(c).schedule.num_ranks == 4
    records = launch(_run_all, list(configs.values()), 4, LaunchOptions(timeout_s=120))
    return {case: (configs[case], record) for case, record in zip(configs, records)}


@pytest.mark.parametrize("case", list(CASES))
def test_pipelines_on_their_own_ranks_equal_the_reference(
    runs: dict[str, tuple[TrainConfig, RunRecord]], case: str
) -> None:
    config, record = runs[case]
    schedule = build_schedule(config)
    corpus = ByteCorpus(Path(str(config.data.path)).read_bytes(), seq_len=MODEL.seq_len, batch_size=config.batch_size)
    reference = run_stream_reference(
        schedule,
        config.model,
        batch_size=config.batch_size,
        optimizer_factory=optimizer_factory(config),
        options=config.policy,
        data=corpus,
    )
    torch.testing.assert_close(record.losses, reference.losses, rtol=1e-5, atol=1e-6)
    for rank_record in record.ranks:
        assert len(rank_record.parameters) == 1  # one replica of one part per process
        for stage, params in rank_record.parameters.items():
            for name, value in params.items():
                torch.testing.assert_close(value, reference.stage_parameters[stage][name], rtol=1e-5, atol=1e-6)
    expected = {a: (v.version, v.target) for a, v in read_versions(schedule).items()}
    assert {a: v for r in record.ranks for a, v in r.versions.items()} == expected
    part_bytes = [0.0] * schedule.num_parts
    for s, params in enumerate(reference.stage_parameters):
        part_bytes[schedule.placement.stage_part[s]] = float(sum(p.numel() * p.element_size() for p in params.values()))
    costs = CostModel(weight=part_bytes).for_parts(num_parts=schedule.num_parts, num_ranks=schedule.num_ranks)
    one_replica = [int(c) for c in weight_copies(schedule, costs)]
    assert [r.weight_bytes for r in record.ranks] == one_replica == [int(part_bytes[i]) for i in (0, 1, 0, 1)]


def test_the_averaging_moves_the_replicas(runs: dict[str, tuple[TrainConfig, RunRecord]]) -> None:
    """Without averaging the two pipelines' replicas drift apart more than with it."""
    config, record = runs["every round"]
    schedule = build_schedule(config)
    corpus = ByteCorpus(Path(str(config.data.path)).read_bytes(), seq_len=MODEL.seq_len, batch_size=config.batch_size)

    def spread(result_parameters: list[dict[str, torch.Tensor]]) -> float:
        return sum(float((result_parameters[0][n] - result_parameters[2][n]).abs().sum()) for n in result_parameters[0])

    apart = run_stream_reference(
        schedule,
        config.model,
        batch_size=config.batch_size,
        optimizer_factory=optimizer_factory(config),
        options=PolicyOptions(averaging_rate=0.0),
        data=corpus,
    )
    measured = {s: p for r in record.ranks for s, p in r.parameters.items()}
    assert spread([measured[s] for s in range(4)]) < 0.5 * spread(apart.stage_parameters)


@pytest.mark.parametrize(("case", "rounds"), [("every round", [1, 2, 3, 4]), ("every second round", [2, 4])])
def test_each_averaging_is_in_the_record_and_the_trace(
    runs: dict[str, tuple[TrainConfig, RunRecord]], case: str, rounds: list[int]
) -> None:
    """8 mini-batches, P = 2: 4 update rounds per replica; an all-reduce every --avg-every of them, per rank."""
    config, record = runs[case]
    for rank_record in record.ranks:
        assert [n for _, n, _, _ in rank_record.averaging] == rounds
        assert all(t1 >= t0 for _, _, t0, t1 in rank_record.averaging)
    trace = chrome_trace(build_schedule(config), record)
    names = sorted(e["name"] for e in trace["traceEvents"] if "AVG" in e.get("name", ""))
    assert names == sorted(f"{s}AVG{n}" for s in range(4) for n in rounds)


@pytest.mark.slow
def test_a_resumed_run_continues_each_pipelines_replica_exactly(tmp_path: Path) -> None:
    """Each pipeline's replica is saved under its own keys (``replicas/<i>/``): 4 steps, saved, then 4 resumed,
    train as 8 steps drained at 4 (a drain applies the averaging in flight, as a save does)."""
    import dataclasses

    base = _config(tmp_path, 1)
    full = dataclasses.replace(base, save=str(tmp_path / "full"), save_every=4)
    first = dataclasses.replace(base, steps=4, save=str(tmp_path / "first"))
    for c in (full, first):
        prepare(c)
    whole, _ = launch(_run_all, [full, first], 4, LaunchOptions(timeout_s=120))
    resumed = dataclasses.replace(base, steps=4, resume=str(tmp_path / "first"))
    prepare(resumed)
    (rest,) = launch(_run_all, [resumed], 4, LaunchOptions(timeout_s=120))
    assert rest.losses == whole.losses[4:]
    ends = {s: p for r in rest.ranks for s, p in r.parameters.items()}
    for r in whole.ranks:
        for s, params in r.parameters.items():
            for name, value in params.items():
                torch.testing.assert_close(ends[s][name], value, rtol=0, atol=0)
