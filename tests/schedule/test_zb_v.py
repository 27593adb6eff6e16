"""ZB-V: zero bubble at f = b = w for T >= 2D-1, D M_a on every rank, validator, rejections."""

from __future__ import annotations

import pytest

from pipeweave.schedule import ScheduleError, format_grid, generate, validate
from pipeweave.schedule.zb_v import zb_v
from pipeweave.sim import CostModel, compute_metrics, simulate

# D = 2: rank 0 holds stages 0 (down) and 3 (up, the loss); rank 1 holds 1 and 2.
GOLDEN_D2_T3 = """\
rank 0 | 0F0  0F1  0F2  3F0  3I0  3W0  3F1  3I1  3W1  0I0  0W0  3F2  3I2  3W2  0I1  0W1  0I2  0W2  0U0  3U0
rank 1 | 1F0  2F0  1F1  2F1  2I0  2W0  1F2  1I0  1W0  2F2  2I1  2W1  1I1  2I2  1I2  1W1  2W2  1W2  1U0  2U0"""


def test_golden_d2_t3() -> None:
    # Phases of rank r: 2(D-r)-1 F0; r x (F1 F0); D-r x (F1 I1 W1); steady F0 I0 W0 F1 I1 W1; drain.
    assert format_grid(generate("zb-v", num_stages=2, num_microbatches=3)) == GOLDEN_D2_T3


def test_validator_over_the_grid() -> None:
    for d in range(1, 9):
        for t in range(1, 25):
            s = zb_v(d, t)
            validate(s)
            assert s.num_chunks == 2 and s.num_stages == 2 * d


def test_zero_bubble_at_equal_costs() -> None:
    for d in range(1, 9):
        for t in range(2 * d - 1, 25):
            m = compute_metrics(simulate(zb_v(d, t), check=False))
            # Every rank is busy from its first action to its last: T x 2 chunks x (f+b+w)/2.
            assert m.span == pytest.approx(m.busy, abs=1e-9)
            assert m.busy == pytest.approx((3.0 * t,) * d)
            assert m.bubble_ratio == pytest.approx(0.0, abs=1e-12)


def test_below_2d_minus_1_microbatches_there_is_a_bubble() -> None:
    for d in range(2, 9):
        m = compute_metrics(simulate(zb_v(d, 2 * d - 2)))
        assert m.bubble_ratio > 1e-6


@pytest.mark.parametrize("mem_w", [0.5, 0.0, 1.0])
def test_peak_activations_d_on_every_rank(mem_w: float) -> None:
    # Each of the 2D parts holds M_a / 2 per microbatch; 2D of them in flight make D M_a.
    for d in range(1, 9):
        for t in (2 * d - 1, 3 * d + 1):
            m = compute_metrics(simulate(zb_v(d, t), CostModel(mem_w=mem_w), check=False))
            assert m.peak_activations == pytest.approx((float(d),) * d)


def test_beats_zb_h1_at_the_same_memory() -> None:
    for d in range(2, 9):
        t = 2 * d
        v = compute_metrics(simulate(zb_v(d, t)))
        h1 = compute_metrics(simulate(generate("zb-h1", num_stages=d, num_microbatches=t)))
        assert v.peak_activations[0] == h1.peak_activations[0] == d
        assert max(v.span) < max(h1.span)


@pytest.mark.parametrize(
    ("d", "t", "chunks", "needle"),
    [(0, 4, None, "num_stages=0"), (4, 0, None, "num_microbatches=0"), (4, 8, 3, "--chunks 3")],
)
def test_rejections_are_one_line(d: int, t: int, chunks: int | None, needle: str) -> None:
    with pytest.raises(ScheduleError, match=needle) as info:
        generate("zb-v", num_stages=d, num_microbatches=t, num_chunks=chunks)
    assert "\n" not in str(info.value)
