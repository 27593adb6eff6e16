"""Sizes of a run, counted before it runs: its schedule's parts and actions, bytes between layers and of weights.

``check_sizes(config)`` refuses, before the schedule is generated, a run
whose sizes cannot work, cheapest check first: the batch must make its
microbatches, the model needs a layer per part (D x the chunks per rank,
known without generating the schedule), the schedule's actions must fit in
free memory (``sim.timeline.BYTES_PER_ACTION`` each, an upper estimate of
their count) and so must the rank processes. ``runtime.run.memory``
estimates what the run then needs per rank.

A custom model is measured by running two samples through its layers
(``models.custom.probe``, once per model and seed in a process); the built-in
models' sizes follow from their shapes. The launcher sizes its shared-memory
rings with ``message_rings``; the report sets the measured weight
bytes beside ``part_weight_bytes`` x the simulated copies.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

import torch

from pipeweave import host
from pipeweave.config import TrainConfig
from pipeweave.data import data_source, split_microbatches
from pipeweave.data.corpus import microbatch_lengths
from pipeweave.errors import UserError
from pipeweave.models.build import build_layers
from pipeweave.models.custom import probe
from pipeweave.models.spec import ModelSpec, layer_seed
from pipeweave.runtime.process import under_torchrun
from pipeweave.runtime.stage.tied import tied_groups
from pipeweave.runtime.transport import shm
from pipeweave.runtime.transport.mesh import process_pairs
from pipeweave.runtime.transport.order import message_pairs
from pipeweave.schedule import SCHEDULES, Schedule
from pipeweave.sim.timeline import BYTES_PER_ACTION

PROCESS_BYTES = 32 << 20
"""Memory a spawned rank process takes of its own before any tensor: measured 23-26 MiB private
(``/proc/PID/smaps_rollup``) per rank of a 4-rank mlp run after 30 s, torch's pages shared with the fork server."""
SPAWN_BYTES = 320 << 20
"""Memory spawned ranks take once, whatever their number: the fork server, the resource tracker and the
pages of torch they share (measured: the processes' PSS summed, 423 MB for 4 ranks, less their own)."""
RANK_BYTES_PER_ACTION = 160
"""Memory each rank's copy of the schedule takes per action: measured 120-154 B unpickled (1f1b, zb-h1, pipedream)."""


def check_sizes(config: TrainConfig) -> None:
    """Refuse, in one line and before the schedule is generated, a run whose sizes cannot work.

    Raises:
        UserError: the batch cannot make T x P microbatches, the model has fewer layers than the
            schedule's parts, or the schedule or the rank processes would not fit in free memory.
    """
    t, d = config.schedule.num_microbatches, config.schedule.num_stages
    if t < 1 or d < 1:
        return  # the generator names the value
    check_batch(config, t * config.parallel.data_parallel)
    parts = part_count(config)
    if parts is None:
        return
    check_layers(config, parts)
    free = host.available_memory()
    if free is None:
        return
    actions = action_estimate(config, parts)
    if actions * BYTES_PER_ACTION > free:
        raise UserError(
            f"{_size(config, parts)} make up to ~{actions:.2g} actions, ~{_gib(actions * BYTES_PER_ACTION)} "
            f"to build and simulate ({BYTES_PER_ACTION} B each), more than the {free / 2**30:.1f} GiB "
            f"free here; give fewer stages or microbatches{' or steps' if config.is_stream else ''} "
            f"(at most ~{free // BYTES_PER_ACTION:.2g} actions fit)"
        )
    ranks = d * config.parallel.data_parallel * config.parallel.per_stage_rank
    if not under_torchrun() and SPAWN_BYTES + ranks * PROCESS_BYTES > free:
        raise UserError(
            f"{_size(config, None)} start {ranks} rank processes here, "
            f"~{_gib(SPAWN_BYTES + ranks * PROCESS_BYTES)} at ~{PROCESS_BYTES >> 20} MiB each and "
            f"{SPAWN_BYTES >> 20} MiB once before any tensor, more than the {free / 2**30:.1f} GiB free; "
            f"give fewer stages (at most ~{max(0, free - SPAWN_BYTES) // PROCESS_BYTES} ranks fit)"
        )


