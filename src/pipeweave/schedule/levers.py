"""Memory actions: saved activations moved away after F and back before the backward.

Two levers of the survey's storage optimisations (Guan et al. 2024, section 5.2):

- **offload** (vPipe, SuperNeurons; ZeRO-Infinity offloads to NVMe): ``OFFLOAD(s, j)``
  right after ``F(s, j)`` moves the microbatch's saved activations of stage s to host
  memory, ``RELOAD(s, j)`` right before its backward (B or I) brings them back;
- **activation balancing** (Kim et al. 2023, "BPipe: Memory-Balanced Pipeline
  Parallelism for Training Large Language Models"): rank r is paired with rank
  D-1-r; the one of a pair whose peak is above the pair's mean sends a share of every
  microbatch's saved activations to its partner after F (``EVICT``) and takes it back
  before the backward (``LOAD``), so both hold about the pair's mean.

They are lowered into a rank's rows like sends: each follows its producer and
precedes its consumer immediately. The share a BPipe rank evicts is the same for
all its microbatches: the smallest that keeps the rank, at every point of its
row, at or below the pair's mean (``evicted_share``).

Example:
    >>> from pipeweave.schedule import generate
    >>> s = generate("1f1b", num_stages=2, num_microbatches=2)
    >>> [str(a) for a in plan_stash(s, StashPlan(offload=frozenset({0}))).actions[0]]
    ['0F0', '0OFFLOAD0', '0F1', '0OFFLOAD1', '0RELOAD0', '0B0', '0RELOAD1', '0B1', '0U0']
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeweave.schedule.ir import Action, Op, Schedule, ScheduleError
from pipeweave.schedule.lower import LoweredSchedule
from pipeweave.schedule.validate import InvalidSchedule

DEFAULT_BANDWIDTH = 0.25
"""Units of M_a a memory action moves per unit of time by default (``sim.levers`` says where it comes from)."""

COMPRESSIONS = {"bf16": 0.5}
"""Compressed activation formats and the fraction of float32's bytes they keep."""


@dataclass(frozen=True, kw_only=True)
class StashPlan:
    """The memory levers of a run.

    Example:
        >>> StashPlan(offload=frozenset({0, 1}), compress="bf16").active
        True
    """

    offload: frozenset[int] = frozenset()
    """Parts whose saved activations go to host memory between F and the backward."""
    balance: bool = False
    """BPipe: ranks above their pair's mean evict a share of their activations to the partner."""
    compress: str | None = None
    """Saved activations stashed in this format between F and the backward (``COMPRESSIONS``); None: exact."""

    def __post_init__(self) -> None:
        if self.compress is not None and self.compress not in COMPRESSIONS:
            raise ScheduleError(
                f"--compress-activations {self.compress} is not supported; give one of {', '.join(COMPRESSIONS)}"
            )

    @property
    def active(self) -> bool:
        """Some lever is set."""
        return bool(self.offload) or self.balance or self.compress is not None

    @property
    def kept(self) -> float:
        """The fraction of a saved activation's bytes a stage keeps (compression)."""
        return COMPRESSIONS[self.compress] if self.compress is not None else 1.0


def parse_offload(text: str, num_parts: int) -> frozenset[int]:
    """``--offload``'s value: ``all``, ``none`` or comma-separated part numbers.

    Raises:
        ScheduleError: a part that is no number or not below ``num_parts``.

    Example:
        >>> sorted(parse_offload("all", 3)), sorted(parse_offload("0,2", 3))
        ([0, 1, 2], [0, 2])
    """
    if text.strip() == "all":
        return frozenset(range(num_parts))
    if text.strip() in ("", "none"):
        return frozenset()
    parts = set()
    for token in text.split(","):
        if not token.strip().isdigit() or int(token) >= num_parts:
            raise ScheduleError(
                f"--offload {text}: {token.strip()!r} is not a part; give all, none or part "
                f"numbers 0..{num_parts - 1}, comma-separated"
            )
        parts.add(int(token))
    return frozenset(parts)


def partner(rank: int, num_ranks: int) -> int | None:
    """BPipe's partner of ``rank``: rank D-1-r (None for the middle rank of an odd D)."""
    other = num_ranks - 1 - rank
    return None if other == rank else other


