"""``schedule.validate``'s verdict without its pure-Python walks: the rules over a schedule's arrays, the
deadlock check left to the simulation that follows.

``validate`` checks the actions (``check_actions``), runs the order
(``check_order``: a deadlock or an action before its input), and checks the
updates (``check_updates`` for a synchronous step, ``check_stream_updates``
for a stream). Here the actions are ``sim.arrays.well_formed`` and the
updates ``updates_ok``, both vectorised; the order needs no pass of its own,
since simulating the schedule runs it (``sim.timeline.simulate_parts`` raises
``check_order``'s error where it gets stuck). What the fast passes doubt,
``validate`` itself explains, so every error is the reference's, word for word.
"""

from __future__ import annotations

import numpy as np

from pipeweave.schedule.ir import Schedule
from pipeweave.schedule.validate import validate
from pipeweave.sim.arrays import B, ScheduleArrays, U, W, schedule_arrays


def updates_ok(schedule: Schedule, a: ScheduleArrays) -> bool:
    """``check_updates`` and ``check_stream_updates`` over the arrays: True means both would accept.

    Example:
        >>> from pipeweave.schedule import generate
        >>> s = generate("zb-v", num_stages=4, num_microbatches=8)
        >>> updates_ok(s, schedule_arrays(s))
        True
    """
    update = a.op == U
    num_stages = schedule.placement.num_stages
    if schedule.is_synchronous:  # one U per stage, after every other action of that stage
        if (np.bincount(a.stage[update], minlength=num_stages) != 1).any():
            return False
        at = np.empty(num_stages, dtype=np.int64)
        at[a.stage[update]] = np.flatnonzero(update)
        last = np.full(num_stages, -1, dtype=np.int64)
        np.maximum.at(last, a.stage[~update], np.flatnonzero(~update))
        return bool((at > last).all())
    return _stream_updates_ok(a, update)


def _stream_updates_ok(a: ScheduleArrays, update: np.ndarray) -> bool:
    """Per stage, in row order: its U numbered 0, 1, ..., each after at least one B or W since the last, and
    none of those after its last U. A stage lives on one rank, so row order is its rank's order."""
    events = np.flatnonzero(update | (a.op == B) | (a.op == W))
    events = events[np.argsort(a.stage[events], kind="stable")]  # by stage, each in its row order
    stage, is_u = a.stage[events], update[events]
    first = np.ones(len(events), dtype=bool)
    first[1:] = stage[1:] != stage[:-1]
    group = np.cumsum(first) - 1
    grads = np.cumsum(~is_u)  # B and W up to each event, included
    before = (grads - ~is_u)[first]  # before each stage's first event
    updates = np.cumsum(is_u)
    ordinal = updates - (updates - is_u)[first][group] - 1  # of each U, its number within its stage
    if (a.microbatch[events[is_u]] != ordinal[is_u]).any():
        return False
    at_u, group_u = grads[is_u], group[is_u]
    previous = np.where(np.r_[True, group_u[1:] != group_u[:-1]], before[group_u], np.r_[0, at_u[:-1]])
    if (at_u - previous < 1).any():
        return False  # a U with no gradient since the last
    last = np.flatnonzero(np.r_[group[1:] != group[:-1], True])  # each stage's last event
    return bool(is_u[last].all())  # no gradient left after a stage's last U


def check(schedule: Schedule) -> None:
    """Every rule of ``validate`` but the order, which the simulation checks (module docstring).

    Raises:
        InvalidSchedule: ``validate``'s own error, where the fast passes find a problem.

    Example:
        >>> from pipeweave.schedule import generate
        >>> check(generate("zb-h1", num_stages=4, num_microbatches=8))
    """
    arrays = schedule_arrays(schedule)
    if not (arrays.ok and updates_ok(schedule, arrays)):
        validate(schedule)  # explains the problem (or accepts what the fast passes are too strict about)
