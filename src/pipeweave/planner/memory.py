"""Bytes one GPU holds: model state by ZeRO stage, activations at the schedule's peak, and an allowance.

- **Model state** (``sim.shards.rank_memory``), per parameter, as the frameworks
  hold it (``StateBytes``): the BF16 weights (2 bytes); the gradients, in
  Megatron-LM's FP32 main-gradient buffer (4 bytes, its default for BF16
  training: gradients accumulate and are reduced in FP32) or in BF16 (2,
  PyTorch DDP or FSDP with BF16 reduction); the FP32 master weights mixed
  precision keeps (4); the optimizer's state, Adam's two FP32 moments (8) or
  SGD's momentum (4) -- 18 bytes with Megatron's defaults, the ZeRO paper's 16
  (Rajbhandari et al., SC20, section 3.1) with BF16 gradients. All of it is
  split over the N tensor-parallel ranks (the vocabulary-parallel embedding and
  head too) and sharded over the P replicas by the ZeRO stage: ZeRO 1 the master
  weights and the moments, ZeRO 2 the gradients too, ZeRO 3 the weights too.
  ZeRO 2 as ``pipeweave train --zero 2`` holds it (``runtime.replicas``): the
  1/P slices of every part's gradient, and, while a B or W runs, that part's
  whole gradient of the microbatch with the 1/P slice its reduce-scatter
  returns (``zero2_grads``) -- so it saves over ZeRO 1 only where a GPU holds
  several parts (v of them: ``v/P + 1 + 1/P < v``).
  The first part holds the embeddings, the last a copy of the tied head
  (Megatron-LM keeps both when they sit on two stages) or the untied head.
- **Activations** of one block for one microbatch, in bytes (Korthikanti et al.
  2022, Table 2, tensor parallel without sequence parallelism; the terms are
  ``sim.activations``', shared with ``pipeweave simulate``, and re-derived there
  for grouped-query attention, SwiGLU, FlashAttention and no dropout; docs/guide/plan.md).
  For a GPT with the unfused attention:
  ``s b h (10 + 24/N + 5 a s / (h N))`` with no recomputation;
  ``s b h (10 + 24/N)`` with selective recomputation (attention's scores are
  replayed); ``2 s b h`` with full recomputation (the block's input only). The
  head keeps its FP32 logits, ``4 b s V / N``. Between I and W a block still
  holds the inputs of its four weight GEMMs, ``s b h (4 + 10/N)`` (the
  zero-bubble paper's M_W). With sequence parallelism (``Layout.sequence_parallel``,
  the paper's section 4.2.2 and Table 2) the ``10 s b h`` every tensor-parallel
  rank held whole (layer norms, dropout masks, the GEMMs' gathered inputs,
  which Megatron-LM stores sharded and all-gathers again in the backward) are
  split too: ``34 s b h / N`` (``+ 5 a s^2 b / N``); the block's input
  ``2 s b h / N``; M_W ``14 s b h / N``. A backward with recomputation holds one replayed
  block (or its attention scores) on top while it runs. The peak per rank is
  walked over the schedule's own order (``sim.metrics.held_peaks``), so every
  schedule's activation memory comes from the simulator, not a closed form.
- **Allowance**: ``ALLOWANCE_BYTES`` for the CUDA context, cuBLAS's workspaces
  and NCCL's own channel buffers; the **workspace of the largest collective**, the
  transient buffer it writes beyond what is counted above: with ZeRO 3 one
  part's gathered BF16 parameters (``sim.shards``), with tensor parallelism the
  all-gathered b s h activation of sequence parallelism or the out-of-place
  pipeline receive buffer (2 b s h bytes), whichever is largest; and the caching
  allocator's **fragmentation**, ``StateBytes.fragmentation`` (5 %) of all the
  rest (PyTorch's reserved-but-unallocated memory, a few percent in steady state).
- **Experts and context parallelism** (``planner.moe``): an EP rank holds E / EP of
  each MoE block's experts; a MoE block holds the MLP's activations k times, the
  dispatch buffers and the router's probabilities; the all-to-all's receive buffer
  is a collective's workspace; a cp rank holds a C-th of every activation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeweave.errors import UserError
from pipeweave.planner.moe import moe_activations
from pipeweave.planner.split import blocks_of
from pipeweave.planner.transformer import Transformer
from pipeweave.schedule.ir import Schedule
from pipeweave.sim.activations import gpt_block_activations
from pipeweave.sim.metrics import held_peaks
from pipeweave.sim.parallel import Layout
from pipeweave.sim.shards import rank_memory
from pipeweave.sim.traffic import ModelBytes, tp_rank_share

GIB = 2.0**30
ALLOWANCE_BYTES = 3 * GIB
"""Beyond model state and activations: ~0.5 GiB of CUDA context, NCCL buffers (~1 GiB at the defaults of
NCCL_BUFFSIZE over a few communicators), cuBLAS workspaces (the collectives' and the allocator's apart)."""
PARAM_BYTES = 2.0
"""Per parameter: BF16 weights."""
GRADIENTS = {"fp32": 4.0, "bf16": 2.0}
"""Bytes of a parameter's gradient: Megatron-LM's FP32 main-gradient buffer, or BF16."""
OPTIMIZERS = {"adam": 8.0, "sgd": 4.0}
"""Bytes of a parameter's optimizer state beyond the master weights: Adam's two FP32 moments, SGD's momentum."""
MASTER_BYTES = 4.0
"""Per parameter: the FP32 master weights of mixed precision."""


