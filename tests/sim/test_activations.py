"""Sequence parallelism in the simulator: activation bytes per GPU (Korthikanti et al. 2022, Table 2) and messages."""

from __future__ import annotations

import pytest

from pipeweave.planner.memory import activation_peaks
from pipeweave.planner.transformer import Transformer
from pipeweave.schedule import generate
from pipeweave.sim.activations import gpt_block_activations, rank_activations
from pipeweave.sim.network import Link, Network
from pipeweave.sim.parallel import Layout, layout_times, simulate_layout
from pipeweave.sim.timeline import Timeline
from pipeweave.sim.traffic import ModelBytes

S, H, A, B, LAYERS = 2048, 1024, 16, 2, 3  # a GPT part of 3 blocks, microbatches of 2 sequences
SBH = S * B * H


def gpt_part() -> ModelBytes:
    block = gpt_block_activations(seq_len=S, hidden=H, heads=A, microbatch_size=B)
    return ModelBytes(activation=LAYERS * block.held, replicated_activation=LAYERS * block.held_replicated)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_sequence_parallelism_lowers_the_activation_peak_by_table_2s_ratio(tp: int) -> None:
    schedule = generate("1f1b", num_stages=4, num_microbatches=8)  # rank r holds 4 - r microbatches at its peak
    without = rank_activations(schedule, None, Layout(tp=tp), gpt_part())
    with_sp = rank_activations(schedule, None, Layout(tp=tp, sequence_parallel=True), gpt_part())
    # Table 2, per block: s b h (10 + 24/t + 5 a s / (h t)) with TP alone, s b h (34/t + 5 a s / (h t)) with SP
    tp_alone, sp = SBH * (10 + 24 / tp + 5 * A * S / (H * tp)), SBH * (34 / tp + 5 * A * S / (H * tp))
    assert without == pytest.approx([(4 - r) * LAYERS * tp_alone for r in range(4)])
    assert with_sp == pytest.approx([(4 - r) * LAYERS * sp for r in range(4)])
    assert [s / w for s, w in zip(with_sp, without)] == pytest.approx([sp / tp_alone] * 4)


def test_the_planner_holds_the_same_blocks() -> None:
    # plan.memory builds on the same terms: its first rank (no head's logits there) of 1F1B (B only: no M_W)
    schedule = generate("1f1b", num_stages=4, num_microbatches=8)
    model = Transformer(layers=4 * LAYERS, hidden=H, heads=A, seq_len=S, attention="math")
    for sp in (False, True):
        planned = activation_peaks(schedule, model, 4, "none", sp)[0] * B  # per sample of a microbatch
        simulated = rank_activations(schedule, None, Layout(tp=4, sequence_parallel=sp), gpt_part())[0]
        assert simulated == pytest.approx(planned)


def makespan(timeline: Timeline) -> float:
    return max(e.end for row in timeline.events for e in row)


# 1F1B, D = 2, T = 1, f = b = w = 1 on one GPU, N = 2: F0 0.5 | hop | F1 0.5, B1 1 | hop | B0 1 = 3 + 2 hops.
TINY = generate("1f1b", num_stages=2, num_microbatches=1)
NET = Network(intra_node=Link(bandwidth=1.0), inter_node=Link(bandwidth=1.0))  # 1 byte/s, no latency


def test_the_step_is_unchanged_where_messages_do_not_matter() -> None:
    # TP collectives of 4 B (an all-gather and a reduce-scatter for each all-reduce: 2 (2-1)/2 x 4 = 4 s each,
    # two in F and two in I) and pipeline messages of no bytes
    model = ModelBytes(message=0.0, tp_message=4.0, tp_collectives=2)
    plain = simulate_layout(TINY, None, Layout(tp=2, network=NET), model)
    sp = simulate_layout(TINY, None, Layout(tp=2, network=NET, sequence_parallel=True), model)
    assert makespan(plain) == makespan(sp) == pytest.approx(3 + 4 * 2 * 4)
    assert makespan(simulate_layout(TINY, None, Layout(tp=2, sequence_parallel=True), model)) == 3  # no network


def test_the_step_is_shorter_by_the_messages_n_fold_cut() -> None:
    model = ModelBytes(message=6.0)  # a hop of 6 s, of 3 s with SP (each of the N = 2 ranks sends its half)
    plain = simulate_layout(TINY, None, Layout(tp=2, network=NET), model)
    sp = simulate_layout(TINY, None, Layout(tp=2, network=NET, sequence_parallel=True), model)
    assert (makespan(plain), makespan(sp)) == pytest.approx((3 + 2 * 6, 3 + 2 * 3))
    # and the search's scalar times: the hop shrinks, compute and collectives do not
    times = [
        layout_times(
            Layout(tp=2, network=NET, sequence_parallel=sp),
            f=1,
            b=1,
            w=1,
            comm=0.5,
            message=6.0,
            tp_collectives=2,
            num_ranks=2,
        )
        for sp in (False, True)
    ]
    assert times == [
        pytest.approx((0.5 + 12, 0.5 + 12, 0.5, 0.5 + 6)),
        pytest.approx((0.5 + 12, 0.5 + 12, 0.5, 0.5 + 3)),
    ]
