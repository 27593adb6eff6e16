"""The public functions behind ``pipeweave.simulate``, ``search``, ``plan`` and ``compare``.

Each takes plain values (registry names, sizes, a ``CostModel``) and returns
the library's own result objects. ``pipeweave plan`` and ``pipeweave compare``
run the same code (``best_configurations``, ``commands.compare_run.simulated_comparison``);
``simulate`` and ``search`` give the numbers of ``pipeweave simulate``
and ``pipeweave search`` (``tests/test_api.py``). The work is done by the
subpackages ``pipeweave.autoschedule`` (the zero-bubble search) and
``pipeweave.planner`` (the cluster planner), named apart from the functions so
that importing one of their modules never rebinds ``pipeweave.search`` or
``pipeweave.plan``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pipeweave.errors import UserError, renamed_activation_limit
from pipeweave.schedule.ir import Schedule
from pipeweave.schedule.registry import SCHEDULES, generate
from pipeweave.sim.cost import CostModel
from pipeweave.sim.metrics import Metrics
from pipeweave.sim.timeline import Timeline


@dataclass(frozen=True)
class Simulation:
    """A schedule simulated under a cost model: its timeline and metrics (``pipeweave.simulate``'s result).

    Attributes:
        schedule: the simulated schedule.
        timeline: every action's start and end per rank (``sim.timeline.Timeline``).
        metrics: makespan, bubble ratios, peak activations (M_a), weight copies (M_theta), staleness,
            inconsistency (``sim.metrics.Metrics``; DESIGN.md defines each).

    Example:
        >>> sim = simulate("gpipe", 2, 4)
        >>> print(sim.text(width=40))  # doctest: +ELLIPSIS
        rank 0 ...
    """

    schedule: Schedule
    timeline: Timeline
    metrics: Metrics

    def text(self, width: int = 100) -> str:
        """The timeline as text, about ``width`` columns wide, with a legend line."""
        from pipeweave.sim.textline import format_timeline

        return format_timeline(self.timeline, width=width)

    def plot(self, path: str) -> str:
        """Draw the timeline to ``path`` (.png, .svg or .pdf); returns the path written."""
        from pipeweave.sim.plot import plot_timeline

        return str(plot_timeline(self.timeline, path))


def simulate(
    schedule: str | Schedule = "1f1b",
    num_stages: int = 4,
    num_microbatches: int = 8,
    *,
    num_chunks: int | None = None,
    cost: CostModel | None = None,
    steps: int | None = None,
    **options: Any,
) -> Simulation:
    """Simulate a schedule, named in the registry or given, under ``cost`` (``pipeweave simulate``).

    Args:
        schedule: a registry name (``pipeweave.SCHEDULES``) or a ``Schedule`` (e.g. read from CSV).
        num_stages, num_microbatches, num_chunks: D, T and v of a named schedule.
        cost: per-part times and memory (default: f = b = w = 1, no communication). Searched schedules
            (zb-auto, zb-v-auto) are searched under its scalar times.
        steps: mini-batches of an asynchronous schedule's stream.
        options: the generator's own options, e.g. ``activation_limit=2.0`` for zb-auto.

    Raises:
        UserError: an unknown name.
        ScheduleError: sizes the schedule cannot serve; ``InvalidSchedule``: a given schedule breaks a rule.

    Example:
        >>> sim = simulate("1f1b", num_stages=4, num_microbatches=8)
        >>> round(sim.metrics.bubble_ratio, 4), sim.metrics.peak_activations
        (0.2727, (4.0, 3.0, 2.0, 1.0))
        >>> simulate("zb-h2", 4, 8).metrics.bubble_ratio
        0.0
    """
    from pipeweave.sim import compute_metrics
    from pipeweave.sim import simulate as timed
    from pipeweave.sim.validation import check

    cost = cost if cost is not None else CostModel()
    if isinstance(schedule, str):
        info = SCHEDULES.get(schedule)
        if info is None:
            raise UserError(f"unknown schedule {schedule!r}; choose one of: {', '.join(SCHEDULES)}")
        if info.searched and "memory_limit" in options:  # K's former name
            raise renamed_activation_limit(options["memory_limit"], keyword=True)
        if steps is not None:
            options["num_steps"] = steps
        options = {**cost.generator_options(info.generator), **options}
        schedule = generate(
            schedule, num_stages=num_stages, num_microbatches=num_microbatches, num_chunks=num_chunks, **options
        )
    check(schedule)
    timeline = timed(schedule, cost, check=True)
    return Simulation(schedule, timeline, compute_metrics(timeline))


def search(
    num_stages: int,
    num_microbatches: int,
    *,
    activation_limit: float = 1.0,
    cost: CostModel | None = None,
    v_shape: bool = False,
    solver: str = "cpsat",
    time_limit: float = 10.0,
    workers: int = 0,
    work_limit: float | None = None,
    **former: float,
) -> Any:
    """The best zero-bubble schedule found under a memory limit, with its proven bound (``pipeweave search``).

    Args:
        num_stages, num_microbatches: D and T.
        activation_limit: K, activations per rank as a multiple of 1F1B's peak D x M_a (1: ZB-1p's, 2: ZB-2p's).
        former: ``memory_limit``, K's former name (bytes per rank elsewhere), refused in one line.
        cost: times of one D-th of the model and ``mem_w`` (default f = b = w = 1).
        v_shape: two chunks per rank in a V (zb-v-auto) instead of one stage per rank.
        solver: ``"cpsat"``, ``"highs"`` or ``"heuristic"`` (no exact search).
        time_limit, workers, work_limit: the solver's wall seconds, threads and deterministic seconds.

    Raises:
        UserError: ``memory_limit=`` given (its line names ``activation_limit=``). TypeError: another unknown keyword.

    Returns:
        A ``search.SearchResult``: ``schedule``, ``bubble_ratio``, ``span``, ``lower_bound``, ``gap``, ``metrics``.

    Example:
        >>> result = search(4, 8, activation_limit=2.0, solver="heuristic")
        >>> result.bubble_ratio, result.schedule.num_ranks
        (0.0, 4)
    """
    from pipeweave.autoschedule import Problem, exact

    if "memory_limit" in former:
        raise renamed_activation_limit(former["memory_limit"], keyword=True)
    if former:
        raise TypeError(f"search() got an unexpected keyword argument {next(iter(former))!r}")
    problem = Problem(
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        vshape=v_shape,
        cost=cost if cost is not None else CostModel(),
        activation_limit=activation_limit,
    )
    return exact(problem, solver=solver, time_limit=time_limit, workers=workers, work_limit=work_limit)


_FIXED = {
    "tensor_parallel": "tp",
    "stages": "pp",
    "data_parallel": "dp",
    "chunks": "chunks",
    "microbatch_size": "microbatch_size",
    "schedule": "schedule",
    "recompute": "recompute",
    "zero": "zero",
}
"""``plan``'s keyword -> ``planner.space.Fixed``'s field."""


def plan(
    model: Any,
    gpus: int,
    global_batch: int,
    *,
    gpu: Any = "a100-80gb",
    top: int = 10,
    exhaustive: bool = False,
    sequence_parallel: bool = False,
    scatter_gather: bool = True,
    dp_overlap: bool = True,
    **fixed: Any,
) -> Any:
    """The planner's best parallel configurations of a GPT on a cluster, predicted by the simulator
    (``pipeweave plan``).

    Args:
        model: a preset name (``"gpt-1.7b"`` ... ``"gpt-1t"``, ``"gpt3-175b"``, ``"llama3-8b"``, ...:
            ``planner.transformer.MODELS``) or a ``planner.transformer.Transformer``.
        gpus, global_batch: N GPUs, B samples per step.
        gpu: a preset name (``"a100-80gb"``, ``"h100-sxm"``, ``"b200"``, ...: ``planner.hardware.GPUS``) or a
            ``planner.hardware.GPU``.
        top: how many of the best are exact (``best[:top]``: no configuration left out beats them);
            ``exhaustive``: simulate every one that may fit.
        sequence_parallel, scatter_gather, dp_overlap: the model of the run (``plan --sequence-parallel``,
            ``--no-scatter-gather``, ``--no-dp-overlap``).
        fixed: dimensions to hold: ``tensor_parallel``, ``stages``, ``data_parallel``, ``chunks``,
            ``microbatch_size``, ``schedule``, ``recompute``, ``zero``.

    Returns:
        A ``planner.search.Plan``: ``best`` lists the simulated configurations that fit, fastest first (each a
        ``planner.evaluate.Result``: ``config``, ``step_time``, ``mfu``, ``memory``, ``bubble``, ...).

    Raises:
        UserError: an unknown preset or fixed dimension, or nothing fits (the reason).

    Example:
        >>> result = plan("gpt-1.7b", gpus=8, global_batch=16, tensor_parallel=1, zero=0, top=3)
        >>> best = result.best[0].config
        >>> best.tp * best.pp * best.dp
        8
    """
    from pipeweave.planner.costs import Cluster
    from pipeweave.planner.efficiency import A100_CALIBRATED
    from pipeweave.planner.evaluate import Evaluator
    from pipeweave.planner.hardware import gpu_named
    from pipeweave.planner.space import Fixed
    from pipeweave.planner.transformer import model_named

    unknown = sorted(set(fixed) - set(_FIXED))
    if unknown:
        raise UserError(f"plan(): unknown dimension {unknown[0]!r}; give one of {', '.join(_FIXED)}")
    cluster = Cluster(
        model=model_named(model) if isinstance(model, str) else model,
        gpu=gpu_named(gpu) if isinstance(gpu, str) else gpu,
        efficiency=A100_CALIBRATED,
        scatter_gather=scatter_gather,
        sequence_parallel=sequence_parallel,
    )
    evaluator = Evaluator(cluster=cluster, batch=global_batch, overlap=dp_overlap)
    held = Fixed(**{_FIXED[k]: v for k, v in fixed.items()})
    return best_configurations(cluster, evaluator, gpus, global_batch, held, top=top, exhaustive=exhaustive)


def best_configurations(
    cluster: Any,
    evaluator: Any,
    gpus: int,
    global_batch: int,
    fixed: Any,
    *,
    top: int,
    exhaustive: bool = False,
    progress: Callable[[int, int], None] | None = None,
    time_limit: float | None = None,
) -> Any:
    """The planner's search over the configurations of ``cluster`` on ``gpus`` that ``pipeweave train`` runs
    (``planner.runnable``; ``planner.search.search``, which stops after ``time_limit`` seconds once something
    fits), each count checked first and the answer checked after (``planner.diagnose.check_plan``: why nothing
    fits).

    Raises:
        UserError: a count below 1, or a space with nothing that fits (the reason).
    """
    from pipeweave.planner.diagnose import check_counts, check_plan
    from pipeweave.planner.runnable import refusal
    from pipeweave.planner.search import search as search_space
    from pipeweave.planner.space import configurations

    for name, value in (("gpus", gpus), ("global batch", global_batch), ("top", top)):
        if value < 1:
            raise UserError(f"{name} {value} is invalid; give an integer >= 1")
    check_counts(cluster, gpus, global_batch, fixed)
    space = list(configurations(cluster.model, gpus, global_batch, cluster.gpu.gpus_per_node, fixed))
    # only what train runs (planner.runnable); what was fixed to a value it refuses is still evaluated, and
    # each row then says why train refuses it
    space = [
        c for c in space if refusal(c, cluster.model, sequence_parallel=cluster.sequence_parallel) is None
    ] or space
    check_plan(space, cluster, gpus, global_batch, fixed)
    found = search_space(space, evaluator, top=top, exhaustive=exhaustive, progress=progress, time_limit=time_limit)
    check_plan(space, cluster, gpus, global_batch, fixed, found)
    return found


@dataclass(frozen=True)
class Comparison:
    """Every approach side by side (``pipeweave.compare``'s result).

    Attributes:
        rows: one dict per approach, as ``pipeweave compare --json``'s rows: the literature's claims
            (``lit_*``), the closed forms (``closed_*``), and the simulated ``bubble_ratio``,
            ``peak_activations``, ``weight_versions``, ``staleness``, ``step_time_s``, ``samples_per_s``.
        skipped: the approaches that cannot serve the setting, each ``{"name", "reason"}``.

    Example:
        >>> Comparison(rows=[{"name": "gpipe"}], skipped=[]).names
        ['gpipe']
    """

    rows: list[dict[str, Any]]
    skipped: list[dict[str, str]]

    @property
    def names(self) -> list[str]:
        return [row["name"] for row in self.rows]


def compare(
    schedules: Sequence[str] | None = None,
    num_stages: int = 4,
    num_microbatches: int = 8,
    *,
    num_chunks: int = 2,
    batch: int = 16,
    model: str = "gpt",
    costs: str | None = None,
    **model_options: Any,
) -> Comparison:
    """Every approach (or ``schedules``) on one model, D and T, simulated under the model's profiled per-part
    costs beside the literature's claims (``pipeweave compare``, its simulated depth).

    ``--measure`` (real runs of each approach) and ``--convergence`` (training through the reference
    executor) stay on the command line.

    Args:
        schedules: registry names (default: every one but the searched zb-auto and zb-v-auto).
        num_stages, num_microbatches, num_chunks: D, T, and v of the schedules that take it.
        batch: samples per mini-batch; the profiled microbatch is ``batch // num_microbatches``.
        model: ``"gpt"``, ``"llama"``, ``"mlp"``, ``"FILE.py:NAME"`` or ``"hf:TYPE"`` (as ``pipeweave train
            --model``).
        costs: a per-layer costs file (``pipeweave partition --save-costs``) instead of profiling (cached).
        model_options: the model's sizes: ``layers``, ``hidden``, ``heads``, ``seq_len``, ``vocab``, ``seed``,
            ``tie_embeddings``, ``hf_config`` (the llama's also ``kv_heads``, ``ffn_hidden``).

    Raises:
        UserError: an unknown option or name, or a setting no approach can serve.

    Example:
        >>> table = compare(["gpipe", "1f1b"], 2, 4, batch=8, model="mlp", layers=4, hidden=16)
        >>> table.names, table.rows[1]["peak_activations"]
        (['gpipe', '1f1b'], [2.0, 1.0])
    """
    import argparse

    from pipeweave.commands.compare import add_parser
    from pipeweave.commands.compare_run import simulated_comparison
    from pipeweave.commands.model_options import MODEL_OPTIONS

    parser = argparse.ArgumentParser(prog="pipeweave")
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["compare"])
    known = {*MODEL_OPTIONS, "tie_embeddings", "hf_config"}
    unknown = sorted(set(model_options) - known)
    if unknown:
        raise UserError(f"compare(): unknown model option {unknown[0]!r}; give one of {', '.join(sorted(known))}")
    given = {
        "schedules": None if schedules is None else ",".join(schedules),
        "stages": num_stages,
        "microbatches": num_microbatches,
        "chunks": num_chunks,
        "batch": batch,
        "model": model,
        "costs": costs,
        **model_options,
    }
    vars(args).update(given)
    rows, skipped, _ = simulated_comparison(args)
    return Comparison(rows=rows, skipped=skipped)