@dataclass(frozen=True, kw_only=True)
class StateBytes:
    """How the framework holds model state, and the allocator's margin (module docstring).

    Example:
        >>> StateBytes().per_parameter, StateBytes(grads="bf16").per_parameter
        (18.0, 16.0)
    """

    grads: str = "fp32"
    """``GRADIENTS``: Megatron-LM's FP32 main-gradient buffer (default) or BF16."""
    optimizer: str = "adam"
    """``OPTIMIZERS``."""
    fragmentation: float = 0.05
    """The caching allocator's reserved-but-unallocated memory, a fraction of the rest."""

    def __post_init__(self) -> None:
        if self.grads not in GRADIENTS:
            raise UserError(f"--grads {self.grads!r} is unknown; choose one of: {', '.join(GRADIENTS)}")
        if self.optimizer not in OPTIMIZERS:
            raise UserError(f"--optimizer {self.optimizer!r} is unknown; choose one of: {', '.join(OPTIMIZERS)}")
        if not 0 <= self.fragmentation < 1:
            raise UserError(f"--fragmentation {self.fragmentation} is invalid; give a fraction in [0, 1), e.g. 0.05")

    @property
    def grad_bytes(self) -> float:
        return GRADIENTS[self.grads]

    @property
    def moment_bytes(self) -> float:
        return OPTIMIZERS[self.optimizer]

    @property
    def per_parameter(self) -> float:
        """Bytes of model state per parameter, unsharded."""
        return PARAM_BYTES + self.grad_bytes + MASTER_BYTES + self.moment_bytes

    def sharded(self, zero: int, dp: int) -> float:
        """Bytes per parameter one GPU holds under ZeRO ``zero`` over ``dp`` replicas."""
        shard = 1.0 / dp
        return (
            PARAM_BYTES * (shard if zero >= 3 else 1.0)
            + self.grad_bytes * (shard if zero >= 2 else 1.0)
            + (MASTER_BYTES + self.moment_bytes) * (shard if zero >= 1 else 1.0)
        )

    def update_bytes(self, zero: int, dp: int) -> float:
        """HBM bytes the optimizer step moves per parameter of the part a GPU holds (its time:
        ``planner.costs.update_time``), its kernels memory-bound: the gradient norm for clipping reads the
        gradients; the optimizer reads the FP32 master weights, the gradients and its state and writes the
        master weights and the state; the BF16 weights are written from the master weights (read 4, write 2);
        the gradient buffer is zeroed for the next step. On the shard a ZeRO stage leaves the GPU: ZeRO 1 and up
        update 1/dp of the parameters (the gradient buffer, whole below ZeRO 2, is zeroed whole).

        Example:
            >>> StateBytes().update_bytes(0, 1)  # 4 + (4 + 4 + 8) + (4 + 8) + (4 + 2) + 4
            42.0
        """
        shard = 1.0 / dp if zero >= 1 else 1.0
        grads = self.grad_bytes
        step = grads + (MASTER_BYTES + grads + self.moment_bytes) + (MASTER_BYTES + self.moment_bytes)
        copy = MASTER_BYTES + PARAM_BYTES
        return (step + copy) * shard + grads * (shard if zero >= 2 else 1.0)


@dataclass(frozen=True)
class GPUMemory:
    """Bytes of the fullest GPU, by kind (module docstring)."""

    params: float
    grads: float
    master: float
    optimizer: float
    activations: float
    context: float
    """``ALLOWANCE_BYTES``."""
    workspace: float
    """The largest collective's transient buffer."""
    fragmentation: float

    @property
    def allowance(self) -> float:
        """What is neither model state nor activations."""
        return self.context + self.workspace + self.fragmentation

    @property
    def state(self) -> float:
        return self.params + self.grads + self.master + self.optimizer

    @property
    def total(self) -> float:
        return self.state + self.activations + self.allowance

    def as_dict(self) -> dict[str, float]:
        """GiB by kind, and the total."""
        names = ("params", "grads", "master", "optimizer", "activations", "context", "workspace", "fragmentation")
        return {n: round(getattr(self, n) / GIB, 3) for n in (*names, "allowance", "total")}


