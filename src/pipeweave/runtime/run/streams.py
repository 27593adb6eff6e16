"""An asynchronous run's streams: where it drains, and each stream's schedule.

An asynchronous schedule runs as one stream of mini-batches; ``--eval-every``
and ``--save-every`` cut it into several, drained between (``segments``), each
generated for its own steps (``stream_schedules``) with the generator options
of the mini-batches it holds (``segment_options``: PipeMare's warm-up counts
the training's first ones).
"""

from __future__ import annotations

from typing import Any

from pipeweave.config import TrainConfig
from pipeweave.errors import UserError
from pipeweave.runtime.run.sizes import check_sizes
from pipeweave.runtime.stream import pipelines_per_round, stream_steps
from pipeweave.schedule import Schedule, generate


def segments(config: TrainConfig) -> list[tuple[int, int]]:
    """An asynchronous run's streams, as ``(first step of this run, steps)``.

    The run drains its stream after every ``eval_every``-th and
    ``save_every``-th step (of this run, as synchronous runs count them);
    without them the run is one stream. A drain is a flush: the segments'
    staleness starts over (``runtime.stream``).

    Example:
        >>> segments(TrainConfig(schedule="pipedream", steps=7, eval_every=3))
        [(0, 3), (3, 3), (6, 1)]
    """
    cuts = {config.training.steps}
    for flag, every in (("--eval-every", config.data.eval_every), ("--save-every", config.checkpoint.save_every)):
        if every is not None and every < config.training.steps:
            check_segment_steps(config, flag, every)
            cuts.update(range(every, config.training.steps, every))
    bounds = [0, *sorted(cuts)]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:])]


def stream_schedules(config: TrainConfig, steps_done: int = 0) -> list[Schedule]:
    """An asynchronous run's streams, one per ``segments`` entry, each generated for its steps (sizes checked first)."""
    check_sizes(config)
    return [
        generate(
            config.schedule.name,
            num_stages=config.schedule.num_stages,
            num_microbatches=config.schedule.num_microbatches,
            num_chunks=config.schedule.num_chunks,
            **segment_options(config, steps_done + first, steps),
        )
        for first, steps in segments(config)
    ]


def check_segment_steps(config: TrainConfig, flag: str, every: int) -> None:
    """Refuse a drain inside an AvgPipe round: every stream is whole rounds of P mini-batches."""
    p = pipelines_per_round(config.schedule.name, dict(config.schedule.options))
    if every % p:
        raise UserError(
            f"{flag} {every} is not a multiple of avgpipe's P={p} pipelines (each stream between two "
            f"drains is whole rounds); give {flag} {every - every % p + p}"
        )


def segment_options(config: TrainConfig, first: int, steps: int) -> dict[str, Any]:
    """The generator options of the stream of the training's mini-batches ``first`` to ``first + steps - 1``.

    PipeMare's ``warmup_steps`` are the training's first mini-batches: a
    stream gets those of them it holds, so a run shorter than the warm-up is
    all warm-up and a later stream (after a drain, or resumed) gets what is left.

    Example:
        >>> c = TrainConfig(schedule="pipemare", schedule_options=(("warmup_steps", 3),))
        >>> segment_options(c, 2, 4), segment_options(c, 0, 2)["warmup_steps"]
        ({'warmup_steps': 1, 'num_steps': 4}, 2)
    """
    options = dict(config.schedule.options)
    warmup = options.get("warmup_steps")
    if isinstance(warmup, int) and not isinstance(warmup, bool) and warmup >= 0:
        options["warmup_steps"] = min(max(0, warmup - first), steps)
    options["num_steps"] = stream_steps(config.schedule.name, steps, options)
    return options
