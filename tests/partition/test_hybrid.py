"""Hybrid data x pipeline parallelism: P replicas of a pipeline equal plain training on the global batch."""

from __future__ import annotations

import pytest
import torch

from pipeweave.data import ByteCorpus
from pipeweave.errors import UserError
from pipeweave.models import ModelSpec
from pipeweave.runtime.plain import run_plain
from pipeweave.runtime.reference import run_reference
from pipeweave.schedule import generate, validate
from pipeweave.schedule.data_parallel import data_parallel
from pipeweave.sim import CostModel, compute_metrics, simulate

TEXT = b"the quick brown fox jumps over the lazy dog. " * 40


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "microbatches", "replicas"), [(2, 3, 2), (3, 4, 3), (4, 2, 2), (1, 2, 4)])
def test_replicas_validate_and_keep_the_bubble(name: str, stages: int, microbatches: int, replicas: int) -> None:
    base = generate(name, num_stages=stages, num_microbatches=microbatches)
    grid = data_parallel(base, replicas)
    validate(grid)
    assert grid.num_ranks == replicas * stages and grid.num_microbatches == replicas * microbatches
    # rank p*D + r plays rank r of replica p: its part, and microbatches p*T .. p*T + T-1
    for rank in range(grid.num_ranks):
        p, r = divmod(rank, stages)
        parts = {grid.placement.stage_part[a.stage] for a in grid.actions[rank]}
        mbs = {a.microbatch for a in grid.actions[rank] if a.op.value != "U"}
        assert parts == {r} and mbs == set(range(p * microbatches, (p + 1) * microbatches))
    # per-part costs: a scalar cost is scaled by ranks / parts, which counts the replicas' ranks too
    cost = CostModel(f=[1.0] * stages, b=[1.0] * stages, w=[1.0] * stages, activation=[1.0] * stages)
    one, many = compute_metrics(simulate(base, cost)), compute_metrics(simulate(grid, cost))
    assert many.bubble_ratio == pytest.approx(one.bubble_ratio)
    assert many.makespan == pytest.approx(one.makespan)
    assert many.peak_activations == one.peak_activations * replicas


@pytest.mark.parametrize(
    ("kind", "stages", "replicas", "microbatches"), [("mlp", 2, 2, 2), ("mlp", 3, 2, 3), ("gpt", 2, 2, 2)]
)
def test_losses_and_weights_equal_plain_training(kind: str, stages: int, replicas: int, microbatches: int) -> None:
    spec = ModelSpec(kind=kind, layers=4 if kind == "mlp" else 2, hidden=16, heads=2, seq_len=8)
    batch = 2 * replicas * microbatches + 1  # odd: the microbatches are not all equal
    grid = data_parallel(generate("1f1b", num_stages=stages, num_microbatches=microbatches), replicas)
    data = ByteCorpus(TEXT, seq_len=8, batch_size=batch) if kind == "gpt" else None  # small: fast
    pipelined = run_reference(grid, spec, steps=3, batch_size=batch, data=data)
    plain = run_plain(spec, steps=3, batch_size=batch, num_microbatches=replicas * microbatches, data=data)
    assert pipelined.losses == pytest.approx(plain.losses, rel=1e-5)
    assert plain.losses[-1] < plain.losses[0]
    for name, value in plain.parameters.items():
        torch.testing.assert_close(pipelined.parameters[name], value, rtol=1e-5, atol=1e-6)
    # every replica of a part holds bitwise the same weights
    for s, params in enumerate(pipelined.stage_parameters):
        twin = pipelined.stage_parameters[s % stages]
        assert all(torch.equal(params[k], twin[k]) for k in params)


def test_asynchronous_schedules_and_bad_degrees_are_refused() -> None:
    with pytest.raises(UserError, match="num_replicas=0 is invalid; give --data-parallel >= 1"):
        data_parallel(generate("1f1b", num_stages=2, num_microbatches=2), 0)
