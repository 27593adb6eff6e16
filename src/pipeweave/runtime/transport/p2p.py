"""Point-to-point transport of a lowered schedule: one group of sends and receives per gap, in one per-pair order.

Every message is named by a key ``(sender stage, kind, microbatch)`` and
posted in the order ``transport.order`` derives from the lowered schedule,
the same on both ends of a pair (as NCCL needs). Over the process group the
messages a rank posts between two compute actions go out together, as one
``torch.distributed.batch_isend_irecv`` group (``post_group``; Megatron-LM
and torch.distributed.pipelining batch theirs alike), in that order: the
executor closes a group (``flush``) before each compute action,
and the transport closes it before it waits on anything. Under
``--transport shm`` a pair with a ring posts each message into its ring at
once instead (a ring needs no grouping).

Shapes travel once: the first message of each ``(sender stage, kind)``
activation stream is preceded by a small metadata tensor holding the dtype
and the per-sample shape (every dimension but the first). Dimension 0 is the
microbatch, whose size every rank knows from the batch split, so a last
microbatch smaller than the others needs no further message. Where the
per-sample shape changes from microbatch to microbatch (sequences of
variable length, ``variable_shapes``), every message is preceded by its own
metadata instead -- one more small message each, paid only by such runs; a
run of fixed shapes keeps the handshake of its first step alone. Sends
are non-blocking and waited lazily (the validator's deadlock check assumes
exactly that).

A tuple of tensors (a custom model's layers may pass several,
``models.boundary``) travels as one message, packed into a byte buffer and
described by its stream's metadata (``runtime.transport.message``); the receiver
unpacks views of the buffer. An input gradient of a tuple is a tuple too.

Every message of a fixed-shape stream is received into a buffer of its
stream's pool (``buffers.RecvPool``), which makes a buffer only when all of
that shape are held by their consumers and takes one back when its consumer
lets go of it: as many buffers as the stream had alive at once, no more in
later steps. A run of variable shapes receives every message into a buffer
of its own. On CUDA the groups are posted from a communication stream of
their own, the compute stream waits only where an action takes a received
tensor, and a sent tensor lives until its send is done (``buffers.CommStream``).

An F&B pair (``Schedule.pairs``) is one gap wide: the receives of its B half
are posted in the group before its F half, so they move (on CUDA, on the
communication stream) while the F half computes, and are waited only before
the B half; the F half's sends go out between the halves, while the B half
computes. The order of compute, and so every result, is the same as without.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeweave.runtime.context import RankContext
from pipeweave.runtime.transport import shm
from pipeweave.runtime.transport.buffers import CommStream, RecvPool
from pipeweave.runtime.transport.message import META_LEN, Layout, read_meta, tensor_meta
from pipeweave.runtime.transport.order import KINDS, META, TIED, Key, message_key, send_order
from pipeweave.schedule.ir import Action, pair_positions
from pipeweave.schedule.lower import LoweredSchedule


@dataclass
class _Posted:
    work: Any  # dist.Work, or shm.RecvWork under --transport shm; None until its group is posted
    buffer: torch.Tensor
    layout: Layout | None = None  # a packed tuple, unpacked when waited
    samples: int = 0


@dataclass
class _Sent:
    work: Any  # None until its group is posted
    tensor: torch.Tensor  # kept alive until the send completes


class _GroupWork:
    """The works of a group that completes as one (a backend that coalesces, NCCL, returns one for all)."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self, timeout: Any = None) -> bool:
        for work in self.works:
            work.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


GroupOp = tuple[bool, torch.Tensor, int, int]
"""A message of a group: ``(is a send, tensor, peer process, tag)``."""


def post_group(ops: list[GroupOp]) -> list[Any]:
    """Post ``ops`` in order as one ``batch_isend_irecv`` group: one work per message, or one for the group
    where the backend coalesces (NCCL)."""
    return dist.batch_isend_irecv(  # type: ignore[no-any-return]
        [dist.P2POp(dist.isend if send else dist.irecv, tensor, peer, tag=tag) for send, tensor, peer, tag in ops]
    )


