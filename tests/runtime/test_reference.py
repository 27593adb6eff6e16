"""Exactness: every synchronous schedule, run by the reference executor, equals plain training.

The registry is iterated at collection time, so schedules added later are
covered without touching this file; a configuration a generator rejects
(chimera's odd D, say) is skipped, nothing else is.
"""

from __future__ import annotations

import functools

import pytest
import torch

from pipeweave.data import ByteCorpus, RandomRegression
from pipeweave.errors import StuckError, UserError
from pipeweave.models import ModelSpec
from pipeweave.runtime.plain import TrainResult, run_plain
from pipeweave.runtime.reference import run_reference
from pipeweave.runtime.stage.worker import OptimizerFactory
from pipeweave.runtime.walk import build_workers
from pipeweave.schedule import SCHEDULES, Action, Op, Schedule, ScheduleError, WeightPolicy, generate

MLP = ModelSpec(kind="mlp", layers=6, hidden=8)  # 6 layers: room for D x v = 3 x 2 parts
GPT = ModelSpec(kind="gpt", layers=2, hidden=8, heads=2, seq_len=8)  # 4 layers: D x v up to 4
# Grouped-query (2 query heads per key/value head), rotary, SwiGLU; 6 layers: D x v up to 6.
LLAMA = ModelSpec(kind="llama", layers=4, hidden=32, heads=4, kv_heads=2, seq_len=8, ffn_hidden=48)
TEXT = bytes(range(256)) * 8
STEPS = 2
SYNC = [name for name, info in SCHEDULES.items() if info.synchronous]


pytestmark = pytest.mark.usefixtures("one_thread")


def _schedule(name: str, num_stages: int, num_chunks: int | None) -> Schedule:
    """The schedule at T = 2D (or the first of D, 4D the generator accepts); skip if none is."""
    errors = []
    for t in (2 * num_stages, num_stages, 4 * num_stages):
        try:
            return generate(name, num_stages=num_stages, num_microbatches=t, num_chunks=num_chunks)
        except ScheduleError as exc:
            errors.append(str(exc))
    pytest.skip(f"{name} rejects D={num_stages} v={num_chunks}: {errors[0]}")


def _chunk_options(name: str) -> list[int | None]:
    return [None, 2] if SCHEDULES[name].chunks is None else [None]


def _data(spec: ModelSpec, batch_size: int) -> RandomRegression | ByteCorpus:
    if spec.kind == "mlp":
        return RandomRegression(hidden=spec.hidden, batch_size=batch_size, seed=3)
    return ByteCorpus(TEXT, seq_len=spec.seq_len, batch_size=batch_size, seed=3)


@functools.cache
def _plain(spec: ModelSpec, num_microbatches: int, adam: bool = False) -> TrainResult:
    batch = 2 * num_microbatches + 1  # does not divide: the last microbatches are one sample smaller
    return run_plain(
        spec,
        steps=STEPS,
        batch_size=batch,
        num_microbatches=num_microbatches,
        optimizer_factory=_adam if adam else None,
        data=_data(spec, batch),
    )


def _adam(params: object) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)  # type: ignore[arg-type]


