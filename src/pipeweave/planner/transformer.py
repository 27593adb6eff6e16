"""Transformer shapes as the planner sees them: the architecture (attention kernel, heads and key/value heads,
MLP kind and size, norm, positions, tied or untied head) and the sizes, with named presets of published models.

What the planner derives from a ``Transformer`` -- FLOPs by GEMM
(``planner.flops``), activation bytes (``sim.activations``, Korthikanti et al.'s
terms re-derived per kind in docs/guide/plan.md), element-wise HBM traffic
(``planner.costs``) and parameters -- follows from these fields. The default is
a 2020s decoder as it trains today: FlashAttention (no s x s scores stored or
moved); the 2021 unfused kernels are ``attention="math"``.

Presets, each with its source:

- ``gpt-1.7b`` ... ``gpt-1t``: Megatron-LM's Table 1 (Narayanan et al., SC21):
  sequence 2048, vocabulary 51,200, learned positions, GeLU 4h, tied head,
  dropout, and the unfused attention those runs used (the planner's calibration).
- ``gpt3-125m`` ... ``gpt3-175b``: GPT-3 (Brown et al. 2020, Table 2.1; 13B's
  d_model is 5120, the table's 5140 is not a multiple of its 40 heads of 128, and
  1.3B (XL) has 16 heads of 128, the table's 24 heads of 128 not making its 2048):
  sequence 2048, GPT-2's BPE vocabulary of 50,257.
- ``bloom-176b``: BigScience, "BLOOM: A 176B-Parameter Open-Access Multilingual
  Language Model" (2022), Table 3: 70 layers, h 14,336, 112 heads, vocabulary
  250,880, ALiBi positions, sequence 2048, tied head.
- ``llama3-8b``, ``llama3-70b``, ``llama3-405b``: "The Llama 3 Herd of Models"
  (2024), Table 3: 32/80/126 layers, h 4096/8192/16,384, 32/64/128 heads, 8
  key/value heads, SwiGLU of 14,336/28,672/53,248, vocabulary 128,256, RMSNorm,
  rotary positions, untied head, sequence 8192 (pre-training).
- ``mixtral-8x7b``: Jiang et al., "Mixtral of Experts" (2024), Table 1: 32 layers,
  h 4096, 32 heads, 8 key/value heads, SwiGLU of 14,336 in each of 8 experts, top-2,
  vocabulary 32,000, Llama's architecture (46.7B parameters, 12.9B active); sequence
  4096 here (the paper's context is 32k, its training sequence unpublished).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeweave.errors import UserError

ATTENTIONS = ("flash", "math")
"""``flash``: a fused kernel keeping only its output and the softmax statistics (FlashAttention, Dao et al.
2022); ``math``: the unfused kernels, the s x s scores written to memory and kept for the backward."""
MLPS = ("gelu", "swiglu")
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rotary", "alibi")


def swiglu_hidden(hidden: int) -> int:
    """Llama's SwiGLU size for a hidden size: 2/3 of 4h, rounded up to a multiple of 256.

    Example:
        >>> swiglu_hidden(4096)
        11008
    """
    return -(-(8 * hidden // 3) // 256) * 256


@dataclass(frozen=True, kw_only=True)
class Transformer:
    """A decoder: embedding, l blocks (attention and an MLP, each behind a norm), a vocabulary head.

    Example:
        >>> round(MODELS["gpt-1t"].parameters / 1e9, 1)
        1008.0
        >>> round(MODELS["llama3-8b"].parameters / 1e9, 2)
        8.03
    """

    layers: int
    """l, transformer blocks."""
    hidden: int
    """h, hidden size."""
    heads: int
    """a, attention (query) heads."""
    seq_len: int = 2048
    """s, tokens per sample."""
    vocab: int = 51200
    """V, vocabulary size."""
    name: str = "gpt"
    kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0: as many as ``heads`` (multi-head attention)."""
    ffn_hidden: int = 0
    """f, the MLP's intermediate size; 0: 4h for GeLU, ``swiglu_hidden(h)`` for SwiGLU."""
    attention: str = "flash"
    """``ATTENTIONS``: the attention kernel."""
    mlp: str = "gelu"
    """``gelu`` (h -> f -> h) or ``swiglu`` (gate and up h -> f each, down f -> h)."""
    norm: str = "layernorm"
    """``layernorm`` (weight and bias) or ``rmsnorm`` (weight)."""
    positions: str = "learned"
    """``learned`` (an s x h table), ``rotary`` or ``alibi`` (no parameters)."""
    tied: bool = True
    """The head shares the token embedding (its parameters counted once; the last stage still holds a copy)."""
    bias: bool = True
    """The linear layers have biases (GPT) or not (Llama)."""
    dropout: bool = True
    """Dropout after attention's softmax and after each sublayer (GPT); its 1-byte masks are activations."""
    moe_experts: int = 0
    """E, experts of each mixture-of-experts block (``train --moe-experts``; ``planner.moe``); 0: dense MLPs."""
    moe_top_k: int = 2
    """k, experts each token is routed to."""
    moe_every: int = 1
    """Every n-th block has experts (blocks n, 2n, ...), the others a dense MLP."""

    def __post_init__(self) -> None:
        for flag, value in (
            ("--layers", self.layers),
            ("--hidden", self.hidden),
            ("--heads", self.heads),
            ("--seq-len", self.seq_len),
            ("--vocab", self.vocab),
        ):
            if value < 1:
                raise UserError(f"{flag} {value} is invalid; give an integer >= 1")
        if self.hidden % self.heads:
            raise UserError(
                f"--hidden {self.hidden} is not a multiple of --heads {self.heads}; give heads that "
                f"divide the hidden size, e.g. {self.hidden // 128 or 1} (head size 128)"
            )
        if self.kv_heads < 0 or (self.kv_heads and self.heads % self.kv_heads):
            raise UserError(
                f"--kv-heads {self.kv_heads} does not divide --heads {self.heads}; give a divisor of the "
                f"heads, e.g. {self.heads // 4 if self.heads % 4 == 0 else self.heads} (or {self.heads}: no grouping)"
            )
        if self.ffn_hidden < 0:
            raise UserError(f"--ffn-hidden {self.ffn_hidden} is invalid; give an integer >= 1, e.g. {4 * self.hidden}")
        for field_name, choice, allowed in (
            ("--attention", self.attention, ATTENTIONS),
            ("mlp", self.mlp, MLPS),
            ("norm", self.norm, NORMS),
            ("positions", self.positions, POSITIONS),
        ):
            if choice not in allowed:
                raise UserError(f"{field_name} {choice!r} is unknown; choose one of: {', '.join(allowed)}")
        if self.moe_experts and not (1 <= self.moe_top_k <= self.moe_experts and self.moe_every >= 1):
            raise UserError(
                f"--moe-top-k {self.moe_top_k} (--moe-every {self.moe_every}) is invalid for --moe-experts "
                f"{self.moe_experts}; give a top-k from 1 to {self.moe_experts} and --moe-every >= 1"
            )
        if not self.kv_heads:
            object.__setattr__(self, "kv_heads", self.heads)
        if not self.ffn_hidden:
            object.__setattr__(
                self, "ffn_hidden", 4 * self.hidden if self.mlp == "gelu" else swiglu_hidden(self.hidden)
            )

    @property
    def head_dim(self) -> int:
        """d = h / a."""
        return self.hidden // self.heads

    @property
    def kv_hidden(self) -> int:
        """Width of K (and of V): key/value heads x d (h without grouping)."""
        return self.kv_heads * self.head_dim

    @property
    def flash(self) -> bool:
        """Whether attention is a fused kernel that stores no s x s scores."""
        return self.attention == "flash"

    @property
    def gated(self) -> bool:
        """Whether the MLP is gated (SwiGLU: two up-projections)."""
        return self.mlp == "swiglu"

    recomputations = ("none", "selective", "full")
    """What a GPT can recompute (``planner.costs``)."""

    def splits_into(self, parts: int) -> bool:
        """Whether the blocks split into ``parts`` non-empty parts (evenly or not: ``planner.split``)."""
        return 1 <= parts <= self.layers

    def splits_evenly(self, parts: int) -> bool:
        """Whether the blocks split into ``parts`` equal parts (Megatron-LM's rule for interleaved chunks)."""
        return parts >= 1 and self.layers % parts == 0

    def splits_tensors(self, tp: int) -> bool:
        """Whether ``tp`` ranks split the heads, the key/value heads, the hidden and the MLP sizes evenly."""
        return all(n % tp == 0 for n in (self.heads, self.kv_heads, self.hidden, self.ffn_hidden))

    @property
    def moe_fraction(self) -> float:
        """Of the blocks, the share with experts: floor(l / n) / l (0 for a dense model)."""
        return (self.layers // self.moe_every) / self.layers if self.moe_experts else 0.0

    @property
    def mlp_parameters(self) -> int:
        """One MLP's (one expert's): (2 or 3) h f weights and their biases."""
        h, f, mats = self.hidden, self.ffn_hidden, 2 + self.gated
        return mats * h * f + ((mats - 1) * f + h if self.bias else 0)

    @property
    def expert_parameters(self) -> float:
        """Of a block's parameters on average, the experts' (E MLPs on each MoE block): what EP ranks split."""
        return self.moe_fraction * self.moe_experts * self.mlp_parameters

    @property
    def layer_parameters(self) -> int:
        """Parameters of one block: QKV h (h + 2 h_kv), projection h^2, MLP (2 or 3) h f, their biases, two norms
        (12 h^2 + 13 h for a GPT); with experts, on average over the blocks, a MoE block's MLP being E of them
        and its router h E."""
        h, kv = self.hidden, self.kv_hidden
        attention = h * (h + 2 * kv) + h * h + ((h + 2 * kv) + h if self.bias else 0)
        norms = 2 * (2 * h if self.norm == "layernorm" else h)
        dense = attention + norms + self.mlp_parameters
        if not self.moe_experts:
            return dense
        moe = self.moe_fraction * ((self.moe_experts - 1) * self.mlp_parameters + h * self.moe_experts)
        return round(dense + moe)

    @property
    def embedding_parameters(self) -> int:
        """Token embedding V h, and the positions' s h where they are learned."""
        return (self.vocab + (self.seq_len if self.positions == "learned" else 0)) * self.hidden

    @property
    def parameters(self) -> int:
        """Blocks, embeddings, and the head V h unless tied (Megatron-LM's count for a GPT: 12 l h^2 (1 +
        13/(12h) + (V + s)/(12 l h))), the final norm aside."""
        head = 0 if self.tied else self.vocab * self.hidden
        return self.layers * self.layer_parameters + self.embedding_parameters + head


def _gpt(name: str, layers: int, hidden: int, heads: int) -> Transformer:
    return Transformer(name=name, layers=layers, hidden=hidden, heads=heads, attention="math")


def _gpt3(name: str, layers: int, hidden: int, heads: int) -> Transformer:
    return Transformer(name=name, layers=layers, hidden=hidden, heads=heads, vocab=50257)


def _llama3(name: str, layers: int, hidden: int, heads: int, ffn_hidden: int) -> Transformer:
    return Transformer(
        name=name,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=8,
        ffn_hidden=ffn_hidden,
        seq_len=8192,
        vocab=128256,
        **LLAMA,
    )


LLAMA: dict[str, Any] = {
    "mlp": "swiglu",
    "norm": "rmsnorm",
    "positions": "rotary",
    "tied": False,
    "bias": False,
    "dropout": False,
}
"""The architecture of ``--model llama`` (Llama 2 and 3): what differs from the GPT's defaults."""


MODELS: dict[str, Transformer] = {
    m.name: m
    for m in (
        _gpt("gpt-1.7b", 24, 2304, 24),
        _gpt("gpt-3.6b", 30, 3072, 32),
        _gpt("gpt-7.5b", 36, 4096, 32),
        _gpt("gpt-18b", 40, 6144, 48),
        _gpt("gpt-39b", 48, 8192, 64),
        _gpt("gpt-76b", 60, 10240, 80),
        _gpt("gpt-145b", 80, 12288, 96),
        _gpt("gpt-310b", 96, 16384, 128),
        _gpt("gpt-530b", 105, 20480, 128),
        _gpt("gpt-1t", 128, 25600, 160),
        _gpt3("gpt3-125m", 12, 768, 12),
        _gpt3("gpt3-350m", 24, 1024, 16),
        _gpt3("gpt3-760m", 24, 1536, 16),
        _gpt3("gpt3-1.3b", 24, 2048, 16),
        _gpt3("gpt3-2.7b", 32, 2560, 32),
        _gpt3("gpt3-6.7b", 32, 4096, 32),
        _gpt3("gpt3-13b", 40, 5120, 40),
        _gpt3("gpt3-175b", 96, 12288, 96),
        Transformer(
            name="bloom-176b",
            layers=70,
            hidden=14336,
            heads=112,
            vocab=250880,
            positions="alibi",
            dropout=False,
        ),
        _llama3("llama3-8b", 32, 4096, 32, 14336),
        _llama3("llama3-70b", 80, 8192, 64, 28672),
        _llama3("llama3-405b", 126, 16384, 128, 53248),
        Transformer(
            name="mixtral-8x7b",
            layers=32,
            hidden=4096,
            heads=32,
            kv_heads=8,
            ffn_hidden=14336,
            seq_len=4096,
            vocab=32000,
            moe_experts=8,
            moe_top_k=2,
            **LLAMA,
        ),
    )
}
"""Named shapes, by ``--model`` (sources in the module docstring)."""


def model_named(name: str) -> Transformer:
    """A preset by name.

    Raises:
        UserError: an unknown name.
    """
    model = MODELS.get(name)
    if model is None:
        raise UserError(
            f"unknown --model {name!r}; choose one of: {', '.join(MODELS)}, or gpt or llama with --layers "
            "--hidden --heads"
        )
    return model
