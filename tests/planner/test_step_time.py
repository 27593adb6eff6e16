"""The step's time terms beyond the pipeline: NCCL's share of NVLink, hierarchical DP reductions, the optimizer
step, the loss on the last stage, the reduction of a split backward waiting for its W, and the terms adding up
to the step."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeweave.planner.candidate import Config
from pipeweave.planner.costs import (
    LOSS_BYTES,
    Cluster,
    deferral_times,
    head_times,
    part_times,
    tp_all_reduce,
    update_time,
)
from pipeweave.planner.efficiency import A100_CALIBRATED
from pipeweave.planner.evaluate import Evaluator
from pipeweave.planner.flops import head_gemm
from pipeweave.planner.hardware import GPUS, NCCL_NVLINK
from pipeweave.planner.transformer import MODELS, Transformer
from pipeweave.sim.network import Link, Network, all_reduce_time, hierarchical_time
from pipeweave.sim.parallel import Layout, gather_time, reduction_time

A100 = GPUS["a100-80gb"]
SMALL = Transformer(name="small", layers=8, hidden=1024, heads=16, seq_len=1024, vocab=32000)


def cluster(model: Transformer = SMALL, **gpu: object) -> Cluster:
    return Cluster(model=model, gpu=replace(A100, **gpu), efficiency=A100_CALIBRATED)


def config(**fields: object) -> Config:
    base = dict(
        tp=1, pp=1, dp=1, chunks=1, microbatch_size=1, microbatches=8, schedule="1f1b", recompute="none", zero=0
    )
    return Config(**{**base, **fields})  # type: ignore[arg-type]


def test_nvlink_collectives_move_at_nccls_share_of_the_line_rate() -> None:
    nbytes = 100e6
    nvlink = Link(bandwidth=300e9 * 370 / 450, latency=A100.latency)
    assert pytest.approx(370 / 450) == NCCL_NVLINK
    assert tp_all_reduce(cluster(), nbytes, 8) == pytest.approx(all_reduce_time(nbytes, 8, nvlink))
    assert A100.network().inter_node.bandwidth == 25e9  # the network cards at their rate


def test_a_dp_group_over_nodes_is_reduced_inside_them_first() -> None:
    net = A100.network()
    grads = 4e9
    layout = Layout(tp=2, dp=32, network=net)  # 4 replicas on each of 8 nodes
    inside = 3 * net.intra_node.latency + 3 / 4 * grads / net.intra_node.bandwidth
    between = 7 * net.inter_node.latency + 7 / 8 * grads / 4 / net.inter_node.bandwidth
    assert reduction_time(layout, grads, num_ranks=1) == pytest.approx(2 * inside + 2 * between)
    assert reduction_time(layout, grads, num_ranks=1) < all_reduce_time(grads, 32, net.inter_node) / 3
    zero = replace(layout, zero=1)
    assert reduction_time(zero, grads, num_ranks=1) == pytest.approx(inside + between)
    assert gather_time(zero, grads, num_ranks=1) == pytest.approx(inside + between)
    # one replica a node (TP 8): the flat ring on the network; one node: the ring on NVLink
    assert reduction_time(Layout(tp=8, dp=4, network=net), grads, num_ranks=1) == all_reduce_time(
        grads, 4, net.inter_node
    )
    assert reduction_time(Layout(tp=1, dp=8, network=net), grads, num_ranks=1) == all_reduce_time(
        grads, 8, net.intra_node
    )
    # it grows with the replicas (the ring's latencies), never shrinks
    sizes = [reduction_time(replace(layout, dp=p), grads, num_ranks=1) for p in (8, 64, 512, 4096)]
    assert sizes == sorted(sizes)
    unit = Network(intra_node=Link(bandwidth=8.0), inter_node=Link(bandwidth=1.0), gpus_per_node=4)
    assert hierarchical_time("all_reduce", 16.0, 4, 2, unit) == 7.0


def test_the_optimizer_step_ends_the_step() -> None:
    ev = Evaluator(cluster=cluster(), batch=8)
    r = ev.evaluate(config())
    assert r is not None
    params = SMALL.parameters + SMALL.vocab * SMALL.hidden  # the tied head's copy on the one part
    update = update_time(ev.cluster, params, zero=0, dp=1)
    assert update == pytest.approx(params * 42 / A100.memory_bandwidth)
    assert r.dp_exposed == pytest.approx(update) and r.terms["optimizer step"] == pytest.approx(update)
    sharded = ev.evaluate(config(dp=2, zero=1, microbatches=4))
    assert sharded is not None and sharded.terms["optimizer step"] < update  # the shard's: 1/2, the buffer whole


def test_the_loss_is_on_the_last_stage() -> None:
    c = cluster()
    f, i, w = head_times(c, tp=2, microbatch_size=2)
    gemm = head_gemm(SMALL, microbatch_size=2, tp=2)
    t = A100_CALIBRATED.seconds(gemm, A100.peak_flops)
    logits = 2 * 1024 * 16000
    assert f - t == pytest.approx(LOSS_BYTES[0] * logits / A100.memory_bandwidth)
    assert i - t - tp_all_reduce(c, 2 * 1024 * 1024 * 2.0, 2) == pytest.approx(
        LOSS_BYTES[1] * logits / A100.memory_bandwidth
    )
    assert w == t


def test_a_split_backward_reduces_its_gradients_after_the_last_w() -> None:
    ev = Evaluator(cluster=cluster(gpus_per_node=1), batch=64)  # every replica on its own node: a slow reduction
    c = config(pp=4, dp=2, microbatches=32, schedule="zb-h1", chunks=1)
    times = ev.times(c, 4)
    schedule = ev.pipeline.schedule(c, {})
    assert schedule is not None
    summary = ev.pipeline.summary(c, schedule, times)
    assert all(g > b for g, b in zip(summary.last_grad_start, summary.last_backward_start))  # W deferred past I
    layout = ev.layout(c)
    params = ev.param_bytes(c, 4)
    reduce = [reduction_time(layout, p, num_ranks=4) for p in params]
    tail = ev.dp_tail(c, layout, summary)
    assert tail >= max(s + r + ev.update(c, p) for s, r, p in zip(summary.last_grad_start, reduce, params)) - 1e-12


@pytest.mark.parametrize("schedule, chunks", [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-v", 2)])
def test_the_terms_add_up_to_the_step(schedule: str, chunks: int) -> None:
    ev = Evaluator(cluster=cluster(MODELS["gpt-1.7b"]), batch=64)
    r = ev.evaluate(config(tp=2, pp=4, dp=2, microbatches=32, schedule=schedule, chunks=chunks, zero=1))
    assert r is not None and r.fits
    work = [k for k in r.terms if k not in ("DP reduction", "optimizer step", "ZeRO all-gather")]
    pipeline = sum(r.terms[k] for k in work if k != "of which past the pipeline's end")
    assert pipeline == pytest.approx(r.step_time - r.dp_exposed)
    assert r.terms["of which past the pipeline's end"] == pytest.approx(r.dp_exposed)
    assert r.terms["TP collectives"] == pytest.approx(r.tp_comm)
    assert all(v >= 0 for v in r.terms.values()) and r.terms["DP reduction"] > 0 and r.terms["ZeRO all-gather"] > 0
    assert r.as_dict()["terms_s"] == r.terms


def test_a_deferred_w_reads_its_output_gradients_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """W deferral's cost (``planner.costs``, docs/guide/plan.md): every W of a split backward reads its GEMMs'
    output gradients again, 2 b s bytes per unit of output width on a TP rank (QKV 3h/N, out h, up 4h/N, down h;
    the head V/N), at the rate model's streaming rate ``peak eta_max / n_half``; a whole backward pays nothing;
    zb-h1's predicted step includes it, and drops without it."""
    c, b, tp = cluster(), 2, 2
    s, h, vocab = SMALL.seq_len, SMALL.hidden, SMALL.vocab
    per_byte = A100_CALIBRATED.n_half / (A100.peak_flops * A100_CALIBRATED.eta_max)
    block, head = deferral_times(c, tp=tp, microbatch_size=b)
    assert block == pytest.approx(2 * b * s * (3 * h / tp + h + 4 * h / tp + h) * per_byte)
    assert head == pytest.approx(2 * b * s * (vocab / tp) * per_byte)
    whole, split = (
        part_times(c, num_parts=4, tp=tp, microbatch_size=b, recompute="none", split_backward=x) for x in (False, True)
    )
    assert whole[:2] == split[:2]
    for k, (w, deferred) in enumerate(zip(whole[2], split[2])):  # two blocks a part, the head on the last
        assert deferred - w == pytest.approx(2 * block + (head if k == 3 else 0.0))
    zb, plain = (config(tp=tp, pp=4, microbatch_size=b, microbatches=16, schedule=n) for n in ("zb-h1", "1f1b"))
    with_it = Evaluator(cluster=c, batch=32).evaluate(zb)
    assert with_it is not None and with_it.terms["W deferral's re-reads"] == pytest.approx(16 * (2 * block + head))
    unsplit = Evaluator(cluster=c, batch=32).evaluate(plain)
    assert unsplit is not None and unsplit.terms["W deferral's re-reads"] == 0.0
    for module in ("pipeweave.planner.costs", "pipeweave.planner.evaluate"):
        monkeypatch.setattr(f"{module}.deferral_times", lambda *_, **__: (0.0, 0.0))
    without = Evaluator(cluster=c, batch=32).evaluate(zb)
    assert without is not None and without.step_time < with_it.step_time
