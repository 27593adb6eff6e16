"""Seconds per action of one part on a cluster: F, I and W from FLOPs, TP collectives, recomputation, messages.

A block's F, I and W are its GEMMs (``planner.flops``) at the rate of
``planner.efficiency``, on one of N tensor-parallel ranks, plus its element-wise
kernels, memory-bound, at the GPU's HBM bandwidth. Their traffic is counted
kernel by kernel as Megatron-LM fuses them, in bytes per sample of a
microbatch (16-bit tensors, 1-byte dropout masks): each layer norm reads and
writes s h elements (4 s h bytes), each bias-dropout-add reads two and writes
one with a mask (7 s h), the bias-GeLU reads and writes 4 s h / N elements
(16 s h / N), the scaled-masked softmax reads and writes the scores (4 a s^2 /
N) and their dropout reads, writes and masks them (5 a s^2 / N): in all
``s h (22 + 16/N) + 9 a s^2 / N``, the layer norms and dropouts being
replicated on the N ranks without sequence parallelism. Per kind: without dropout
a residual add reads two and writes one (6 s h); SwiGLU reads the gate and the up
projection and writes their product (6 s f / N; GeLU 4 s f / N); rotary positions
read and write Q and K (4 s (h + h_kv) / N); FlashAttention moves no scores (its
reads of Q, K, V are counted with its GEMMs), the unfused softmax reads and writes
them (4 a s^2 / N) and their dropout 5 a s^2 / N more. FlashAttention's backward
recomputes the scores Q K^T (Dao et al. 2022, algorithm 4): its I holds that
product once more, 2.5 times the attention products' forward. The backward of these
kernels reads what they saved and the output gradient and writes the input
gradient: counted as twice the forward's traffic, in I. The tensor-parallel
all-reduces are ``sim.parallel``'s model (Megatron-LM without sequence
parallelism: two of the block's activation, b x s x h in 16 bits, in F, two in
I; a ring on the TP group's link), and they block the computation. Recomputation
(Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models", 2022) adds to I what is replayed before the backward: "selective" the
two attention products, "full" the whole forward with its all-reduces. The
vocabulary head (last part) is a column-parallel GEMM whose input gradient is
all-reduced, followed by the FP32 cross-entropy's memory traffic
(``LOSS_BYTES``); the vocabulary-parallel embedding (first part) all-reduces its
output in F. The optimizer step is memory-bound (``update_time``). Collectives
on NVLink move at NCCL's share of its line rate (``planner.hardware.NCCL_NVLINK``). Pipeline messages carry the activation; with Megatron-LM's
scatter/gather optimisation (Narayanan et al., SC21, section 4.1) each of the N
ranks sends 1/N of it over the inter-node link and the receiving node
all-gathers it over NVLink, without it each sends the whole activation (what
pipeweave's runtime does without sequence parallelism). With sequence
parallelism (``Cluster.sequence_parallel``, Korthikanti et al. section 4.2.2)
the activation between blocks is already split along the sequence: each rank
sends its 1/N and nothing is gathered; the TP collectives move the same bytes
(an all-gather and a reduce-scatter for each all-reduce), and the activations
held shrink (``planner.memory``). Experts' all-to-alls and context parallelism's
ring are ``planner.moe``'s (added to a block's F and I; a cp rank's tokens are s / C).

W deferral (a schedule that splits the backward, ``ScheduleInfo.splits_backward``):
I and W are the same GEMMs a whole backward runs (each weighted GEMM's input
gradient in I, its weight gradient in W, each at its own size's efficiency), so
their products cost what B's do. What the split adds is traffic: a whole
backward computes a layer's weight gradient right after its input gradient,
from the output gradient dY both read, still in the GPU's L2 cache; a
deferred W reads dY again from HBM, ``b s n`` elements of 16 bits for each
weighted GEMM of output width n on a TP rank (the head's too: ``b s V / N``), charged
at the rate model's own streaming rate (``Efficiency.streaming_seconds``:
``peak eta_max / n_half`` bytes a second). Its other operand, the layer's
input saved in F, comes from HBM in either backward. ``deferral_times``; in a
block, ``2 b s ((h + 2 h_kv) / N + h + (1 + gated) f / N + h)`` bytes (the
row-parallel output and down projections' dY is whole on every TP rank).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from pipeweave.planner.efficiency import Efficiency
from pipeweave.planner.flops import block_gemms, head_gemm
from pipeweave.planner.hardware import GPU
from pipeweave.planner.memory import StateBytes
from pipeweave.planner.moe import all_to_all_time, ring_time
from pipeweave.planner.profiled import Model
from pipeweave.planner.split import blocks_of
from pipeweave.planner.transformer import Transformer
from pipeweave.sim.network import all_gather_time, all_reduce_time

BYTES_PER_ELEMENT = 2
"""Activations and their gradients in BF16."""


@dataclass(frozen=True)
class BlockTimes:
    """Seconds of one block's F, I and W on one TP rank, TP collectives included."""

    f: float
    i: float
    w: float
    tp_f: float
    """Of ``f``, the TP all-reduces."""
    tp_i: float
    """Of ``i``, the TP all-reduces (those of a full recomputation's replayed forward too)."""
    gemm_f: float = 0.0
    """Of ``f``, the GEMMs (attention's products included); I runs them once more (2.5 times attention's with
    FlashAttention), W the weighted ones once more."""
    elementwise_f: float = 0.0
    """Of ``f``, the element-wise kernels; I runs twice their traffic."""
    replay: float = 0.0
    """Of ``i``, the forward a recomputation replays."""
    deferral: float = 0.0
    """What a deferred W adds to ``w``: its output gradients read again from HBM (module docstring)."""
    a2a: float = 0.0
    """Of ``f``, and of ``i`` again, the experts' two all-to-alls (``planner.moe``); of a full replay too."""
    ring_f: float = 0.0
    """Of ``f``, context parallelism's ring not hidden behind attention (``planner.moe.ring_time``)."""
    ring_i: float = 0.0
    """Of ``i``, the ring's backward not hidden."""


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """What the costs depend on besides the configuration: the model, the GPU and the GEMM efficiency."""

    model: Model
    """A GPT (``planner.transformer``) or a profiled model (``planner.profiled``, whose costs do not come from here)."""
    gpu: GPU
    efficiency: Efficiency
    scatter_gather: bool = True
    """Megatron-LM's scatter/gather of pipeline messages over the TP ranks (module docstring)."""
    sequence_parallel: bool = False
    """Sequence parallelism with TP (module docstring): smaller messages and activations, the same collectives."""
    state: StateBytes = StateBytes()
    """How the framework holds model state (``planner.memory``)."""


