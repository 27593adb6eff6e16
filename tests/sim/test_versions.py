"""Weight versions: what each F and B reads, staleness, inconsistency and copies against closed forms."""

from __future__ import annotations

import pytest

from pipeweave.schedule import Action, Op, ScheduleError, generate
from pipeweave.sim import CostModel, compute_metrics, simulate
from pipeweave.sim.versions import inconsistency, read_versions, stage_weights, staleness, weight_copies


def reads(name: str, d: int, t: int, steps: int = 4, **options: object) -> tuple[object, dict]:
    s = generate(name, num_stages=d, num_microbatches=t, num_steps=steps, **options)
    return s, read_versions(s)


@pytest.mark.parametrize("d", [2, 3, 5])
def test_pipedream_stash(d: int) -> None:
    s, r = reads("pipedream", d, 3)
    for j in range(s.num_microbatches):
        for st in range(d):
            # In 1F1B stage s warms up with D-1-s forwards, then F(s, w+i) comes right after U(s, i-1):
            # F(s, j) finds max(0, j - (D-1-s)) updates done; the stashed backward reads the same.
            expected = max(0, j - (d - 1 - st))
            assert r[Action(st, Op.F, j)] == (expected, expected)
            assert r[Action(st, Op.B, j)] == (expected, expected)
    assert staleness(s) == tuple(d - 1 - st for st in range(d))
    assert inconsistency(s) == (0,) * d
    # The survey's table: stage s keeps D - s versions, [M_theta, D M_theta].
    assert [w.total for w in stage_weights(s)] == [d - st for st in range(d)]
    costs = CostModel().for_parts(num_parts=d, num_ranks=d)
    assert weight_copies(s, costs) == tuple(float(d - st) for st in range(d))


def test_vertical_sync_reads_stage_zero_version() -> None:
    s, r = reads("pipedream", 4, 4, vertical_sync=True)
    for j in range(s.num_microbatches):
        v0 = r[Action(0, Op.F, j)].version
        assert v0 == max(0, j - 3)
        for st in range(4):
            assert r[Action(st, Op.F, j)].version == v0 and r[Action(st, Op.B, j)].version == v0
    assert staleness(s) == (3, 3, 3, 3)  # every stage as stale as stage 0
    # Every stage keeps the versions from stage 0's down to its own current one: D (not the table's D - s).
    assert [w.versions for w in stage_weights(s)] == [4, 4, 4, 4]


def test_2bw_double_buffer() -> None:
    d, t = 4, 4
    s, r = reads("pipedream-2bw", d, t)
    for a, got in r.items():
        f = r[Action(a.stage, Op.F, a.microbatch)]
        assert got == f  # backward reads its forward's version
    # Brute force: F reads the number of U its rank ran before it.
    for row in s.actions:
        for i, a in enumerate(row):
            if a.op is Op.F:
                assert r[a].version == sum(1 for b in row[:i] if b.op is Op.U)
    assert [w.total for w in stage_weights(s)] == [2, 2, 2, 1]  # the last stage never crosses an update
    assert staleness(s) == (1, 1, 1, 0)
    with pytest.raises(ScheduleError, match="double buffer"):
        stage_weights(generate("pipedream-2bw", num_stages=4, num_microbatches=1))


def test_ampnet_reads_current_and_is_inconsistent() -> None:
    d = 3
    s, r = reads("ampnet", d, 3)
    for j in range(s.num_microbatches):
        for st in range(d):
            assert r[Action(st, Op.F, j)].version == max(0, j - (d - 1 - st))
            assert r[Action(st, Op.B, j)].version == j  # after U(s, j-1): j updates
    assert inconsistency(s) == (2, 1, 0)
    assert [w.total for w in stage_weights(s)] == [1, 1, 1]


def test_pipemare_backward_stands_for_forward_version() -> None:
    s, r = reads("pipemare", 3, 3)
    for a, got in r.items():
        f = r[Action(a.stage, Op.F, a.microbatch)]
        if a.op is Op.B:
            assert got.target == f.version and got.version >= f.version
    assert max(inconsistency(s)) == 1
    w = stage_weights(s)
    assert [x.total for x in w] == [2, 2, 2] and {x.extra_kind for x in w} == {"velocity"}
    warm = generate("pipemare", num_stages=3, num_microbatches=3, num_steps=4, warmup_steps=4)
    assert staleness(warm) == (0, 0, 0) and inconsistency(warm) == (0, 0, 0)


def test_spectrain_predicts_to_the_applied_version() -> None:
    d = 4
    s, r = reads("spectrain", d, 2)
    for j in range(s.num_microbatches):
        for st in range(d):
            f, b = r[Action(st, Op.F, j)], r[Action(st, Op.B, j)]
            assert f.target == b.target == j  # U(s, j) applies microbatch j's gradient to version j
            assert f.distance == min(j, d - 1 - st) and b.distance == 0
    assert [w.total for w in stage_weights(s)] == [2] * d


def test_xpipe_bellwether() -> None:
    d, t = 3, 4
    s, r = reads("xpipe", d, t)
    for st in range(d):
        for j in range(s.num_microbatches):
            bell = (j // t) * t
            for op in (Op.F, Op.B):
                assert r[Action(st, op, j)] == r[Action(st, op, bell)]  # the bellwether's prediction
                assert r[Action(st, op, j)].target == j // t
    assert [w.extra for w in stage_weights(s)] == [2, 2, 2]  # F and B caches of two mini-batches overlap


def test_avgpipe_replicas() -> None:
    for p in (2, 3):
        s = generate("avgpipe", num_stages=3, num_microbatches=3, num_pipelines=p)
        costs = CostModel().for_parts(num_parts=3, num_ranks=3)
        assert weight_copies(s, costs) == (float(p),) * 3  # P replicas per rank
        assert staleness(s) == (0,) * (3 * p) and inconsistency(s) == (0,) * (3 * p)


def test_wpipe_copies() -> None:
    s = generate("wpipe", num_stages=4, num_microbatches=8)
    w = stage_weights(s)
    assert [x.versions for x in w] == [2, 2, 2, 2, 1, 1, 1, 1]  # first group double-buffered
    assert staleness(s) == (1, 1, 1, 1, 0, 0, 0, 0)
    costs = CostModel().for_parts(num_parts=8, num_ranks=4)
    assert weight_copies(s, costs) == (1.5,) * 4  # parts are M_theta / 2


@pytest.mark.parametrize("name", ["naive", "gpipe", "1f1b"])
def test_synchronous_schedules_have_no_staleness(name: str) -> None:
    s = generate(name, num_stages=4, num_microbatches=5)
    assert staleness(s) == (0,) * 4 and inconsistency(s) == (0,) * 4
    assert set(read_versions(s).values()) == {(0, 0)}
    m = compute_metrics(simulate(s))
    assert m.weight_versions == (1.0,) * 4 and m.steady_bubble_ratio == pytest.approx(m.bubble_ratio)


def test_metrics_of_a_stream() -> None:
    m = compute_metrics(simulate(generate("pipedream", num_stages=4, num_microbatches=4)))
    assert m.weight_versions == (4.0, 3.0, 2.0, 1.0)
    assert m.staleness == (3, 2, 1, 0) and m.inconsistency == (0, 0, 0, 0)
    assert m.steady_bubble_ratio == 0.0 < m.bubble_ratio  # warm-up and drain are in the whole stream
