"""The tensor- and data-parallel flags of ``simulate``, ``partition`` and ``search``: parsed, checked, reported.

Bandwidths are in Gb/s (gigabits per second, as network cards are sold; NVLink's
"300 GB/s per direction" is 2400 Gb/s), per GPU and direction; latencies in
microseconds. With a network, the cost model's times are seconds.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from pipeweave.commands.units import check_cost_flags, format_bytes, parse_values
from pipeweave.errors import UserError
from pipeweave.schedule.ir import Schedule
from pipeweave.sim.activations import rank_activations
from pipeweave.sim.communication import Communication, communication
from pipeweave.sim.cost import CostModel
from pipeweave.sim.network import Link, Network
from pipeweave.sim.parallel import ZERO_STAGES, Layout
from pipeweave.sim.shards import RankMemory, rank_memory
from pipeweave.sim.traffic import ModelBytes

GBPS = 1e9 / 8
"""Bytes per second in one Gb/s."""

TP_SPLIT = {"Block": (2, 2, False), "MLPBlock": (1, 1, False), "Head": (0, 1, True)}
"""Per layer type, how pipeweave's tensor-parallel layers split it (Megatron-LM without sequence parallelism):
``(all-reduces in F, all-reduces in I, all-gathers its output in F)``. The gpt's ``Block`` (and the llama's,
of the same class name and the same collectives) all-reduces
behind attention's and the MLP's row-parallel projections, and in front of their column-parallel inputs
backward; the mlp's ``MLPBlock`` (column then row) once each way; the gpt's ``Head`` (column-parallel by
vocabulary) gathers its logits and all-reduces its input gradient. Other layers are not split."""
TP_REPLICATED = ("Embedding",)
"""Layer types every TP rank holds whole (the gpt's token and position embeddings, the llama's token table)."""


def add_layout_arguments(
    parser: argparse.ArgumentParser, *, data_parallel: bool = True, sequence_parallel: bool = False
) -> None:
    """The layout's flags (``data_parallel=False`` where the command declares ``--data-parallel`` itself;
    ``sequence_parallel=True`` where the command models it: ``simulate``, ``search``)."""
    g = parser.add_argument_group(
        "tensor and data parallelism", "N x P copies of each stage; with a network, times are seconds"
    )
    g.add_argument(
        "--tensor-parallel", type=int, default=1, metavar="N", help="N, tensor-parallel ranks per stage (default 1)"
    )
    if sequence_parallel:
        g.add_argument(
            "--sequence-parallel",
            action="store_true",
            help="with --tensor-parallel N > 1, as train's: pipeline messages of 1/N of the sequence, "
            "an all-gather and a reduce-scatter for each TP all-reduce (same time), the "
            "--replicated-activation-bytes split over N too (Korthikanti et al. 2022)",
        )
    if data_parallel:
        g.add_argument(
            "--data-parallel",
            type=int,
            default=1,
            metavar="P",
            help="P, data-parallel replicas of the pipeline (default 1)",
        )
    g.add_argument(
        "--zero",
        type=int,
        default=0,
        metavar="0|1|3",
        help="ZeRO stage: 1 shards optimizer state over P, 3 parameters and gradients too (default 0)",
    )
    g.add_argument(
        "--intra-node-gbps",
        type=float,
        metavar="GBPS",
        help="Gb/s between GPUs of a node, per GPU (e.g. 2400 for NVLink's 300 GB/s)",
    )
    g.add_argument(
        "--inter-node-gbps",
        type=float,
        metavar="GBPS",
        help="Gb/s between nodes, per GPU (e.g. 200 for one InfiniBand HDR card per GPU)",
    )
    g.add_argument("--gpus-per-node", type=int, default=8, metavar="G", help="ranks per node (default 8)")
    g.add_argument(
        "--link-latency-us",
        type=float,
        default=0.0,
        metavar="US",
        help="latency of one message or ring step, microseconds (default 0)",
    )


def add_byte_arguments(parser: argparse.ArgumentParser) -> None:
    """What the layout moves and stores, for commands whose costs are typed in (``simulate``, ``search``)."""
    g = parser.add_argument_group("bytes", "a number, or a comma list with one value per part")
    g.add_argument(
        "--message-bytes",
        default="0",
        metavar="BYTES",
        help="activation of one microbatch (b x s x h x bytes per element): sent between stages, "
        "summed by each TP all-reduce (default 0)",
    )
    g.add_argument(
        "--param-bytes",
        default="0",
        metavar="BYTES",
        help="parameter bytes of one D-th of the model, all TP shards together (default 0)",
    )
    g.add_argument(
        "--tp-collectives",
        default="2",
        metavar="K",
        help="TP all-reduces in the forward of one D-th of the model, as many in its backward "
        "(default 2: one transformer block, Megatron-LM's; with --sequence-parallel each is an "
        "all-gather and a reduce-scatter)",
    )
    g.add_argument(
        "--optimizer-state",
        type=float,
        default=1.0,
        metavar="X",
        help="bytes of gradient and optimizer state per weight byte (SGD 1, Adam 3; default 1)",
    )
    g.add_argument(
        "--activation-bytes",
        default="0",
        metavar="BYTES",
        help="activations one microbatch holds from F to its backward in one D-th of the model, all TP "
        "shards together (a GPT block: s b h (34 + 5 a s / h)); shows them per GPU (default 0)",
    )
    g.add_argument(
        "--replicated-activation-bytes",
        default="0",
        metavar="BYTES",
        help="of --activation-bytes, what every TP rank holds whole without --sequence-parallel "
        "(a GPT block: 10 s b h, its layer norms', dropout masks' and first GEMMs' inputs; default 0)",
    )


def model_bytes(args: argparse.Namespace, num_parts: int) -> ModelBytes:
    """The ``ModelBytes`` of ``add_byte_arguments``' flags, for a schedule of ``num_parts`` parts.

    Raises:
        UserError: a value that is not a size >= 0, or a list whose length is not ``num_parts``.
    """
    check_cost_flags(args, (("--optimizer-state", "number of bytes per weight byte"),))
    values = {
        flag: parse_values(flag, getattr(args, flag[2:].replace("-", "_")), what)
        for flag, what in (
            ("--message-bytes", "number of bytes"),
            ("--param-bytes", "number of bytes"),
            ("--tp-collectives", "count"),
            ("--activation-bytes", "number of bytes"),
            ("--replicated-activation-bytes", "number of bytes"),
        )
    }
    for flag, value in values.items():
        if isinstance(value, list) and len(value) != num_parts:
            raise UserError(
                f"{flag} has {len(value)} values but the schedule has {num_parts} parts; "
                "give one value per part or a single number"
            )
    activation, replicated = values["--activation-bytes"], values["--replicated-activation-bytes"]
    if isinstance(activation, float) and isinstance(replicated, float) and replicated > activation:
        raise UserError(
            f"--replicated-activation-bytes {args.replicated_activation_bytes} is more than "
            f"--activation-bytes {args.activation_bytes}; give at most the activation bytes"
        )
    grads, optimizer = state_split(args.optimizer_state)
    return ModelBytes(
        message=values["--message-bytes"],
        params=values["--param-bytes"],
        tp_collectives=values["--tp-collectives"],
        grads=grads,
        optimizer=optimizer,
        activation=activation,
        replicated_activation=replicated,
    )


def layout_report(
    schedule: Schedule,
    cost: CostModel,
    layout: Layout,
    model: ModelBytes,
    makespan: float,
    *,
    split_compute: bool = True,
) -> tuple[dict[str, Any], list[str]] | None:
    """``(json, lines)`` of the layout's communication and memory per GPU; None for a trivial layout without
    activation bytes (``has_report``)."""
    if not has_report(layout, model):
        return None
    comm = (
        None
        if layout.trivial
        else communication(schedule, cost, layout, model, makespan=makespan, split_compute=split_compute)
    )
    try:
        memory: tuple[RankMemory, ...] | None = rank_memory(schedule, layout, model)
    except NotImplementedError:  # a weight policy whose copies are not modelled
        memory = None
    acts = activation_json(schedule, cost, layout, model)
    return {**layout_json(layout, comm, memory), **acts}, [*layout_lines(layout, comm, memory), *activation_lines(acts)]


def has_report(layout: Layout, model: ModelBytes) -> bool:
    """Whether there is a layout to report: more than one GPU per stage, a network, or activation bytes."""
    value = model.activation
    return not layout.trivial or any(v > 0 for v in ([value] if isinstance(value, (int, float)) else value))


def activation_json(schedule: Schedule, cost: CostModel, layout: Layout, model: ModelBytes) -> dict[str, list[float]]:
    """Per pipeline rank, the peak activation bytes of one GPU (``sim.activations.rank_activations``), and with
    sequence parallelism the same without it, to compare; empty without activation bytes."""
    parts = model.for_parts(num_parts=schedule.num_parts, num_ranks=schedule.placement.ranks_per_pipeline)
    if not any(parts.activation):
        return {}
    out = {"activations_per_rank": list(rank_activations(schedule, cost, layout, model))}
    if layout.sequence_parallel:
        without = rank_activations(schedule, cost, layout, model, sequence_parallel=False)
        out["activations_per_rank_without_sequence_parallel"] = list(without)
    return out


def activation_lines(acts: dict[str, list[float]]) -> list[str]:
    """``activation_json``'s largest rank, in words."""
    if not acts:
        return []
    peak = max(acts["activations_per_rank"])
    without = max(acts.get("activations_per_rank_without_sequence_parallel", [0.0]))
    compared = f"; without sequence parallelism {format_bytes(without, 2)} (x{peak / without:.3f})" if without else ""
    return [f"  activations per GPU (peak, largest rank): {format_bytes(peak, 2)}{compared}"]


