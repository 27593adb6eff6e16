"""The reference models: configuration checks, per-layer seeding, exact block formulas, custom layers' gradients."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pipeweave.errors import UserError
from pipeweave.models import ModelSpec, build_layers, loss_fn, uniform_parts
from pipeweave.models.layers import Deferrable, Embedding, LayerNorm, Linear, WeightGradStore


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"kind": "rnn"}, "rnn"),
        ({"layers": 0}, "layers=0"),
        ({"hidden": -1}, "hidden=-1"),
        ({"kind": "gpt", "hidden": 10, "heads": 3}, "heads=3"),
    ],
)
def test_spec_rejects_bad_values_in_one_line(kwargs: dict[str, object], word: str) -> None:
    with pytest.raises(UserError) as info:
        ModelSpec(**kwargs)  # type: ignore[arg-type]
    assert word in str(info.value) and "\n" not in str(info.value)


def test_num_layers_counts_gpt_embedding_and_head() -> None:
    assert ModelSpec(kind="mlp", layers=5).num_layers == 5
    assert ModelSpec(kind="gpt", layers=5).num_layers == 7


@pytest.mark.parametrize("num_layers, num_parts", [(1, 1), (5, 2), (7, 3), (8, 8), (10, 4)])
def test_uniform_parts_are_consecutive_and_balanced(num_layers: int, num_parts: int) -> None:
    parts = uniform_parts(num_layers, num_parts)
    assert len(parts) == num_parts
    assert [i for p in parts for i in p] == list(range(num_layers))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_uniform_parts_rejects_more_parts_than_layers() -> None:
    with pytest.raises(UserError, match="Reduce num_stages or increase num_layers"):
        uniform_parts(3, 4)


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_layer_initialisation_depends_only_on_seed_and_index(kind: str) -> None:
    spec = ModelSpec(kind=kind, layers=3, hidden=8, heads=2, seq_len=4)
    whole = build_layers(spec, range(spec.num_layers))
    for k in range(spec.num_layers):
        alone = build_layers(spec, [k])[0]
        for (name, a), (_, b) in zip(alone.named_parameters(), whole[k].named_parameters()):
            assert torch.equal(a, b), (k, name)
    # Two blocks of one model, and one block of two seeds, differ.
    assert not torch.equal(whole[1].up.weight, whole[2].up.weight)
    other = build_layers(ModelSpec(kind=kind, layers=3, hidden=8, heads=2, seq_len=4, seed=1), [1])[0]
    assert not torch.equal(other.up.weight, whole[1].up.weight)


def test_mlp_block_is_exactly_the_issue_formula() -> None:
    spec = ModelSpec(kind="mlp", layers=1, hidden=6)
    (block,) = build_layers(spec, [0])
    with torch.no_grad():
        block.norm.weight.uniform_(0.5, 1.5)  # non-trivial affine, so the check covers it
        block.norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(5, 6)
    n = F.layer_norm(x, (6,), block.norm.weight, block.norm.bias, 1e-5)
    expected = x + F.linear(F.gelu(F.linear(n, block.up.weight, block.up.bias)), block.down.weight, block.down.bias)
    torch.testing.assert_close(block(x), expected, rtol=1e-6, atol=1e-6)
    assert block.up.weight.shape == (24, 6) and block.down.weight.shape == (6, 24)


def test_gpt_is_causal_and_maps_bytes_to_logits() -> None:
    spec = ModelSpec(kind="gpt", layers=2, hidden=8, heads=2, seq_len=6)
    layers = build_layers(spec, range(spec.num_layers))
    idx = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(0))

    def run(tokens: torch.Tensor) -> torch.Tensor:
        x = tokens
        for layer in layers:
            x = layer(x)
        return x

    logits = run(idx)
    assert logits.shape == (2, 6, 256)
    changed = idx.clone()
    changed[:, 4] = (changed[:, 4] + 1) % 256
    other = run(changed)
    torch.testing.assert_close(other[:, :4], logits[:, :4], rtol=0, atol=0)  # the past ignores the future
    assert not torch.allclose(other[:, 4:], logits[:, 4:])


def test_loss_fn_is_the_batch_mean() -> None:
    mse = loss_fn(ModelSpec(kind="mlp", hidden=2))
    assert float(mse(torch.tensor([[1.0, 3.0]]), torch.zeros(1, 2))) == pytest.approx(5.0)
    ce = loss_fn(ModelSpec(kind="gpt", hidden=4, heads=2))
    uniform = torch.zeros(2, 3, 256)  # equal logits: loss ln(256) whatever the targets
    assert float(ce(uniform, torch.zeros(2, 3, dtype=torch.long))) == pytest.approx(math.log(256))


def _grads(layer: torch.nn.Module, x: torch.Tensor, gy: torch.Tensor, *, defer: bool) -> list[torch.Tensor]:
    """Backward of ``layer`` at ``x`` with output gradient ``gy``; deferred weight grads run afterwards."""
    store = WeightGradStore()
    layer.grad_store = store
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(x.is_floating_point())
    y = layer(x)
    store.deferring = defer
    y.backward(gy)
    store.deferring = False
    if defer:
        # Nothing computed at I, except LayerNorm's cheap elementwise gradients (never deferred).
        assert all(p.grad is None for p in layer.parameters()) == isinstance(layer, Deferrable)
        for fn, _ in store.pending:
            fn()
    grads = [p.grad.clone() for p in layer.parameters()]
    return grads + ([x.grad] if x.requires_grad else [])


@pytest.mark.parametrize("defer", [False, True])
def test_custom_layers_match_torch_autograd(defer: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x, gy = torch.randn(3, 4, 5), torch.randn(3, 4, 7)
    lin = Linear(5, 7, generator=g)
    w, b = lin.weight.detach().requires_grad_(), lin.bias.detach().requires_grad_()
    xr = x.clone().requires_grad_()
    F.linear(xr, w, b).backward(gy)
    for got, want in zip(_grads(lin, x, gy, defer=defer), [w.grad, b.grad, xr.grad]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

    norm = LayerNorm(5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=g)
    gz = torch.randn(3, 4, 5)
    w, b = norm.weight.detach().requires_grad_(), norm.bias.detach().requires_grad_()
    xr = x.clone().requires_grad_()
    F.layer_norm(xr, (5,), w, b, 1e-5).backward(gz)
    for got, want in zip(_grads(norm, x, gz, defer=defer), [w.grad, b.grad, xr.grad]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

    emb = Embedding(11, 5, 6, generator=g)
    idx = torch.randint(0, 11, (3, 4), generator=g)
    tok, pos = emb.token.detach().requires_grad_(), emb.position.detach().requires_grad_()
    (F.embedding(idx, tok) + pos[:4]).backward(gz)
    for got, want in zip(_grads(emb, idx, gz, defer=defer), [tok.grad, pos.grad]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(pos.grad[4:]) == 0  # positions beyond the sequence get no gradient


@pytest.mark.parametrize("defer", [False, True])
def test_linear_under_autocast_is_torch_autocast_linear_bitwise(defer: bool) -> None:
    """bf16: the forward, input gradient and float32 weight gradients of an autocast ``nn.Linear``, I + W as B."""
    g = torch.Generator().manual_seed(0)
    lin = Linear(16, 24, generator=g)
    torch_lin = torch.nn.Linear(16, 24)
    with torch.no_grad():
        torch_lin.weight.copy_(lin.weight)
        torch_lin.bias.copy_(lin.bias)
    x, gy = torch.randn(3, 5, 16, generator=g), torch.randn(3, 5, 24, generator=g)
    xr = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch_lin(xr)
        got = lin(x)
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)
    want.float().backward(gy)
    store = WeightGradStore()
    lin.grad_store = store
    xg = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(xg)
    store.deferring = defer
    y.float().backward(gy)
    store.deferring = False
    for fn, held in store.pending:
        assert all(t.dtype == torch.bfloat16 for t in held)  # W keeps the bfloat16 input: half the bytes
        fn()
    assert lin.weight.grad is not None and lin.bias.grad is not None
    assert lin.weight.grad.dtype == torch.float32 and xg.grad is not None and xg.grad.dtype == torch.float32
    for ours, theirs in (
        (lin.weight.grad, torch_lin.weight.grad),
        (lin.bias.grad, torch_lin.bias.grad),
        (xg.grad, xr.grad),
    ):
        assert torch.equal(ours, theirs)
