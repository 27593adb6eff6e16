"""When each action of a step ran, and what memory the step took: one timer per rank, chosen by its device.

The executor marks every action's start and end with ``timer.mark()`` and
turns a step's marks into ``perf_counter_ns`` times once the step is over
(``timer.resolve``): never a synchronisation inside the step.

- ``HostTimer`` (CPU ranks): a mark is the host clock itself; the actions run
  on the host, so it measures them.
- ``CudaEventTimer`` (CUDA ranks): the host clock would measure kernel
  launches, not kernels. A mark is a CUDA event recorded on the stream that
  runs the action (the current stream unless given) beside the host time of
  its recording. ``resolve`` synchronises the device once, reads the host
  clock ``t_sync`` and places every event at ``t_sync - elapsed(event, last
  event)``: an upper bound, as the last event completed at ``t_sync`` or
  before. An event cannot run before it was recorded, so every time is then
  moved earlier by the largest amount that keeps each event at or after its
  recording on the host (``delta = min(event time - host time)``, when
  positive): exact when the GPU was idle at one mark of the step, as it is
  where a rank waits for a message. Peak allocated and reserved bytes of the
  step come from the CUDA caching allocator (its peaks are reset when a step
  begins).

``action_timer(device)`` picks the timer; the executor, the trace, the
measured bubble and the timeline all read the times it resolves.

Example:
    >>> timer = action_timer(torch.device("cpu"))
    >>> timer.begin_step()
    >>> marks = [timer.mark(), timer.mark()]
    >>> start, end = timer.resolve(marks)
    >>> start <= end, timer.step_memory()
    (True, None)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch


class HostTimer:
    """The host clock (``perf_counter_ns``): what the actions of CPU ranks take."""

    def begin_step(self) -> None:
        """Nothing to reset on the host."""

    def mark(self, stream: Any = None) -> int:
        """Now, in ``perf_counter_ns``."""
        return time.perf_counter_ns()

    def resolve(self, marks: Sequence[Any]) -> list[int]:
        """The marks are times already."""
        return list(marks)

    def step_memory(self) -> tuple[int, int] | None:
        """None: the CPU allocator keeps no statistics (``stage.tensor_bytes`` measures tensors instead)."""
        return None


class CudaEventTimer:
    """CUDA events on the stream that runs each action, resolved to ``perf_counter_ns`` once per step.

    Args:
        device: the rank's CUDA device.
        event: what makes an event (``torch.cuda.Event``; a test gives a fake one).
        synchronize: waits for every stream of the device (``torch.cuda.synchronize``).
        memory: the allocator's ``(reset_peaks, peak_allocated, peak_reserved)`` functions, None: torch.cuda's.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        event: Callable[..., Any] | None = None,
        synchronize: Callable[[], None] | None = None,
        memory: tuple[Callable[[], None], Callable[[], int], Callable[[], int]] | None = None,
    ) -> None:
        self.device = device
        self._event = event or torch.cuda.Event
        self._synchronize = synchronize or (lambda: torch.cuda.synchronize(device))
        self._memory = memory or (
            lambda: torch.cuda.reset_peak_memory_stats(device),
            lambda: int(torch.cuda.max_memory_allocated(device)),
            lambda: int(torch.cuda.max_memory_reserved(device)),
        )

    def begin_step(self) -> None:
        """Reset the allocator's peaks: ``step_memory`` then reads this step's."""
        self._memory[0]()

    def mark(self, stream: Any = None) -> tuple[Any, int]:
        """An event recorded now on ``stream`` (None: the current stream), and the host time of its recording."""
        event = self._event(enable_timing=True)
        if stream is None:
            event.record()
        else:
            event.record(stream)
        return event, time.perf_counter_ns()

    def resolve(self, marks: Sequence[tuple[Any, int]]) -> list[int]:
        """Every mark's time on the host clock (module docstring); one device synchronisation."""
        if not marks:
            return []
        self._synchronize()
        t_sync = time.perf_counter_ns()
        last = marks[-1][0]
        upper = [t_sync - int(round(event.elapsed_time(last) * 1e6)) for event, _ in marks]  # ms to ns
        delta = max(0, min(t - host for t, (_, host) in zip(upper, marks)))
        return [t - delta for t in upper]

    def step_memory(self) -> tuple[int, int] | None:
        """The step's peak allocated and reserved bytes (the CUDA caching allocator's)."""
        return self._memory[1](), self._memory[2]()


Timer = HostTimer | CudaEventTimer


def action_timer(device: torch.device) -> Timer:
    """The timer of a rank on ``device``: CUDA events on a GPU, the host clock elsewhere."""
    return CudaEventTimer(device) if device.type == "cuda" else HostTimer()
