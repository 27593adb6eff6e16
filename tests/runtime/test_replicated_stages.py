"""PipeDream's replicated stages at run time (1F1B-RR, ``schedule.round_robin``): one process per replica.

Parts [2, 1] on 3 gloo processes (and [1, 2, 1] on 4, slow): microbatch m runs
part k on replica m mod r_k, the replicas of a part average their gradients at
every update. Each run must give:

- per-mini-batch losses and every replica's final parameters equal to the
  reference executor's (one process, the same averaging), rtol 1e-5; the
  replicas of a part equal to each other;
- per replica, the staleness measured from the versions its backwards read and
  the updates that applied them, the microbatches it held in flight, and the
  weight bytes it held, equal to the simulator's (``sim.versions``).
"""

from __future__ import annotations

import pytest
import torch
from config_defaults import train_config

from pipeweave.config import TrainConfig
from pipeweave.models import ModelSpec
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.reference import run_reference
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import build_schedule, optimizer_factory, prepare
from pipeweave.runtime.run.record import RunRecord
from pipeweave.schedule.dataflow import consumed_gradients
from pipeweave.schedule.ir import Op, Schedule
from pipeweave.schedule.stream import peak_in_flight
from pipeweave.sim.cost import CostModel
from pipeweave.sim.versions import staleness, weight_copies

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.distributed,
    pytest.mark.timeout(300),
]

CASES = {
    "2,1": (2, 1),
    "2,1+vertical-sync": (2, 1),
    "1,2,1": (1, 2, 1),
}


def _config(case: str) -> TrainConfig:
    replicas = CASES[case]
    return train_config(
        schedule="pipedream",
        stage_replicas=replicas,
        num_microbatches=4,
        model=ModelSpec(kind="mlp", layers=8, hidden=8),
        batch_size=7,
        steps=4,
        lr=0.05,
        momentum=0.9,
        collect_parameters=True,
        options=(("vertical_sync", True),) if "vertical-sync" in case else (),
    )


def _run_all(context: RankContext, configs: list[TrainConfig]) -> list[RunRecord | None]:
    return [run_rank(context, prepare(c)) for c in configs]


@pytest.fixture(scope="module", params=[3, pytest.param(4, marks=pytest.mark.slow)], ids=lambda n: f"{n}processes")
def runs(request: pytest.FixtureRequest) -> dict[str, tuple[TrainConfig, RunRecord]]:
    configs = {case: _config(case) for case, r in CASES.items() if sum(r) == request.param}
    records = launch(_run_all, list(configs.values()), request.param, LaunchOptions(timeout_s=90))
    return {case: (configs[case], record) for case, record in zip(configs, records)}


def _measured_staleness(schedule: Schedule, record: RunRecord) -> list[int]:
    """Per stage, the most updates between the version a backward read and the update applying its gradient."""
    read = {a: v[0] for r in record.ranks for a, v in r.versions.items()}
    worst = [0] * schedule.num_stages
    for update, grads in consumed_gradients(schedule).items():
        for g in grads:
            worst[g.stage] = max(worst[g.stage], update.microbatch - read[g])
    return worst


def test_replicated_stages_equal_the_reference_and_the_simulator(
    runs: dict[str, tuple[TrainConfig, RunRecord]],
) -> None:
    for case, (config, record) in runs.items():
        schedule = build_schedule(config)
        assert schedule.num_ranks == sum(CASES[case]) and schedule.placement.shared
        reference = run_reference(
            schedule,
            config.model,
            steps=config.steps,
            batch_size=config.batch_size,
            optimizer_factory=optimizer_factory(config),
        )
        torch.testing.assert_close(record.losses, reference.losses, rtol=1e-5, atol=1e-6)
        params = {s: p for r in record.ranks for s, p in r.parameters.items()}
        for stage, named in params.items():
            for name, value in named.items():
                torch.testing.assert_close(value, reference.stage_parameters[stage][name], rtol=1e-5, atol=1e-6)
                first = schedule.placement.replicas(stage)[0]  # replicas stay identical: averaged gradients
                torch.testing.assert_close(value, params[first][name], rtol=0, atol=0)
        assert _measured_staleness(schedule, record) == list(staleness(schedule)), case
        ranks = sorted(record.ranks, key=lambda r: r.rank)
        ran = [sorted((rec for step in r.records for rec in step), key=lambda rec: rec[3]) for r in ranks]
        assert [peak_in_flight(rows, r) for r, rows in enumerate(ran)] == [
            peak_in_flight(row, r) for r, row in enumerate(schedule.actions)
        ]
        part_bytes = [0.0] * schedule.num_parts
        for s, named in enumerate(reference.stage_parameters):
            part_bytes[schedule.placement.stage_part[s]] = sum(p.numel() * p.element_size() for p in named.values())
        costs = CostModel(weight=part_bytes).for_parts(num_parts=schedule.num_parts, num_ranks=schedule.num_ranks)
        assert [r.weight_bytes for r in ranks] == [int(c) for c in weight_copies(schedule, costs)], case


def test_the_replicas_take_alternate_microbatches(runs: dict[str, tuple[TrainConfig, RunRecord]]) -> None:
    """1F1B-RR as run: replica i of a part of r ran the F and B of exactly the microbatches m = i mod r."""
    for case, (_, record) in runs.items():
        first = [sum(CASES[case][:k]) for k in range(len(CASES[case]))]
        for r in record.ranks:
            ran = {(op, j) for step in r.records for _, op, j, *_ in step if op in (Op.F.value, Op.B.value)}
            part = next(k for k in reversed(range(len(first))) if first[k] <= r.rank)
            i, count = r.rank - first[part], CASES[case][part]
            assert ran and {j % count for _, j in ran} == {i}, case
