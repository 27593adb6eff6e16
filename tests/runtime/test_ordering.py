"""Per-pair posting order: every rank posts its receives from a peer in the order the peer posts its sends.

NCCL ignores tags and pairs the n-th send from rank a to rank b with the n-th
receive rank b posted from rank a. No GPU is needed to check that the runtime
is correct under that rule: here every rank's real ``Executor`` runs in a
thread of one process over an in-process transport that replaces
``torch.distributed.isend``/``irecv`` and matches exactly as NCCL does (per
ordered pair, first posted with first posted, tags ignored), refusing a pair
whose sizes or dtypes differ and completing a send only when its receive is
matched. For every synchronous schedule of the registry, on 2 and 3 ranks
(replicated ones: Chimera, GEMS, DualPipe, whose gradients are all-reduced
per part: the transport matches each group's collectives in call order, as
NCCL and gloo do, and fails where the members' calls differ), and
for a gpt with tied embeddings, the sequence of messages (named by their
unique gloo tag) that each rank sends to each peer must equal the sequence
the peer posts from it, and the losses must equal the reference executor's 1F1B.
The pure ``comm.rank_sends`` is also checked against the messages the
receivers' actions consume, independently.
"""

from __future__ import annotations

import datetime
import threading
from collections import Counter, deque
from typing import Any

import pytest
import torch
import torch.distributed as dist
from config_defaults import train_config

from pipeweave.config import TrainConfig
from pipeweave.data import data_source, split_microbatches
from pipeweave.models import ModelSpec
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.executor import Executor
from pipeweave.runtime.reference import run_reference
from pipeweave.runtime.run.prepare import optimizer_factory, prepare
from pipeweave.runtime.run.sizes import microbatch_sizes
from pipeweave.runtime.run.workers import build_workers
from pipeweave.runtime.transport import p2p
from pipeweave.runtime.transport.mesh import Mesh, replica_rank_sets
from pipeweave.runtime.transport.order import message_key, rank_sends
from pipeweave.schedule import SCHEDULES, ScheduleError, generate, lower
from pipeweave.schedule.ir import Op

pytestmark = pytest.mark.timeout(120)

STEPS = 2  # the first step carries the shape handshake, the second does not
_WAIT_S = 20.0  # a wait this long is a deadlock: fail, never hang


class _Work:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: str | None = None

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if not self.done.wait(_WAIT_S):
            raise RuntimeError("a message was never matched (deadlock under in-order matching)")
        if self.error:
            raise RuntimeError(self.error)
        return True

    def is_completed(self) -> bool:
        return self.done.is_set()