def layout_from_args(args: argparse.Namespace, *, num_ranks: int) -> Layout:
    """The ``Layout`` the flags describe for a pipeline of ``num_ranks`` ranks.

    Raises:
        UserError: a value out of range, or one bandwidth missing where the mesh needs it.
    """
    for flag, value in (
        ("--tensor-parallel", args.tensor_parallel),
        ("--data-parallel", args.data_parallel),
        ("--gpus-per-node", args.gpus_per_node),
    ):
        if value < 1:
            raise UserError(f"{flag} {value} is invalid; give an integer >= 1")
    if args.zero not in ZERO_STAGES:
        raise UserError(
            f"--zero {args.zero} is invalid; give 0 (replicated), 1 (optimizer state sharded) "
            "or 3 (parameters, gradients and optimizer state sharded)"
        )
    for flag, value in (("--intra-node-gbps", args.intra_node_gbps), ("--inter-node-gbps", args.inter_node_gbps)):
        if value is not None and not 0 < value < math.inf:
            raise UserError(f"{flag} {value:g} is invalid; give a finite bandwidth > 0 in Gb/s, e.g. 200")
    if not 0 <= args.link_latency_us < math.inf:
        raise UserError(f"--link-latency-us {args.link_latency_us:g} is invalid; give finite microseconds >= 0")
    sequence_parallel = getattr(args, "sequence_parallel", False)
    if sequence_parallel:
        _check_sequence_parallel(args)
    return Layout(
        tp=args.tensor_parallel,
        dp=args.data_parallel,
        zero=args.zero,
        sequence_parallel=sequence_parallel,
        network=_network(args, args.data_parallel * num_ranks * args.tensor_parallel),
    )


