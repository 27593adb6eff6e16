"""``pipeweave schedules`` and ``pipeweave simulate`` through ``cli.main`` (no subprocess)."""

from __future__ import annotations

import json
from pathlib import Path
from unittest.mock import patch

import pytest

from pipeweave.cli import COMMANDS, main
from pipeweave.schedule import SCHEDULES

REQUIRED = (
    "schedule",
    "stages",
    "microbatches",
    "chunks",
    "makespan",
    "bubble_ratio",
    "bubble_ratio_flush",
    "bubble_overhead",
    "peak_activations",
    "weight_versions",
    "staleness",
    "valid",
    "cost",
)


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, object]:
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # exactly one JSON object on one line
    data: dict[str, object] = json.loads(out)
    return data


def _error(capsys: pytest.CaptureFixture[str], argv: list[str], code: int = 2) -> str:
    assert main(argv) == code
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "Traceback" not in captured.err + captured.out
    return err


def test_commands_are_registered() -> None:
    assert "schedules" in COMMANDS and "simulate" in COMMANDS


def test_schedules_lists_every_registry_entry(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedules"]) == 0
    out = capsys.readouterr().out
    for name, info in SCHEDULES.items():
        assert name in out and info.family.split()[0] in out
    data = _json(capsys, ["schedules", "--json"])
    rows = data["schedules"]
    assert isinstance(rows, list) and [r["name"] for r in rows] == list(SCHEDULES)
    assert {"family", "synchronous", "bubble", "activations", "weights"} <= set(rows[0])


def test_schedules_json_says_what_each_supports(capsys: pytest.CaptureFixture[str]) -> None:
    rows = {r["name"]: r for r in _json(capsys, ["schedules", "--json"])["schedules"]}
    assert (rows["zb-v"]["placement"], rows["zb-v"]["splits_backward"], rows["zb-v"]["searched"]) == (
        "v-shape",
        True,
        False,
    )
    assert (rows["chimera"]["placement"], rows["chimera"]["zero"]) == ("bidirectional", False)
    assert (rows["pipedream"]["data_parallel"], rows["pipemare"]["data_parallel"]) == ("asynchronous", "none")
    assert rows["zb-auto"]["searched"] and rows["ampnet"]["ties"] and not rows["xpipe"]["ties"]
    assert rows["spectrain"]["defaults"] == {"momentum": 0.9} and rows["1f1b"]["defaults"] == {}


def test_schedules_sees_entries_added_at_run_time(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    info = SCHEDULES["gpipe"]
    monkeypatch.setitem(SCHEDULES, "my-test-schedule", info)
    assert main(["schedules"]) == 0
    assert "my-test-schedule" in capsys.readouterr().out


def test_simulate_defaults_print_timeline_and_metrics(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("1f1b (DAPPLE / PipeDream-Flush, synchronous): D=4 ranks, T=8 microbatches")
    assert "rank 3 |" in out and "legend:" in out
    assert "bubble_ratio" in out and "0.2727" in out and "(D-1)/(T+D-1) = 0.2727" in out
    assert "4, 3, 2, 1" in out  # peak activations per rank


def test_simulate_json_fields(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(capsys, ["simulate", "-s", "gpipe", "--stages", "4", "--microbatches", "12", "--json"])
    for key in REQUIRED:
        assert key in data, key
    assert (data["schedule"], data["stages"], data["microbatches"], data["chunks"]) == ("gpipe", 4, 12, 1)
    assert data["valid"] is True
    assert data["bubble_ratio"] == pytest.approx(3 / 15)
    assert data["makespan"] == 3 * 15
    assert data["peak_activations"] == [12.0] * 4
    assert data["cost"] == {
        "f": 1.0,
        "b": 1.0,
        "w": 1.0,
        "u": 0.0,
        "comm": 0.0,
        "dispatch": 0.0,
        "mem_w": 0.5,
        "recompute": "none",
    }


def test_simulate_uneven_times_and_comm(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(
        capsys,
        [
            "simulate",
            "-s",
            "gpipe",
            "--stages",
            "3",
            "--microbatches",
            "2",
            "--time-f",
            "1,2,1",
            "--time-b",
            "1,1,2",
            "--time-w",
            "0,1,0",
            "--json",
        ],
    )
    assert data["makespan"] == 13  # the hand timeline of tests/sim/test_simulator.py
    assert data["cost"]["f"] == [1.0, 2.0, 1.0]  # type: ignore[index]
    data = _json(capsys, ["simulate", "-s", "gpipe", "-D", "3", "-T", "2", "--time-comm", "0.5", "--json"])
    assert data["makespan"] == 3 * 4 + 2 * 2 * 0.5


def test_simulate_chunks(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(capsys, ["simulate", "-s", "interleaved-1f1b", "-D", "4", "-T", "8", "--chunks", "2", "--json"])
    assert data["chunks"] == 2
    assert data["bubble_overhead"] == pytest.approx(3 / 16)  # (D-1)/(vT)


def test_simulate_writes_files(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plot, trace, table = tmp_path / "t.svg", tmp_path / "t.json", tmp_path / "s.csv"
    data = _json(
        capsys, ["simulate", "-s", "zb-h1", "--plot", str(plot), "--trace", str(trace), "--csv", str(table), "--json"]
    )
    assert plot.stat().st_size > 1000 and json.loads(trace.read_text())["traceEvents"]
    assert table.read_text().splitlines()[0].startswith("0F0,")
    assert data["files"] == {"csv": str(table), "plot": str(plot), "trace": str(trace)}


def test_simulate_exported_csv_reads_back_the_same(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    table = tmp_path / "s.csv"
    first = _json(capsys, ["simulate", "-s", "1f1b", "-D", "3", "-T", "5", "--csv", str(table), "--json"])
    again = _json(capsys, ["simulate", "--from-csv", str(table), "--json"])
    for key in ("makespan", "bubble_ratio", "peak_activations", "stages", "microbatches"):
        assert again[key] == first[key], key
    assert again["schedule"] == "s"


def test_simulate_invalid_csv(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("0B0,0F0\n1F0,1B0\n")
    assert main(["simulate", "--from-csv", str(bad), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["valid"] is False and "0B0 needs 0F0" in data["reason"] and (data["rank"], data["step"]) == (0, 0)
    err = _error(capsys, ["simulate", "--from-csv", str(bad)], code=1)
    assert "rank 0 step 0: 0B0 needs 0F0" in err and "[0B0]" in err  # the marked grid


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["-s", "nope"], "unknown schedule 'nope'; choose one of: naive"),
        (["--stages", "0"], "--stages 0 is invalid; give --stages >= 1"),
        (["--microbatches", "-2"], "--microbatches -2 is invalid"),
        (["-s", "chimera", "--stages", "3"], "chimera"),
        (["--time-f", "1,2"], "--time-f has 2 values but the schedule has 4 parts"),
        (["--time-b", "fast"], "--time-b 'fast' is not a number"),
        (["--time-w", "-1"], "--time-w '-1' has a negative time"),
        (["--time-comm", "-1"], "--time-comm -1.0 is invalid"),
        (["--mem-w", "2"], "--mem-w 2.0 is invalid"),
        (["--plot", "x.gif"], "end the file name in .png, .svg or .pdf"),
        (["--from-csv", "/nonexistent/x.csv"], "is not a file"),
        (["-s", "gpipe", "--chunks", "3"], "drop --chunks"),
        (["-s", "1f1b", "--stage-replicas", "2,1"], "--stage-replicas applies to pipedream, not 1f1b; drop it"),
        (["-s", "1f1b", "--in-flight", "2"], "--in-flight applies to pipedream, not 1f1b; drop it"),
        (
            ["-s", "pipedream", "--stages", "4", "--stage-replicas", "2,1"],
            "stage replicas 2,1 need 3 processes but the pipeline has 4; give --stages 3 or counts summing to 4",
        ),
    ],
)
def test_simulate_user_errors_are_one_line_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    err = _error(capsys, ["simulate", *argv])
    assert err.count("\n") == 0, err
    assert err.startswith("pipeweave simulate: error: ") and needle in err, err


def test_bad_csv_text_is_a_user_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,zzz\n")
    err = _error(capsys, ["simulate", "--from-csv", str(bad)])
    assert "cannot read action 'zzz'" in err and err.count("\n") == 0


def test_simulate_zb_auto_takes_its_activation_limit(capsys: pytest.CaptureFixture[str]) -> None:
    peaks = {}
    for k in (1, 2):
        assert (
            main(
                [
                    "simulate",
                    "-s",
                    "zb-auto",
                    "--stages",
                    "4",
                    "--microbatches",
                    "8",
                    "--activation-limit",
                    str(k),
                    "--json",
                ]
            )
            == 0
        )
        peaks[k] = max(json.loads(capsys.readouterr().out)["peak_activations"])
    assert peaks[1] <= 4 < peaks[2] <= 8  # K x D x M_a, and K = 2 is used
    assert main(["simulate", "-s", "1f1b", "--activation-limit", "2"]) == 2
    assert "--activation-limit applies to zb-auto, zb-v-auto, not 1f1b; drop it" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["simulate", "search"])
def test_memory_limit_is_bytes_and_k_is_the_activation_limit(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    zb = ["-s", "zb-auto"] if command == "simulate" else ["--stages", "4", "--microbatches", "8"]
    assert main([command, *zb, "--memory-limit", "2"]) == 2
    err = capsys.readouterr().err
    assert "--memory-limit 2 is bytes per rank now; the activation multiple K is --activation-limit 2" in err
    assert err.count("\n") == 1
    assert main([command, *zb, "--memory-limit", "8GiB"]) == 2
    assert f"--memory-limit 8GiB is bytes per rank, which {command} does not take" in capsys.readouterr().err


def test_a_simulation_larger_than_free_memory_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from unittest.mock import patch

    with patch("pipeweave.commands.simulate._available_memory", return_value=2**30):
        err = _error(capsys, ["simulate", "-s", "zb-v", "--stages", "1024", "--microbatches", "1024"])
        assert err.count("\n") == 0, err
        assert "make up to 6.3e+06 actions, ~2 GiB to simulate, more than the 1.0 GiB free here" in err, err
        assert main(["simulate", "-s", "zb-v", "--stages", "8", "--microbatches", "16", "--json"]) == 0


def test_ctrl_c_while_the_subcommands_import_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    # The first seconds of ``pipeweave train``: building the parser imports numpy, before any argument is read.
    with patch("pipeweave.cli.importlib.import_module", side_effect=KeyboardInterrupt):
        try:
            code = main(["train"])
        except KeyboardInterrupt:  # escaped: the user saw its traceback
            code = None
    assert code == 130
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", "pipeweave: interrupted\n")


def test_simulate_tied_counts_the_tied_members_staleness_and_lag(capsys: pytest.CaptureFixture[str]) -> None:
    """``--tied``: 2BW's last stage takes the tied members' staleness (1, not 0) and lags them one update
    (runtime.stage.tied_stream); a stream that refuses a tie is one line."""
    argv = ["simulate", "-s", "pipedream-2bw", "--stages", "3", "--microbatches", "3", "--json"]
    untied, tied = _json(capsys, argv), _json(capsys, [*argv, "--tied"])
    assert untied["staleness"] == [1, 1, 0] and "tied_lag" not in untied
    assert tied["staleness"] == [1, 1, 1] and tied["tied_lag"] == [0, 0, 1]
    assert main(["simulate", "-s", "pipemare", "--tied"]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("train them on pipedream-2bw, pipedream, ampnet only; choose one or drop --tied")
    )


def test_simulate_pipedream_with_replicated_stages(capsys: pytest.CaptureFixture[str]) -> None:
    """``--stage-replicas 2,1``: part 0 on ranks 0 and 1 (1F1B-RR), its replicas' staleness and copies."""
    assert main(["simulate", "-s", "pipedream", "--stages", "3", "--microbatches", "4", "--json"]) == 0
    straight = json.loads(capsys.readouterr().out)
    argv = ["simulate", "-s", "pipedream", "--stages", "3", "--microbatches", "4", "--stage-replicas", "2,1", "--json"]
    assert main(argv) == 0
    replicated = json.loads(capsys.readouterr().out)
    assert replicated["staleness"] == [1, 1, 0] and straight["staleness"] == [2, 1, 0]
    assert replicated["weight_versions"] == [2, 2, 1] and straight["weight_versions"] == [3, 2, 1]
