"""Point-to-point transport of a lowered schedule: tagged isend/irecv, receives posted ahead.

Every message is named by a key ``(sender stage, direction, microbatch)``:
direction 0 carries an activation forward (``SEND_F`` -> ``RECV_F``), 1 an
input gradient backward (``SEND_B`` -> ``RECV_B``). Two rules make matching
unambiguous even when several stages share a pair of ranks (Chimera, DualPipe,
ZB-V, interleaved):

- every message has its own tag (gloo matches on peer and tag);
- a receiver posts its receives from a peer in the order that peer sends them,
  an order every rank computes from the lowered schedule (NCCL ignores tags and
  matches in posting order per pair).

Shapes travel once: the first message of each ``(sender stage, direction)``
is preceded by a small metadata tensor holding the dtype and the per-sample
shape (every dimension but the first). Dimension 0 is the microbatch, whose
size every rank knows from the batch split, so a last microbatch smaller than
the others needs no further message. Sends are non-blocking and waited lazily
(the validator's deadlock check assumes exactly that).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeweave.runtime.launch import wait_timeout
from pipeweave.schedule.ir import Action, Op
from pipeweave.schedule.lower import LoweredSchedule

_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)
_MAX_DIMS = 8
_META_LEN = 2 + _MAX_DIMS  # dtype code, number of sample dims, the sample dims
_META = -1  # microbatch field of a metadata message
_FWD, _BWD = 0, 1

Key = tuple[int, int, int]  # (sender stage, direction, microbatch or _META)


def message_key(lowered: LoweredSchedule, a: Action) -> Key:
    """The key of the message a communication action sends or receives.

    Example:
        >>> from pipeweave.schedule import generate, lower
        >>> low = lower(generate("1f1b", num_stages=2, num_microbatches=2))
        >>> message_key(low, Action(1, Op.RECV_F, 1))
        (0, 0, 1)
    """
    placement = lowered.schedule.placement
    if a.op is Op.SEND_F:
        return (a.stage, _FWD, a.microbatch)
    if a.op is Op.SEND_B:
        return (a.stage, _BWD, a.microbatch)
    if a.op is Op.RECV_F:
        sender = placement.prev_stage(a.stage)
        direction = _FWD
    elif a.op is Op.RECV_B:
        sender = placement.next_stage(a.stage)
        direction = _BWD
    else:
        raise ValueError(f"{a} is not a communication action")
    if sender is None:
        raise ValueError(f"{a} has no sender stage")
    return (sender, direction, a.microbatch)


def send_order(lowered: LoweredSchedule, rank: int, *, with_meta: bool) -> dict[int, list[Key]]:
    """Per destination rank, the keys ``rank`` sends in one step, in order.

    With ``with_meta`` a metadata key precedes the first message of each
    ``(sender stage, direction)`` (the first step's handshake).
    """
    order: dict[int, list[Key]] = {}
    announced: set[tuple[int, int]] = set()
    for a in lowered.actions[rank]:
        if a.op not in (Op.SEND_F, Op.SEND_B):
            continue
        key = message_key(lowered, a)
        keys = order.setdefault(lowered.peer(a), [])
        if with_meta and key[:2] not in announced:
            announced.add(key[:2])
            keys.append((key[0], key[1], _META))
        keys.append(key)
    return order


@dataclass
class _Posted:
    work: dist.Work
    buffer: torch.Tensor


class P2P:
    """One rank's send and receive side of a lowered schedule.

    Args:
        lowered: the lowered schedule every rank runs.
        rank: this rank in ``lowered`` (its rank in the process group).
        microbatch_sizes: size of dimension 0 of every microbatch.
        device: where received tensors live (CPU for gloo, this rank's GPU for NCCL).
        lookahead: receives are posted ahead up to this many compute actions.

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
    ) -> None:
        self.lowered, self.rank, self.device = lowered, rank, device
        self.sizes = list(microbatch_sizes)
        self.lookahead = lookahead
        self.row = lowered.actions[rank]
        self._span = len(self.sizes) + 1
        self._sent_meta: set[tuple[int, int]] = set()
        self._shapes: dict[tuple[int, int], tuple[torch.dtype, tuple[int, ...]]] = {}
        self._pending_sends: list[tuple[dist.Work, torch.Tensor]] = []
        self._posted: dict[Key, _Posted] = {}
        self._queues: dict[int, deque[Key]] = {}
        self._next_compute = self._compute_positions()
        self._first_step = True

    def _compute_positions(self) -> list[int]:
        """For each position, the index of the lookahead-th compute action after it."""
        compute = [i for i, a in enumerate(self.row) if a.op not in _COMM]
        out, k = [], 0
        for i in range(len(self.row)):
            while k < len(compute) and compute[k] <= i:
                k += 1
            target = k + self.lookahead - 1
            out.append(compute[target] if target < len(compute) else len(self.row))
        return out

    def tag(self, key: Key) -> int:
        """A unique non-negative tag per key within a step."""
        stage, direction, j = key
        return (stage * 2 + direction) * self._span + j + 1

    # ---- steps ----------------------------------------------------------
    def begin_step(self) -> None:
        """Compute, per peer, the order in which its messages to this rank arrive."""
        self._queues = {}
        for peer in range(len(self.lowered.actions)):
            if peer == self.rank:
                continue
            keys = send_order(self.lowered, peer, with_meta=self._first_step).get(self.rank, [])
            if keys:
                self._queues[peer] = deque(keys)
        self._first_step = False

    def end_step(self) -> None:
        """Wait for every send of the step (lazily, only now)."""
        for work, _ in self._pending_sends:
            work.wait(wait_timeout())
        self._pending_sends.clear()
        if self._posted or any(self._queues.values()):  # pragma: no cover - lowering bug
            raise RuntimeError(f"rank {self.rank}: unreceived messages at the end of a step")

    # ---- sends ----------------------------------------------------------
    def send(self, a: Action, tensor: torch.Tensor) -> None:
        """Post a non-blocking send of ``tensor`` for the SEND action ``a``."""
        key = message_key(self.lowered, a)
        peer = self.lowered.peer(a)
        tensor = tensor.detach().contiguous()
        if tensor.dim() == 0 or tensor.shape[0] != self.sizes[a.microbatch]:
            raise ValueError(
                f"{a}: tensor of shape {tuple(tensor.shape)} does not have the microbatch "
                f"({self.sizes[a.microbatch]}) as dimension 0"
            )
        if key[:2] not in self._sent_meta:
            self._sent_meta.add(key[:2])
            self._isend(_encode_meta(tensor).to(self.device), peer, (key[0], key[1], _META))
        # Forget finished sends so their buffers can be freed before the step ends.
        self._pending_sends = [(w, t) for w, t in self._pending_sends if not w.is_completed()]
        self._isend(tensor, peer, key)

    def _isend(self, tensor: torch.Tensor, peer: int, key: Key) -> None:
        work = dist.isend(tensor, dst=peer, tag=self.tag(key))
        assert work is not None
        self._pending_sends.append((work, tensor))

    # ---- receives -------------------------------------------------------
    def post_ahead(self, index: int) -> None:
        """Post the receives of the actions before the next ``lookahead`` compute actions."""
        stop = self._next_compute[index]
        for a in self.row[index:stop]:
            if a.op in (Op.RECV_F, Op.RECV_B):
                self._post_through(self.lowered.peer(a), message_key(self.lowered, a), block=False)

    def recv(self, a: Action) -> torch.Tensor:
        """Wait for the message of the RECV action ``a`` and return it."""
        key = message_key(self.lowered, a)
        self._post_through(self.lowered.peer(a), key, block=True)
        posted = self._posted.pop(key)
        posted.work.wait(wait_timeout())
        return posted.buffer

    def _post_through(self, peer: int, key: Key, *, block: bool) -> None:
        """Post receives from ``peer`` in its send order, up to and including ``key``."""
        if key in self._posted:
            return
        queue = self._queues.get(peer)
        while queue:
            nxt = queue[0]
            if nxt[2] != _META and nxt[:2] not in self._shapes:
                if not self._read_meta(nxt[:2], block):
                    return
            queue.popleft()
            self._post(peer, nxt)
            if nxt == key:
                return
        if block:  # pragma: no cover - lowering bug
            raise RuntimeError(f"rank {self.rank}: message {key} is not expected from rank {peer}")

    def _read_meta(self, stream: tuple[int, int], block: bool) -> bool:
        meta = self._posted.get((stream[0], stream[1], _META))
        if meta is None:  # pragma: no cover - the meta is always queued first
            raise RuntimeError(f"rank {self.rank}: no shape handshake for stream {stream}")
        if not block and not meta.work.is_completed():
            return False
        meta.work.wait(wait_timeout())
        del self._posted[(stream[0], stream[1], _META)]
        self._shapes[stream] = _decode_meta(meta.buffer.cpu())
        return True

    def _post(self, peer: int, key: Key) -> None:
        if key[2] == _META:
            buffer = torch.zeros(_META_LEN, dtype=torch.int64, device=self.device)
        else:
            dtype, sample = self._shapes[key[:2]]
            buffer = torch.empty((self.sizes[key[2]], *sample), dtype=dtype, device=self.device)
        work = dist.irecv(buffer, src=peer, tag=self.tag(key))
        assert work is not None
        self._posted[key] = _Posted(work, buffer)


_COMM = (Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B)


def _encode_meta(tensor: torch.Tensor) -> torch.Tensor:
    sample = tuple(tensor.shape[1:])
    if len(sample) > _MAX_DIMS or tensor.dtype not in _DTYPES:
        raise ValueError(f"cannot send a {tensor.dtype} tensor of shape {tuple(tensor.shape)}")
    values = [_DTYPES.index(tensor.dtype), len(sample), *sample]
    return torch.tensor(values + [0] * (_META_LEN - len(values)), dtype=torch.int64)


def _decode_meta(meta: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...]]:
    values = meta.tolist()
    ndim = values[1]
    return _DTYPES[values[0]], tuple(values[2 : 2 + ndim])
