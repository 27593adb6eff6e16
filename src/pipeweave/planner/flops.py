"""FLOPs of a transformer, by GEMM, after a tensor-parallel split (Narayanan et al., SC21, section 5.1, equation 3,
generalised to grouped-query attention and SwiGLU).

One block's forward on a microbatch of b samples is six matrix multiplies
(2 m n k FLOPs each), per tensor-parallel rank of N, with h_kv the width of K
(and of V: key/value heads x d; h without grouping) and f the MLP's size:

| GEMM | m x k x n | FLOPs |
|---|---|---|
| QKV (column-parallel) | bs x h x (h + 2 h_kv)/N | 2 b s h (h + 2 h_kv) / N |
| scores Q K^T (a/N heads) | s x d x s, b a/N times | 2 b s^2 h / N |
| context (scores V) | s x s x d, b a/N times | 2 b s^2 h / N |
| projection (row-parallel) | bs x h/N x h | 2 b s h^2 / N |
| MLP up (column-parallel) | bs x h x f/N (2f/N: SwiGLU's gate and up) | 2 b s h f / N (x 2) |
| MLP down (row-parallel) | bs x f/N x h | 2 b s h f / N |

24 b s h^2 + 4 b s^2 h in all for a GPT (h_kv = h, f = 4h, GeLU), Megatron's count.
The attention products are counted whole, as Megatron counts them, with FlashAttention too (a causal
kernel skips about half of them: ``planner.explain``'s list of what is not modelled). Each GEMM with weights has two
of the same size backward, the input gradient (``I``) and the weight gradient
(``W``); the two attention products have two backward each, both in ``I``. The
vocabulary head is bs x h x V/N (2 b s h V / N FLOPs forward). Equation 3 for a
step of B samples with full recomputation (one more forward per block):
``96 B s l h^2 (1 + s/(6h) + V/(16 l h))``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeweave.planner.transformer import Transformer


@dataclass(frozen=True)
class Gemm:
    """One matrix multiply of a forward, repeated ``count`` times (batched attention): m x k times k x n."""

    m: float
    k: int
    n: int
    count: float = 1
    """Repeats: batched attention's heads, an expert's GEMM on each local expert (fractional: the share of
    blocks with experts, ``block_gemms``)."""
    weight: bool = True
    """True for a layer's weight (its backward has a W); False for attention's activation products."""

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n * self.count

    @property
    def smallest(self) -> int:
        """The smallest of m, k, n: what limits its efficiency (``planner.efficiency``)."""
        return min(self.m, self.k, self.n)


def block_gemms(model: Transformer, *, microbatch_size: int, tp: int, ep: int = 1, cp: int = 1) -> tuple[Gemm, ...]:
    """The forward GEMMs of one block on one of ``tp`` ranks (table in the module docstring), of ``cp``
    context-parallel ranks (each the s / C tokens of its chunks, their queries against all s keys: attention's
    products divided by C too), with experts (``moe_gemms``) on the share of blocks that have them.

    Example:
        >>> m = Transformer(layers=1, hidden=1024, heads=16, seq_len=512)
        >>> sum(g.flops for g in block_gemms(m, microbatch_size=1, tp=1)) == 24 * 512 * 1024**2 + 4 * 512**2 * 1024
        True
        >>> sum(g.flops for g in block_gemms(m, microbatch_size=1, tp=1, cp=2)) == 12 * 512 * 1024**2 + 2 * 512**2 * 1024
        True
    """
    b, s, h, d, f = microbatch_size, model.seq_len, model.hidden, model.head_dim, model.ffn_hidden
    local = s // cp
    tokens, heads = b * local, b * model.heads // tp
    dense = 1.0 - model.moe_fraction
    mlp = (Gemm(tokens, h, (1 + model.gated) * f // tp, dense), Gemm(tokens, f // tp, h, dense)) if dense else ()
    return (
        Gemm(tokens, h, (h + 2 * model.kv_hidden) // tp),
        Gemm(local, d, s, heads, weight=False),
        Gemm(local, s, d, heads, weight=False),
        Gemm(tokens, h // tp, h),
        *mlp,
        *moe_gemms(model, tokens=tokens, tp=tp, ep=ep),
    )


def moe_gemms(model: Transformer, *, tokens: int, tp: int, ep: int) -> tuple[Gemm, ...]:
    """The forward GEMMs of a MoE block's router and experts on one rank (``tokens`` = b s / C of its own), their
    counts the share of blocks with experts (``planner.moe``'s module docstring); none for a dense model.

    Example:
        >>> m = Transformer(layers=2, hidden=64, heads=4, seq_len=32, moe_experts=4, moe_top_k=2)
        >>> router, up, down = moe_gemms(m, tokens=32, tp=1, ep=2)
        >>> router.flops == 2 * 32 * 64 * 4, up.flops == 2 * (2 * 32 * 64 * 256), up.count
        (True, True, 2.0)
    """
    if not model.moe_experts:
        return ()
    experts, k, h, f = model.moe_experts, model.moe_top_k, model.hidden, model.ffn_hidden
    share, local = model.moe_fraction, experts / ep
    routed = k * tokens * ep / experts  # tokens an expert computes, on average
    return (
        Gemm(tokens, h, experts, share),
        Gemm(routed, h, (1 + model.gated) * f // tp, share * local),
        Gemm(routed, f // tp, h, share * local),
    )


def head_gemm(model: Transformer, *, microbatch_size: int, tp: int, cp: int = 1) -> Gemm:
    """The vocabulary head's forward GEMM on one of ``tp`` ranks (column-parallel by vocabulary, padded to split),
    on the s / C tokens of one of ``cp`` ranks."""
    return Gemm(microbatch_size * model.seq_len // cp, model.hidden, -(-model.vocab // tp))


def step_flops(model: Transformer, batch: int, *, recompute: str = "full") -> float:
    """FLOPs of one step on ``batch`` samples: Megatron's equation 3 with ``recompute`` "full", the model's
    own (72 instead of 96) with "none", and the attention products once more with "selective" (the GEMMs
    of the module docstring's table, l times, and the head).

    Example:
        >>> m = Transformer(layers=2, hidden=64, heads=2, seq_len=128, vocab=1000)
        >>> step_flops(m, 4) == 96 * 4 * 128 * 2 * 64**2 * (1 + 128 / (6 * 64) + 1000 / (16 * 2 * 64))
        True
    """
    gemms = block_gemms(model, microbatch_size=batch, tp=1)
    blocks = model.layers * sum(g.flops for g in gemms)
    attention = model.layers * sum(g.flops for g in gemms if not g.weight)
    head = 2.0 * batch * model.seq_len * model.hidden * model.vocab
    extra = {"none": 0.0, "selective": attention, "full": blocks}[recompute]
    return 3 * (blocks + head) + extra
