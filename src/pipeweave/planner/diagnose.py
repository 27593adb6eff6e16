"""One line saying what would make a plan possible: no split of the GPUs, heads that allow no TP, a model that
fits on no split."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipeweave.errors import UserError
from pipeweave.planner.candidate import Config
from pipeweave.planner.costs import Cluster
from pipeweave.planner.floor import floor_bytes, largest_tensor_parallel, what_would_fit
from pipeweave.planner.memory import GIB
from pipeweave.planner.profiled import ProfiledModel
from pipeweave.planner.search import Plan
from pipeweave.planner.space import (
    MAX_CELLS,
    UNEVEN_SLACK,
    Fixed,
    cells_per_microbatch,
    divisors,
    searched_parts,
    splits,
    tensor_parallel_sizes,
)


def check_plan(
    space: Sequence[Config], cluster: Cluster, gpus: int, batch: int, fixed: Fixed, plan: Plan | None = None
) -> None:
    """Raise the one-line reason when ``space`` is empty, or when ``plan`` found nothing that fits.

    Raises:
        UserError: as above.
    """
    model, per_node = cluster.model, cluster.gpu.gpus_per_node
    _check_dimensions(cluster, fixed)
    if not splits(model, gpus, batch, per_node, Fixed(tp=fixed.tp)):
        raise UserError(_no_split(cluster, gpus, batch, fixed))
    if not space:
        raise UserError(
            f"no configuration of {gpus} GPUs matches the fixed dimensions ({_fixed_text(fixed)}) with at most "
            f"{MAX_CELLS} (part, microbatch) pairs per step (D x v x T, the most the planner simulates); fix "
            "fewer of them, or give fewer --gpus or a smaller --global-batch"
        )
    if plan is not None and not plan.best:
        raise UserError(_too_big(cluster, gpus, plan, fixed, space))


def _check_dimensions(cluster: Cluster, fixed: Fixed) -> None:
    """A fixed TP the heads or the node refuse, or what a profiled model cannot do."""
    model, per_node = cluster.model, cluster.gpu.gpus_per_node
    if isinstance(model, ProfiledModel):
        _check_profiled(model, fixed)
    elif not tensor_parallel_sizes(model, per_node, fixed):
        good = [t for t in divisors(per_node) if model.heads % t == 0 and model.hidden % t == 0]
        raise UserError(
            f"--tensor-parallel {fixed.tp} does not divide the {model.heads} heads (and hidden "
            f"{model.hidden}) or the {per_node} GPUs of a node; give one of {good}"
        )


def check_counts(cluster: Cluster, gpus: int, batch: int, fixed: Fixed) -> None:
    """Before the space is listed: more GPUs than any split uses, or a batch whose microbatches the simulation
    limit (``space.MAX_CELLS``) makes too large to fit on any split, is one line with the count that works.

    Raises:
        UserError: as above.
    """
    _check_dimensions(cluster, fixed)
    if gpus > split_counts(cluster, batch, Fixed(tp=fixed.tp)).largest:
        raise UserError(_no_split(cluster, gpus, batch, fixed))
    if (floor := floor_bytes(cluster, fixed)) > cluster.gpu.memory_bytes:
        raise UserError(_no_count_fits(cluster, fixed, floor))
    found = splits(cluster.model, gpus, batch, cluster.gpu.gpus_per_node, fixed)
    if not found or fixed.microbatch_size is not None:
        return
    least = min(_least_microbatch(batch, dp, pp) for _, pp, dp in found)
    if least > 1 and floor_bytes(cluster, replace(fixed, microbatch_size=least)) > cluster.gpu.memory_bytes:
        raise UserError(_batch_limited(cluster, gpus, batch, least, found))


def _no_count_fits(cluster: Cluster, fixed: Fixed, floor: float) -> str:
    """What no count of GPUs can go below (``planner.floor``), and what would bring it under the GPU's memory."""
    model, memory = cluster.model, cluster.gpu.memory_bytes
    tp = fixed.tp or largest_tensor_parallel(cluster)
    return (
        f"{model.name} ({model.parameters / 1e9:.3g}B parameters) fits on no count of GPUs of {memory / GIB:.1f} "
        f"GiB: with one block per GPU, b = {fixed.microbatch_size or 1} and TP {tp} at most, a GPU still holds {floor / GIB:.1f} GiB of activations and allowance; give "
        f"{'; or '.join(what_would_fit(cluster, fixed))}"
    )


