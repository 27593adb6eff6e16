"""Output paths: every command refuses one it cannot write in one line, before it does any work."""

from __future__ import annotations

from pathlib import Path
from unittest.mock import patch

import pytest

from pipeweave.cli import main
from pipeweave.commands.outputs import output_folder

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


def test_a_file_in_a_missing_folder_is_refused_a_folder_option_is_made(
    places: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """`compare --markdown /nonexistent/dir/x.md` created /nonexistent/dir: a typo in a path made folders."""
    new = Path(places["new"])
    with patch("pipeweave.commands.compare_run.simulated_comparison", side_effect=AssertionError("worked first")):
        assert main(["compare", "--markdown", str(new / "x.md")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"pipeweave compare: error: --markdown {new}/x.md: no folder {new}; create it or give another path"
    for flag in ("--plot", "--trace", "--csv"):
        suffix = {"--plot": "png", "--trace": "json", "--csv": "csv"}[flag]
        assert main([*SIMULATE, flag, str(new / f"t.{suffix}")]) == 2
        assert f"no folder {new}; create it" in capsys.readouterr().err
    assert not new.parent.exists()
    assert output_folder("--out", new / "out") == new / "out" and (new / "out").is_dir()  # a run's own folder


def test_an_output_that_fails_after_the_work_is_exit_3_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """compare's files are written after it simulated (or measured): a full disk then is exit 3, as train's."""
    full = OSError(28, "No space left on device")
    argv = ["compare", "-s", "gpipe", "-D", "2", "-T", "4", "--model", "mlp", "--layers", "4", "--hidden", "8"]
    with patch("pipeweave.commands.outputs.write_atomic", side_effect=full):
        code = main([*argv, "--csv", str(tmp_path / "rows.csv")])
    err = capsys.readouterr().err.strip()
    assert code == 3, err
    assert err == f"pipeweave compare: error: cannot write {tmp_path / 'rows.csv'}: No space left on device", err
