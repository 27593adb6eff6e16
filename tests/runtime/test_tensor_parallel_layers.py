"""Tensor-parallel layers: on 2 ranks, outputs and gradients equal the whole layer's, W deferrable."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from pipeweave.errors import UserError
from pipeweave.models.build import build_layers, check_tensor_parallel, tensor_parallel_plan
from pipeweave.models.layers import Deferrable, WeightGradStore
from pipeweave.models.spec import ModelSpec
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.run.launch import launch
from pipeweave.runtime.stage.sequence_parallel import sum_partial
from pipeweave.runtime.stage.tensor_parallel import TensorParallel, gather, split, split_layers

pytestmark = pytest.mark.distributed

GPT = ModelSpec(kind="gpt", layers=1, hidden=16, heads=4, seq_len=6, vocab=32)
MLP = ModelSpec(kind="mlp", layers=1, hidden=8)


def _inputs(spec: ModelSpec, index: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    if spec.kind == "gpt" and index == 0:
        return torch.randint(0, spec.vocab, (3, spec.seq_len), generator=g)
    return (
        torch.randn(3, spec.seq_len, spec.hidden, generator=g) if spec.kind == "gpt" else torch.randn(3, 8, generator=g)
    )


def _run(layer: torch.nn.Module, x: torch.Tensor, defer: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    store = WeightGradStore()
    for m in layer.modules():
        if isinstance(m, Deferrable):
            m.grad_store = store
    if x.is_floating_point():
        x = x.clone().requires_grad_(True)
    y = layer(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
    store.deferring = defer
    y.backward(g)
    store.deferring = False
    if defer:  # W: the deferred weight gradients, after the input gradient
        assert all(p.grad is None for n, p in layer.named_parameters() if "norm" not in n)
        for fn, _ in store.pending:
            fn()
    return y.detach(), x.grad if x.is_floating_point() else None


def _compare(context: RankContext, payload: tuple[ModelSpec, int, bool]) -> list[str]:
    rank, world = context.process, context.world
    spec, index, defer = payload
    tp = TensorParallel(dist.group.WORLD, rank, world)
    (full,) = build_layers(spec, [index])
    (layer,) = build_layers(spec, [index])
    cut = split(layer, tensor_parallel_plan(spec, index, layer), tp, f"layer {index}")
    x = _inputs(spec, index)
    y_full, gx_full = _run(full, x, defer=False)
    y, gx = _run(cut, x, defer)
    problems = []
    if not torch.allclose(y, y_full, rtol=1e-5, atol=1e-6):
        problems.append("output")
    if gx is not None and not torch.allclose(gx, gx_full, rtol=1e-5, atol=1e-6):
        problems.append("input gradient")
    whole = dict(full.named_parameters())
    shards = [n for n, p in cut.named_parameters() if p.shape != whole[n].shape]
    if bool(shards) == (spec.kind == "gpt" and index == 0):  # all but the embedding are split
        problems.append(f"split parameters: {shards}")
    for name, p in cut.named_parameters():
        if not torch.equal(gather(p, tp), whole[name].detach()):  # the shards put back are the whole weight
            problems.append(f"{name} gathered")
        expect = whole[name].grad
        if p.shape != expect.shape:  # a shard: find its rows or columns in the whole gradient
            expect = _shard_of(name, expect, p.shape, rank, world, spec)
        assert p.grad is not None, name
        if not torch.allclose(p.grad, expect, rtol=1e-5, atol=1e-6):
            problems.append(name)
    return problems


def _shard_of(
    name: str, whole: torch.Tensor, shape: torch.Size, rank: int, world: int, spec: ModelSpec
) -> torch.Tensor:
    if name.endswith("qkv.weight") or name.endswith("qkv.bias"):  # this rank's heads of Q, K and V
        return torch.cat([part.chunk(world)[rank] for part in whole.chunk(3)])
    if whole.shape[0] != shape[0]:
        return whole.chunk(world)[rank]
    return whole.chunk(world, dim=1)[rank]


@pytest.mark.parametrize(
    ("spec", "index", "defer"),
    [
        (GPT, 1, False),
        (GPT, 1, True),
        (GPT, 2, True),
        (GPT, 0, False),
        (MLP, 0, True),
    ],
    ids=["gpt-block-B", "gpt-block-I+W", "gpt-head-I+W", "gpt-embedding", "mlp-I+W"],
)
def test_a_split_layer_computes_what_the_whole_layer_does(spec: ModelSpec, index: int, defer: bool) -> None:
    # float32: the row-parallel sums partial products in another order; 1e-5 relative holds that.
    assert launch(_compare, (spec, index, defer), 2) == []


def _local_only(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("a collective in W")


def _compare_sequence_parallel(context: RankContext, _: Any) -> list[str]:
    """A gpt block on this rank's half of the sequence: I then W (W with every collective refused), the
    partial gradients summed over the group; against the whole block's on the whole sequence."""
    rank, world = context.process, context.world
    tp = TensorParallel(dist.group.WORLD, rank, world, sequence_parallel=True)
    (full,) = build_layers(GPT, [1])
    (cut,) = split_layers(GPT, [1], build_layers(GPT, [1]), tp)
    x = _inputs(GPT, 1)
    y_full, gx_full = _run(full, x, defer=False)
    store = WeightGradStore()
    for m in cut.modules():
        if isinstance(m, Deferrable):
            m.grad_store = store
    mine = x.chunk(world, dim=1)[rank].clone().requires_grad_(True)
    y = cut(mine)
    store.deferring = True
    y.backward(torch.randn(y_full.shape, generator=torch.Generator().manual_seed(3)).chunk(world, dim=1)[rank])
    store.deferring = False
    problems = [
        n for n, p in cut.named_parameters() if p.grad is not None and n.endswith("weight") and "norm" not in n
    ]  # the weights' gradients wait for W
    with pytest.MonkeyPatch.context() as patch:
        for name in ("all_gather", "reduce_scatter", "all_reduce"):
            patch.setattr(dist, name, _local_only)
        for fn, _held in store.pending:
            fn()
    sum_partial(list(cut.parameters()), tp)
    if not torch.allclose(y, y_full.chunk(world, dim=1)[rank], rtol=1e-5, atol=1e-6):
        problems.append("output")
    if not torch.allclose(mine.grad, gx_full.chunk(world, dim=1)[rank], rtol=1e-5, atol=1e-6):
        problems.append("input gradient")
    whole = dict(full.named_parameters())
    for name, p in cut.named_parameters():
        expect = whole[name].grad
        if p.shape != expect.shape:
            expect = _shard_of(name, expect, p.shape, rank, world, GPT)
        if not torch.allclose(p.grad, expect, rtol=1e-5, atol=1e-6):
            problems.append(name)
    return problems


