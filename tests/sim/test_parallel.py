"""Tensor and data parallelism in the simulator: timelines computed by hand on tiny schedules."""

from __future__ import annotations

import pytest

from pipeweave.errors import UserError
from pipeweave.schedule import SCHEDULES, Op, ScheduleError, generate
from pipeweave.sim import CostModel, compute_metrics, simulate
from pipeweave.sim.communication import communication
from pipeweave.sim.network import Link, Network, all_reduce_time
from pipeweave.sim.parallel import Layout, layout_costs, layout_times, reduction_time, reduction_times, simulate_layout
from pipeweave.sim.shards import RankMemory, Shares, rank_memory
from pipeweave.sim.traffic import ModelBytes

UNIT = Network(intra_node=Link(bandwidth=1.0), inter_node=Link(bandwidth=1.0))  # 1 byte/s, no latency
FAST, SLOW = Link(bandwidth=100.0, latency=0.5), Link(bandwidth=10.0, latency=2.0)


def rows(timeline: object) -> list[list[tuple[str, float, float]]]:
    return [[(str(e.action), e.start, e.end) for e in row] for row in timeline.events]  # type: ignore[attr-defined]


def every_schedule() -> list[object]:
    out = []
    for name in SCHEDULES:
        try:
            out.append(generate(name, num_stages=4, num_microbatches=8))
        except ScheduleError:
            out.append(generate(name, num_stages=4, num_microbatches=4))
    return out


UNEVEN = CostModel(f=[1.0, 2.0, 1.5, 1.0], b=[1.0, 2.5, 1.0, 2.0], w=[0.5, 1.0, 0.5, 1.0], u=0.25, comm=0.125)


@pytest.mark.parametrize("schedule", every_schedule(), ids=lambda s: s.name)
def test_one_rank_per_stage_and_nothing_to_send_is_todays_simulation_bit_for_bit(schedule: object) -> None:
    cost = UNEVEN if schedule.num_parts == 4 else CostModel(comm=0.125)  # type: ignore[attr-defined]
    today = rows(simulate(schedule, cost))  # type: ignore[arg-type]
    assert rows(simulate_layout(schedule, cost, Layout())) == today  # type: ignore[arg-type]
    # the layout path itself: a network, but one rank per stage, one replica, no bytes and no latency
    assert rows(simulate_layout(schedule, cost, Layout(network=UNIT), ModelBytes())) == today  # type: ignore[arg-type]


def test_tp_splits_compute_and_adds_its_all_reduces_to_f_and_i() -> None:
    # N=2 on one node: each all-reduce of 10 B is 2(2-1) x 0.5 + 2(2-1)/2 x 10/100 = 1.1; two per F and per I.
    layout = Layout(tp=2, network=Network(intra_node=FAST, inter_node=SLOW, gpus_per_node=4))
    model = ModelBytes(message=10.0, tp_collectives=2)
    costs = layout_costs(
        CostModel(f=2.0, b=2.0, w=2.0, u=1.0).for_parts(num_parts=2, num_ranks=2),
        layout,
        model.for_parts(num_parts=2, num_ranks=2),
        num_ranks=2,
    )
    assert costs.f == pytest.approx((1 + 2.2,) * 2) and costs.b == pytest.approx((1 + 2.2,) * 2)
    assert costs.w == (1.0, 1.0) and costs.u == (1.0, 1.0)  # no collective in W; ZeRO 0 gathers nothing
    # and a hop of 10 B inside the node: 0.5 + 10/100 = 0.6
    #   rank 0 |F0 3.2|      .6       |           ...          .6 |B0 4.2    |
    #   rank 1 |  .6  |F0 3.8-7.0|B0 7.0-11.2|
    t = rows(
        simulate_layout(
            generate("1f1b", num_stages=2, num_microbatches=1), CostModel(f=2.0, b=2.0, w=2.0), layout, model
        )
    )
    assert [(a, pytest.approx(s), pytest.approx(e)) for a, s, e in t[1][:2]] == [("1F0", 3.8, 7.0), ("1B0", 7.0, 11.2)]
    assert t[0][1][:3] == ("0B0", pytest.approx(11.8), pytest.approx(16.0))


