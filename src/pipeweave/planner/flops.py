"""FLOPs of a GPT, by GEMM, after a tensor-parallel split (Narayanan et al., SC21, section 5.1, equation 3).

One block's forward on a microbatch of b samples is six matrix multiplies
(2 m n k FLOPs each), per tensor-parallel rank of N:

| GEMM | m x k x n | FLOPs |
|---|---|---|
| QKV (column-parallel) | bs x h x 3h/N | 6 b s h^2 / N |
| scores Q K^T (a/N heads) | s x d x s, b a/N times | 2 b s^2 h / N |
| context (scores V) | s x s x d, b a/N times | 2 b s^2 h / N |
| projection (row-parallel) | bs x h/N x h | 2 b s h^2 / N |
| MLP up (column-parallel) | bs x h x 4h/N | 8 b s h^2 / N |
| MLP down (row-parallel) | bs x 4h/N x h | 8 b s h^2 / N |

24 b s h^2 + 4 b s^2 h in all, Megatron's count. Each GEMM with weights has two
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

    m: int
    k: int
    n: int
    count: int = 1
    weight: bool = True
    """True for a layer's weight (its backward has a W); False for attention's activation products."""

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n * self.count

    @property
    def smallest(self) -> int:
        """The smallest of m, k, n: what limits its efficiency (``planner.efficiency``)."""
        return min(self.m, self.k, self.n)


def block_gemms(model: Transformer, *, microbatch_size: int, tp: int) -> tuple[Gemm, ...]:
    """The forward GEMMs of one block on one of ``tp`` ranks (table in the module docstring).

    Example:
        >>> m = Transformer(layers=1, hidden=1024, heads=16, seq_len=512)
        >>> sum(g.flops for g in block_gemms(m, microbatch_size=1, tp=1)) == 24 * 512 * 1024**2 + 4 * 512**2 * 1024
        True
    """
    b, s, h, d = microbatch_size, model.seq_len, model.hidden, model.head_dim
    tokens, heads = b * s, b * model.heads // tp
    return (
        Gemm(tokens, h, 3 * h // tp),
        Gemm(s, d, s, heads, weight=False),
        Gemm(s, s, d, heads, weight=False),
        Gemm(tokens, h // tp, h),
        Gemm(tokens, h, 4 * h // tp),
        Gemm(tokens, 4 * h // tp, h),
    )


def head_gemm(model: Transformer, *, microbatch_size: int, tp: int) -> Gemm:
    """The vocabulary head's forward GEMM on one of ``tp`` ranks (column-parallel by vocabulary)."""
    return Gemm(microbatch_size * model.seq_len, model.hidden, model.vocab // tp)


def step_flops(model: Transformer, batch: int, *, recompute: str = "full") -> float:
    """FLOPs of one step on ``batch`` samples: Megatron's equation 3 with ``recompute`` "full", the model's
    own (72 instead of 96) with "none", and the attention products once more with "selective".

    Example:
        >>> m = Transformer(layers=2, hidden=64, heads=2, seq_len=128, vocab=1000)
        >>> step_flops(m, 4) == 96 * 4 * 128 * 2 * 64**2 * (1 + 128 / (6 * 64) + 1000 / (16 * 2 * 64))
        True
    """
    b, s, l, h, v = batch, model.seq_len, model.layers, model.hidden, model.vocab
    blocks = 24 * b * s * l * h * h * (1 + s / (6 * h))
    head = 2 * b * s * h * v
    extra = {"none": 0.0, "selective": 4 * b * s * s * h * l, "full": blocks}[recompute]
    return 3 * (blocks + head) + extra
