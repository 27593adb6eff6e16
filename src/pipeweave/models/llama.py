"""A small byte-level decoder-only transformer of the Llama family (Touvron et al. 2023), as a list of layers.

Layer 0 embeds tokens (no position table: positions enter the attention as
rotary embeddings, Su et al. 2021), layers 1..L are pre-norm blocks, layer
L+1 is the final RMSNorm (Zhang & Sennrich 2019) and the vocabulary head,
untied unless ``tie_embeddings``. A block is::

    x = x + proj(attention(rotary(q), rotary(k), v))   q, k, v = qkv(rms_norm(x))
    x = x + down(silu(gate) * up)                       gate, up = gate_up(rms_norm(x))

The attention is grouped-query (Ainslie et al. 2023): ``kv_heads`` key/value
heads, each shared by ``heads / kv_heads`` query heads, through
``scaled_dot_product_attention`` (causal, its flash or memory-efficient kernel
where the device has one; no s x s scores kept). The MLP is SwiGLU (Shazeer
2020) of width ``ffn_width``. Q, K and V are one fused projection, gate and up
another (``FusedLinear``: one GEMM each, one all-gather each under sequence
parallelism), split part by part under tensor parallelism. No biases, no
dropout: a replayed forward (activation recomputation) is exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeweave.models import moe
from pipeweave.models.gpt import tie_head
from pipeweave.models.layers import Embedding, FusedLinear, Linear
from pipeweave.models.spec import ModelSpec
from pipeweave.models.tensor_parallel import check_divisible

ROPE_THETA = 10_000.0
"""The rotary embeddings' base (Su et al.; Llama 1 and 2; Llama 3 uses 500,000 for its long contexts)."""
NORM_EPS = 1e-5
"""RMSNorm's epsilon (Llama 2 and 3)."""


def rotary(x: torch.Tensor, theta: float = ROPE_THETA) -> torch.Tensor:
    """``x`` of shape (batch, heads, seq, d) with position p's feature pairs ``(i, i + d/2)`` turned by the angle
    ``p theta^(-2i/d)`` (the half-split pairing of Hugging Face's Llama), computed in float32."""
    seq, width = x.shape[-2], x.shape[-1]
    inverse = theta ** (-torch.arange(0, width, 2, dtype=torch.float32, device=x.device) / width)
    angle = torch.outer(torch.arange(seq, dtype=torch.float32, device=x.device), inverse)  # (seq, d/2)
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class AttentionCore(nn.Module):
    """softmax(QK^T / sqrt(d)) V, causal, each key/value head serving its group of query heads: the part
    selective recomputation replays (Korthikanti et al.)."""

    def __init__(self, group: int) -> None:
        super().__init__()
        self.group = group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.group > 1)


class Attention(nn.Module):
    """Grouped-query causal self-attention with rotary positions."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, *, generator: torch.Generator) -> None:
        super().__init__()
        self.head_width, self.group = hidden // heads, heads // kv_heads
        kv = kv_heads * self.head_width
        self.qkv = FusedLinear(hidden, (hidden, kv, kv), generator=generator)
        self.core = AttentionCore(self.group)  # no parameters: the state dict is unchanged
        self.proj = Linear(hidden, hidden, generator=generator, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # under sequence parallelism, of the whole sequence gathered from x's shards
        batch, seq, width = qkv.shape
        kv = width // (self.group + 2)  # under tensor parallelism, this rank's share of each part
        q, k, v = qkv.split([self.group * kv, kv, kv], dim=-1)
        # (batch, seq, heads x head width) -> (batch, heads, seq, head width): the heads held here
        q, k, v = (t.view(batch, seq, -1, self.head_width).transpose(1, 2) for t in (q, k, v))
        y = self.core(rotary(q), rotary(k), v)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    """``x + attn(norm1(x))`` then ``x + down(silu(gate) * up)`` of ``norm2(x)``; a mixture of experts of such
    MLPs where ``experts`` (``models.moe``)."""

    def __init__(self, spec: ModelSpec, *, generator: torch.Generator, experts: bool = False) -> None:
        super().__init__()
        hidden, ffn = spec.hidden, spec.ffn_width
        self.norm1 = nn.RMSNorm(hidden, eps=NORM_EPS)
        self.attn = Attention(hidden, spec.heads, spec.kv_head_count, generator=generator)
        self.norm2 = nn.RMSNorm(hidden, eps=NORM_EPS)
        if experts:
            self.moe = moe.MoE(spec, generator=generator)
        else:
            self.gate_up = FusedLinear(hidden, (ffn, ffn), generator=generator)
            self.down = Linear(ffn, hidden, generator=generator, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        if hasattr(self, "moe"):
            return x + self.moe(self.norm2(x))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)  # this rank's share of each, under TP
        return x + self.down(F.silu(gate) * up)


class Head(nn.Module):
    """Final RMSNorm and the projection to vocabulary logits."""

    def __init__(self, hidden: int, vocab: int, *, generator: torch.Generator) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=NORM_EPS)
        self.out = Linear(hidden, vocab, generator=generator, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def build_layer(spec: ModelSpec, index: int, generator: torch.Generator) -> nn.Module:
    """Layer ``index`` of the llama: embedding, blocks, head."""
    if index == 0:
        return Embedding(spec.vocab, spec.hidden, None, generator=generator)
    if index == spec.num_layers - 1:
        return tie_head(spec, Head(spec.hidden, spec.vocab, generator=generator))
    return Block(spec, generator=generator, experts=moe.is_moe_block(spec, index))


def selective_plan(layer: nn.Module) -> tuple[str, ...]:
    """The submodules selective recomputation replays: a block's attention core; nothing in the embedding
    and the head."""
    return ("attn.core",) if isinstance(layer, Block) else ()


def check_tensor_parallel(spec: ModelSpec, size: int) -> None:
    """One line if ``size`` ranks cannot split the llama's query heads, key/value heads, MLP or vocabulary
    evenly (each expert's MLP as the dense one)."""
    check_divisible(
        [("--heads", spec.heads), ("--kv-heads", spec.kv_head_count), ("--ffn-hidden", spec.ffn_width)]
        + ([] if spec.tie_embeddings else [("the vocabulary", spec.vocab)]),
        size,
    )


def tensor_parallel_plan(spec: ModelSpec, layer: nn.Module) -> dict[str, str]:
    """Megatron's split of a llama layer (``models.tensor_parallel``): attention by query and key/value heads,
    the MLP's gate and up column-wise and its down projection row-wise, the head by vocabulary. The embedding
    stays whole on every rank; so does a head tied to it."""
    if isinstance(layer, Block):
        mlp = (
            moe.tensor_parallel_plan(layer.moe)
            if hasattr(layer, "moe")
            else {"gate_up": "colwise_fused", "down": "rowwise"}
        )
        return {"attn.qkv": "colwise_fused", "attn.proj": "rowwise", **mlp}
    if isinstance(layer, Head) and not spec.tie_embeddings:
        return {"out": "colwise_gather"}
    return {}
