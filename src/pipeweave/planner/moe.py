"""The costs mixture-of-experts blocks and context parallelism add to a transformer's: FLOPs, bytes, links.

**Mixture of experts** (``Transformer.moe_experts`` E, top-k k, on every n-th
block). Per MoE block and token: the router, one h x E GEMM; the experts, k of
the model's MLP (so k times its FLOPs), each local expert one GEMM of the tokens
routed to it, k b s EP / E of them on average (``planner.flops.moe_gemms``: their
size sets their efficiency); parameters E MLPs and the router, an EP rank holding E / EP
experts (``Transformer.expert_parameters``). Activations held (``moe_activations``):
the MLP's k - 1 more times, and the dispatch buffers, the permuted token copies
k s b h each way (the experts' input and their output before the gates weigh
it), 2 bytes an element; the router's probabilities (4 s E bytes) too; the
auxiliary loss is a few numbers (negligible). Its time (``all_to_all_time``):
two all-to-alls per MoE block in F (dispatch, combine) and two in the backward
(their gradients), each rank sending k s b h x 2 bytes x (EP - 1) / EP of its
tokens' copies to the other EP ranks (split over its TP ranks: Megatron-LM's
dispatcher scatters the tokens over TP first), at the link the EP group spans.
pipeweave's mesh is (dp, pp, cp, tp), EP borrowing the DP dimension: an EP group
is inside a node when TP x CP x PP x EP <= GPUs per node (TP x EP without
pipeline or context parallelism), else it crosses nodes and its all-to-all moves
at the inter-node rate. They block the computation, except in DualPipe's F&B
pairs (``fb_hidden``): there the all-to-alls of one half run while the other
half computes, a pair costing its compute and the communication it does not hide.

**Context parallelism** (C ranks, ring attention over 2C load-balanced chunks):
each rank holds s / C tokens, so its activations, its GEMMs and its attention
products (its queries against all s keys) are divided by C (``planner.flops``,
``planner.memory``); the ring passes the local K/V block (2 b s h_kv / (C N) x 2
bytes) C - 1 times per block in F, K/V and their gradients (twice that) in the
backward, each step hidden behind that step's share of the attention (1/C of
it) where shorter (``ring_time``: what is not hidden); a cp group reduces its
gradients like data parallelism (the DP reduction over DP x C ranks:
``planner.evaluate``). The cp ranks are neighbours of the TP ranks in the mesh:
inside a node when TP x C <= GPUs per node.
"""

from __future__ import annotations

import functools
import inspect

from pipeweave.planner.hardware import GPU
from pipeweave.planner.transformer import Transformer

BYTES = 2
"""Tokens and their gradients in BF16."""


def moe_activations(model: Transformer) -> tuple[float, float, float]:
    """``(held split by TP, held whole on each TP rank, stashed between I and W split by TP)``: bytes a MoE block
    adds on average to a dense block's, per sample (module docstring).

    Example:
        >>> m = Transformer(layers=1, hidden=64, heads=4, seq_len=32, moe_experts=4, moe_top_k=2)
        >>> split, whole, stash = moe_activations(m)
        >>> whole == 2 * (2 * 2 * 32 * 64) + 4 * 32 * 4, split == 4 * 256 * 32  # one more GeLU's 4 s f
        (True, True)
    """
    if not model.moe_experts:
        return 0.0, 0.0, 0.0
    s, h, f, k = model.seq_len, model.hidden, model.ffn_hidden, model.moe_top_k
    mlp = (6 if model.gated else 4) * f * s
    dispatch = 2 * k * s * h * BYTES  # the permuted copies, each way
    router = 4.0 * s * model.moe_experts
    stash = (k - 1) * (2 * s * h + 2 * f * s)  # the experts' weight GEMMs' inputs
    share = model.moe_fraction
    return share * (k - 1) * mlp, share * (dispatch + router), share * stash


def ep_inter_node(gpu: GPU, *, tp: int, cp: int, pp: int, ep: int) -> bool:
    """Whether an EP group crosses nodes in the (dp, pp, cp, tp) mesh (module docstring)."""
    return tp * cp * pp * ep > gpu.gpus_per_node


