"""ZeRO stages 1 and 2: the optimizer state (and, stage 2, the gradients) of a data-parallel part sharded over its replicas.

Rajbhandari et al. (ZeRO, SC 2020), stage 1: each of the P replicas of a part
keeps the optimizer state (SGD's momentum, AdamW's two moments) of 1/P of the
part's parameters only. The gradients are reduce-scattered instead of
all-reduced (``runtime.replicas``: same buckets, same overlap with the
backward), so each replica receives the summed gradient of its own slice;
it steps its slice, and an all-gather puts the updated slices together into
every replica's parameters. The parameters and the update are those of
ZeRO-0 (an elementwise optimizer on a slice computes what it computes on the
whole), the optimizer state per rank is 1/P of it, and the bytes moved are
the same as an all-reduce's (a reduce-scatter and an all-gather).

The slices follow the buckets: each bucket's parameters flattened, padded to
a multiple of P, cut into P equal pieces.

Stage 2 shards the gradients too: ``runtime.replicas`` reduce-scatters a
part's gradient after every action that adds to it (each ``B`` or ``W``, one
microbatch's), frees the parameters' whole gradients at once and adds the
slice it receives into the slice this replica steps
(``accumulate_gradients``), as DeepSpeed's stage 2 reduces at every
micro-step of gradient accumulation. Between actions a replica so keeps 1/P
of the part's gradient instead of all of it; the price is T reduce-scatters
a step instead of one (the same bytes each), and one microbatch's whole
gradient of the part while its ``B`` or ``W`` runs.

Stage 3 is FSDP2's (``runtime.fsdp``): the parameters sharded too, by
``torch.distributed.fsdp.fully_shard``, per layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class ZeroOptimizer:
    """Steps this replica's slice of a part's parameters, then all-gathers every replica's into the parameters.

    Built by the part's own optimizer factory, over the slices; it replaces the part's optimizer:
    ``worker.optimizer = ZeroOptimizer(worker.optimizer_factory, params, spans, group)``.

    Args:
        factory: builds the optimizer from parameters (``StageWorker.optimizer_factory``).
        params: the part's parameters, in the order of the gradients ``runtime.replicas`` buckets.
        spans: the buckets, as ranges of ``params``.
        group: the part's replica group.
    """

    def __init__(
        self,
        factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        params: Sequence[nn.Parameter],
        spans: Sequence[range],
        group: Any,
    ) -> None:
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.buckets = [[params[i] for i in span] for span in spans]
        self.shards = [nn.Parameter(self._slice(bucket)) for bucket in self.buckets]
        self.inner = factory(self.shards)
        self.param_groups = self.inner.param_groups
        self.defaults = self.inner.defaults

    def _slice(self, bucket: Sequence[nn.Parameter]) -> torch.Tensor:
        flat = pad(torch.cat([p.detach().reshape(-1).float() for p in bucket]), self.size)
        return flat.chunk(self.size)[self.rank].clone()

    def refresh(self) -> None:
        """Take this replica's slices from the parameters again (after something else set them: a checkpoint)."""
        with torch.no_grad():
            for bucket, piece in zip(self.buckets, self.shards):
                piece.copy_(self._slice(bucket))

    @property
    def state(self) -> Any:
        return self.inner.state

    def set_gradients(self, shard_grads: Sequence[torch.Tensor]) -> None:
        """This replica's slices of the summed gradient (what the reduce-scatter of each bucket gave it)."""
        for shard, grad in zip(self.shards, shard_grads):
            shard.grad = grad

    def accumulate_gradients(self, shard_grads: Sequence[torch.Tensor]) -> None:
        """Add a reduce-scatter's slices into this replica's gradient slices (ZeRO-2: one per ``B`` or ``W``)."""
        for shard, grad in zip(self.shards, shard_grads):
            if shard.grad is None:
                shard.grad = grad
            else:
                shard.grad += grad

    def gradient_bytes(self) -> int:
        """Bytes of the gradient slices this replica holds."""
        return sum(s.grad.numel() * s.grad.element_size() for s in self.shards if s.grad is not None)

    def step(self) -> None:
        self.inner.step()
        self._gather()

    def _gather(self) -> None:
        """Every replica's slices all-gathered into the parameters."""
        for bucket, shard in zip(self.buckets, self.shards):
            whole = torch.empty(shard.numel() * self.size, dtype=shard.dtype, device=shard.device)
            dist.all_gather_single(whole, shard.detach(), group=self.group)
            offset = 0
            for p in bucket:
                p.data.copy_(whole[offset : offset + p.numel()].view_as(p))  # .data: autograd's versions stay
                offset += p.numel()

    def owned_gradients(self) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        """Per parameter, the piece of this replica's gradient slices that is that parameter's (after
        ``set_gradients``; parameters outside this replica's slices are left out)."""
        for bucket, shard in zip(self.buckets, self.shards):
            assert shard.grad is not None
            n = shard.numel()
            low, offset = self.rank * n, 0
            for p in bucket:
                start, stop = max(offset, low), min(offset + p.numel(), low + n)
                if start < stop:
                    yield p, shard.grad[start - low : stop - low]
                offset += p.numel()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for bucket in self.buckets:
            for p in bucket:
                p.grad = None
        self.inner.zero_grad(set_to_none=set_to_none)

    def whole_state(self) -> list[dict[str, torch.Tensor]]:
        """Per parameter (in the order given), its optimizer state whole, as an unsharded optimizer keeps it.

        Every replica's slices are all-gathered: a collective of the replica group (each replica calls it).
        """
        out: list[dict[str, torch.Tensor]] = []
        for bucket, piece in zip(self.buckets, self.shards):
            state = self.inner.state.get(piece, {})
            gathered: dict[str, torch.Tensor] = {}
            for key in sorted(state):  # the same keys on every replica: one optimizer, the same steps
                value = state[key]
                if value.dim() == 0:  # AdamW's step count: one number, the same everywhere
                    gathered[key] = value.clone()
                    continue
                gathered[key] = torch.empty(value.numel() * self.size, dtype=value.dtype, device=value.device)
                dist.all_gather_single(gathered[key], value.contiguous(), group=self.group)
            offset = 0
            for p in bucket:
                out.append(
                    {
                        k: v if v.dim() == 0 else v[offset : offset + p.numel()].view_as(p).clone()
                        for k, v in gathered.items()
                    }
                )
                offset += p.numel()
        return out

    def load_whole_state(self, states: Sequence[dict[str, torch.Tensor]]) -> None:
        """Take this replica's slices of ``states`` (per parameter, whole, as ``whole_state`` gives them)."""
        first = 0
        for bucket, piece in zip(self.buckets, self.shards):
            mine = states[first : first + len(bucket)]
            first += len(bucket)
            if not any(mine):
                continue
            state: dict[str, torch.Tensor] = {}
            for key, value in mine[0].items():
                if value.dim() == 0:
                    state[key] = value.clone()
                    continue
                flat = pad(torch.cat([s[key].reshape(-1).to(piece.device) for s in mine]), self.size)
                state[key] = flat.chunk(self.size)[self.rank].clone()
            self.inner.state[piece] = state

    def state_bytes(self) -> int:
        """Bytes of optimizer state this replica keeps (its slices')."""
        return sum(
            v.numel() * v.element_size()
            for s in self.inner.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        )


def pad(flat: torch.Tensor, size: int) -> torch.Tensor:
    """``flat`` with zeros appended up to a multiple of ``size``."""
    extra = -flat.numel() % size
    return flat if extra == 0 else torch.cat([flat, flat.new_zeros(extra)])
