"""Input files that are no text, or text of the wrong shape, are one line (exit 2) naming the file.

Before, ``partition --costs`` of a binary file and ``simulate --from-csv`` of a binary or
UTF-16 file ended in a UnicodeDecodeError traceback, and a blank line inside a CSV
schedule silently became a rank with no actions.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeweave.partition import LayerCosts
from pipeweave.schedule import ScheduleError, from_csv, read_csv

BINARY = b"{" + bytes([0xBA, 0x00, 0xFF]) + os.urandom(4092)  # not UTF-8 from its second byte on
UTF16_CSV = "0F0,0B0\n1F0,1B0\n".encode("utf-16")  # with its byte-order mark, as Windows' Notepad saves it


# --- item 3: partition --costs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (BINARY, "byte 1 is not UTF-8 text; give the JSON file of layer costs that --save-costs writes"),
        (json.dumps(LayerCosts.uniform(2).to_json()).encode("utf-16"), "byte 0 is not UTF-8 text"),
        (b'{"names": ' * 100_000, "nested too deep"),
        (b"\x00\x01\x02 not json", "Expecting value: line 1 column 1"),
    ],
)
def test_partition_costs_that_are_no_json_text_are_one_line(
    content: bytes, message: str, tmp_path: Path, cli_error: Callable[..., str]
) -> None:
    path = tmp_path / "x.json"
    path.write_bytes(content)
    err = cli_error(
        ["partition", "--stages", "2", "--costs", str(path)], "pipeweave.commands.partition.plan_and_predict"
    )
    assert f"cannot read costs from {str(path)!r}" in err and message in err, err


@pytest.mark.parametrize(("field", "value"), [("forward", 5), ("forward", ["a", "b", "c", "d"]), ("names", 3)])
def test_partition_costs_of_the_wrong_json_type_are_one_line(
    field: str, value: object, tmp_path: Path, cli_error: Callable[..., str]
) -> None:
    data = LayerCosts.uniform(4).to_json()
    data[field] = value
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(data))
    err = cli_error(
        ["partition", "--stages", "2", "--costs", str(path)], "pipeweave.commands.partition.plan_and_predict"
    )
    assert f"costs file {str(path)!r} has a field of the wrong type" in err, err


def test_a_costs_file_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(LayerCosts.uniform(3).to_json()).encode())
    assert LayerCosts.load(path) == LayerCosts.uniform(3)


# --- item 4: simulate --from-csv -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (BINARY, "is not UTF-8 text (byte 1 is not UTF-8); give a CSV schedule saved as UTF-8"),
        (UTF16_CSV, "is not UTF-8 text (UTF-16); give a CSV schedule saved as UTF-8"),
        ("0F0,0B0\n".encode("utf-16-le"), "holds NUL bytes, so it is no text file"),
    ],
)
def test_simulate_from_csv_that_is_no_utf8_text_is_one_line(
    content: bytes, message: str, tmp_path: Path, cli_error: Callable[..., str]
) -> None:
    path = tmp_path / "s.csv"
    path.write_bytes(content)
    err = cli_error(["simulate", "--from-csv", str(path)], "pipeweave.commands.simulate.simulate")
    assert f"{str(path)!r} {message}" in err, err


def test_a_blank_line_inside_a_csv_is_refused_with_its_line(tmp_path: Path, cli_error: Callable[..., str]) -> None:
    path = tmp_path / "s.csv"
    path.write_text("0F0,0B0\n\n1F0,1B0\n")
    err = cli_error(["simulate", "--from-csv", str(path)], "pipeweave.commands.simulate.simulate")
    assert (
        f"{str(path)!r}: line 2 holds no actions, so rank 1 would have none; give every rank its row of "
        "actions and delete blank lines between rows"
    ) in err, err


@pytest.mark.parametrize(
    ("text", "line", "rank"),
    [
        ("\n0F0,0B0\n1F0,1B0\n", 1, 0),  # a blank first line would be an empty rank 0
        ("0F0,0B0\n,,,\n1F0,1B0\n", 2, 1),  # torch's idle cells only
        ("0F0,0B0\n   \n1F0,1B0\n", 2, 1),
        ("# a comment\n0F0,0B0\n\n1F0,1B0\n", 3, 1),  # lines count the comment
    ],
)
def test_a_row_without_actions_is_no_rank(text: str, line: int, rank: int) -> None:
    with pytest.raises(ScheduleError, match=f"line {line} holds no actions, so rank {rank} would have none"):
        from_csv(text)


def test_blank_lines_at_the_end_are_no_ranks(tmp_path: Path) -> None:
    path = tmp_path / "s.csv"
    path.write_text("0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1\n\n\n")
    schedule = read_csv(path)
    assert schedule.num_ranks == 2 and schedule.num_microbatches == 2


def test_a_bad_action_names_its_line_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "s.csv"
    path.write_text("# a comment\n0F0,0B0\n1F0,1X0\n")
    with pytest.raises(ScheduleError, match=r"s\.csv': line 3: cannot read action '1X0'"):
        read_csv(path)


def test_a_csv_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    path = tmp_path / "s.csv"
    path.write_bytes(b"\xef\xbb\xbf0F0,0B0\n1F0,1B0\n")
    assert read_csv(path).num_ranks == 2


def test_a_long_garbage_cell_is_shortened_in_the_message() -> None:
    with pytest.raises(ScheduleError) as info:
        from_csv("0F0," + "x" * 5000 + "\n")
    assert len(str(info.value)) < 300 and "'xxxxxxxx" in str(info.value)
