"""Weight-policy math against hand-computed values, and the policies the runtime runs driven by real schedules.

Every test exercises what the executors run: the ``weights/`` functions and
classes ``runtime.stage.policy`` calls, or ``RankPolicy`` itself on one rank of a
tiny schedule (``drive``), with the optimizer step replaced by a known change.
"""

from __future__ import annotations

import doctest
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from pipeweave.models import ModelSpec
from pipeweave.runtime.stage.policy import PolicyOptions, RankPolicy
from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.schedule import Action, Op, generate
from pipeweave.schedule.dataflow import consumed_gradients
from pipeweave.schedule.ir import Schedule
from pipeweave.sim.versions import read_versions, stage_weights
from pipeweave.weights.avgpipe import default_alpha, elastic_average
from pipeweave.weights.double_buffer import DoubleBuffer
from pipeweave.weights.pipemare import DiscrepancyCorrection, rescheduled_lr
from pipeweave.weights.prediction import predict_weights
from pipeweave.weights.wpipe import weights_for_part

Step = Callable[[int, StageWorker], None]  # (stage, its worker): the optimizer step of a U, or its stand-in


@pytest.mark.parametrize("name", ["stash", "double_buffer", "pipemare", "prediction", "xpipe", "wpipe", "avgpipe"])
def test_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(f"pipeweave.weights.{name}"))
    assert result.failed == 0 and result.attempted > 0


def _count_versions(stage: int, worker: StageWorker) -> None:
    for p in worker.module.parameters():
        p += 1.0  # every weight's value is the version number


@dataclass
class Run:
    """One rank's list run through ``RankPolicy`` (``drive``)."""

    policy: RankPolicy
    workers: dict[int, StageWorker]
    read: dict[Action, float] = field(default_factory=dict)  # F/B/I/W: the stage's first weight while it ran
    storage: dict[Action, int] = field(default_factory=dict)  # F/B/I/W: where the weights it ran with live
    held: dict[Action, int] = field(default_factory=dict)  # F/B/I/W: weight bytes the rank held while it ran
    live: dict[Action, dict[int, float]] = field(default_factory=dict)  # after each action: every stage's weight


def drive(
    schedule: Schedule,
    rank: int,
    step: Step = _count_versions,
    options: PolicyOptions | None = None,
    optimizer: type[torch.optim.Optimizer] = torch.optim.SGD,
) -> Run:
    """Run one rank's list through ``RankPolicy``: one one-layer part per stage, every weight 0 at first.

    ``step(stage, worker)`` makes each ``U``'s update (under ``torch.no_grad``).
    """
    spec = ModelSpec(kind="mlp", layers=schedule.num_parts, hidden=1)
    part = schedule.placement.stage_part
    workers = {
        s: StageWorker(
            spec, range(part[s], part[s] + 1), batch_size=1, optimizer_factory=lambda ps: optimizer(ps, lr=0.1)
        )
        for s in schedule.placement.stages_on(rank)
    }
    params = {s: list(w.module.parameters()) for s, w in workers.items()}
    with torch.no_grad():
        for ps in params.values():
            for p in ps:
                p.zero_()
    run = Run(RankPolicy(schedule, workers, options), workers)
    swapped_in = []  # kept alive, so that equal storages are the same tensor
    for a in schedule.actions[rank]:
        run.policy.enter(a)
        first = params[a.stage][0]
        if a.op is Op.U:
            with torch.no_grad():
                step(a.stage, run.workers[a.stage])
        else:
            run.read[a] = first.flatten()[0].item()
            run.storage[a] = first.data_ptr()
            run.held[a] = run.policy.held_bytes()
            swapped_in.append(first.data)
        run.policy.exit(a)
        run.live[a] = {s: ps[0].flatten()[0].item() for s, ps in params.items()}
    return run


def test_pipemare_rescheduled_lr() -> None:
    # alpha / tau ** (1 - k/K): tau = 8, K = 3: 0.8/8, 0.8/4, 0.8/2, 0.8, then 0.8.
    assert [rescheduled_lr(0.8, 8, k, 3) for k in range(5)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 0.8])
    assert rescheduled_lr(0.8, 0, 0, 3) == rescheduled_lr(0.8, 1, 0, 3) == 0.8  # no delay, no change


