"""``pipeweave plan``: the data/tensor/pipeline split, schedule, microbatch size, recomputation and ZeRO stage
for a GPT on a cluster, predicted by the simulator (``pipeweave.planner``).

    pipeweave plan --model gpt-1t --gpus 3072 --gpu a100-80gb --global-batch 3072

prints the best configurations as a table; ``--json`` prints them as one JSON
object, ``--plot FILE`` draws step time against memory, ``--explain`` says why
the winner wins. Any dimension can be fixed (``--tensor-parallel``,
``--stages``, ``--data-parallel``, ``--chunks``, ``--microbatch-size``, ``-s``,
``--recompute``, ``--zero``) to evaluate a given configuration.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

from pipeweave.commands.model_options import add_moe_arguments, moe_fields
from pipeweave.errors import UserError
from pipeweave.planner.space import MAX_CELLS, MAX_CONFIGURATIONS
from pipeweave.planner.transformer import ATTENTIONS

MODEL_FLAGS = (
    ("--layers", "l, transformer blocks"),
    ("--hidden", "h, hidden size"),
    ("--heads", "a, attention (query) heads"),
    ("--kv-heads", "key/value heads, dividing --heads (grouped-query attention; default --heads)"),
    ("--ffn-hidden", "f, the MLP's size (default 4h for gpt's GeLU; llama's SwiGLU: 8h/3 rounded up to 256)"),
    ("--seq-len", "s, tokens per sample (default 2048)"),
    ("--vocab", "V, vocabulary (default 51200)"),
)
"""The shape of ``--model gpt`` or ``--model llama``, named as ``train`` names them."""
SHAPE = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "seq_len", "vocab")

CUSTOM_FLAGS = (
    ("--peak-tflops", "peak dense BF16 TFLOP/s (with --costs, none: the profiling machine)"),
    ("--memory-gib", "memory per GPU, GiB"),
    ("--memory-tbps", "HBM TB/s (default 2.039, an A100's)"),
    ("--intra-node-gbps", "NVLink Gb/s per GPU and direction"),
    ("--inter-node-gbps", "InfiniBand Gb/s per GPU and direction"),
)
"""The figures of ``--gpu custom``."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:  # argparse declaration: one list of options
    p: argparse.ArgumentParser = subparsers.add_parser(
        "plan",
        help="choose TP x PP x DP (and CP, EP), schedule, microbatch, recomputation and ZeRO for a cluster",
        description="Enumerate the parallel configurations of a GPT on N GPUs, prune what cannot fit or cannot "
        "win, simulate the rest, and print the best with their predicted step time, TFLOP/s, MFU, bubble and "
        "memory per GPU.",
    )
    p.add_argument(
        "--model",
        help="a preset (gpt-1.7b ... gpt-1t, gpt3-125m ... gpt3-175b, bloom-176b, llama3-8b, llama3-70b, "
        "llama3-405b), or gpt or llama with --layers --hidden --heads (default gpt)",
    )
    for flag, help_ in MODEL_FLAGS:
        p.add_argument(flag, type=int, help=help_)
    p.add_argument(
        "--attention",
        choices=ATTENTIONS,
        help="flash (default; no s x s scores stored or moved) or math (the unfused kernels); presets too",
    )
    p.add_argument(
        "--tie-embeddings", action="store_true", help="llama: the head shares the token embedding (gpt: always)"
    )
    add_moe_arguments(p)
    p.add_argument(
        "--costs",
        metavar="FILE",
        nargs="+",
        help="plan a model from its profile (pipeweave partition "
        "--save-costs FILE): its measured times scaled to the GPU by the ratio of FLOP rates (TP 1); "
        "several profiles at other microbatch sizes: times interpolated between them",
    )
    p.add_argument(
        "--profile-tflops",
        type=float,
        metavar="R",
        help="--costs: the profiling machine's effective "
        "TFLOP/s on these layers (default: the profile's counted FLOPs over its measured times)",
    )
    p.add_argument(
        "--dispatch",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="--costs: the runtime's time between two actions of a rank (train's 'dispatch per action'; default 0)",
    )
    p.add_argument(
        "--gpus",
        type=int,
        required=True,
        help="N, GPUs in the cluster: at most TP x PP x DP can use (the largest TP, the layers, the batch)",
    )
    p.add_argument(
        "--global-batch",
        type=int,
        required=True,
        metavar="B",
        help=f"B, samples per step; microbatches start at the size that keeps D x v x T within {MAX_CELLS} "
        f"(part, microbatch) pairs, the most a step simulates, and the space within {MAX_CONFIGURATIONS} "
        "configurations",
    )
    g = p.add_argument_group("hardware", "a preset, or custom with the five figures")
    g.add_argument(
        "--gpu",
        default="a100-80gb",
        help="a100-80gb (default), a100-40gb, h100-sxm, h100-pcie, h200, b200, mi300x or custom",
    )
    for flag, help_ in CUSTOM_FLAGS:
        g.add_argument(flag, type=float, help=f"custom: {help_}")
    g.add_argument("--gpus-per-node", type=int, help="GPUs per node (default 8)")
    f = p.add_argument_group("fixed dimensions", "each one searched unless given")
    f.add_argument("--tensor-parallel", type=int, metavar="N", help="N, tensor-parallel ranks")
    f.add_argument("--stages", "-D", type=int, metavar="D", help="D, pipeline ranks")
    f.add_argument("--data-parallel", type=int, metavar="P", help="P, data-parallel replicas")
    f.add_argument("--chunks", "-v", type=int, metavar="V", help="v, chunks per rank")
    f.add_argument("--microbatch-size", type=int, metavar="b", help="b, samples per microbatch")
    f.add_argument("-s", "--schedule", help="a synchronous registry schedule (pipeweave schedules)")
    f.add_argument("--recompute", help="none, selective (attention) or full")
    f.add_argument("--zero", type=int, help="ZeRO stage 0, 1, 2 or 3")
    f.add_argument("--expert-parallel", type=int, metavar="E", help="EP, of the DP ranks, splitting the experts")
    f.add_argument("--context-parallel", type=int, metavar="C", help="C, ranks splitting each sequence (ring)")
    o = p.add_argument_group("model of the run")
    o.add_argument(
        "--no-scatter-gather",
        action="store_true",
        help="pipeline messages sent whole by every TP rank (pipeweave's runtime), not split as Megatron",
    )
    o.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with TP, norms and messages on 1/N of the sequence (Korthikanti et al.): fewer activation "
        "bytes, the same collectives",
    )
    o.add_argument(
        "--grads",
        choices=("fp32", "bf16"),
        default="fp32",
        help="gradients in Megatron-LM's FP32 main-gradient buffer (default) or in BF16",
    )
    o.add_argument(
        "--optimizer", choices=("adam", "sgd"), default="adam", help="Adam (two FP32 moments; default) or SGD (one)"
    )
    o.add_argument(
        "--fragmentation",
        type=float,
        default=0.05,
        metavar="F",
        help="the caching allocator's margin, a fraction of the rest of the memory (default 0.05)",
    )
    o.add_argument(
        "--no-dp-overlap",
        action="store_true",
        help="DP all-reduce after the backward (Megatron's local DDP), not overlapped with it",
    )
    p.add_argument("--top", type=int, default=10, help="configurations to show (default 10)")
    p.add_argument("--all", action="store_true", help="simulate every configuration that may fit (for --plot)")
    p.add_argument(
        "--time-limit",
        type=float,
        default=6.0,
        metavar="SECONDS",
        help="stop the search once the command has used this many CPU seconds (from its start: imports and "
        "bounding count) and something fits, and say how much the configurations left could still gain "
        "(default 6; 0: search to the exact top)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object, best configuration first")
    p.add_argument(
        "--plot",
        metavar="FILE",
        help="draw step time against memory per GPU of the configurations simulated, the Pareto front "
        "marked (.png, .svg, .pdf; with --all: of the whole space)",
    )
    p.add_argument("--explain", action="store_true", help="say why the best configuration wins")
    return p