def transformer(cluster: Cluster) -> Transformer:
    """The cluster's GPT: the costs of this module are a GPT's (a profiled model's are ``planner.profiled``'s)."""
    if not isinstance(cluster.model, Transformer):
        raise TypeError(f"{cluster.model.name} is not a GPT shape; its costs come from plan.profiled")
    return cluster.model


def activation_bytes(model: Transformer, microbatch_size: int, cp: int = 1) -> float:
    """Bytes of one microbatch's activation between blocks: b x s x h in 16 bits (s / C on one of ``cp``
    context-parallel ranks)."""
    return float(microbatch_size * model.seq_len * model.hidden * BYTES_PER_ELEMENT) / cp


def tp_all_reduce(cluster: Cluster, nbytes: float, tp: int) -> float:
    """One all-reduce over a TP group inside a node (the planner keeps TP groups on one node)."""
    return all_reduce_time(nbytes, tp, cluster.gpu.network().intra_node) if tp > 1 else 0.0


def elementwise_bytes(model: Transformer, tp: int) -> tuple[float, float]:
    """``(all, of which attention scores)``: HBM bytes the element-wise kernels of one block's forward read and
    write, for a microbatch of one sample, on one of ``tp`` ranks (module docstring's count).

    Example:
        >>> m = Transformer(layers=1, hidden=1024, heads=16, seq_len=1024, attention="math")
        >>> [x / (1024 * 1024) for x in elementwise_bytes(m, 1)]
        [182.0, 144.0]
        >>> from dataclasses import replace
        >>> [x / (1024 * 1024) for x in elementwise_bytes(replace(m, attention="flash"), 1)]
        [38.0, 0.0]
    """
    s, h, a, f = model.seq_len, model.hidden, model.heads, model.ffn_hidden
    norms_and_adds = s * h * (8 + (14 if model.dropout else 12))
    activation = (6 if model.gated else 4) * s * f / tp
    rotary = 4.0 * s * (h + model.kv_hidden) / tp if model.positions == "rotary" else 0.0
    scores = 0.0 if model.flash else (9.0 if model.dropout else 4.0) * a * s * s / tp
    return norms_and_adds + activation + rotary + scores, scores


