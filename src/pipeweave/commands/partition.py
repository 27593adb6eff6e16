"""``pipeweave partition``: cut a model into parts, and predict each part's time and memory and the schedule's bubble.

Costs come from the profiler (measured once on this machine, then cached) or
from ``--costs FILE``. Per part it prints the layers, the F + I + W time of one
microbatch, the memory its rank holds at peak under the schedule, and then
the bubble and step time the simulator predicts with those per-part costs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any

import numpy as np

from pipeweave.commands.layout_options import (
    TP_REPLICATED,
    TP_SPLIT,
    add_layout_arguments,
    layout_from_args,
    layout_report,
    state_split,
)
from pipeweave.commands.lever_options import add_stash_arguments, stash_plan
from pipeweave.commands.model_options import add_model_arguments, model_spec
from pipeweave.commands.recompute_options import add_recompute_argument
from pipeweave.commands.simulate import MAX_ACTIONS, check_simulation_size
from pipeweave.commands.units import check_cost_flags, format_bytes
from pipeweave.config.model import TRANSFORMERS
from pipeweave.config.sections import parse_bytes
from pipeweave.config.sections import parse_counts as counts_of
from pipeweave.errors import UserError
from pipeweave.partition import LayerCosts, MemoryProfile, Partition, PartitionContext, partition
from pipeweave.partition.recompute import kept_bytes, replay_time
from pipeweave.schedule import generate
from pipeweave.schedule.ir import Schedule
from pipeweave.schedule.pipedream import noam
from pipeweave.schedule.registry import SCHEDULES
from pipeweave.sim import CostModel, compute_metrics
from pipeweave.sim.levers import levered_activations
from pipeweave.sim.parallel import Layout, simulate_layout, tp_backward_time, tp_forward_time
from pipeweave.sim.recompute import RECOMPUTE, spelled
from pipeweave.sim.shards import Shares
from pipeweave.sim.traffic import ModelBytes


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "partition",
        help="balance a model's layers over the stages",
        description="Cut a model into parts; predict per-part time and memory and the schedule's bubble.",
    )
    add_model_arguments(p)
    p.add_argument("--save-costs", metavar="FILE", help="write the per-layer costs used (JSON)")
    p.add_argument("--stages", type=int, required=True, help="D, pipeline ranks")
    p.add_argument("-s", "--schedule", default="1f1b", help="schedule name (default 1f1b)")
    p.add_argument(
        "--microbatches",
        type=int,
        default=8,
        help=f"T, microbatches per step (default 8); D x T x chunks at most {MAX_ACTIONS // 3}, as simulate",
    )
    p.add_argument("--chunks", type=int, help="v, chunks per rank, for interleaved schedules")
    p.add_argument(
        "--batch-size", type=int, default=32, help="samples per step, split into T microbatches (default 32)"
    )
    add_partition_arguments(p)
    add_stash_arguments(p, bandwidth=False)
    p.add_argument("--device", default="cpu", help="where to profile: the device the run uses (default cpu)")
    p.add_argument(
        "--precision",
        default="fp32",
        metavar="fp32|bf16|fp16",
        help="profile as the run computes: bf16 or fp16, under bfloat16 or float16 autocast (default fp32)",
    )
    p.add_argument("--threads", type=int, default=1, help="intra-op threads while profiling, as per rank (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_recompute_argument(p, auto=True)
    add_layout_arguments(p)
    return p


def add_partition_arguments(parser: argparse.ArgumentParser) -> None:
    """``--partition METHOD`` and what the methods need (shared by ``partition`` and ``train``)."""
    group = parser.add_argument_group("partition")
    group.add_argument(
        "--partition",
        default="uniform",
        metavar="METHOD",
        help="uniform, parameters, type:REGEX, time, pipedream, memory or explicit (default uniform)",
    )
    group.add_argument("--memory-limit", metavar="BYTES", help="memory: bytes one rank may hold, e.g. 8GiB or 2e9")
    group.add_argument(
        "--layers-per-stage",
        metavar="N,N,...",
        help="explicit: layer count of each part, e.g. 3,2,2,1 (the gpt's layers are its embedding, "
        "its --layers blocks and its head)",
    )
    for end, part in (("first", "embedding"), ("last", "head")):
        group.add_argument(
            f"--{end}-stage-layers",
            type=int,
            metavar="N",
            help=f"uniform: blocks of the {end} part, the {part} besides (Megatron-LM's {end} pipeline stage); "
            "the parts between share the rest evenly",
        )
    group.add_argument(
        "--optimizer-state",
        type=float,
        default=1.0,
        metavar="X",
        help="bytes of gradient and optimizer state per weight byte (SGD 1, Adam 3; default 1)",
    )
    group.add_argument("--bandwidth", type=float, default=1e10, help="pipedream: bytes/s between ranks (default 1e10)")
    group.add_argument("--costs", metavar="FILE", help="per-layer costs (JSON) instead of profiling the model")
    group.add_argument("--repeats", type=int, default=5, help="timed runs per layer when profiling (default 5)")
    group.add_argument("--refresh", action="store_true", help="profile again even if a cached profile exists")


def partition_method(args: argparse.Namespace) -> str:
    """``--partition``, or ``explicit`` when ``--layers-per-stage`` is given with the default method.

    Raises:
        UserError: ``--layers-per-stage`` beside another method, which would ignore it.
    """
    ends = [f for f in ("first_stage_layers", "last_stage_layers") if getattr(args, f, None) is not None]
    if ends and (args.partition != "uniform" or args.layers_per_stage is not None):
        given = "--layers-per-stage" if args.layers_per_stage is not None else f"--partition {args.partition}"
        raise UserError(
            f"--{ends[0].replace('_', '-')} applies to --partition uniform, not {given}; drop one of them "
            "(--layers-per-stage gives every part's count)"
        )
    if args.layers_per_stage is None:
        return str(args.partition)
    if args.partition not in ("uniform", "explicit"):
        raise UserError(f"--layers-per-stage applies to --partition explicit, not {args.partition}; drop one of them")
    return "explicit"


def check_partition_arguments(args: argparse.Namespace) -> None:
    """The values of ``add_partition_arguments``' flags, one line each (shared by ``partition`` and ``train``).

    Raises:
        UserError: a count list with a negative count, a nan or infinite number, or too few repeats.
    """
    parse_counts(args.layers_per_stage)
    if isinstance(args.memory_limit, str):  # train's is parsed already (``config.sections.parse_bytes``)
        args.memory_limit = parse_bytes(args.memory_limit)
    check_cost_flags(args, (("--optimizer-state", "number of bytes per weight byte"),))
    if not 0 < args.bandwidth < math.inf:
        raise UserError(f"--bandwidth {args.bandwidth} is invalid; give finite bytes per second > 0, e.g. 1e10")
    if args.repeats < 1:
        raise UserError(f"--repeats {args.repeats} is invalid; give an integer >= 1")


def partition_context(args: argparse.Namespace, profile: MemoryProfile | None) -> PartitionContext:
    return PartitionContext(
        counts=parse_counts(args.layers_per_stage),
        memory_limit=args.memory_limit,
        profile=profile,
        bandwidth=args.bandwidth,
        first=getattr(args, "first_stage_layers", None),
        last=getattr(args, "last_stage_layers", None),
        ends=getattr(args, "ends", 0),
        recompute=getattr(args, "recompute", "none"),
    )


def parse_counts(text: str | None) -> tuple[int, ...] | None:
    """``"3,2,2,1"`` -> ``(3, 2, 2, 1)``; None stays None (``config.sections.parse_counts``'s words)."""
    return None if text is None else counts_of(text)


def layer_costs(args: argparse.Namespace) -> LayerCosts:
    """The costs from ``--costs``, or measured by the profiler (cached)."""
    if args.costs:
        return LayerCosts.load(args.costs)
    if args.batch_size % args.microbatches:
        raise UserError(
            f"--batch-size {args.batch_size} is not divisible by --microbatches {args.microbatches}; "
            "give a multiple of the microbatch count"
        )
    # Imported here, when profiling: ``pipeweave partition --costs FILE`` and the other commands need no torch.
    from pipeweave.commands.profiled import profiled_costs

    check_device(args.device)
    return profiled_costs(
        args, model_spec(args), args.batch_size // args.microbatches, args.device, threads=args.threads
    )


def check_device(device: str) -> None:
    """Refuse, in one line, a ``--device`` torch does not know or this machine does not have.

    Raises:
        UserError: e.g. ``--device banana is not a device; give cpu, or cuda / cuda:N on a machine with a GPU``.
    """
    import torch

    fix = "give cpu, or cuda / cuda:N on a machine with a GPU"
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise UserError(f"--device {device} is not a device; {fix}") from None
    if parsed.type == "cpu":
        return
    if parsed.type != "cuda":
        raise UserError(f"--device {device}: pipeweave profiles on cpu or cuda, not {parsed.type}; {fix}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise UserError(f"--device {device}: this machine has no CUDA GPU torch can use; give --device cpu")
    if parsed.index is not None and parsed.index >= count:
        raise UserError(
            f"--device {device}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}; give one of them"
        )


def part_costs(costs: LayerCosts, plan: Partition) -> dict[str, list[float]]:
    """Per part: F, I and W time (over replicas: PipeDream's round robin), activation and weight bytes, and
    what recomputation replays (``replay_selective``) and keeps (``kept_selective``, ``kept_full``: fractions
    of the activation bytes; ``partition.recompute``)."""
    names = ("f", "b", "w", "activation", "weight", "replay_selective", "kept_selective", "kept_full")
    out: dict[str, list[float]] = {name: [] for name in names}
    for (start, stop), replicas in zip(plan.bounds, plan.replicas):
        out["f"].append(costs.total("forward", start, stop) / replicas)
        out["b"].append(costs.total("input_grad", start, stop) / replicas)
        out["w"].append(costs.total("weight_grad", start, stop) / replicas)
        kept = {m: float(kept_bytes(costs, np.array([start]), stop, m)[0]) for m in RECOMPUTE}
        out["activation"].append(kept["none"])
        out["weight"].append(costs.total("params", start, stop))
        out["replay_selective"].append(float(replay_time(costs, np.array([start]), stop, "selective")[0]) / replicas)
        for m in ("selective", "full"):
            out[f"kept_{m}"].append(min(1.0, kept[m] / kept["none"]) if kept["none"] > 0 else 1.0)
    return out


def plan_and_predict(args: argparse.Namespace, costs: LayerCosts) -> dict[str, Any]:
    """Partition ``costs`` for the schedule of ``args``; simulate the schedule with the parts' costs."""
    schedule = generate(
        args.schedule, num_stages=args.stages, num_microbatches=args.microbatches, num_chunks=args.chunks
    )
    layout = layout_from_args(args, num_ranks=args.stages)
    profile = memory_profile(schedule, args, layout)
    balanced = layout_layer_costs(costs, layout, num_ranks=args.stages)
    plan = partition(partition_method(args), balanced, schedule.num_parts, partition_context(args, profile))
    if plan.num_parts != schedule.num_parts:  # PipeDream chose fewer, replicated stages
        schedule = generate(args.schedule, num_stages=plan.num_parts, num_microbatches=args.microbatches)
        layout = layout_from_args(args, num_ranks=plan.num_parts)
        profile = memory_profile(schedule, args, layout)
    cost = CostModel(recompute=plan.recompute, **part_costs(costs, plan))
    model = layer_bytes(costs, plan, args.optimizer_state)
    timeline = simulate_layout(schedule, cost, layout, model)
    metrics = compute_metrics(timeline)
    report = layout_report(schedule, cost, layout, model, metrics.makespan)
    on = timeline.costs  # per part on one GPU of the layout: compute / N plus TP all-reduces
    assert on is not None
    parts: list[dict[str, Any]] = []
    for k, (start, stop) in enumerate(plan.bounds):
        memory = profile.memory_of(costs, k, start, stop, plan.recompute[k]) if profile else None
        parts.append(
            {
                "layers": list(range(start, stop)),
                "names": list(costs.names[start:stop]),
                "replicas": plan.replicas[k],
                "time": on.f[k] + on.b[k] + on.w[k],
                "f": on.f[k],
                "b": on.b[k],
                "w": on.w[k],
                "memory": memory,
                "recompute": plan.recompute[k],
            }
        )
    return {
        "schedule": schedule.name,
        "stages": args.stages,
        "microbatches": args.microbatches,
        "partition": partition_method(args),
        "recompute": spelled(plan.recompute),
        "recompute_chosen": args.recompute == "auto",
        "parts": parts,
        "noam": noam(args.stages, plan.replicas[0]),  # PipeDream's microbatches in flight: ranks / input replicas
        "max_stage_time": max(float(p["time"]) for p in parts),
        "max_memory": max((float(p["memory"]) for p in parts if p["memory"] is not None), default=None),
        "memory_limit": args.memory_limit,
        "bubble_ratio": metrics.bubble_ratio,
        "bubble_ratio_flush": metrics.bubble_ratio_flush,
        "makespan": metrics.makespan,
        **({"layout": report[0], "layout_lines": report[1]} if report is not None else {}),
    }


def layout_layer_costs(costs: LayerCosts, layout: Layout, *, num_ranks: int) -> LayerCosts:
    """The layers' times on one GPU of the layout, which the partitioners balance: compute / N plus each
    layer's TP collectives (``TP_SPLIT``) in its forward and its input gradient."""
    if layout.trivial:
        return costs
    n, layers = layout.tp, range(costs.num_layers)
    traffic = layer_traffic(costs).for_parts(num_parts=costs.num_layers, num_ranks=costs.num_layers)
    forward = [tp_forward_time(layout, traffic, i, num_ranks=num_ranks) for i in layers]
    backward = [tp_backward_time(layout, traffic, i, num_ranks=num_ranks) for i in layers]
    return dataclasses.replace(
        costs,
        forward=tuple(f / n + c for f, c in zip(costs.forward, forward)),
        input_grad=tuple(b / n + c for b, c in zip(costs.input_grad, backward)),
        weight_grad=tuple(w / n for w in costs.weight_grad),
    )


def layer_traffic(costs: LayerCosts, optimizer_state: float = 1.0) -> ModelBytes:
    """Per layer, what it moves and stores under TP and DP: its output as its message, its TP collectives by
    type (``TP_SPLIT``) on the model's hidden activation (the output of its split layers), its parameters
    (whole on every TP rank for ``TP_REPLICATED`` types)."""
    split = [TP_SPLIT.get(kind, (0, 0, False)) for kind in costs.types]
    hidden = max((out for (forward, _, _), out in zip(split, costs.output) if forward), default=0.0)
    grads, optimizer = state_split(optimizer_state)
    return ModelBytes(
        message=costs.output,
        tp_message=hidden,
        tp_collectives=[float(s[0]) for s in split],
        tp_backward=[float(s[1]) for s in split],
        tp_gather=[out if s[2] else 0.0 for s, out in zip(split, costs.output)],
        params=costs.params,
        replicated=[p if kind in TP_REPLICATED else 0.0 for kind, p in zip(costs.types, costs.params)],
        grads=grads,
        optimizer=optimizer,
    )


def layer_bytes(costs: LayerCosts, plan: Partition, optimizer_state: float) -> ModelBytes:
    """Per part, ``layer_traffic`` summed over its layers; its message is its last layer's output."""
    layers = layer_traffic(costs, optimizer_state)

    def total(name: str) -> list[float]:
        values = getattr(layers, name)
        return [float(sum(values[start:stop])) for start, stop in plan.bounds]

    return ModelBytes(
        message=[costs.output[stop - 1] for _, stop in plan.bounds],
        tp_message=layers.tp_message,
        tp_collectives=total("tp_collectives"),
        tp_backward=total("tp_backward"),
        tp_gather=total("tp_gather"),
        params=total("params"),
        replicated=total("replicated"),
        grads=layers.grads,
        optimizer=layers.optimizer,
    )


def memory_profile(schedule: Schedule, args: argparse.Namespace, layout: Layout | None = None) -> MemoryProfile | None:
    """The schedule's memory profile, or None where its weight policy has no model (memory is then not predicted).

    Under a ``layout`` one GPU holds its TP (and ZeRO) share of the weights, gradients and optimizer state.
    """
    state, weight_share = args.optimizer_state, 1.0
    if layout is not None and not layout.trivial:  # every weight taken as TP-split: embeddings are not, a few %
        share = Shares.of(layout)
        grads, optimizer = state_split(args.optimizer_state)
        state = (grads * share.grads + optimizer * share.optimizer) / layout.tp
        weight_share = share.params / layout.tp
    levers = stash_plan(args, schedule.num_parts)  # --offload, BPipe, compression: what the ranks then hold
    try:
        profile = MemoryProfile.of_schedule(schedule, state=state, weight_share=weight_share)
    except UserError:
        if args.partition == "memory":
            raise
        return None
    return dataclasses.replace(profile, activations=levered_activations(schedule, profile.activations, levers))


def render(result: dict[str, Any]) -> str:
    """The human-readable table of ``run``."""
    lines = [
        f"{result['schedule']}, {result['stages']} stages, {result['microbatches']} microbatches, "
        f"partition {result['partition']}",
        f"{'part':>4}  {'layers':<14} {'replicas':>8}  {'time/mb':>10}  {'memory':>12}  recompute",
    ]
    for k, part in enumerate(result["parts"]):
        layers = part["layers"]
        span = f"{layers[0]}-{layers[-1]} ({len(layers)})" if len(layers) > 1 else f"{layers[0]} (1)"
        memory = "-" if part["memory"] is None else _bytes(part["memory"])
        lines.append(
            f"{k:>4}  {span:<14} {part['replicas']:>8}  {_seconds(part['time']):>10}  {memory:>12}  {part['recompute']}"
        )
    lines.append(
        f"slowest part {_seconds(result['max_stage_time'])}/microbatch; predicted step {_seconds(result['makespan'])}, "
        f"bubble {result['bubble_ratio']:.1%}"
    )
    if result["recompute_chosen"]:
        lines.append(f"recompute chosen per part with the split: {result['recompute']}")
    if result["partition"] == "pipedream":
        replicas = result["parts"][0]["replicas"]
        lines.append(f"NOAM {result['noam']}: ceil({result['stages']} ranks / {replicas} input replicas) in flight")
        counts = [part["replicas"] for part in result["parts"]]
        if max(counts) > 1:  # what trains it: pipedream's 1F1B-RR, a process per replica
            lines.append(
                f"train runs it: -s pipedream --stages {sum(counts)} --partition pipedream "
                f"(--stage-replicas {','.join(map(str, counts))}: a process per replica, 1F1B-RR)"
            )
    return "\n".join(lines + result.get("layout_lines", []))


def _seconds(t: float) -> str:
    return f"{t * 1e3:.3f} ms"


def _bytes(n: float) -> str:
    return format_bytes(n, 2)


def run(args: argparse.Namespace) -> int:
    for name in ("stages", "microbatches", "batch_size", "threads", "repeats"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} {getattr(args, name)} is invalid; give an integer >= 1")
    check_partition_arguments(args)
    check_simulation_size(  # before the profiling: the partitioned schedule is simulated
        args.stages, args.microbatches, chunks=args.chunks or getattr(SCHEDULES.get(args.schedule), "chunks", 1) or 1
    )
    layout_from_args(args, num_ranks=args.stages)  # its flags refused before the profiling
    if args.save_costs:
        from pipeweave.commands.outputs import output_file

        output_file("--save-costs", args.save_costs)  # before the profiling, which takes a while
    args.ends = 1 if args.model in TRANSFORMERS else 0  # --first/last-stage-layers count a transformer's blocks
    costs = layer_costs(args)
    if args.save_costs:
        costs.save(args.save_costs)
    result = plan_and_predict(args, costs)
    split = None
    if not args.costs:  # the model profiled: where a model cut at module names is split (commands.split_names)
        from pipeweave.commands.split_names import split_fields, split_line

        spec, parts = model_spec(args), [range(p["layers"][0], p["layers"][-1] + 1) for p in result["parts"]]
        result.update(split_fields(spec, parts))
        split = split_line(spec, parts)
    if args.json:
        result.pop("layout_lines", None)
    print(json.dumps(result) if args.json else render(result) + (f"\n{split}" if split else ""))
    return 0