def test_a_tp_group_across_nodes_pays_the_inter_node_link() -> None:
    inside = Layout(tp=4, network=Network(intra_node=FAST, inter_node=SLOW, gpus_per_node=4))
    across = Layout(tp=4, network=Network(intra_node=FAST, inter_node=SLOW, gpus_per_node=2))
    kwargs = {"f": 4.0, "b": 4.0, "w": 4.0, "comm": 0.0, "message": 40.0, "tp_collectives": 1.0, "num_ranks": 1}
    assert layout_times(inside, **kwargs)[0] == pytest.approx(1 + all_reduce_time(40.0, 4, FAST))  # 1 + 3 + 0.6
    assert layout_times(across, **kwargs)[0] == pytest.approx(1 + all_reduce_time(40.0, 4, SLOW))  # 1 + 12 + 6


# 1F1B, D=2, T=2, f=b=w=1 (B=2), U=0:
#   rank 0 |F0|F1|..|..|B0 B0|..|B1 B1|U      ends at 9
#   rank 1 |..|F0|B0 B0|F1|B1 B1|U            part 1's last W ends at 7
# Part 1's DP reduction (all-reduce over P=2 at 1 B/s: as many seconds as its gradient bytes) runs
# from 7 while rank 0 still computes until 9: up to 2 s of it is hidden.
ONE_F_ONE_B = generate("1f1b", num_stages=2, num_microbatches=2)
ONE_STAGE = generate("1f1b", num_stages=1, num_microbatches=1)


@pytest.mark.parametrize("part1_bytes,makespan", [(0.0, 9.0), (1.5, 9.0), (2.0, 9.0), (5.0, 12.0)])
def test_a_dp_reduction_costs_only_what_sticks_out_past_the_backward(part1_bytes: float, makespan: float) -> None:
    t = simulate_layout(ONE_F_ONE_B, None, Layout(dp=2, network=UNIT), ModelBytes(params=(0.0, part1_bytes)))
    assert compute_metrics(t).makespan == makespan
    u1 = t.events[1][-1]
    assert (str(u1.action), u1.start) == ("1U0", 7.0 + part1_bytes)
    c = communication(ONE_F_ONE_B, None, Layout(dp=2, network=UNIT), ModelBytes(params=(0.0, part1_bytes)))
    assert c.reduction == (0.0, part1_bytes) and c.exposed == makespan - 9.0


def test_zero_1_reduce_scatters_before_u_and_all_gathers_after_it() -> None:
    # reduce-scatter of 5 B over 2: 2.5 s, from 7 to 9.5; the all-gather of 5 B (2.5 s) is added to U.
    t = simulate_layout(ONE_F_ONE_B, None, Layout(dp=2, zero=1, network=UNIT), ModelBytes(params=(0.0, 5.0)))
    assert rows(t)[1][-1] == ("1U0", 9.5, 12.0)
    assert compute_metrics(t).makespan == 12.0


def test_reductions_of_one_rank_wait_for_each_other() -> None:
    # interleaved, D=2, v=2: rank 0 holds parts 0 and 2; their last B end at 7.5 and 5.5.
    s = generate("interleaved-1f1b", num_stages=2, num_microbatches=2, num_chunks=2)
    alone = simulate_layout(s, None, Layout(dp=2, network=UNIT), ModelBytes(params=(3.0, 0.0, 0.0, 0.0)))
    assert rows(alone)[0][-2] == ("0U0", 10.5, 10.5)  # 7.5 + 3
    both = simulate_layout(s, None, Layout(dp=2, network=UNIT), ModelBytes(params=(3.0, 0.0, 3.0, 0.0)))
    assert rows(both)[0][-2] == ("0U0", 11.5, 11.5)  # part 2's runs 5.5-8.5, then part 0's 8.5-11.5


