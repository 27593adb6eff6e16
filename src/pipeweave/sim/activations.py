"""Activation bytes per GPU under tensor and sequence parallelism (Korthikanti et al. 2022, section 4 and Table 2).

A GPT block holds, for one microbatch of b sequences of s tokens, hidden size
h and a heads, 16-bit activations and 1-byte dropout masks (the paper's 4.1):
``s b h (34 + 5 a s / h)`` bytes from its forward to its backward. Tensor
parallelism over N ranks splits ``24 s b h + 5 a s^2 b`` of them (the
attention's and the MLP's inner tensors) and leaves ``10 s b h`` whole on every
rank (the two layer norms' inputs, the inputs of attention's and the MLP's
first GEMMs, the two dropout masks): ``s b h (10 + 24/N + 5 a s / (h N))``.
Sequence parallelism splits those 10 too, along the sequence:
``s b h (34/N + 5 a s / (h N))``. ``gpt_block_activations`` re-derives these
terms for grouped-query attention, SwiGLU, FlashAttention and no dropout.
``planner.memory`` builds the planner's memory from these terms;
``rank_activations`` walks them over a schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeweave.schedule.ir import Schedule
from pipeweave.sim.cost import CostModel
from pipeweave.sim.metrics import held_peaks
from pipeweave.sim.parallel import Layout
from pipeweave.sim.traffic import ModelBytes


@dataclass(frozen=True)
class BlockActivations:
    """Bytes of one GPT block's activations for one microbatch, all TP shards together (Table 2's terms)."""

    held: float
    """Held from F to the backward: ``s b h (34 + 5 a s / h)``."""
    held_replicated: float
    """Of ``held``, what every TP rank keeps whole without sequence parallelism: ``10 s b h``."""
    scores: float
    """Of ``held``, attention's scores, softmax and its dropout mask, all split by TP: ``5 a s^2 b`` (0 with
    FlashAttention)."""
    stash: float
    """Still held between I and W, the inputs of the four weight GEMMs (zero-bubble's M_W): ``14 s b h``."""
    stash_replicated: float
    """Of ``stash``, whole on every TP rank without sequence parallelism: ``4 s b h``."""
    input: float
    """The block's input, all a full recomputation keeps: ``2 s b h``, whole on every TP rank without SP."""


def gpt_block_activations(
    *,
    seq_len: int,
    hidden: int,
    heads: int,
    microbatch_size: int = 1,
    kv_heads: int | None = None,
    ffn_hidden: int | None = None,
    gated: bool = False,
    flash: bool = False,
    dropout: bool = True,
) -> BlockActivations:
    """Table 2's terms of one block (module docstring), re-derived for grouped-query attention (``kv_heads``),
    an MLP of size ``ffn_hidden`` (default 4h; ``gated``: SwiGLU), FlashAttention (``flash``: no s x s scores,
    the softmax's FP32 log-sum-exp per head and token instead) and no dropout: the derivation is in
    docs/guide/plan.md ("Activations, per kind").

    Example:
        >>> a = gpt_block_activations(seq_len=1024, hidden=1024, heads=16)
        >>> round(a.held / 2**20), round(a.held_replicated / 2**20)  # s b h (34 + 5 a s / h), 10 s b h
        (114, 10)
        >>> a = gpt_block_activations(seq_len=1024, hidden=1024, heads=16, kv_heads=4, ffn_hidden=2816,
        ...                           gated=True, flash=True, dropout=False)
        >>> round(a.held / 2**20), round(a.scores / 2**20)  # s b h (8 + 2 + 4 r + 2 + 6 f / h), no scores
        (30, 0)
    """
    b, s, h = microbatch_size, seq_len, hidden
    sbh = float(s * h * b)
    r = (kv_heads or heads) / heads
    f = (ffn_hidden or 4 * h) / h
    masks = 2 * sbh if dropout else 0.0  # after attention and after the MLP, 1 byte an element
    replicated = 8 * sbh + masks  # two norms' inputs, the QKV and first MLP GEMMs' inputs (2 s b h each)
    qkv = (2 + 4 * r) * sbh  # Q, K and V, what the attention core's backward reads
    context = 2 * sbh  # the projection's input (FlashAttention's output, which its backward reads too)
    mlp = (6 if gated else 4) * f * sbh  # GeLU's input and output; SwiGLU's gate, up and their product
    if flash:
        scores, statistics = 0.0, 4.0 * heads * s * b
    else:
        scores, statistics = (2 + 3 * dropout) * heads * s * s * b, 0.0  # softmax (its dropout mask and output)
    return BlockActivations(
        held=replicated + qkv + context + mlp + scores + statistics,
        held_replicated=replicated,
        scores=scores,
        stash=4 * sbh + context + 2 * f * sbh,
        stash_replicated=4 * sbh,
        input=2 * sbh,
    )


def rank_activations(
    schedule: Schedule,
    cost: CostModel | None,
    layout: Layout,
    model: ModelBytes,
    *,
    sequence_parallel: bool | None = None,
) -> tuple[float, ...]:
    """Per pipeline rank, the peak activation bytes one of its GPUs holds: the simulator's walk of M_a
    (``sim.metrics.held_peaks``, in the schedule's order) with each part's M_a its ``ModelBytes.activation``
    on one TP rank (``PartBytes.tp_rank_activation``). The cost model's recomputation keeps its fractions of
    it and M_W stays ``mem_w`` of it, with sequence parallelism as without (the zero-bubble runtime's W
    keeps the gathered input with SP, so its M_W shrinks less than M_a: this is a lower bound there).

    Args:
        sequence_parallel: overrides the layout's (None), to compare both.

    Example:
        >>> from pipeweave.schedule import generate
        >>> s, model = generate("1f1b", num_stages=2, num_microbatches=4), ModelBytes(activation=10.0,
        ...                                                                              replicated_activation=4.0)
        >>> rank_activations(s, None, Layout(tp=2), model), rank_activations(s, None, Layout(tp=2), model,
        ...                                                                   sequence_parallel=True)
        ((14.0, 7.0), (10.0, 5.0))
    """
    num_ranks, num_parts = schedule.placement.ranks_per_pipeline, schedule.num_parts
    parts = model.for_parts(num_parts=num_parts, num_ranks=num_ranks)
    split = layout.sequence_parallel if sequence_parallel is None else sequence_parallel
    per_gpu = tuple(parts.tp_rank_activation(k, layout.tp, sequence_parallel=split) for k in range(num_parts))
    costs = replace(cost or CostModel(), activation=per_gpu).for_parts(num_parts=num_parts, num_ranks=num_ranks)
    return held_peaks(
        schedule.actions, schedule.placement.stage_part, costs.activation, [a * costs.mem_w for a in costs.activation]
    )
