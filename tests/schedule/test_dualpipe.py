"""DualPipe and DualPipeV: DeepSeek's program, exact bubbles at f = b = w, memory, rejections."""

from __future__ import annotations

import pytest

from pipeweave.schedule import ScheduleError, format_grid, generate, validate
from pipeweave.schedule.dualpipe import deepseek_program, dualpipe, dualpipe_v
from pipeweave.schedule.ir import Op
from pipeweave.sim import CostModel, compute_metrics, simulate

GOLDEN_DUALPIPE = """\
rank 0 | 0F0  0F1  0F2  7F4  7I4  7W4  7F5  0F3  7B5  7F6  0B0  7B6  7F7  0B1  7B7  0I2  0W2  0I3  0W3  0U0  7U0
rank 1 | 1F0  6F4  1F1  6F5  1F2  6B4  6F6  1B0  1F3  6B5  6F7  1B1  6B6  1B2  6I7  1I3  6W7  1W3  1U0  6U0
rank 2 | 5F4  2F0  5F5  2F1  5F6  2B0  2F2  5B4  5F7  2B1  2F3  5B5  2B2  5B6  2I3  5I7  2W3  5W7  2U0  5U0
rank 3 | 4F4  4F5  4F6  3F0  3I0  3W0  3F1  4F7  3B1  3F2  4B4  3B2  3F3  4B5  3B3  4I6  4W6  4I7  4W7  3U0  4U0"""

GOLDEN_DUALPIPE_V = """\
rank 0 | 0F0  0F1  0F2  3F0  3I0  3W0  3F1  0F3  3B1  3F2  0B0  3B2  3F3  0B1  3B3  0I2  0W2  0I3  0W3  0U0  3U0
rank 1 | 1F0  2F0  1F1  2F1  1F2  2B0  2F2  1B0  1F3  2B1  2F3  1B1  2B2  1B2  2I3  1I3  2W3  1W3  1U0  2U0"""


def dualpipe_grid() -> list[tuple[int, int]]:
    return [(d, t) for d in range(2, 9, 2) for t in range(2 * d, 25, 2)]


def dualpipe_v_grid() -> list[tuple[int, int]]:
    return [(d, t) for d in range(1, 9) for t in range(2 * d, 25)]


def test_golden_pictures() -> None:  # the order; tests/schedule/test_overlap_fb.py draws it with its F&B pairs
    assert format_grid(generate("dualpipe", num_stages=4, num_microbatches=8, overlap_fb=False)) == GOLDEN_DUALPIPE
    assert format_grid(generate("dualpipe-v", num_stages=2, num_microbatches=4, overlap_fb=False)) == GOLDEN_DUALPIPE_V


def test_program_follows_deepseeks_eight_phases() -> None:
    # Hand-expanded from DeepSeek's DualPipe.step for n = 2, C = 4 (W's phase is not used).
    ops = lambda steps: [f"{op}{p}" if op is not Op.W else "W" for p, op in steps]  # noqa: E731
    assert ops(deepseek_program(2, 0, 4)) == (
        "F0 F0 | F0 F1 | I1 W F1 | F0 B1 F1 B0 | B1 F1 B0 | B1 I0 | W I0 | W".replace("| ", "").split()
    )
    assert ops(deepseek_program(2, 1, 4)) == (
        "F0 F1 F0 F1 | F0 B1 F1 B0 F0 B1 F1 B0 | B1 B0 I1 I0 | W W".replace("| ", "").split()
    )


@pytest.mark.parametrize("f", (1.0, 2.0))
def test_dualpipe_bubble_at_uniform_costs(f: float) -> None:
    cost = CostModel(f=f, b=f, w=f)
    for d, t in dualpipe_grid():
        m = compute_metrics(simulate(dualpipe(d, t), cost))
        assert set(m.busy) == {3 * t * f}
        idle = max(m.span) - m.busy[0]
        # Half of DeepSeek's (D/2-1)(F&B + B - 3W) read with F&B = F + B = 3f, B = 2f, W = f.
        assert idle == pytest.approx((d / 2 - 1) * f) == pytest.approx((d / 2 - 1) * (3 * f + 2 * f - 3 * f) / 2)
        assert m.bubble_ratio == pytest.approx((d - 2) / (6 * t + d - 2), abs=1e-12), (d, t)


@pytest.mark.parametrize("f", (1.0, 2.0))
def test_dualpipe_v_bubble_at_uniform_costs(f: float) -> None:
    cost = CostModel(f=f, b=f, w=f)
    for d, t in dualpipe_v_grid():
        m = compute_metrics(simulate(dualpipe_v(d, t), cost))
        assert m.busy == pytest.approx((3 * t * f,) * d)  # 2 chunks of f/2 per microbatch
        assert max(m.span) - m.busy[0] == pytest.approx((d - 1) * f / 2), (d, t)
        assert m.bubble_ratio == pytest.approx((d - 1) / (6 * t + d - 1), abs=1e-12), (d, t)


def test_memory() -> None:
    for d, t in [(2, 4), (4, 10), (6, 12), (8, 20)]:
        m = compute_metrics(simulate(dualpipe(d, t)))
        assert m.weight_versions == (2.0,) * d
        assert max(m.peak_activations) == d + 1  # DeepSeek's PP + 1
        v = compute_metrics(simulate(dualpipe_v(d, t)))
        assert v.weight_versions == (1.0,) * d
        assert max(v.peak_activations) == d + 0.5  # 2D + 1 chunks of M_a / 2


def test_split_backward_is_used() -> None:
    for s in (dualpipe(4, 8), dualpipe_v(3, 6)):
        ops = {a.op for row in s.actions for a in row}
        assert {Op.I, Op.W, Op.B} <= ops


def test_validator_over_the_grid() -> None:
    for d, t in dualpipe_grid():
        validate(dualpipe(d, t))
    for d, t in dualpipe_v_grid():
        validate(dualpipe_v(d, t))


@pytest.mark.parametrize(
    ("name", "d", "t", "needle"),
    [
        ("dualpipe", 3, 8, "num_stages=3"),
        ("dualpipe", 4, 7, "num_microbatches=7"),
        ("dualpipe", 4, 6, "use 8"),
        ("dualpipe-v", 3, 5, "use 6"),
        ("dualpipe-v", 0, 5, "num_stages=0"),
    ],
)
def test_rejections_are_one_line(name: str, d: int, t: int, needle: str) -> None:
    with pytest.raises(ScheduleError) as info:
        generate(name, num_stages=d, num_microbatches=t)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_registry_chunks() -> None:
    assert generate("dualpipe-v", num_stages=2, num_microbatches=4, num_chunks=2).num_chunks == 2
    with pytest.raises(ScheduleError):
        generate("dualpipe", num_stages=2, num_microbatches=4, num_chunks=2)