def test_an_asynchronous_update_waits_for_its_own_gradients_reduction() -> None:
    s = generate("pipedream", num_stages=2, num_microbatches=4)
    t = simulate_layout(s, None, Layout(dp=2, network=UNIT), ModelBytes(params=1.5))
    for row in t.events:
        last_w = None
        for e in row:
            if e.action.op in (Op.B, Op.W):
                last_w = e.end
            elif e.action.op is Op.U and last_w is not None:
                assert e.start >= last_w + 1.5, e
    assert compute_metrics(t).makespan > compute_metrics(simulate(s)).makespan


def test_a_part_held_twice_in_a_pipeline_reduces_over_both_copies() -> None:
    # Chimera, D=4: part 0 on pipeline ranks 0 and 3, part 1 on 1 and 2; 4 B of gradients per part
    s = generate("chimera", num_stages=4, num_microbatches=4)
    parts = ModelBytes(params=4.0).for_parts(num_parts=4, num_ranks=4)
    assert reduction_times(s, Layout(network=UNIT), parts) == (4.0,) * 4  # all-reduce over 2: 2 (1)/2 x 4
    assert reduction_times(s, Layout(dp=2, network=UNIT), parts) == (6.0,) * 4  # over 4: 2 (3)/4 x 4
    two_per_node = Network(intra_node=FAST, inter_node=SLOW, gpus_per_node=2)
    # pipeline ranks 0 and 3 are on nodes 0 and 1; 1 and 2 too
    assert reduction_times(s, Layout(network=two_per_node), parts)[0] == all_reduce_time(4.0, 2, SLOW)
    four_per_node = Network(intra_node=FAST, inter_node=SLOW, gpus_per_node=4)
    assert reduction_times(s, Layout(network=four_per_node), parts)[0] == all_reduce_time(4.0, 2, FAST)


def test_gradients_go_in_buckets_each_paying_its_latency() -> None:
    net = Network(intra_node=Link(bandwidth=1.0, latency=1.0), inter_node=Link(bandwidth=1.0, latency=1.0))
    # P=2: one all-reduce of s bytes is 2 x 1 + s; 10 B in buckets of 4: 4, 4 and 2
    assert reduction_time(Layout(dp=2, network=net), 10.0, num_ranks=1) == 12.0
    assert reduction_time(Layout(dp=2, network=net, bucket_bytes=4.0), 10.0, num_ranks=1) == 6 + 6 + 4
    # the bytes are one TP rank's: each of a part's N TP ranks reduces its own shard, side by side
    two = ModelBytes(params=10.0, grads=1.0).for_parts(num_parts=1, num_ranks=1)
    assert reduction_times(ONE_STAGE, Layout(dp=2, tp=2, network=net), two) == (2 + 5,)
    replicated = ModelBytes(params=10.0, replicated=4.0, grads=1.0).for_parts(num_parts=1, num_ranks=1)
    assert reduction_times(ONE_STAGE, Layout(dp=2, tp=2, network=net), replicated) == (2 + 3 + 4,)


@pytest.mark.parametrize(
    "zero,rank0",
    [
        # part 0: 8 B of parameters, gradients 1 B and optimizer state 2 B per parameter byte; N=2, P=4
        (0, RankMemory(4.0, 4.0, 8.0)),
        (1, RankMemory(4.0, 4.0, 2.0)),
        (3, RankMemory(1.0, 1.0, 2.0)),
    ],
)
def test_model_state_per_rank_per_zero_stage(zero: int, rank0: RankMemory) -> None:
    layout = Layout(tp=2, dp=4, zero=zero)
    memory = rank_memory(ONE_F_ONE_B, layout, ModelBytes(params=(8.0, 4.0), grads=1.0, optimizer=2.0))
    assert memory[0] == rank0
    assert memory[1].total == rank0.total / 2  # part 1 has half the parameters
    assert Shares.of(layout).params * 8.0 / 2 == rank0.params


