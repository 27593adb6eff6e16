"""ZB-H1 and ZB-H2: the paper's bubble times and per-worker memory, exactly where they hold."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pipeweave.schedule import Schedule, ScheduleError, format_grid, generate, validate
from pipeweave.schedule.ir import Op
from pipeweave.schedule.zero_bubble import zb_h1, zb_h2
from pipeweave.sim import CostModel, compute_metrics, simulate

# (f, b, w): each satisfies w <= f and 2w <= f + b, the conditions of both forms.
COSTS = [(1.0, 1.0, 1.0), (2.0, 2.0, 1.0), (3.0, 2.0, 1.0), (1.0, 1.0, 0.5), (1.0, 0.5, 0.75), (2.0, 1.0, 1.5)]
GRID = [(d, t) for d in range(1, 9) for t in range(1, 25)]

GOLDEN_H1_D3_T4 = """\
rank 0 | 0F0  0F1  0F2  0I0  0W0  0F3  0I1  0W1  0I2  0W2  0I3  0W3  0U0
rank 1 | 1F0  1F1  1I0  1F2  1I1  1W0  1F3  1I2  1W1  1I3  1W2  1W3  1U0
rank 2 | 2F0  2I0  2F1  2I1  2F2  2I2  2W0  2F3  2I3  2W1  2W2  2W3  2U0"""

GOLDEN_H2_D3_T5 = """\
rank 0 | 0F0  0F1  0F2  0F3  0F4  0I0  0W0  0I1  0W1  0I2  0W2  0I3  0W3  0I4  0W4  0U0
rank 1 | 1F0  1F1  1F2  1I0  1F3  1I1  1F4  1I2  1W0  1I3  1W1  1I4  1W2  1W3  1W4  1U0
rank 2 | 2F0  2I0  2F1  2I1  2F2  2I2  2F3  2I3  2F4  2I4  2W0  2W1  2W2  2W3  2W4  2U0"""


Generator = Callable[[int, int], Schedule]
Formula = Callable[[int, float, float, float], float]


def bubble_time(schedule: Schedule, cost: CostModel) -> float:
    """Max over ranks of span - busy (the paper's bubble time)."""
    m = compute_metrics(simulate(schedule, cost, check=False))
    return max(span - busy for span, busy in zip(m.span, m.busy))


def test_golden_pictures() -> None:
    # ZB-H1: rank r warms up with D-r-1 forwards and keeps r W's pending; ZB-H2: 2(D-r)-2 and 2r.
    assert format_grid(generate("zb-h1", num_stages=3, num_microbatches=4)) == GOLDEN_H1_D3_T4
    assert format_grid(generate("zb-h2", num_stages=3, num_microbatches=5)) == GOLDEN_H2_D3_T5


@pytest.mark.parametrize("generator", [zb_h1, zb_h2])
def test_validator_over_the_grid(generator: Generator) -> None:
    for d, t in GRID:
        s = generator(d, t)
        validate(s)
        assert all(a.op is not Op.B for row in s.actions for a in row)  # the backward is always split


@pytest.mark.parametrize(("f", "b", "w"), COSTS)
def test_zb_h1_bubble_time_for_t_at_least_d(f: float, b: float, w: float) -> None:
    cost = CostModel(f=f, b=b, w=w)
    for d, t in GRID:
        if t >= d:
            assert bubble_time(zb_h1(d, t), cost) == pytest.approx((d - 1) * (f + b - w), abs=1e-9), (d, t)


@pytest.mark.parametrize(("f", "b", "w"), COSTS)
def test_zb_h2_bubble_time_for_t_at_least_2d_minus_1(f: float, b: float, w: float) -> None:
    cost = CostModel(f=f, b=b, w=w)
    for d, t in GRID:
        if t >= 2 * d - 1:
            assert bubble_time(zb_h2(d, t), cost) == pytest.approx((d - 1) * (f + b - 2 * w), abs=1e-9), (d, t)


def test_zb_h2_is_bubble_free_at_equal_costs() -> None:
    for d in range(1, 9):
        m = compute_metrics(simulate(zb_h2(d, 2 * d + 3)))
        assert m.bubble_ratio == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize(
    ("generator", "formula", "t_min"),
    [
        (zb_h1, lambda d, f, b, w: (d - 1) * (f + b - w), lambda d: d),
        (zb_h2, lambda d, f, b, w: (d - 1) * (f + b - 2 * w), lambda d: 2 * d - 1),
    ],
)
def test_conditions_are_tight(generator: Generator, formula: Formula, t_min: Callable[[int], int]) -> None:
    # One microbatch fewer, or a W longer than F (or 2w > f + b for ZB-H2), and the form fails.
    for d in range(2, 9):
        tm = t_min(d)
        if tm > 1:
            assert bubble_time(generator(d, tm - 1), CostModel()) > formula(d, 1, 1, 1) + 1e-9
        for f, b, w in [(1.0, 2.0, 1.5), (1.0, 1.0, 2.0)]:  # w > f
            assert bubble_time(generator(d, tm + 2), CostModel(f=f, b=b, w=w)) > formula(d, f, b, w) + 1e-9


def test_zb_h2_clamps_at_zero_when_w_outweighs_half_of_f_plus_b() -> None:
    # w <= f but 2w > f + b: the form would go negative; the schedule simply has no bubble.
    for d in range(2, 9):
        for f, b, w in [(1.0, 0.5, 1.0), (3.0, 0.5, 2.0)]:
            assert (d - 1) * (f + b - 2 * w) < 0
            assert bubble_time(zb_h2(d, 2 * d + 1), CostModel(f=f, b=b, w=w)) == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("mem_w", [0.5, 0.25, 0.0, 1.0])
def test_per_worker_memory_of_the_paper(mem_w: float) -> None:
    # Worker i = r + 1 holds (p-i+1) M_B + (i-1) M_W (ZB-H1), (2p-2i+1) M_B + (2i-2) M_W (ZB-H2).
    cost = CostModel(mem_w=mem_w)
    for d in range(1, 9):
        for t in (2 * d - 1, 2 * d + 5):
            h1 = compute_metrics(simulate(zb_h1(d, t), cost, check=False)).peak_activations
            h2 = compute_metrics(simulate(zb_h2(d, t), cost, check=False)).peak_activations
            assert h1 == pytest.approx([(d - r) + r * mem_w for r in range(d)])
            assert h2 == pytest.approx([(2 * d - 2 * r - 1) + 2 * r * mem_w for r in range(d)])
            assert h1[0] == d and h2[0] == 2 * d - 1


def test_zb_h1_keeps_1f1b_memory_and_beats_its_bubble() -> None:
    for d in range(2, 9):
        t = 2 * d
        zb = compute_metrics(simulate(zb_h1(d, t)))
        base = compute_metrics(simulate(generate("1f1b", num_stages=d, num_microbatches=t)))
        assert zb.peak_activations[0] == base.peak_activations[0] == d
        assert zb.makespan < base.makespan


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
@pytest.mark.parametrize(
    ("d", "t", "needle"), [(0, 4, "num_stages=0"), (4, 0, "num_microbatches=0"), (4, -1, "num_microbatches=-1")]
)
def test_rejections_are_one_line(name: str, d: int, t: int, needle: str) -> None:
    with pytest.raises(ScheduleError, match=needle) as info:
        generate(name, num_stages=d, num_microbatches=t)
    assert "\n" not in str(info.value)