def run(args: argparse.Namespace) -> int:
    from pipeweave.api import best_configurations
    from pipeweave.commands.outputs import picture_file
    from pipeweave.commands.plan_report import explain_lines, plan_json, print_table, write_plot

    if args.top < 1:
        raise UserError(f"--top {args.top} is invalid; give an integer >= 1")
    if not 0 <= args.time_limit < math.inf:
        raise UserError(f"--time-limit {args.time_limit} is invalid; give finite seconds >= 0 (0: no limit)")
    plot = picture_file("--plot", args.plot) if args.plot else None
    cluster, fixed = _cluster(args), _fixed(args)
    _check_parallel(args, cluster.model)
    for flag, value in (("--gpus", args.gpus), ("--global-batch", args.global_batch)):
        if value < 1:
            raise UserError(f"{flag} {value} is invalid; give an integer >= 1")
    evaluator = _evaluator(args, cluster)
    with _Bar(quiet=args.json) as progress:
        plan = best_configurations(
            cluster,
            evaluator,
            args.gpus,
            args.global_batch,
            fixed,
            top=args.top,
            exhaustive=args.all,
            progress=progress,
            time_limit=max(0.0, args.time_limit - _cpu_used(args)) if args.time_limit else None,
        )
    if plot is not None:
        write_plot(plan, plot)
    if args.json:
        print(json.dumps(plan_json(plan, cluster, args, top=args.top)))
        return 0
    print_table(plan, cluster, args, top=args.top)
    if args.explain:
        for line in explain_lines(plan, cluster):
            print(line)
    if plot is not None:
        print(f"plot: {plot}")
    return 0


