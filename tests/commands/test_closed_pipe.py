"""A command whose output goes into a closed pipe (``pipeweave schedules --json | head -c 10``) ends quietly.

Before, it ended in a ``BrokenPipeError`` traceback on stderr (and exit 1). Now it exits with 141,
as a shell reports ``cat`` stopped by ``head``, and says nothing (rich's tables exited 1).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeweave.cli import CLOSED_PIPE

SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.mark.parametrize(
    "argv",
    [["schedules", "--json"], ["schedules"], ["simulate", "-s", "1f1b", "--stages", "4", "--microbatches", "8"]],
)  # print, a rich table, and text after a rich table
def test_output_into_a_closed_pipe_ends_quietly_with_the_status_of_sigpipe(argv: list[str]) -> None:
    read, write = os.pipe()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    command = subprocess.Popen(
        [sys.executable, "-m", "pipeweave.cli", *argv], stdout=write, stderr=subprocess.PIPE, env=env
    )
    os.close(write)
    os.close(read)  # the reader is gone before the command writes (it is still importing): every write fails
    _, err = command.communicate(timeout=60)
    assert (command.returncode, err.decode()) == (CLOSED_PIPE, "")
