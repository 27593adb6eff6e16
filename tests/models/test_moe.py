"""The mixture-of-experts layer (``models.moe``): routing, dispatch and combine, the auxiliary loss's gradient,
capacity, experts without tokens, zero bubble's deferred W, sizes, and its options' one-line errors."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch
from config_defaults import train_config
from torch.utils.flop_counter import FlopCounterMode

from pipeweave.config import ModelSpec, TrainConfig
from pipeweave.config.cli import add_arguments, from_arguments
from pipeweave.errors import UserError
from pipeweave.models.build import build_layers, tensor_parallel_plan
from pipeweave.models.moe import MoE, Routing, attach_aux_losses
from pipeweave.runtime.run.prepare import prepare
from pipeweave.runtime.stage.worker import StageWorker

GPT = ModelSpec(kind="gpt", layers=2, hidden=8, heads=2, seq_len=6, moe_experts=4, moe_top_k=2)
LLAMA = ModelSpec(kind="llama", layers=2, hidden=8, heads=2, seq_len=6, ffn_hidden=12, moe_experts=4, moe_top_k=2)


def _moe(spec: ModelSpec = GPT) -> MoE:
    return MoE(spec, generator=torch.Generator().manual_seed(1))


def _dense_sum(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every token through every expert, weighted by its gate where routed: the layer written the slow way."""
    flat = x.reshape(-1, x.shape[-1])
    routing, _ = moe.router(flat)
    out = torch.zeros_like(flat)
    for e, expert in enumerate(moe.experts.local):
        weight = (routing.gates * (routing.experts == e)).sum(-1, keepdim=True)
        out = out + weight * expert(flat)
    return out.reshape(x.shape)


@pytest.mark.parametrize("spec", [GPT, LLAMA, dataclasses.replace(GPT, moe_router="sigmoid", moe_top_k=1)])
def test_dispatch_and_combine_equal_every_expert_on_every_token_weighted(spec: ModelSpec) -> None:
    moe = _moe(spec)
    x = torch.randn(3, 5, 8)
    torch.testing.assert_close(moe(x), _dense_sum(moe, x), rtol=1e-5, atol=1e-6)


