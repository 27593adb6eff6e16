"""Output paths: every command refuses one it cannot write in one line, before it does any work."""

from __future__ import annotations

from pathlib import Path
from unittest.mock import patch

import pytest

from pipeweave.cli import main

SIMULATE = ["simulate", "-s", "1f1b", "--stages", "2", "--microbatches", "4"]
SEARCH = ["search", "--stages", "2", "--microbatches", "2", "--solver", "heuristic"]
TRAIN = ["train", "--model", "mlp", "--layers", "2", "--hidden", "8", "--batch", "4", "--steps", "1"]


@pytest.fixture
def places(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "file").write_text("x")
    (tmp_path / "folder").mkdir()
    return {"file": str(tmp_path / "file"), "folder": str(tmp_path / "folder"), "new": str(tmp_path / "a" / "b")}


CASES = [
    (SIMULATE, "--plot", "{folder}/x.gif", "--plot {folder}/x.gif: cannot draw a .gif file; end the file name in .png"),
    (SIMULATE, "--plot", "{file}/x.png", "--plot {file}/x.png: {file} is a file, not a folder; give another path"),
    (SIMULATE, "--trace", "{folder}", "--trace {folder} is a folder; give a file path"),
    (SIMULATE, "--csv", "{file}/deeper/x.csv", "{file} is a file, not a folder"),
    (SEARCH, "--csv", "{folder}", "--csv {folder} is a folder"),
    (SEARCH, "--plot", "{folder}/x", "--plot {folder}/x: cannot draw a file without a suffix"),
    (["partition", "--stages", "2"], "--save-costs", "{file}/c.json", "--save-costs {file}/c.json: {file} is a file"),
    (TRAIN, "--json", "{folder}", "--json {folder} is a folder"),
    (TRAIN, "--plot", "{folder}/t.txt", "cannot draw a .txt file"),
    (TRAIN, "--out", "{file}", "--out {file}: {file} is a file, not a folder"),
    (TRAIN, "--save", "{file}", "--save {file}: {file} is a file, not a folder"),
]


@pytest.mark.parametrize(("command", "flag", "value", "message"), CASES)
def test_an_unwritable_output_is_one_line_before_any_work(
    command: list[str],
    flag: str,
    value: str,
    message: str,
    places: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    work = {
        "simulate": "pipeweave.commands.simulate.simulate",
        "search": "pipeweave.autoschedule.exact",
        "partition": "pipeweave.commands.partition.layer_costs",
        "train": "pipeweave.runtime.run.launch._spawn",
    }
    with patch(work[command[0]], side_effect=AssertionError("worked before checking its outputs")):
        code = main([*command, flag, value.format(**places)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"pipeweave {command[0]}: error: ") and message.format(**places) in err, err


def test_missing_folders_of_outputs_are_made(places: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    new = Path(places["new"])
    assert (
        main(
            [*SIMULATE, "--plot", str(new / "t.png"), "--trace", str(new / "t.json"), "--csv", str(new / "s" / "t.csv")]
        )
        == 0
    )
    assert (new / "t.png").stat().st_size > 0 and (new / "t.json").is_file() and (new / "s" / "t.csv").is_file()
