"""Dynamic loss scaling for ``--precision fp16``: ``torch.amp.GradScaler``'s semantics across a pipeline.

float16 holds numbers up to 65504 and down to about 6e-8: small gradients
underflow to zero. GradScaler multiplies the loss by a scale S before the
backward, so every gradient is S times larger, divides them by S before the
optimizer step, and skips a step whose gradients overflowed (inf or NaN),
lowering S; after ``growth_interval`` steps in a row without an overflow it
raises S again. A pipelined run does the same with one scale for the whole run:

- the backward of each microbatch's loss, on the last stage, starts from S
  instead of 1 (``LossScaling.root``): the same gradients as
  ``GradScaler.scale(loss).backward()``, and every stage's gradients, sent or
  accumulated, carry the factor S;
- at the first ``U`` of a step, each rank checks the gradients it holds (every
  stage on it, before any exchange: a replica's or a tie's sum of finite
  gradients is finite) and one all-reduce (MAX, over every process: pipeline,
  data- and tensor-parallel ranks) tells every rank whether any overflowed;
  every rank then updates S alike (``torch._amp_update_scale_``, GradScaler's
  own kernel), so the scale stays one number everywhere;
- each ``U`` unscales what its optimizer applies (after the replicas' and the
  ties' sums, before the global norm's clipping or post-validation's norm) by
  GradScaler's ``1 / S`` (float64 reciprocal, rounded to float32) and, after an
  overflow, skips its update (``StageWorker.update(skip=True)``: the exchanges
  still take place, parameters and optimizer state stay as they were).

S is a power of two as long as the factors are (the defaults: 2**16, 2, 0.5),
and multiplying by a power of two commutes with the sums of floating-point
numbers (barring underflow), so unscaling each replica's or microbatch's part
after summing equals GradScaler's unscaling of the whole: a run equals one
process training with ``GradScaler`` (``runtime.plain``).

The check waits for every rank's backward of the step (GradScaler's step needs
it; a global clipping norm does too): one all-reduce of one number per step.
Every synchronous schedule does each rank's backwards before its first ``U``
(``check_row`` refuses a row that does not). Asynchronous schedules update per
microbatch: there is no step to skip, and ``--precision fp16`` is refused for
them (``config.train``).

The scale and its growth counter are part of every checkpoint (``state_dict``,
GradScaler's keys), so ``--resume`` goes on with them exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipeweave.errors import UserError
from pipeweave.runtime.clip import applied_gradients
from pipeweave.runtime.fsdp import FullyShardedPart
from pipeweave.runtime.stage.worker import StageWorker
from pipeweave.schedule.ir import Action, Op


class LossScale:
    """GradScaler's scale and growth counter, with its update rule (``torch._amp_update_scale_``).

    Args:
        init_scale, growth_factor, backoff_factor, growth_interval: GradScaler's (``TrainingConfig.loss_scale``...).
        device: where the scale lives (the rank's device).

    Example:
        >>> s = LossScale(8.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)
        >>> for found in (False, False, True, False):
        ...     s.update(found)
        >>> s.value, s.state_dict()["_growth_tracker"]
        (8.0, 1)
    """

    def __init__(
        self,
        init_scale: float = 65536.0,
        *,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        device: torch.device | str = "cpu",
    ) -> None:
        self.device = torch.device(device)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.scale = torch.full((), init_scale, dtype=torch.float32, device=self.device)
        self._growth_tracker = torch.zeros((), dtype=torch.int32, device=self.device)

    @property
    def value(self) -> float:
        """The scale now."""
        return float(self.scale)

    def inverse(self) -> torch.Tensor:
        """``1 / S`` as GradScaler computes it: the float64 reciprocal, rounded to float32."""
        return self.scale.double().reciprocal().float()

    def update(self, found_inf: bool) -> None:
        """After a step: back off on an overflow, else count it and grow after ``growth_interval`` in a row."""
        found = torch.full((), float(found_inf), dtype=torch.float32, device=self.device)
        torch._amp_update_scale_(
            self.scale, self._growth_tracker, found, self.growth_factor, self.backoff_factor, self.growth_interval
        )

    def state_dict(self) -> dict[str, Any]:
        """GradScaler's ``state_dict`` keys: ``GradScaler.load_state_dict`` reads it, and this reads GradScaler's."""
        return {
            "scale": self.value,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": int(self._growth_tracker),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from a checkpoint's scale and growth counter (the factors stay this run's)."""
        self.scale.fill_(float(state["scale"]))
        self._growth_tracker.fill_(int(state["_growth_tracker"]))


def check_row(row: Sequence[Action], rank: int) -> None:
    """Refuse a row with a backward after its first ``U`` (a written schedule's): the overflow check there must
    cover every gradient of the step.

    Raises:
        UserError: one line naming the rank and the two actions.
    """
    updates = [i for i, a in enumerate(row) if a.op is Op.U]
    late = [a for a in row[updates[0] :] if a.op in (Op.B, Op.I, Op.W)] if updates else []
    if late:
        raise UserError(
            f"rank {rank}: --precision fp16 checks every gradient of the step at the rank's first U, "
            f"and {late[0]} comes after it ({row[updates[0]]}); use a schedule whose U follow every backward"
        )


class LossScaling:
    """One rank's side of dynamic loss scaling in a synchronous run (module docstring).

    Args:
        scale: the run's scale (one per process, equal on every process).
        workers: this rank's stage workers.
        group: the processes that agree on an overflow (None: every process of the run).

    Attributes:
        hooks: per stage, what its ``U`` runs to unscale (``Executor`` chains it before the clipping).
        overflowed: per step of this run, whether its gradients overflowed (its update skipped).
        scales: per step of this run, the scale its backward started from.
    """

    def __init__(self, scale: LossScale, workers: Mapping[int, StageWorker], group: Any = None) -> None:
        self.scale, self.workers, self.group = scale, workers, group
        self.hooks: dict[int, Callable[[StageWorker], None]] = {s: self._unscale for s in workers}
        self.overflowed: list[bool] = []
        self.scales: list[float] = []
        self._inverse: torch.Tensor | None = None  # of the step being updated, None before its first U

    def root(self) -> torch.Tensor:
        """What the backward of a microbatch's loss starts from: the scale (GradScaler's ``scale(loss)``)."""
        return self.scale.scale

    def begin_step(self) -> None:
        """A step begins: its first ``U`` agrees on an overflow again; MoE layers' auxiliary losses start their
        backward from the scale too (``models.moe``)."""
        self._inverse = None
        for worker in self.workers.values():
            worker.aux_losses.grad_scale = self.scale.scale

    def skip(self) -> bool:
        """Whether this step's updates are skipped: at the step's first ``U``, the check and the all-reduce,
        then the scale's update; at the others, the answer of the first."""
        if self._inverse is None:
            self._inverse = self.scale.inverse()
            self.scales.append(self.scale.value)
            found = torch.zeros(1, dtype=torch.float32, device=self.scale.device)
            for worker in self.workers.values():
                grads = _held(worker)
                if grads and not bool(torch.stack([g.isfinite().all() for g in grads]).all()):
                    found.fill_(1.0)
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)  # every rank holding gradients
            self.overflowed.append(bool(found))
            self.scale.update(self.overflowed[-1])
        return self.overflowed[-1]

    def _unscale(self, worker: StageWorker) -> None:
        assert self._inverse is not None, "unscaling before the step's overflow check"
        grads = applied_gradients(worker)
        if grads:
            torch._foreach_mul_(grads, self._inverse.to(grads[0].device))


def _held(worker: StageWorker) -> list[torch.Tensor]:
    """The gradients a worker holds before its ``U``'s exchanges (ZeRO-3: its own rows)."""
    if isinstance(worker.shards, FullyShardedPart):
        return worker.shards.local_gradients()
    return [p.grad for p in worker.module.parameters() if p.grad is not None]