def check_batch(config: TrainConfig, microbatches: int) -> None:
    """The batch makes ``microbatches`` microbatches of at least one sample."""
    if config.data.batch_size < microbatches:
        raise UserError(
            f"--batch {config.data.batch_size} cannot make {microbatches} microbatches; "
            "increase --batch or reduce --microbatches"
        )


def check_layers(config: TrainConfig, parts: int) -> None:
    """The model has a layer for each of the schedule's ``parts``."""
    model = config.model
    if model.num_layers < parts:
        raise UserError(
            f"{parts} parts ({config.schedule.name}, D={config.schedule.num_stages}) need at least {parts} layers, the model "
            f"has {model.layers_described}; reduce --stages or "
            + ("give the model more layers" if model.kind == "custom" else "increase --layers")
        )


def part_count(config: TrainConfig) -> int | None:
    """The parts of the run's schedule, D x its chunks per rank, without generating it.

    None where the generator decides: an unknown name, a ``--chunks`` it refuses.

    Example:
        >>> part_count(TrainConfig(schedule="zb-v", num_stages=4)), part_count(TrainConfig(schedule="interleaved-1f1b"))
        (8, 4)
    """
    if config.schedule.written is not None:
        return config.schedule.written.num_parts
    info = SCHEDULES.get(config.schedule.name)
    if info is None or config.schedule.num_stages < 1:
        return None
    if config.schedule.num_chunks is not None and info.chunks is not None and config.schedule.num_chunks != info.chunks:
        return None
    default = inspect.signature(info.generator).parameters.get("num_chunks")
    chunks = config.schedule.num_chunks or info.chunks or (default.default if default is not None else 1)
    return config.schedule.num_stages * chunks if isinstance(chunks, int) and chunks >= 1 else None


def action_estimate(config: TrainConfig, parts: int) -> int:
    """At least the actions of the run's schedule: F, I and W (or B and U) per part and microbatch, a U per part.

    Every replica's (``--data-parallel``); an asynchronous run's streams hold every mini-batch of it.

    Example:
        >>> action_estimate(TrainConfig(schedule="zb-h1", num_stages=4, num_microbatches=8), 4)  # ZB-H1 has 100
        100
    """
    steps = config.training.steps if config.is_stream else 1
    return (3 * config.schedule.num_microbatches + 1) * parts * config.parallel.data_parallel * steps


def _size(config: TrainConfig, parts: int | None) -> str:
    """What makes the run this large, as the user typed it."""
    text = f"--stages {config.schedule.num_stages}"
    if parts is not None:
        text += f" x --microbatches {config.schedule.num_microbatches}"
        if parts != config.schedule.num_stages:
            text += f" x {parts // config.schedule.num_stages} chunks"
        if config.is_stream:
            text += f" x --steps {config.training.steps}"
    if config.parallel.data_parallel != 1:
        text += f" x --data-parallel {config.parallel.data_parallel}"
    return text


def _gib(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30)):
        if n >= size:
            return f"{n / size:.0f} {unit}"
    return f"{n / 2**20:.0f} MiB"


def microbatch_sizes(config: TrainConfig) -> list[int]:
    """Dimension 0 of every microbatch of a step (a stream: of every mini-batch), every replica's."""
    t = config.schedule.num_microbatches * config.parallel.data_parallel  # every replica's microbatches
    sizes = [len(m) for m in split_microbatches(torch.empty(config.data.batch_size, 0), t)]
    return sizes * config.training.steps if config.is_stream else sizes


def step_tokens(config: TrainConfig, num_microbatches: int, step: int) -> int | None:
    """A built-in transformer's tokens in step ``step`` of the training (``num_microbatches``: the schedule's, every
    replica's): batch x ``seq_len``, or, with ``min_seq_len``, each microbatch's samples x its own length;
    None for other models."""
    if not config.model.is_transformer:
        return None
    if config.data.min_seq_len is None:
        return config.data.batch_size * config.model.seq_len
    lengths = microbatch_lengths(
        config.data.data_seed, step, num_microbatches, config.data.min_seq_len, config.model.seq_len
    )
    return sum(n * length for n, length in zip(microbatch_sizes(config), lengths))