def test_pipemare_discrepancy_correction() -> None:
    p = [torch.tensor([1.0, 0.0])]
    dc = DiscrepancyCorrection(p, decay=0.5)
    for step in ([2.0, -1.0], [4.0, 1.0]):
        dc.before_update()
        p[0] += torch.tensor(step)
        dc.after_update()
    # delta1 = 0.5 * 0 + 0.5 * (2, -1) = (1, -0.5); delta2 = 0.5 * delta1 + 0.5 * (4, 1) = (2.5, 0.25)
    assert dc.velocity[0].tolist() == [2.5, 0.25]
    # w = (7, 0); two versions back: w - 2 delta = (2, -0.5), in place, and back again
    live = p[0]
    dc.extrapolate(2)
    assert p[0].tolist() == [2.0, -0.5]
    dc.restore(2)
    assert p[0] is live and p[0].tolist() == [7.0, 0.0]


def test_pipemare_backward_reads_live_minus_gap_velocity() -> None:
    """Through ``RankPolicy``: a B with gap g reads w - g x velocity (gap 0: w itself), and w is back after it."""
    s = generate("pipemare", num_stages=3, num_microbatches=3, num_steps=3)
    reads = read_versions(s)

    def step(stage: int, worker: StageWorker) -> None:
        for p in worker.module.parameters():
            p += 2.0  # w_k = 2k; velocity (gamma 0.5): delta_k = 0.5 delta_(k-1) + 0.5 x 2

    run = drive(s, 0, step, PolicyOptions(decay=0.5))
    velocity = [0.0]
    for _ in range(3):
        velocity.append(0.5 * velocity[-1] + 1.0)
    live = next(run.workers[0].module.parameters()).data_ptr()
    gaps = set()
    for a, value in run.read.items():
        k, gap = reads[a].version, reads[a].version - reads[a].target
        assert value == 2.0 * k - gap * velocity[k], a
        assert run.storage[a] == live and run.live[a][0] == 2.0 * k, a  # in place, undone after the action
        if a.op is not Op.F:
            gaps.add(gap)
    assert gaps == {0, 1}  # backwards with and without a gap ran


def test_spectrain_prediction() -> None:
    # float64: the fused pass w + (-s lr) v, which the runtime runs, rounds differently from w - s lr v in
    # float32, where -0.04 is a cancellation of 0.52 and 0.56
    w = torch.nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    for g in (2.0, 1.0):
        w.grad = torch.tensor([g], dtype=torch.float64)
        opt.step()
    # v1 = 2, w1 = 0.8; v2 = 0.9 * 2 + 1 = 2.8, w2 = 0.8 - 0.28 = 0.52; w_hat(s=2) = 0.52 - 2 * 0.1 * 2.8 = -0.04
    assert w.item() == pytest.approx(0.52)
    assert predict_weights(opt, [w], 2)[0].item() == pytest.approx(-0.04)
    # The prediction is what momentum SGD reaches if the velocity stays put (zero further gradients
    # change it by 0.9x, so compare with the exact s = 1 step).
    assert predict_weights(opt, [w], 1)[0].item() == pytest.approx(0.52 - 0.28)


def test_xpipe_prediction() -> None:
    w = torch.nn.Parameter(torch.tensor([1.0]))
    opt = torch.optim.Adam([w], lr=0.1, betas=(0.9, 0.99), eps=0.0)
    for g in (1.0, 3.0):
        w.grad = torch.tensor([g])
        opt.step()
    m = 0.9 * 0.1 + 0.1 * 3.0  # 0.39
    v = 0.99 * 0.01 + 0.01 * 9.0  # 0.0999
    direction = (m / (1 - 0.9**2)) / (v / (1 - 0.99**2)) ** 0.5
    w2 = 0.9 - 0.1 * direction
    assert w.item() == pytest.approx(w2, rel=1e-6)
    assert predict_weights(opt, [w], 3)[0].item() == pytest.approx(w2 - 3 * 0.1 * direction, rel=1e-6)


