"""ZeRO-3 by FSDP2: a part's parameters sharded over its data-parallel replicas with ``fully_shard``, per layer.

Rajbhandari et al. (ZeRO, SC 2020), stage 3, as PyTorch's FSDP2
(``torch.distributed.fsdp.fully_shard``) implements it and torchtitan
composes it with pipelining: every layer of the part is one FSDP unit on the
``dp`` dimension of the run's ``DeviceMesh``, its parameters ``DTensor``s
sharded on dim 0. FSDP's own hooks all-gather a layer before its forward
(F, a replay, evaluation) and before its backward (B, I), and free it after
each, so a rank holds one layer whole at a time, not its part.

FSDP reduces a unit's gradients from its post-backward hook, at the end of
the autograd backward that computed them. Zero-bubble schedules write the
weight gradients later, at ``W`` (``models.layers``'s deferred closures
accumulate into the unsharded parameters' ``.grad``), so the hooks are told
not to reduce (``set_requires_gradient_sync(False)``: they only reshard),
and the part's reduction is driven by hand once its last ``W`` or ``B`` of
the step has run, as ``torch.distributed.pipelining``'s stage does for its
own zero-bubble schedules (``_PipelineStageBase.perform_reduce_grad``):
each unit's parameter groups' ``post_backward`` reduce-scatters the summed
gradient (``reduce``), and the root's final callback, at ``U``, waits for
it (``finish``). The sum, not FSDP's default mean: each microbatch's loss
is already scaled by its share of the global batch (gloo has no average
either: sums are forced). Every unit reduces even a gradient no microbatch
wrote (zeros), so that the replicas' collectives always match.

The optimizer is the part's own, rebuilt over the sharded parameters: an
elementwise optimizer steps each replica's rows as it would step the whole.
Code that reads parameters outside an action -- a checkpoint, the run's
final parameters, the finiteness check -- opens ``gathered()``: every unit
all-gathered and its whole parameters registered on the layers; what is
written into them there (a checkpoint's values) is taken back into the
shards before they are freed.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pipeweave.runtime.stage.build import Stage
from pipeweave.runtime.stage.tensor_parallel import split_of

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

# torch.distributed.fsdp and torch.distributed.tensor are imported where a part is sharded, not here: they
# cost every rank process about 0.8 s of start-up, and only ``--zero 3`` needs them (a DTensor exists only
# once they are imported, so the checks below import nothing new).


class FullyShardedPart:
    """A stage's part under ``fully_shard``, one FSDP unit per layer; the worker's ``shards`` (``shard_stage``).

    Args:
        stage: the stage under construction (``stage.build``); its layers are sharded in place.
        dp_mesh: the one-dimensional mesh of the part's replicas (the run's ``DeviceMesh["dp"]``).
    """

    def __init__(self, stage: Stage, dp_mesh: Any) -> None:
        from torch.distributed.fsdp import fully_shard

        whole = dict(stage.module.named_parameters())
        self.units: dict[str, FSDPModule] = {}  # by layer index, as ``StageWorker.module`` names them
        for index, layer in stage.module.items():
            unit = fully_shard(layer, mesh=dp_mesh, reshard_after_forward=True)
            unit.set_force_sum_reduction_for_comms(True)  # gloo has no average, nor a pre-multiplied sum
            unit.set_gradient_divide_factor(1.0)  # the sum of the replicas' gradients (module docstring)
            unit.set_requires_gradient_sync(False)  # the hooks only reshard; ``reduce`` reduces
            unit.set_reduce_scatter_unused_params(True)
            self.units[index] = unit
        self.replicas = dp_mesh.size()
        self._depth = 0  # gathered() contexts open
        self.sharded: dict[str, nn.Parameter] = dict(stage.module.named_parameters())
        """Per global name, the sharded parameter (a ``DTensor``): what the optimizer steps."""
        with self._whole():  # FSDP makes the whole parameters at their first all-gather; they keep a split's mark
            for name, p in stage.module.named_parameters():
                _mark(p, whole[name])
        for name, p in self.sharded.items():
            _mark(p, whole[name])
        # The activation meter leaves parameters out by storage address: the part's own storages are freed now
        # (activations may take their addresses), and a gathered layer's are allocated at each all-gather.
        stage.meter.exclude = _Gathered(self.units)  # type: ignore[assignment]

    def reduce(self) -> None:
        """Reduce-scatter the part's gradients, summed over the replicas, into the sharded parameters' ``.grad``
        (after the part's last W or B of the step; a collective of the replicas, each calling it once)."""
        for unit in reversed(self.units.values()):  # the backward's order
            unit.set_requires_gradient_sync(True)
            unit.set_is_last_backward(True)
            for group in _state(unit)._fsdp_param_groups:
                group.post_backward()

    def finish(self) -> None:
        """Wait for ``reduce`` (the part's ``U``) and leave the units ready for the next step's backward."""
        for unit in self.units.values():
            _state(unit)._root_post_backward_final_callback()
            unit.set_requires_gradient_sync(False)
            unit.set_is_last_backward(False)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """The part's parameters whole inside (a collective of the replicas); written ones kept after. Nested
        uses gather once (a checkpoint's save checks the weights' finiteness inside its own)."""
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        with self._whole():
            self._depth = 1
            try:
                yield
            finally:
                self._depth = 0
            with torch.no_grad():
                for index, unit in self.units.items():
                    for name, p in unit.named_parameters():
                        _take_shard(self.sharded[f"{index}.{name}"], p)

    @contextlib.contextmanager
    def _whole(self) -> Iterator[None]:
        for unit in self.units.values():
            unit.unshard()
        try:
            yield
        finally:
            for unit in self.units.values():
                unit.reshard()

    def weight_bytes(self) -> int:
        """Bytes of this replica's shards of the parameters (what it keeps between actions): FSDP pads each
        parameter's rows to a multiple of the replicas, so every replica keeps ``ceil(rows / P)`` of them."""
        return sum(padded_shard_bytes(p.shape, p.element_size(), self.replicas) for p in self.sharded.values())

    def local_gradients(self) -> list[torch.Tensor]:
        """This replica's shards of the reduced gradients (after ``reduce``), the optimizer's to step."""
        return [_local(p.grad) for p in self.sharded.values() if p.grad is not None]

    def owned_gradients(self) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        """Per sharded parameter, this replica's rows of its reduced gradient (distinct across replicas)."""
        for p in self.sharded.values():
            if p.grad is not None:
                yield p, _local(p.grad)

    def whole_state(self, optimizer: Any) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer's state per global parameter name, whole (a collective of the replicas)."""
        return {
            name: {k: v.full_tensor() if _is_dtensor(v) else v for k, v in optimizer.state[p].items()}
            for name, p in self.sharded.items()
            if p in optimizer.state
        }

    def load_whole_state(self, optimizer: Any, states: dict[str, dict[str, torch.Tensor]]) -> None:
        """Take this replica's rows of ``states`` (per global name, whole, as ``whole_state`` gives them)."""
        for name, state in states.items():
            p = self.sharded[name]
            optimizer.state[p] = {k: v.clone() if v.dim() == 0 else _distribute(v, p) for k, v in state.items()}


class _Gathered:
    """The addresses of the units' gathered parameters now (one storage per unit: FSDP's all-gather output)."""

    def __init__(self, units: dict[str, FSDPModule]) -> None:
        self.units = list(units.values())

    def __contains__(self, key: object) -> bool:
        for unit in self.units:
            first = next(unit.parameters(), None)  # type: ignore[attr-defined]
            if first is not None and not _is_dtensor(first) and first.untyped_storage().data_ptr() == key:
                return True
        return False


def padded_shard_bytes(shape: torch.Size, element_bytes: int, replicas: int) -> int:
    """Bytes one replica keeps of a parameter of ``shape`` sharded on dim 0 over ``replicas``, padded as FSDP pads.

    Example:
        >>> padded_shard_bytes(torch.Size([5, 4]), 4, 2)   # 3 of the 5 rows, 4 float32 each
        48
    """
    if not shape:
        return element_bytes
    return math.ceil(shape[0] / replicas) * math.prod(shape[1:]) * element_bytes


def _mark(param: torch.Tensor, original: torch.Tensor) -> None:
    """Carry a tensor-parallel shard's mark (``stage.tensor_parallel.split_of``) over to FSDP's parameter."""
    split = split_of(original)
    if split is not None:
        param.tensor_parallel_split = split  # type: ignore[attr-defined]  # as stage.tensor_parallel marks it


def _state(unit: Any) -> Any:
    """FSDP's state of ``unit`` (its parameter groups: what torch.distributed.pipelining drives too)."""
    from torch.distributed.fsdp import fully_shard

    return fully_shard.state(unit)


def _is_dtensor(t: object) -> bool:
    tensor = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor exists
    return tensor is not None and isinstance(t, tensor.DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t  # type: ignore[attr-defined]


def _distribute(whole: torch.Tensor, like: Any) -> torch.Tensor:
    """This replica's rows of ``whole``, as a ``DTensor`` sharded as ``like`` (no communication)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(whole.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


def _take_shard(sharded: Any, whole: torch.Tensor) -> None:
    """Copy this replica's rows of ``whole`` into the sharded parameter's own storage."""
    _local(sharded).copy_(_local(_distribute(whole.detach(), sharded)))


def shard_stage(stage: Stage, dp_mesh: Any) -> FullyShardedPart:
    """ZeRO-3, a build step of a stage (``runtime.run.workers``): its layers fully sharded over ``dp_mesh``,
    its optimizer rebuilt over the shards."""
    part = FullyShardedPart(stage, dp_mesh)
    stage.shards = part
    stage.optimizer = stage.optimizer_factory(list(part.sharded.values()))
    return part