def test_the_injected_gradient_is_the_auxiliary_loss_added_to_the_objective() -> None:
    moe, x, g = _moe(), torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    (moe(x) * g).sum().backward()
    injected = {n: p.grad.clone() for n, p in moe.named_parameters()}
    moe.zero_grad(set_to_none=True)
    flat = x.reshape(-1, 8)
    routing, aux = moe.router(flat)
    rows, counts, handle = moe.dispatcher.dispatch(flat, routing)
    explicit = (moe.dispatcher.combine(moe.experts(rows, counts), handle).reshape(x.shape) * g).sum() + aux
    explicit.backward()
    for name, p in moe.named_parameters():
        torch.testing.assert_close(injected[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert aux > 0
    assert not torch.equal(injected["router.gate.weight"], _router_grad_without_aux(x, g))


def _router_grad_without_aux(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    moe = MoE(dataclasses.replace(GPT, moe_aux_loss=0.0), generator=torch.Generator().manual_seed(1))
    (moe(x) * g).sum().backward()
    return moe.router.gate.weight.grad  # type: ignore[return-value]


def test_the_auxiliary_losses_gradient_carries_the_loss_scale() -> None:
    """fp16: a backward started from the loss scale S gives every gradient, the auxiliary loss's included, S x."""
    x, g = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    grads = []
    for scale in (1.0, 8.0):
        moe = _moe()
        attach_aux_losses(moe, batch_size=None).grad_scale = scale
        (moe(x) * g * scale).sum().backward()
        grads.append(moe.router.gate.weight.grad)
    torch.testing.assert_close(grads[1], 8 * grads[0])


def test_the_auxiliary_loss_is_recorded_scaled_by_the_microbatch_share() -> None:
    moe = _moe()
    losses = attach_aux_losses(moe, batch_size=8)
    x = torch.randn(2, 5, 8)
    moe(x)
    _, aux = moe.router(x.reshape(-1, 8))
    torch.testing.assert_close(losses.take(), aux * 2 / 8)
    assert losses.take() is None


def test_uniform_routing_costs_the_coefficient() -> None:
    moe = _moe()
    with torch.no_grad():
        moe.router.gate.weight.zero_()  # every probability 1/E, ties broken alike: f_i P_i sums to 1/E
    flat = torch.randn(16, 8)
    _, aux = moe.router(flat)
    torch.testing.assert_close(aux, torch.tensor(GPT.moe_aux_loss))


def test_an_expert_without_tokens_gets_a_zero_gradient() -> None:
    moe = _moe(LLAMA)
    with torch.no_grad():  # positive inputs, expert 3's router row negative: never among the top 2 of 4
        moe.router.gate.weight.abs_()
        moe.router.gate.weight[3] = -1.0
    x = torch.rand(2, 5, 8) + 0.1
    moe(x).square().sum().backward()
    starved, fed = moe.experts.local[3], moe.experts.local[0]
    for p in starved.parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) == 0
    assert all(torch.count_nonzero(p.grad) > 0 for p in fed.parameters())


def test_capacity_drops_the_assignments_over_it_first_choices_first() -> None:
    spec = dataclasses.replace(GPT, moe_capacity=0.5)
    moe = _moe(spec)
    flat = torch.randn(12, 8)
    routing, _ = moe.router(flat)
    assert routing.kept is not None
    capacity = 3  # ceil(0.5 x 12 tokens x 2 / 4 experts)
    _, counts, _ = moe.dispatcher.dispatch(flat, routing)
    assert max(counts) <= capacity and sum(counts) == int(routing.kept.sum()) < 24
    for e in range(4):  # an expert full of first choices takes no second choice
        first = int((routing.experts[:, 0] == e).sum())
        second_kept = int(((routing.experts[:, 1] == e) & routing.kept[:, 1]).sum())
        assert second_kept <= max(0, capacity - first)
    # a dropped assignment adds nothing: the layer equals the dense sum over kept assignments
    kept = Routing(routing.experts, routing.gates * routing.kept, None)
    rows, c, handle = moe.dispatcher.dispatch(flat, kept)
    torch.testing.assert_close(
        moe.dispatcher.combine(moe.experts(rows, c), handle), moe(flat.reshape(1, 12, 8)).reshape(12, 8)
    )


@pytest.mark.parametrize("spec", [GPT, LLAMA])
def test_zero_bubbles_w_covers_the_router_and_the_experts(spec: ModelSpec) -> None:
    """I defers every weight gradient of an MoE block (router and experts); I then W equals B."""
    x = torch.randint(0, 256, (3, 6))
    target = torch.randint(0, 256, (3, 6))
    full = StageWorker(spec, range(spec.num_layers), batch_size=3)
    split = StageWorker(spec, range(spec.num_layers), batch_size=3)
    full.forward(0, x, target)
    full.backward(0)
    split.forward(0, x, target)
    split.backward_input(0)
    moe_params = {n: p for n, p in split.named_parameters().items() if ".moe." in n}
    assert moe_params and all(p.grad is None for p in moe_params.values())
    split.backward_weight(0)
    want = full.named_parameters()
    for name, p in split.named_parameters().items():
        torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-6, atol=0, msg=name)


def test_every_nth_block_has_experts() -> None:
    spec = dataclasses.replace(LLAMA, layers=4, moe_every=2)
    blocks = build_layers(spec, range(1, 5))
    assert [hasattr(b, "moe") for b in blocks] == [False, True, False, True]


@pytest.mark.parametrize("spec", [GPT, LLAMA])
def test_a_block_holds_e_mlps_and_computes_k_of_them(spec: ModelSpec) -> None:
    """What the partitioners measure of a layer (``runtime.profile``, ``run.sizes``): parameters E x MLP + the
    router, forward FLOPs k x MLP + the router per token (dropless)."""
    dense = dataclasses.replace(spec, moe_experts=None)
    moe_block, dense_block = build_layers(spec, [1])[0], build_layers(dense, [1])[0]
    h, e, k = spec.hidden, spec.moe_experts, spec.moe_top_k
    mlp = sum(p.numel() for n, p in dense_block.named_parameters() if not n.startswith(("attn", "norm")))
    others = sum(p.numel() for n, p in dense_block.named_parameters() if n.startswith(("attn", "norm")))
    assert sum(p.numel() for p in moe_block.parameters()) == others + e * mlp + h * e  # type: ignore[operator]
    x = torch.randn(2, 6, h)
    flops = []
    for block in (moe_block, dense_block):
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            block(x)
        flops.append(counter.get_total_flops())
    tokens, mlp_flops = 12, 2 * 12 * mlp  # a matmul of weights w costs 2 w per token (biases not counted)
    if spec.kind == "gpt":
        mlp_flops = 2 * tokens * (mlp - 5 * h)  # the biases (4h + h) are no matmul
    assert flops[0] - flops[1] == (k - 1) * mlp_flops + 2 * tokens * h * e


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"moe_experts": 4, "moe_top_k": 5}, "--moe-top-k 5 is invalid for --moe-experts 4"),
        ({"moe_experts": 4, "moe_top_k": 0}, "--moe-top-k 0 is invalid"),
        ({"kind": "mlp", "moe_experts": 4}, "--moe-experts 4 applies to --model gpt or llama"),
        ({"moe_experts": 4, "moe_capacity": 0.0}, "--moe-capacity 0.0 is invalid"),
        ({"moe_experts": 4, "moe_capacity": -1.5}, "--moe-capacity -1.5 is invalid"),
        ({"moe_experts": 4, "moe_every": 0}, "--moe-every 0 is invalid"),
        ({"moe_experts": -2}, "--moe-experts -2 is invalid"),
        ({"moe_experts": 4, "moe_router": "tanh"}, "--moe-router 'tanh' is unknown"),
    ],
)
def test_bad_options_are_one_line_naming_the_value(fields: dict[str, object], words: str) -> None:
    with pytest.raises(UserError) as caught:
        ModelSpec(**{"kind": "gpt", "hidden": 8, "heads": 2, **fields})  # type: ignore[arg-type]
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_experts_split_over_tensor_parallel_ranks_as_the_dense_mlp() -> None:
    """Each expert's plan is the dense block's MLP plan under its name; the router stays whole."""
    for spec in (GPT, LLAMA):
        dense_spec = dataclasses.replace(spec, moe_experts=None)
        dense = tensor_parallel_plan(dense_spec, 1, build_layers(dense_spec, [1])[0])
        plan = tensor_parallel_plan(spec, 1, build_layers(spec, [1])[0])
        mlp = {k: v for k, v in dense.items() if not k.startswith("attn.")}
        assert plan == {
            **{k: v for k, v in dense.items() if k.startswith("attn.")},
            **{f"moe.experts.local.{e}.{k}": v for e in range(4) for k, v in mlp.items()},
        }