def block_activation_bytes(
    model: Transformer, *, tp: int, recompute: str, sequence_parallel: bool = False, cp: int = 1
) -> tuple[float, float, float]:
    """``(held, stash, during)`` of one block for a microbatch of 1: held from F to the backward, still held
    between I and W, and used on top while a backward replays the forward; with experts, a MoE block's share
    added (``planner.moe.moe_activations``); on one of ``cp`` context-parallel ranks, a C-th of each.

    Example:
        >>> m = Transformer(layers=1, hidden=1024, heads=16, seq_len=1024, attention="math")
        >>> [round(x / (1024 * 1024)) for x in block_activation_bytes(m, tp=1, recompute="none")]
        [114, 14, 0]
        >>> [round(x / (1024 * 1024)) for x in block_activation_bytes(m, tp=2, recompute="selective",
        ...                                                           sequence_parallel=True)]
        [17, 7, 40]
    """
    terms = gpt_block_activations(
        seq_len=model.seq_len,
        hidden=model.hidden,
        heads=model.heads,
        kv_heads=model.kv_heads,
        ffn_hidden=model.ffn_hidden,
        gated=model.gated,
        flash=model.flash,
        dropout=model.dropout,
    )

    def share(total: float, replicated: float) -> float:
        return tp_rank_share(total, replicated, tp, split_replicated=sequence_parallel) / cp

    split, whole, experts = moe_activations(model)
    full = share(terms.held + split + whole, terms.held_replicated + whole)
    stash = share(terms.stash + experts, terms.stash_replicated)
    scores = terms.scores / tp / cp
    if recompute == "none":
        return full, stash, 0.0
    if recompute == "selective":
        return full - scores, stash, scores
    return share(terms.input, terms.input), stash, full


def part_activation_bytes(
    model: Transformer,
    num_parts: int,
    tp: int,
    recompute: str,
    sequence_parallel: bool = False,
    blocks: Sequence[int] = (),
    cp: int = 1,
) -> dict[str, Any]:
    """Per part, its activation bytes for a microbatch of one sample, as ``planner.activations.peaks`` takes
    them: held and stashed (the last part's with the head's FP32 logits), and one replayed block; ``blocks``:
    blocks per part (``planner.split``; default even); on one of ``cp`` context-parallel ranks."""
    counts = blocks_of(model, num_parts, blocks)
    held, stash, during = block_activation_bytes(
        model, tp=tp, recompute=recompute, sequence_parallel=sequence_parallel, cp=cp
    )
    logits = [0.0] * (num_parts - 1) + [4.0 * model.seq_len * model.vocab / tp / cp]
    return {
        "held": tuple(n * held + x for n, x in zip(counts, logits)),
        "stash": tuple(n * stash + x for n, x in zip(counts, logits)),
        "during": during,
    }


def activation_peaks(
    schedule: Schedule,
    model: Transformer,
    tp: int,
    recompute: str,
    sequence_parallel: bool = False,
    blocks: Sequence[int] = (),
    cp: int = 1,
) -> tuple[float, ...]:
    """Per rank, the peak activation bytes of ``schedule`` for microbatches of one sample (scale by b), walked by
    the simulator's ``held_peaks`` (``planner.activations`` finds the same for many sizes at once).

    Example:
        >>> from pipeweave.schedule import generate
        >>> from pipeweave.planner.activations import activation_profile, peaks
        >>> m, s = Transformer(layers=8, hidden=256, heads=4, seq_len=64), generate("zb-h1", num_stages=4,
        ...                                                                          num_microbatches=8)
        >>> activation_peaks(s, m, 2, "full") == peaks(activation_profile(s), **part_activation_bytes(m, 4, 2, "full"))
        True
    """
    sizes = part_activation_bytes(model, schedule.num_parts, tp, recompute, sequence_parallel, blocks, cp)
    extra = [sizes["during"]] * schedule.num_parts  # one block replayed at a time
    part_of = schedule.placement.stage_part
    return held_peaks(schedule.actions, part_of, list(sizes["held"]), list(sizes["stash"]), extra, extra)


def part_parameters(model: Transformer, num_parts: int, blocks: Sequence[int] = (), ep: int = 1) -> tuple[float, ...]:
    """Parameters per part on one rank: its blocks (``blocks``, default the even split), their experts split over
    ``ep`` ranks (E / EP each), the embeddings on the first, the head on the last."""
    block = model.layer_parameters - model.expert_parameters * (1 - 1 / ep)
    params = [float(n * block) for n in blocks_of(model, num_parts, blocks)]
    params[0] += model.embedding_parameters
    params[-1] += model.vocab * model.hidden
    return tuple(params)


