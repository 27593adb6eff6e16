"""Memory actions in the simulator (sim.levers): both engines equal, peaks, the copy times."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipeweave.schedule import generate
from pipeweave.schedule.ir import Op
from pipeweave.schedule.levers import StashPlan
from pipeweave.sim import CostModel, compute_metrics, simulate
from pipeweave.sim.levers import simulate_stash, stash_costs, stash_events, stash_peaks

PLANS = (
    StashPlan(offload=frozenset({0, 1})),
    StashPlan(balance=True),
    StashPlan(offload=frozenset({1}), balance=True),
    StashPlan(compress="bf16"),
)
NAMES = (("1f1b", {}), ("zb-h1", {}), ("interleaved-1f1b", {"num_chunks": 2}), ("gpipe", {}))


def _costs(s):
    cost = CostModel(
        f=[1.1, 0.7, 1.3, 0.9, 1.0, 1.2, 0.8, 1.05][: s.num_parts],
        b=1.3,
        w=0.7,
        comm=0.1,
        activation=[1.0, 0.9, 1.1, 0.7, 1.0, 1.2, 0.8, 1.3][: s.num_parts],
    )
    return cost.for_parts(num_parts=s.num_parts, num_ranks=s.num_ranks)


@pytest.mark.parametrize("name, options", NAMES)
@pytest.mark.parametrize("plan", PLANS)
def test_fast_and_reference_engines_time_memory_actions_bit_for_bit(name, options, plan):
    s = generate(name, num_stages=4, num_microbatches=8, **options)
    fast, _, _ = simulate_stash(s, _costs(s), plan, bandwidth=3.0, hop=lambda a, b: 0.1)
    slow, _, _ = simulate_stash(s, _costs(s), plan, bandwidth=3.0, hop=lambda a, b: 0.1, fast=False)
    assert fast.times is not None and fast.events == slow.events


def test_offload_charges_each_copy_at_the_bandwidth_and_frees_the_rank():
    s = generate("1f1b", num_stages=4, num_microbatches=8)
    costs = CostModel().for_parts(num_parts=4, num_ranks=4)
    plain = compute_metrics(simulate(s))
    timeline, stash, extra = simulate_stash(s, costs, StashPlan(offload=frozenset({0})), bandwidth=4.0)
    events = stash_events(stash, timeline, extra)
    copies = [e for e in events[0] if e.action.op.is_memory]
    assert len(copies) == 16 and all(e.end - e.start == 0.25 for e in copies)
    # Rank 0 holds one microbatch at a time (just forwarded, or reloaded for its backward).
    assert stash_peaks(stash, events, costs) == (1.0, 3.0, 2.0, 1.0)
    assert plain.peak_activations == (4.0, 3.0, 2.0, 1.0)
    # Each copy sits on rank 0's critical path: 8 microbatches x 2 copies x 0.25 at most.
    assert plain.makespan < compute_metrics(timeline).makespan <= plain.makespan + 4.0


@pytest.mark.parametrize("d, t", [(4, 8), (4, 16), (8, 16)])
def test_bpipe_brings_every_ranks_peak_within_15_percent_of_the_mean(d, t):
    s = generate("1f1b", num_stages=d, num_microbatches=t)
    costs = CostModel().for_parts(num_parts=d, num_ranks=d)
    timeline, stash, extra = simulate_stash(s, costs, StashPlan(balance=True), bandwidth=8.0)
    peaks = stash_peaks(stash, stash_events(stash, timeline, extra), costs)
    mean = sum(peaks) / d
    assert max(peaks) <= 1.15 * mean and min(peaks) >= 0.85 * mean
    assert compute_metrics(simulate(s)).peak_activations[0] == d


def test_compression_halves_the_peaks_and_keeps_the_time():
    s = generate("zb-h1", num_stages=4, num_microbatches=8)
    costs = CostModel().for_parts(num_parts=4, num_ranks=4)
    timeline, stash, extra = simulate_stash(s, costs, StashPlan(compress="bf16"))
    plain = compute_metrics(simulate(s))
    assert compute_metrics(timeline).makespan == plain.makespan
    peaks = stash_peaks(stash, stash_events(stash, timeline, extra), stash_costs(costs, stash.plan))
    assert peaks == tuple(p / 2 for p in plain.peak_activations)


def test_simulate_json_gives_peak_activations_with_the_levers_and_the_trace_shows_them(tmp_path):
    trace = tmp_path / "t.json"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeweave.cli",
            "simulate",
            "--balance-activations",
            "--offload",
            "3",
            "--json",
            "--trace",
            str(trace),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    data = json.loads(out)
    # The pairs' peaks meet (sim.levers.balanced_shares): rank 0 lends 3/7 of each microbatch, rank 1 1/5.
    assert data["memory_levers"]["moved_share"][:2] == [0.428571, 0.2]
    assert max(data["peak_activations"]) < 2.75
    names = {e["cat"] for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"}
    assert {Op.EVICT.value, Op.LOAD.value, Op.OFFLOAD.value, Op.RELOAD.value} <= names


def test_the_memory_partitioner_sees_what_the_levers_leave_each_rank():
    from pipeweave.sim.levers import levered_activations

    s = generate("1f1b", num_stages=4, num_microbatches=8)
    plain = (4.0, 3.0, 2.0, 1.0)
    assert levered_activations(s, plain, StashPlan()) == plain
    assert levered_activations(s, plain, StashPlan(compress="bf16")) == (2.0, 1.5, 1.0, 0.5)
    assert levered_activations(s, plain, StashPlan(offload=frozenset({0, 1}))) == (1.0, 1.0, 2.0, 1.0)
    balanced = levered_activations(s, plain, StashPlan(balance=True))
    assert max(balanced) < 2.75 and min(balanced) > 2.55


def test_offload_on_a_copy_stream_hides_what_the_wait_for_the_gradient_covers():
    """CUDA's side stream: an OFFLOAD takes nothing from the compute, a RELOAD only what exceeds the rank's
    wait for the gradient (1F1B, part 2 twice as slow as the others: rank 1 waits 2 before each steady backward)."""
    s = generate("1f1b", num_stages=4, num_microbatches=8)
    cost = CostModel(f=[1.0, 1.0, 2.0, 1.0], b=[1.0, 1.0, 2.0, 1.0], w=0.0)
    costs = cost.for_parts(num_parts=4, num_ranks=4)
    plain = compute_metrics(simulate(s, cost))
    plan = StashPlan(offload=frozenset({1}))
    for bandwidth, hidden in ((1.0, True), (0.25, False)):  # copies of 1 (within the wait of 2) or 4 (beyond it)
        synchronous, _, _ = simulate_stash(s, costs, plan, bandwidth=bandwidth)
        stream, stash, extra = simulate_stash(s, costs, plan, bandwidth=bandwidth, copy_stream=True)
        assert not any(a.op is Op.F for a in extra)  # no OFFLOAD on the compute stream
        assert compute_metrics(stream).makespan < compute_metrics(synchronous).makespan
        assert (compute_metrics(stream).makespan == plain.makespan) is hidden
        events = stash_events(stash, stream, extra, bandwidth)
        copies = [e for e in events[1] if e.action.op.is_memory]
        assert all(e.end - e.start == pytest.approx(1 / bandwidth) for e in copies)  # each copy whole
        timed = {e.action: e for e in events[1]}
        for e in copies:
            twin = e.action._replace(op=Op.F if e.action.op is Op.OFFLOAD else Op.B)
            assert (e.start == timed[twin].end) if e.action.op is Op.OFFLOAD else (e.end == timed[twin].start)