def _check_sequence_parallel(args: argparse.Namespace) -> None:
    """What ``pipeweave train`` refuses with ``--sequence-parallel`` (``runtime.run.prepare``), where it applies to
    a simulated model: no tensor parallelism, ZeRO, tied embeddings (the sequence length and the model kind are
    not known here)."""
    if args.tensor_parallel == 1:
        raise UserError(
            "--sequence-parallel shards activations over the tensor-parallel group; give --tensor-parallel N > 1"
        )
    for on, flag in ((args.zero, f"--zero {args.zero}"), (getattr(args, "tied", False), "--tied")):
        if on:
            raise UserError(
                f"--sequence-parallel with {flag} is not supported (pipeweave train refuses it); drop one of them"
            )


def _network(args: argparse.Namespace, world_size: int) -> Network | None:
    intra, inter = args.intra_node_gbps, args.inter_node_gbps
    if intra is None and inter is None:
        return None
    one_node = world_size <= args.gpus_per_node
    if inter is None and not one_node:
        raise UserError(
            f"--inter-node-gbps is missing: the {world_size} ranks span "
            f"{math.ceil(world_size / args.gpus_per_node)} nodes of --gpus-per-node {args.gpus_per_node}; "
            "give the bandwidth between nodes, e.g. --inter-node-gbps 200"
        )
    if intra is None and args.gpus_per_node > 1:
        raise UserError(
            f"--intra-node-gbps is missing with --gpus-per-node {args.gpus_per_node}; give the "
            "bandwidth inside a node, e.g. --intra-node-gbps 2400, or --gpus-per-node 1"
        )
    latency = args.link_latency_us * 1e-6
    intra_link = Link(bandwidth=(intra or inter) * GBPS, latency=latency)
    inter_link = Link(bandwidth=(inter or intra) * GBPS, latency=latency)
    return Network(intra_node=intra_link, inter_node=inter_link, gpus_per_node=args.gpus_per_node)


