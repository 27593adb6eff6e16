"""What a configuration leaves to the run: the schedule file read, the split a partitioner chooses, a searched
schedule's costs, the outputs checked -- resolved once, before anything is spawned.

``resolve(config)`` is the one place where what follows from the model itself
is filled in; ``TrainConfig.__post_init__`` resolves what follows from the
fields alone. Every rank then builds from the same resolved configuration.
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any

import torch

from pipeweave.commands.outputs import output_folder
from pipeweave.commands.partition import memory_profile, partition_context, partition_method
from pipeweave.commands.profiled import profiled_costs
from pipeweave.commands.schedule_file import schedule_from_file
from pipeweave.config import TrainConfig
from pipeweave.config.sections import AUTO
from pipeweave.errors import BYTES_AT_LEAST, UserError, renamed_activation_limit
from pipeweave.models.hf import is_hf
from pipeweave.partition import LayerCosts, Partition, partition
from pipeweave.runtime.profile import profile_model
from pipeweave.runtime.run.prepare import build_schedule, layer_ranges
from pipeweave.schedule import SCHEDULES, Schedule
from pipeweave.sim.recompute import spelled


def resolve(config: TrainConfig) -> TrainConfig:
    """``config`` with its schedule file read and validated, its split and a searched schedule's costs chosen,
    and its outputs checked (one line each before anything is spawned).

    Raises:
        UserError: an unreadable schedule file, a partitioner's error, an output that cannot be written.
    """
    written = schedule_from_file(argparse.Namespace(schedule_file=config.schedule.schedule_path, schedule=None))
    if written is not None:
        config = config.replace(written=written)
    _check_outputs(config)
    return _with_searched_costs(_with_partition(config))


def _check_outputs(config: TrainConfig) -> None:
    """``--log-dir`` a folder this command can write, with the package that writes it; ``--save-pretrained``
    for a Hugging Face model."""
    log_dir = config.logging.log_dir
    if log_dir is not None:
        if importlib.util.find_spec("tensorboard") is None:
            raise UserError(
                f"--log-dir {log_dir} writes TensorBoard event files and needs the tensorboard package; "
                "pip install 'pipeweave[tensorboard]', or drop --log-dir"
            )
        output_folder("--log-dir", log_dir)
    folder = config.checkpoint.save_pretrained
    if folder is not None and not is_hf(config.model.entry):
        raise UserError(
            f"--save-pretrained {folder} applies to hf: models (--model hf:TYPE or hf:PATH); use --save for a checkpoint"
        )


def partition_arguments(config: TrainConfig) -> argparse.Namespace:
    """The partition section as the options the partitioner's helpers read (shared with ``pipeweave partition``)."""
    p, m = config.partition, config.memory
    return argparse.Namespace(
        partition=p.method,
        memory_limit=p.memory_limit,
        optimizer_state=p.optimizer_state,
        bandwidth=p.bandwidth,
        costs=p.costs,
        repeats=p.repeats,
        refresh=p.refresh,
        precision=config.training.precision,
        layers_per_stage=None if p.layers_per_stage is None else ",".join(map(str, p.layers_per_stage)),
        first_stage_layers=p.first_stage_layers,
        last_stage_layers=p.last_stage_layers,
        ends=1 if config.model.is_transformer else 0,
        recompute=m.recompute,
        offload=m.offload,
        balance_activations=m.balance_activations,
        compress_activations=m.compress_activations,
    )


