"""Context parallelism: every sequence split over a ``cp`` process group, attention by ring attention.

With ``--context-parallel C`` the C processes of a ``cp`` group hold the same
weights and each holds a slice of every sequence: chunks i and 2C-1-i of its
2C (``models.context_parallel``: the load-balanced causal layout, as
Megatron-LM and torchtitan cut it). Everything but the attention is local to
a token, so each rank runs it on its slice alone; the first stage takes its
slice of the tokens, the last its slice of the targets, and the layers that
read positions (learned position embeddings, rotary) read the tokens' global
ones (``SequenceShard.positions``).

The attention needs every earlier key. **Ring attention** (Liu et al. 2023,
"Ring Attention with Blockwise Transformers"; Megatron-LM's and torchtitan's
context parallelism) passes the key/value blocks around the ring of the C
ranks: at step j rank i holds the block of rank i-j, attends its queries to
it, and meanwhile sends it on to rank i+1 and receives the next from rank i-1
(``_RingAttentionFn``). Each block's partial attention comes with its
log-sum-exp per query; the partial results combine exactly by those
(``out = sum_b exp(lse_b - lse) out_b``, ``lse = log sum_b exp(lse_b)``). The
causal mask is applied per pair of chunks: a key chunk before the query chunk
is seen whole, the same chunk through the triangular mask, a later one not at
all (skipped, no work). The backward recomputes each block's probabilities
from the saved log-sum-exp (as FlashAttention's does) and passes the key/value
blocks around the ring again, each with its key and value gradients
accumulated on the way, so that after C steps every block's gradient arrives
back at its owner.

Each rank's loss is the mean over its own tokens divided by C (the worker's):
the C shares sum to the whole sequence's loss, and the parameters' gradients,
partial on every rank, are summed over the group at ``U``
(the executor's ``combine``) -- as data parallelism sums replicas' -- so every rank
applies the gradient of plain training. Grouped-query attention passes the
key/value heads around the ring, not the repeated ones. Under tensor
parallelism a rank's attention has its heads, over its slice of the sequence.

Example (on each rank of a group of 2, ``q``, ``k``, ``v`` of shape ``(batch, heads, seq / 2, head width)``)::

    cp = ContextParallel(group, rank, 2)
    y = RingAttention(cp)(q, k, v)    # this rank's rows of the causal attention over the whole sequence
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeweave.models.build import selective_plan
from pipeweave.models.context_parallel import SequenceShard
from pipeweave.models.precision import autocast_device_type
from pipeweave.models.spec import ModelSpec
from pipeweave.runtime.transport.mesh import ContextParallel

KEYS = -2
"""The sequence dimension of queries, keys and values (``(batch, heads, seq, head width)``)."""


class _Passing:
    """``send`` on its way to the next rank of the ring, the previous rank's block on its way here (``wait``).

    ``tag``: the key/value blocks 0, their gradients 1, which travel at the same time in the backward. Over
    gloo a CUDA tensor is staged through the host (gloo carries none from rank to rank: ``--transport host``).
    """

    def __init__(self, send: torch.Tensor, cp: ContextParallel, tag: int = 0) -> None:
        self.device = send.device
        staged = send.device.type != "cpu" and dist.get_backend(cp.group) == "gloo"
        self.sent = send.cpu() if staged else send  # kept until the send completes
        self.received = torch.empty_like(self.sent)
        after = dist.get_global_rank(cp.group, (cp.rank + 1) % cp.size)
        before = dist.get_global_rank(cp.group, (cp.rank - 1) % cp.size)
        ops = [
            dist.P2POp(dist.isend, self.sent, after, cp.group, tag),
            dist.P2POp(dist.irecv, self.received, before, cp.group, tag),
        ]
        self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> torch.Tensor:
        """The previous rank's block, once here (on ``send``'s device)."""
        for work in self.works:
            work.wait()
        return self.received.to(self.device)


def _pairs(q_chunks: Sequence[int], k_chunks: Sequence[int]) -> list[list[tuple[int, bool]]]:
    """Per query chunk, the key chunks it sees: ``(index among the key chunks, seen through the causal mask)``."""
    return [[(i, b == a) for i, b in enumerate(k_chunks) if b <= a] for a in q_chunks]


def _scores(q: torch.Tensor, k: torch.Tensor, seen: list[tuple[int, bool]], scale: float) -> torch.Tensor:
    """``q k^T scale`` over the key chunks ``seen``, the causal one masked (``k``: those chunks side by side)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if any(diagonal for _, diagonal in seen):
        width = q.shape[KEYS]
        allowed = torch.cat(
            [
                torch.ones(width, width, dtype=torch.bool, device=q.device).tril()
                if diagonal
                else torch.ones(width, width, dtype=torch.bool, device=q.device)
                for _, diagonal in seen
            ],
            dim=-1,
        )
        s = s.masked_fill(~allowed, float("-inf"))
    return s


