"""Asynchronous streams: valid over a grid, golden orders, which gradients each U applies, steady-state bubble."""

from __future__ import annotations

import pytest

from pipeweave.schedule import Action, Op, ScheduleError, generate, validate
from pipeweave.schedule.dataflow import consumed_gradients
from pipeweave.schedule.pipedream import noam
from pipeweave.schedule.stream import peak_in_flight
from pipeweave.schedule.validate import InvalidSchedule
from pipeweave.sim import simulate
from pipeweave.sim.steady import steady_bubble_ratio

ASYNC = ["pipedream", "pipedream-2bw", "pipemare", "spectrain", "xpipe", "ampnet", "wpipe", "avgpipe"]


def rows(schedule: object) -> list[list[str]]:
    return [[str(a) for a in row] for row in schedule.actions]  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ASYNC)
@pytest.mark.parametrize("d,t,steps", [(1, 1, 1), (2, 3, 2), (3, 2, 3), (4, 5, 2), (3, 7, 1)])
def test_valid_over_a_grid(name: str, d: int, t: int, steps: int) -> None:
    s = generate(name, num_stages=d, num_microbatches=t, num_steps=steps)
    validate(s)
    assert not s.is_synchronous and s.num_steps == steps
    per_step = t * (2 if name == "avgpipe" else 1)  # AvgPipe: one mini-batch per pipeline, P = 2
    assert s.num_microbatches == steps * per_step


def test_pipedream_golden() -> None:
    # 1F1B without a flush, a U after every backward:
    #   rank 0 | F0 F1 B0 U0 F2 B1 U1 F3 B2 U2 B3 U3
    #   rank 1 | .. F0 B0 U0 F1 B1 U1 F2 B2 U2 F3 B3 U3
    assert rows(generate("pipedream", num_stages=2, num_microbatches=2, num_steps=2)) == [
        ["0F0", "0F1", "0B0", "0U0", "0F2", "0B1", "0U1", "0F3", "0B2", "0U2", "0B3", "0U3"],
        ["1F0", "1B0", "1U0", "1F1", "1B1", "1U1", "1F2", "1B2", "1U2", "1F3", "1B3", "1U3"],
    ]


def test_2bw_and_xpipe_update_once_per_mini_batch() -> None:
    for name in ("pipedream-2bw", "xpipe", "pipemare"):
        s = generate(name, num_stages=3, num_microbatches=4, num_steps=3)
        for u, grads in consumed_gradients(s).items():
            assert [g.microbatch for g in grads] == list(range(4 * u.microbatch, 4 * u.microbatch + 4))
            assert all(g.stage == u.stage and g.op is Op.B for g in grads)


def test_pipedream_updates_after_every_microbatch() -> None:
    s = generate("pipedream", num_stages=3, num_microbatches=2, num_steps=3)
    groups = consumed_gradients(s)
    assert len(groups) == 3 * 6
    assert all(grads == (Action(u.stage, Op.B, u.microbatch),) for u, grads in groups.items())


@pytest.mark.parametrize("d", [1, 2, 3, 4])
def test_pipedream_admits_noam_microbatches_by_default_and_in_flight_when_given(d: int) -> None:
    """NOAM = ceil(workers / input replicas) = D on D straight stages; ``in_flight`` sets what stage 0 admits,
    and stage s still holds at most D - s (more adds nothing on a straight pipeline)."""
    assert noam(d) == d
    default = generate("pipedream", num_stages=d, num_microbatches=4, num_steps=2)
    assert [peak_in_flight(row, s) for s, row in enumerate(default.actions)] == [d - s for s in range(d)]
    for n in range(1, d + 2):
        s = generate("pipedream", num_stages=d, num_microbatches=4, num_steps=2, in_flight=n)
        validate(s)
        assert [peak_in_flight(row, k) for k, row in enumerate(s.actions)] == [max(1, min(n, d) - k) for k in range(d)]
    # One in flight: each microbatch's backward before the next forward (no staleness, naive model parallelism)
    one = generate("pipedream", num_stages=d, num_microbatches=2, num_steps=1, in_flight=1)
    assert rows(one)[0][:3] == ["0F0", "0B0", "0U0"]


