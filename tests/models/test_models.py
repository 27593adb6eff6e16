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
        ({"kind": "llama", "heads": 4, "kv_heads": 3}, "--kv-heads 3 does not divide --heads 4"),
        ({"kind": "llama", "ffn_hidden": 0}, "--ffn-hidden 0 is invalid"),
        ({"kind": "llama", "kv_heads": 0}, "--kv-heads 0 is invalid"),
        ({"kind": "llama", "hidden": 12, "heads": 4}, "head width hidden/heads = 3 is odd"),
        ({"kind": "gpt", "kv_heads": 2}, "--kv-heads applies to the llama only"),
        ({"kind": "mlp", "ffn_hidden": 64}, "--ffn-hidden applies to the llama only"),
        ({"kind": "mlp", "tie_embeddings": True}, "tie_embeddings applies to the gpt and the llama"),
    ],
)
def test_spec_rejects_bad_values_in_one_line(kwargs: dict[str, object], word: str) -> None:
    with pytest.raises(UserError) as info:
        ModelSpec(**kwargs)  # type: ignore[arg-type]
    assert word in str(info.value) and "\n" not in str(info.value)


def test_num_layers_counts_gpt_embedding_and_head() -> None:
    assert ModelSpec(kind="mlp", layers=5).num_layers == 5
    assert ModelSpec(kind="gpt", layers=5).num_layers == 7
    assert ModelSpec(kind="llama", layers=5).num_layers == 7


@pytest.mark.parametrize(
    "hidden, ffn",
    [(4096, 11008), (5120, 13824), (128, 512), (16, 256)],  # Llama 2 7B and 13B's widths, then tiny ones
)
def test_llama_ffn_default_is_two_thirds_of_4h_rounded_up_to_256(hidden: int, ffn: int) -> None:
    assert ModelSpec(kind="llama", hidden=hidden, heads=4).ffn_width == ffn
    assert ModelSpec(kind="llama", hidden=hidden, heads=4, ffn_hidden=40).ffn_width == 40


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


@pytest.mark.parametrize("kind", ["mlp", "gpt", "llama"])
def test_layer_initialisation_depends_only_on_seed_and_index(kind: str) -> None:
    spec = ModelSpec(kind=kind, layers=3, hidden=8, heads=2, seq_len=4)
    whole = build_layers(spec, range(spec.num_layers))
    for k in range(spec.num_layers):
        alone = build_layers(spec, [k])[0]
        for (name, a), (_, b) in zip(alone.named_parameters(), whole[k].named_parameters()):
            assert torch.equal(a, b), (k, name)
    # Two blocks of one model, and one block of two seeds, differ.
    assert not torch.equal(whole[1].down.weight, whole[2].down.weight)
    other = build_layers(ModelSpec(kind=kind, layers=3, hidden=8, heads=2, seq_len=4, seed=1), [1])[0]
    assert not torch.equal(other.down.weight, whole[1].down.weight)


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


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_transformer_is_causal_and_maps_bytes_to_logits(kind: str) -> None:
    spec = ModelSpec(kind=kind, layers=2, hidden=8, heads=2, seq_len=6)
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


def _llama_block_by_hand(block: torch.nn.Module, x: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """A llama block written out: RMSNorm, rotary (pairs (i, i + d/2)), each key/value head repeated for its
    group of query heads, causal softmax attention, SwiGLU."""
    batch, seq, hidden = x.shape
    d, ffn = hidden // heads, block.down.weight.shape[1]

    def rms(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    def heads_of(t: torch.Tensor) -> torch.Tensor:
        return t.view(batch, seq, -1, d).transpose(1, 2)

    def rotate(t: torch.Tensor) -> torch.Tensor:
        angle = torch.arange(seq)[:, None] * 10_000.0 ** (-torch.arange(0, d, 2) / d)
        a, b = t[..., : d // 2], t[..., d // 2 :]
        return torch.cat((a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()), -1)

    wq, wk, wv = block.attn.qkv.weight.split([hidden, kv_heads * d, kv_heads * d])
    n = rms(x, block.norm1.weight)
    q, k, v = rotate(heads_of(n @ wq.T)), rotate(heads_of(n @ wk.T)), heads_of(n @ wv.T)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(d) + torch.full((seq, seq), -math.inf).triu(1)
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, hidden)
    x = x + y @ block.attn.proj.weight.T
    gate, up = (rms(x, block.norm2.weight) @ block.gate_up.weight.T).split([ffn, ffn], -1)
    return x + (F.silu(gate) * up) @ block.down.weight.T


def test_llama_block_is_exactly_rmsnorm_rotary_gqa_and_swiglu() -> None:
    spec = ModelSpec(kind="llama", layers=1, hidden=16, heads=4, kv_heads=2, ffn_hidden=24)
    (block,) = build_layers(spec, [1])
    with torch.no_grad():
        block.norm1.weight.uniform_(0.5, 1.5)  # non-trivial scales, so the check covers them
        block.norm2.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(block(x), _llama_block_by_hand(block, x, 4, 2), rtol=1e-5, atol=1e-5)
    assert block.attn.qkv.weight.shape == (16 + 2 * 8, 16) and block.gate_up.weight.shape == (48, 16)
    assert all(not name.endswith("bias") for name, _ in block.named_parameters())


def test_llama_head_is_untied_unless_asked_and_has_no_position_table() -> None:
    spec = ModelSpec(kind="llama", layers=1, hidden=8, heads=2)
    embedding, block, head = build_layers(spec, range(3))
    # the gpt's class names: partition's tensor-parallel costs (commands.layout_options.TP_SPLIT) key on them
    assert [type(m).__name__ for m in (embedding, block, head)] == ["Embedding", "Block", "Head"]
    assert embedding.position is None and [n for n, _ in embedding.named_parameters()] == ["token"]
    assert not torch.equal(head.out.weight, embedding.token)
    tied = ModelSpec(kind="llama", layers=1, hidden=8, heads=2, tie_embeddings=True)
    assert torch.equal(build_layers(tied, [2])[0].out.weight, build_layers(tied, [0])[0].token)


def test_llama_block_defers_its_weight_gradients_and_i_plus_w_is_b() -> None:
    """Zero bubble's I computes the block's input gradient and its RMSNorm scales (elementwise, as LayerNorm's);
    the fused QKV, gate/up and the projections wait for W, and I + W equals B bitwise."""
    spec = ModelSpec(kind="llama", layers=1, hidden=16, heads=4, kv_heads=2, ffn_hidden=24)
    g = torch.Generator().manual_seed(0)
    x, gy = torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 16, generator=g)

    def backward(defer: bool) -> dict[str, torch.Tensor]:
        (block,) = build_layers(spec, [1])
        store = WeightGradStore()
        for module in block.modules():
            if isinstance(module, Deferrable):
                module.grad_store = store
        xr = x.clone().requires_grad_()
        y = block(xr)
        store.deferring = defer
        y.backward(gy)
        store.deferring = False
        if defer:
            assert {n for n, p in block.named_parameters() if p.grad is not None} == {"norm1.weight", "norm2.weight"}
            assert len(store.pending) == 4  # qkv, proj, gate_up, down
            for fn, _ in store.pending:
                fn()
        return {"x": xr.grad, **{n: p.grad for n, p in block.named_parameters()}}

    split, whole = backward(True), backward(False)
    assert split.keys() == whole.keys()
    for name, value in whole.items():
        assert torch.equal(split[name], value), name