@dataclass(frozen=True)
class Stash:
    """A schedule's rows with their memory actions.

    Attributes:
        schedule: the compute schedule.
        plan: the levers.
        actions: per rank, compute and memory actions in order.
        share: per rank, the share of each microbatch's saved activations it moves away (1 for
            offloaded stages, BPipe's evicted share otherwise, 0 where nothing moves).
    """

    schedule: Schedule
    plan: StashPlan
    actions: tuple[tuple[Action, ...], ...]
    share: tuple[float, ...] = field(default=())

    def moved(self, a: Action) -> float:
        """The share of ``a``'s microbatch a memory action moves."""
        if a.op in (Op.OFFLOAD, Op.RELOAD):
            return 1.0
        return self.share[self.schedule.placement.stage_rank[a.stage]]


def plan_stash(
    schedule: Schedule,
    plan: StashPlan,
    held: Sequence[float] | None = None,
    mem_w: float = 0.5,
    shares: Sequence[float] | None = None,
) -> Stash:
    """The memory actions of ``plan`` on ``schedule``, lowered into its rows.

    Args:
        schedule: a compute schedule.
        plan: the levers.
        held: per part, the activation memory a microbatch holds from F to its backward (default 1),
            for BPipe's shares.
        mem_w: the fraction of it still held between I and W.
        shares: BPipe's share per rank, instead of ``evicted_shares`` (``sim.levers.balanced_shares``).
    """
    held = held if held is not None else (1.0,) * schedule.num_parts
    share = (
        (tuple(shares) if shares is not None else evicted_shares(schedule, plan, held, mem_w))
        if plan.balance
        else (0.0,) * schedule.num_ranks
    )
    part_of = schedule.placement.stage_part
    rows = []
    for rank, row in enumerate(schedule.actions):
        out: list[Action] = []
        for a in row:
            away = Op.OFFLOAD if part_of[a.stage] in plan.offload else Op.EVICT if share[rank] > 0 else None
            if a.op.computes_input_grad and away is not None:
                out.append(Action(a.stage, Op.RELOAD if away is Op.OFFLOAD else Op.LOAD, a.microbatch))
            out.append(a)
            if a.op is Op.F and away is not None:
                out.append(Action(a.stage, away, a.microbatch))
        rows.append(tuple(out))
    offloaded = [
        r for r in range(schedule.num_ranks) if all(part_of[s] in plan.offload for s in schedule.placement.stages_on(r))
    ]
    return Stash(
        schedule, plan, tuple(rows), tuple(1.0 if r in offloaded else share[r] for r in range(schedule.num_ranks))
    )


def own_peaks(schedule: Schedule, held: Sequence[float], mem_w: float) -> list[float]:
    """Per rank, the peak memory held for backwards in the order of its row (``sim.metrics.held_peaks``)."""
    part_of = schedule.placement.stage_part
    peaks = []
    for row in schedule.actions:
        now = peak = 0.0
        for s, op, _ in row:
            h = held[part_of[s]]
            now += (
                h
                if op is Op.F
                else -h
                if op is Op.B
                else h * (mem_w - 1)
                if op is Op.I
                else -h * mem_w
                if op is Op.W
                else 0.0
            )
            peak = max(peak, now)
        peaks.append(peak)
    return peaks


