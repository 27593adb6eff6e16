"""``pipeweave search`` refuses, in one line, a problem too large to search on this machine.

Before, ``search --stages 100000 --microbatches 100000`` ran on with no message: its
heuristic and the checks of its result run to their end whatever ``--time-limit`` says.
"""

from __future__ import annotations

from unittest.mock import patch

import pytest

from pipeweave.cli import main


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], free: int | None) -> str:
    with (
        patch("pipeweave.commands.search.available_memory", return_value=free),
        patch("pipeweave.autoschedule.exact", side_effect=AssertionError("searched a problem too large")),
        patch("pipeweave.autoschedule.problem_from_times", side_effect=AssertionError("built a problem too large")),
    ):
        code = main(["search", *argv])
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in captured.err, captured
    assert err.startswith("pipeweave search: error: "), err
    return err


def test_a_search_larger_than_free_memory_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused(capsys, ["--stages", "100000", "--microbatches", "100000"], free=16 * 2**30)
    assert (
        "--stages 100000 x --microbatches 100000 make 3e+10 actions, ~11 TiB to search (400 B each), more than "
        "the 16.0 GiB free here; give fewer stages or microbatches (at most ~4.3e+07 actions fit)"
    ) in err, err


def test_the_v_shape_counts_its_two_chunks(capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused(capsys, ["--stages", "2000", "--microbatches", "1000", "--v-shape"], free=2**30)
    assert "--stages 2000 x --microbatches 1000 x 2 chunks make 1.2e+07 actions, ~4 GiB to search" in err, err


def test_a_search_far_beyond_its_time_limit_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused(capsys, ["--stages", "1000", "--microbatches", "2000"], free=2**40)
    assert (
        "--stages 1000 x --microbatches 2000 make 6e+06 actions, ~4 min of search that --time-limit cannot stop "
        "(~40 us each), more than 2 min (10 x --time-limit 10, at least 60 s); give fewer stages or microbatches "
        "(at most ~2.5e+06 actions) or a larger --time-limit"
    ) in err, err


def test_a_larger_time_limit_lets_it_run(capsys: pytest.CaptureFixture[str]) -> None:
    with (
        patch("pipeweave.commands.search.available_memory", return_value=2**40),
        patch("pipeweave.autoschedule.exact", side_effect=RuntimeError("ran")),
        pytest.raises(RuntimeError, match="ran"),
    ):
        main(["search", "--stages", "1000", "--microbatches", "2000", "--time-limit", "30"])


def test_the_command_line_itself_answers_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    # No patch: this machine's own free memory. 3e10 actions fit nowhere.
    with patch("pipeweave.autoschedule.exact", side_effect=AssertionError("searched")):
        assert main(["search", "--stages", "100000", "--microbatches", "100000"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "make 3e+10 actions" in err and "give fewer stages or microbatches" in err
