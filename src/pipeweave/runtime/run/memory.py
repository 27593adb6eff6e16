"""What a run needs in memory per rank, estimated before any rank is spawned, and the refusal of a run that would not fit.

``estimate_memory(plan, ring_capacity)`` counts, per rank:

- **activations**: the peak of what the rank's stages hold for their
  backwards, walking its actions in order (``sim.metrics.held_peaks``: the
  simulator's peak activations, with each part's own bytes for M_a and M_W),
  from each part's bytes for one microbatch of the run's largest size as a
  rank's meter counts them (``part_memory``: the part's ``StageWorker`` run on
  a tiny sample, or on the meta device), with the memory levers
  (``levered_activations``: an offloaded part holds a microbatch only while its F
  or backward runs, compressed activations are measured compressed, BPipe's
  balancing scales each rank as the simulator does);
- **weights and optimizer state**: every weight copy the schedule's policy
  holds (``sim.metrics.version_metrics``: stashed versions, double buffers,
  predictions), one gradient per stage, and the optimizer's state per stage
  (SGD with momentum 1x, AdamW 2x the part's weights; 1/P of it under
  ``--zero 1``, with the slices of the parameters and of the reduced gradient
  it steps, 1/P each). ``--zero 2`` keeps the slices alone, no whole
  gradient between actions (``runtime.replicas`` reduce-scatters after each
  B or W), and per rank on top its largest part's whole gradient, which a
  B or W writes before the reduce-scatter takes it, with the slice that
  reduce-scatter returns (1/P). (Left out: the few whole gradients a
  split backward's I writes itself, a block's layer norms', held until the
  W after it.) ``--zero 3`` (FSDP2, ``runtime.fsdp``) keeps per
  stage the shards of the parameters and of the optimizer state, each
  parameter's dim 0 padded to a multiple of P as FSDP pads it
  (``part_memory.sharded_layers``), and the part's gradients, which the
  deferred reduction accumulates whole (padded) through the step; per rank
  on top, the largest layer twice: FSDP gathers one layer at a time (each
  layer is its own root, so no other layer is prefetched: torch 2.13's
  ``_backward_prefetch`` looks only in the unit's own forward order, and
  nothing is set to prefetch in forward), and in a forward it keeps the
  all-gather's flat output beside the layer's parameters until the
  layer's forward ends (``wait_for_unshard``); at the reduction, a layer's
  gradient is copied into the reduce-scatter's input beside the reduced
  shards (one layer plus the gradient shards, counted where larger);
- **message rings**: the shared-memory rings a rank receives on
  (``sizes.message_rings``: one from each process that sends it messages, ``shm.capacity_for`` the largest
  message), where they are used -- each ring counted once, at its receiver;
- **rank process**: a rank's own memory before any tensor and its copy of the
  schedule (``sizes.PROCESS_BYTES``, ``sizes.RANK_BYTES_PER_ACTION``); spawned
  ranks add, once, the fork server they start from (``sizes.SPAWN_BYTES``).

Accuracy: the activation figure equals the ``peak_activation_bytes`` a run
measures, on every rank of the runs checked (mlp and gpt, fp32 and bf16,
recomputation, GPipe, 1F1B, ZB-H1, ZB-V, interleaved 1F1B, hybrid data
parallelism, a PipeDream stream); the test (``tests/runtime/test_memory_estimate.py``)
holds it within 1.1x. It is an upper bound where a backward's transient meets
the rank's peak. Under ``--zero 3`` the activations and weights together
were checked against the shards kept plus the step's tensor peak
(``peak_tensor_bytes``): 1.02x on a gpt at P = 2 (the test) and 1.06-1.10x
at P = D = 2 under zb-h1 with SGD momentum (its shards count; the first
step, the one measured, creates them only at its end), but 0.99x at P =
D = 2 without momentum: the messages a meter of every tensor counts are
left out here. What no meter counts -- messages in flight, the data batch,
the allocator's slack -- is left out, as is a CUDA rank's context.

Under tensor parallelism a rank is N processes, each holding its shards and
its activations (measured as one process of the group holds them: the
layers split, their collectives left out, ``models.tensor_parallel.MEASURING``);
the figures are per process, and every process of a rank needs them.

``check_memory`` refuses a run whose ranks on this host -- every rank when
spawned, a node's local ranks under torchrun -- need more than the host's free
memory, in one line with the estimate. CUDA ranks keep activations and
weights on their GPUs: there only the processes are checked against the
host's memory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeweave import host
from pipeweave.config import TrainConfig
from pipeweave.errors import UserError
from pipeweave.runtime.process import under_torchrun
from pipeweave.runtime.run.part_memory import part_memory, sharded_layers
from pipeweave.runtime.run.prepare import RunPlan, offloaded
from pipeweave.runtime.run.sizes import PROCESS_BYTES, RANK_BYTES_PER_ACTION, SPAWN_BYTES
from pipeweave.runtime.transport.shm import ring_bytes
from pipeweave.schedule.ir import Op
from pipeweave.schedule.levers import StashPlan
from pipeweave.sim.cost import CostModel
from pipeweave.sim.levers import simulate_levers
from pipeweave.sim.metrics import held_peaks, version_metrics
from pipeweave.weights.optimizers import OPTIMIZERS


@dataclass(frozen=True)
class MemoryEstimate:
    """Per rank, the bytes a run needs (``estimate_memory``)."""

    activations: tuple[int, ...]
    weights: tuple[int, ...]
    """Weight copies, gradients and optimizer state."""
    rings: tuple[int, ...]
    processes: tuple[int, ...]
    gradients: tuple[int, ...] = ()
    """Of ``weights``, the gradient bytes a rank keeps from one action to the next (whole under ZeRO 0, whole with
    the reduced slices beside them under ZeRO 1, the slices alone under ZeRO 2, ``runtime.replicas``): what the
    run measures as ``gradient_bytes``."""
    tensor_parallel: int = 1
    """Processes per rank (N; P x N for an asynchronous schedule's replicas around it), each needing the
    rank's figures."""

    @property
    def per_rank(self) -> tuple[int, ...]:
        """Each rank's total."""
        return tuple(sum(v) for v in zip(self.activations, self.weights, self.rings, self.processes))

    def as_dict(self) -> dict[str, Any]:
        """The JSON record's fields: ``memory_estimate_bytes`` per rank, and its parts."""
        return {
            "memory_estimate_bytes": list(self.per_rank),
            "memory_estimate": {
                "activations": list(self.activations),
                "weights_and_optimizer": list(self.weights),
                "gradients": list(self.gradients),
                "message_rings": list(self.rings),
                "rank_process": list(self.processes),
            },
        }


def estimate_memory(plan: RunPlan, rings: Mapping[tuple[int, int], int] | None = None) -> MemoryEstimate:
    """What each rank of ``plan`` needs; ``rings``: its shared-memory rings, ``(sender process, receiver
    process) -> bytes`` (``sizes.message_rings``; None: no rings)."""
    config, schedule = plan.config, plan.schedule
    ops = {a.op for row in schedule.actions for a in row}
    # A full backward without recomputation frees as it goes (0 on top, measured): only the others are run here
    backwards = tuple(op for op, run in (("B", Op.B in ops and config.memory.recomputes), ("I", Op.I in ops)) if run)
    parts = part_memory(config, plan.parts, backwards)
    activations = levered_activations(config, schedule, parts)
    part_weights = [p.weights for p in parts]
    if config.parallel.zero == 3 and config.parallel.data_parallel > 1:
        weights = fully_sharded(
            config,
            schedule,
            part_weights,
            sharded_layers(config, plan.parts, config.parallel.data_parallel),
            activations,
        )
    else:
        costs = CostModel(weight=[float(w) for w in part_weights]).for_parts(
            num_parts=schedule.num_parts, num_ranks=schedule.num_ranks
        )
        weights = _weights(config, schedule, part_weights, version_metrics(schedule, costs)[0])
    ranks = schedule.num_ranks
    copies = config.parallel.per_stage_rank * (
        config.parallel.data_parallel if config.is_stream else 1
    )  # processes per rank
    received = _rings_received(rings or {}, ranks, config.parallel.per_stage_rank)
    actions = sum(len(row) for row in schedule.actions)
    process = PROCESS_BYTES + actions * RANK_BYTES_PER_ACTION
    return MemoryEstimate(
        tuple(int(a) for a in activations),
        tuple(int(w) for w in weights),
        received,
        (process,) * ranks,
        tuple(int(g) for g in held_gradients(config, schedule, part_weights)),
        copies,
    )


def _rings_received(rings: Mapping[tuple[int, int], int], ranks: int, tensor_parallel: int) -> tuple[int, ...]:
    """Per rank, the bytes of the rings its first process receives on (every process of a rank alike).

    Example:
        >>> _rings_received({(0, 1): 1 << 20, (1, 0): 1 << 20, (1, 2): 1 << 20}, 3, 1)[2] == (1 << 20) + 128
        True
    """
    into = [0] * ranks
    for (_, receiver), capacity in rings.items():
        if receiver % tensor_parallel == 0 and receiver // tensor_parallel < ranks:
            into[receiver // tensor_parallel] += ring_bytes({(0, 0): capacity})
    return tuple(into)


def levered_activations(config: TrainConfig, schedule: Any, parts: list[Any]) -> tuple[float, ...]:
    """Per rank, the peak activation bytes (``held_peaks`` over ``part_memory``'s bytes, compressed ones measured
    so) with the memory levers: an offloaded part (``--offload``) holds a microbatch only while its F or its
    backward runs (on top of the rest, as the backward's own use); BPipe (``--balance-activations``) scales each
    rank's peak as the simulator's does (``sim.levers``, each part's bytes for M_a, uniform times)."""
    away = offloaded(config, schedule)
    part_of = schedule.placement.stage_part
    held = [0 if k in away else p.held for k, p in enumerate(parts)]
    during_b = [p.during_b + (p.held if k in away else 0) for k, p in enumerate(parts)]
    during_i = [p.during_i + (p.held if k in away else 0) for k, p in enumerate(parts)]
    peaks = held_peaks(schedule.actions, part_of, held, [p.stash for p in parts], during_b, during_i)
    if not config.memory.balance_activations:
        return peaks
    costs = CostModel(activation=[float(p.held) for p in parts], mem_w=0.0).for_parts(
        num_parts=schedule.num_parts, num_ranks=schedule.num_ranks
    )
    before = simulate_levers(schedule, costs, StashPlan(offload=away))[0].peak_activations
    after = simulate_levers(schedule, costs, StashPlan(offload=away, balance=True))[0].peak_activations
    return tuple(p * a / b if b else p for p, a, b in zip(peaks, after, before))


def _weights(config: TrainConfig, schedule: Any, part_weights: list[int], copies: list[float]) -> list[float]:
    """Per rank: weight copies (``copies``, whole), gradients and optimizer state, by ZeRO stage (module docstring)."""
    zero = config.parallel.zero if config.parallel.data_parallel > 1 else 0  # nothing to shard without replicas
    p = config.parallel.data_parallel if zero else 1
    # Per stage, in part weights: the gradient (ZeRO-2: between actions, none whole), and the optimizer state
    # (ZeRO: the slices of it, of the parameters and of the reduced gradient, the replicas sharing the rest).
    per_stage = (0 if zero == 2 else 1) + (optimizer_copies(config) + (2 if zero else 0)) / p
    weights = [0.0] * len(copies) if zero == 3 else list(copies)  # ZeRO-3: the slices are the parameters
    part_of = schedule.placement.stage_part
    for stage, rank in enumerate(schedule.placement.stage_rank):
        weights[rank] += per_stage * part_weights[part_of[stage]]
    # ZeRO-3, no layer sizes (``fully_sharded``): one part whole at a time, an upper bound. ZeRO-2: a B or W's
    # whole gradient of its part, and the slice its reduce-scatter returns.
    during = {3: 1.0, 2: 1.0 + 1.0 / p}.get(zero, 0.0)
    for rank, row in enumerate(schedule.actions):
        weights[rank] += during * max((part_weights[part_of[a.stage]] for a in row), default=0)
    return weights


def held_gradients(config: TrainConfig, schedule: Any, part_weights: list[int]) -> list[float]:
    """Per rank, the gradient bytes kept from one action to the next (``MemoryEstimate.gradients``): per stage its
    part's whole (ZeRO 0 and 3: FSDP's deferred reduction keeps them whole), whole plus the 1/P slices reduced
    into (ZeRO 1), or the slices alone (ZeRO 2)."""
    zero = config.parallel.zero if config.parallel.data_parallel > 1 else 0
    per_stage = {1: 1.0 + 1.0 / config.parallel.data_parallel, 2: 1.0 / config.parallel.data_parallel}.get(zero, 1.0)
    held = [0.0] * schedule.num_ranks
    for stage, rank in enumerate(schedule.placement.stage_rank):
        held[rank] += per_stage * part_weights[schedule.placement.stage_part[stage]]
    return held


def fully_sharded(
    config: TrainConfig,
    schedule: Any,
    part_weights: list[int],
    layers: list[list[tuple[int, int]]] | None,
    activations: Sequence[float],
) -> list[float]:
    """Per rank under ``--zero 3`` (module docstring): per stage its parameter and optimizer-state shards and its
    whole gradients, and the largest gathered layer twice -- or, at the reduction, where no activation is held,
    one layer beside the gradient shards, where that exceeds the rank's ``activations`` and two layers.
    ``layers``: per part, per layer, ``(shard, whole)`` bytes of whole layers, scaled to the part's own (a
    tensor-parallel process's share); None: the bound of ``_weights``."""
    if layers is None or any(sum(w for _, w in part) == 0 for part in layers):
        return _weights(config, schedule, part_weights, [0.0] * schedule.num_ranks)
    p = config.parallel.data_parallel
    share = [own / sum(w for _, w in part) for own, part in zip(part_weights, layers)]
    shard = [s * sum(x for x, _ in part) for s, part in zip(share, layers)]
    gathered = [s * p * max(x for x, _ in part) for s, part in zip(share, layers)]  # the all-gather's padded output
    part_of = schedule.placement.stage_part
    weights, shards = [0.0] * schedule.num_ranks, [0.0] * schedule.num_ranks
    for stage, rank in enumerate(schedule.placement.stage_rank):
        k = part_of[stage]
        weights[rank] += (1 + optimizer_copies(config)) * shard[k] + p * shard[k]  # shards; whole gradients
        shards[rank] += shard[k]
    for rank, row in enumerate(schedule.actions):
        largest = max((gathered[part_of[a.stage]] for a in row), default=0.0)
        weights[rank] += max(2 * largest, largest + shards[rank] - activations[rank])
    return weights


def optimizer_copies(config: TrainConfig) -> int:
    """Copies of a part's weights its optimizer keeps (``weights.optimizers``: SGD's momentum buffer, Adam's
    two moments, ...)."""
    return OPTIMIZERS[config.training.optimizer].state_copies(config.training.momentum or 0.0)


def ranks_here(num_ranks: int) -> range:
    """The ranks of this run on this host: all when spawned; under torchrun, this node's (ranks are given per node)."""
    if not under_torchrun():
        return range(num_ranks)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", num_ranks))
    first = int(os.environ["RANK"]) - int(os.environ.get("LOCAL_RANK", "0"))
    return range(max(0, first), min(num_ranks, first + local))


def check_memory(estimate: MemoryEstimate, config: TrainConfig, on_cpu: bool = True) -> None:
    """Refuse, in one line with the estimate, a run whose ranks on this host need more than its free memory.

    ``on_cpu``: the ranks' tensors live in the host's memory (CUDA ranks: only their processes do). Spawned
    ranks add the fork server they start from (``sizes.SPAWN_BYTES``).

    Raises:
        UserError: e.g. ``this run needs ~31.2 GiB (activations 28.0, ...) and 22.6 GiB is free; ...``.
    """
    free = host.available_memory()
    n = estimate.tensor_parallel
    here = [p // n for p in ranks_here(len(estimate.per_rank) * n)]  # this host's processes, by their rank
    terms = {
        "activations": estimate.activations,
        "weights and optimizer state": estimate.weights,
        "message rings": estimate.rings,
        "processes": estimate.processes,
    }
    if not on_cpu:
        terms = {"processes": estimate.processes}
    sums = {name: sum(values[r] for r in here) for name, values in terms.items()}
    if not under_torchrun():
        sums["processes"] += SPAWN_BYTES  # the fork server the ranks start from
    need = sum(sums.values())
    if free is None or need <= free:
        return
    unit, size = ("GiB", 2**30) if need >= 2**30 else ("MiB", 2**20)
    parts = ", ".join(f"{name} {value / size:.1f}" for name, value in sums.items() if value)
    noun = "processes" if n > 1 else "ranks"
    where = f"{len(here)} {noun} on this host" if under_torchrun() else f"{len(here)} {noun}"
    raise UserError(
        f"this run needs ~{need / size:.1f} {unit} ({where}: {parts}) and {free / size:.1f} {unit} "
        f"is free; {_hint(max(sums, key=lambda k: sums[k]), config)}"
    )


def _hint(largest: str, config: TrainConfig) -> str:
    """The fix for the largest term."""
    if largest == "activations":
        levers = "" if config.memory.offload else " or --offload (the first parts)"
        return (
            "reduce --batch" + levers
            if config.memory.recompute == "full"
            else f"reduce --batch or add --recompute (selective or full){levers}"
        )
    if largest == "weights and optimizer state":
        return "give a smaller model (--layers, --hidden)" + (
            " or --optimizer sgd" if optimizer_copies(config) > 1 else ""
        )
    if largest == "message rings":
        return "use --transport gloo"
    return "give fewer stages or --data-parallel replicas"