class P2P:
    """One rank's send and receive side of a lowered schedule.

    Args:
        lowered: the lowered schedule every rank runs.
        rank: this rank in ``lowered`` (its stage rank: ``context.process_of`` gives the process of each).
        microbatch_sizes: size of dimension 0 of every microbatch.
        device: where received tensors live (CPU for gloo, this rank's GPU for NCCL).
        lookahead: receives from a peer on a shared-memory ring are posted ahead up to this many compute
            actions after the end of the current gap; those over the process group in their own gap's group
            (a group posted ahead would hold up every later group of the rank on NCCL's one stream).
        variable_shapes: every message carries its own metadata (per-sample shapes that change).
        context: the rank's run context: the processes of the stage ranks (its mesh), the shared-memory
            transport if any, how long a wait may take.

    Example (per step, in the executor):
        p2p.begin_step(); p2p.post_ahead(i); x = p2p.recv(a); p2p.send(a, y); p2p.end_step()
    """

    def __init__(
        self,
        lowered: LoweredSchedule,
        rank: int,
        microbatch_sizes: Sequence[int],
        device: torch.device,
        lookahead: int = 2,
        variable_shapes: bool = False,
        context: RankContext | None = None,
    ) -> None:
        self.lowered, self.rank, self.device = lowered, rank, device
        self.context = context if context is not None else RankContext()
        self.variable_shapes = variable_shapes
        self.sizes = list(microbatch_sizes)
        self.lookahead = lookahead
        self.row = lowered.actions[rank]
        self._span = len(self.sizes) + 1
        # Per (stage, kind) stream sent: dtype, per-sample shape and bytes (announced by its metadata).
        self._sent: dict[tuple[int, int], tuple[torch.dtype, tuple[int, ...], int]] = {}
        self._sent_layouts: dict[tuple[int, int], Layout] = {}  # streams of tuples
        # Per stream received: dtype, per-sample shape and bytes (read from its metadata), or a tuple's layout.
        self._shapes: dict[tuple[int, int], tuple[torch.dtype, tuple[int, ...], int] | Layout] = {}
        self._pending_sends: list[_Sent] = []
        self._group: list[tuple[GroupOp, _Posted | _Sent]] = []  # posted since the last compute action
        self._posted: dict[Key, _Posted] = {}
        self._queues: dict[int, deque[Key]] = {}
        ahead, gap = self._compute_positions(lookahead), self._pair_gaps(self._compute_positions(0))
        ring = self.context.transport
        # Per position, (peer, key) of every receive up to the lookahead-th compute action after it (a ring's
        # peer) or to the end of the gap (a peer over the process group: the gap's group, the same on NCCL).
        self._ahead = [
            [
                (lowered.peer(a), message_key(lowered, a))
                for j, a in enumerate(self.row[i:stop], i)
                if a.op.is_recv
                and (j < gap[i] or bool(ring and self.context.process_of(lowered.peer(a)) in ring.incoming))
            ]
            for i, stop in enumerate(ahead)
        ]
        self._first_step = True
        self.pool = RecvPool(device)
        """The receive buffers of fixed-shape streams (``buffers.RecvPool``)."""
        self.comm = CommStream(device)
        """Where groups are posted and received tensors are waited for (``buffers.CommStream``)."""
        # Per peer, the keys it sends here, first step (with metadata) and later: computed once.
        self._orders: dict[bool, dict[int, list[Key]]] = {}
        self.tied: dict[int, int] = {}
        """Every tied stage of the schedule -> the stage of its other end (set before the first step)."""
        self.tied_message: tuple[torch.dtype, int] | None = None
        """A stream's tied messages (``runtime.stage.tied_stream``): dtype and length, posted in order like the
        others; None: a synchronous step's, posted by ``runtime.stage.tied`` itself."""

    def _compute_positions(self, lookahead: int) -> list[int]:
        """For each position, the index of the ``lookahead``-th compute action after the one that ends its gap
        (itself, for a compute action): every position of a gap posts the same receives, so the first one posts
        them with the gap's sends, in the gap's one group."""
        compute = [i for i, a in enumerate(self.row) if a.op.is_compute]
        out, k = [], 0
        for i in range(len(self.row)):
            while k < len(compute) and compute[k] < i:
                k += 1
            target = k + lookahead
            out.append(compute[target] if target < len(compute) else len(self.row))
        return out

    def _pair_gaps(self, gap: list[int]) -> list[int]:
        """``gap`` with an F&B pair's two halves as one action (``Schedule.pairs``): the receives of its B half
        go out in the group before its F half, so they move while the F half computes; its F half's sends
        still go out between the halves (the executor flushes before each compute action)."""
        halves = pair_positions(self.row, self.lowered.schedule.pairs)
        return [halves.get(k, k) for k in gap]

    def tag(self, key: Key) -> int:
        """A unique non-negative tag per key within a step (gloo matches on it; NCCL ignores it)."""
        stage, kind, j = key
        return (stage * KINDS + kind) * self._span + j + 1

    @property
    def tag_limit(self) -> int:
        """The first tag above every tag of this transport (free for other exchanges)."""
        return self.lowered.schedule.placement.num_stages * KINDS * self._span + 1

    # ---- steps ----------------------------------------------------------
    def begin_step(self) -> None:
        """Compute, per peer, the order in which its messages to this rank arrive."""
        orders = self._orders.get(self._first_step)
        if orders is None:
            orders = self._orders[self._first_step] = {
                peer: keys
                for peer in range(len(self.lowered.actions))
                if peer != self.rank
                for keys in [
                    send_order(
                        self.lowered,
                        peer,
                        with_meta=self._first_step,
                        tied=self.tied,
                        meta_every_message=self.variable_shapes,
                    ).get(self.rank, [])
                ]
                if keys
            }
        self._queues = {peer: deque(keys) for peer, keys in orders.items()}
        self._first_step = False

    def end_step(self) -> None:
        """Wait for every send of the step (lazily, only now)."""
        self.flush()
        sends = self._pending_sends
        self.comm.retire([s.work for s in sends], [s.tensor for s in sends], self.context.timeout)
        sends.clear()
        if self._posted or any(self._queues.values()):  # pragma: no cover - lowering bug
            raise RuntimeError(f"rank {self.rank}: unreceived messages at the end of a step")

    # ---- sends ----------------------------------------------------------
    def send(self, a: Action, tensor: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
        """Post a non-blocking send of ``tensor`` (or a tuple of tensors) for the SEND action ``a``.

        Few tensor calls on this path: right after a compute action each one is
        slow (cold caches; benchmarks/runtime/README.md), and a microbatch's
        message paid several.
        """
        key = message_key(self.lowered, a)
        peer = self.lowered.peer(a)
        if isinstance(tensor, tuple):
            self._send_packed(a, key, peer, tensor)
            return
        shape = tensor.shape
        if not shape or shape[0] != self.sizes[a.microbatch]:
            raise ValueError(
                f"{a}: tensor of shape {tuple(shape)} does not have the microbatch "
                f"({self.sizes[a.microbatch]}) as dimension 0"
            )
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        stream = key[:2]
        sent = self._sent.get(stream)
        if sent is None or self.variable_shapes:
            sent = self._sent[stream] = (tensor.dtype, tuple(shape[1:]), tensor.element_size() * math.prod(shape[1:]))
            self._isend(tensor_meta(tensor).to(self.device), peer, (key[0], key[1], META))
        elif tuple(shape[1:]) != sent[1] or tensor.dtype != sent[0]:
            raise ValueError(
                f"{a}: a {tensor.dtype} tensor of per-sample shape {tuple(shape[1:])} in a stream "
                f"announced as {sent[0]} {sent[1]}"
            )
        self._forget_finished_sends()
        self._isend(tensor, peer, key, sent[2] * shape[0])

    def _send_packed(self, a: Action, key: Key, peer: int, tensors: tuple[torch.Tensor, ...]) -> None:
        samples = self.sizes[a.microbatch]
        for t in tensors:
            if not t.shape or t.shape[0] != samples:
                raise ValueError(
                    f"{a}: a tuple's tensor of shape {tuple(t.shape)} does not have the microbatch "
                    f"({samples}) as dimension 0"
                )
        layout = Layout.of(tensors)
        stream = key[:2]
        sent = self._sent_layouts.get(stream)
        if sent is None or self.variable_shapes:
            sent = self._sent_layouts[stream] = layout
            self._isend(layout.encode().to(self.device), peer, (key[0], key[1], META))
        elif layout != sent:
            raise ValueError(f"{a}: a tuple {layout.entries} in a stream announced as {sent.entries}")
        self._forget_finished_sends()
        buffer = layout.pack(tensors, samples)
        self._isend(buffer, peer, key, buffer.numel())

    def _forget_finished_sends(self) -> None:
        """Drop finished sends (a look every ``_PRUNE_AT`` held): their buffers may go before the step ends."""
        if len(self._pending_sends) >= _PRUNE_AT:
            self._pending_sends = [s for s in self._pending_sends if s.work is None or not s.work.is_completed()]

    def before_update(self, stage: int) -> None:
        """At ``U`` of ``stage``: if it is tied across ranks, post every receive its peer sends before the tie.

        ``runtime.stage.tied`` then posts the tied exchange itself, in its place.
        """
        other = self.tied.get(stage)
        if self.tied_message is not None:  # a stream's: received in order (recv_tied)
            return
        rank_of = self.lowered.schedule.placement.stage_rank
        if other is not None and rank_of[other] != self.rank:
            self._post_through(rank_of[other], (other, TIED, 0), block=True)
        self.flush()  # the tied exchange (runtime.stage.tied) comes after every message posted before it

    def send_tied(self, stage: int, k: int, peer: int, flat: torch.Tensor) -> None:
        """Post a stream's tied message: ``stage``'s half of its k-th update, to rank ``peer`` (non-blocking)."""
        self._isend(flat, peer, (stage, TIED, k), flat.numel() * flat.element_size())

    def recv_tied(self, stage: int, k: int, peer: int) -> torch.Tensor:
        """Wait for the tied message of ``stage``'s k-th update from rank ``peer`` (a stream's)."""
        return self._take((stage, TIED, k), peer).buffer

    def _isend(self, tensor: torch.Tensor, peer: int, key: Key, nbytes: int | None = None) -> None:
        """Post the send; ``nbytes``: the (contiguous) tensor's bytes, when known."""
        ring = self.context.transport  # --transport shm: the same messages, in the same order, through shared memory
        dst = self.context.process_of(peer)  # the peer stage rank's process with this tensor-parallel coordinate
        if not (ring and dst in ring.outgoing):  # a pair without a ring talks over the process group, grouped
            sent = _Sent(None, tensor)
            self._group.append(((True, tensor, dst, self.tag(key)), sent))
            self._pending_sends.append(sent)
            return
        work = ring.isend(tensor, dst, self.tag(key), nbytes)
        if work is not shm.SENT:  # a record already in the ring needs no waiting (and no tensor)
            self._pending_sends.append(_Sent(work, tensor))

    def flush(self) -> None:
        """Post every message gathered since the last call as one group (``post_group``), in posting order."""
        if not self._group:
            return
        group, self._group = self._group, []
        works = self.comm.post(lambda: post_group([op for op, _ in group]))
        if len(works) != len(group):  # coalesced: every message completes with the group
            works = [_GroupWork(works)] * len(group)
        for (_, holder), work in zip(group, works):
            holder.work = self.context.delayed(work)  # --comm-delay-ms: each message completes that much later

    # ---- receives -------------------------------------------------------
    def post_ahead(self, index: int) -> None:
        """Post the receives of the gap of ``index`` (from a ring's peer: up to the ``lookahead``-th compute action)."""
        for peer, key in self._ahead[index]:
            self._post_through(peer, key, block=False)

    def arrived(self, a: Action) -> bool:
        """Whether the message of the RECV action ``a`` is here already (its receive is posted if not yet)."""
        key = message_key(self.lowered, a)
        self._post_through(self.lowered.peer(a), key, block=False)
        self.flush()  # asked before a wait: what is gathered goes out now
        posted = self._posted.get(key)
        return posted is not None and bool(posted.work.is_completed())

    def recv(self, a: Action) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Wait for the message of the RECV action ``a`` and return it (a tuple if a tuple was sent)."""
        posted = self._take(message_key(self.lowered, a), self.lowered.peer(a))
        return posted.buffer if posted.layout is None else posted.layout.unpack(posted.buffer, posted.samples)

    def _take(self, key: Key, peer: int) -> _Posted:
        self._post_through(peer, key, block=True)
        self.flush()
        posted = self._posted.pop(key)  # a synchronous tie waits on its own (stage.tied)
        self.comm.consume(posted.work, self.context.timeout)
        return posted

    def _post_through(self, peer: int, key: Key, *, block: bool) -> None:
        """Post receives from ``peer`` in its send order, up to and including ``key``."""
        if key in self._posted:
            return
        queue = self._queues.get(peer)
        while queue:
            nxt = queue[0]
            if nxt[1] == TIED and self.tied_message is None:  # a step's, posted by runtime.stage.tied at this U
                if nxt != key:
                    if block:  # pragma: no cover - a receive needed after the peer's U
                        raise RuntimeError(f"rank {self.rank}: message {key} is queued behind a tied exchange")
                    return
                queue.popleft()
                return
            if (
                nxt[2] != META
                and nxt[1] != TIED
                and nxt[:2] not in self._shapes
                and not self._read_meta(nxt[:2], block)
            ):
                return
            queue.popleft()
            self._post(peer, nxt)
            if self.variable_shapes and nxt[2] != META and nxt[1] != TIED:  # the next message brings its own shape
                del self._shapes[nxt[:2]]
            if nxt == key:
                return
        if block:  # pragma: no cover - lowering bug
            raise RuntimeError(f"rank {self.rank}: message {key} is not expected from rank {peer}")

    def _read_meta(self, stream: tuple[int, int], block: bool) -> bool:
        meta = self._posted.get((stream[0], stream[1], META))
        if meta is None:  # pragma: no cover - the meta is always queued first
            raise RuntimeError(f"rank {self.rank}: no shape handshake for stream {stream}")
        if not block and (meta.work is None or not meta.work.is_completed()):
            return False
        self.flush()
        self.comm.consume(meta.work, self.context.timeout)
        del self._posted[(stream[0], stream[1], META)]
        described = read_meta(meta.buffer.cpu().tolist())
        if isinstance(described, Layout):
            self._shapes[stream] = described
        else:
            dtype, sample = described
            self._shapes[stream] = (dtype, sample, dtype.itemsize * math.prod(sample))
        return True

    def _post(self, peer: int, key: Key) -> None:
        layout = None
        if key[1] == TIED:
            assert self.tied_message is not None
            dtype, length = self.tied_message
            buffer = torch.empty(length, dtype=dtype, device=self.device)
            nbytes = length * dtype.itemsize
        elif key[2] == META:
            buffer = torch.zeros(META_LEN, dtype=torch.int64, device=self.device)
            nbytes = 8 * META_LEN
        else:
            shape = self._shapes[key[:2]]
            samples = self.sizes[key[2]]
            if isinstance(shape, Layout):
                layout, nbytes = shape, shape.nbytes(samples)
                buffer = self._buffer(key, torch.uint8, (nbytes,))
            else:
                dtype, sample, sample_bytes = shape
                buffer = self._buffer(key, dtype, (samples, *sample))
                nbytes = sample_bytes * samples
        ring = self.context.transport
        src = self.context.process_of(peer)
        posted = _Posted(None, buffer, layout, self.sizes[key[2]] if layout is not None else 0)
        if ring and src in ring.incoming:
            posted.work = ring.irecv(buffer, src, self.tag(key), nbytes)
        elif key[2] == META:  # alone in its group: waiting for it (to post its data's receive) waits for no more
            self.flush()
            self._group.append(((False, buffer, src, self.tag(key)), posted))
            self.flush()
        else:
            self._group.append(((False, buffer, src, self.tag(key)), posted))
        self._posted[key] = posted

    def _buffer(self, key: Key, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The receive buffer of message ``key``: from its stream's pool, or its own where shapes vary."""
        if self.variable_shapes:
            return torch.empty(shape, dtype=dtype, device=self.device)
        return self.pool.take(key[:2], dtype, shape)


_PRUNE_AT = 4  # unfinished sends held before looking for finished ones (a look costs a call per send)
