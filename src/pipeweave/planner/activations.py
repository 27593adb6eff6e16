"""A schedule's activation memory walked once for every cost: per rank, the few states its peak can be in.

``sim.metrics.held_peaks`` walks a rank's actions in order and keeps the peak
of what its microbatches hold (F adds a part's held bytes, I swaps them for
the bytes W still needs, B and W free them, a backward that replays the
forward uses a block more while it runs). Between configurations of one
schedule only those byte sizes change, and a rank holds only its own parts (one, or
its chunks). So the walk here records, per rank, the states where a peak may
be, as counts (held of each of its parts, stashed of each, a replay
running): the peak under any sizes >= 0 is the largest of their weighted sums,
the number ``held_peaks`` finds (tests/planner/test_costs.py), one product of
arrays per configuration instead of a walk.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeweave.schedule.ir import Op, Schedule

Profile = tuple[tuple[tuple[int, ...], "np.ndarray"], ...]
"""Per rank, its parts and its states: one row of counts (held, then stashed, of each of its parts, and a
replay running) per moment its peak may be reached."""


def activation_profile(schedule: Schedule) -> Profile:
    """Per rank, the states of its walk where a peak may be: before each backward (a replay may be running)
    and after the last of a run of forwards or an I (module docstring).

    Example:
        >>> from pipeweave.schedule import generate
        >>> parts, states = activation_profile(generate("1f1b", num_stages=2, num_microbatches=3))[0]
        >>> parts, states.tolist()
        ((0,), [[2, 0, 1], [2, 0, 1], [1, 0, 1], [0, 0, 0]])
    """
    part_of = schedule.placement.stage_part
    profile = []
    for row in schedule.actions:
        parts = tuple(sorted({part_of[stage] for stage, _, _ in row}))
        column = {p: k for k, p in enumerate(parts)}
        counts = [0] * (2 * len(parts))  # held of each part, then stashed of each part
        states: list[list[int]] = []
        for stage, op, _ in row:
            k = column[part_of[stage]]
            if op is Op.F:
                counts[k] += 1
            elif op is Op.B or op is Op.I:
                states.append(counts + [1])  # the forwards before it are all counted: no need to record them
                counts[k] -= 1
                if op is Op.I:
                    counts[k + len(parts)] += 1
                    states.append(counts + [0])
            elif op is Op.W:
                counts[k + len(parts)] -= 1
        states.append(counts + [0])  # forwards with no backward after them (none in a whole step)
        profile.append((parts, np.array(states, dtype=np.int64).reshape(len(states), 2 * len(parts) + 1)))
    return tuple(profile)


def peaks(profile: Profile, *, held: Sequence[float], stash: Sequence[float], during: float) -> tuple[float, ...]:
    """Per rank, the peak bytes under these sizes (per microbatch of each part, held and stashed, and one
    replayed block).

    Example:
        >>> from pipeweave.schedule import generate
        >>> peaks(activation_profile(generate("1f1b", num_stages=2, num_microbatches=3)), held=(1.0, 2.0),
        ...       stash=(0.5, 1.0), during=0.25)
        (2.25, 2.25)
    """
    out = []
    for parts, states in profile:
        weights = np.array([*(held[p] for p in parts), *(stash[p] for p in parts), during])
        out.append(round(float(max(0.0, (states @ weights).max())), 9))
    return tuple(out)