def test_a_sequence_parallel_block_computes_the_whole_blocks_shard_with_w_local() -> None:
    # The g / g-bar collectives run in I; W is refused every collective and still gives the gradients.
    assert launch(_compare_sequence_parallel, None, 2) == []


@pytest.mark.parametrize(
    ("spec", "size", "message"),
    [
        (
            ModelSpec(kind="gpt", layers=1, hidden=16, heads=4, vocab=32),
            3,
            "--heads 4 is not divisible by --tensor-parallel 3",
        ),
        (ModelSpec(kind="gpt", layers=1, hidden=12, heads=6, vocab=30), 4, "--heads 6 is not divisible"),
        (ModelSpec(kind="gpt", layers=1, hidden=16, heads=2, vocab=33), 2, "the vocabulary 33 is not divisible"),
        (ModelSpec(kind="mlp", layers=1, hidden=3), 8, "4 x --hidden 12 is not divisible by --tensor-parallel 8"),
    ],
)
def test_an_uneven_split_is_one_line(spec: ModelSpec, size: int, message: str) -> None:
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        check_tensor_parallel(spec, size)


def test_a_tp_plan_naming_a_missing_module_is_one_line() -> None:
    layer: Any = build_layers(MLP, [0])[0]
    with pytest.raises(
        UserError,
        match=r"tp_plan\[0\]: the TP plan names 'mlp.up', which is not a linear layer of "
        r"it; give one of up, down",
    ):
        split(layer, {"mlp.up": "colwise"}, TensorParallel(None, 0, 2), "tp_plan[0]")
    with pytest.raises(UserError, match="style 'column' for 'up' is unknown"):
        split(layer, {"up": "column"}, TensorParallel(None, 0, 2), "tp_plan[0]")
