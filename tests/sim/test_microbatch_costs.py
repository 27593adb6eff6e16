"""Per-microbatch costs (``CostModel.microbatch``): each microbatch's F, B, I and W scaled by its own factor."""

from __future__ import annotations

import pytest

from pipeweave.errors import UserError
from pipeweave.schedule import Op, generate
from pipeweave.sim import CostModel, compute_metrics, simulate

NAMES = ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "chimera")


@pytest.mark.parametrize("name", NAMES)
def test_factors_of_one_time_as_the_fast_engine(name: str) -> None:
    schedule = generate(name, num_stages=4, num_microbatches=8)
    cost = CostModel(f=1.0, b=1.5, w=0.5, comm=0.25, dispatch=0.125)
    fast = simulate(schedule, cost)
    each = simulate(schedule, CostModel(f=1.0, b=1.5, w=0.5, comm=0.25, dispatch=0.125, microbatch=[1.0] * 8))
    assert each.times is None and fast.times is not None  # the per-action walk, beside the numpy engine
    assert compute_metrics(each).as_dict() == compute_metrics(fast).as_dict()


def test_each_microbatch_takes_its_factor_of_the_time() -> None:
    """1F1B, D=2, T=3, f=b=1, w=0: microbatch 0 twice as long, microbatch 2 half as long
    (``format_timeline``, a column = 0.5; ``FB`` is F2 and B2 in one column each)::

        rank 0 |F0  F1......B0  FB1B
        rank 1 |....F0  B0  F1B1.FB.
    """
    schedule = generate("1f1b", num_stages=2, num_microbatches=3)
    timeline = simulate(schedule, CostModel(f=1.0, b=1.0, w=0.0, microbatch=[2.0, 1.0, 0.5]))
    durations = {str(e.action): e.end - e.start for row in timeline.events for e in row}
    for stage in (0, 1):
        assert [durations[f"{stage}F{j}"] for j in range(3)] == [2.0, 1.0, 0.5]
        assert [durations[f"{stage}B{j}"] for j in range(3)] == [2.0, 1.0, 0.5]
    assert [(str(e.action), e.start) for e in timeline.events[1] if e.action.op is not Op.U] == [
        ("1F0", 2.0),
        ("1B0", 4.0),
        ("1F1", 6.0),
        ("1B1", 7.0),
        ("1F2", 8.5),
        ("1B2", 9.0),
    ]
    assert compute_metrics(timeline).makespan == 10.0


def test_one_factor_per_microbatch_or_one_line() -> None:
    schedule = generate("1f1b", num_stages=2, num_microbatches=3)
    with pytest.raises(UserError, match=r"^cost microbatch has 2 factors for 3 microbatches; give one per microbatch$"):
        simulate(schedule, CostModel(microbatch=[1.0, 2.0]))
    with pytest.raises(UserError, match=r"^cost microbatch=\[1.0, -1.0\]: -1.0 is invalid; give a factor >= 0$"):
        CostModel(microbatch=[1.0, -1.0])
