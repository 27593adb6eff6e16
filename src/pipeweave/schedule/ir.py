"""The schedule IR: parts, stages, placement, actions and per-rank action lists.

Vocabulary (DESIGN.md, after the survey of Guan et al. 2024):

- the model is cut into consecutive **parts**; a **stage** is one instance of a
  part placed on a **rank**. Schedules that replicate parts (Chimera, GEMS,
  DualPipe, data parallelism) have several stages per part;
- a **pipeline** is the sequence of stages, one per part in part order, that a
  microbatch traverses; every microbatch is routed through exactly one pipeline;
- an **action** is ``(stage, op, microbatch)``, written ``"2F0"``; for ``U`` the
  microbatch field counts the stage's updates;
- an **F&B pair** (DeepSeek-V3's overlapped forward and backward, torch's
  ``OVERLAP_F_B``) is an F and the B or I right after it on the same rank, run
  as one action: the communication of one half moves while the other computes
  (``Schedule.pairs``), written ``(3F5;0B0)OVERLAP_F_B`` as torch writes it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from pipeweave.errors import UserError


class ScheduleError(UserError):
    """A schedule or a schedule configuration is invalid; the message says how."""


class Op(str, enum.Enum):
    """What an action does. Compute ops first, then the lowered communication.

    The predicates name the sets of ops the code tests:

        >>> [op.value for op in Op if op.is_compute]
        ['F', 'B', 'I', 'W', 'U']
        >>> [op.value for op in Op if op.is_memory]
        ['OFFLOAD', 'RELOAD', 'EVICT', 'LOAD']
        >>> [op.value for op in Op if op.is_send], [op.value for op in Op if op.is_recv]
        (['SEND_F', 'SEND_B'], ['RECV_F', 'RECV_B'])
        >>> [op.value for op in Op if op.is_backward]
        ['B', 'I', 'W']
        >>> [op.value for op in Op if op.computes_input_grad]
        ['B', 'I']
        >>> [op.value for op in Op if op.computes_weight_grad]
        ['B', 'W']
    """

    F = "F"  # forward
    B = "B"  # full backward (input and weight gradients)
    I = "I"  # noqa: E741  input-gradient half of a backward
    W = "W"  # weight-gradient half of a backward
    U = "U"  # optimizer update of the stage's part
    SEND_F = "SEND_F"  # activation to the next stage
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"  # input gradient to the previous stage
    RECV_B = "RECV_B"
    # Memory actions, lowered by ``schedule.levers`` (like sends, never in a compute schedule):
    OFFLOAD = "OFFLOAD"  # a microbatch's saved activations to host memory (after its F)
    RELOAD = "RELOAD"  # ... and back (before its backward)
    EVICT = "EVICT"  # BPipe: a share of them to the partner rank
    LOAD = "LOAD"  # BPipe: that share taken back (before the backward)

    def __str__(self) -> str:
        return self.value

    @property
    def is_compute(self) -> bool:
        """F, B, I, W or U: work on a stage's part, not communication nor memory."""
        return not self.is_comm and not self.is_memory

    @property
    def is_memory(self) -> bool:
        """OFFLOAD, RELOAD, EVICT or LOAD: saved activations moved away and back (``schedule.levers``)."""
        return self in _MEMORY

    @property
    def is_comm(self) -> bool:
        """A send or a receive, inserted by lowering."""
        return self.is_send or self.is_recv

    @property
    def is_send(self) -> bool:
        """SEND_F or SEND_B."""
        return self is Op.SEND_F or self is Op.SEND_B

    @property
    def is_recv(self) -> bool:
        """RECV_F or RECV_B."""
        return self is Op.RECV_F or self is Op.RECV_B

    @property
    def is_backward(self) -> bool:
        """B, I or W: part of a microbatch's backward pass."""
        return self is Op.B or self is Op.I or self is Op.W

    @property
    def computes_input_grad(self) -> bool:
        """B or I: consumes the output gradient and produces the input gradient."""
        return self is Op.B or self is Op.I

    @property
    def computes_weight_grad(self) -> bool:
        """B or W: produces a weight gradient (what a U applies)."""
        return self is Op.B or self is Op.W


