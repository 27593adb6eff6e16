"""Links, ring collectives and the placement of a (dp, pp, tp) mesh on nodes, against hand-computed values."""

from __future__ import annotations

import pytest

from pipeweave.errors import UserError
from pipeweave.sim.network import (
    Link,
    Mesh,
    Network,
    all_gather_time,
    all_reduce_time,
    reduce_scatter_time,
    slowest_link,
)
from pipeweave.sim.parallel import Layout

FAST, SLOW = Link(bandwidth=100.0, latency=0.5), Link(bandwidth=10.0, latency=2.0)


def network(gpus_per_node: int) -> Network:
    return Network(intra_node=FAST, inter_node=SLOW, gpus_per_node=gpus_per_node)


def test_a_message_is_latency_plus_bytes_over_bandwidth() -> None:
    assert Link(bandwidth=4.0, latency=0.25).time(10.0) == 0.25 + 2.5


@pytest.mark.parametrize(
    "n,all_reduce,half",
    [
        # 2(n-1) latencies + 2(n-1)/n x 1000 B / 100 B/s; reduce-scatter and all-gather are half of it.
        (2, 2 * 0.5 + 10.0, 0.5 + 5.0),
        (4, 6 * 0.5 + 15.0, 3 * 0.5 + 7.5),
        (8, 14 * 0.5 + 17.5, 7 * 0.5 + 8.75),
    ],
)
def test_ring_collectives(n: int, all_reduce: float, half: float) -> None:
    assert all_reduce_time(1000.0, n, FAST) == pytest.approx(all_reduce)
    assert reduce_scatter_time(1000.0, n, FAST) == pytest.approx(half)
    assert all_gather_time(1000.0, n, FAST) == pytest.approx(half)


def test_a_group_of_one_communicates_nothing() -> None:
    for collective in (all_reduce_time, reduce_scatter_time, all_gather_time):
        assert collective(1e9, 1, SLOW) == 0.0


def test_ranks_are_tp_innermost_then_pp_then_dp() -> None:
    mesh = Mesh(dp=2, pp=3, tp=2)
    assert [mesh.rank(dp=d, pp=p, tp=t) for d in range(2) for p in range(3) for t in range(2)] == list(range(12))
    assert mesh.rank(dp=1, pp=2, tp=0) == 1 * 6 + 2 * 2 + 0
    assert mesh.tp_groups()[:3] == [(0, 1), (2, 3), (4, 5)]
    assert mesh.dp_groups()[:3] == [(0, 6), (1, 7), (2, 8)]
    assert mesh.hop_pairs(1, 2) == [(2, 4), (3, 5), (8, 10), (9, 11)]


def test_a_tp_group_stays_inside_a_node_when_it_fits() -> None:
    assert Layout(tp=4, network=network(4)).tp_link(num_ranks=2) == FAST
    assert Layout(tp=4, network=network(8)).tp_link(num_ranks=3) == FAST
    assert Layout(tp=4, network=network(2)).tp_link(num_ranks=1) == SLOW  # N > gpus per node


def test_a_pipeline_hop_crosses_nodes_where_its_stage_ranks_do() -> None:
    # D=3, N=2 on nodes of 4: pipeline ranks 0, 1 share node 0; pipeline rank 2 is on node 1.
    layout = Layout(tp=2, network=network(4))
    assert layout.hop_link(0, 1, num_ranks=3) == FAST
    assert layout.hop_link(1, 2, num_ranks=3) == SLOW
    assert layout.hop_link(2, 1, num_ranks=3) == SLOW
    # with a second replica (global ranks 6-11), its hop 0 -> 1 (ranks 6, 8) crosses from node 1 to node 2
    assert Layout(tp=2, dp=2, network=network(4)).hop_link(0, 1, num_ranks=3) == SLOW


def test_a_dp_group_crosses_nodes_when_its_ranks_do() -> None:
    assert Layout(dp=2, tp=2, network=network(8)).dp_link(num_ranks=2) == FAST  # 8 ranks, one node
    assert Layout(dp=2, tp=2, network=network(4)).dp_link(num_ranks=2) == SLOW  # replica 1 on node 1


def test_the_slowest_group_sets_the_link() -> None:
    net = network(3)  # nodes of 3 and groups of 2: group (2, 3) spans two nodes
    assert slowest_link(net, [(0, 1)]) == FAST
    assert slowest_link(net, [(0, 1), (2, 3)]) == SLOW


@pytest.mark.parametrize(
    "make,needle",
    [
        (lambda: Link(bandwidth=0.0), "bandwidth 0.0 is invalid"),
        (lambda: Link(bandwidth=float("inf")), "bandwidth inf is invalid"),
        (lambda: Link(bandwidth=1.0, latency=-1.0), "latency -1.0 is invalid"),
        (lambda: Network(intra_node=FAST, inter_node=SLOW, gpus_per_node=0), "gpus_per_node=0"),
        (lambda: Mesh(tp=0), "mesh tp=0 is invalid"),
    ],
)
def test_bad_values_are_user_errors(make: object, needle: str) -> None:
    with pytest.raises(UserError, match=needle):
        make()  # type: ignore[operator]