def _assert_equal_training(got: TrainResult, want: TrainResult) -> None:
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(want.losses), rtol=1e-5, atol=0)
    assert got.parameters.keys() == want.parameters.keys()
    for key, value in want.parameters.items():
        torch.testing.assert_close(got.parameters[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert got.losses[-1] < got.losses[0]  # it trained, so the comparison is not of two untouched models


def _assert_replicas_agree(result: TrainResult) -> None:
    for params in result.stage_parameters:
        for key, value in params.items():
            torch.testing.assert_close(value, result.parameters[key], rtol=1e-6, atol=1e-7, msg=key)


def _run(
    schedule: Schedule, spec: ModelSpec, *, recompute: bool, optimizer: OptimizerFactory | None = None
) -> TrainResult:
    batch = 2 * schedule.num_microbatches + 1
    return run_reference(
        schedule,
        spec,
        steps=STEPS,
        batch_size=batch,
        recompute=recompute,
        optimizer_factory=optimizer,
        data=_data(spec, batch),
    )


@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recompute"])
@pytest.mark.parametrize("num_stages", [2, 3])
@pytest.mark.parametrize("name", SYNC)
def test_every_synchronous_schedule_equals_plain_training_mlp(name: str, num_stages: int, recompute: bool) -> None:
    for chunks in _chunk_options(name):
        schedule = _schedule(name, num_stages, chunks)
        result = _run(schedule, MLP, recompute=recompute)
        _assert_equal_training(result, _plain(MLP, schedule.num_microbatches))
        _assert_replicas_agree(result)


@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recompute"])
@pytest.mark.parametrize("name", SYNC)
def test_every_synchronous_schedule_equals_plain_training_gpt(name: str, recompute: bool) -> None:
    schedule = _schedule(name, 2, None)
    result = _run(schedule, GPT, recompute=recompute)
    _assert_equal_training(result, _plain(GPT, schedule.num_microbatches))
    _assert_replicas_agree(result)


@pytest.mark.parametrize("num_stages", [1, 2, 3])
@pytest.mark.parametrize("name", SYNC)
def test_every_synchronous_schedule_equals_plain_training_llama(name: str, num_stages: int) -> None:
    schedule = _schedule(name, num_stages, None)
    result = _run(schedule, LLAMA, recompute=num_stages == 3)  # recomputation replays rotary and GQA exactly
    _assert_equal_training(result, _plain(LLAMA, schedule.num_microbatches))
    _assert_replicas_agree(result)


@pytest.mark.parametrize("name", ["1f1b", "chimera"])
def test_any_optimizer_adam(name: str) -> None:
    if name not in SCHEDULES:
        pytest.skip(f"{name} not registered")
    schedule = _schedule(name, 2, None)
    result = _run(schedule, MLP, recompute=False, optimizer=_adam)
    _assert_equal_training(result, _plain(MLP, schedule.num_microbatches, adam=True))
    _assert_replicas_agree(result)


def test_reference_is_deterministic() -> None:
    schedule = generate("1f1b", num_stages=2, num_microbatches=3)
    a, b = _run(schedule, GPT, recompute=False), _run(schedule, GPT, recompute=False)
    assert a.losses == b.losses
    assert all(torch.equal(a.parameters[k], b.parameters[k]) for k in a.parameters)


def test_a_stuck_schedule_names_the_next_actions() -> None:
    schedule = generate("gpipe", num_stages=2, num_microbatches=2)
    rows = [list(r) for r in schedule.actions]
    rows[1].insert(0, rows[1].pop(2))  # 1B0 before 1F0: can never run
    with pytest.raises(StuckError, match="1B0") as stuck:
        _run(schedule.with_actions(rows), MLP, recompute=False)
    cause, *grid = str(stuck.value).splitlines()
    assert cause.startswith("schedule gpipe is stuck") and len(grid) == 2  # the grid, a row per rank
    assert "[0B0]" in grid[0] and "[1B0]" in grid[1]  # each rank's next action, bracketed


def test_asynchronous_schedule_is_rejected() -> None:
    schedule = generate("1f1b", num_stages=2, num_microbatches=2)
    stream = Schedule("stream", schedule.placement, 2, schedule.actions, policy=WeightPolicy.STASH)
    with pytest.raises(UserError, match="asynchronous"):
        _run(stream, MLP, recompute=False)


def test_fewer_samples_than_microbatches_is_one_line() -> None:
    schedule = generate("1f1b", num_stages=2, num_microbatches=4)
    with pytest.raises(UserError, match="cannot make 4 microbatches"):
        run_reference(schedule, MLP, steps=1, batch_size=3)


def test_split_backward_schedule_runs_i_and_w() -> None:
    """A hand-made split-backward 1F1B (every B as I then W later) equals plain training."""
    base = generate("1f1b", num_stages=2, num_microbatches=3)
    rows = []
    for row in base.actions:
        out: list[Action] = []
        for a in row:
            if a.op is Op.B:
                out.append(Action(a.stage, Op.I, a.microbatch))
            elif a.op is Op.U:
                # Defer every W to the end of the step, the extreme case of zero bubble's order.
                out += [Action(a.stage, Op.W, j) for j in range(3)] + [a]
            else:
                out.append(a)
        rows.append(out)
    result = _run(base.with_actions(rows), MLP, recompute=False)
    _assert_equal_training(result, _plain(MLP, 3))


def test_peak_activations_follow_the_schedule() -> None:
    """Measured peaks are the closed forms: rank r of 1F1B holds min(D-r, T) microbatches, GPipe T."""
    spec, t = ModelSpec(kind="mlp", layers=4, hidden=16), 6
    batch = 2 * t  # equal microbatches, so each holds the same bytes
    data = _data(spec, batch)
    x, y = (m[0] for m in (data.batch(0)[0].tensor_split(t), data.batch(0)[1].tensor_split(t)))
    first, last = build_workers(generate("naive", num_stages=2, num_microbatches=t), spec, batch_size=batch)
    last.forward(0, first.forward(0, x), y)
    one = [first.activation_bytes(), last.activation_bytes()]  # M_a of each stage, measured alone
    expected = {"naive": [1, 1], "1f1b": [2, 1], "gpipe": [t, t]}
    for name, counts in expected.items():
        result = run_reference(
            generate(name, num_stages=2, num_microbatches=t), spec, steps=1, batch_size=batch, data=data
        )
        assert result.peak_activation_bytes == [c * m for c, m in zip(counts, one)], name