def test_experts_refuse_sequence_parallelism_in_one_line() -> None:
    config = train_config(model=GPT, num_stages=2, tensor_parallel=2, sequence_parallel=True, batch_size=4)
    with pytest.raises(UserError, match="--sequence-parallel with --moe-experts 4 is not supported") as caught:
        prepare(config)
    assert "\n" not in str(caught.value)


def test_the_command_line_sets_the_options() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, TrainConfig)
    args = "--model llama --moe-experts 8 --moe-top-k 1 --moe-every 2 --moe-router sigmoid --moe-capacity 1.25"
    model = from_arguments(parser.parse_args([*args.split(), "--moe-aux-loss", "0.001"]), TrainConfig).model
    assert (model.moe_experts, model.moe_top_k, model.moe_every) == (8, 1, 2)
    assert (model.moe_router, model.moe_capacity, model.moe_aux_loss) == ("sigmoid", 1.25, 0.001)
    assert "load-balancing auxiliary loss" in " ".join(parser.format_help().split())
    assert ModelSpec(kind="gpt").moe_experts is None  # dense by default


def test_a_dense_model_keeps_its_parameter_names() -> None:
    block = build_layers(dataclasses.replace(GPT, moe_experts=0), [1])[0]
    assert {"up.weight", "down.weight"} <= {n for n, _ in block.named_parameters()}


def test_a_block_builds_on_the_meta_device_with_the_cpus_expert_seeds() -> None:
    """The experts' seeds are drawn on the CPU, so a block builds without data (``torch.device("meta")``)."""
    with torch.device("meta"):
        (block,) = build_layers(GPT, [1])
    assert block.moe.experts.local[0].up.weight.is_meta  # type: ignore[union-attr,index]