def _microbatch(config: TrainConfig) -> int:
    return max(1, config.data.batch_size // (config.schedule.num_microbatches * config.parallel.data_parallel))


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _with_searched_costs(config: TrainConfig) -> TrainConfig:
    """zb-auto/zb-v-auto: plan with this model's per-part F, I, W times, profiled per layer (cached).

    ``--activation-limit K`` (a generator option of the schedule section) is their
    activation limit, K x the 1F1B peak. The numbers travel in the config, so every
    rank searches the same instance and builds the same schedule.
    """
    info = SCHEDULES.get(config.schedule.name or "")
    if info is None or not info.searched:
        return config
    options = dict(config.schedule.options)
    parts = build_schedule(config.replace(data_parallel=1, expert_parallel=1, zero=0))
    costs = profile_model(config.model, _microbatch(config), device=_device(), precision=config.training.precision)
    ranges = layer_ranges(config, parts)
    for key, per_layer in (("time_f", costs.forward), ("time_b", costs.input_grad), ("time_w", costs.weight_grad)):
        options[key] = tuple(sum(per_layer[i] for i in r) for r in ranges)
    return config.replace(options=tuple(options.items()))


def _with_partition(config: TrainConfig) -> TrainConfig:
    """``config`` with the layer counts of ``--partition`` (profiled on this machine's device, cached)."""
    args = partition_arguments(config)
    info = SCHEDULES.get(config.schedule.name or "")
    searched = info is not None and info.searched
    if args.memory_limit is not None and args.partition != "memory":
        # Otherwise --memory-limit would be ignored: say so instead (K of zb-auto under its former name too).
        if searched and args.memory_limit < BYTES_AT_LEAST:
            raise renamed_activation_limit(args.memory_limit)
        raise UserError(
            f"--memory-limit {args.memory_limit:g} (bytes per rank) applies to --partition memory; add it or drop "
            "--memory-limit" + (" (zb-auto's activation multiple K is --activation-limit K)" if searched else "")
        )
    base = build_schedule(
        config.replace(
            data_parallel=1,
            expert_parallel=1,
            zero=0,
            recompute="none" if args.recompute == AUTO else config.memory.recompute,
        )
    )  # one replica: the parts
    if args.recompute == AUTO and partition_method(args) != "memory":
        raise UserError(
            "--recompute auto is chosen by --partition memory under --memory-limit; add them, or give "
            "the modes (none, selective, full or one per part)"
        )
    plan = layers_per_part(args, config.model, base, _microbatch(config), _device())
    if plan is None:
        return config
    chosen: dict[str, Any] = {"recompute": spelled(plan.recompute)} if args.recompute == AUTO else {}
    if base.name == "pipedream" and partition_method(args) == "pipedream" and max(plan.replicas) > 1:
        given = config.schedule.stage_replicas  # a rerun's (its TOML keeps them): the plan must agree
        if given is not None and tuple(given) != plan.replicas:
            raise UserError(
                f"--partition pipedream replicates parts {','.join(map(str, plan.replicas))}, not --stage-replicas "
                f"{','.join(map(str, given))}; drop --stage-replicas, or give --partition time for their layers"
            )
        chosen["stage_replicas"] = plan.replicas  # PipeDream's plan replicates parts: its 1F1B-RR runs them
    return config.replace(layers_per_part=plan.counts, **chosen)


def layers_per_part(
    args: argparse.Namespace, spec: Any, schedule: Schedule, microbatch_size: int, device: str
) -> Partition | None:
    """For ``train``: the partition ``--partition`` gives for ``schedule`` (None: uniform), with its recomputation
    per part (``--recompute auto``: chosen by ``--partition memory``).

    Costs come from ``--costs`` or the profiler (cached) on ``device``.

    Raises:
        UserError: the method's errors, or a PipeDream plan that replicates parts for a schedule other than
            pipedream (whose 1F1B-RR runs them: ``schedule.round_robin``).
    """
    method = partition_method(args)
    if method == "uniform" and args.first_stage_layers is None and args.last_stage_layers is None:
        return None
    counts = None if args.layers_per_stage is None else tuple(int(c) for c in args.layers_per_stage.split(","))
    if counts is not None and sum(counts) != spec.num_layers:  # the layers named: a gpt has more than --layers
        raise UserError(
            f"--layers-per-stage {args.layers_per_stage} sums to {sum(counts)} layers but the model has "
            f"{spec.layers_described}; make the counts sum to {spec.num_layers}"
        )
    if method in ("explicit", "uniform") or args.costs:
        costs = LayerCosts.load(args.costs) if args.costs else LayerCosts.uniform(spec.num_layers)
    else:
        costs = profiled_costs(args, spec, microbatch_size, device)
    if costs.num_layers != spec.num_layers:
        raise UserError(f"--costs has {costs.num_layers} layers for a model of {spec.num_layers}; profile this model")
    profile = memory_profile(schedule, args)
    # PipeDream's planner places parts on the ranks, replicating some (run by pipedream's 1F1B-RR).
    parts = schedule.num_ranks if method == "pipedream" and schedule.name == "pipedream" else schedule.num_parts
    plan = partition(method, costs, parts, partition_context(args, profile))
    if plan.num_parts != schedule.num_parts and schedule.name != "pipedream":
        raise UserError(
            f"--partition {method} replicates parts {list(plan.replicas)}, which pipedream's 1F1B-RR runs and "
            f"{schedule.name} cannot; give -s pipedream, train one replica per part with --partition time, or "
            "replicate whole pipelines with --data-parallel"
        )
    return plan