def test_replicated_parameters_are_whole_on_every_tp_rank() -> None:
    # part 0: 8 B, 4 of them an embedding every TP rank holds whole: 4 / 2 + 4 = 6 B per GPU
    memory = rank_memory(
        ONE_F_ONE_B, Layout(tp=2), ModelBytes(params=(8.0, 4.0), replicated=(4.0, 0.0), grads=1.0, optimizer=2.0)
    )
    assert memory[0] == RankMemory(6.0, 6.0, 12.0) and memory[1] == RankMemory(2.0, 2.0, 4.0)
    with pytest.raises(UserError, match="part 1 has 5 replicated parameter bytes of 4; give replicated <= params"):
        rank_memory(ONE_F_ONE_B, Layout(tp=2), ModelBytes(params=(8.0, 4.0), replicated=(0.0, 5.0)))


def test_a_vocabulary_head_gathers_its_logits_forward_and_all_reduces_its_input_gradient_backward() -> None:
    # N=2 inside a node: all-gather of 40 B = 0.5 + 1/2 x 40/100 = 0.7; all-reduce of 10 B = 1.1
    layout = Layout(tp=2, network=Network(intra_node=FAST, inter_node=SLOW, gpus_per_node=4))
    head = ModelBytes(tp_message=10.0, tp_collectives=0, tp_backward=1, tp_gather=40.0)
    costs = layout_costs(
        CostModel(f=0.0, b=0.0, w=0.0).for_parts(num_parts=1, num_ranks=1),
        layout,
        head.for_parts(num_parts=1, num_ranks=1),
        num_ranks=1,
    )
    assert costs.f == pytest.approx((0.7,)) and costs.b == pytest.approx((1.1,)) and costs.w == (0.0,)


def test_weight_stashing_keeps_a_copy_per_version() -> None:
    # PipeDream on D=2 stashes D - s versions on stage s: rank 0 holds 2 copies of its 8 B / N=2.
    memory = rank_memory(
        generate("pipedream", num_stages=2, num_microbatches=4),
        Layout(tp=2),
        ModelBytes(params=(8.0, 8.0), grads=1.0, optimizer=0.0),
    )
    assert [m.params for m in memory] == [8.0, 4.0] and [m.grads for m in memory] == [4.0, 4.0]


@pytest.mark.parametrize(
    "make,needle",
    [
        (lambda: Layout(tp=0), "layout tp=0 is invalid"),
        (lambda: Layout(zero=2), "ZeRO stage 2 is invalid; give one of 0, 1, 3"),
        (lambda: ModelBytes(params=-1.0), "params=-1.0 is invalid"),
        (
            lambda: ModelBytes(message=(1.0, 2.0)).for_parts(num_parts=4, num_ranks=4),
            "message has 2 values for 4 parts",
        ),
    ],
)
def test_bad_layouts_are_user_errors(make: object, needle: str) -> None:
    with pytest.raises(UserError, match=needle):
        make()  # type: ignore[operator]


def test_avgpipe_on_ranks_of_their_own_pays_an_all_reduce_of_each_part_between_its_replicas() -> None:
    """P = 2 pipelines of D = 2 on 4 ranks: part i's replicas on ranks i and 2 + i, one all-reduce of its
    parameters per averaging; across nodes when a node holds one pipeline. Shared ranks average in place."""
    model = ModelBytes(params=8.0)
    own = generate("avgpipe", num_stages=2, num_microbatches=2, own_ranks=True)
    one_node = Layout(network=Network(intra_node=FAST, inter_node=SLOW, gpus_per_node=4))
    two_nodes = Layout(network=Network(intra_node=FAST, inter_node=SLOW, gpus_per_node=2))
    inside = communication(own, None, one_node, model).averaging
    across = communication(own, None, two_nodes, model).averaging
    assert inside == (all_reduce_time(8.0, 2, FAST),) * 2
    assert across == (all_reduce_time(8.0, 2, SLOW),) * 2 and across[0] > inside[0]
    assert communication(own, None, two_nodes, model).as_dict()["avg_all_reduce"] == list(across)
    shared = generate("avgpipe", num_stages=2, num_microbatches=2)
    assert communication(shared, None, two_nodes, model).averaging == ()
