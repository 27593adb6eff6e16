"""The planner's mixture-of-experts and context-parallel terms (``planner.moe``): each one against its own
formula, and each one shown to move the prediction the way it must (a test per term that fails without it)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeweave.errors import UserError
from pipeweave.planner.candidate import Config
from pipeweave.planner.costs import Cluster, block_times
from pipeweave.planner.efficiency import Efficiency
from pipeweave.planner.evaluate import Evaluator
from pipeweave.planner.flops import block_gemms, step_flops
from pipeweave.planner.hardware import GPUS
from pipeweave.planner.memory import block_activation_bytes, part_parameters
from pipeweave.planner.moe import all_to_all_time, ring_time
from pipeweave.planner.runnable import refusal, train_command
from pipeweave.planner.space import Fixed, configurations
from pipeweave.planner.transformer import MODELS, Transformer

IDEAL = Efficiency(eta_max=1.0, n_half=0.0)
H100 = GPUS["h100-sxm"]
DENSE = Transformer(layers=8, hidden=1024, heads=8, seq_len=4096, vocab=32000, dropout=False)
MOE = replace(DENSE, moe_experts=8, moe_top_k=2)


def config(**kw: object) -> Config:
    base: dict[str, object] = dict(
        tp=1, pp=1, dp=8, chunks=1, microbatch_size=1, microbatches=4, schedule="1f1b", recompute="none", zero=0
    )
    return Config(**{**base, **kw})  # type: ignore[arg-type]


def evaluator(model: Transformer, batch: int = 32) -> Evaluator:
    return Evaluator(cluster=Cluster(model=model, gpu=H100, efficiency=IDEAL), batch=batch)


def test_mixtral_parameters_are_the_papers() -> None:
    m = MODELS["mixtral-8x7b"]
    active = m.parameters - m.layers * m.expert_parameters * (1 - m.moe_top_k / m.moe_experts)
    assert round(m.parameters / 1e9, 1) == 46.7 and round(active / 1e9, 1) == 12.9  # Jiang et al. 2024


def test_router_and_experts_flops() -> None:
    """Per token and MoE block: the router's h x E, and k MLPs instead of one."""
    b, s, h, f, e, k = 1, MOE.seq_len, MOE.hidden, MOE.ffn_hidden, 8, 2
    dense = sum(g.flops for g in block_gemms(DENSE, microbatch_size=b, tp=1))
    moe = sum(g.flops for g in block_gemms(MOE, microbatch_size=b, tp=1, ep=4))
    assert moe - dense == pytest.approx(2 * b * s * h * e + (k - 1) * 2 * (2 * b * s * h * f))
    # every other block with experts: half the difference
    half = sum(g.flops for g in block_gemms(replace(MOE, moe_every=2), microbatch_size=b, tp=1))
    assert half - dense == pytest.approx((moe - dense) / 2)
    assert step_flops(MOE, 4, recompute="none") > step_flops(DENSE, 4, recompute="none")


def test_experts_memory_divides_by_ep() -> None:
    """The experts' parameters of a part: E / EP experts on each rank; the rest whole."""
    one, four = part_parameters(MOE, 2, ep=1), part_parameters(MOE, 2, ep=4)
    experts = MOE.layers / 2 * MOE.moe_experts * MOE.mlp_parameters
    assert [a - b for a, b in zip(one, four)] == pytest.approx([experts * 3 / 4] * 2)
    ev = evaluator(MOE)
    mem = {
        ep: ev.evaluate(config(ep=ep, schedule="1f1b")).memory.params  # type: ignore[union-attr]
        for ep in (1, 8)
    }
    assert mem[8] < mem[1]


def test_dispatch_buffers_are_activations() -> None:
    """With k = 1 the experts' MLP activations are the dense MLP's: what is left is the dispatch buffers (k s h
    each way, in BF16) and the router's FP32 probabilities."""
    one = replace(MOE, moe_top_k=1)
    s, h, e = MOE.seq_len, MOE.hidden, MOE.moe_experts
    dense = block_activation_bytes(DENSE, tp=1, recompute="none")[0]
    assert block_activation_bytes(one, tp=1, recompute="none")[0] - dense == pytest.approx(2 * s * h * 2 + 4 * s * e)
    two = block_activation_bytes(MOE, tp=1, recompute="none")[0]
    assert two - dense > 2 * (block_activation_bytes(one, tp=1, recompute="none")[0] - dense)


