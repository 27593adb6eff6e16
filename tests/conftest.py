"""Fixtures shared by the tests: the command-line error of a run, the ruff of this environment."""

from __future__ import annotations

import contextlib
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from unittest.mock import patch

import pytest

from pipeweave.cli import main

CliError = Callable[..., str]


@pytest.fixture
def cli_error(capsys: pytest.CaptureFixture[str]) -> CliError:
    """``cli_error(argv, *never)``: the error of ``pipeweave ARGV``, checked to be exit 2, one line, no traceback,
    with each function named in ``never`` (a dotted path) patched to fail the test if the command reached it."""

    def run(argv: list[str], *never: str) -> str:
        with contextlib.ExitStack() as stack:
            for target in never:
                stack.enter_context(patch(target, side_effect=AssertionError(f"reached {target}")))
            code = main(argv)
        captured = capsys.readouterr()
        err = captured.err.strip()
        assert code == 2, captured
        assert len(err.splitlines()) == 1 and "Traceback" not in captured.err, err
        assert err.startswith(f"pipeweave {argv[0]}: error: "), err
        return err

    return run


@pytest.fixture(scope="session")
def ruff() -> str:
    """The path of this environment's ruff (installed by the ``test`` extra, pinned in constraints.txt)."""
    beside = Path(sys.executable).with_name("ruff")
    found = str(beside) if beside.exists() else shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed: pip install -c constraints.txt -e '.[test]'")
    return found