class InOrderTransport:
    """isend/irecv matched per ordered pair in posting order, tags ignored (NCCL's rule)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.local = threading.local()
        self.sends: dict[tuple[int, int], deque[tuple[torch.Tensor, _Work]]] = {}
        self.recvs: dict[tuple[int, int], deque[tuple[torch.Tensor, _Work]]] = {}
        self.sent: dict[tuple[int, int], list[int]] = {}  # (src, dst) -> tags in posting order
        self.posted: dict[tuple[int, int], list[int]] = {}
        self.mismatches: list[str] = []
        self.groups: dict[int, list[list[tuple[bool, int, int]]]] = {}  # rank -> its groups: (send?, peer, tag)
        self.calls: dict[tuple[int, int], list[int]] = {}  # (part, rank) -> all-reduces called
        self.collectives: dict[tuple[int, int], dict[int, tuple[torch.Tensor, _Work]]] = {}

    def all_reduce(self, tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> _Work:
        """Sum over the group's members (``group``: ``("part", part, ranks)``), matched per group in call order."""
        _, part, ranks = group
        work = _Work()
        with self.lock:
            calls = self.calls.setdefault((part, self.local.rank), [0])
            key = (part, calls[0])
            calls[0] += 1
            arrived = self.collectives.setdefault(key, {})
            arrived[self.local.rank] = (tensor, work)
            if len(arrived) == len(ranks):
                shapes = {tuple(t.shape) for t, _ in arrived.values()}
                total = sum(arrived[r][0].clone() for r in sorted(arrived))
                for t, w in arrived.values():
                    if len(shapes) > 1:
                        w.error = f"part {part}: all-reduce of shapes {sorted(shapes)}"
                        self.mismatches.append(w.error)
                    else:
                        t.copy_(total)
                    w.done.set()
        return work

    def post_group(self, ops: list[tuple[bool, torch.Tensor, int, int]]) -> list[_Work]:
        """``transport.p2p.post_group``: the group's messages posted in order (one work each, as gloo's)."""
        self.groups.setdefault(self.local.rank, []).append([(send, peer, tag) for send, _, peer, tag in ops])
        return [self.isend(t, peer, tag=tag) if send else self.irecv(t, peer, tag=tag) for send, t, peer, tag in ops]

    def isend(self, tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> _Work:
        return self._post(self.local.rank, dst, tensor, tag, sending=True)

    def irecv(self, tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> _Work:
        assert src is not None
        return self._post(src, self.local.rank, tensor, tag, sending=False)

    def _post(self, src: int, dst: int, tensor: torch.Tensor, tag: int, *, sending: bool) -> _Work:
        work = _Work()
        with self.lock:
            (self.sent if sending else self.posted).setdefault((src, dst), []).append(tag)
            mine, theirs = (self.sends, self.recvs) if sending else (self.recvs, self.sends)
            waiting = theirs.setdefault((src, dst), deque())
            if not waiting:
                mine.setdefault((src, dst), deque()).append((tensor, work))
                return work
            other, other_work = waiting.popleft()
            send, recv = (tensor, other) if sending else (other, tensor)
            if send.dtype != recv.dtype or send.shape != recv.shape:
                error = (
                    f"rank {src} -> {dst}: sent {send.dtype}{tuple(send.shape)} into {recv.dtype}{tuple(recv.shape)}"
                )
                self.mismatches.append(error)
                work.error = other_work.error = error
            else:
                recv.copy_(send)
        work.done.set()
        other_work.done.set()
        return work


def _run_threads(config: TrainConfig, transport: InOrderTransport) -> list[float]:
    """Every rank's Executor in its own thread over ``transport``; the per-step mini-batch losses."""
    plan = prepare(config)
    schedule = plan.schedule
    lowered = lower(schedule)
    # The run's mesh, its replica groups stand-ins the transport recognises (every thread reads the one mesh).
    groups = {part: ("part", part, ranks) for part, ranks in replica_rank_sets(schedule.placement).items()}
    joined = Mesh(1, schedule.num_ranks, 1, 0, replica_groups=groups)
    return _run_rank_threads(config, plan, transport, lowered, joined)


def _run_rank_threads(
    config: TrainConfig, plan: Any, transport: InOrderTransport, lowered: Any, joined: Mesh
) -> list[float]:
    schedule, device = plan.schedule, torch.device("cpu")
    losses = [[0.0] * schedule.num_ranks for _ in range(config.steps)]
    errors: list[str] = []

    def rank_main(rank: int) -> None:
        transport.local.rank = rank
        try:
            context = RankContext(process=rank, world=schedule.num_ranks, mesh=joined)
            workers = build_workers(plan, rank, device, context=context)
            executor = Executor(lowered, rank, workers, microbatch_sizes(config), device, context=context)
            source = data_source(config.model, batch_size=config.batch_size, seed=config.seed)
            for step in range(config.steps):
                inputs, targets = source.batch(step)
                t = schedule.num_microbatches
                losses[step][rank], _ = executor.run_step(split_microbatches(inputs, t), split_microbatches(targets, t))
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append(f"rank {rank}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(schedule.num_ranks)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads), "a rank hung"
    assert not errors, errors
    return [sum(step) for step in losses]


def _config(name: str, ranks: int, model: ModelSpec | None = None) -> TrainConfig | None:
    info = SCHEDULES[name]
    for t in (4, 6, 8):
        config = train_config(
            schedule=name,
            num_stages=ranks,
            num_microbatches=t,
            batch_size=2 * t - 1,
            steps=STEPS,
            model=model or ModelSpec(kind="mlp", layers=4 * ranks, hidden=8),
            num_chunks=2 if info.chunks is None else None,
        )
        try:
            schedule = prepare(config).schedule
        except ScheduleError:
            continue
        if schedule.num_ranks == ranks:
            return config
    return None


def _cases() -> dict[str, TrainConfig]:
    cases = {}
    for name, info in SCHEDULES.items():
        if info.synchronous:
            for ranks in (2, 3):
                config = _config(name, ranks)
                if config is not None:
                    cases[f"{name}-{ranks}ranks"] = config
    tied = ModelSpec(kind="gpt", layers=4, hidden=16, heads=2, seq_len=8, tie_embeddings=True)
    for name in ("1f1b", "chimera"):
        config = _config(name, 2, tied)
        if config is not None:
            cases[f"{name}-gpt-tied"] = config
    return cases


CASES = _cases()


def _installed(monkeypatch: pytest.MonkeyPatch) -> InOrderTransport:
    """A fresh ``InOrderTransport`` in place of the process group's messages, groups and all-reduces."""
    transport = InOrderTransport()
    monkeypatch.setattr(p2p, "post_group", transport.post_group)
    monkeypatch.setattr(dist, "isend", transport.isend)
    monkeypatch.setattr(dist, "irecv", transport.irecv)
    monkeypatch.setattr(dist, "all_reduce", transport.all_reduce)
    return transport


@pytest.mark.parametrize("case", sorted(CASES))
def test_posting_order_matches_per_pair_and_losses_equal_reference(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config = CASES[case]
    transport = _installed(monkeypatch)
    losses = _run_threads(config, transport)
    assert not transport.mismatches, transport.mismatches
    assert transport.sent, "no message crossed ranks"
    assert set(transport.sent) == set(transport.posted)
    for pair, tags in transport.sent.items():
        assert transport.posted[pair] == tags, f"{case}: rank {pair[0]} -> {pair[1]} posted out of order"
    # The reference executor running 1F1B: every synchronous schedule is the same computation.
    # (Not the same schedule: the reference's own chimera with tied embeddings drifts from its 1F1B.)
    one_f_one_b = generate("1f1b", num_stages=config.num_stages, num_microbatches=config.num_microbatches)
    reference = run_reference(
        one_f_one_b,
        config.model,
        steps=config.steps,
        batch_size=config.batch_size,
        optimizer_factory=optimizer_factory(config),
        seed=config.seed,
    )
    torch.testing.assert_close(losses, reference.losses, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", sorted(CASES))
def test_rank_sends_are_what_the_receivers_consume(case: str) -> None:
    """Each rank's sends to a peer, as a multiset, are exactly what that peer's actions consume from it."""
    schedule = prepare(CASES[case]).schedule
    lowered = lower(schedule)
    for rank in range(schedule.num_ranks):
        sent: Counter[tuple[int, tuple[int, int, int]]] = Counter(rank_sends(lowered, rank, with_meta=False))
        consumed: Counter[tuple[int, tuple[int, int, int]]] = Counter()
        for peer in range(schedule.num_ranks):
            for a in lowered.actions[peer]:
                if a.op in (Op.RECV_F, Op.RECV_B) and lowered.peer(a) == rank:
                    consumed[(peer, message_key(lowered, a))] += 1
        assert sent == +consumed, case


GROUP_CASES = ("1f1b-2ranks", "zb-h1-3ranks", "interleaved-1f1b-2ranks", "1f1b-gpt-tied")


def _gap_sends(lowered: Any, rank: int, p2p_of_rank: p2p.P2P) -> list[list[int]]:
    """The tags of the sends of each gap between two compute actions of ``rank``'s row (gaps without one left out)."""
    gaps: list[list[int]] = [[]]
    for a in lowered.actions[rank]:
        if a.op.is_compute:
            gaps.append([])
        elif a.op.is_send:
            gaps[-1].append(p2p_of_rank.tag(message_key(lowered, a)))
    return [gap for gap in gaps if gap]


@pytest.mark.parametrize("case", GROUP_CASES)
def test_each_gap_is_one_group_in_one_order_on_both_ends(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank posts the sends between two compute actions as one group (``p2p.post_group``), and the messages of
    every pair go out in the sender's groups in the order the receiver's groups post them."""
    config = CASES[case]
    transport = _installed(monkeypatch)
    _run_threads(config, transport)
    lowered = lower(prepare(config).schedule)
    sizes = microbatch_sizes(config)
    for rank, groups in transport.groups.items():
        tags = p2p.P2P(lowered, rank, sizes, torch.device("cpu"))
        span = len(sizes) + 1  # a metadata message's tag is a multiple of it (P2P.tag)
        sends = [[tag for send, _, tag in group if send and tag % span] for group in groups]
        assert [s for s in sends if s] == _gap_sends(lowered, rank, tags) * STEPS, f"{case}: rank {rank}"
    pairs = {(rank, peer) for rank, groups in transport.groups.items() for group in groups for _, peer, _ in group}
    for a, b in pairs:
        sent = [tag for group in transport.groups[a] for send, peer, tag in group if send and peer == b]
        posted = [tag for group in transport.groups.get(b, []) for send, peer, tag in group if not send and peer == a]
        assert sent == posted, f"{case}: rank {a} -> {b}"
