"""DualPipe's and DualPipeV's simulated idle time against DeepSeek's table, (PP/2-1)(F&B + B - 3W).

docs/guide/dualpipe.md derives what the simulator gives: with F, I, W one stage's times
(B = I + W), PP the stages of one pipeline and no communication time, every rank idles
(PP/2 - 1)(F + B - 2W) over the widest span whenever W <= I <= F <= B, and never less
otherwise. DeepSeek's entry, read with F&B = F + B (pipeweave does not overlap the pair
yet), is that plus (PP/2 - 1)(B - W). Costs are small integers and halves, so every sum is
exact in floating point and the comparisons below are equalities.
"""

from __future__ import annotations

from typing import NamedTuple

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


class Run(NamedTuple):
    """One simulated step: PP, one stage's F, I, W, and per rank its busy time, first start and last end."""

    pp: int
    f: float
    i: float
    w: float
    busy: list[float]
    starts: list[float]
    ends: list[float]

    @property
    def idle(self) -> float:
        """Every rank's idle time over the widest span (all ranks are equally busy)."""
        return max(e - s for s, e in zip(self.starts, self.ends)) - self.busy[0]


def simulated(name: str, d: int, t: int, f: float, b: float, w: float) -> Run:
    schedule = (dualpipe if name == "dualpipe" else dualpipe_v)(d, t)
    timeline = simulate(schedule, CostModel(f=f, b=b, w=w))
    metrics = compute_metrics(timeline)
    busy = list(metrics.busy)
    assert len(set(busy)) == 1  # every rank does the same work
    chunks = 1 if name == "dualpipe" else 2  # a dualpipe-v rank holds two stages, each half its costs
    starts = [min(e.start for e in row) for row in timeline.events]
    ends = [max(e.end for e in row) for row in timeline.events]
    assert [end - start for start, end in zip(starts, ends)] == list(metrics.span)  # the metrics' span
    return Run(d * chunks, f / chunks, b / chunks, w / chunks, busy, starts, ends)


@pytest.mark.parametrize(("f", "b", "w"), INSIDE)
def test_idle_is_the_derived_form_and_deepseeks_less_one_input_gradient_per_hop(f: int, b: int, w: int) -> None:
    for name, d, t in cases():
        r = simulated(name, d, t, f, b, w)
        n, full_b = r.pp // 2, r.i + r.w
        assert r.idle == (n - 1) * (r.f + full_b - 2 * r.w), (name, d, t)
        assert deepseek_bubble(r.pp, r.f + full_b, full_b, r.w) - r.idle == (n - 1) * r.i, (name, d, t)
        # The derivation's steps: the middle ranks (h = n-1) never wait; rank h starts h F after
        # the end ranks and ends (n-1-h)(I - W) after the middle, so idles (n-1-h)(F + I - W) itself.
        hs = [min(rank, r.pp - 1 - rank) for rank in range(d)]
        assert r.starts == [h * r.f for h in hs], (name, d, t)
        assert [end - r.ends[n - 1] for end in r.ends] == [(n - 1 - h) * (r.i - r.w) for h in hs], (name, d, t)
        own = [end - start - busy for start, end, busy in zip(r.starts, r.ends, r.busy)]
        assert own == [(n - 1 - h) * (r.f + r.i - r.w) for h in hs], (name, d, t)


@pytest.mark.parametrize(("f", "b", "w"), OUTSIDE)
def test_idle_elsewhere_is_never_below_the_derived_form(f: int, b: int, w: int) -> None:
    above = 0
    for name, d, t in cases():
        r = simulated(name, d, t, f, b, w)
        form = (r.pp // 2 - 1) * (r.f + r.i - r.w)
        assert r.idle >= form, (name, d, t)
        above += r.idle > form
    assert above  # outside the region the form is a lower bound, reached only sometimes