def _cluster(args: argparse.Namespace) -> Any:
    from pipeweave.planner.costs import Cluster
    from pipeweave.planner.efficiency import A100_CALIBRATED
    from pipeweave.planner.hardware import custom_gpu, gpu_named
    from pipeweave.planner.memory import StateBytes

    if args.gpu == "custom":
        peak = args.peak_tflops
        if peak is None and args.costs is not None:  # the profiling machine itself, at its measured rate
            peak = _profile_rate(args) / 1e12
        gpu = custom_gpu(
            peak_tflops=peak,
            memory_gib=args.memory_gib,
            intra_node_gbps=args.intra_node_gbps,
            inter_node_gbps=args.inter_node_gbps,
            gpus_per_node=args.gpus_per_node or 8,
            memory_tbps=args.memory_tbps,
        )
    else:
        given = [
            f
            for f in ("peak_tflops", "memory_gib", "memory_tbps", "intra_node_gbps", "inter_node_gbps")
            if getattr(args, f) is not None
        ]
        if given:
            raise UserError(
                f"--{given[0].replace('_', '-')} describes a custom GPU; give --gpu custom, or drop it "
                f"to use the {args.gpu} preset"
            )
        gpu = gpu_named(args.gpu)
        if args.gpus_per_node is not None:
            from dataclasses import replace

            gpu = replace(gpu, gpus_per_node=args.gpus_per_node)
    return Cluster(
        model=_model(args, gpu),
        gpu=gpu,
        efficiency=A100_CALIBRATED,
        scatter_gather=not args.no_scatter_gather,
        sequence_parallel=args.sequence_parallel,
        state=StateBytes(grads=args.grads, optimizer=args.optimizer, fragmentation=args.fragmentation),
    )


def _model(args: argparse.Namespace, gpu: Any) -> Any:
    """The model: from ``--costs`` scaled to ``gpu``, a preset, or ``--model gpt`` or ``llama`` with its shape."""
    from dataclasses import replace

    from pipeweave.planner.transformer import LLAMA, Transformer, model_named

    shape = {k: getattr(args, k) for k in SHAPE}
    given = [f"--{k.replace('_', '-')}" for k, v in shape.items() if v is not None]
    given += [f"--{k.replace('_', '-')}" for k in moe_fields(args)]
    if args.costs is not None:
        described = [f for f in ("--attention", "--tie-embeddings") if getattr(args, f[2:].replace("-", "_"))]
        if args.model is not None or given or described:
            raise UserError(
                f"{'--model' if args.model is not None else (given + described)[0]} describes a transformer; "
                "--costs plans the profiled model: give one of them"
            )
        if args.sequence_parallel:
            raise UserError(
                "--sequence-parallel applies to a GPT shape; --costs plans the profiled model as it "
                "was measured: drop --sequence-parallel"
            )
        return _profiled(args, gpu)
    if args.profile_tflops is not None or args.dispatch:
        raise UserError("--profile-tflops and --dispatch apply to a profiled model; give --costs FILE or drop them")
    kernel = {"attention": args.attention} if args.attention else {}
    if args.model in (None, "gpt", "llama"):
        kind = args.model or "gpt"
        missing = [f"--{k}" for k in ("layers", "hidden", "heads") if shape[k] is None]
        if missing:
            raise UserError(
                f"--model {kind} needs {' '.join(missing)}; give them, or a preset such as --model gpt-1t or "
                "llama3-8b, or --costs FILE"
            )
        for flag, value in (("--kv-heads", args.kv_heads), ("--ffn-hidden", args.ffn_hidden)):
            if value is not None and value < 1:
                raise UserError(f"{flag} {value} is invalid; give an integer >= 1")
        sizes = {k: v for k, v in shape.items() if v is not None}
        architecture = {**LLAMA, "tied": args.tie_embeddings} if kind == "llama" else {}
        return Transformer(name=kind, **sizes, **architecture, **kernel, **moe_fields(args))
    if given or args.tie_embeddings:
        raise UserError(
            f"{(given or ['--tie-embeddings'])[0]} changes the preset {args.model}; use --model gpt or llama with "
            "--layers --hidden --heads for another shape"
        )
    return replace(model_named(args.model), **kernel)