@functools.lru_cache(maxsize=4096)
def block_times(
    cluster: Cluster, *, tp: int, microbatch_size: int, recompute: str, ep: int = 1, cp: int = 1, pp: int = 1
) -> BlockTimes:
    """F, I, W of one block (module docstring), on one of ``cp`` context-parallel ranks, its experts over ``ep``
    ranks (``planner.moe``; ``pp``: where the EP group lies).

    Example:
        >>> from pipeweave.planner.hardware import GPUS
        >>> from pipeweave.planner.transformer import MODELS
        >>> c = Cluster(model=MODELS["gpt-1.7b"], gpu=GPUS["a100-80gb"], efficiency=Efficiency(eta_max=1, n_half=0))
        >>> t = block_times(c, tp=1, microbatch_size=1, recompute="none")
        >>> round((t.i + t.w) / t.f, 6)  # the backward is twice the forward
        2.0
    """
    peak, eff, model = cluster.gpu.peak_flops, cluster.efficiency, transformer(cluster)
    gemms = block_gemms(model, microbatch_size=microbatch_size, tp=tp, ep=ep, cp=cp)
    forward = sum(eff.seconds(g, peak) for g in gemms)
    weighted = sum(eff.seconds(g, peak) for g in gemms if g.weight)
    attention = forward - weighted
    bandwidth = cluster.gpu.memory_bandwidth
    elementwise, softmax = (x * microbatch_size / bandwidth / cp for x in elementwise_bytes(model, tp))
    collective = 2 * tp_all_reduce(cluster, activation_bytes(model, microbatch_size, cp), tp)
    a2a = 2 * all_to_all_time(model, cluster.gpu, microbatch_size=microbatch_size, tp=tp, ep=ep, cp=cp, pp=pp)
    # I: each weighted GEMM's input gradient (its own size) and attention's two backward products each (and
    # FlashAttention's recomputed scores).
    backward_attention = (2.5 if model.flash else 2.0) * attention
    deferral = sum(eff.streaming_seconds(BYTES_PER_ELEMENT * g.m * g.n * g.count, peak) for g in gemms if g.weight)
    ring_f, ring_i = ring_time(
        model,
        cluster.gpu,
        microbatch_size=microbatch_size,
        tp=tp,
        cp=cp,
        attention_f=attention,
        attention_i=backward_attention,
    )
    full = forward + elementwise + collective + a2a + ring_f
    replay = {"none": 0.0, "selective": attention + softmax, "full": full}[recompute]
    tp_i = collective * (2 if recompute == "full" else 1)
    return BlockTimes(
        f=full,
        i=weighted + backward_attention + 2 * elementwise + collective + a2a + ring_i + replay,
        w=weighted,
        tp_f=collective,
        tp_i=tp_i,
        gemm_f=forward,
        elementwise_f=elementwise,
        replay=replay,
        deferral=deferral,
        a2a=a2a,
        ring_f=ring_f,
        ring_i=ring_i,
    )


LOSS_BYTES = (38.0, 22.0)
"""HBM bytes per logit of the vocabulary-parallel cross-entropy, forward and backward, as Megatron-LM computes
it in FP32 with one kernel per step: forward, the BF16 logits cast to FP32 (read 2, write 4), their maximum
(read 4), the maximum subtracted (read and write 4 each), exponentiated (the same), summed (read 4) and
normalised into the softmax kept for the backward (read and write 4): 38; backward, the one-hot target
subtracted from the softmax (read and write 4), scaled by the loss's gradient (the same), cast back to BF16
(read 4, write 2): 22. Its three all-reduces over TP (the maximum, the sum, the target's logit) carry b x s
numbers each: left out."""


@functools.lru_cache(maxsize=4096)
def head_times(cluster: Cluster, *, tp: int, microbatch_size: int, cp: int = 1) -> tuple[float, float, float]:
    """``(f, i, w)`` of the vocabulary head and the loss on the last stage: the head's GEMM in each, the
    cross-entropy's memory traffic (``LOSS_BYTES`` per logit, ``b s V / N`` logits a TP rank) in F and I, and
    I's input gradient all-reduced over TP (the s / C tokens of one of ``cp`` ranks)."""
    model = transformer(cluster)
    gemm = head_gemm(model, microbatch_size=microbatch_size, tp=tp, cp=cp)
    t = cluster.efficiency.seconds(gemm, cluster.gpu.peak_flops)
    loss_f, loss_i = (b * gemm.m * gemm.n / cluster.gpu.memory_bandwidth for b in LOSS_BYTES)
    return t + loss_f, t + loss_i + tp_all_reduce(cluster, activation_bytes(model, microbatch_size, cp), tp), t