def test_pipedream_in_flight_below_one_is_one_line() -> None:
    with pytest.raises(ScheduleError, match=r"^in_flight=0 is invalid; give in_flight >= 1 .*NOAM is 3\)$"):
        generate("pipedream", num_stages=3, num_microbatches=2, in_flight=0)


def test_ampnet_update_frequency_and_bound() -> None:
    s = generate("ampnet", num_stages=3, num_microbatches=3, num_steps=2, min_update_frequency=2)
    sizes = [len(g) for u, g in sorted(consumed_gradients(s).items()) if u.stage == 0]
    assert sizes == [2, 2, 2]
    one = generate("ampnet", num_stages=3, num_microbatches=2, num_steps=1, max_active_keys=1)
    # One microbatch in flight: naive model parallelism, bubble (D-1)/D at f = b = w... with B = 2f.
    t = simulate(one)
    busy = sum(e.end - e.start for row in t.events for e in row)
    assert busy == 2 * 3 * 3  # 2 microbatches x 3 stages x (f + b + w)
    assert max(e.end for e in t.events[0]) == 2 * 3 * 3  # everything serial


def test_sync_rules_unchanged() -> None:
    g = consumed_gradients(generate("1f1b", num_stages=3, num_microbatches=4))
    assert [str(a) for a in g[Action(0, Op.U, 0)]] == ["0B0", "0B1", "0B2", "0B3"]


def test_stream_update_rules_are_checked() -> None:
    s = generate("pipedream", num_stages=2, num_microbatches=2, num_steps=1)
    drop_last_u = [list(r) for r in s.actions]
    drop_last_u[0] = drop_last_u[0][:-1]
    with pytest.raises(InvalidSchedule, match="no U applies"):
        validate(s.with_actions(drop_last_u))
    empty = [list(r) for r in s.actions]  # rank 1: 1F0 1B0 1U0 1U1 1F1 1B1 1U2
    empty[1] = empty[1][:3] + [Action(1, Op.U, 1)] + empty[1][3:5] + [Action(1, Op.U, 2)]
    with pytest.raises(InvalidSchedule, match="applies no gradient"):
        validate(s.with_actions(empty))
    renumbered = [[Action(a.stage, a.op, a.microbatch + 1) if a.op is Op.U else a for a in r] for r in s.actions]
    with pytest.raises(InvalidSchedule, match="should be 0U0"):
        validate(s.with_actions(renumbered))


@pytest.mark.parametrize("name", ["pipedream", "pipedream-2bw", "pipemare", "spectrain", "xpipe", "ampnet", "avgpipe"])
@pytest.mark.parametrize("d,t", [(2, 2), (4, 4), (3, 5)])
def test_steady_state_bubble_is_zero(name: str, d: int, t: int) -> None:
    s = generate(name, num_stages=d, num_microbatches=t, num_steps=4)
    assert steady_bubble_ratio(simulate(s)) == pytest.approx(0.0, abs=1e-12)


def test_wpipe_golden() -> None:
    # 2GW at D = T = 2 (stages 0, 1: G0; 2, 3: G1), three periods. G1 runs each period as 1F1B and updates
    # before the next period's forwards; G0's forwards of period k + 1 come before its backwards of period k:
    #   rank 0 | 0F0 0F1 2F0 2F1 2B0 0F2 2B1 2U0 0F3 0B0 | 2F2 0B1 0U0 2F3 2B2 0F4 2B3 2U1 0F5 0B2 | 2F4 0B3 ...
    #   rank 1 | 1F0 1F1 3F0 3B0 3F1 3B1 3U0 1F2 1B0 1F3 1B1 1U0 | 3F2 3B2 3F3 3B3 3U1 1F4 1B2 1F5 1B3 1U1 | ...
    assert [" ".join(row) for row in rows(generate("wpipe", num_stages=2, num_microbatches=2, num_steps=3))] == [
        "0F0 0F1 2F0 2F1 2B0 0F2 2B1 2U0 0F3 0B0 2F2 0B1 0U0 2F3 2B2 0F4 2B3 2U1 0F5 0B2 2F4 0B3 0U1 2F5 2B4 2B5 "
        "2U2 0B4 0B5 0U2",
        "1F0 1F1 3F0 3B0 3F1 3B1 3U0 1F2 1B0 1F3 1B1 1U0 3F2 3B2 3F3 3B3 3U1 1F4 1B2 1F5 1B3 1U1 3F4 3B4 3F5 3B5 "
        "3U2 1B4 1B5 1U2",
    ]


