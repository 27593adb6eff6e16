"""The blocks per part the planner tries: the even split, and the split that balances the parts with the
embedding and the head counted (Megatron-LM's uneven first and last stages; Llama 3's one block fewer there).

A part's time is its blocks' F + I + W plus, on the first part, the embedding and, on
the last, the vocabulary head (three GEMMs of 2 b s h V FLOPs: a 128k x h head weighs
several blocks at small h). The balanced split is ``partition.time``'s exact
min-max split of the model's layers as ``train`` cuts them (the embedding, the
blocks, the head), costed in FLOPs (``planner.flops``; with recomputation the
replayed forward too), so that its counts are the ones ``--partition explicit
--layers-per-stage`` takes, less the embedding and the head. Where the blocks do not
divide, the even split gives the first parts one more, never refuses. The planner
simulates both and keeps the faster that fits: the balanced one where it pays.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from pipeweave.partition import LayerCosts, PartitionContext, partition
from pipeweave.planner.flops import block_gemms, head_gemm
from pipeweave.planner.transformer import Transformer


def even_blocks(layers: int, num_parts: int) -> tuple[int, ...]:
    """``layers`` blocks over ``num_parts`` parts, the first ``layers mod num_parts`` one more.

    Example:
        >>> even_blocks(126, 16)[:2], even_blocks(126, 16)[-2:]
        ((8, 8), (7, 7))
    """
    size, extra = divmod(layers, num_parts)
    return tuple(size + (k < extra) for k in range(num_parts))


def blocks_of(model: Transformer, num_parts: int, blocks: Sequence[int] = ()) -> tuple[int, ...]:
    """The blocks of each part: ``blocks`` where given, else the even split."""
    return tuple(blocks) if blocks else even_blocks(model.layers, num_parts)


def layer_flops(model: Transformer, recompute: str) -> tuple[float, float]:
    """``(block, head)``: FLOPs of one block's F, I and W (and its replayed forward), and the head's, for one
    sample (``planner.flops``: each weighted GEMM's backward is two of its size, attention's products two each)."""
    gemms = block_gemms(model, microbatch_size=1, tp=1)
    forward = sum(g.flops for g in gemms)
    attention = sum(g.flops for g in gemms if not g.weight)
    replay = {"none": 0.0, "selective": attention, "full": forward}[recompute]
    return 3.0 * forward + replay, 3.0 * head_gemm(model, microbatch_size=1, tp=1).flops


@functools.lru_cache(maxsize=4096)
def balanced_blocks(model: Transformer, num_parts: int, recompute: str = "none") -> tuple[int, ...]:
    """The split of least slowest part, the head and the embedding counted (module docstring); a first or last
    part may hold no block (the embedding alone, the head alone).

    Example:
        >>> from pipeweave.planner.transformer import MODELS
        >>> balanced_blocks(MODELS["bloom-176b"], 12)  # its 250,880-word head weighs about 1.5 blocks
        (6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 4)
    """
    block, head = layer_flops(model, recompute)
    n = model.layers + 2
    forward = [0.0] + [1.0 / 3] * model.layers + [head / block / 3]  # in blocks' F + I + W
    costs = LayerCosts(
        names=("embedding", *(f"blocks.{k}" for k in range(model.layers)), "head"),
        types=("Embedding", *("Block",) * model.layers, "Head"),
        forward=tuple(forward),
        input_grad=tuple(2 * f for f in forward),
        weight_grad=(0.0,) * n,
        activation=(1.0,) * n,
        params=(1.0,) * n,
    )
    counts = list(partition("time", costs, num_parts, PartitionContext()).counts)
    counts[0] -= 1
    counts[-1] -= 1
    return tuple(counts)


def candidate_blocks(model: Transformer, num_parts: int, recompute: str) -> list[tuple[int, ...]]:
    """The splits the planner tries: the even one (``()`` where the blocks divide, else its counts) and the
    balanced one where it differs (its slowest part no slower, by construction; the simulation decides).

    Example:
        >>> from pipeweave.planner.transformer import MODELS
        >>> candidate_blocks(MODELS["gpt3-175b"], 8, "none")  # a head of a third of a block: even is best
        [()]
        >>> candidate_blocks(MODELS["llama3-8b"], 4, "none")  # a head of about two blocks
        [(), (7, 9, 9, 7)]
    """
    if num_parts > model.layers:
        return []
    balanced = balanced_blocks(model, num_parts, recompute)
    even = even_blocks(model.layers, num_parts)
    first = () if model.layers % num_parts == 0 else even
    return [first] if balanced == even else [first, balanced]


def runtime_counts(blocks: Sequence[int]) -> tuple[int, ...]:
    """``train``'s ``--layers-per-stage`` for blocks per part: the embedding on the first part, the head on the last.

    Example:
        >>> runtime_counts((7, 8, 8, 7))
        (8, 8, 8, 8)
    """
    counts = list(blocks)
    counts[0] += 1
    counts[-1] += 1
    return tuple(counts)


def split_label(blocks: Sequence[int]) -> str:
    """A split in a few characters, runs of equal counts folded: ``7,8x14,7``; ``even`` for ``()``.

    Example:
        >>> split_label((7,) + (8,) * 14 + (7,)), split_label(())
        ('7,8x14,7', 'even')
    """
    if not blocks:
        return "even"
    runs: list[list[int]] = []
    for n in blocks:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return ",".join(f"{n}x{r}" if r > 1 else str(n) for n, r in runs)