def _gather(x: torch.Tensor, seen: list[tuple[int, bool]]) -> torch.Tensor:
    pieces = x.chunk(2, dim=KEYS)
    return torch.cat([pieces[i] for i, _ in seen], dim=KEYS)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pairs: list[list[tuple[int, bool]]], scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention of ``q``'s chunks over the block ``k``, ``v``: (out, lse), lse -inf where nothing is seen.

    ``q``: (batch, kv heads, group, seq, d); ``k``, ``v``: (batch, kv heads, 1, seq, d)."""
    outs, lses = [], []
    for qc, seen in zip(q.chunk(2, dim=KEYS), pairs):
        if not seen:
            outs.append(torch.zeros_like(qc))
            lses.append(torch.full(qc.shape[:-1], float("-inf"), dtype=qc.dtype, device=qc.device))
            continue
        s = _scores(qc, _gather(k, seen), seen, scale)
        lse = s.logsumexp(dim=-1)
        outs.append(torch.matmul(torch.exp(s - lse.unsqueeze(-1)), _gather(v, seen)))
        lses.append(lse)
    return torch.cat(outs, dim=KEYS), torch.cat(lses, dim=-1)


def _attend_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    pairs: list[list[tuple[int, bool]]],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of the whole attention through the block ``k``, ``v``: (dq, dk, dv), each block's
    probabilities recomputed from the final log-sum-exp. ``saved``: the output gradient, the log-sum-exp and
    ``delta = rowsum(dout * out)``, of every query."""
    grad_out, lse, delta = saved
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dk_pieces, dv_pieces = list(dk.chunk(2, dim=KEYS)), list(dv.chunk(2, dim=KEYS))
    rows = zip(q.chunk(2, KEYS), grad_out.chunk(2, KEYS), lse.chunk(2, -1), delta.chunk(2, -1), dq.chunk(2, KEYS))
    for (qc, gc, lc, dc, dqc), seen in zip(rows, pairs):
        if not seen:
            continue
        kc, vc = _gather(k, seen), _gather(v, seen)
        p = torch.exp(_scores(qc, kc, seen, scale) - lc.unsqueeze(-1))
        dp = torch.matmul(gc, vc.transpose(-1, -2))
        ds = p * (dp - dc.unsqueeze(-1))
        dqc += torch.matmul(ds, kc) * scale
        dkc = (torch.matmul(ds.transpose(-1, -2), qc) * scale).sum(2, keepdim=True)  # over the query group
        dvc = torch.matmul(p.transpose(-1, -2), gc).sum(2, keepdim=True)
        width = qc.shape[KEYS]
        for n, (i, _) in enumerate(seen):
            dk_pieces[i] += dkc[..., n * width : (n + 1) * width, :]
            dv_pieces[i] += dvc[..., n * width : (n + 1) * width, :]
    return dq, dk, dv