_MEMORY = frozenset((Op.OFFLOAD, Op.RELOAD, Op.EVICT, Op.LOAD))


class Action(NamedTuple):
    """One step of one rank: ``Action(2, Op.F, 0)`` is written ``2F0``."""

    stage: int
    op: Op
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.op.value}{self.microbatch}"


class WeightPolicy(str, enum.Enum):
    """Which weight version each action reads (DESIGN.md, weight-policy table)."""

    SYNC = "sync"  # flush: every action of a step reads the same version
    STASH = "stash"  # PipeDream: backward reads the version its forward read
    VERTICAL_SYNC = "vertical-sync"  # all stages read the version stage 0 read
    DOUBLE_BUFFER = "double-buffer"  # PipeDream-2BW
    NONE = "none"  # AMPNet: read whatever is current
    DISCREPANCY_CORRECTION = "discrepancy-correction"  # PipeMare
    PREDICTION = "prediction"  # SpecTrain: every F and B predicts for its own distance
    BELLWETHER_PREDICTION = "bellwether-prediction"  # XPipe: one prediction per mini-batch and pass
    AVERAGING = "averaging"  # AvgPipe

    def __str__(self) -> str:
        return self.value

    @property
    def predicts(self) -> bool:
        """True when actions read weights predicted along the optimizer's next steps (SpecTrain, XPipe)."""
        return self in (WeightPolicy.PREDICTION, WeightPolicy.BELLWETHER_PREDICTION)


