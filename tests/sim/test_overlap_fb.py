"""The simulator's F&B pairs: under ``comm_rendezvous`` a pair hides its B half's message behind its F half.

DualPipe, D = 2, T = 4, f = b = w = 1 (B = 2), hops of c = 1, a message moving
once its receive is posted (rank 1 is rank 0 mirrored)::

    serial  rank 0 | 0F0 .. 3F2 0F1 3B2 3B2 .. 3F3 .. 0B0 0B0 3B3 3B3 .. 0I1 0W1     16
    paired  rank 0 | 0F0 .. 3F2 0F1 3B2 3B2 .. 3F3 0B0 0B0 3B3 3B3 .. 0I1 0W1         15

0B0 takes 1B0's gradient, made at 6: serially its receive is posted after
3F3, at 8, and the message lands at 9; paired, it is posted with 3F3's, at 6,
and lands at 7, while 3F3 computes. So 12 + 4c serially, 12 + 3c paired.
"""

from __future__ import annotations

import pytest

from pipeweave.schedule import generate
from pipeweave.sim import CostModel, compute_metrics, simulate
from pipeweave.sim.trace import chrome_trace


@pytest.mark.parametrize("c", [0.5, 1.0])
def test_a_pair_hides_its_b_halfs_hop(c: float) -> None:
    cost = CostModel(comm=c, comm_rendezvous=True)
    serial = simulate(generate("dualpipe", num_stages=2, num_microbatches=4, overlap_fb=False), cost)
    paired = simulate(generate("dualpipe", num_stages=2, num_microbatches=4), cost)
    assert compute_metrics(serial).makespan == pytest.approx(12 + 4 * c)
    assert compute_metrics(paired).makespan == pytest.approx(12 + 3 * c)
    b_half = {str(e.action): e for e in paired.events[0]}["0B0"]
    assert (b_half.start, b_half.end) == pytest.approx((6 + 2 * c, 8 + 2 * c))  # right after 3F3, which ends at 6 + 2c


@pytest.mark.parametrize(("name", "d", "t"), [("dualpipe", 4, 8), ("dualpipe-v", 2, 8)])
def test_without_rendezvous_pairs_cost_what_their_halves_cost(name: str, d: int, t: int) -> None:
    for cost in (CostModel(), CostModel(comm=0.5, f=2.0)):  # messages move from their producer's end
        paired = simulate(generate(name, num_stages=d, num_microbatches=t), cost)
        serial = simulate(generate(name, num_stages=d, num_microbatches=t, overlap_fb=False), cost)
        assert paired.events == serial.events


def test_rendezvous_never_beats_the_messages_moving_early() -> None:
    for overlap in (False, True):
        s = generate("dualpipe-v", num_stages=3, num_microbatches=9, overlap_fb=overlap)
        early = compute_metrics(simulate(s, CostModel(comm=0.7))).makespan
        posted = compute_metrics(simulate(s, CostModel(comm=0.7, comm_rendezvous=True))).makespan
        assert posted >= early
        assert (
            simulate(s, CostModel(comm=0.7, comm_rendezvous=True), fast=False).events
            == simulate(s, CostModel(comm=0.7, comm_rendezvous=True)).events
        )


def test_the_trace_shows_each_pair_and_what_it_left_exposed() -> None:
    trace = chrome_trace(simulate(generate("dualpipe", num_stages=2, num_microbatches=4), CostModel(comm=1.0)))
    pairs = [e for e in trace["traceEvents"] if e.get("cat") == "F&B"]
    assert [(e["name"], e["pid"], e["tid"]) for e in pairs] == [("F&B 3F3;0B0", 0, 1), ("F&B 1F1;2B2", 1, 1)]
    assert all(e["args"]["exposed"] == 0.0 for e in pairs)
