"""A schedule's activation memory walked once for every cost: per rank, the few states its peak can be in.

``sim.metrics.held_peaks`` walks a rank's actions in order and keeps the peak
of what its microbatches hold (F adds a part's held bytes, I swaps them for
the bytes W still needs, B and W free them, a backward that replays the
forward uses a block more while it runs). Between configurations of one
schedule only those byte sizes change, and the planner's parts are all alike
but the last (which holds the head's logits too). So the walk here records,
per rank, the states where a peak may be, as counts (held on ordinary parts,
stashed on ordinary parts, held on the last, stashed on the last, a replay
running): the peak under any sizes >= 0 is the largest of their weighted sums,
the number ``held_peaks`` finds (tests/planner/test_costs.py), one product of
arrays per configuration instead of a walk.
"""

from __future__ import annotations

import numpy as np

from pipeweave.schedule.ir import Op, Schedule

Profile = tuple["np.ndarray", ...]
"""Per rank, its states: one row of counts (held, stashed, held on the last part, stashed on the last part,
a replay running) per moment its peak may be reached."""


def activation_profile(schedule: Schedule) -> Profile:
    """Per rank, the states of its walk where a peak may be: before each backward (a replay may be running)
    and after the last of a run of forwards or an I (module docstring).

    Example:
        >>> from pipeweave.schedule import generate
        >>> activation_profile(generate("1f1b", num_stages=2, num_microbatches=3))[0].tolist()
        [[2, 0, 0, 0, 1], [2, 0, 0, 0, 1], [1, 0, 0, 0, 1], [0, 0, 0, 0, 0]]
    """
    last = schedule.num_parts - 1
    part_of = schedule.placement.stage_part
    profile = []
    for row in schedule.actions:
        counts = [0, 0, 0, 0]  # held, stashed, held on the last part, stashed on the last part
        states: list[list[int]] = []
        for stage, op, _ in row:
            k = 2 if part_of[stage] == last else 0
            if op is Op.F:
                counts[k] += 1
            elif op is Op.B or op is Op.I:
                states.append(counts + [1])  # the forwards before it are all counted: no need to record them
                counts[k] -= 1
                if op is Op.I:
                    counts[k + 1] += 1
                    states.append(counts + [0])
            elif op is Op.W:
                counts[k + 1] -= 1
        states.append(counts + [0])  # forwards with no backward after them (none in a whole step)
        profile.append(np.array(states, dtype=np.int64))
    return tuple(profile)


def peaks(
    profile: Profile, *, held: float, stash: float, held_last: float, stash_last: float, during: float
) -> tuple[float, ...]:
    """Per rank, the peak bytes under these sizes (per microbatch of the ordinary and the last part, and one
    replayed block).

    Example:
        >>> from pipeweave.schedule import generate
        >>> peaks(activation_profile(generate("1f1b", num_stages=2, num_microbatches=3)), held=1.0, stash=0.5,
        ...       held_last=2.0, stash_last=1.0, during=0.25)
        (2.25, 2.25)
    """
    weights = np.array([held, stash, held_last, stash_last, during])
    return tuple(round(float(max(0.0, (states @ weights).max())), 9) for states in profile)
