"""A testing aid: communication made slower by a fixed delay that a schedule can hide (``--comm-delay-ms``).

``delayed(work, seconds)`` wraps the work of a posted message (or of any
collective posted with ``async_op=True``) so that it completes ``seconds``
after the transfer it wraps has completed -- as a link ``seconds`` slower
would. The transfer itself starts when gloo starts it, once both ends have
posted it (gloo moves a message only to a posted receive), so the delay runs
from there, beside whatever the rank computes meanwhile: a rank that waits
only when it needs the data loses ``seconds`` minus what it computed since
the message could move, not ``seconds``. This is what lets a run measure how
much communication a schedule hides (docs/guide/dualpipe.md, "F&B overlap";
benchmarks/moe/overlap.py).

Every point-to-point message of ``transport.p2p`` is wrapped when the run's
``RankContext.comm_delay`` is above 0. A collective that should be delayed
alike -- an expert all-to-all, say -- is wrapped at its call site::

    work = dist.all_to_all_single(out, inp, async_op=True)
    work = context.delayed(work)  # RankContext.delayed: this function with the run's delay
    ...                            # compute that does not need ``out``
    work.wait()

A watcher thread per work waits for the transfer (the rank's thread never
sleeps until it waits, and then only for what is left of the delay).
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any


class DelayedWork:
    """``work``, completing ``seconds`` after it has (module docstring).

    Args:
        work: a posted message's or collective's work (``wait(timeout)``, ``is_completed()``).
        seconds: the delay, > 0.
        timeout: how long the watcher waits for ``work`` (the run's peer timeout; None: the backend's own).

    Example:
        >>> class Done:
        ...     def wait(self, timeout=None): return True
        ...     def is_completed(self): return True
        >>> w = DelayedWork(Done(), 0.05); w.is_completed()
        False
        >>> t = time.monotonic(); w.wait(); time.monotonic() - t > 0.03, w.is_completed()
        (True, True)
    """

    def __init__(self, work: Any, seconds: float, timeout: datetime.timedelta | None = None) -> None:
        self.work, self.seconds, self.timeout = work, seconds, timeout
        self._done = threading.Event()
        self._at = 0.0  # when the transfer completed (time.monotonic)
        self._error: BaseException | None = None
        threading.Thread(target=self._watch, name="pipeweave-comm-delay", daemon=True).start()

    def _watch(self) -> None:
        try:
            self.work.wait() if self.timeout is None else self.work.wait(self.timeout)
        except BaseException as exc:  # noqa: BLE001 - handed to the rank's thread at its wait
            self._error = exc
        self._at = time.monotonic()
        self._done.set()

    def is_completed(self) -> bool:
        """True once the transfer has completed and the delay has passed since."""
        return self._done.is_set() and time.monotonic() >= self._at + self.seconds

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Wait for the transfer, then for what is left of the delay.

        Raises:
            RuntimeError: the transfer did not complete within ``timeout``.
            Exception: what the transfer's own wait raised.
        """
        if not self._done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError(f"a delayed message did not arrive within {timeout}")
        if self._error is not None:
            raise self._error
        left = self._at + self.seconds - time.monotonic()
        if left > 0:
            time.sleep(left)
        return True


def delayed(work: Any, seconds: float, timeout: datetime.timedelta | None = None) -> Any:
    """``work`` delayed by ``seconds`` (``DelayedWork``); ``work`` itself when ``seconds`` is 0 or it is None."""
    if work is None or seconds <= 0:
        return work
    return DelayedWork(work, seconds, timeout)
