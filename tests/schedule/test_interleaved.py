"""Interleaved 1F1B (Megatron-LM): bubble overhead (D-1)/(vT), memory, validator, rejections."""

from __future__ import annotations

import pytest

from pipeweave.schedule import ScheduleError, format_grid, generate, validate
from pipeweave.schedule.interleaved import interleaved_1f1b
from pipeweave.schedule.one_f_one_b import one_f_one_b
from pipeweave.sim import CostModel, compute_metrics, simulate

# (f, b, w) per D-th of the model; each of the v chunks costs a v-th of it.
COSTS = [(1.0, 1.0, 1.0), (1.0, 2.0, 0.0), (2.0, 1.0, 1.0), (1.0, 1.0, 0.5)]

GOLDEN_D2_V2_T4 = """\
rank 0 | 0F0  0F1  2F0  2F1  0F2  2B0  0F3  2B1  2F2  0B0  2F3  0B1  2B2  2B3  0B2  0B3  0U0  2U0
rank 1 | 1F0  1F1  3F0  3B0  3F1  3B1  1F2  1B0  1F3  1B1  3F2  3B2  3F3  3B3  1B2  1B3  1U0  3U0"""


def accepted() -> list[tuple[int, int, int]]:
    """Every (D, T, v) the generator serves on the grid D 1..8, T 1..24, v 1..4."""
    return [(d, t, v) for v in range(1, 5) for d in range(1, 9) for t in range(1, 25) if v == 1 or t % d == 0]


def test_golden_d2_v2_t4() -> None:
    # Megatron's order: microbatches in groups of D, chunk 0 of the group before chunk 1;
    # rank 0 warms up with 2(D-1) + (v-1)D = 4 forwards, rank 1 with 2.
    assert format_grid(generate("interleaved-1f1b", num_stages=2, num_microbatches=4, num_chunks=2)) == GOLDEN_D2_V2_T4


def test_validator_over_the_grid() -> None:
    for d, t, v in accepted():
        validate(interleaved_1f1b(d, t, v))


@pytest.mark.parametrize(("f", "b", "w"), COSTS)
def test_bubble_overhead_is_megatron_closed_form(f: float, b: float, w: float) -> None:
    cost = CostModel(f=f, b=b, w=w)
    for d, t, v in [(d, k * d, v) for d in range(1, 9) for k in (1, 2, 3) for v in (2, 3)]:
        m = compute_metrics(simulate(interleaved_1f1b(d, t, v), cost, check=False))
        assert m.bubble_overhead == pytest.approx((d - 1) / (v * t), abs=1e-9), (d, t, v)


def test_bubble_overhead_on_every_accepted_point_at_unit_costs() -> None:
    for d, t, v in accepted():
        m = compute_metrics(simulate(interleaved_1f1b(d, t, v), check=False))
        assert m.bubble_overhead == pytest.approx((d - 1) / (v * t), abs=1e-9), (d, t, v)
        # Ideal time is T (f + b + w) per rank, the same for every v: chunks cost f/v.
        assert max(m.busy) == pytest.approx(3.0 * t)


@pytest.mark.parametrize(("d", "t", "v"), [(4, 8, 2), (4, 16, 3), (8, 16, 2), (3, 9, 4), (5, 5, 2), (2, 2, 4)])
def test_peak_activations_per_rank(d: int, t: int, v: int) -> None:
    # Rank r holds at most its warm-up + 1 chunk activations, each M_a / v.
    m = compute_metrics(simulate(interleaved_1f1b(d, t, v)))
    expected = [min(2 * (d - r - 1) + (v - 1) * d + 1, v * t) / v for r in range(d)]
    assert m.peak_activations == pytest.approx(expected)
    if 2 * (d - 1) + (v - 1) * d + 1 <= v * t:  # T >= 2D suffices
        assert m.peak_activations[0] == pytest.approx(d + (d - 1) / v)  # Megatron's D (1 + (D-1)/(vD))


def test_one_chunk_is_1f1b() -> None:
    for d in range(1, 6):
        for t in (1, 3, 7):
            assert interleaved_1f1b(d, t, 1).actions == one_f_one_b(d, t).actions


def test_more_chunks_shrink_the_bubble() -> None:
    ratios = [compute_metrics(simulate(interleaved_1f1b(4, 8, v))).bubble_ratio for v in (1, 2, 4)]
    assert ratios[0] > ratios[1] > ratios[2]


@pytest.mark.parametrize(
    ("d", "t", "v", "needle"),
    [
        (4, 6, 2, "num_microbatches=6 is not a multiple of num_stages=4"),
        (3, 7, 3, "use 9 microbatches"),
        (4, 8, 0, "num_chunks=0"),
        (0, 8, 2, "num_stages=0"),
        (4, 0, 2, "num_microbatches=0"),
    ],
)
def test_rejections_are_one_line(d: int, t: int, v: int, needle: str) -> None:
    with pytest.raises(ScheduleError, match=needle) as info:
        interleaved_1f1b(d, t, v)
    assert "\n" not in str(info.value)


def test_registry_passes_chunks() -> None:
    s = generate("interleaved-1f1b", num_stages=2, num_microbatches=4, num_chunks=3)
    assert s.num_stages == 6 and s.num_chunks == 3
    assert generate("interleaved-1f1b", num_stages=2, num_microbatches=4).num_chunks == 2


def test_rejected_microbatch_counts_would_deadlock_in_megatrons_order() -> None:
    # Why T must be a multiple of D: the same order with a short last group deadlocks.
    from pipeweave.schedule.interleaved import interleaved_order
    from pipeweave.schedule.ir import Placement, Schedule, append_updates
    from pipeweave.schedule.validate import is_valid

    rows = [interleaved_order(r, 5, 7, 2) for r in range(5)]
    placement = Placement.looped(5, 2)
    append_updates(rows, placement)
    assert not is_valid(Schedule("interleaved-1f1b", placement, 7, tuple(map(tuple, rows))))