def gpu_memory(
    schedule: Schedule,
    model: Transformer,
    layout: Layout,
    *,
    microbatch_size: int,
    recompute: str,
    peaks: tuple[float, ...] | None = None,
    state: StateBytes = StateBytes(),
    zero2: bool = False,
    blocks: Sequence[int] = (),
    ep: int = 1,
    cp: int = 1,
) -> GPUMemory:
    """The fullest GPU of ``schedule`` on the layout (module docstring); ``peaks``: ``activation_peaks``' result
    if known; ``blocks``: blocks per part (default even); ``ep``, ``cp``: expert- and context-parallel ranks
    (``planner.moe``).

    Example:
        >>> from pipeweave.schedule import generate
        >>> m = Transformer(layers=4, hidden=1024, heads=16, seq_len=1024, vocab=1024)
        >>> mem = gpu_memory(generate("1f1b", num_stages=2, num_microbatches=4), m, Layout(tp=2),
        ...                  microbatch_size=1, recompute="full")
        >>> round(mem.grads / mem.params), round(mem.master / mem.params), round(mem.optimizer / mem.params)
        (2, 2, 4)
    """
    params = part_parameters(model, schedule.num_parts, blocks, ep)
    acts = [
        p * microbatch_size
        for p in peaks or activation_peaks(schedule, model, layout.tp, recompute, layout.sequence_parallel, blocks, cp)
    ]
    message = (
        2.0 * microbatch_size * model.seq_len * model.hidden / cp if layout.tp > 1 or schedule.num_parts > 1 else 0.0
    )
    if model.moe_experts and ep > 1:  # the all-to-all's receive buffer: k b s h / C in BF16
        message = max(message, 2.0 * model.moe_top_k * microbatch_size * model.seq_len * model.hidden / cp)
    return fullest_gpu(schedule, params, layout, acts, state=state, message=message, zero2=zero2)


def fullest_gpu(
    schedule: Schedule,
    params: Sequence[float],
    layout: Layout,
    acts: Sequence[float],
    *,
    state: StateBytes = StateBytes(),
    message: float = 0.0,
    zero2: bool = False,
) -> GPUMemory:
    """The GPU whose model state (``params`` per part, ``state``'s bytes each) and activations (``acts`` bytes
    per rank) are the most, with the allowance (module docstring; ``message``: bytes of one activation between
    blocks, for the collectives' workspace; ``zero2``: ZeRO 2, the layout's ZeRO 1 with the gradients sharded
    too, its collectives ZeRO 1's)."""
    moments = MASTER_BYTES + state.moment_bytes
    model_bytes = ModelBytes(
        params=tuple(p * PARAM_BYTES for p in params),
        grads=state.grad_bytes / PARAM_BYTES,
        optimizer=moments / PARAM_BYTES,
    )
    ranks = rank_memory(schedule, layout, model_bytes)
    held = zero2_grads(schedule, params, [r.grads for r in ranks], layout.dp) if zero2 else [r.grads for r in ranks]
    worst = max(range(len(ranks)), key=lambda r: ranks[r].total - ranks[r].grads + held[r] + acts[r])
    r = ranks[worst]
    grads = held[worst]
    gathered = max(params) * PARAM_BYTES / layout.tp if layout.zero == 3 else 0.0
    workspace = max(gathered, message)
    master, optimizer = r.optimizer * MASTER_BYTES / moments, r.optimizer * state.moment_bytes / moments
    rest = r.params + grads + r.optimizer + acts[worst] + ALLOWANCE_BYTES + workspace
    return GPUMemory(
        r.params, grads, master, optimizer, acts[worst], ALLOWANCE_BYTES, workspace, state.fragmentation * rest
    )


def zero2_grads(schedule: Schedule, params: Sequence[float], grads: Sequence[float], dp: int) -> list[float]:
    """Per rank, the gradient bytes of ZeRO 2 as ``pipeweave train --zero 2`` holds them (module docstring), from
    ``grads``, each rank's whole gradients (its parts' ``params``, in proportion).

    Example:
        >>> from pipeweave.schedule import generate
        >>> s = generate("interleaved-1f1b", num_stages=2, num_microbatches=4, num_chunks=4)
        >>> zero2_grads(s, [1.0] * 8, [4.0, 4.0], dp=8)  # 4/8 sliced, and one part whole with its slice
        [1.625, 1.625]
    """
    placement = schedule.placement
    out = []
    for rank, whole in enumerate(grads):
        mine = [params[placement.stage_part[s]] for s in placement.stages_on(rank)]
        largest = whole * max(mine) / sum(mine) if sum(mine) > 0 else 0.0
        out.append(whole / dp + largest * (1.0 + 1.0 / dp))
    return out
