"""DualPipe's and DualPipeV's simulated idle time against DeepSeek's table, (PP/2-1)(F&B + B - 3W).

docs/guide/dualpipe.md derives what the simulator gives: with F, I, W one stage's times
(B = I + W), PP the stages of one pipeline and no communication time, every rank idles
(PP/2 - 1)(F + B - 2W) over the widest span whenever W <= I <= F <= B, and never less
otherwise. DeepSeek's entry, read with F&B = F + B (pipeweave does not overlap the pair
yet), is that plus (PP/2 - 1)(B - W). Costs are small integers and halves, so every sum is
exact in floating point and the comparisons below are equalities.
"""

from __future__ import annotations

import pytest

from pipeweave.schedule.dualpipe import dualpipe, dualpipe_v
from pipeweave.sim import CostModel, compute_metrics, simulate

# (f, b, w) with W <= I <= F <= B = I + W, and ratios outside that region.
INSIDE = [(1, 1, 1), (2, 1, 1), (2, 2, 1), (3, 2, 1), (3, 2, 2), (3, 3, 1), (4, 3, 2), (5, 3, 2), (4, 4, 3)]
OUTSIDE = [(1, 2, 1), (1, 1, 2), (3, 1, 1), (4, 2, 1), (2, 3, 1), (1, 3, 2), (5, 1, 3)]


def cases() -> list[tuple[str, int, int]]:
    """(name, D, T): several depths, each at the fewest microbatches allowed and more."""
    pipe = [("dualpipe", d, t) for d in (2, 4, 6, 8) for t in (2 * d, 2 * d + 2, 3 * d)]
    return pipe + [("dualpipe-v", d, t) for d in (1, 2, 3, 4, 5) for t in (2 * d, 2 * d + 1, 3 * d)]


def deepseek_bubble(pp: int, f_and_b: float, b: float, w: float) -> float:
    """DeepSeek-V3's Table 2 (and the DualPipe README): (PP/2 - 1)(F&B + B - 3W)."""
    return (pp / 2 - 1) * (f_and_b + b - 3 * w)


def simulated(
    name: str, d: int, t: int, f: float, b: float, w: float
) -> tuple[float, int, float, float, float, list[float]]:
    """Idle over the widest span, PP, one stage's F, I, W, and each rank's idle within its own span."""
    schedule = (dualpipe if name == "dualpipe" else dualpipe_v)(d, t)
    m = compute_metrics(simulate(schedule, CostModel(f=f, b=b, w=w)))
    assert len(set(m.busy)) == 1  # every rank does the same work
    chunks = 1 if name == "dualpipe" else 2  # a dualpipe-v rank holds two stages, each half its costs
    pp = d if name == "dualpipe" else 2 * d
    own_idle = [m.span[r] - m.busy[r] for r in range(d)]
    return max(m.span) - m.busy[0], pp, f / chunks, b / chunks, w / chunks, own_idle


@pytest.mark.parametrize(("f", "b", "w"), INSIDE)
def test_idle_is_the_derived_form_and_deepseeks_less_one_input_gradient_per_hop(f: int, b: int, w: int) -> None:
    for name, d, t in cases():
        idle, pp, f_s, i_s, w_s, own_idle = simulated(name, d, t, f, b, w)
        b_s = i_s + w_s
        assert idle == (pp / 2 - 1) * (f_s + b_s - 2 * w_s), (name, d, t)
        assert deepseek_bubble(pp, f_s + b_s, b_s, w_s) - idle == (pp / 2 - 1) * i_s, (name, d, t)
        # The derivation's steps: the middle ranks never wait; rank h starts (n-1-h) F before
        # them and ends (n-1-h)(I - W) after them, so it idles (n-1-h)(F + I - W) in its own span.
        n = pp // 2
        hs = [min(r, pp - 1 - r) for r in range(d)]
        assert own_idle == [(n - 1 - h) * (f_s + i_s - w_s) for h in hs], (name, d, t)


@pytest.mark.parametrize(("f", "b", "w"), OUTSIDE)
def test_idle_elsewhere_is_never_below_the_derived_form(f: int, b: int, w: int) -> None:
    above = 0
    for name, d, t in cases():
        idle, pp, f_s, i_s, w_s, _ = simulated(name, d, t, f, b, w)
        form = (pp / 2 - 1) * (f_s + i_s - w_s)
        assert idle >= form, (name, d, t)
        above += idle > form
    assert above  # outside the region the form is a lower bound, reached only sometimes
