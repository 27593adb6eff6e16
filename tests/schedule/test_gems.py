"""GEMS: exact step closed form, the survey's (D-1)/(D+1/2), memory, the validator."""

from __future__ import annotations

import pytest

from pipeweave.schedule import ScheduleError, format_grid, generate, validate
from pipeweave.schedule.gems import gems
from pipeweave.sim import CostModel, compute_metrics, simulate

GOLDEN_D3 = """\
rank 0 | 0F0  0B0  5F1  5B1  0F2  0B2  5F3  5B3  0U0  5U0
rank 1 | 1F0  1B0  4F1  4B1  1F2  1B2  4F3  4B3  1U0  4U0
rank 2 | 2F0  2B0  3F1  3B1  2F2  2B2  3F3  3B3  2U0  3U0"""


def expected_makespan(d: int, t: int, f: float, full_b: float) -> float:
    """Hand-derived in gems.py: a pair every P = 2(D B + f)."""
    period = 2 * (d * full_b + f)
    if t % 2 == 0:
        return t // 2 * period + (d - 1) * f
    return (t - 1) // 2 * period + d * (f + full_b)


def test_golden_d3() -> None:
    assert format_grid(generate("gems", num_stages=3, num_microbatches=4)) == GOLDEN_D3


@pytest.mark.parametrize(("f", "b", "w"), [(1, 1, 1), (1, 2, 1), (2, 2, 1), (1, 0.5, 0.5)])
def test_step_closed_form_over_the_grid(f: float, b: float, w: float) -> None:
    # The closed form needs B = b + w >= f (a forward trails the other replica's backward).
    cost, full_b = CostModel(f=f, b=b, w=w), b + w
    for d in range(1, 9):
        for t in range(1, 25):
            m = compute_metrics(simulate(gems(d, t), cost))
            makespan = expected_makespan(d, t, f, full_b)
            assert max(m.span) == pytest.approx(makespan), (d, t)
            assert m.bubble_ratio == pytest.approx(1 - t * (f + full_b) / makespan, abs=1e-12), (d, t)


@pytest.mark.parametrize("d", range(1, 9))
def test_survey_ratio_per_pair_at_backward_twice_forward(d: int) -> None:
    # At b + w = 2f one more pair of microbatches adds exactly 2(f + B) of work per rank
    # and 1 / (1 - (D-1)/(D+1/2)) times that in time: the survey's (D-1)/(D+1/2).
    a, b = (compute_metrics(simulate(gems(d, t))) for t in (8, 10))
    added_time = b.makespan - a.makespan
    added_busy = b.busy[0] - a.busy[0]
    assert 1 - added_busy / added_time == pytest.approx((d - 1) / (d + 0.5), abs=1e-12)
    # and the step's ratio approaches it from above as T grows
    assert b.bubble_ratio > (d - 1) / (d + 0.5) - 1e-12


@pytest.mark.parametrize("d", range(1, 9))
def test_memory(d: int) -> None:
    m = compute_metrics(simulate(gems(d, 7)))
    assert m.peak_activations == (1.0,) * d  # one microbatch in flight per rank
    assert m.weight_versions == (2.0,) * d


def test_validator_over_the_grid() -> None:
    for d in range(1, 9):
        for t in range(1, 25):
            validate(gems(d, t))


@pytest.mark.parametrize(("d", "t", "needle"), [(0, 4, "num_stages=0"), (2, 0, "num_microbatches=0")])
def test_rejections_are_one_line(d: int, t: int, needle: str) -> None:
    with pytest.raises(ScheduleError) as info:
        gems(d, t)
    assert needle in str(info.value) and "\n" not in str(info.value)
