"""Weight-policy math against hand-computed values, and the version stores driven by real schedules."""

from __future__ import annotations

import doctest
import importlib

import pytest
import torch

from pipeweave.schedule import Action, Op, generate
from pipeweave.sim.versions import read_versions, stage_weights
from pipeweave.weights.ampnet import UpdateTrigger
from pipeweave.weights.avgpipe import ElasticAveraging, elastic_average
from pipeweave.weights.double_buffer import DoubleBuffer
from pipeweave.weights.pipemare import DiscrepancyCorrection, rescheduled_lr
from pipeweave.weights.spectrain import SpecTrainPredictor
from pipeweave.weights.stash import WeightStash
from pipeweave.weights.wpipe import weights_for_part
from pipeweave.weights.xpipe import XPipePredictor


@pytest.mark.parametrize("name", ["stash", "double_buffer", "pipemare", "spectrain", "xpipe", "ampnet", "wpipe", "avgpipe"])
def test_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(f"pipeweave.weights.{name}"))
    assert result.failed == 0 and result.attempted > 0


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
    # w = (7, 0); two versions back: w - 2 delta = (2, -0.5)
    assert dc.weights_for_backward(2)[0].tolist() == [2.0, -0.5]
    assert dc.weights_for_backward(0)[0] is p[0]


def test_spectrain_prediction() -> None:
    w = torch.nn.Parameter(torch.tensor([1.0]))
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    for g in (2.0, 1.0):
        w.grad = torch.tensor([g])
        opt.step()
    # v1 = 2, w1 = 0.8; v2 = 0.9 * 2 + 1 = 2.8, w2 = 0.8 - 0.28 = 0.52; w_hat(s=2) = 0.52 - 2 * 0.1 * 2.8 = -0.04
    pred = SpecTrainPredictor([w], opt)
    assert w.item() == pytest.approx(0.52)
    assert pred.weights_for(2)[0].item() == pytest.approx(-0.04)
    # The prediction is what momentum SGD reaches if the velocity stays put (zero further gradients
    # change it by 0.9x, so compare with the exact s = 1 step).
    assert pred.weights_for(1)[0].item() == pytest.approx(0.52 - 0.28)


def test_xpipe_prediction_and_bellwether() -> None:
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
    xp = XPipePredictor([w], opt)
    first = xp.weights_for("F", mini_batch=3, distance=3)
    assert first[0].item() == pytest.approx(w2 - 3 * 0.1 * direction, rel=1e-6)
    assert xp.weights_for("F", mini_batch=3, distance=1) is first  # reused: computed once by the bellwether
    assert xp.cached() == 1
    xp.release("F", 3)
    assert xp.cached() == 0


def drive(store: WeightStash, schedule: object, rank: int) -> tuple[int, dict[tuple[Op, int], int]]:
    """Run one rank's list on a scalar weight that counts its updates; return peak versions and reads."""
    peak, seen = 1, {}
    for a in schedule.actions[rank]:  # type: ignore[attr-defined]
        if a.op is Op.F:
            seen[(Op.F, a.microbatch)] = int(store.weights_for_forward(a.microbatch)[0].item())
        elif a.op is Op.B:
            seen[(Op.B, a.microbatch)] = int(store.weights_for_backward(a.microbatch)[0].item())
            store.release(a.microbatch)
        elif a.op is Op.U:
            store.before_update()
            store.params[0] += 1.0  # the value is the version number
            store.after_update()
        peak = max(peak, store.versions_held())
    return peak, seen


@pytest.mark.parametrize("name,cls", [("pipedream", WeightStash), ("pipedream-2bw", DoubleBuffer)])
def test_stores_match_the_simulator(name: str, cls: type) -> None:
    s = generate(name, num_stages=4, num_microbatches=4)
    expected = read_versions(s)
    for rank in range(4):
        peak, seen = drive(cls([torch.zeros(1)]), s, rank)
        assert peak == stage_weights(s)[rank].versions
        for (op, j), value in seen.items():
            assert value == expected[Action(rank, op, j)].version


def test_vertical_sync_store_needs_retain() -> None:
    s = generate("pipedream", num_stages=3, num_microbatches=3, vertical_sync=True)
    r = read_versions(s)
    store = WeightStash([torch.zeros(1)], retain=stage_weights(s)[2].versions)
    for a in s.actions[2]:
        if a.op is Op.F:
            got = store.weights_for_forward(a.microbatch, version=r[a].version)
            assert got[0].item() == r[a].version
        elif a.op is Op.B:
            assert store.weights_for_backward(a.microbatch)[0].item() == r[a].version
            store.release(a.microbatch)
        elif a.op is Op.U:
            store.before_update()
            store.params[0] += 1.0
            store.after_update()
    assert store.versions_held() <= 3


def test_wpipe_and_ampnet_and_avgpipe() -> None:
    assert isinstance(weights_for_part(1, 2, [torch.zeros(1)]), DoubleBuffer)
    assert weights_for_part(2, 2, [torch.zeros(1)]).max_versions == 1
    trig = UpdateTrigger(3)
    assert [trig.add() for _ in range(6)] == [False, False, True, False, False, True]
    reps = [[torch.tensor([0.0, 3.0])], [torch.tensor([3.0, 0.0])], [torch.tensor([6.0, 6.0])]]
    elastic_average(reps, alpha=0.3)  # mean (3, 3): x + 0.3 (3 - x)
    assert [r[0].tolist() for r in reps] == [pytest.approx([0.9, 3.0]), pytest.approx([3.0, 0.9]),
                                             pytest.approx([5.1, 5.1])]
    avg = ElasticAveraging(reps)
    assert avg.alpha == pytest.approx(0.3)  # 0.9 / P
