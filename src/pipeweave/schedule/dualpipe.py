"""DualPipe (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024) and DualPipeV (DeepSeek's DualPipe repository).

Both follow the eight phases of DeepSeek's reference ``DualPipe.step``; per
rank, with "phase 0" the stage nearer the start of its pipeline and "phase 1"
the other stage on the rank, n the half depth, h the rank's distance from
the nearer end and C the microbatches per phase::

    1. 2(n-h-1) x F0            warm-up of phase 0
    2. (h+1)    x F0 F1
    3. (n-h-1)  x I1 W1 F1       split backward fills the gap
    4. (C-2n+h+1) x F0 B1 F1 B0  steady state (DeepSeek overlaps F&B pairs)
    5. (n-h-1)  x B1 F1 B0
    6. (h+1)    x B1 B0          from the middle on, B becomes I (W deferred)
    7. (n-h-1)  x W I0
    8. (h+1)    x W              deferred W in FIFO order

- ``dualpipe``: ``Placement.bidirectional`` (2 M_theta per rank), D even,
  n = D/2, h = min(r, D-1-r), C = T/2: microbatches 0..C-1 go down from rank
  0, C..T-1 go up from rank D-1.
- ``dualpipe-v``: ``Placement.vshape`` (2 chunks per rank, M_theta per rank),
  n = D, h = r, C = T: every microbatch goes down the ranks and back up.

The order of compute is DeepSeek's action for action (tests/schedule/
test_dualpipe_reference.py holds the reference's order transcribed by hand).
DeepSeek runs the F and B of steps 4 and 5 as one overlapped ``F&B`` call
(all of them but the first F0 B1 of the middle ranks); ``dualpipe_pairs`` and
``dualpipe_v_pairs`` name those pairs, and both generators make them the
schedule's F&B pairs (``Schedule.pairs``) unless ``overlap_fb=False``: the
order is the same either way, the pairs say which communication may move
while the other half computes (docs/guide/dualpipe.md, "F&B overlap").

Idle time (docs/guide/dualpipe.md derives it). With F, I, W the times of one
stage's forward, input-gradient and weight-gradient (B = I + W), PP the
stages of one pipeline (D for dualpipe, 2D for dualpipe-v, so n = PP/2) and
no communication time, the simulator gives every rank, over the widest span,

    idle = (PP/2 - 1)(F + B - 2W)       whenever W <= I <= F <= B,

for any T the generator accepts, and never less at other ratios. DeepSeek's
table gives (PP/2 - 1)(F&B + B - 3W); read with F&B = F + B (no overlap) that
is the simulated idle plus (PP/2 - 1)(B - W), one input-gradient time per hop.
Peak activations: D + 1 microbatches on every rank for dualpipe (DeepSeek's
PP + 1), D + 1/2 M_a for dualpipe-v (2D + 1 chunk activations of M_a/2).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from pipeweave.schedule.ir import (
    Action,
    Op,
    Placement,
    Schedule,
    ScheduleError,
    append_updates,
    check_positive,
)

# One step of the program: (phase, op), op F, B, I, or W (phase ignored for W).
Step = tuple[int, Op]


def deepseek_program(half: int, h: int, per_phase: int) -> list[Step]:
    """The (phase, op) sequence of one rank of DeepSeek's DualPipe step.

    Args:
        half: n, half the pipeline depth (D/2 for DualPipe, D for DualPipeV).
        h: the rank's position, 0 <= h < n.
        per_phase: C, microbatches through each of the rank's two stages.

    Example:
        >>> [f"{op}{p}" for p, op in deepseek_program(1, 0, 2)]
        ['F0', 'F1', 'F0', 'B1', 'F1', 'B0', 'B1', 'I0', 'W0']
    """
    rest = half - h - 1
    steps: list[Step] = [(0, Op.F)] * (2 * rest)
    steps += [(0, Op.F), (1, Op.F)] * (h + 1)
    steps += [(1, Op.I), (1, Op.W), (1, Op.F)] * rest
    steps += [(0, Op.F), (1, Op.B), (1, Op.F), (0, Op.B)] * (per_phase - 2 * half + h + 1)
    steps += [(1, Op.B), (1, Op.F), (0, Op.B)] * rest
    split = False  # DeepSeek switches to split backward half way through phase 6
    for i in range(h + 1):
        split = split or (i == (h + 1) // 2 and h % 2 == 1)
        steps.append((1, Op.I if split else Op.B))
        split = split or (i == (h + 1) // 2 and h % 2 == 0)
        steps.append((0, Op.I if split else Op.B))
    steps += [(0, Op.W), (0, Op.I)] * rest
    steps += [(0, Op.W)] * (h + 1)
    return steps


def deepseek_pairs(half: int, h: int, per_phase: int) -> list[tuple[int, int]]:
    """The steps of ``deepseek_program`` that DeepSeek runs as one overlapped ``F&B``, as (F, B) indices.

    Steps 4 and 5 call ``_forward_backward_chunk`` for F0 B1 and F1 B0 (step 4) and F1 B0
    (step 5); the middle ranks (h = n - 1) run their first F0 and B1 one after the other
    ("to further reduce bubble size", DeepSeek's note).

    Example:
        >>> deepseek_pairs(1, 0, 2)  # F0 F1 [F0 B1] [F1 B0] B1 I0 W0; the first pair runs apart
        [(4, 5)]
    """
    rest = half - h - 1
    start = 2 * rest + 2 * (h + 1) + 3 * rest
    main = per_phase - 2 * half + h + 1
    pairs = []
    for i in range(main):
        k = start + 4 * i
        if i > 0 or h < half - 1:
            pairs.append((k, k + 1))
        pairs.append((k + 2, k + 3))
    k = start + 4 * main
    pairs += [(k + 3 * i + 1, k + 3 * i + 2) for i in range(rest)]
    return pairs


Pairs = tuple[tuple[tuple[int, int], ...], ...]


def dualpipe_pairs(num_stages: int, num_microbatches: int) -> Pairs:
    """Per rank of ``dualpipe``, the (F, B) positions in ``Schedule.actions[rank]`` DeepSeek overlaps as ``F&B``.

    Args:
        num_stages: D, as for ``dualpipe``.
        num_microbatches: T, as for ``dualpipe``.

    Raises:
        ScheduleError: sizes ``dualpipe`` refuses.

    Example:
        >>> dualpipe_pairs(2, 4)  # both ranks are middle ranks: 0F0 3F2 0F1 3B2 [3F3 0B0] 3B3 0I1 0W1
        (((4, 5),), ((4, 5),))
    """
    _check_depth("dualpipe", num_stages, num_microbatches, even=True)
    d, half, per_phase = num_stages, num_stages // 2, num_microbatches // 2
    return tuple(tuple(deepseek_pairs(half, min(r, d - 1 - r), per_phase)) for r in range(d))


def dualpipe_v_pairs(num_stages: int, num_microbatches: int) -> Pairs:
    """``dualpipe_pairs`` for ``dualpipe-v`` (its D and T, and the sizes it refuses).

    Example:
        >>> dualpipe_v_pairs(1, 2)  # one rank: 0F0 1F0 0F1 1B0 [1F1 0B0] 1B1 0I1 0W1
        (((4, 5),),)
    """
    _check_depth("dualpipe-v", num_stages, num_microbatches, even=False)
    return tuple(tuple(deepseek_pairs(num_stages, r, num_microbatches)) for r in range(num_stages))


def _actions(steps: list[Step], stages: tuple[int, int], microbatches: tuple[range, range]) -> Iterator[Action]:
    """Turn a program into actions: per phase, microbatches in order; W in I order."""
    forward = [iter(m) for m in microbatches]
    backward = [iter(m) for m in microbatches]
    pending: deque[Action] = deque()  # deferred weight gradients, FIFO
    for phase, op in steps:
        if op is Op.W:
            yield Action(pending[0].stage, Op.W, pending.popleft().microbatch)
            continue
        j = next(forward[phase] if op is Op.F else backward[phase])
        a = Action(stages[phase], op, j)
        if op is Op.I:
            pending.append(a)
        yield a


def _check_depth(name: str, num_stages: int, num_microbatches: int, even: bool) -> None:
    check_positive("num_stages", num_stages)
    check_positive("num_microbatches", num_microbatches)
    if even and num_stages % 2:
        raise ScheduleError(
            f"{name} needs an even number of stages, got num_stages={num_stages}; "
            f"use {num_stages + 1} or {max(2, num_stages - 1)}"
        )
    if num_microbatches < 2 * num_stages or (even and num_microbatches % 2):
        need = "an even num_microbatches >= 2 x num_stages" if even else "num_microbatches >= 2 x num_stages"
        raise ScheduleError(
            f"{name} needs {need}, got num_microbatches={num_microbatches} for num_stages={num_stages}; "
            f"use {max(2 * num_stages, num_microbatches + num_microbatches % 2)}"
        )


def _paired(rows: list[list[Action]], pairs: Pairs) -> tuple[tuple[Action, Action], ...]:
    """The F&B pairs of ``rows`` at the positions ``pairs`` gives per rank."""
    return tuple((rows[r][f], rows[r][b]) for r, positions in enumerate(pairs) for f, b in positions)


def dualpipe(num_stages: int, num_microbatches: int, *, overlap_fb: bool = True) -> Schedule:
    """DualPipe: two opposite pipelines, T/2 microbatches each.

    Args:
        num_stages: D, the number of ranks (even).
        num_microbatches: T, even and at least 2D (as DeepSeek's reference requires).
        overlap_fb: run DeepSeek's F&B pairs overlapped (``dualpipe_pairs``); False: one after the other.

    Raises:
        ScheduleError: odd D, odd T or T < 2D.

    Example:
        >>> [str(a) for a in dualpipe(2, 4).actions[0]]
        ['0F0', '3F2', '0F1', '3B2', '3F3', '0B0', '3B3', '0I1', '0W1', '0U0', '3U0']
    """
    _check_depth("dualpipe", num_stages, num_microbatches, even=True)
    d, half = num_stages, num_stages // 2
    per_phase = num_microbatches // 2
    placement = Placement.bidirectional(d)
    down, up = range(per_phase), range(per_phase, num_microbatches)
    rows = []
    for r in range(d):
        h = min(r, d - 1 - r)
        stages, mbs = ((r, 2 * d - 1 - r), (down, up))
        if r >= half:  # phase 0 is the stage nearer the start of its pipeline
            stages, mbs = (stages[1], stages[0]), (up, down)
        rows.append(list(_actions(deepseek_program(half, h, per_phase), stages, mbs)))
    pairs = _paired(rows, dualpipe_pairs(num_stages, num_microbatches)) if overlap_fb else ()
    append_updates(rows, placement)
    pipelines = tuple(int(j >= per_phase) for j in range(num_microbatches))
    return Schedule("dualpipe", placement, num_microbatches, tuple(map(tuple, rows)), pipelines, pairs=pairs)


def dualpipe_v(num_stages: int, num_microbatches: int, *, overlap_fb: bool = True) -> Schedule:
    """DualPipeV: DualPipe cut in half, a V of 2D stages on D ranks.

    Args:
        num_stages: D, the number of ranks.
        num_microbatches: T >= 2D.
        overlap_fb: run DeepSeek's F&B pairs overlapped (``dualpipe_v_pairs``); False: one after the other.

    Raises:
        ScheduleError: T < 2D.

    Example:
        >>> [str(a) for a in dualpipe_v(1, 2).actions[0]]
        ['0F0', '1F0', '0F1', '1B0', '1F1', '0B0', '1B1', '0I1', '0W1', '0U0', '1U0']
    """
    _check_depth("dualpipe-v", num_stages, num_microbatches, even=False)
    d, t = num_stages, num_microbatches
    placement = Placement.vshape(d)
    rows = [list(_actions(deepseek_program(d, r, t), (r, 2 * d - 1 - r), (range(t), range(t)))) for r in range(d)]
    pairs = _paired(rows, dualpipe_v_pairs(d, t)) if overlap_fb else ()
    append_updates(rows, placement)
    return Schedule("dualpipe-v", placement, t, tuple(map(tuple, rows)), pairs=pairs)