class _RingAttentionFn(torch.autograd.Function):
    """Causal attention of this rank's queries over every rank's keys and values, passed around the ring."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
        with torch.autocast(autocast_device_type(q.device), enabled=False):  # float32 under bf16/fp16 autocast
            return _RingAttentionFn._forward(ctx, q, k, v, cp)

    @staticmethod
    def _forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
        batch, heads, length, width = q.shape
        kv_heads = k.shape[1]
        dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        qf = q.to(dtype).reshape(batch, kv_heads, heads // kv_heads, length, width)
        kv = torch.stack([k.to(dtype), v.to(dtype)]).unsqueeze(3)  # (2, batch, kv heads, 1, seq, d)
        scale = 1.0 / math.sqrt(width)
        mine = SequenceShard(cp.rank, cp.size).chunks()
        out, lse = None, None
        for j in range(cp.size):
            src = (cp.rank - j) % cp.size
            ahead = _Passing(kv, cp) if j < cp.size - 1 else None
            block_out, block_lse = _attend(qf, kv[0], kv[1], _pairs(mine, SequenceShard(src, cp.size).chunks()), scale)
            out, lse = _combine(out, lse, block_out, block_lse)
            if ahead is not None:
                kv = ahead.wait()
        assert out is not None and lse is not None
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp = cp
        return out.reshape(batch, heads, length, width).to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        cp = ctx.cp
        batch, heads, length, width = q.shape
        kv_heads, dtype = k.shape[1], out.dtype
        qf = q.to(dtype).reshape(out.shape)
        gf = grad.to(dtype).reshape(out.shape)
        saved = (gf, lse, (gf * out).sum(-1))
        kv = torch.stack([k.to(dtype), v.to(dtype)]).unsqueeze(3)
        dkv = torch.zeros_like(kv)  # the gradient of the block held, accumulated around the ring
        dq = torch.zeros_like(qf)
        scale = 1.0 / math.sqrt(width)
        mine = SequenceShard(cp.rank, cp.size).chunks()
        for j in range(cp.size):
            src = (cp.rank - j) % cp.size
            ahead = _Passing(kv, cp) if j < cp.size - 1 else None
            pairs = _pairs(mine, SequenceShard(src, cp.size).chunks())
            block_dq, block_dk, block_dv = _attend_backward(qf, kv[0], kv[1], saved, pairs, scale)
            dq += block_dq
            dkv = dkv + torch.stack([block_dk, block_dv])
            dkv = _Passing(dkv, cp, tag=1).wait()  # on to the next rank; after the last step home to its owner
            if ahead is not None:
                kv = ahead.wait()
        dk, dv = dkv.squeeze(3)
        return (
            dq.reshape(batch, heads, length, width).to(q.dtype),
            dk.reshape(batch, kv_heads, length, width).to(k.dtype),
            dv.reshape(batch, kv_heads, length, width).to(v.dtype),
            None,
        )


def _combine(
    out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial softmax attentions over disjoint keys merged by their log-sum-exps (a query that saw nothing
    in one keeps the other's)."""
    if out is None or lse is None:
        return block_out, block_lse
    total = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isinf(total), torch.zeros_like(total), total)  # a query that saw no key yet
    merged = out * torch.exp(lse - safe).unsqueeze(-1) + block_out * torch.exp(block_lse - safe).unsqueeze(-1)
    return merged, total


class RingAttention(nn.Module):
    """A causal attention core (``softmax(q k^T / sqrt(d)) v``, grouped-query where ``k`` has fewer heads than
    ``q``) over a sequence split over ``cp``, by ring attention (module docstring)."""

    def __init__(self, cp: ContextParallel) -> None:
        super().__init__()
        self.cp = cp

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _RingAttentionFn.apply(q, k, v, self.cp)  # type: ignore[no-any-return]


def shard_layers(spec: ModelSpec, indices: Sequence[int], layers: Sequence[nn.Module], cp: ContextParallel) -> None:
    """A transformer's layers made context-parallel in place: each attention core (the region selective
    recomputation replays, ``models.build.selective_plan``) a ``RingAttention`` over ``cp``; each module that
    reads positions (a class attribute ``sequence``: the learned position embedding, the llama's rotary
    attention) told which part of the sequence it holds."""
    shard = SequenceShard(cp.rank, cp.size)
    for index, layer in zip(indices, layers):
        for name in selective_plan(spec, index, layer):
            layer.set_submodule(name, RingAttention(cp))
        for module in layer.modules():
            if hasattr(type(module), "sequence"):
                module.sequence = shard  # type: ignore[assignment]


def summed_loss(loss: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """The whole sequence's loss from this rank's share (detached): the shares summed over ``cp``."""
    whole = loss.detach().clone()
    dist.all_reduce(whole, group=cp.group)
    return whole
