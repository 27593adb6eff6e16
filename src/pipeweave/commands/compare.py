"""``pipeweave compare``: the survey's comparison table (Guan et al. 2024, Table 3), measured on your model.

For every chosen approach, the literature's claims beside pipeweave's numbers,
at three depths: simulated (default, seconds: the registry's closed forms and
``pipeweave simulate`` under the model's profiled per-part costs),
``--measure STEPS`` (each approach run for real by ``pipeweave train``, in
alternating rounds) and ``--convergence STEPS`` (each approach trained through
the reference executor, as ``benchmarks/convergence``, its final held-out loss
against synchronous training). The parser needs no torch; the work is in
``commands.compare_run``.
"""

from __future__ import annotations

import argparse
from typing import Any

from pipeweave.commands.model_options import add_model_arguments


# An argparse declaration, kept as one list of options (exempt from the 60-line rule for functions).
def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "compare",
        help="every approach side by side: literature's claims beside simulated, measured numbers",
        description="Compare pipeline approaches on one model, D and T: the survey's formulas and adjectives "
        "beside the simulator's values under the model's profiled costs; --measure runs them for real, "
        "--convergence trains them through the reference executor.",
    )
    choose = p.add_mutually_exclusive_group()
    choose.add_argument(
        "-s",
        "--schedules",
        metavar="NAME,NAME,...",
        help="the approaches to compare (pipeweave schedules; default: every one but the searched "
        "zb-auto and zb-v-auto)",
    )
    choose.add_argument("--all", action="store_true", help="every registered approach, the searched ones too")
    p.add_argument("--stages", "-D", type=int, default=4, help="D, pipeline ranks (default 4)")
    p.add_argument(
        "--microbatches",
        "-T",
        type=int,
        default=8,
        help="T, microbatches per step (default 8); D x T x chunks x --stream-steps within simulate's limit",
    )
    p.add_argument(
        "--chunks",
        "-v",
        type=int,
        default=2,
        help="v, chunks per rank of the schedules that take it (interleaved-1f1b; default 2)",
    )
    add_model_arguments(p)
    p.add_argument(
        "--batch", type=int, default=16, help="samples per mini-batch, split into T microbatches (default 16)"
    )
    p.add_argument(
        "--costs",
        metavar="FILE",
        help="per-layer costs (JSON, pipeweave partition --save-costs) instead of profiling the model (cached)",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed runs per layer when profiling (default 5)")
    p.add_argument("--refresh", action="store_true", help="profile again even if a cached profile exists")
    p.add_argument(
        "--time-comm",
        type=float,
        default=None,
        metavar="SECONDS",
        help="hop latency for the 'bubble +comm' column (default: the measured run's, with --measure)",
    )
    p.add_argument(
        "--time-dispatch",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a runtime's time between two actions, for the 'bubble +comm' column (default: the measured "
        "run's, with --measure)",
    )
    p.add_argument(
        "--stream-steps",
        type=int,
        default=8,
        metavar="N",
        help="mini-batches of a simulated asynchronous stream (default 8; its steady state is reported)",
    )
    depth = p.add_argument_group("depth")
    depth.add_argument(
        "--measure",
        type=int,
        metavar="STEPS",
        help="also run each approach for real (pipeweave train) for STEPS steps on D ranks",
    )
    depth.add_argument(
        "--rounds",
        type=int,
        help="--measure: alternating rounds, the median of each figure kept (default 1)",
    )
    depth.add_argument(
        "--convergence",
        type=int,
        metavar="STEPS",
        help="also train each approach for STEPS mini-batches through the reference executor "
        "(same data order, optimizer, samples) and compare the final held-out loss",
    )
    depth.add_argument(
        "--seeds",
        type=int,
        metavar="K",
        help="--convergence: seeds 0..K-1 (initialisation and data order; default 1)",
    )
    depth.add_argument("--lr", type=float, help="--convergence: SGD learning rate (default 0.3)")
    depth.add_argument("--momentum", type=float, help="--convergence: SGD momentum (default 0.9)")
    out = p.add_argument_group("outputs")
    out.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    out.add_argument("--csv", metavar="FILE", help="write one row per approach (CSV)")
    out.add_argument(
        "--markdown", metavar="FILE", help="write the table as Markdown, with the hardware, date and commit"
    )
    out.add_argument(
        "--plot", metavar="FILE", help="write the trade-off plot (.png, .svg or .pdf), Pareto front marked"
    )
    out.add_argument(
        "--recommend",
        action="store_true",
        help="rank the approaches that fit --activation-limit or --memory-limit by time per sample, each "
        "exclusion's reason",
    )
    out.add_argument(
        "--activation-limit",
        type=float,
        metavar="K",
        help="--recommend: activations one rank may hold as a multiple of 1F1B's peak D x M_a (e.g. 1, 2)",
    )
    out.add_argument(
        "--memory-limit",
        metavar="BYTES",
        help="--recommend: activation bytes one rank may hold, measured or simulated (e.g. 64MiB, 2e9)",
    )
    return p


def run(args: argparse.Namespace) -> int:
    """Compare (``commands.compare_run``: imported here, so that parsing any subcommand needs no torch)."""
    from pipeweave.commands.compare_run import compare

    return compare(args)