def all_to_all_time(
    model: Transformer, gpu: GPU, *, microbatch_size: int, tp: int, ep: int, cp: int = 1, pp: int = 1
) -> float:
    """Seconds of one all-to-all of a MoE block's tokens over ``ep`` ranks (module docstring); 0 without EP.

    Example:
        >>> from pipeweave.planner.hardware import GPUS
        >>> m = Transformer(layers=4, hidden=1024, heads=8, seq_len=1024, moe_experts=8)
        >>> g = GPUS["h100-sxm"]
        >>> inside = all_to_all_time(m, g, microbatch_size=1, tp=1, ep=8)
        >>> across = all_to_all_time(m, g, microbatch_size=1, tp=1, ep=8, pp=2)
        >>> 0 < inside < across
        True
    """
    if ep <= 1 or not model.moe_experts:
        return 0.0
    tokens = microbatch_size * model.seq_len / cp / tp
    nbytes = model.moe_top_k * tokens * model.hidden * BYTES * (ep - 1) / ep
    net = gpu.network()
    link = net.inter_node if ep_inter_node(gpu, tp=tp, cp=cp, pp=pp, ep=ep) else net.intra_node
    return model.moe_fraction * link.time(nbytes)


def ring_time(
    model: Transformer, gpu: GPU, *, microbatch_size: int, tp: int, cp: int, attention_f: float, attention_i: float
) -> tuple[float, float]:
    """``(F, backward)`` seconds of one block's ring not hidden behind its attention (``attention_f`` and
    ``attention_i`` its seconds on the rank), module docstring; 0 without CP.

    Example:
        >>> from pipeweave.planner.hardware import GPUS
        >>> m = Transformer(layers=4, hidden=4096, heads=32, seq_len=8192)
        >>> f, i = ring_time(m, GPUS["h100-sxm"], microbatch_size=1, tp=1, cp=4, attention_f=0.0, attention_i=0.0)
        >>> 0 < f < i  # nothing to hide behind: every step shows; the backward moves twice the bytes
        True
        >>> ring_time(m, GPUS["h100-sxm"], microbatch_size=1, tp=1, cp=4, attention_f=1.0, attention_i=2.0)
        (0.0, 0.0)
    """
    if cp <= 1:
        return 0.0, 0.0
    block = 2 * microbatch_size * model.seq_len / cp * model.kv_hidden / tp * BYTES
    net = gpu.network()
    link = net.intra_node if tp * cp <= gpu.gpus_per_node else net.inter_node
    step = link.time(block)
    f = (cp - 1) * max(0.0, step - attention_f / cp)
    i = (cp - 1) * max(0.0, 2 * step - attention_i / cp)
    return f, i


def fb_hidden(*, a2a_f: float, a2a_i: float, compute_f: float, compute_i: float, paired: float) -> tuple[float, float]:
    """Seconds of all-to-all an F and an I (or B) each hide on average where a share ``paired`` of a rank's F run
    in F&B pairs: a pair's F half moves its all-to-alls while the B half computes and the other way round, so
    each hides up to the other's compute (module docstring).

    Example:
        >>> fb_hidden(a2a_f=1.0, a2a_i=1.0, compute_f=3.0, compute_i=0.5, paired=1.0)
        (0.5, 1.0)
        >>> fb_hidden(a2a_f=1.0, a2a_i=1.0, compute_f=3.0, compute_i=3.0, paired=0.0)
        (0.0, 0.0)
    """
    return paired * min(a2a_f, compute_i), paired * min(a2a_i, compute_f)


@functools.cache
def fb_pairs(schedule: str) -> bool:
    """Whether a registry schedule makes F&B pairs (its generator takes ``overlap_fb``: dualpipe, dualpipe-v).

    Example:
        >>> fb_pairs("dualpipe-v"), fb_pairs("1f1b")
        (True, False)
    """
    from pipeweave.schedule.registry import SCHEDULES

    return "overlap_fb" in inspect.signature(SCHEDULES[schedule].generator).parameters


def moe_terms(
    *, blocks: float, a2a: float, ring_f: float, ring_i: float, full: bool, moe: bool, cp: int
) -> dict[str, float]:
    """``plan --explain``'s terms of the experts and the ring on the rank holding the head, ``blocks`` block
    passes (T x its blocks) of one block's ``a2a`` (its two all-to-alls), ``ring_f`` and ``ring_i``: the
    all-to-alls as counted before F&B pairs hide any (two in F, two in the backward, two more in a ``full``
    replay) and the ring's exposed time; none where the run has neither.

    Example:
        >>> moe_terms(blocks=10, a2a=0.5, ring_f=0.0, ring_i=0.0, full=False, moe=True, cp=1)
        {'expert all-to-all (before F&B overlap)': 10.0}
    """
    out = {}
    replays = 1.0 if full else 0.0
    if moe:
        out["expert all-to-all (before F&B overlap)"] = blocks * a2a * (2 + replays)
    if cp > 1:
        out["CP ring (not hidden)"] = blocks * (ring_f * (1 + replays) + ring_i)
    return out
