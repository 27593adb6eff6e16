"""The costs a run profiles from its own trace: per-part medians, U, hop latency, dispatch time."""

from __future__ import annotations

import pytest

from pipeweave.models import ModelSpec
from pipeweave.runtime.run.config import TrainConfig
from pipeweave.runtime.run.record import RankRecord, RunRecord
from pipeweave.runtime.report.trace import dispatch_time, hop_latency, profile_costs
from pipeweave.schedule import generate
from pipeweave.sim import CostModel, compute_metrics, simulate

Row = list[tuple[int, str, int, float, float]]


def _record(rows: list[Row]) -> RunRecord:
    """A two-step run whose second (measured) step is ``rows``; the first is ignored."""
    config = TrainConfig(schedule="1f1b", num_stages=2, num_microbatches=1, batch_size=1, steps=2,
                         model=ModelSpec(kind="mlp", layers=2, hidden=4))
    ranks = [RankRecord(r, [0.0, 0.0], [[], row], 0, 0, {}) for r, row in enumerate(rows)]
    return RunRecord(config, ranks, 0.0, "shm")


def test_hand_trace_gives_its_costs() -> None:
    # 1F1B, D = 2, T = 1 by hand (ms): rank 0 F, send, waits in RECV_B, B, U; rank 1 waits in RECV_F, F, B, send, U.
    rank0: Row = [(0, "F", 0, 0.0, 2.0), (0, "SEND_F", 0, 2.1, 2.2), (0, "RECV_B", 0, 2.4, 8.0),
                  (0, "B", 0, 8.2, 12.2), (0, "U", 0, 12.5, 13.0)]
    rank1: Row = [(1, "RECV_F", 0, 0.0, 2.5), (1, "F", 0, 2.6, 4.6), (1, "B", 0, 4.7, 7.7),
                  (1, "SEND_B", 0, 7.8, 7.9), (1, "U", 0, 8.0, 8.5)]
    record = _record([rank0, rank1])
    cost = profile_costs(generate("1f1b", num_stages=2, num_microbatches=1), record)
    assert cost.f == pytest.approx([2.0, 2.0]) and cost.b == pytest.approx([4.0, 3.0])
    assert cost.u == pytest.approx([0.5, 0.5]) and cost.w == [0.0, 0.0]
    # Send start to receive end: F 2.1 -> 2.5, B 7.8 -> 8.0.
    assert hop_latency(generate("1f1b", num_stages=2, num_microbatches=1), record) == pytest.approx(0.2)
    # Gaps between compute actions less the receives in them: rank 0 (8.2-2.0-5.6)=0.6 and 0.3;
    # rank 1 0.1 and (8.0-7.7)=0.3 (the wait before its first F is not a gap).
    assert dispatch_time(record) == pytest.approx((0.6 + 0.3 + 0.1 + 0.3) / 4)
    assert cost.dispatch == pytest.approx(dispatch_time(record))


def test_dispatch_separates_consecutive_actions_of_a_rank_and_counts_as_bubble() -> None:
    one_rank = generate("gpipe", num_stages=1, num_microbatches=2)
    got = simulate(one_rank, CostModel(dispatch=0.5))
    assert [(str(e.action), e.start, e.end) for e in got.events[0]] == [
        ("0F0", 0.0, 1.0), ("0F1", 1.5, 2.5), ("0B0", 3.0, 5.0), ("0B1", 5.5, 7.5), ("0U0", 8.0, 8.0)]
    m = compute_metrics(got)
    assert m.makespan == 8.0 and m.bubble_ratio == pytest.approx(1 - 6.0 / 8.0)
    with pytest.raises(Exception, match="dispatch=-1"):
        CostModel(dispatch=-1)


def test_the_profiler_counts_each_layers_flops(tmp_path: object) -> None:
    from pipeweave.runtime.profile import profile_model

    # An mlp block is Linear(h, 4h) and Linear(4h, h): 16 b h^2 FLOPs forward, as many for I and for W.
    costs = profile_model(ModelSpec(kind="mlp", layers=2, hidden=8), 4, repeats=1, cache_dir=str(tmp_path))
    assert costs.flops == (48 * 4 * 8**2,) * 2
