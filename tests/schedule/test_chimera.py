"""Chimera: the survey's closed forms under the paper's conditions, overlapped units, the validator, rejections."""

from __future__ import annotations

import pytest

from pipeweave.schedule import ScheduleError, format_grid, generate, validate
from pipeweave.schedule.chimera import basic_unit, chimera
from pipeweave.schedule.ir import Op
from pipeweave.sim import CostModel, compute_metrics, simulate

EVEN_D = (2, 4, 6, 8)
UNITS = (1, 2, 3, 4)
F_EQ_B = CostModel(f=1.0, b=0.5, w=0.5)  # the paper's figures: a forward as long as a full backward

GOLDEN_D4 = """\
rank 0 | 0F0  0F1  7F2  7B2  7F3  7B3  0B0  0B1  0U0  7U0
rank 1 | 1F0  6F2  1F1  6F3  6B2  1B0  6B3  1B1  1U0  6U0
rank 2 | 5F2  2F0  5F3  2F1  2B0  5B2  2B1  5B3  2U0  5U0
rank 3 | 4F2  4F3  3F0  3B0  3F1  3B1  4B2  4B3  3U0  4U0"""

# Two units, D = 4: unit 1 (microbatches 4..7) fills unit 0's idle slots, e.g. 0F4 in
# rank 0's third slot, 4F6 in rank 3's, 1F4 and 5F6 where unit 0 had nothing ready.
GOLDEN_D4_T8 = """\
rank 0 | 0F0  0F1  0F4  7F2  7B2  7F3  7B3  0B0  0F5  0B1  7F6  7B6  7F7  7B7  0B4  0B5  0U0  7U0
rank 1 | 1F0  6F2  1F1  6F3  6B2  1B0  6B3  1B1  1F4  6F6  1F5  6F7  6B6  1B4  6B7  1B5  1U0  6U0
rank 2 | 5F2  2F0  5F3  2F1  2B0  5B2  2B1  5B3  5F6  2F4  5F7  2F5  2B4  5B6  2B5  5B7  2U0  5U0
rank 3 | 4F2  4F3  4F6  3F0  3B0  3F1  3B1  4B2  4F7  4B3  3F4  3B4  3F5  3B5  4B6  4B7  3U0  4U0"""


def test_golden_basic_unit_d4() -> None:
    # The paper's Figure (D = 4): down microbatches 0, 1 from rank 0, up microbatches 2, 3 from rank 3.
    assert format_grid(generate("chimera", num_stages=4, num_microbatches=4)) == GOLDEN_D4


def test_golden_two_units_d4() -> None:
    assert format_grid(generate("chimera", num_stages=4, num_microbatches=8)) == GOLDEN_D4_T8


@pytest.mark.parametrize("d", EVEN_D)
@pytest.mark.parametrize("units", UNITS)
def test_bubble_ratio_matches_paper_for_every_t(d: int, units: int) -> None:
    t = units * d
    m = compute_metrics(simulate(chimera(d, t), F_EQ_B))
    # Every rank does T forwards and T backwards of one slot each: 2T busy, D-2 idle, whatever T.
    assert set(m.busy) == {2.0 * t}
    assert max(m.span) == 2 * t + d - 2
    assert m.bubble_ratio == pytest.approx((d - 2) / (2 * t + d - 2), abs=1e-12)


@pytest.mark.parametrize("d", EVEN_D)
def test_bubble_ratio_falls_with_t(d: int) -> None:
    for costs in (F_EQ_B, CostModel()):
        ratios = [compute_metrics(simulate(chimera(d, k * d), costs)).bubble_ratio for k in UNITS]
        if d == 2:
            assert ratios == [0.0] * len(UNITS)
        else:
            assert all(a > b for a, b in zip(ratios, ratios[1:])), ratios


@pytest.mark.parametrize("d", EVEN_D)
@pytest.mark.parametrize("units", UNITS)
def test_backward_twice_forward_reopens_gaps_between_units(d: int, units: int) -> None:
    # At b + w = 2f (stated in the docstring): 2(D-2) f idle per rank for one unit
    # (a CP-SAT search of all orders found the same optimum for D = 4, 6, 8), then
    # (D-2) k + D - 3 for k >= 2 units; nothing for D = 2.
    t = units * d
    m = compute_metrics(simulate(chimera(d, t)))
    assert set(m.busy) == {3.0 * t}
    if d == 2:
        idle = 0
    elif units == 1:
        idle = 2 * (d - 2)
    else:
        idle = (d - 2) * units + d - 3
    assert max(m.span) - 3 * t == idle
    assert m.bubble_ratio == pytest.approx(idle / (3 * t + idle), abs=1e-12)


@pytest.mark.parametrize("d", EVEN_D)
def test_later_units_never_delay_earlier_ones(d: int) -> None:
    # Unit-first priority: unit 0 runs at the same times alone and with two units behind it.
    def times(t: int) -> dict[str, tuple[float, float]]:
        timeline = simulate(chimera(d, t), F_EQ_B)
        return {
            str(e.action): (e.start, e.end)
            for row in timeline.events
            for e in row
            if e.action.op in (Op.F, Op.B) and e.action.microbatch < d
        }

    assert times(3 * d) == times(d)


@pytest.mark.parametrize("d", EVEN_D)
def test_memory_two_weight_copies_and_activation_range(d: int) -> None:
    one = compute_metrics(simulate(chimera(d, d)))
    # Survey: activations between (D/2+1) M_a (end ranks) and D M_a (middle ranks).
    assert one.peak_activations[0] == one.peak_activations[-1] == d // 2 + 1
    assert max(one.peak_activations) == d
    for units in (2, 3, 4):
        m = compute_metrics(simulate(chimera(d, units * d)))
        assert m.weight_versions == (2.0,) * d
        # The fill lifts the end ranks to the paper's upper bound D, never beyond.
        assert m.peak_activations == (float(d),) * d


def test_basic_unit_routes_half_the_microbatches_each_way() -> None:
    s = chimera(4, 8)
    assert s.microbatch_pipeline == (0, 0, 1, 1, 0, 0, 1, 1)
    for row in basic_unit(6):
        assert sum(a.op is Op.F for a in row) == sum(a.op is Op.B for a in row) == 6


def test_validator_over_the_grid() -> None:
    for d in range(1, 9):
        for t in range(1, 25):
            if d % 2 == 0 and t % d == 0:
                validate(chimera(d, t))


@pytest.mark.parametrize(
    ("d", "t", "needle"),
    [
        (3, 6, "num_stages=3"),
        (1, 1, "num_stages=1"),
        (4, 6, "got 6; use 8"),
        (4, 2, "got 2; use 4"),
        (0, 4, "num_stages=0"),
    ],
)
def test_rejections_are_one_line(d: int, t: int, needle: str) -> None:
    with pytest.raises(ScheduleError) as info:
        chimera(d, t)
    message = str(info.value)
    assert needle in message and "\n" not in message
