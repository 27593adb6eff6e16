"""``pipeweave train --schedule-file FILE``: a schedule written by hand, read, validated and sized for the run.

The file is torch.distributed.pipelining's compute-only CSV or pipeweave's
text form (``schedule.text``: the grid ``simulate`` and the validator print).
Its schedule is validated (``schedule.validate``: exactly-once, order, deadlock
freedom) before anything is built or spawned; a bad one is one line and the
schedule's grid with the stuck step in brackets. ``--stages`` and
``--microbatches`` come from the file: given too, they must agree with it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeweave.errors import UserError
from pipeweave.schedule import InvalidSchedule, Schedule, read_csv, validate
from pipeweave.schedule.dataflow import execute
from pipeweave.schedule.grid import format_rows


def add_schedule_file_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--schedule-file",
        metavar="FILE",
        help="train a schedule written by hand: torch.distributed.pipelining's CSV (one row of "
        "actions such as 0F1 per rank) or pipeweave's text form; validated first; --stages "
        "and --microbatches come from it",
    )


def schedule_from_file(args: argparse.Namespace) -> Schedule | None:
    """The validated schedule of ``--schedule-file`` (None without the flag).

    Raises:
        UserError: no such file, an unreadable or invalid schedule (the validator's reason and the grid),
            or ``-s`` given too.

    Example:
        >>> args = argparse.Namespace(schedule_file=None, schedule=None)
        >>> schedule_from_file(args) is None
        True
    """
    if args.schedule_file is None:
        return None
    if args.schedule is not None:
        raise UserError(
            f"-s {args.schedule} and --schedule-file {args.schedule_file} both name the schedule; give one of them"
        )
    path = Path(args.schedule_file)
    if not path.is_file():
        raise UserError(f"--schedule-file {args.schedule_file!r} is not a file; give the path of a CSV schedule")
    schedule = read_csv(path, name=args.schedule_file)
    try:
        validate(schedule)
    except InvalidSchedule as exc:
        raise UserError(
            f"--schedule-file {args.schedule_file} is invalid: {exc.reason}"
            f"{_where(exc)}; fix the file\n{_grid(schedule, exc)}"
        ) from None
    return schedule


def _where(exc: InvalidSchedule) -> str:
    if exc.reason.startswith("deadlock"):
        return " (each rank's stuck step in brackets below)"
    return f" (rank {exc.rank} step {exc.step}, in brackets below)" if exc.rank >= 0 and exc.step >= 0 else ""


def _grid(schedule: Schedule, exc: InvalidSchedule) -> str:
    """The schedule's grid: a deadlock's every stuck step bracketed, else the step ``InvalidSchedule`` names."""
    if exc.reason.startswith("deadlock"):
        run = execute(schedule)
        return format_rows(schedule.actions, [(rank, run.done[rank]) for rank in run.waiting_for])
    return str(exc).split("\n", 1)[1]