def test_all_to_all_bytes_and_links() -> None:
    """k s b h x 2 bytes x (EP - 1) / EP each way, slower once the EP group crosses nodes."""
    net = H100.network()
    within = all_to_all_time(MOE, H100, microbatch_size=2, tp=1, ep=4)
    nbytes = 2 * MOE.seq_len * 2 * MOE.hidden * 2 * 3 / 4
    assert within == pytest.approx(net.intra_node.time(nbytes))
    assert all_to_all_time(MOE, H100, microbatch_size=2, tp=1, ep=1) == 0.0
    assert all_to_all_time(DENSE, H100, microbatch_size=2, tp=1, ep=4) == 0.0
    across = all_to_all_time(MOE, H100, microbatch_size=2, tp=4, ep=4)  # TP x EP = 16 > 8 GPUs a node
    assert across == pytest.approx(net.inter_node.time(nbytes / 4))
    assert across > within / 4


def test_all_to_all_in_forward_and_backward() -> None:
    """Two all-to-alls in F and two in I, on top of a dense-EP-free block; none without EP."""
    c = Cluster(model=MOE, gpu=H100, efficiency=IDEAL)
    apart = block_times(c, tp=1, microbatch_size=1, recompute="none", ep=1)
    split = block_times(c, tp=1, microbatch_size=1, recompute="none", ep=8)
    a2a = 2 * all_to_all_time(MOE, H100, microbatch_size=1, tp=1, ep=8)
    assert split.a2a == pytest.approx(a2a) and apart.a2a == 0.0
    # same FLOPs at EP 8 and EP 1 with ideal GEMMs: the difference is the all-to-alls
    assert split.f - apart.f == pytest.approx(a2a) and split.i - apart.i == pytest.approx(a2a)
    step = {n: evaluator(MOE).evaluate(config(ep=8, tp=n, dp=8)) for n in (1, 2)}
    assert step[1] is not None and step[2] is not None
    crossing = evaluator(MOE).block(config(ep=8, tp=2, dp=8)).a2a
    inside = evaluator(MOE).block(config(ep=8, tp=1, dp=8)).a2a
    assert crossing > inside  # TP 2 x EP 8 spans two nodes: the all-to-all grows


def test_fb_pairs_hide_the_all_to_all() -> None:
    """dualpipe's F&B pairs hide all-to-all behind the other half's compute; --no-overlap-fb's order does not."""
    ev = evaluator(MOE, batch=64)
    c = config(pp=2, dp=8, ep=8, microbatches=8, schedule="dualpipe")
    f, i, _ = ev.part_times(c, 2)
    hidden_f, hidden_i, _, _ = ev.times(c, 2)
    block = ev.block(c)
    assert all(x < y for x, y in zip(hidden_f, f)) and all(x < y for x, y in zip(hidden_i, i))
    assert all(y - x <= MOE.layers / 2 * block.a2a + 1e-12 for x, y in zip(hidden_f, f))
    dense = evaluator(DENSE, batch=64)
    assert dense.times(replace(c, ep=1), 2)[0] == dense.part_times(replace(c, ep=1), 2)[0]


def test_context_parallel_divides_activations_and_flops() -> None:
    for recompute in ("none", "full"):
        one = block_activation_bytes(DENSE, tp=1, recompute=recompute)
        two = block_activation_bytes(DENSE, tp=1, recompute=recompute, cp=2)
        assert two == pytest.approx(tuple(x / 2 for x in one))
    whole = sum(g.flops for g in block_gemms(DENSE, microbatch_size=1, tp=1) if not g.weight)
    half = sum(g.flops for g in block_gemms(DENSE, microbatch_size=1, tp=1, cp=2) if not g.weight)
    assert half == pytest.approx(whole / 2)
    ev = evaluator(DENSE)
    peak = {cp: ev.evaluate(config(cp=cp, dp=4)).memory.activations for cp in (1, 2)}  # type: ignore[union-attr]
    assert peak[2] == pytest.approx(peak[1] / 2, rel=1e-6)


