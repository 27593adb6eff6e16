"""The least memory per GPU over every split of any number of GPUs, and what would bring it under the GPU's.

More GPUs shrink the model state (PP over the layers, TP over the heads, ZeRO 3
over the replicas: to nothing in the limit) but not the activations of one
microbatch of one sample in one block: with one block per pipeline rank
(PP = l), the largest TP the heads and a node allow, b = 1 and the best
recomputation, the rank holding the last block still holds that block's
activations (``planner.memory``: held from F to the backward), the head's
FP32 logits, the replayed block while its backward runs, and the allowance.
When this floor exceeds the GPU's memory no count of GPUs fits, and the plan
says what would: a shorter sequence, recomputation, sequence parallelism,
heads that split further, or a GPU with more memory (each with its figure).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pipeweave.planner.costs import Cluster
from pipeweave.planner.memory import ALLOWANCE_BYTES, GIB, block_activation_bytes
from pipeweave.planner.profiled import ProfiledModel
from pipeweave.planner.space import Fixed, tensor_parallel_sizes
from pipeweave.planner.transformer import Transformer


def floor_bytes(cluster: Cluster, fixed: Fixed | None = None) -> float:
    """Bytes the fullest GPU holds at least on any number of GPUs, the dimensions ``fixed`` fixes (TP,
    recomputation, microbatch size) as given (module docstring).

    Example:
        >>> from pipeweave.planner.efficiency import A100_CALIBRATED
        >>> from pipeweave.planner.hardware import gpu_named
        >>> m = Transformer(layers=2, hidden=1024, heads=16, seq_len=2048, attention="math")
        >>> round(floor_bytes(Cluster(model=m, gpu=gpu_named("a100-80gb"), efficiency=A100_CALIBRATED)) / GIB, 2)
        3.11
    """
    fixed = fixed or Fixed()
    model, b = cluster.model, fixed.microbatch_size or 1
    recomputations = [r for r in model.recomputations if fixed.allows("recompute", r)]
    if isinstance(model, ProfiledModel):
        return b * min(_profiled_floor(model, r) for r in recomputations) + ALLOWANCE_BYTES
    tps = tensor_parallel_sizes(model, cluster.gpu.gpus_per_node, fixed) or [1]
    least = min(_block_floor(model, t, r, cluster.sequence_parallel) for t in tps for r in recomputations)
    return b * least + ALLOWANCE_BYTES


def _block_floor(model: Transformer, tp: int, recompute: str, sequence_parallel: bool) -> float:
    """One sample's bytes on the rank holding the last block: its activations, the logits, one replayed block."""
    held, _, during = block_activation_bytes(model, tp=tp, recompute=recompute, sequence_parallel=sequence_parallel)
    return held + during + 4.0 * model.seq_len * model.vocab / tp


def _profiled_floor(model: ProfiledModel, recompute: str) -> float:
    """One sample's bytes on any rank of a one-layer-per-part split: the least held and the least replayed."""
    held, _, during = model.part_activations(model.layers, microbatch_size=1, recompute=recompute)
    return min(held) + min(during)


def what_would_fit(cluster: Cluster, fixed: Fixed) -> list[str]:
    """What brings ``floor_bytes`` under the GPU's memory, each with its figure; the last resort, a GPU with the
    floor's memory, always last."""
    memory, model = cluster.gpu.memory_bytes, cluster.model
    found = []
    for flag in ("recompute", "tp", "microbatch_size"):  # a fixed dimension given its best value instead
        if getattr(fixed, flag) is None:
            continue
        value, need = min(
            ((v, floor_bytes(cluster, replace(fixed, **{flag: v}))) for v in _values(cluster, flag)),
            key=lambda pair: pair[1],
        )
        if need <= memory:
            found.append(f"{_FLAGS[flag]} {value} ({need / GIB:.1f} GiB)")
    if isinstance(model, Transformer):
        found += _gpt_remedies(cluster, fixed)
    found.append(f"a GPU of at least {floor_bytes(cluster, fixed) / GIB:.0f} GiB")
    return found


def _values(cluster: Cluster, flag: str) -> list[Any]:
    """The values a fixed dimension could take instead (the floor's: b = 1 is the least)."""
    if flag == "recompute":
        return list(cluster.model.recomputations)
    if flag == "tp":
        return list(tensor_parallel_sizes(cluster.model, cluster.gpu.gpus_per_node, Fixed())) or [1]
    return [1]


_FLAGS = {"recompute": "--recompute", "tp": "--tensor-parallel", "microbatch_size": "--microbatch-size"}


def _gpt_remedies(cluster: Cluster, fixed: Fixed) -> list[str]:
    """A GPT's: sequence parallelism, heads that split over a whole node, the longest sequence that fits."""
    memory, model, per_node = cluster.gpu.memory_bytes, cluster.model, cluster.gpu.gpus_per_node
    assert isinstance(model, Transformer)
    found = []
    if (
        not cluster.sequence_parallel
        and (need := floor_bytes(replace(cluster, sequence_parallel=True), fixed)) <= memory
    ):
        found.append(f"--sequence-parallel ({need / GIB:.1f} GiB)")
    if fixed.tp is None and max(tensor_parallel_sizes(model, per_node, fixed), default=1) < per_node:
        heads = per_node * max(1, round(model.heads / per_node))
        kv_heads = heads if model.kv_heads == model.heads else model.kv_heads
        if (
            model.hidden % heads == 0
            and heads % kv_heads == 0
            and (need := floor_bytes(replace(cluster, model=replace(model, heads=heads, kv_heads=kv_heads)), fixed))
            <= memory
        ):
            found.append(f"heads a multiple of {per_node}, for TP {per_node} ({need / GIB:.1f} GiB)")
    seq_len = _longest_sequence(cluster, fixed)
    if seq_len:
        found.append(f"--seq-len {seq_len} or shorter")
    return found


def _longest_sequence(cluster: Cluster, fixed: Fixed) -> int:
    """The longest sequence whose floor fits the GPU (0: none does); the floor grows with it."""
    model = cluster.model
    assert isinstance(model, Transformer)

    def fits(seq_len: int) -> bool:
        shorter = replace(cluster, model=replace(model, seq_len=seq_len))
        return floor_bytes(shorter, fixed) <= cluster.gpu.memory_bytes

    low, high = 0, model.seq_len  # fits(low) (or low == 0), not fits(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def largest_tensor_parallel(cluster: Cluster) -> int:
    """The largest TP the heads and a node allow (1 for a profiled model)."""
    return max(tensor_parallel_sizes(cluster.model, cluster.gpu.gpus_per_node, Fixed()), default=1)
