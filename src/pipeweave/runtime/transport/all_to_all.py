"""The all-to-all of expert parallelism: rows of a tensor sent to every rank of a group in uneven shares.

Each rank of a group of E holds rows to send, ``input_splits[j]`` of them to
rank j (consecutive, rank 0's first), and receives ``output_splits[i]`` rows
from rank i. The receiver learns ``output_splits`` from the senders' counts
first (``exchange_counts``: one all-to-all of integers), as Megatron-LM's and
torchtitan's token dispatchers do. ``all_to_all`` is differentiable: its
backward is the reverse all-to-all of the gradient (the splits swapped), so
it sits on the input gradient's path (``I`` or ``B``) and a deferred ``W``
stays local work. ``torch.distributed.all_to_all_single`` takes the uneven
splits on gloo (CPU) and NCCL alike, shares of zero rows included.

Every rank of the group calls both functions the same number of times in one
order, whatever its counts (a rank with nothing to send sends zero rows): no
rank waits on a peer that skipped one.

Example (on each rank of a group of 2)::

    received = exchange_counts(torch.tensor([1, 3]), group)   # rows each rank sends here
    y = all_to_all(x, received.tolist(), [1, 3], group)       # x: 4 rows; y: received.sum() rows
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def exchange_counts(counts: torch.Tensor, group: Any) -> torch.Tensor:
    """What every rank of ``group`` sends to this one: ``counts`` (int64, a multiple of the group's size long,
    one equal slice per destination rank) exchanged slice for slice. The result has ``counts``'s shape, its
    slice i the one rank i addressed here."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received


Around = Callable[[Callable[[], torch.Tensor]], torch.Tensor]
"""Runs an exchange given as a thunk and returns its result: where a caller times (or delays) each one."""


Delayed = Callable[[Any], Any]
"""Takes a posted collective's work, returns the work to wait on (``RankContext.delayed``'s signature)."""


def _run(exchange: Callable[[], torch.Tensor]) -> torch.Tensor:
    return exchange()


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: Any,
        around: Around,
        delayed: Delayed | None,
    ) -> Any:
        ctx.splits, ctx.group, ctx.around, ctx.delayed = (output_splits, input_splits), group, around, delayed
        return around(lambda: _exchange(x, output_splits, input_splits, group, delayed))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        output_splits, input_splits = ctx.splits
        back = ctx.around(lambda: _exchange(grad, input_splits, output_splits, ctx.group, ctx.delayed))
        return back, None, None, None, None, None


def all_to_all(
    x: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: Any,
    around: Around = _run,
    delayed: Delayed | None = None,
) -> torch.Tensor:
    """Rows of ``x`` (dimension 0) to every rank of ``group``: ``input_splits[j]`` rows to rank j, in rank order;
    returns the ``sum(output_splits)`` rows received, ``output_splits[i]`` from rank i, in rank order.
    Differentiable: the gradient goes back by the reverse all-to-all. ``around`` runs each exchange, this one
    and its backward's (e.g. timing it); ``delayed``, where given, takes each exchange's posted work and returns
    what to wait on instead (an injected link delay, a testing aid: ``RankContext.delayed``).

    Raises:
        ValueError: ``input_splits`` does not add up to ``x``'s rows.
    """
    if sum(input_splits) != x.shape[0]:
        raise ValueError(f"input splits {input_splits} add up to {sum(input_splits)} rows, not x's {x.shape[0]}")
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group, around, delayed)


def _exchange(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any, delayed: Delayed | None
) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    work = dist.all_to_all_single(out, x, output_splits, input_splits, group=group, async_op=delayed is not None)
    if delayed is not None:
        delayed(work).wait()
    return out