def test_ring_exposed_beyond_attention() -> None:
    """C - 1 steps of the local K/V block, each hidden behind 1/C of the attention where shorter."""
    link = H100.network().intra_node
    kv = 2 * DENSE.seq_len / 4 * DENSE.kv_hidden * 2
    bare = ring_time(DENSE, H100, microbatch_size=1, tp=1, cp=4, attention_f=0.0, attention_i=0.0)
    assert bare == pytest.approx((3 * link.time(kv), 3 * 2 * link.time(kv)))  # K/V, and their gradients
    part = ring_time(DENSE, H100, microbatch_size=1, tp=1, cp=4, attention_f=4 * link.time(kv) / 2, attention_i=0.0)
    assert part[0] == pytest.approx(3 * link.time(kv) / 2)
    across = ring_time(DENSE, H100, microbatch_size=1, tp=8, cp=4, attention_f=0.0, attention_i=0.0)
    assert across[0] > bare[0] / 8  # TP 8 x C 4 spans nodes
    c = Cluster(model=DENSE, gpu=H100, efficiency=IDEAL)
    assert block_times(c, tp=1, microbatch_size=1, recompute="none", cp=4).ring_f >= 0.0


def test_cp_gradients_reduced_like_dp() -> None:
    ev = evaluator(DENSE)
    assert ev.layout(config(cp=2, dp=4)).dp == 8
    one = ev.evaluate(config(cp=1, dp=4))
    two = ev.evaluate(config(cp=2, dp=4))
    assert one is not None and two is not None
    assert two.terms["DP reduction"] > one.terms["DP reduction"]


def test_space_searches_ep_and_cp() -> None:
    long = replace(MOE, seq_len=8192)
    space = list(configurations(long, 16, 32, 8, Fixed(schedule="1f1b", recompute="none")))
    assert {c.ep for c in space} == {1, 2, 4, 8} and {c.cp for c in space} == {1, 2, 4}
    assert all(c.zero == 0 for c in space if c.ep > 1)
    assert all(c.gpus == 16 for c in space)
    dense = list(configurations(replace(DENSE, seq_len=2048), 16, 32, 8, Fixed(schedule="1f1b")))
    assert {c.ep for c in dense} == {1} and {c.cp for c in dense} == {1}


def test_train_command_and_refusals() -> None:
    c = config(ep=4, cp=2, dp=4)
    args = train_command(c, MOE, batch=16)
    line = " ".join(args)
    assert "--moe-experts 8 --moe-top-k 2 --moe-every 1" in line
    assert "--expert-parallel 4" in line and "--context-parallel 2" in line
    assert refusal(c, MOE) is None
    assert "--zero" in (refusal(replace(c, zero=1), MOE) or "")
    assert "--moe-experts" in (refusal(c, DENSE) or "")
    assert "2C" in (refusal(replace(c, ep=1, cp=3), replace(DENSE, seq_len=4097)) or "")


def test_bad_moe_shape_is_one_line() -> None:
    with pytest.raises(UserError, match="--moe-top-k 9"):
        replace(MOE, moe_top_k=9)


def test_plan_command_takes_trains_moe_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from pipeweave.cli import main

    tiny = ["plan", "--model", "llama", "--layers", "4", "--hidden", "64", "--heads", "4", "--seq-len", "32"]
    tiny += ["--vocab", "256", "--gpus", "4", "--global-batch", "8", "--gpus-per-node", "4", "--time-limit", "0"]
    assert main([*tiny, "--moe-experts", "4", "--expert-parallel", "2", "--explain", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "--moe-experts 4 --moe-top-k 2" in out and "--expert-parallel 2" in out
    assert "expert all-to-all" in out and "load imbalance among the experts" in out
    assert main([*tiny, "--moe-top-k", "2"]) != 0
    assert "--moe-top-k describes the experts; give --moe-experts E" in capsys.readouterr().err
    assert main(["plan", "--model", "llama3-8b", "--moe-experts", "8", "--gpus", "8", "--global-batch", "8"]) != 0
    assert "--moe-experts changes the preset" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--expert-parallel", "2"], "--expert-parallel 2 splits the experts, and llama has none"),
        (["--moe-experts", "6", "--expert-parallel", "4"], "--expert-parallel 4 splits the experts"),
        (["--context-parallel", "3"], "--context-parallel 3 splits each sequence into 2C = 6 chunks"),
    ],
)
def test_plan_refuses_parallelism_the_model_cannot_take(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    from pipeweave.cli import main

    tiny = ["plan", "--model", "llama", "--layers", "4", "--hidden", "64", "--heads", "4", "--seq-len", "32"]
    assert main([*tiny, "--gpus", "4", "--global-batch", "8", *argv]) != 0
    assert message in capsys.readouterr().err