def deferral_times(cluster: Cluster, *, tp: int, microbatch_size: int, cp: int = 1) -> tuple[float, float]:
    """``(block, head)``: seconds a deferred W adds to one block's W and to the head's (module docstring: its
    output gradients, ``b s n`` elements per weighted GEMM of width n on a TP rank, read again at the rate model's
    streaming rate).

    Example:
        >>> from pipeweave.planner.efficiency import A100_CALIBRATED
        >>> from pipeweave.planner.hardware import GPUS
        >>> from pipeweave.planner.transformer import MODELS
        >>> c = Cluster(model=MODELS["gpt-1.7b"], gpu=GPUS["a100-80gb"], efficiency=A100_CALIBRATED)
        >>> block, _ = deferral_times(c, tp=1, microbatch_size=1)
        >>> t = block_times(c, tp=1, microbatch_size=1, recompute="none")
        >>> round(block / t.w, 3)  # GPT, h 2304: 9 s h outputs for 24 s h^2 FLOPs: 0.75 n_half / h = 0.023 at most
        0.022
    """
    block = block_times(cluster, tp=tp, microbatch_size=microbatch_size, recompute="none", cp=cp).deferral
    head = head_gemm(transformer(cluster), microbatch_size=microbatch_size, tp=tp, cp=cp)
    return block, cluster.efficiency.streaming_seconds(BYTES_PER_ELEMENT * head.m * head.n, cluster.gpu.peak_flops)


def update_time(cluster: Cluster, parameters: float, *, zero: int, dp: int) -> float:
    """Seconds of the optimizer step over ``parameters`` (one TP rank's of a part), memory-bound at the GPU's
    HBM bandwidth (``planner.memory.StateBytes.update_bytes``).

    Example:
        >>> from pipeweave.planner.hardware import GPUS
        >>> from pipeweave.planner.transformer import MODELS
        >>> c = Cluster(model=MODELS["gpt-1.7b"], gpu=GPUS["a100-80gb"], efficiency=Efficiency(eta_max=1, n_half=0))
        >>> round(update_time(c, 1e9, zero=0, dp=8) * 1e3, 1)  # 42 bytes a parameter at 2.039 TB/s
        20.6
    """
    return parameters * cluster.state.update_bytes(zero, dp) / cluster.gpu.memory_bandwidth


def part_times(
    cluster: Cluster,
    *,
    num_parts: int,
    tp: int,
    microbatch_size: int,
    recompute: str,
    blocks: Sequence[int] = (),
    split_backward: bool = False,
    ep: int = 1,
    cp: int = 1,
    pp: int = 1,
) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """Per part (``blocks`` blocks each, default the even split: ``planner.split``), ``(f, i, w)``: the head on
    the last, the embedding's all-reduce on the first; ``split_backward``: W deferred (``deferral_times`` added
    to every W).

    Example:
        >>> from pipeweave.planner.hardware import GPUS
        >>> from pipeweave.planner.transformer import MODELS
        >>> c = Cluster(model=MODELS["gpt-1.7b"], gpu=GPUS["a100-80gb"], efficiency=Efficiency(eta_max=1, n_half=0))
        >>> f, i, w = part_times(c, num_parts=4, tp=1, microbatch_size=1, recompute="none")
        >>> f[0] == f[1] < f[3]
        True
        >>> f, i, w = part_times(c, num_parts=4, tp=1, microbatch_size=1, recompute="none", blocks=(6, 7, 6, 5))
        >>> f[0] < f[1]
        True
    """
    block = block_times(cluster, tp=tp, microbatch_size=microbatch_size, recompute=recompute, ep=ep, cp=cp, pp=pp)
    head = head_times(cluster, tp=tp, microbatch_size=microbatch_size, cp=cp)
    counts = blocks_of(transformer(cluster), num_parts, blocks)
    f, i, w = [n * block.f for n in counts], [n * block.i for n in counts], [n * block.w for n in counts]
    f[0] += tp_all_reduce(cluster, activation_bytes(transformer(cluster), microbatch_size, cp), tp)
    f[-1], i[-1], w[-1] = f[-1] + head[0], i[-1] + head[1], w[-1] + head[2]
    if split_backward:
        block_deferral, head_deferral = deferral_times(cluster, tp=tp, microbatch_size=microbatch_size, cp=cp)
        w = [x + n * block_deferral for x, n in zip(w, counts)]
        w[-1] += head_deferral
    return tuple(f), tuple(i), tuple(w)


def hop_time(cluster: Cluster, *, tp: int, microbatch_size: int, inter_node: bool, cp: int = 1) -> float:
    """A pipeline message between neighbouring stages (module docstring; a cp rank's s / C tokens)."""
    net = cluster.gpu.network()
    nbytes = activation_bytes(transformer(cluster), microbatch_size, cp)
    if cluster.sequence_parallel and tp > 1:  # each rank's shard of the sequence, to its peer
        return (net.inter_node if inter_node else net.intra_node).time(nbytes / tp)
    if not inter_node:
        return net.intra_node.time(nbytes)
    if cluster.scatter_gather and tp > 1:
        return net.inter_node.time(nbytes / tp) + all_gather_time(nbytes, tp, net.intra_node)
    return net.inter_node.time(nbytes)
