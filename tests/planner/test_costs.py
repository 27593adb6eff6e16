"""The planner's cost model against the papers' own formulas: Megatron-LM's FLOPs and parameters, the ZeRO
paper's bytes, Korthikanti et al.'s activations, and the simulator's peak."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeweave.planner.candidate import Config
from pipeweave.planner.costs import Cluster, block_times, hop_time, part_times
from pipeweave.planner.efficiency import Efficiency
from pipeweave.planner.evaluate import Evaluator
from pipeweave.planner.flops import block_gemms, head_gemm, step_flops
from pipeweave.planner.hardware import GPUS
from pipeweave.planner.memory import StateBytes, block_activation_bytes, fullest_gpu, gpu_memory
from pipeweave.planner.published import TABLE_1
from pipeweave.planner.transformer import MODELS
from pipeweave.schedule import generate
from pipeweave.sim.parallel import Layout

IDEAL = Efficiency(eta_max=1.0, n_half=0.0)


@pytest.mark.parametrize("row", TABLE_1, ids=lambda r: r.model)
def test_parameters_are_table_1s(row: object) -> None:
    published = {
        "gpt-1.7b": 1.7,
        "gpt-3.6b": 3.6,
        "gpt-7.5b": 7.5,
        "gpt-18b": 18.4,
        "gpt-39b": 39.1,
        "gpt-76b": 76.1,
        "gpt-145b": 145.6,
        "gpt-310b": 310.1,
        "gpt-530b": 529.6,
        "gpt-1t": 1008.0,
    }
    model = row.transformer  # type: ignore[attr-defined]
    assert round(model.parameters / 1e9, 1) == pytest.approx(published[model.name], abs=0.051)


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_gemm_flops_sum_to_equation_3(tp: int) -> None:
    m, b = MODELS["gpt-39b"], 4
    block = sum(g.flops for g in block_gemms(m, microbatch_size=b, tp=tp)) * tp
    head = head_gemm(m, microbatch_size=b, tp=tp).flops * tp
    # one forward of l blocks and the head, x 3 (forward, backward) + one more forward of the blocks
    assert 3 * (m.layers * block + head) + m.layers * block == pytest.approx(step_flops(m, b))
    assert step_flops(m, b) == pytest.approx(
        96
        * b
        * m.seq_len
        * m.layers
        * m.hidden**2
        * (1 + m.seq_len / (6 * m.hidden) + m.vocab / (16 * m.layers * m.hidden))
    )


def test_recompute_adds_the_replayed_forward_to_i_only() -> None:
    cluster = Cluster(model=MODELS["gpt-7.5b"], gpu=GPUS["a100-80gb"], efficiency=IDEAL)
    none, full = (block_times(cluster, tp=4, microbatch_size=2, recompute=r) for r in ("none", "full"))
    selective = block_times(cluster, tp=4, microbatch_size=2, recompute="selective")
    assert (full.f, full.w) == (none.f, none.w)
    assert full.i == pytest.approx(none.i + none.f)
    assert none.i < selective.i < full.i
    assert full.tp_i == 2 * none.tp_i > 0


def test_head_makes_the_last_part_heavier() -> None:
    cluster = Cluster(model=MODELS["gpt-1t"], gpu=GPUS["a100-80gb"], efficiency=IDEAL)
    f, i, w = part_times(cluster, num_parts=64, tp=8, microbatch_size=1, recompute="full")
    assert f[1] == f[62] < f[63] and w[1] < w[63] and f[0] > f[1]  # the embedding's all-reduce on the first


def test_scatter_gather_shortens_an_inter_node_message() -> None:
    model, gpu = MODELS["gpt-1t"], GPUS["a100-80gb"]
    split = Cluster(model=model, gpu=gpu, efficiency=IDEAL)
    whole = Cluster(model=model, gpu=gpu, efficiency=IDEAL, scatter_gather=False)
    nbytes = 2048 * 25600 * 2
    assert hop_time(whole, tp=8, microbatch_size=1, inter_node=True) == pytest.approx(5e-6 + nbytes / 25e9)
    assert (
        hop_time(split, tp=8, microbatch_size=1, inter_node=True)
        < hop_time(whole, tp=8, microbatch_size=1, inter_node=True) / 4
    )


def test_activations_are_korthikantis() -> None:
    m = MODELS["gpt-145b"]
    s, h, a, t = m.seq_len, m.hidden, m.heads, 8
    held, stash, during = block_activation_bytes(m, tp=t, recompute="none")
    assert held == pytest.approx(s * h * (10 + 24 / t + 5 * a * s / (h * t)))
    assert block_activation_bytes(m, tp=t, recompute="selective")[0] == pytest.approx(s * h * (10 + 24 / t))
    assert block_activation_bytes(m, tp=t, recompute="full")[:2] == (2 * s * h, stash)


def test_sequence_parallel_activations_are_korthikantis_table_2() -> None:
    m = MODELS["gpt-145b"]
    s, h, a, t = m.seq_len, m.hidden, m.heads, 8
    held, stash, _ = block_activation_bytes(m, tp=t, recompute="none", sequence_parallel=True)
    assert held == pytest.approx(s * h * (34 / t + 5 * a * s / (h * t)))
    assert block_activation_bytes(m, tp=t, recompute="selective", sequence_parallel=True)[0] == pytest.approx(
        s * h * 34 / t
    )
    assert block_activation_bytes(m, tp=t, recompute="full", sequence_parallel=True)[:2] == pytest.approx(
        (2 * s * h / t, 14 * s * h / t)
    )  # the block's input, and M_W, on 1/t of the sequence
    schedule = generate("1f1b", num_stages=2, num_microbatches=4)
    base, split = (
        gpu_memory(schedule, m, Layout(tp=t, sequence_parallel=sp), microbatch_size=1, recompute="selective")
        for sp in (False, True)
    )
    assert split.activations < base.activations and split.params == base.params


def test_memory_uses_the_simulated_peak_and_zero_shares() -> None:
    m = MODELS["gpt-39b"]
    schedule = generate("1f1b", num_stages=2, num_microbatches=12)
    base = gpu_memory(schedule, m, Layout(tp=8, dp=32), microbatch_size=4, recompute="full")
    zero1 = gpu_memory(schedule, m, Layout(tp=8, dp=32, zero=1), microbatch_size=4, recompute="full")
    per_gpu = m.parameters / 16  # TP 8 x PP 2, the embeddings and head shared out unevenly: within 5 %
    assert base.params == pytest.approx(2 * per_gpu, rel=0.05)
    # Megatron-LM's defaults: FP32 main gradients, FP32 master weights, Adam's two FP32 moments (18 bytes)
    assert (base.grads, base.master, base.optimizer) == (2 * base.params, 2 * base.params, 4 * base.params)
    assert zero1.optimizer == pytest.approx(base.optimizer / 32) and zero1.params == base.params
    assert zero1.master == pytest.approx(base.master / 32) and zero1.grads == base.grads
    # ZeRO 2 as train --zero 2 holds it: 1/32 slices, and while a backward runs the part whole with its slice
    zero2 = gpu_memory(schedule, m, Layout(tp=8, dp=32, zero=1), microbatch_size=4, recompute="full", zero2=True)
    assert zero2.grads == pytest.approx(base.grads * (1 + 2 / 32)) and zero2.master == zero1.master
    # four equal parts per GPU over P = 2 (interleaved): 4/2 + 1 + 1/2 = 3.5 parts' gradients against 4
    looped = generate("interleaved-1f1b", num_stages=2, num_microbatches=4, num_chunks=4)
    one, two = (fullest_gpu(looped, [1e9] * 8, Layout(dp=2, zero=1), [0.0, 0.0], zero2=z2) for z2 in (False, True))
    assert two.grads == pytest.approx(one.grads * 3.5 / 4)
    bf16 = gpu_memory(
        schedule,
        m,
        Layout(tp=8, dp=32),
        microbatch_size=4,
        recompute="full",
        state=StateBytes(grads="bf16", optimizer="sgd"),
    )
    assert (bf16.grads, bf16.optimizer) == (base.params, 2 * base.params)
    # the allocator's margin is 5 % of everything else; the workspace, with TP, an activation of 2 b s h bytes
    assert base.fragmentation == pytest.approx(0.05 * (base.total - base.fragmentation))
    assert base.workspace == 2 * 4 * m.seq_len * m.hidden
    # rank 0 of 1F1B holds D = 2 microbatches of its 24 blocks' inputs (2 s b h bytes), plus one replayed block
    held, _, during = block_activation_bytes(m, tp=8, recompute="full")
    assert base.activations == pytest.approx(4 * (2 * 24 * held + during))


def test_zero_3_gathers_before_each_f_and_i() -> None:
    one_per_node = replace(GPUS["a100-80gb"], gpus_per_node=1)  # the replicas on 32 nodes: a ring on the network
    cluster = Cluster(model=MODELS["gpt-1.7b"], gpu=one_per_node, efficiency=IDEAL)
    ev = Evaluator(cluster=cluster, batch=512)
    base = Config(
        tp=1, pp=1, dp=32, chunks=1, microbatch_size=1, microbatches=16, schedule="1f1b", recompute="none", zero=1
    )
    f1, i1, w1, _ = ev.times(base, 1)
    f3, i3, w3, _ = ev.times(Config(**{**base.as_dict(), "zero": 3}), 1)  # type: ignore[arg-type]
    assert f3[0] > f1[0] and i3[0] > i1[0] and w3 == w1  # 3.3 GB gathered at 25 GB/s outlasts the compute


@pytest.mark.parametrize(
    "schedule, chunks",
    [
        ("1f1b", 1),
        ("gpipe", 1),
        ("interleaved-1f1b", 2),
        ("zb-h1", 1),
        ("zb-h2", 1),
        ("zb-v", 2),
        ("chimera", 1),
        ("dualpipe-v", 2),
    ],
)
def test_time_bound_is_below_the_simulated_step_and_exact_for_1f1b(schedule: str, chunks: int) -> None:
    from pipeweave.planner.bound import time_bound

    cluster = Cluster(model=MODELS["gpt-39b"], gpu=GPUS["a100-80gb"], efficiency=IDEAL)
    ev = Evaluator(cluster=cluster, batch=64)
    config = Config(
        tp=8,
        pp=4,
        dp=2,
        chunks=chunks,
        microbatch_size=2,
        microbatches=16,
        schedule=schedule,
        recompute="selective",
        zero=1,
    )
    result = ev.evaluate(config, time_unfit=True)
    assert result is not None
    bound = time_bound(config, ev)
    assert bound <= result.step_time - result.dp_exposed + 1e-9
    if schedule in ("1f1b", "gpipe"):
        assert bound == pytest.approx(result.step_time - result.dp_exposed, rel=1e-9)


@pytest.mark.parametrize(
    "schedule, chunks",
    [
        ("1f1b", None),
        ("gpipe", None),
        ("interleaved-1f1b", 3),
        ("zb-h2", None),
        ("zb-v", None),
        ("chimera", None),
        ("dualpipe", None),
        ("dualpipe-v", None),
        ("gems", None),
    ],
)
@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
def test_the_profile_walk_finds_held_peaks_own_peaks(
    schedule: str, chunks: int | None, recompute: str, uneven: bool
) -> None:
    from pipeweave.planner.activations import activation_profile, peaks
    from pipeweave.planner.memory import activation_peaks, part_activation_bytes

    model = MODELS["gpt-39b"]
    s = generate(schedule, num_stages=4, num_microbatches=8, num_chunks=chunks)
    blocks = tuple(1 + 5 * (k % 3) for k in range(s.num_parts)) if uneven else ()  # every part its own size
    sizes = part_activation_bytes(model, s.num_parts, 8, recompute, blocks=blocks)
    walked = activation_peaks(s, model, 8, recompute, blocks=blocks)
    assert peaks(activation_profile(s), **sizes) == pytest.approx(walked)


def test_the_planner_with_sequence_parallelism_holds_fewer_activations_and_sends_smaller_messages() -> None:
    config = Config(
        tp=8, pp=4, dp=2, chunks=1, microbatch_size=2, microbatches=16, schedule="1f1b", recompute="selective", zero=1
    )
    results = []
    for sp in (False, True):
        cluster = Cluster(model=MODELS["gpt-39b"], gpu=GPUS["a100-80gb"], efficiency=IDEAL, sequence_parallel=sp)
        ev = Evaluator(cluster=cluster, batch=64)
        results.append((ev.evaluate(config, time_unfit=True), ev.hop(config, 4)))
    (whole, hop_whole), (split, hop_split) = results
    assert whole is not None and split is not None
    # Table 2 with selective recomputation: 34/t against 10 + 24/t, the whole rank's activations (blocks only)
    assert split.memory.activations == pytest.approx(whole.memory.activations * (34 / 8) / (10 + 24 / 8), rel=0.05)
    assert split.memory.params == whole.memory.params and hop_split < hop_whole


def test_the_naive_bound_is_its_makespan() -> None:
    from pipeweave.planner.bound import time_bound

    ev = Evaluator(cluster=Cluster(model=MODELS["gpt-39b"], gpu=GPUS["a100-80gb"], efficiency=IDEAL), batch=64)
    config = Config(
        tp=8, pp=4, dp=2, chunks=1, microbatch_size=2, microbatches=16, schedule="naive", recompute="full", zero=0
    )
    result = ev.evaluate(config, time_unfit=True)
    assert result is not None and time_bound(config, ev) <= result.step_time - result.dp_exposed + 1e-9
    assert time_bound(config, ev) == pytest.approx(result.step_time - result.dp_exposed, rel=0.01)  # hops aside


def test_presets_order_by_their_datasheets() -> None:
    row = Config(
        tp=8, pp=2, dp=32, chunks=1, microbatch_size=4, microbatches=12, schedule="1f1b", recompute="full", zero=0
    )
    steps = {}
    for name in ("a100-80gb", "h100-sxm", "h200"):
        cluster = Cluster(model=MODELS["gpt-39b"], gpu=GPUS[name], efficiency=IDEAL)
        result = Evaluator(cluster=cluster, batch=1536).evaluate(row)
        assert result is not None and result.fits
        steps[name] = result.step_time
    assert steps["h200"] < steps["h100-sxm"] < steps["a100-80gb"]  # same compute, H200's faster HBM


@pytest.mark.parametrize(
    "schedule, chunks",
    [("1f1b", None), ("interleaved-1f1b", 2), ("zb-h2", None), ("zb-v", None), ("chimera", None), ("dualpipe-v", None)],
)
def test_the_critical_path_is_the_makespan_and_a_bound_under_other_times(schedule: str, chunks: int | None) -> None:
    from pipeweave.planner.critical import critical_path
    from pipeweave.sim.cost import CostModel
    from pipeweave.sim.timeline import simulate

    s = generate(schedule, num_stages=4, num_microbatches=8, num_chunks=chunks)
    n = s.num_parts
    f, i, w = [1.0] * (n - 1) + [1.4], [1.1] * (n - 1) + [1.5], [0.7] * (n - 1) + [0.9]
    timeline = simulate(s, CostModel(f=f, b=i, w=w, comm=0.05))
    path = critical_path(timeline)
    makespan = max(row[-1].end for row in timeline.events)
    assert path.length(tuple(f), tuple(i), tuple(w), 0.05) == pytest.approx(makespan)
    other = ([2.0] * n, [1.0] * n, [1.5] * n)
    again = simulate(s, CostModel(f=other[0], b=other[1], w=other[2], comm=0.2))
    assert path.length(*map(tuple, other), 0.2) <= max(row[-1].end for row in again.events) + 1e-9
