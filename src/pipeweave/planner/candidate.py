"""One point of the planner's space: how N GPUs are split and what each pipeline runs."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pipeweave.planner.split import split_label
from pipeweave.schedule.registry import SCHEDULES


@dataclass(frozen=True, kw_only=True, order=True)
class Config:
    """A parallel configuration: N = tp x cp x pp x dp GPUs, T = B / (dp x microbatch_size) microbatches.

    Example:
        >>> c = Config(tp=8, pp=64, dp=6, chunks=1, microbatch_size=1, microbatches=512, schedule="1f1b",
        ...            recompute="full", zero=0)
        >>> c.gpus, c.label
        (3072, 'TP8 PP64 DP6 1f1b b=1 T=512 rc=full Z0')
    """

    tp: int
    """N, tensor-parallel ranks per stage."""
    pp: int
    """D, pipeline ranks."""
    dp: int
    """P, data-parallel replicas."""
    chunks: int
    """v, chunks (parts) per pipeline rank: 1, or 2 for V shapes, or the interleaved schedule's."""
    microbatch_size: int
    """b, samples per microbatch."""
    microbatches: int
    """T, microbatches per step and pipeline."""
    schedule: str
    """A registry name."""
    recompute: str
    """"none", "selective" (attention) or "full"."""
    zero: int
    """ZeRO stage: 0, 1 or 3."""
    blocks: tuple[int, ...] = ()
    """Blocks of each part, part 0 first (``planner.split``); empty: the layers split evenly."""
    ep: int = 1
    """Expert-parallel ranks (``train --expert-parallel``): of the dp replicas, each group of ep splits the
    experts (``planner.moe``); 1: every rank holds them all."""
    cp: int = 1
    """C, context-parallel ranks (``train --context-parallel``), each the s / C tokens of a sequence."""

    @property
    def searched(self) -> bool:
        """Its schedule is searched for the configuration's own times (``ScheduleInfo.searched``: zb-auto)."""
        return SCHEDULES[self.schedule].searched

    @property
    def takes_chunks(self) -> bool:
        """Its schedule takes ``--chunks v`` (``ScheduleInfo.chunks`` None: interleaved 1F1B)."""
        return SCHEDULES[self.schedule].chunks is None

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def shape(self) -> tuple[str, int, int, int]:
        """What the schedule's actions depend on: (schedule, D, T, v)."""
        return (self.schedule, self.pp, self.microbatches, self.chunks)

    @property
    def label(self) -> str:
        v = f" v={self.chunks}" if self.takes_chunks else ""
        split = f" split={split_label(self.blocks)}" if self.blocks else ""
        extra = (f" CP{self.cp}" if self.cp > 1 else "") + (f" EP{self.ep}" if self.ep > 1 else "")
        return (
            f"TP{self.tp} PP{self.pp} DP{self.dp}{extra} {self.schedule}{v} b={self.microbatch_size} "
            f"T={self.microbatches} rc={self.recompute} Z{self.zero}{split}"
        )

    def as_dict(self) -> dict[str, object]:
        return asdict(self)
