"""Branch and bound over the planner's space: the best configurations, exactly, after simulating few.

Configurations whose memory bound (``planner.bound``) exceeds the GPU cannot fit
and are dropped. The rest are taken in the order of their time bound and
simulated (``planner.evaluate``), until the next bound is no better than the
``top``-th best step found among those that fit: none of the remaining ones
can enter the top, since a simulation is never below its bound. Before a
configuration is simulated, a simulation of its shape under other times may
raise its bound (its critical path: ``planner.critical``); it then waits its turn again. The answer is
the one an exhaustive search would give for those ``top``. With a ``time_limit``, the search stops once it
has run that long and found a configuration that fits: the configurations left unsimulated are counted, with
the least step time any of them could reach (the next bound), so the answer says how far from exact it may be.
"""

from __future__ import annotations

import gc
import heapq
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pipeweave.planner.bound import memory_bound, time_bound
from pipeweave.planner.candidate import Config
from pipeweave.planner.evaluate import Evaluator, Result

Progress = Callable[[int, int], None]
"""``progress(done, total)``: configurations settled so far (simulated or pruned), of all."""


@dataclass
class Plan:
    """What the search found and how much of the space it looked at."""

    results: list[Result]
    """Every configuration looked at, those that fit first by step time, then those that do not (by memory;
    simulated only with ``exhaustive``)."""
    candidates: int
    """Configurations in the space."""
    too_big: int
    """Dropped by the memory bound."""
    bounded: int
    """Skipped: their time bound could not beat the ``top``-th best."""
    refused: int
    """Shapes the schedule family cannot serve (e.g. interleaving with T not a multiple of D)."""
    simulations: int
    seconds: float
    least_memory: tuple[float, str] = (0.0, "")
    """The least memory a configuration needs (simulated, or its bound when none was) and its label."""
    auto_skipped: int = 0
    """zb-auto configurations left out once the searches allowed were spent."""
    unsettled: int = 0
    """Configurations neither simulated nor ruled out when the time limit stopped the search (0: exact)."""
    unsettled_bound: float = 0.0
    """The least step time any of the ``unsettled`` could reach (their least time bound)."""

    @property
    def best(self) -> list[Result]:
        return [r for r in self.results if r.fits]


AUTO_CELLS = 4096
"""The largest zb-auto search the planner runs, in (stage, microbatch) cells D x v x T: its list scheduling
grows with them (T = 2000 on D = 8 takes seconds per search), while zb-h1/zb-h2, evaluated beside it, come
within a bubble of (D - 1) / T of it there."""


def search(
    space: Iterable[Config],
    evaluator: Evaluator,
    *,
    top: int = 10,
    exhaustive: bool = False,
    auto_searches: int = 8,
    tolerance: float = 0.0,
    progress: Progress | None = None,
    time_limit: float | None = None,
) -> Plan:
    """The best ``top`` configurations of ``space`` (module docstring); ``exhaustive`` simulates every one that
    may fit (for ``--plot`` over the whole space); at most ``auto_searches`` zb-auto searches (about a second
    each, more at large D), the most promising first, none over ``AUTO_CELLS``: the others are skipped, and
    counted. With a
    ``tolerance`` t, a configuration is skipped once its bound is within t of the ``top``-th best: one
    skipped could beat that one by less than t x its step (0: the exact top). ``time_limit``: seconds after
    which the search stops once something fits, in CPU seconds of this process (module docstring; None: never)."""
    started = time.perf_counter()
    collecting = gc.isenabled()
    gc.disable()  # millions of short-lived event tuples, no cycles: the collector would only walk them
    try:
        # CPU seconds, not the wall clock's: the same answer on a loaded machine as on an idle one
        deadline = math.inf if time_limit is None else time.process_time() + time_limit
        return _search(list(space), evaluator, top, exhaustive, auto_searches, tolerance, progress, (started, deadline))
    finally:
        if collecting:
            gc.enable()


def _search(
    configs: list[Config],
    evaluator: Evaluator,
    top: int,
    exhaustive: bool,
    auto_searches: int,
    tolerance: float,
    progress: Progress | None,
    clock: tuple[float, float],
) -> Plan:
    """``search``'s loop (with the collector paused); ``clock``: when it started, when it must stop."""
    started, deadline = clock
    bounds, fitting, queue = _candidates(configs, evaluator)
    done = len(configs) - len(fitting)
    best: list[float] = []  # a max-heap (negated) of the top step times that fit
    results: list[Result] = []
    refused = bounded = skipped = 0
    while queue and not (best and time.process_time() > deadline):
        bound, k, rescaled = heapq.heappop(queue)
        if not exhaustive and len(best) >= top and bound * (1 + tolerance) >= -best[0]:
            bounded = len(queue) + 1
            break
        config = fitting[k]
        times = evaluator.times(config, evaluator.num_parts(config))
        if config.searched and not evaluator.pipeline.has_schedule(config, evaluator.auto_options(config, times)):
            if auto_searches <= 0 or config.pp * config.chunks * config.microbatches > AUTO_CELLS:
                skipped += 1
                continue
            auto_searches -= 1
        if not rescaled:  # a simulation of the same shape may tighten the bound: look again in its new place
            scaled = evaluator.pipeline.path_bound(config, times)
            if scaled > bound:
                heapq.heappush(queue, (scaled, k, True))
                continue
        result = evaluator.evaluate(fitting[k], time_unfit=exhaustive)
        done += 1
        if progress is not None and (done % 16 == 0 or done == len(configs)):
            progress(done, len(configs))
        if result is None:
            refused += 1
            continue
        results.append(result)
        if result.fits:
            _keep_best(best, result.step_time, top)
    if progress is not None:
        progress(len(configs), len(configs))
    results.sort(key=lambda r: (not r.fits, r.step_time if r.fits else r.memory.total))
    least = _least_memory(results, configs, bounds)
    return Plan(
        results,
        len(configs),
        len(configs) - len(fitting),
        bounded,
        refused,
        evaluator.pipeline.simulations,
        time.perf_counter() - started,
        least,
        skipped,
        0 if bounded else len(queue),  # left by the time limit: the other ends empty the queue or bound it
        queue[0][0] if queue and not bounded else 0.0,
    )


def _candidates(
    configs: list[Config], evaluator: Evaluator
) -> tuple[list[float], list[Config], list[tuple[float, int, bool]]]:
    """Each configuration's memory bound, those whose bound fits the GPU, and a heap of the latter by time bound:
    ``(time bound, index in the fitting ones, rescaled)``."""
    limit = evaluator.cluster.gpu.memory_bytes
    bounds = [memory_bound(c, evaluator) for c in configs]
    fitting = [c for c, m in zip(configs, bounds) if m <= limit]
    queue = [(time_bound(c, evaluator), k, False) for k, c in enumerate(fitting)]
    heapq.heapify(queue)
    return bounds, fitting, queue


def _keep_best(best: list[float], step_time: float, top: int) -> None:
    """Add ``step_time`` to ``best``, a max-heap (negated) of the ``top`` least step times."""
    heapq.heappush(best, -step_time)
    if len(best) > top:
        heapq.heappop(best)


def _least_memory(results: list[Result], configs: list[Config], bounds: list[float]) -> tuple[float, str]:
    """The least memory a result needs, with its label; without results, the least bound of a configuration."""
    least = min(((r.memory.total, r.config.label) for r in results), default=None)
    if least is None:
        least = min(((m, c.label) for m, c in zip(bounds, configs)), default=(0.0, ""))
    return least
