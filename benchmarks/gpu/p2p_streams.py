"""The ``p2p/streams`` case of the GPU check: the transport's CUDA branches in one process.

Two ``P2P`` sides of a 2-stage 1F1B (``runtime.transport.p2p``) run in this
process on one device; ``post_group`` is replaced by a loopback that pairs a
group's sends with the other side's receives (same ranks and tag) and copies
each message on the stream it is posted from, finishing its work with a CUDA
event. So every CUDA branch of ``transport.buffers`` runs: groups posted from
the communication stream, the compute stream waiting on an event where a
received tensor is taken, sent tensors ``record_stream``'ed, receive buffers
from the pool on the GPU. Each stage computes ``tanh(x W)`` forward and its
input gradient backward; the first stage's input gradients must equal the same
arithmetic without messages, bitwise, and the pool must hold the same buffers
at step 2 and at the last step. NCCL itself is not involved (one rank cannot
message another; ``tests/runtime/test_batched_p2p.py`` checks the group order
it needs).
"""

from __future__ import annotations

from typing import Any

import torch

from pipeweave.runtime.transport import p2p
from pipeweave.runtime.transport.order import message_key
from pipeweave.schedule import generate, lower
from pipeweave.schedule.ir import Op

SIZES = [4, 4, 4, 3]  # microbatches; the last one smaller: a receive shape of its own


class _Work:
    """A loopback message's completion: set when both ends are posted, an event on the copy's stream (CUDA)."""

    def __init__(self) -> None:
        self.done, self.event = False, None

    def finish(self, device: torch.device) -> None:
        self.done = True
        if device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self, timeout: Any = None) -> bool:
        if not self.done:
            raise RuntimeError("loopback: a message waited on before its other end was posted")
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
        return True

    def is_completed(self) -> bool:
        return self.done and (self.event is None or self.event.query())


class Loopback:
    """``post_group`` for two sides in one process: ``me`` is the side posting."""

    def __init__(self, device: torch.device, sides: list[p2p.P2P]) -> None:
        self.device, self.sides, self.me = device, sides, 0
        self.waiting: dict[tuple[int, int, int], tuple[torch.Tensor, _Work]] = {}  # (src, dst, tag): first end
        self.off_stream = 0  # groups not posted from the posting side's communication stream

    def __call__(self, ops: list[p2p.GroupOp]) -> list[Any]:
        stream = self.sides[self.me].comm.stream
        if stream is not None and torch.cuda.current_stream() != stream:
            self.off_stream += 1
        works = []
        for send, tensor, peer, tag in ops:
            key = (self.me, peer, tag) if send else (peer, self.me, tag)
            work = _Work()
            other = self.waiting.pop(key, None)
            if other is None:
                self.waiting[key] = (tensor, work)
            else:
                source, target = (tensor, other[0]) if send else (other[0], tensor)
                target.copy_(source)
                for w in (work, other[1]):
                    w.finish(self.device)
            works.append(work)
        return works


def _stage(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w)


def _backward(g: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (g * (1 - y * y)) @ w.T


def _act(side: p2p.P2P, a: Any, state: dict[str, Any]) -> None:
    """Run action ``a`` of ``side``'s row: F, B and the messages (the rest has nothing to compute here)."""
    w, key = state["weights"][a.stage], (a.stage, a.microbatch)
    if a.op is Op.F:
        x = state["data"][a.microbatch] if a.stage == 0 else state["inputs"].pop(key)
        state["held"][key] = y = _stage(x, w)
        state["outputs"][key] = y
    elif a.op is Op.B:
        y = state["held"].pop(key)
        g = y if a.stage == 1 else state["grads"].pop(key)  # the last stage's loss gradient: its output
        gx = _backward(g, y, w)
        state["result" if a.stage == 0 else "grads_out"][key] = gx
    elif a.op in (Op.SEND_F, Op.SEND_B):
        side.send(a, state["outputs" if a.op is Op.SEND_F else "grads_out"].pop(key))
    elif a.op in (Op.RECV_F, Op.RECV_B):
        state["inputs" if a.op is Op.RECV_F else "grads"][key] = side.recv(a)


def _step(sides: list[p2p.P2P], loop: Loopback, state: dict[str, Any]) -> None:
    rows = [side.row for side in sides]
    position = [0, 0]
    for side in sides:
        side.begin_step()
    while any(position[r] < len(rows[r]) for r in range(2)):
        moved = False
        for r, side in enumerate(sides):
            loop.me = r
            while position[r] < len(rows[r]):
                i, a = position[r], rows[r][position[r]]
                side.post_ahead(i)
                if a.op.is_compute:
                    side.flush()
                if a.op.is_recv and not side.arrived(a):
                    break
                _act(side, a, state)
                position[r] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"loopback: both sides wait (positions {position})")
    for r, side in enumerate(sides):
        loop.me = r
        side.end_step()


def run(device: torch.device, hidden: int, steps: int) -> dict[str, Any]:
    """Run ``steps`` steps; returns the largest difference from the direct arithmetic, the pool per step
    (buffers, bytes) of the receiving sides and the groups posted off the communication stream."""
    lowered = lower(generate("1f1b", num_stages=2, num_microbatches=len(SIZES)))
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(hidden, hidden, generator=gen) / hidden**0.5).to(device) for _ in range(2)]
    data = [torch.randn(n, hidden, generator=gen).to(device) for n in SIZES]
    sides = [p2p.P2P(lowered, r, SIZES, device) for r in range(2)]
    loop, original = Loopback(device, sides), p2p.post_group
    p2p.post_group = loop
    pools, worst = [], 0.0
    try:
        for _ in range(steps):
            state: dict[str, Any] = {"weights": weights, "data": data, "result": {}}
            for name in ("inputs", "outputs", "held", "grads", "grads_out"):
                state[name] = {}
            _step(sides, loop, state)
            pools.append([(side.pool.count, side.pool.nbytes) for side in sides])
            for j, x in enumerate(data):  # the same arithmetic, no messages
                y0 = _stage(x, weights[0])
                y1 = _stage(y0, weights[1])
                expected = _backward(_backward(y1, y1, weights[1]), y0, weights[0])
                worst = max(worst, float((state["result"][(0, j)] - expected).abs().max()))
    finally:
        p2p.post_group = original
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    assert message_key(lowered, lowered.actions[1][0]) == (0, 0, 0)  # rank 1 starts by receiving stage 0's F0
    return {"difference": worst, "pools": pools, "off_stream": loop.off_stream}
