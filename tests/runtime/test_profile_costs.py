"""The costs a run profiles from its own trace: per-part medians, U, hop latency, dispatch time."""

from __future__ import annotations

import pytest
from config_defaults import train_config

from pipeweave.models import ModelSpec
from pipeweave.runtime.report.trace import dispatch_time, hop_latency, profile_costs
from pipeweave.runtime.run.record import RankRecord, RunRecord
from pipeweave.schedule import generate
from pipeweave.sim import CostModel, compute_metrics, simulate

Row = list[tuple[int, str, int, float, float]]


def _record(rows: list[Row]) -> RunRecord:
    """A two-step run whose second (measured) step is ``rows``; the first is ignored."""
    config = train_config(
        schedule="1f1b",
        num_stages=2,
        num_microbatches=1,
        batch_size=1,
        steps=2,
        model=ModelSpec(kind="mlp", layers=2, hidden=4),
    )
    ranks = [RankRecord(r, [0.0, 0.0], [[], row], 0, 0, {}) for r, row in enumerate(rows)]
    return RunRecord(config, ranks, 0.0, "shm")


def test_hand_trace_gives_its_costs() -> None:
    # 1F1B, D = 2, T = 1 by hand (ms): rank 0 F, send, waits in RECV_B, B, U; rank 1 waits in RECV_F, F, B, send, U.
    rank0: Row = [
        (0, "F", 0, 0.0, 2.0),
        (0, "SEND_F", 0, 2.1, 2.2),
        (0, "RECV_B", 0, 2.4, 8.0),
        (0, "B", 0, 8.2, 12.2),
        (0, "U", 0, 12.5, 13.0),
    ]
    rank1: Row = [
        (1, "RECV_F", 0, 0.0, 2.5),
        (1, "F", 0, 2.6, 4.6),
        (1, "B", 0, 4.7, 7.7),
        (1, "SEND_B", 0, 7.8, 7.9),
        (1, "U", 0, 8.0, 8.5),
    ]
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
        ("0F0", 0.0, 1.0),
        ("0F1", 1.5, 2.5),
        ("0B0", 3.0, 5.0),
        ("0B1", 5.5, 7.5),
        ("0U0", 8.0, 8.0),
    ]
    m = compute_metrics(got)
    assert m.makespan == 8.0 and m.bubble_ratio == pytest.approx(1 - 6.0 / 8.0)
    with pytest.raises(Exception, match="dispatch=-1"):
        CostModel(dispatch=-1)


def test_the_profiler_counts_each_layers_flops(tmp_path: object) -> None:
    from pipeweave.runtime.profile import profile_model

    # An mlp block is Linear(h, 4h) and Linear(4h, h): 16 b h^2 FLOPs forward, as many for I and for W.
    costs = profile_model(ModelSpec(kind="mlp", layers=2, hidden=8), 4, repeats=1, cache_dir=str(tmp_path))
    assert costs.flops == (48 * 4 * 8**2,) * 2


def test_a_layer_without_parameters_is_profiled(tmp_path: object) -> None:
    """An ``nn.Sequential`` split by ``pipeweave.pipeline`` has its activations as layers of their own (no
    parameters; torch's optimizers refuse an empty list): profiled as the others, no weight bytes."""
    from pathlib import Path

    from pipeweave.runtime.profile import profile_model

    entry = f"{Path(__file__).resolve().parent.parent / 'models' / 'tiny_modules.py'}:tied_sequential"
    costs = profile_model(ModelSpec(kind="custom", entry=entry), 4, repeats=1, cache_dir=str(tmp_path))
    assert costs.num_layers == 5 and costs.params[0] > 0 and costs.params[1] == 0 and costs.forward[1] > 0


def test_the_copies_are_profiled_on_their_own_and_charged_where_the_runtime_runs_them() -> None:
    """The hand trace above with part 0 offloaded: the copy out after F (1.0), back before B (0.5), on rank 0's
    own time: not dispatch, and the simulated step charges them to its F and its B (makespan +1.5)."""
    from pipeweave.runtime.report.trace import copy_extra, copy_times, summarize

    rank0: Row = [
        (0, "F", 0, 0.0, 2.0),
        (0, "SEND_F", 0, 2.1, 2.2),
        (0, "OFFLOAD", 0, 2.2, 3.2),
        (0, "RECV_B", 0, 3.4, 8.0),
        (0, "RELOAD", 0, 8.0, 8.5),
        (0, "B", 0, 8.7, 12.7),
        (0, "U", 0, 13.0, 13.5),
    ]
    rank1: Row = [
        (1, "RECV_F", 0, 0.0, 2.5),
        (1, "F", 0, 2.6, 4.6),
        (1, "B", 0, 4.7, 7.7),
        (1, "SEND_B", 0, 7.8, 7.9),
        (1, "U", 0, 8.0, 8.5),
    ]
    schedule, record = generate("1f1b", num_stages=2, num_microbatches=1), _record([rank0, rank1])
    assert copy_times(schedule, record) == {"0": {"OFFLOAD": pytest.approx(1.0), "RELOAD": pytest.approx(0.5)}}
    assert {str(a): t for a, t in copy_extra(schedule, copy_times(schedule, record)).items()} == {
        "0F0": pytest.approx(1.0),
        "0B0": pytest.approx(0.5),
    }
    # Rank 0's gaps: 8.7 - 2.0 - (1.0 + 4.6 + 0.5) = 0.6 and 0.3; rank 1's 0.1 and 0.3: as without the copies.
    assert dispatch_time(record) == pytest.approx((0.6 + 0.3 + 0.1 + 0.3) / 4)
    # Both copies on the one chain of this step: the simulated step is 1.5 longer than without them, the same
    # profiled costs otherwise (dispatch included).
    moved = summarize(schedule, _twice([rank0, rank1]))
    cost = profile_costs(schedule, _twice([rank0, rank1]))
    assert moved["makespan_simulated_s"] == pytest.approx(compute_metrics(simulate(schedule, cost)).makespan + 1.5)
    assert moved["profiled_copies_s"] == {"0": {"OFFLOAD": pytest.approx(1.0), "RELOAD": pytest.approx(0.5)}}


def _twice(rows: list[Row]) -> RunRecord:
    """``_record`` with its step 0 the same step 20 earlier (``summarize`` measures from step 0's start)."""
    run = _record(rows)
    for rank, row in zip(run.ranks, rows):
        rank.records[0] = [(s, op, j, t0 - 20.0, t1 - 20.0) for s, op, j, t0, t1 in row]
    return run