@pytest.mark.parametrize("d", [1, 2, 3, 4, 5, 8])
def test_wpipe_steady_state_is_the_rule_and_has_no_bubble(d: int) -> None:
    """The paper's ~0 at f = 1, B = 2 for every T >= D; two G0 versions, one G1 version, G0 one update stale."""
    from pipeweave.schedule.wpipe import period_slots
    from pipeweave.sim.versions import stage_weights, staleness

    for t in (d, d + 1, 2 * d + 1):
        s = generate("wpipe", num_stages=d, num_microbatches=t, num_steps=5)
        assert steady_bubble_ratio(simulate(s)) == pytest.approx(0.0, abs=1e-12), (d, t)
        assert [w.versions for w in stage_weights(s)] == [2] * d + [1] * d
        assert staleness(s) == (1,) * d + (0,) * d
        for r in range(d):  # period 2 (no warm-up nor drain left): the rule's list, microbatches numbered
            computes = [a for a in s.actions[r] if a.op is not Op.U]
            period = [a for a in computes if a.stage >= d and a.microbatch // t == 2]
            start = computes.index(period[0])
            kinds = [("F" if a.op is Op.F else "B") + ("1" if a.stage >= d else "0") for a in computes[start:]]
            assert kinds[: 4 * t] == [k for k, _ in period_slots(d, t, r)], (d, t, r)


def test_wpipe_short_periods_keep_two_versions() -> None:
    """T < D (outside the paper's setting): list-scheduled under the same two rules, still a double buffer."""
    from pipeweave.sim.versions import stage_weights, staleness

    for d, t in [(3, 2), (4, 3), (5, 2), (3, 1)]:
        s = generate("wpipe", num_stages=d, num_microbatches=t, num_steps=5)
        validate(s)
        assert max(w.versions for w in stage_weights(s)) <= 2 and staleness(s)[d:] == (0,) * d


def test_flush_warmup_makes_a_bubble() -> None:
    warm = generate("pipemare", num_stages=4, num_microbatches=4, num_steps=4, warmup_steps=2)
    validate(warm)
    t = simulate(warm)
    # Two flushed 1F1B steps then the stream: slower than the pure stream.
    assert t.events[0][-1].end > simulate(generate("pipemare", num_stages=4, num_microbatches=4)).events[0][-1].end


def test_bad_options() -> None:
    with pytest.raises(ScheduleError, match="num_steps"):
        generate("pipedream", num_stages=2, num_microbatches=2, num_steps=0)
    with pytest.raises(ScheduleError, match="warmup_steps"):
        generate("pipemare", num_stages=2, num_microbatches=2, num_steps=2, warmup_steps=3)
    with pytest.raises(ScheduleError, match="takes no option"):
        generate("xpipe", num_stages=2, num_microbatches=2, vertical_sync=True)
    with pytest.raises(ScheduleError, match="chunk"):
        generate("wpipe", num_stages=2, num_microbatches=2, num_chunks=1)


def _scan_every_unit(placement, routes, in_flight, admit):  # type: ignore[no-untyped-def]
    """The list scheduler by its definition: at every time unit, every free rank scans all its actions."""
    n = placement.num_ranks
    todo: list[list[tuple[Op, int, int]]] = [[] for _ in range(n)]
    for j, route in enumerate(routes):
        for s in route:
            todo[placement.stage_rank[s]] += [(Op.F, j, s), (Op.B, j, s)]
    pos = {s: i for route in routes for i, s in enumerate(route)}
    done_at: dict[tuple[Op, int, int], int] = {}
    open_: dict[int, int] = {}
    backs: dict[int, int] = {}
    rows: list[list[Action]] = [[] for _ in range(n)]
    free, t = [0] * n, 0
    while any(todo):
        for r in range(n):
            if free[r] > t:
                continue
            ready = []
            for op, j, s in todo[r]:
                route, i = routes[j], pos[s]
                if op is Op.F:
                    ok = (
                        (i == 0 or done_at.get((Op.F, j, route[i - 1]), t + 1) <= t)
                        and open_.get(s, 0) < in_flight(s)
                        and (admit is None or admit(s, j, backs.get(s, 0)))
                    )
                else:
                    ok = done_at.get((Op.F, j, s), t + 1) <= t and (
                        i == len(route) - 1 or done_at.get((Op.B, j, route[i + 1]), t + 1) <= t
                    )
                if ok:
                    ready.append(((op is Op.F, j, -i), (op, j, s)))
            if not ready:
                continue
            op, j, s = min(ready)[1]
            todo[r].remove((op, j, s))
            rows[r].append(Action(s, op, j))
            free[r] = done_at[(op, j, s)] = t + (1 if op is Op.F else 2)
            open_[s] = open_.get(s, 0) + (1 if op is Op.F else -1)
            backs[s] = backs.get(s, 0) + (op is Op.B)
        t += 1
    return rows


@pytest.mark.parametrize("name", ["wpipe", "avgpipe"])
def test_greedy_stream_equals_the_list_scheduler_by_its_definition(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The event-driven builder (linear-ish; D = 64, T = 512 in about a second) picks what a full scan picks."""
    import importlib

    module = importlib.import_module(f"pipeweave.schedule.{name}")
    for d in (1, 2, 3, 5):
        for t in (1, 2, 4, 7):
            for steps in (1, 3):
                options = [{"num_pipelines": p} for p in (1, 2, 3)] if name == "avgpipe" else [{}]
                for extra in options:
                    fast = generate(name, num_stages=d, num_microbatches=t, num_steps=steps, **extra)
                    monkeypatch.setattr(module, "greedy_stream", _scan_every_unit)
                    slow = generate(name, num_stages=d, num_microbatches=t, num_steps=steps, **extra)
                    monkeypatch.undo()
                    assert fast.actions == slow.actions, (d, t, steps, extra)


def test_avgpipe_on_ranks_of_their_own() -> None:
    """P pipelines on P x D ranks: pipeline q runs the lone pipeline's order on its own mini-batches m P + q.
    rank 0 | 0F0 0F1 0B0 0B1 0U0 0F4 ...     (pipeline 0: mini-batches 0, 2)
    rank 2 | 2F2 2F3 2B2 2B3 2U0 2F6 ...     (pipeline 1: mini-batches 1, 3)
    """
    for d, t, p, steps in [(2, 2, 2, 2), (3, 2, 3, 2), (1, 1, 2, 1), (4, 5, 2, 3)]:
        s = generate("avgpipe", num_stages=d, num_microbatches=t, num_steps=steps, num_pipelines=p, own_ranks=True)
        validate(s)
        lone = generate("avgpipe", num_stages=d, num_microbatches=t, num_steps=steps, num_pipelines=1)
        assert s.num_ranks == p * d and s.placement.stage_rank == tuple(range(p * d))
        for q in range(p):
            for i in range(d):
                row = s.actions[q * d + i]
                assert {a.microbatch // t % p for a in row if a.op is not Op.U} == {q}
                assert [(a.op, a.stage - q * d) for a in row] == [(a.op, a.stage) for a in lone.actions[i]]
    first = rows(generate("avgpipe", num_stages=2, num_microbatches=2, num_steps=2, own_ranks=True))[2][:6]
    assert first == ["2F2", "2F3", "2B2", "2B3", "2U0", "2F6"]
