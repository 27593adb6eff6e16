"""GEMS (Jain et al., "GEMS: GPU-Enabled Memory-Aware Model-Parallelism System for Distributed DNN Training", SC'20).

GEMS's memory-aware synchronous training (MAST) keeps two mirrored replicas of
the model on the D ranks (``Placement.bidirectional``): replica 1 runs parts
0..D-1 on ranks 0..D-1, replica 2 on ranks D-1..0. Microbatches alternate
between them (even ones on replica 1, the "down" pipeline; odd ones on
replica 2, "up"), and each replica has at most one microbatch in flight:
replica 2's forward of microbatch 2k+1 follows replica 1's backward of 2k up
the ranks, and replica 1's next forward follows replica 2's backward down.
Every rank therefore runs, per pair of microbatches::

    F(2k) B(2k) F(2k+1) B(2k+1)        (down stage, then up stage)

and holds one microbatch of activations (M_a) at a time.

Closed forms (the survey's Table 3) and when the simulator reproduces them.
With f forward and B = b + w full-backward time per stage, B >= f and no
communication, a pair of microbatches repeats every P = 2(D B + f); the
update of a part waits for both replicas' gradients (all-reduce), so every
step spans the makespan

    T even: (T/2) P + (D-1) f        T odd: ((T-1)/2) P + D (f + B)

and the bubble ratio is 1 - T (f + B) / makespan. Per pair in steady state
that is (D-1) B / (D B + f): at the survey's B = 2f exactly (D-1)/(D+1/2),
which the step's ratio approaches as T grows (the survey's "~"). Weights
2 M_theta per rank; activations M_a per rank.

Any D >= 1 and T >= 1 are accepted.
"""

from __future__ import annotations

from pipeweave.schedule.ir import Action, Op, Placement, Schedule, append_updates, check_positive


def gems(num_stages: int, num_microbatches: int) -> Schedule:
    """Two mirrored replicas, one microbatch in flight per replica.

    Args:
        num_stages: D, the number of ranks.
        num_microbatches: T; microbatch j takes replica j mod 2.

    Raises:
        ScheduleError: D or T below 1.

    Example:
        >>> [str(a) for a in gems(2, 2).actions[0]]
        ['0F0', '0B0', '3F1', '3B1', '0U0', '3U0']
    """
    check_positive("num_stages", num_stages)
    check_positive("num_microbatches", num_microbatches)
    d = num_stages
    placement = Placement.bidirectional(d)
    rows: list[list[Action]] = []
    for r in range(d):
        down, up = r, 2 * d - 1 - r  # the two stages on rank r
        row = []
        for j in range(num_microbatches):
            stage = down if j % 2 == 0 else up
            row += [Action(stage, Op.F, j), Action(stage, Op.B, j)]
        rows.append(row)
    append_updates(rows, placement)
    pipelines = tuple(j % 2 for j in range(num_microbatches))
    return Schedule("gems", placement, num_microbatches, tuple(map(tuple, rows)), pipelines)