def _least_microbatch(batch: int, dp: int, pp: int) -> int:
    """The least b that keeps T = batch / (dp x b) microbatches over ``pp`` parts within ``MAX_CELLS``."""
    per_replica = batch // dp
    return next(b for b in divisors(per_replica) if per_replica // b * pp <= MAX_CELLS)


def _batch_limited(cluster: Cluster, gpus: int, batch: int, least: int, found: Sequence[tuple[int, int, int]]) -> str:
    """The simulation limit makes microbatches of ``least`` samples at least: the largest batch it keeps at b = 1."""
    most = max(dp * (MAX_CELLS // pp) for _, pp, dp in found)
    need = floor_bytes(cluster, Fixed(microbatch_size=least))
    return (
        f"--global-batch {batch} on {gpus} GPUs: a step simulates at most {MAX_CELLS} (part, microbatch) pairs, "
        f"so its microbatches hold {least} samples at least, {need / GIB:.0f} GiB per GPU or more; give "
        f"--global-batch {most} or less (microbatches of one sample within the limit), or more --gpus"
    )


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
    """No TP x PP x DP makes ``gpus``: above the largest count that splits, that count; else the nearest three."""
    model, per_node = cluster.model, cluster.gpu.gpus_per_node
    if isinstance(model, ProfiledModel):
        tp, pp = "TP 1", f"PP at most the {model.layers} layers"
    else:
        tp = f"TP {fixed.tp}" if fixed.tp else f"TP dividing the {model.heads} heads and the {per_node} GPUs of a node"
        pp = f"PP cutting the {model.layers} layers evenly or nearly (at most {UNEVEN_SLACK:.0%} idle)"
    counts = split_counts(cluster, batch, Fixed(tp=fixed.tp))
    if gpus > counts.largest:
        return (
            f"--gpus {gpus} is more than any split uses: {tp}, {pp} and DP dividing the global batch {batch} "
            f"make at most {counts.largest} GPUs; give --gpus {counts.largest} or fewer, or a larger --global-batch"
        )
    nearest = counts.nearest(gpus)
    return (
        f"{gpus} GPUs split into no TP x PP x DP with {tp}, {pp} and DP "
        f"dividing the global batch {batch}; give --gpus {' or '.join(map(str, nearest))}, or a --global-batch "
        f"with more divisors"
    )


@dataclass(frozen=True)
class SplitCounts:
    """The GPU counts TP x PP x DP can make: TP and PP as pairs, DP any divisor of the batch."""

    units: tuple[int, ...]
    """Every TP x PP."""
    replicas: tuple[int, ...]
    """Every DP, ascending."""

    @property
    def largest(self) -> int:
        return max(self.units, default=0) * max(self.replicas, default=0)

    def at_least(self, gpus: int) -> int:
        """The least count of ``gpus`` or more (0: none)."""
        above = []
        for unit in self.units:
            k = bisect.bisect_left(self.replicas, gpus / unit)
            above += [unit * self.replicas[k]] if k < len(self.replicas) else []
        return min(above, default=0)

    def nearest(self, gpus: int, count: int = 3) -> list[int]:
        """The ``count`` counts closest to ``gpus`` (``gpus`` itself excluded), the smaller first on a tie."""
        found: set[int] = set()
        for unit in self.units:  # of each unit, the ``count`` replica counts on either side of gpus / unit
            k = bisect.bisect_left(self.replicas, gpus / unit)
            found.update(unit * dp for dp in self.replicas[max(0, k - count) : k + count + 1])
        found.discard(gpus)
        return sorted(found, key=lambda n: (abs(n - gpus), n))[:count]


def split_counts(cluster: Cluster, batch: int, fixed: Fixed) -> SplitCounts:
    """The counts of GPUs ``cluster``'s model splits over with ``batch`` (``SplitCounts``), in O(sqrt) of each
    figure: never a walk over the counts themselves."""
    model, per_node = cluster.model, cluster.gpu.gpus_per_node
    pps = [
        p
        for p in range(1, min(model.layers, MAX_CELLS) + 1)
        if searched_parts(model, p, fixed) and fixed.allows("pp", p)
    ]
    units = {t * p for t in tensor_parallel_sizes(model, per_node, fixed) for p in pps}
    return SplitCounts(tuple(sorted(units)), tuple(d for d in divisors(batch) if fixed.allows("dp", d)))


def _too_big(cluster: Cluster, gpus: int, plan: Plan, fixed: Fixed, space: Sequence[Config]) -> str:
    """Nothing fits (though some count of GPUs would, ``check_counts``): the microbatch the simulation limit
    forces, or the least memory any configuration needs and how many GPUs would give room."""
    memory, model = cluster.gpu.memory_bytes, cluster.model
    need, label = plan.least_memory
    head = (
        f"{model.name} ({model.parameters / 1e9:.3g}B parameters) fits on no split of {gpus} GPUs of "
        f"{memory / GIB:.1f} GiB: the smallest needs {need / GIB:.1f} GiB per GPU ({label})"
    )
    least = min(c.microbatch_size for c in space)
    if least > 1 and fixed.microbatch_size is None:
        found = {(c.tp, cells_per_microbatch(c.schedule, c.pp, c.chunks), c.dp) for c in space}  # (tp, parts, dp)
        return f"{head}; " + _batch_limited(cluster, gpus, _batch_of(space), least, sorted(found))
    return head + _more_gpus(cluster, gpus, need, split_counts(cluster, _batch_of(space), Fixed(tp=fixed.tp)))


def _batch_of(space: Sequence[Config]) -> int:
    """The global batch of a space: DP x b x T of any of its configurations."""
    c = space[0]
    return c.dp * c.microbatch_size * c.microbatches


def _more_gpus(cluster: Cluster, gpus: int, need: float, counts: SplitCounts) -> str:
    """How many more GPUs would give room (a fifth of the memory left for what does not shrink): the least
    count that splits at or above that, at most the largest."""
    memory, model = cluster.gpu.memory_bytes, cluster.model
    factor = max(2, math.ceil(need / (0.8 * memory)))
    tp_note, most = "", largest_tensor_parallel(cluster)
    if isinstance(model, ProfiledModel):
        tp_note = "; a profiled model runs at TP 1"
    elif most < cluster.gpu.gpus_per_node:
        per_node = cluster.gpu.gpus_per_node
        tp_note = (
            f"; its {model.heads} heads allow TP up to {most} only, heads a multiple of {per_node} would allow "
            f"TP {per_node}"
        )
    if gpus >= counts.largest:
        return f"{tp_note}; no split uses more than these {gpus} GPUs: give a GPU with more memory, or a larger batch"
    more = counts.at_least(factor * gpus) or counts.largest
    return f"{tp_note}; give about {more / gpus:.0f}x the GPUs (--gpus {more}) or a GPU with more memory"
