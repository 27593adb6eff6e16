"""Side outputs: the files a run writes beside its training, and the one policy for a write of them that fails.

A training run's side outputs are its TensorBoard log (``--log-dir``), its
checkpoints (``--save``) and, at its end, its JSON record, Chrome trace and
timeline plot (``--out``, ``--json``, ``--trace``, ``--plot``). None of them
may stop the training or take another output with it. A write that fails --
a full disk, a folder made read-only or removed -- is said once, in one line
naming the file and the operating system's reason; that output is given up
(a log stops, a checkpoint is dropped and the next one is tried), the run
goes on, the other outputs are written, and the command exits with
``OUTPUT_FAILED`` when something the run should have left is missing or
incomplete. ``SideOutput`` is that policy for one output; every writer of a
side output goes through it or says its failure with ``cannot_write``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

from pipeweave.durable import reason
from pipeweave.errors import OutputNotWritten

OUTPUT_FAILED = OutputNotWritten.EXIT_CODE
"""The exit code of a run that trained but could not write an output: a checkpoint, its record, trace, plot or log
(0: all written; 1: the run failed; 2: a usage error, nothing run)."""

T = TypeVar("T")


def cannot_write(path: str | os.PathLike[str], exc: OSError) -> str:
    """The one line of a failed write of ``path``: ``cannot write PATH: REASON`` (the operating system's words).

    Example:
        >>> cannot_write("out/train.json", OSError(28, "No space left on device"))
        'cannot write out/train.json: No space left on device'
    """
    return f"cannot write {path}: {reason(exc)}"


class SideOutput:
    """One side output: its writes go through ``attempt``; the first that fails is kept (``failure``) and said
    once, and every later write of that output is skipped.

    Args:
        path: the file or folder it writes, which the line names (a writer may set it to the file it opened).
        say: what receives the line when a write fails (None: the caller says ``failure`` itself).

    Example:
        >>> said = []
        >>> log = SideOutput("tb", said.append)
        >>> def full():
        ...     raise OSError(28, "No space left on device")
        >>> log.attempt(full), log.attempt(lambda: 1), said
        (None, None, ['cannot write tb: No space left on device'])
    """

    def __init__(self, path: str | os.PathLike[str], say: Callable[[str], None] | None = None) -> None:
        self.path, self.say = path, say
        self.failure: str | None = None

    def attempt(self, write: Callable[[], T]) -> T | None:
        """``write()``'s result; None where it failed with an ``OSError``, now or at an earlier write."""
        if self.failure is not None:
            return None
        try:
            return write()
        except OSError as exc:
            self.failure = cannot_write(self.path, exc)
            if self.say is not None:
                self.say(self.failure)
            return None