def evicted_shares(schedule: Schedule, plan: StashPlan, held: Sequence[float], mem_w: float) -> tuple[float, ...]:
    """Per rank, BPipe's evicted share: for a rank above its pair's mean peak, the smallest share x of
    every microbatch that keeps it at or below that mean at every point of its row, else 0.

    At a point where the rank holds ``a`` it cannot evict (the microbatch just forwarded or about
    to be backwarded, and I's leftovers for W) and ``b`` of other microbatches waiting for their
    backward, it holds ``a + (1 - x) b``: x >= 1 - (mean - a) / b, the largest over the points.

    Example:
        >>> from pipeweave.schedule import generate
        >>> evicted_shares(generate("1f1b", num_stages=4, num_microbatches=8), StashPlan(balance=True), (1.0,) * 4, 0.5)
        (0.5, 0.25, 0.0, 0.0)
    """
    peaks = own_peaks(schedule, held, mem_w)
    part_of = schedule.placement.stage_part
    shares = []
    for rank, row in enumerate(schedule.actions):
        other = partner(rank, schedule.num_ranks)
        mean = (peaks[rank] + peaks[other]) / 2 if other is not None else peaks[rank]
        if other is None or peaks[rank] <= mean:
            shares.append(0.0)
            continue
        waiting: dict[tuple[int, int], float] = {}  # forwarded, backward not begun: evictable
        fixed = x = 0.0  # I's leftovers, held until W
        for s, op, j in row:
            h = held[part_of[s]]
            if op is Op.F or op.computes_input_grad:
                waiting.pop((s, j), None)
                rest = sum(waiting.values())
                if rest > 0:
                    x = max(x, 1 - (mean - fixed - h) / rest)
            if op is Op.F:
                waiting[(s, j)] = h
            elif op is Op.I:
                fixed += h * mem_w
            elif op is Op.W:
                fixed -= h * mem_w
        shares.append(round(min(1.0, max(0.0, x)), 9))
    return tuple(shares)


_AWAY = {Op.RELOAD: Op.OFFLOAD, Op.LOAD: Op.EVICT}


def check_stash(stash: Stash) -> None:
    """Every memory action on its stage's rank, each move away after its F and taken back once, before the
    microbatch's backward (B or I) on that rank.

    Raises:
        InvalidSchedule: naming the rank and the position in its row with memory actions.
    """
    schedule = stash.schedule
    for rank, row in enumerate(stash.actions):
        seen: dict[Action, int] = {}
        for step, a in enumerate(row):
            seen[a] = step
            s, op, j = a

            def fail(reason: str) -> None:
                raise InvalidSchedule(f"{a} (action {step} with memory actions): {reason}", schedule, rank)

            if op.is_memory and schedule.placement.stage_rank[s] != rank:
                fail(f"stage {s} lives on rank {schedule.placement.stage_rank[s]}")
            if op in (Op.OFFLOAD, Op.EVICT) and Action(s, Op.F, j) not in seen:
                fail(f"it comes before {s}F{j}; move activations away after their F")
            if op in _AWAY and Action(s, _AWAY[op], j) not in seen:
                fail(f"nothing was moved away by {s}{_AWAY[op].value}{j} before it")
            if op.computes_input_grad:
                for away, back in ((Op.OFFLOAD, Op.RELOAD), (Op.EVICT, Op.LOAD)):
                    if Action(s, away, j) in seen and Action(s, back, j) not in seen:
                        fail(f"{s}{back.value}{j} must come before it: its activations are away")


def lower_stash(lowered: LoweredSchedule, stash: Stash) -> LoweredSchedule:
    """``lowered``'s rows with ``stash``'s memory actions: a move away after its F and the F's send (the
    next stage's input leaves first), a move back after the backward's receive, right before it.

    Example:
        >>> from pipeweave.schedule import generate, lower
        >>> s = generate("1f1b", num_stages=2, num_microbatches=1)
        >>> [str(a) for a in lower_stash(lower(s), plan_stash(s, StashPlan(offload=frozenset({0})))).actions[0]]
        ['0F0', '0SEND_F0', '0OFFLOAD0', '0RECV_B0', '0RELOAD0', '0B0', '0U0']
    """
    rows = []
    for row, memory in zip(lowered.actions, stash.actions):
        after: dict[Action, Action] = {}
        before: dict[Action, Action] = {}
        for k, a in enumerate(memory):
            if a.op in (Op.OFFLOAD, Op.EVICT):
                after[memory[k - 1]] = a
            elif a.op in (Op.RELOAD, Op.LOAD):
                before[memory[k + 1]] = a
        out: list[Action] = []
        for k, a in enumerate(row):
            if a in before:
                out.append(before[a])
            out.append(a)
            f = row[k - 1] if a.op is Op.SEND_F else a
            if f in after and not (a.op is Op.F and k + 1 < len(row) and row[k + 1].op is Op.SEND_F):
                out.append(after[f])
        rows.append(tuple(out))
    return LoweredSchedule(lowered.schedule, tuple(rows))