def layout_json(layout: Layout, comm: Communication | None, memory: tuple[RankMemory, ...] | None) -> dict[str, Any]:
    """The layout, its communication and the memory per rank, as the ``--json`` outputs carry them."""
    net = layout.network
    out: dict[str, Any] = {
        "tensor_parallel": layout.tp,
        "data_parallel": layout.dp,
        "zero": layout.zero,
        "sequence_parallel": layout.sequence_parallel,
        "network": None
        if net is None
        else {
            "intra_node_bytes_per_s": net.intra_node.bandwidth,
            "inter_node_bytes_per_s": net.inter_node.bandwidth,
            "latency_s": net.intra_node.latency,
            "gpus_per_node": net.gpus_per_node,
        },
    }
    if comm is not None:
        out["communication"] = comm.as_dict()
    if memory is not None:
        out["memory_per_rank"] = [m.as_dict() for m in memory]
    return out


def layout_lines(layout: Layout, comm: Communication | None, memory: tuple[RankMemory, ...] | None) -> list[str]:
    """The human-readable report of the layout: TP and DP communication, model-state memory per GPU."""
    unit = _time
    lines = [
        f"layout: TP={layout.tp} x DP={layout.dp}, ZeRO {layout.zero}"
        + (", sequence parallel" if layout.sequence_parallel else "")
        + ("" if layout.network else "; no network given (--intra-node-gbps ...): communication not timed")
    ]
    if comm is not None and layout.network is not None:
        lines.append(
            f"  TP all-reduces per step, busiest rank {unit(max(comm.tp_per_rank, default=0.0))}; "
            f"slowest pipeline message {unit(comm.hop)}"
        )
        lines.append(
            f"  DP gradient reduction per part, max {unit(max(comm.reduction, default=0.0))}; "
            f"sticking out past the backward {unit(comm.exposed)}"
            + (f"; ZeRO all-gather after U, max {unit(max(comm.gather))}" if any(comm.gather) else "")
        )
        if comm.averaging:
            lines.append(
                f"  AvgPipe averaging all-reduce per part, max {unit(max(comm.averaging))}, every --avg-every "
                "rounds, overlapped with the next mini-batch"
            )
    if memory is not None and any(m.total for m in memory):
        worst = max(memory, key=lambda m: m.total)
        lines.append(
            f"  model state per GPU (largest rank): {format_bytes(worst.total, 2)} = parameters "
            f"{format_bytes(worst.params, 2)} + gradients {format_bytes(worst.grads, 2)} + optimizer "
            f"{format_bytes(worst.optimizer, 2)}"
        )
    return lines


def _time(t: float) -> str:
    return f"{t * 1e3:.3f} ms" if t < 1 else f"{t:.3f} s"


def state_split(optimizer_state: float) -> tuple[float, float]:
    """``--optimizer-state X`` (gradient and optimizer bytes per weight byte) as ``(gradient, optimizer)``.

    Example:
        >>> state_split(3.0), state_split(0.5)
        ((1.0, 2.0), (0.5, 0.0))
    """
    grads = min(optimizer_state, 1.0)
    return grads, optimizer_state - grads
