"""The registry of schedule names: a plain dict from name to ``ScheduleInfo``.

The names are the CLI's ``-s`` values. Each entry carries the closed forms of
its paper (as text, for ``pipeweave schedules``) and the conditions they need,
and what the schedule supports: its placement, whether it splits B into I and
W, whether it is searched, how it takes data parallelism, ties, and its default
options. Every other module reads these facts here, by name; none keeps its own
list of names (``tests/schedule/test_registry_facts.py`` keeps it so).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

from pipeweave.schedule.ampnet import ampnet
from pipeweave.schedule.avgpipe import avgpipe
from pipeweave.schedule.chimera import chimera
from pipeweave.schedule.dualpipe import dualpipe, dualpipe_v
from pipeweave.schedule.gems import gems
from pipeweave.schedule.gpipe import gpipe
from pipeweave.schedule.info import DataParallel, PlacementKind, ScheduleInfo
from pipeweave.schedule.interleaved import interleaved_1f1b
from pipeweave.schedule.ir import Schedule, ScheduleError
from pipeweave.schedule.naive import naive
from pipeweave.schedule.one_f_one_b import one_f_one_b
from pipeweave.schedule.pipedream import pipedream, pipedream_2bw
from pipeweave.schedule.pipemare import pipemare
from pipeweave.schedule.spectrain import spectrain
from pipeweave.schedule.wpipe import wpipe
from pipeweave.schedule.xpipe import xpipe
from pipeweave.schedule.zb_v import zb_v
from pipeweave.schedule.zero_bubble import zb_h1, zb_h2

Times = float | Sequence[float]  # a scalar per D-th of the model, or one value per part


# zb-auto and zb-v-auto live in pipeweave.autoschedule, which imports schedule.ir: importing
# it here at module level would be a cycle (search -> schedule package -> registry ->
# search), so these wrappers import it when called. Their signatures are the options.
def _zb_auto(
    num_stages: int,
    num_microbatches: int,
    *,
    activation_limit: float = 1.0,
    mem_w: float = 0.5,
    time_f: Times = 1.0,
    time_b: Times = 1.0,
    time_w: Times = 1.0,
    time_comm: float = 0.0,
    solver: str = "heuristic",
    time_limit: float = 10.0,
) -> Schedule:
    from pipeweave.autoschedule.registry_entries import zb_auto

    return zb_auto(
        num_stages,
        num_microbatches,
        activation_limit=activation_limit,
        mem_w=mem_w,
        time_f=time_f,
        time_b=time_b,
        time_w=time_w,
        time_comm=time_comm,
        solver=solver,
        time_limit=time_limit,
    )


def _zb_v_auto(
    num_stages: int,
    num_microbatches: int,
    *,
    activation_limit: float = 1.0,
    mem_w: float = 0.5,
    time_f: Times = 1.0,
    time_b: Times = 1.0,
    time_w: Times = 1.0,
    time_comm: float = 0.0,
    solver: str = "heuristic",
    time_limit: float = 10.0,
) -> Schedule:
    from pipeweave.autoschedule.registry_entries import zb_v_auto

    return zb_v_auto(
        num_stages,
        num_microbatches,
        activation_limit=activation_limit,
        mem_w=mem_w,
        time_f=time_f,
        time_b=time_b,
        time_w=time_w,
        time_comm=time_comm,
        solver=solver,
        time_limit=time_limit,
    )


SCHEDULES: dict[str, ScheduleInfo] = {
    "naive": ScheduleInfo(
        name="naive",
        generator=naive,
        family="naive model parallelism",
        synchronous=True,
        bubble="(D-1)/D",
        activations="M_a",
        weights="M_theta",
        chunks=1,
        placement=PlacementKind.STRAIGHT,
        splits_backward=False,
        data_parallel=DataParallel.SYNCHRONOUS,
        ties=True,
    ),
    "gpipe": ScheduleInfo(
        name="gpipe",
        generator=gpipe,
        family="GPipe",
        synchronous=True,
        bubble="(D-1)/(T+D-1)",
        activations="T M_a",
        weights="M_theta",
        chunks=1,
        placement=PlacementKind.STRAIGHT,
        splits_backward=False,
        data_parallel=DataParallel.SYNCHRONOUS,
        ties=True,
    ),
    "1f1b": ScheduleInfo(
        name="1f1b",
        generator=one_f_one_b,
        family="DAPPLE / PipeDream-Flush",
        synchronous=True,
        bubble="(D-1)/(T+D-1)",
        activations="min(D-r, T) M_a on rank r",
        weights="M_theta",
        chunks=1,
        placement=PlacementKind.STRAIGHT,
        splits_backward=False,
        data_parallel=DataParallel.SYNCHRONOUS,
        ties=True,
    ),
    "interleaved-1f1b": ScheduleInfo(
        name="interleaved-1f1b",
        generator=interleaved_1f1b,
        family="Megatron-LM interleaved 1F1B",
        synchronous=True,
        bubble="overhead (D-1)/(vT) (T multiple of D when v > 1; any f, b, w)",
        activations="min(2(D-r-1)+(v-1)D+1, vT)/v M_a on rank r; D+(D-1)/v on rank 0 (T >= 2D)",
        weights="M_theta",
        chunks=None,
        placement=PlacementKind.LOOPED,
        splits_backward=False,
        data_parallel=DataParallel.SYNCHRONOUS,
        ties=True,
    ),
    "zb-h1": ScheduleInfo(
        name="zb-h1",
        generator=zb_h1,
        family="zero bubble ZB-H1",
        synchronous=True,
        bubble="time (D-1)(f+b-w) (T >= D, w <= f)",
        activations="(D-r) M_a + r M_W on rank r; D M_a on rank 0 (T >= D)",
        weights="M_theta",
        chunks=1,
        placement=PlacementKind.STRAIGHT,
        splits_backward=True,
        data_parallel=DataParallel.SYNCHRONOUS,
        ties=True,
    ),
    "zb-h2": ScheduleInfo(
        name="zb-h2",
        generator=zb_h2,
        family="zero bubble ZB-H2",
        synchronous=True,
        bubble="time max(0, (D-1)(f+b-2w)) (T >= 2D-1, w <= f); 0 at f = b = w",
        activations="(2D-2r-1) M_a + 2r M_W on rank r; (2D-1) M_a on rank 0 (T >= 2D-1)",
        weights="M_theta",
        chunks=1,
        placement=PlacementKind.STRAIGHT,
        splits_backward=True,
        data_parallel=DataParallel.SYNCHRONOUS,
        ties=True,
    ),
    "zb-v": ScheduleInfo(
        name="zb-v",
        generator=zb_v,
        family="zero bubble ZB-V",
        synchronous=True,
        bubble="0 at f = b = w (T >= 2D-1)",
        activations="D M_a on every rank (T >= 2D-1)",
        weights="M_theta",
        chunks=2,
        placement=PlacementKind.V_SHAPE,
        splits_backward=True,
        data_parallel=DataParallel.SYNCHRONOUS,
        ties=True,
    ),
    "chimera": ScheduleInfo(
        name="chimera",
        generator=chimera,
        family="Chimera (bidirectional)",
        synchronous=True,
        bubble="(D-2)/(2T+D-2) at f = b+w, overlapped units (D even, T multiple of D)",
        activations="(D/2+1) M_a to D M_a (T = D); D M_a (T >= 2D)",
        weights="2 M_theta",
        chunks=1,
        placement=PlacementKind.BIDIRECTIONAL,
        splits_backward=False,
        data_parallel=DataParallel.SYNCHRONOUS,
        ties=True,
    ),
    "gems": ScheduleInfo(
        name="gems",
        generator=gems,
        family="GEMS (mirrored replicas)",
        synchronous=True,
        bubble="~(D-1)/(D+1/2) at b+w = 2f (per pair; exact step form in gems.py)",
        activations="M_a",
        weights="2 M_theta",
        chunks=1,
        placement=PlacementKind.BIDIRECTIONAL,
        splits_backward=False,
        data_parallel=DataParallel.SYNCHRONOUS,
        ties=True,
    ),
    "dualpipe": ScheduleInfo(
        name="dualpipe",
        generator=dualpipe,
        family="DualPipe (DeepSeek-V3)",
        synchronous=True,
        bubble="time (D/2-1)(f+b-w), no comm (F&B pairs hide only comm), w <= b <= f <= b+w (DeepSeek: (PP/2-1)(F&B+B-3W))",
        activations="D+1 M_a",
        weights="2 M_theta",
        chunks=1,
        placement=PlacementKind.BIDIRECTIONAL,
        splits_backward=True,
        data_parallel=DataParallel.SYNCHRONOUS,
        ties=True,
    ),
    "dualpipe-v": ScheduleInfo(
        name="dualpipe-v",
        generator=dualpipe_v,
        family="DualPipeV (DeepSeek, cut-in-half V)",
        synchronous=True,
        bubble="time (D-1)(f+b-w)/2, no comm (F&B pairs hide only comm), w <= b <= f <= b+w (DeepSeek: PP=2D)",
        activations="D+1/2 M_a",
        weights="M_theta",
        chunks=2,
        placement=PlacementKind.V_SHAPE,
        splits_backward=True,
        data_parallel=DataParallel.SYNCHRONOUS,
        ties=True,
    ),
    # Asynchronous streams (no flush): options num_steps (mini-batches, default 4) and
    # each family's hyperparameters; "~0" is the steady-state bubble at f = b = w.
    "pipedream": ScheduleInfo(
        name="pipedream",
        generator=pipedream,
        family="PipeDream (weight stashing; vertical_sync)",
        synchronous=False,
        bubble="~0 (steady state)",
        activations="D-r M_a on rank r",
        weights="D-r M_theta on rank r (stash); D M_theta with vertical sync",
        chunks=1,
        placement=PlacementKind.STRAIGHT,
        splits_backward=False,
        data_parallel=DataParallel.ASYNCHRONOUS,
        ties=True,
    ),
    "pipedream-2bw": ScheduleInfo(
        name="pipedream-2bw",
        generator=pipedream_2bw,
        family="PipeDream-2BW",
        synchronous=False,
        bubble="~0 (steady state)",
        activations="D-r M_a on rank r",
        weights="2 M_theta (T >= D)",
        chunks=1,
        placement=PlacementKind.STRAIGHT,
        splits_backward=False,
        data_parallel=DataParallel.ASYNCHRONOUS,
        ties=True,
    ),
    "pipemare": ScheduleInfo(
        name="pipemare",
        generator=pipemare,
        family="PipeMare",
        synchronous=False,
        bubble="~0 (steady state; warmup_steps are flushed)",
        activations="D-r M_a on rank r",
        weights="M_theta + velocity M_theta",
        chunks=1,
        placement=PlacementKind.STRAIGHT,
        splits_backward=False,
        data_parallel=DataParallel.NONE,
        ties=False,
    ),
    "spectrain": ScheduleInfo(
        name="spectrain",
        generator=spectrain,
        family="SpecTrain",
        synchronous=False,
        bubble="~0 (steady state)",
        activations="D-r M_a on rank r",
        weights="M_theta + prediction M_theta",
        chunks=1,
        placement=PlacementKind.STRAIGHT,
        splits_backward=False,
        data_parallel=DataParallel.NONE,
        ties=False,
        defaults=(("momentum", 0.9),),
    ),
    "xpipe": ScheduleInfo(
        name="xpipe",
        generator=xpipe,
        family="XPipe",
        synchronous=False,
        bubble="~0 (steady state)",
        activations="D-r M_a on rank r",
        weights="M_theta + cached predictions (<= 2 M_theta)",
        chunks=1,
        placement=PlacementKind.STRAIGHT,
        splits_backward=False,
        data_parallel=DataParallel.NONE,
        ties=False,
        defaults=(("momentum", 0.9),),
    ),
    "ampnet": ScheduleInfo(
        name="ampnet",
        generator=ampnet,
        family="AMPNet",
        synchronous=False,
        bubble="~0 (steady state, max_active_keys >= D)",
        activations="D-r M_a on rank r",
        weights="M_theta",
        chunks=1,
        placement=PlacementKind.STRAIGHT,
        splits_backward=False,
        data_parallel=DataParallel.NONE,
        ties=True,
    ),
    "wpipe": ScheduleInfo(
        name="wpipe",
        generator=wpipe,
        family="WPipe (double-grouped weight updates)",
        synchronous=False,
        bubble="0 in steady state (2GW order, T >= D, f = 1, B = 2)",
        activations="see simulate",
        weights="<= 2 M_theta",
        chunks=2,
        placement=PlacementKind.LOOPED,
        splits_backward=False,
        data_parallel=DataParallel.NONE,
        ties=False,
    ),
    "avgpipe": ScheduleInfo(
        name="avgpipe",
        generator=avgpipe,
        family="AvgPipe (elastic averaging)",
        synchronous=False,
        bubble="~0 (steady state)",
        activations="[1, D] P M_a",
        weights="P M_theta",
        chunks=1,
        placement=PlacementKind.REPLICATED,
        splits_backward=False,
        data_parallel=DataParallel.NONE,
        ties=False,
    ),
    "zb-auto": ScheduleInfo(
        name="zb-auto",
        generator=_zb_auto,
        family="zero bubble, automatic (ZB-1p/ZB-2p)",
        synchronous=True,
        bubble="searched; ZB-H1's (D-1)(f+b-w) or less at activation_limit=1",
        activations="<= K D M_a",
        weights="M_theta",
        chunks=1,
        placement=PlacementKind.STRAIGHT,
        splits_backward=True,
        data_parallel=DataParallel.SYNCHRONOUS,
        ties=True,
        searched=True,
    ),
    "zb-v-auto": ScheduleInfo(
        name="zb-v-auto",
        generator=_zb_v_auto,
        family="zero bubble, automatic, V placement",
        synchronous=True,
        bubble="searched; 0 at f = b = w, no comm, activation_limit=1",
        activations="<= K D M_a",
        weights="M_theta",
        chunks=2,
        placement=PlacementKind.V_SHAPE,
        splits_backward=True,
        data_parallel=DataParallel.SYNCHRONOUS,
        ties=True,
        searched=True,
    ),
}
"""Every schedule pipeweave knows, by the name ``-s`` takes: its generator, its paper's closed forms and what it
supports (``ScheduleInfo``). ``pipeweave schedules`` prints it."""


def schedule_defaults(name: str) -> dict[str, float]:
    """The run options whose default schedule ``name`` sets (``ScheduleInfo.defaults``); none for a name the
    registry does not hold (a schedule read from a file).

    Example:
        >>> schedule_defaults("spectrain"), schedule_defaults("1f1b")
        ({'momentum': 0.9}, {})
    """
    info = SCHEDULES.get(name)
    return {} if info is None else dict(info.defaults)


def tied_streams() -> list[str]:
    """The asynchronous schedules that train a tie between a pipeline's first and last stage
    (``ScheduleInfo.ties``; ``runtime.stage.tied_stream``'s rule), in reverse name order: pipedream-2bw,
    the asynchronous schedule people use, first.

    Example:
        >>> tied_streams()
        ['pipedream-2bw', 'pipedream', 'ampnet']
    """
    return sorted((n for n, info in SCHEDULES.items() if info.ties and not info.synchronous), reverse=True)


def generate(
    name: str,
    *,
    num_stages: int,
    num_microbatches: int,
    num_chunks: int | None = None,
    **options: object,
) -> Schedule:
    """Build the named schedule.

    Args:
        name: a registry key (``pipeweave schedules`` lists them).
        num_stages: D, the pipeline depth in ranks (devices).
        num_microbatches: T, microbatches per mini-batch.
        num_chunks: v, chunks per rank, for schedules that take it.
        options: family-specific options (see each generator).

    Raises:
        ScheduleError: unknown name, or a configuration the family cannot serve.

    Example:
        >>> generate("gpipe", num_stages=4, num_microbatches=8).num_ranks
        4
    """
    info = SCHEDULES.get(name)
    if info is None:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of: {', '.join(SCHEDULES)}")
    params = inspect.signature(info.generator).parameters
    kwargs = dict(options)
    if num_chunks is not None and num_chunks != (info.chunks or num_chunks):
        raise ScheduleError(f"{name} uses {info.chunks} chunk(s) per rank, not --chunks {num_chunks}; drop --chunks")
    if "num_chunks" in params and num_chunks is not None:
        kwargs["num_chunks"] = num_chunks
    unknown = [k for k in kwargs if k not in params]
    if unknown:
        raise ScheduleError(f"{name} takes no option {unknown[0]!r}; its options: {list(params)[2:]}")
    return info.generator(num_stages, num_microbatches, **kwargs)
