"""One line saying what would make a plan possible: no split of the GPUs, heads that allow no TP, a model that
fits on no split."""

from __future__ import annotations

import math
from collections.abc import Sequence

from pipeweave.errors import UserError
from pipeweave.planner.candidate import Config
from pipeweave.planner.costs import Cluster
from pipeweave.planner.memory import GIB
from pipeweave.planner.profiled import ProfiledModel
from pipeweave.planner.search import Plan
from pipeweave.planner.space import Fixed, divisors, splits, tensor_parallel_sizes


def check_plan(
    space: Sequence[Config], cluster: Cluster, gpus: int, batch: int, fixed: Fixed, plan: Plan | None = None
) -> None:
    """Raise the one-line reason when ``space`` is empty, or when ``plan`` found nothing that fits.

    Raises:
        UserError: as above.
    """
    model, per_node = cluster.model, cluster.gpu.gpus_per_node
    if isinstance(model, ProfiledModel):
        _check_profiled(model, fixed)
    elif not tensor_parallel_sizes(model, per_node, fixed):
        good = [t for t in divisors(per_node) if model.heads % t == 0 and model.hidden % t == 0]
        raise UserError(
            f"--tensor-parallel {fixed.tp} does not divide the {model.heads} heads (and hidden "
            f"{model.hidden}) or the {per_node} GPUs of a node; give one of {good}"
        )
    if not splits(model, gpus, batch, per_node, Fixed(tp=fixed.tp)):
        raise UserError(_no_split(cluster, gpus, batch, fixed))
    if not space:
        raise UserError(
            f"no configuration of {gpus} GPUs matches the fixed dimensions ({_fixed_text(fixed)}); fix fewer of them"
        )
    if plan is not None and not plan.best:
        raise UserError(_too_big(cluster, gpus, plan))


def _check_profiled(model: ProfiledModel, fixed: Fixed) -> None:
    """What a profiled model cannot do: split a layer over TP ranks, recompute attention alone."""
    if fixed.tp not in (None, 1):
        raise UserError(
            f"--tensor-parallel {fixed.tp}: a model planned from --costs runs with TP 1 (its profile "
            "does not say how to split a layer); drop --tensor-parallel or give 1"
        )
    if fixed.recompute not in (None, *model.recomputations):
        raise UserError(
            f"--recompute {fixed.recompute}: a model planned from --costs recomputes none or full "
            "(its profile does not isolate attention); give one of those"
        )


def _fixed_text(fixed: Fixed) -> str:
    from pipeweave.planner.space import FLAGS

    given = [f"{FLAGS[k]} {getattr(fixed, k)}" for k in FLAGS if getattr(fixed, k) is not None]
    return ", ".join(given) or "none fixed"


def _no_split(cluster: Cluster, gpus: int, batch: int, fixed: Fixed) -> str:
    """No TP x PP x DP makes ``gpus``: name the nearest GPU counts that split."""
    model, per_node = cluster.model, cluster.gpu.gpus_per_node
    nearest = [n for n in _nearby(gpus) if splits(model, n, batch, per_node, Fixed(tp=fixed.tp))][:3]
    if isinstance(model, ProfiledModel):
        tp, pp = "TP 1", f"PP at most the {model.layers} layers"
    else:
        tp = f"TP {fixed.tp}" if fixed.tp else f"TP dividing the {model.heads} heads and the {per_node} GPUs of a node"
        pp = f"PP dividing the {model.layers} layers"
    return (
        f"{gpus} GPUs split into no TP x PP x DP with {tp}, {pp} and DP "
        f"dividing the global batch {batch}; give --gpus {' or '.join(map(str, nearest))}, or a --global-batch "
        f"with more divisors"
    )


def _nearby(n: int) -> list[int]:
    """Counts near ``n``, closest first (``n`` itself excluded)."""
    out = []
    for d in range(1, 4 * n + 1):
        out += [m for m in (n - d, n + d) if m >= 1]
    return out


def _too_big(cluster: Cluster, gpus: int, plan: Plan) -> str:
    """Nothing fits: the least memory any configuration needs, and how many GPUs would give room."""
    memory = cluster.gpu.memory_bytes
    need, label = plan.least_memory
    factor = max(2, math.ceil(need / (0.8 * memory)))  # a fifth of the memory left for what does not shrink
    tp_note = ""
    if isinstance(cluster.model, ProfiledModel):
        tp_note = "; a profiled model runs at TP 1"
    elif max(tensor_parallel_sizes(cluster.model, cluster.gpu.gpus_per_node, Fixed())) < cluster.gpu.gpus_per_node:
        tp_note = (
            f"; its {cluster.model.heads} heads allow TP up to "
            f"{max(tensor_parallel_sizes(cluster.model, cluster.gpu.gpus_per_node, Fixed()))} only, heads a "
            f"multiple of {cluster.gpu.gpus_per_node} would allow TP {cluster.gpu.gpus_per_node}"
        )
    return (
        f"{cluster.model.name} ({cluster.model.parameters / 1e9:.3g}B parameters) fits on no split of {gpus} "
        f"GPUs of {memory / GIB:.1f} GiB: the smallest needs {need / GIB:.1f} GiB per GPU ({label}){tp_note}; "
        f"give about {factor}x the GPUs (--gpus {factor * gpus}) or a GPU with more memory"
    )
