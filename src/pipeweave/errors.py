"""pipeweave's exceptions: ``UserError``, the one the command line reports as a one-line user error,
``StuckError``, a schedule that stopped progressing, shown with its grid, and ``Diverged``, a run stopped
because its loss, gradient norm or weights stopped being finite, and ``RanksDisagree``, ranks that chose
different splits of the model."""


class UserError(ValueError):
    """Bad input from the user: the message names the value and the fix."""


class OutputNotWritten(UserError):
    """The work is done but one of its output files could not be written (a full disk, a folder made read-only).

    The command line reports it as a ``UserError`` (one line naming the file and the operating system's reason)
    with exit code 3 (``EXIT_CODE``), the code ``pipeweave train`` gives a run trained without all its outputs.
    """

    EXIT_CODE = 3


class StuckError(RuntimeError):
    """A schedule stopped progressing (a deadlock, or a peer that never sent).

    ``str()`` is the cause on its first line, then ``grid``: the schedule's
    action lists with the stuck step of each rank in brackets
    (``pipeweave.schedule.grid.format_rows``).
    """

    def __init__(self, cause: str, grid: str) -> None:
        super().__init__(f"{cause}\n{grid}")
        self.cause, self.grid = cause, grid


class Diverged(RuntimeError):
    """Training diverged: a non-finite loss, gradient norm or weights (``runtime.run.divergence``).

    Every rank of the run raises it at the same step (the ranks agree on it),
    and the launcher prints its message as is: one line naming the step and
    the fix, no traceback, exit code 1.
    """


class RanksDisagree(UserError):
    """The ranks of a run chose different splits of the model (``runtime.run.agreement``).

    Every rank raises it at the same point, before any stage is built, and
    the launcher prints its message as is, as for ``Diverged``: one line
    naming both splits and the fix.
    """


BYTES_AT_LEAST = 1024.0
"""The least ``--memory-limit`` taken as bytes per rank: below it, a value can only be the activation multiple K
that ``--memory-limit`` once meant for the searched schedules (1: ZB-1p's, 2: ZB-2p's)."""


def renamed_activation_limit(value: float, keyword: bool = False) -> UserError:
    """The one line for K given under its former name, ``--memory-limit`` (or ``memory_limit=`` with ``keyword``).

    Example:
        >>> str(renamed_activation_limit(2.0))
        '--memory-limit 2 is bytes per rank now; the activation multiple K is --activation-limit 2'
        >>> str(renamed_activation_limit(2.0, keyword=True))
        'memory_limit=2 is bytes per rank now; the activation multiple K is activation_limit=2'
    """
    if keyword:
        return UserError(
            f"memory_limit={value:g} is bytes per rank now; the activation multiple K is activation_limit={value:g}"
        )
    return UserError(
        f"--memory-limit {value:g} is bytes per rank now; the activation multiple K is --activation-limit {value:g}"
    )