def _profiled(args: argparse.Namespace, gpu: Any) -> Any:
    """``--costs FILE`` scaled to ``gpu`` (``planner.profiled``); a custom GPU without a peak is the profiling
    machine, at the profile's measured rate."""
    import math

    from pipeweave.partition import LayerCosts
    from pipeweave.planner.efficiency import A100_CALIBRATED
    from pipeweave.planner.profiled import profiled_model

    if not 0 <= args.dispatch < math.inf:
        raise UserError(f"--dispatch {args.dispatch} is invalid; give finite seconds >= 0, e.g. 0.001")
    target = None if gpu.name == "custom" and args.peak_tflops is None else gpu.peak_flops
    first, *others = (LayerCosts.load(path) for path in args.costs)
    return profiled_model(
        first,
        target_flops=target,
        eta_max=A100_CALIBRATED.eta_max,
        rate=_profile_rate(args),
        name=f"profile {args.costs[0]}",
        others=tuple(others),
    )


def _profile_rate(args: argparse.Namespace) -> float:
    """R_profile in FLOP/s: ``--profile-tflops``, or the profile's counted FLOPs over its measured times."""
    import math

    from pipeweave.partition import LayerCosts
    from pipeweave.planner.profiled import profile_rate

    if args.profile_tflops is None:
        return profile_rate(*(LayerCosts.load(path) for path in args.costs))
    if not 0 < args.profile_tflops < math.inf:
        raise UserError(
            f"--profile-tflops {args.profile_tflops} is invalid; give the profiling machine's finite "
            "TFLOP/s > 0, e.g. 0.003"
        )
    return float(args.profile_tflops * 1e12)


def _evaluator(args: argparse.Namespace, cluster: Any) -> Any:
    from pipeweave.planner.evaluate import Evaluator
    from pipeweave.planner.evaluate_profiled import ProfiledEvaluator
    from pipeweave.planner.pipeline import Pipeline

    if args.costs is None:
        return Evaluator(cluster=cluster, batch=args.global_batch, overlap=not args.no_dp_overlap)
    return ProfiledEvaluator(
        cluster=cluster,
        batch=args.global_batch,
        overlap=not args.no_dp_overlap,
        pipeline=Pipeline(dispatch=args.dispatch),
    )


def _check_parallel(args: argparse.Namespace, model: Any) -> None:
    """A fixed --expert-parallel needs experts it divides; a fixed --context-parallel, 2C dividing the sequence."""
    ep, cp = args.expert_parallel, args.context_parallel
    experts = getattr(model, "moe_experts", 0)
    if ep is not None and ep > 1 and (not experts or experts % ep):
        raise UserError(
            f"--expert-parallel {ep} splits the experts, and {model.name} has {experts or 'none'}; give "
            "--moe-experts a multiple of it (a gpt or llama), or drop --expert-parallel"
        )
    seq = getattr(model, "seq_len", 0)
    if cp is not None and cp > 1 and (not seq or seq % (2 * cp)):
        raise UserError(
            f"--context-parallel {cp} splits each sequence into 2C = {2 * cp} chunks; give a --seq-len they "
            f"divide (a gpt or llama), e.g. {2 * cp * 1024}, or another C"
        )


def _fixed(args: argparse.Namespace) -> Any:
    from pipeweave.planner.space import Fixed

    return Fixed(
        tp=args.tensor_parallel,
        pp=args.stages,
        dp=args.data_parallel,
        chunks=args.chunks,
        microbatch_size=args.microbatch_size,
        schedule=args.schedule,
        recompute=args.recompute,
        zero=args.zero,
        ep=args.expert_parallel,
        cp=args.context_parallel,
    )


class _Bar:
    """A rich progress bar on stderr (only on a terminal, and never with ``--json``)."""

    def __init__(self, *, quiet: bool) -> None:
        self.quiet, self.bar, self.task = quiet, None, None

    def __enter__(self) -> Any:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        console = Console(stderr=True)
        if self.quiet or not console.is_terminal:
            return None
        self.bar = Progress(
            TextColumn("[bold]plan"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        self.bar.start()
        self.task = self.bar.add_task("plan", total=None)
        return self.update

    def update(self, done: int, total: int) -> None:
        assert self.bar is not None
        self.bar.update(self.task, completed=done, total=total)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()
        sys.stderr.flush()


def _cpu_used(args: argparse.Namespace) -> float:
    """CPU seconds the command has used so far (``cli`` notes its start; in-process callers without it: none)."""
    started = getattr(args, "cpu_started", None)
    return 0.0 if started is None else time.process_time() - started