def replica_microbatch_sizes(config: TrainConfig, replica: int) -> list[int]:
    """An asynchronous run's microbatch sizes on data-parallel ``replica``: its piece of each microbatch
    (``stream.StreamData``'s ``piece``), every mini-batch's."""
    whole = [
        len(m) for m in split_microbatches(torch.empty(config.data.batch_size, 0), config.schedule.num_microbatches)
    ]
    p = config.parallel.data_parallel
    return [len(split_microbatches(torch.empty(size, 0), p)[replica]) for size in whole] * config.training.steps


def probe_model(spec: ModelSpec, seed: int) -> int:
    """A custom model, checked by running two samples through it: the largest bytes per sample between layers.

    Raises:
        UserError: a layer or the loss that does not fit the ``LayerModel`` contract (``models.custom.probe``).
    """
    return _probe(spec, seed)


@functools.cache
def _probe(spec: ModelSpec, seed: int) -> int:
    inputs, targets = data_source(spec, batch_size=2, seed=seed).batch(0)
    return probe(spec.custom, [layer_seed(spec, k) for k in range(spec.num_layers)], inputs, targets)


def part_weight_bytes(spec: ModelSpec, parts: Sequence[range]) -> list[float]:
    """Bytes of one copy of each part's weights (M_theta), counted from the model's layers."""
    return [
        float(sum(p.numel() * p.element_size() for layer in build_layers(spec, list(part)) for p in layer.parameters()))
        for part in parts
    ]


def largest_message_bytes(config: TrainConfig) -> int:
    """Bytes of the largest point-to-point message a run sends between stages (what a shared-memory ring holds).

    A microbatch's activation or input gradient (float32, (b, h) for the
    mlp, (b, seq, h) for the gpt and the llama -- (b, seq / N, h) with sequence parallelism --
    a custom model's largest as ``probe_model`` finds it). Replicated parts'
    gradients (Chimera, GEMS, DualPipe) are summed by collectives, not sent
    point to point; a stream's tied halves are (``runtime.stage.tied_stream``,
    one per update), streaming through a smaller ring in records.
    """
    model = config.model
    if model.kind == "custom":
        per_sample = probe_model(model, config.data.data_seed)
    else:
        shards = config.parallel.context_parallel * (
            config.parallel.tensor_parallel if config.parallel.sequence_parallel else 1
        )
        per_sample = model.hidden * (model.seq_len // shards if model.is_transformer else 1) * 4
    return max(microbatch_sizes(config)) * per_sample


def message_rings(config: TrainConfig, schedule: Schedule, num_processes: int) -> dict[tuple[int, int], int]:
    """The shared-memory rings of a spawned run, ``(sender process, receiver process) -> bytes``.

    One per ordered pair of processes that exchange messages
    (``transport.order.message_pairs``: neighbouring stages on two ranks,
    and a stream's tied ends; ``transport.mesh.process_pairs``: in each
    tensor-parallel coordinate and each replica around a stream), each
    holding two of the largest messages (``shm.capacity_for``).

    Example:
        >>> from pipeweave.runtime.run.prepare import prepare
        >>> plan = prepare(TrainConfig(schedule="1f1b", num_stages=4, num_microbatches=4, batch_size=16))
        >>> sorted(message_rings(plan.config, plan.schedule, plan.num_processes))
        [(0, 1), (1, 0), (1, 2), (2, 1), (2, 3), (3, 2)]
    """
    n = config.parallel.per_stage_rank  # every (cp, tp) coordinate its own rings
    ties = config.is_stream and bool(tied_groups(config.model))
    pairs = message_pairs(schedule.placement, ties=ties)
    replicas = max(1, num_processes // (n * schedule.num_ranks))
    capacity = shm.capacity_for(largest_message_bytes(config))
    return {
        pair: capacity
        for pair in process_pairs(pairs, stage_ranks=schedule.num_ranks, tensor_parallel=n, replicas=replicas)
    }
