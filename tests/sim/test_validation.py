"""``sim.validation``: ``validate``'s rules over arrays, with the pure-Python validator as the reference: every
registered schedule accepted, every broken one refused with the reference's own error, word for word."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pipeweave.schedule import SCHEDULES, ScheduleError, generate
from pipeweave.schedule.ir import Action, Op, Schedule
from pipeweave.schedule.validate import InvalidSchedule, validate
from pipeweave.sim import simulate
from pipeweave.sim.arrays import encode
from pipeweave.sim.validation import check, updates_ok


def _generated(name: str, d: int, t: int) -> Schedule | None:
    try:
        return generate(name, num_stages=d, num_microbatches=t)
    except ScheduleError:
        return None  # a size the family rejects


def _registered() -> list[Schedule]:
    made = (_generated(name, d, t) for name in SCHEDULES for d, t in ((2, 4), (3, 5), (4, 8)))
    return [s for s in made if s is not None]


@pytest.mark.parametrize("schedule", _registered(), ids=lambda s: f"{s.name}-D{s.num_ranks}")
def test_every_registered_schedule_passes_the_fast_checks(schedule: Schedule) -> None:
    arrays = encode(schedule)
    assert arrays.ok and updates_ok(schedule, arrays)


def _edit(name: str, change: Callable[[list[list[Action]]], None], **options: object) -> Schedule:
    good = generate(name, num_stages=3, num_microbatches=4, **options)
    rows = [list(row) for row in good.actions]
    change(rows)
    return good.with_actions(rows)


def _move_u_first(rows: list[list[Action]]) -> None:
    rows[0].insert(0, rows[0].pop())  # the synchronous U before the work it applies


def _u_twice(rows: list[list[Action]]) -> None:
    rows[1].append(rows[1][-1])


def _no_u(rows: list[list[Action]]) -> None:
    rows[2].pop()


def _swap_first_two(rows: list[list[Action]]) -> None:
    rows[-1][0], rows[-1][1] = rows[-1][1], rows[-1][0]  # a backward before its forward: stuck


def _forward_twice(rows: list[list[Action]]) -> None:
    rows[1].append(Action(1, Op.F, 0))


def _backward_missing(rows: list[list[Action]]) -> None:
    rows[1].remove(next(a for a in rows[1] if a.op is Op.B))


def _weight_gradient_missing(rows: list[list[Action]]) -> None:
    rows[0].remove(next(a for a in rows[0] if a.op is Op.W))


def _off_route(rows: list[list[Action]]) -> None:
    # GEMS at D = 3: microbatch 0 goes down stages 0-2; stage 3 (rank 2) is the other pipeline's
    rows[2].insert(0, Action(3, Op.F, 0))


def _stream_first_u_renumbered(rows: list[list[Action]]) -> None:
    k = next(k for k, a in enumerate(rows[0]) if a.op is Op.U)
    rows[0][k] = Action(rows[0][k].stage, Op.U, 5)


def _stream_empty_u(rows: list[list[Action]]) -> None:
    k = next(k for k, a in enumerate(rows[0]) if a.op is Op.U)
    rows[0].insert(k + 1, Action(rows[0][k].stage, Op.U, rows[0][k].microbatch + 1))
    for j in range(k + 2, len(rows[0])):  # renumber the later ones, so only the empty one is wrong
        a = rows[0][j]
        if a.op is Op.U:
            rows[0][j] = Action(a.stage, Op.U, a.microbatch + 1)


def _stream_gradient_left(rows: list[list[Action]]) -> None:
    rows[0].pop()  # the stream's last U: its gradients are never applied


BROKEN = [
    ("1f1b", _move_u_first, {}),
    ("zb-h1", _u_twice, {}),
    ("gpipe", _no_u, {}),
    ("1f1b", _swap_first_two, {}),
    ("zb-v", _forward_twice, {}),
    ("1f1b", _backward_missing, {}),
    ("zb-h1", _weight_gradient_missing, {}),
    ("gems", _backward_missing, {}),
    ("gems", _off_route, {}),
    ("pipedream", _stream_first_u_renumbered, {}),
    ("pipedream", _stream_empty_u, {}),
    ("pipedream", _stream_gradient_left, {}),
]


@pytest.mark.parametrize("name, change, options", BROKEN, ids=lambda x: getattr(x, "__name__", str(x)))
def test_a_broken_schedule_gets_the_references_error(
    name: str, change: Callable[[list[list[Action]]], None], options: dict[str, object]
) -> None:
    bad = _edit(name, change, **options)
    with pytest.raises(InvalidSchedule) as reference:
        validate(bad)
    with pytest.raises(InvalidSchedule) as fast:
        check(bad)
        simulate(bad)  # the order: a schedule that gets stuck
    assert str(fast.value) == str(reference.value)
    if change is not _swap_first_two:
        arrays = encode(bad)
        assert not (arrays.ok and updates_ok(bad, arrays))  # refused by the fast passes themselves