def test_xpipe_bellwether_predicts_once_per_mini_batch_and_pass() -> None:
    """Through ``RankPolicy``: a mini-batch's microbatches reuse its bellwether's prediction, dropped after the pass."""
    s = generate("xpipe", num_stages=2, num_microbatches=3, num_steps=3)
    reads = read_versions(s)

    def step(stage: int, worker: StageWorker) -> None:  # Adam's own step: the predictions follow its state
        for p in worker.module.parameters():
            p.grad = torch.ones_like(p)
        worker.optimizer.step()

    run = drive(s, 0, step, optimizer=torch.optim.Adam)
    passes: dict[tuple[bool, int], list[Action]] = {}
    for a in run.read:
        passes.setdefault((a.op is Op.F, reads[a].target), []).append(a)
    first = next(iter(run.read))
    assert run.held[first] == 2 * run.policy.bytes[0]  # the live weights and the bellwether's prediction
    assert max(len(actions) for actions in passes.values()) == 3
    for actions in passes.values():
        assert len({run.storage[a] for a in actions}) == 1  # reused: computed once by the bellwether
        assert len({run.read[a] for a in actions}) == 1
        assert len({reads[a].version for a in actions}) == 1  # the version the bellwether predicted from
    assert run.policy.held_bytes() == run.policy.bytes[0]  # drained: every cached prediction released


@pytest.mark.parametrize("name", ["pipedream", "pipedream-2bw"])
def test_stores_match_the_simulator(name: str) -> None:
    s = generate(name, num_stages=4, num_microbatches=4)
    expected = read_versions(s)
    for rank in range(4):
        run = drive(s, rank)
        assert run.policy.peak_weight_bytes == stage_weights(s)[rank].versions * run.policy.bytes[rank]
        for a, value in run.read.items():
            assert value == expected[a].version


def test_vertical_sync_reads_the_version_stage_0_read() -> None:
    s = generate("pipedream", num_stages=3, num_microbatches=3, vertical_sync=True)
    r = read_versions(s)
    run = drive(s, 2)
    assert {a.op for a in run.read} == {Op.F, Op.B}
    for a, value in run.read.items():
        assert value == r[a].version
    assert run.policy.peak_weight_bytes <= 3 * run.policy.bytes[2]


def test_avgpipe_averages_every_period_th_round() -> None:
    """Through ``RankPolicy``: replicas are pulled together once both made a round's update, every period-th round."""
    s = generate("avgpipe", num_stages=2, num_microbatches=2, num_steps=2)
    assert s.placement.stages_on(0) == (0, 2)  # the two replicas of part 0

    def step(stage: int, worker: StageWorker) -> None:
        for p in worker.module.parameters():
            p += 1.0 if stage == 0 else 3.0

    rounds = [a for a in s.actions[0] if a.op is Op.U and a.stage == 2]  # stage 2 completes each round
    run = drive(s, 0, step, PolicyOptions(averaging_rate=1.0, averaging_period=2))
    assert [run.live[u] for u in rounds] == [{0: 1.0, 2: 3.0}, {0: 4.0, 2: 4.0}]  # round 1 kept, round 2 averaged
    run = drive(s, 0, step)  # every round, alpha = 0.9 / P = 0.45: 1 + 0.45 (2 - 1), 3 - 0.45 (3 - 2)
    assert run.live[rounds[0]] == {0: pytest.approx(1.45), 2: pytest.approx(2.55)}


def test_wpipe_and_ampnet_and_avgpipe() -> None:
    assert isinstance(weights_for_part(1, 2, [torch.zeros(1)]), DoubleBuffer)
    assert weights_for_part(2, 2, [torch.zeros(1)]).max_versions == 1
    # AMPNet: a stage updates once it holds min_update_frequency gradients (the schedule's U placement)
    s = generate("ampnet", num_stages=2, num_microbatches=3, num_steps=2, min_update_frequency=3)
    groups = [g for u, g in sorted(consumed_gradients(s).items()) if u.stage == 0]
    assert [b == g[-1] for g in groups for b in g] == [False, False, True, False, False, True]
    reps = [[torch.tensor([0.0, 3.0])], [torch.tensor([3.0, 0.0])], [torch.tensor([6.0, 6.0])]]
    elastic_average(reps, alpha=0.3)  # mean (3, 3): x + 0.3 (3 - x)
    assert [r[0].tolist() for r in reps] == [
        pytest.approx([0.9, 3.0]),
        pytest.approx([3.0, 0.9]),
        pytest.approx([5.1, 5.1]),
    ]
    assert default_alpha(len(reps)) == pytest.approx(0.3)  # 0.9 / P, RankPolicy's alpha when none is given
