"""Chimera: the survey's closed forms under the paper's conditions, the validator, rejections."""

from __future__ import annotations

import pytest

from pipeweave.schedule import ScheduleError, format_grid, generate, validate
from pipeweave.schedule.chimera import basic_unit, chimera
from pipeweave.schedule.ir import Op
from pipeweave.sim import CostModel, compute_metrics, simulate

EVEN_D = (2, 4, 6, 8)
F_EQ_B = CostModel(f=1.0, b=0.5, w=0.5)  # the paper's figures: a forward as long as a full backward

GOLDEN_D4 = """\
rank 0 | 0F0  0F1  7F2  7B2  7F3  7B3  0B0  0B1  0U0  7U0
rank 1 | 1F0  6F2  1F1  6F3  6B2  1B0  6B3  1B1  1U0  6U0
rank 2 | 5F2  2F0  5F3  2F1  2B0  5B2  2B1  5B3  2U0  5U0
rank 3 | 4F2  4F3  3F0  3B0  3F1  3B1  4B2  4B3  3U0  4U0"""


def test_golden_basic_unit_d4() -> None:
    # The paper's Figure (D = 4): down microbatches 0, 1 from rank 0, up microbatches 2, 3 from rank 3.
    assert format_grid(generate("chimera", num_stages=4, num_microbatches=4)) == GOLDEN_D4


@pytest.mark.parametrize("d", EVEN_D)
def test_bubble_ratio_matches_paper_at_t_equals_d(d: int) -> None:
    m = compute_metrics(simulate(chimera(d, d), F_EQ_B))
    assert m.bubble_ratio == pytest.approx((d - 2) / (2 * d + d - 2), abs=1e-12)
    # Every rank does T forwards and T backwards of one slot each: 2T busy, D-2 idle.
    assert set(m.busy) == {2.0 * d}
    assert max(m.span) == 2 * d + d - 2


@pytest.mark.parametrize("d", EVEN_D)
def test_backward_twice_forward_idles_two_slots_per_bubble(d: int) -> None:
    # At b + w = 2f the same order idles 2(D-2) f per rank (stated in the docstring);
    # a CP-SAT search of all orders found the same optimum for D = 4, 6, 8.
    m = compute_metrics(simulate(chimera(d, d)))
    assert max(m.span) - max(m.busy) == 2 * (d - 2)
    assert m.bubble_ratio == pytest.approx(2 * (d - 2) / (5 * d - 4), abs=1e-12)


@pytest.mark.parametrize("d", EVEN_D)
@pytest.mark.parametrize("units", (2, 3))
def test_concatenated_units_keep_the_unit_ratio(d: int, units: int) -> None:
    m = compute_metrics(simulate(chimera(d, units * d), F_EQ_B))
    assert max(m.span) == units * (3 * d - 2)
    assert m.bubble_ratio == pytest.approx((d - 2) / (3 * d - 2), abs=1e-12)


@pytest.mark.parametrize("d", EVEN_D)
def test_memory_two_weight_copies_and_activation_range(d: int) -> None:
    m = compute_metrics(simulate(chimera(d, 2 * d)))
    assert m.weight_versions == (2.0,) * d
    # Survey: activations between (D/2+1) M_a (end ranks) and D M_a (middle ranks).
    assert m.peak_activations[0] == m.peak_activations[-1] == d // 2 + 1
    assert max(m.peak_activations) == d


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
    [(3, 6, "num_stages=3"), (1, 1, "num_stages=1"), (4, 6, "got 6; use 8"), (4, 2, "got 2; use 4"), (0, 4, "num_stages=0")],
)
def test_rejections_are_one_line(d: int, t: int, needle: str) -> None:
    with pytest.raises(ScheduleError) as info:
        chimera(d, t)
    message = str(info.value)
    assert needle in message and "\n" not in message
