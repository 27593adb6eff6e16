"""A small byte-level decoder-only transformer (GPT-2 layout, pre-norm), as a list of layers.

Layer 0 embeds tokens and positions, layers 1..L are transformer blocks
(causal self-attention through ``scaled_dot_product_attention``, then a 4h
MLP, each residual), layer L+1 is the final LayerNorm and the vocabulary head.
No dropout, so a replayed forward (activation recomputation) is exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeweave.models import moe
from pipeweave.models.layers import Embedding, LayerNorm, Linear
from pipeweave.models.spec import ModelSpec, layer_generator
from pipeweave.models.tensor_parallel import check_divisible


class AttentionCore(nn.Module):
    """softmax(QK^T / sqrt(d)) V, causal: the part selective recomputation replays (Korthikanti et al.)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    """Multi-head causal self-attention."""

    def __init__(self, hidden: int, heads: int, *, generator: torch.Generator) -> None:
        super().__init__()
        self.head_width = hidden // heads
        self.qkv = Linear(hidden, 3 * hidden, generator=generator)
        self.core = AttentionCore()  # no parameters: the state dict is unchanged
        self.proj = Linear(hidden, hidden, generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # under sequence parallelism, of the whole sequence gathered from x's shards
        batch, seq, _ = qkv.shape
        q, k, v = qkv.chunk(3, dim=-1)  # under tensor parallelism, this rank's heads of each
        # (batch, seq, heads x head width) -> (batch, heads, seq, head width): the heads held here
        q, k, v = (t.view(batch, seq, -1, self.head_width).transpose(1, 2) for t in (q, k, v))
        y = self.core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    """``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``; the MLP a mixture of experts of such MLPs where ``spec``
    gives the block experts (``models.moe``)."""

    def __init__(self, hidden: int, heads: int, *, generator: torch.Generator, spec: ModelSpec | None = None) -> None:
        super().__init__()
        self.norm1 = LayerNorm(hidden)
        self.attn = Attention(hidden, heads, generator=generator)
        self.norm2 = LayerNorm(hidden)
        if spec is not None:
            self.moe = moe.MoE(spec, generator=generator)
        else:
            self.up = Linear(hidden, 4 * hidden, generator=generator)
            self.down = Linear(4 * hidden, hidden, generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        if hasattr(self, "moe"):
            return x + self.moe(self.norm2(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Head(nn.Module):
    """Final LayerNorm and the projection to vocabulary logits."""

    def __init__(self, hidden: int, vocab: int, *, generator: torch.Generator) -> None:
        super().__init__()
        self.norm = LayerNorm(hidden)
        self.out = Linear(hidden, vocab, generator=generator, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def build_layer(spec: ModelSpec, index: int, generator: torch.Generator) -> nn.Module:
    """Layer ``index`` of the gpt: embedding, blocks, head."""
    if index == 0:
        return Embedding(spec.vocab, spec.hidden, spec.seq_len, generator=generator)
    if index == spec.num_layers - 1:
        return tie_head(spec, Head(spec.hidden, spec.vocab, generator=generator))
    experts = spec if moe.is_moe_block(spec, index) else None
    return Block(spec.hidden, spec.heads, generator=generator, spec=experts)


def tie_head(spec: ModelSpec, head: nn.Module) -> nn.Module:
    """``head`` with its ``out.weight`` starting as the token table where ``tie_embeddings`` (that table's
    initialisation, drawn without building layer 0)."""
    if spec.tie_embeddings:
        with torch.no_grad():
            head.out.weight.copy_(Embedding.initial_token(spec.vocab, spec.hidden, layer_generator(spec, 0)))
    return head


def selective_plan(layer: nn.Module) -> tuple[str, ...]:
    """The submodules selective recomputation replays: a block's attention core; nothing in the embedding
    and the head."""
    return ("attn.core",) if isinstance(layer, Block) else ()


def check_tensor_parallel(spec: ModelSpec, size: int) -> None:
    """One line if ``size`` ranks cannot split the gpt's heads, MLP (or experts) or vocabulary evenly."""
    check_divisible(
        [("--heads", spec.heads), ("--hidden", spec.hidden)]
        + ([] if spec.tie_embeddings else [("the vocabulary", spec.vocab)]),
        size,
    )


def tensor_parallel_plan(spec: ModelSpec, layer: nn.Module) -> dict[str, str]:
    """Megatron's split of a gpt layer (``models.tensor_parallel``): attention by heads, the MLP column then
    row (each expert's alike), the head by vocabulary. The embedding stays whole on every rank; so does a head tied to it."""
    if isinstance(layer, Block):
        mlp = moe.tensor_parallel_plan(layer.moe) if hasattr(layer, "moe") else {"up": "colwise", "down": "rowwise"}
        return {"attn.qkv": "colwise_qkv", "attn.proj": "rowwise", **mlp}
    if isinstance(layer, Head) and not spec.tie_embeddings:
        return {"out": "colwise_gather"}
    return {}
