"""``pipeweave``: the command line. Thin: each subcommand lives in ``pipeweave.commands``.

A subcommand module defines ``add_parser(subparsers) -> argparse.ArgumentParser``
and ``run(args) -> int``. User errors (``UserError``) print one line and exit 2; Ctrl-C
one line and exit 130; output into a closed pipe (``pipeweave schedules --json | head -c 10``) ends the
command quietly with 141, the status a shell gives a command SIGPIPE ended (as ``cat`` in ``cat FILE | head``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Sequence

from pipeweave import __version__
from pipeweave.errors import OutputNotWritten, UserError

# Subcommands in the order ``pipeweave --help`` lists them.
COMMANDS = ("schedules", "simulate", "partition", "train", "search", "plan", "compare", "export")
CLOSED_PIPE = 128 + 13
"""The exit status of a command whose output went into a closed pipe: 128 + SIGPIPE, as the shell reports
``cat``'s in ``cat FILE | head`` (``set -o pipefail`` scripts expect it of a producer ``head`` stopped)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipeweave", description="Pipeline-parallel schedules: simulate, search, partition, train."
    )
    parser.add_argument("--version", action="version", version=f"pipeweave {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"pipeweave.commands.{name}")
        module.add_parser(sub).set_defaults(run=module.run)
    return parser


def _negative_value(word: str) -> bool:
    """``-1,5``, ``-inf``, ``-1e5``: a negative number or a list starting with one, which argparse takes for an option."""
    if not word.startswith("-") or word.startswith("--"):
        return False
    if "," in word:
        return word[1:2].isdigit() or word[1:2] == "." or word[1:4].lower() in ("inf", "nan")
    try:
        float(word)
    except ValueError:
        return False
    return True


def _attach_negative_values(argv: Sequence[str]) -> list[str]:
    """``["--layers-per-stage", "-1,5"]`` -> ``["--layers-per-stage=-1,5"]``, so the command can refuse the value.

    argparse reads "-1" as a value but "-1,5", "-inf" or "-1e5" as an unknown option, and
    answers "expected one argument"; no option's name is such a number, so the word is the
    value of the long option before it.
    """
    out: list[str] = []
    for word in argv:
        if out and _negative_value(word) and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={word}"
        else:
            out.append(word)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``pipeweave ARGV``; the exit code. Ctrl-C is one line and exit code 130 wherever it lands,
    in the subcommands' imports (numpy, torch: seconds) as in their work. Output into a closed pipe ends
    it quietly (``CLOSED_PIPE``)."""
    try:
        return _main(argv)
    except BrokenPipeError:  # the reader is gone (head): nothing more to say, to it or on stderr
        # the recipe of Python's signal docs: stdout onto devnull, so the flush at exit cannot fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return CLOSED_PIPE
    except SystemExit as exc:  # rich's tables take the same recipe, then exit 1: the same status as the rest
        if isinstance(exc.__context__, BrokenPipeError):
            return CLOSED_PIPE
        raise


def _main(argv: Sequence[str] | None) -> int:
    name = "pipeweave"
    try:
        started = time.process_time()  # a command's CPU budget counts from here (plan --time-limit)
        parser = build_parser()
        args = parser.parse_args(_attach_negative_values(sys.argv[1:] if argv is None else argv))
        args.cpu_started = started
        if not hasattr(args, "run"):
            parser.print_help()
            return 2
        name = f"pipeweave {args.command}"
        code = int(args.run(args))
        sys.stdout.flush()  # here, where a closed pipe is caught, rather than at exit
        return code
    except UserError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return OutputNotWritten.EXIT_CODE if isinstance(exc, OutputNotWritten) else 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