@dataclass(frozen=True)
class Placement:
    """Where stages live and which parts they hold.

    Args:
        stage_rank: rank of each stage.
        stage_part: part held by each stage.
        pipelines: per pipeline, its stages in part order (part 0 first).

    Example:
        >>> p = Placement.straight(4)
        >>> p.stage_rank, p.pipelines
        ((0, 1, 2, 3), ((0, 1, 2, 3),))
    """

    stage_rank: tuple[int, ...]
    stage_part: tuple[int, ...]
    pipelines: tuple[tuple[int, ...], ...]
    # Derived lookups, filled in __post_init__.
    _position: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)
    _replicas: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.stage_rank) != len(self.stage_part):
            raise ScheduleError(
                f"placement has {len(self.stage_rank)} stage ranks but "
                f"{len(self.stage_part)} stage parts; give one of each per stage"
            )
        num_parts = self.num_parts
        position: list[tuple[int, int]] = [(-1, -1)] * self.num_stages
        for p, pipeline in enumerate(self.pipelines):
            if [self.stage_part[s] for s in pipeline] != list(range(num_parts)):
                raise ScheduleError(
                    f"pipeline {p} visits parts {[self.stage_part[s] for s in pipeline]}; "
                    f"it must visit parts 0..{num_parts - 1} in order"
                )
            for i, s in enumerate(pipeline):
                if position[s] != (-1, -1):
                    raise ScheduleError(f"stage {s} belongs to two pipelines; give each its own")
                position[s] = (p, i)
        replicas: list[list[int]] = [[] for _ in range(num_parts)]
        for s, part in enumerate(self.stage_part):
            replicas[part].append(s)
        object.__setattr__(self, "_position", tuple(position))
        object.__setattr__(self, "_replicas", tuple(tuple(r) for r in replicas))

    @property
    def num_stages(self) -> int:
        return len(self.stage_rank)

    @property
    def num_parts(self) -> int:
        return max(self.stage_part) + 1 if self.stage_part else 0

    @property
    def num_ranks(self) -> int:
        return max(self.stage_rank) + 1 if self.stage_rank else 0

    @property
    def ranks_per_pipeline(self) -> int:
        """Ranks one pipeline spans (D); a data-parallel grid of P pipelines has P x D ranks."""
        return len({self.stage_rank[s] for s in self.pipelines[0]}) if self.pipelines else 0

    def next_stage(self, stage: int) -> int | None:
        """The stage after ``stage`` in its pipeline, or None for the last."""
        p, i = self._position[stage]
        pipeline = self.pipelines[p]
        return pipeline[i + 1] if i + 1 < len(pipeline) else None

    def prev_stage(self, stage: int) -> int | None:
        """The stage before ``stage`` in its pipeline, or None for the first."""
        p, i = self._position[stage]
        return self.pipelines[p][i - 1] if i > 0 else None

    def neighbours(self) -> tuple[list[int], list[int]]:
        """Per stage, the stage before it and the stage after it in its pipeline (-1: none), as lists for hot loops.

        Example:
            >>> Placement.straight(3).neighbours()
            ([-1, 0, 1], [1, 2, -1])
        """
        stages = range(self.num_stages)
        return (
            [-1 if (p := self.prev_stage(s)) is None else p for s in stages],
            [-1 if (q := self.next_stage(s)) is None else q for s in stages],
        )

    def pipeline_of(self, stage: int) -> int:
        return self._position[stage][0]

    def replicas(self, stage: int) -> tuple[int, ...]:
        """All stages (``stage`` included) that hold the same part."""
        return self._replicas[self.stage_part[stage]]

    def stages_on(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.stage_rank) if r == rank)

    @classmethod
    def straight(cls, num_ranks: int) -> Placement:
        """Stage k (= part k) on rank k."""
        stages = tuple(range(num_ranks))
        return cls(stages, stages, (stages,))

    @classmethod
    def looped(cls, num_ranks: int, num_chunks: int) -> Placement:
        """Interleaved (Megatron-LM): part k on rank k mod D, D x v parts."""
        n = num_ranks * num_chunks
        return cls(tuple(k % num_ranks for k in range(n)), tuple(range(n)), (tuple(range(n)),))

    @classmethod
    def vshape(cls, num_ranks: int) -> Placement:
        """V-shaped (ZB-V, DualPipe-V): parts 0..D-1 down the ranks, D..2D-1 back up."""
        n = 2 * num_ranks
        ranks = tuple(k if k < num_ranks else n - 1 - k for k in range(n))
        return cls(ranks, tuple(range(n)), (tuple(range(n)),))

    @classmethod
    def bidirectional(cls, num_ranks: int) -> Placement:
        """Two pipelines in opposite directions (Chimera, DualPipe).

        Stages 0..D-1 hold parts 0..D-1 on ranks 0..D-1 ("down"); stages D..2D-1
        hold parts 0..D-1 on ranks D-1..0 ("up").
        """
        d = num_ranks
        ranks = tuple(range(d)) + tuple(d - 1 - k for k in range(d))
        parts = tuple(range(d)) * 2
        return cls(ranks, parts, (tuple(range(d)), tuple(range(d, 2 * d))))


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered action lists plus their placement and weight policy.

    Args:
        name: registry name of the generator that made it (or a label).
        placement: stage -> rank and stage -> part, and the pipelines.
        num_microbatches: microbatches in the schedule (all steps, for streams).
        actions: per rank, its ordered compute actions.
        microbatch_pipeline: per microbatch, the pipeline it traverses
            (empty means every microbatch uses pipeline 0).
        policy: the weight policy.
        num_steps: optimizer steps the schedule covers (1 for synchronous ones).
        pairs: the F&B pairs: ``(F, B or I)`` actions of one rank, the second right after the first in its
            list, run as one overlapped action (``pair_positions``; the validator checks that neither half
            needs the other). Without pairs, or wherever a pass ignores them, the two run one after the other.

    Example:
        >>> from pipeweave.schedule import generate
        >>> s = generate("1f1b", num_stages=2, num_microbatches=2)
        >>> [str(a) for a in s.actions[1]]
        ['1F0', '1B0', '1F1', '1B1', '1U0']
    """

    name: str
    placement: Placement
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    microbatch_pipeline: tuple[int, ...] = ()
    policy: WeightPolicy = WeightPolicy.SYNC
    num_steps: int = 1
    pairs: tuple[tuple[Action, Action], ...] = ()

    def __post_init__(self) -> None:
        if self.microbatch_pipeline and len(self.microbatch_pipeline) != self.num_microbatches:
            raise ScheduleError(
                f"microbatch_pipeline has {len(self.microbatch_pipeline)} entries for "
                f"{self.num_microbatches} microbatches; give one pipeline per microbatch"
            )

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    @property
    def num_stages(self) -> int:
        return self.placement.num_stages

    @property
    def num_parts(self) -> int:
        return self.placement.num_parts

    @property
    def num_chunks(self) -> int:
        """Stages per rank per pipeline (v of the survey)."""
        return max(1, self.placement.num_parts // max(1, self.num_ranks))

    @property
    def is_synchronous(self) -> bool:
        return self.policy is WeightPolicy.SYNC

    def pipeline_of_microbatch(self, microbatch: int) -> int:
        return self.microbatch_pipeline[microbatch] if self.microbatch_pipeline else 0

    def route(self, microbatch: int) -> tuple[int, ...]:
        """The stages microbatch ``microbatch`` visits, in forward order."""
        return self.placement.pipelines[self.pipeline_of_microbatch(microbatch)]

    def microbatches_of(self, stage: int) -> list[int]:
        """The microbatches that flow through ``stage``."""
        p = self.placement.pipeline_of(stage)
        return [j for j in range(self.num_microbatches) if self.pipeline_of_microbatch(j) == p]

    def iter_actions(self) -> Iterator[tuple[int, int, Action]]:
        """Yield ``(rank, step, action)`` for every action."""
        for rank, row in enumerate(self.actions):
            for step, action in enumerate(row):
                yield rank, step, action

    def with_actions(self, actions: Sequence[Sequence[Action]]) -> Schedule:
        """A copy with other action lists (for passes and mutation tests); the F&B pairs both of whose
        halves are still there stay pairs."""
        rows = tuple(tuple(row) for row in actions)
        kept = {a for row in rows for a in row} if self.pairs else set()
        return Schedule(
            name=self.name,
            placement=self.placement,
            num_microbatches=self.num_microbatches,
            actions=rows,
            microbatch_pipeline=self.microbatch_pipeline,
            policy=self.policy,
            num_steps=self.num_steps,
            pairs=tuple(p for p in self.pairs if p[0] in kept and p[1] in kept),
        )


def check_positive(name: str, value: int, hint: str = "") -> None:
    """Raise ScheduleError unless ``value`` is an integer >= 1."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        fix = hint or f"give {name} >= 1"
        raise ScheduleError(f"{name}={value!r} is invalid; {fix}")


def append_updates(rows: list[list[Action]], placement: Placement) -> None:
    """Append ``U`` (update 0) of every stage, at the end of its rank's list."""
    for stage, rank in enumerate(placement.stage_rank):
        rows[rank].append(Action(stage, Op.U, 0))


def pair_positions(row: Sequence[Action], pairs: Sequence[tuple[Action, Action]]) -> dict[int, int]:
    """In one rank's list (compute or lowered), the position of each F&B pair's F half -> its B (or I) half's.

    Example:
        >>> row = [Action(0, Op.F, 0), Action(3, Op.F, 2), Action(0, Op.SEND_F, 2), Action(0, Op.B, 0)]
        >>> pair_positions(row, [(Action(3, Op.F, 2), Action(0, Op.B, 0))])
        {1: 3}
    """
    if not pairs:
        return {}
    where = {a: i for i, a in enumerate(row) if a.op is Op.F or a.op.computes_input_grad}
    return {where[f]: where[b] for f, b in pairs if f in where and b in where}
