"""What the registry knows of one schedule family: ``ScheduleInfo``, with the kinds of placement and of data
parallelism a schedule may have (``schedule.registry`` holds one per name)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from pipeweave.schedule.ir import Schedule


class PlacementKind(str, enum.Enum):
    """Where a schedule puts its stages (``schedule.ir.Placement``), D ranks."""

    STRAIGHT = "straight"
    """Part k on rank k: one stage per rank, one pipeline (GPipe, 1F1B, ZB-H1/H2, the PipeDream family)."""
    LOOPED = "looped"
    """Part k on rank k mod D, D x v parts (Megatron-LM interleaved, WPipe's two groups)."""
    V_SHAPE = "v-shape"
    """Parts 0..D-1 down the ranks and D..2D-1 back up, 2 parts per rank (ZB-V, DualPipeV)."""
    BIDIRECTIONAL = "bidirectional"
    """Two pipelines in opposite directions, each rank holding two replicas' parts (Chimera, GEMS, DualPipe):
    a part's two replicas are combined inside the pipeline, at 2 M_theta per rank."""
    REPLICATED = "replicated"
    """P straight pipelines over the same D ranks, each a replica of every part (AvgPipe)."""


class DataParallel(str, enum.Enum):
    """How a schedule takes ``--data-parallel P`` (P pipeline replicas)."""

    SYNCHRONOUS = "synchronous"
    """P replicas of the step side by side in one schedule (``schedule.data_parallel``); a part's replicas'
    gradients are summed before its ``U`` (an all-reduce over ``dp``). Every synchronous schedule."""
    ASYNCHRONOUS = "asynchronous"
    """P copies of the stream, one per data-parallel rank; each ``U`` sums its replicas' gradients first
    (PipeDream's hybrid, ``runtime.run.prepare``)."""
    NONE = "none"
    """``--data-parallel`` is refused (the other streams: only PipeDream's policies are run with replicas)."""


@dataclass(frozen=True, kw_only=True)
class ScheduleInfo:
    """What the registry knows of one schedule family.

    Example:
        >>> from pipeweave.schedule.registry import SCHEDULES
        >>> info = SCHEDULES["zb-h1"]
        >>> info.family, info.synchronous, info.chunks
        ('zero bubble ZB-H1', True, 1)
    """

    name: str
    """Registry key, e.g. ``"1f1b"``."""
    generator: Callable[..., Schedule]
    """``generator(num_stages, num_microbatches, **options) -> Schedule``."""
    family: str
    """The paper's name for it, e.g. ``"DAPPLE / PipeDream-Flush"``."""
    synchronous: bool
    """True when every step ends in a flush and equals plain training."""
    bubble: str
    """Closed-form bubble (and the conditions it needs)."""
    activations: str
    """Peak activation memory, in M_a."""
    weights: str
    """Weight memory per rank, in M_theta."""
    placement: PlacementKind
    """Where its stages live; the planner's bounds and chunk counts read it."""
    splits_backward: bool
    """True when some backward is split into I (input gradient) and W (weight gradient) actions."""
    data_parallel: DataParallel
    """How it takes ``--data-parallel``."""
    ties: bool
    """True when it trains tied parameters (a part's weight shared with another, e.g. tied embeddings):
    synchronous schedules sum the copies' gradients before ``U``; of the streams, those whose last stage may
    apply each tied update some updates later (``runtime.stage.tied_stream``)."""
    chunks: int | None = None
    """Fixed chunks per rank (2 for V shapes), or None when ``--chunks`` applies (default 1)."""
    searched: bool = False
    """True when built by ``pipeweave.autoschedule`` for the run's own costs: its generator takes ``time_f``,
    ``time_b``, ``time_w`` and ``activation_limit``, which ``train`` and the planner fill in."""
    defaults: tuple[tuple[str, float], ...] = ()
    """``(option, value)`` pairs: its defaults of run options where they differ from the usual ones, e.g.
    ``(("momentum", 0.9),)`` for SpecTrain and XPipe, which predict the weights along the momentum."""

    @property
    def zero(self) -> bool:
        """True when it takes ``--zero 1/3``: synchronous, one replica of each part per pipeline."""
        return self.synchronous and self.placement is not PlacementKind.BIDIRECTIONAL
