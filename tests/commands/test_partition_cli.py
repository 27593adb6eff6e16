"""``pipeweave partition``: the table, the JSON contract, profiling, and one-line errors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pipeweave.commands import partition as command
from pipeweave.errors import UserError
from pipeweave.partition import LayerCosts
from pipeweave.runtime.run.prepare import layer_ranges, prepare


def main(argv: list[str]) -> int:
    """``pipeweave partition ARGV`` through the real CLI entry point when every subcommand exists."""
    try:
        from pipeweave.cli import build_parser
        from pipeweave.cli import main as cli_main

        build_parser()
    except ModuleNotFoundError:  # another subcommand not landed yet: drive ours the same way
        parser = argparse.ArgumentParser(prog="pipeweave")
        command.add_parser(parser.add_subparsers(dest="command")).set_defaults(run=command.run)
        args = parser.parse_args(["partition", *argv])
        try:
            return int(args.run(args))
        except UserError as exc:
            print(f"pipeweave partition: error: {exc}", file=__import__("sys").stderr)
            return 2
    return cli_main(["partition", *argv])


@pytest.fixture
def head_heavy(tmp_path: Path) -> Path:
    """Eight layers of F+I+W 3 ms and a head of 15 ms; activations 1 KiB, weights 1 KiB per layer."""
    costs = LayerCosts(
        names=[f"layers.{i}" for i in range(8)],
        types=["Embedding"] + ["Block"] * 6 + ["Head"],
        forward=[1e-3] * 7 + [5e-3],
        input_grad=[1e-3] * 7 + [6e-3],
        weight_grad=[1e-3] * 7 + [4e-3],
        activation=[1024.0] * 8,
        params=[1024.0] * 8,
    )
    path = tmp_path / "costs.json"
    costs.save(path)
    return path


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:  # type: ignore[type-arg]
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_fields_and_time_beats_uniform(head_heavy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--costs", str(head_heavy), "--stages", "2", "-s", "1f1b", "--microbatches", "4"]
    uniform = run_json(capsys, [*base, "--partition", "uniform"])
    timed = run_json(capsys, [*base, "--partition", "time"])
    assert [p["layers"] for p in uniform["parts"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [p["layers"] for p in timed["parts"]] == [[0, 1, 2, 3, 4, 5], [6, 7]]
    # uniform: 12 | 24 ms; time: 18 | 18 ms
    assert uniform["max_stage_time"] == pytest.approx(24e-3) and timed["max_stage_time"] == pytest.approx(18e-3)
    # 1F1B, D = 2, T = 4, equal stages of 18 ms: makespan (T + D - 1) x 18, bubble (D-1)/(T+D-1) = 1/5
    assert timed["makespan"] == pytest.approx(5 * 18e-3) and timed["bubble_ratio"] == pytest.approx(0.2)
    assert uniform["bubble_ratio"] > timed["bubble_ratio"]
    # memory under 1F1B: part 0 holds 2 microbatches, part 1 one; weights + SGD gradient twice the params
    assert [p["memory"] for p in timed["parts"]] == [2 * 6 * 1024 + 2 * 6 * 1024, 2 * 1024 + 2 * 2 * 1024]
    for key in ("parts", "max_stage_time", "bubble_ratio"):
        assert key in timed


def test_memory_fits_a_limit_that_time_exceeds(head_heavy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--costs", str(head_heavy), "--stages", "2", "--microbatches", "4"]
    timed = run_json(capsys, [*base, "--partition", "time"])
    limit = 20 * 1024  # time's part 0 needs 24 KiB
    assert timed["max_memory"] > limit
    fitted = run_json(capsys, [*base, "--partition", "memory", "--memory-limit", str(limit)])
    assert fitted["max_memory"] <= limit
    assert [len(p["layers"]) for p in fitted["parts"]] == [5, 3]  # 4 x 5 KiB = 20 KiB on part 0
    in_units = run_json(capsys, [*base, "--partition", "memory", "--memory-limit", "20KiB"])
    assert in_units["parts"] == fitted["parts"] and in_units["memory_limit"] == limit


def test_explicit_and_table(head_heavy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--costs", str(head_heavy), "--stages", "4", "--partition", "explicit", "--layers-per-stage", "3,2,2,1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "0-2 (3)" in out and "7 (1)" in out and "bubble" in out


def test_pipedream_replicates_on_fast_links(head_heavy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_json(
        capsys, ["--costs", str(head_heavy), "--stages", "4", "--partition", "pipedream", "--bandwidth", "1e12"]
    )
    assert sum(p["replicas"] for p in result["parts"]) == 4
    assert sum(len(p["layers"]) for p in result["parts"]) == 8
    # NOAM: ceil(workers / replicas of the input stage), PipeDream's microbatches in flight
    assert result["noam"] == -(-4 // result["parts"][0]["replicas"])
    argv = ["--costs", str(head_heavy), "--stages", "4", "--partition", "pipedream", "--bandwidth", "1e12"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"NOAM {result['noam']}: ceil(4 ranks / {result['parts'][0]['replicas']} input replicas)" in out
    counts = ",".join(str(p["replicas"]) for p in result["parts"])
    assert f"train runs it: -s pipedream --stages 4 --partition pipedream (--stage-replicas {counts}" in out


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--stages", "9"], "9 parts for a model of 8 layers"),
        (["--stages", "4", "--partition", "explicit", "--layers-per-stage", "3,2,2"], "gives 3 parts for 4"),
        (["--stages", "4", "--partition", "explicit", "--layers-per-stage", "3,x"], "not a list of integers"),
        (["--stages", "2", "--partition", "memory", "--memory-limit", "100"], "--memory-limit 100 bytes is below"),
        (["--stages", "2", "--partition", "memory"], "needs --memory-limit"),
        (["--stages", "2", "--partition", "bogus"], "unknown partition method 'bogus'"),
        (["--stages", "2", "-s", "nope"], "unknown schedule 'nope'"),
        (["--stages", "0"], "--stages 0 is invalid"),
    ],
)
def test_errors_are_one_line(
    head_heavy: Path, capsys: pytest.CaptureFixture[str], extra: list[str], fragment: str
) -> None:
    assert main(["--costs", str(head_heavy), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1


def test_profiles_a_real_model_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIPEWEAVE_CACHE", str(tmp_path))
    argv = [
        "--model",
        "mlp",
        "--layers",
        "4",
        "--hidden",
        "16",
        "--stages",
        "2",
        "--batch-size",
        "8",
        "--microbatches",
        "2",
        "--repeats",
        "1",
        "--partition",
        "time",
        "--save-costs",
        str(tmp_path / "c.json"),
    ]
    first = run_json(capsys, argv)
    cached = list((tmp_path / "profiles").glob("*.json"))
    assert len(cached) == 1
    costs = LayerCosts.load(tmp_path / "c.json")
    assert costs.types == ("MLPBlock",) * 4
    # parameters of a block: LayerNorm 2h, Linear(h, 4h) 4h^2 + 4h, Linear(4h, h) 4h^2 + h; float32
    assert costs.params == ((2 * 16 + 4 * 16 * 16 + 4 * 16 + 4 * 16 * 16 + 16) * 4.0,) * 4
    assert all(t > 0 for t in costs.forward + costs.input_grad + costs.weight_grad)
    # the output of a block is the microbatch (4, 16) float32; the next run reads the cache
    assert costs.output[:3] == (4 * 16 * 4.0,) * 3
    assert run_json(capsys, argv)["parts"] == first["parts"]
    assert "split_points" not in first  # the mlp's layers are pipeweave's own: no module names


def test_a_module_cut_at_names_says_where_the_partition_splits_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ``nn.Sequential`` cut before each child (``pipeweave.pipeline``): the names at the parts' starts, from
    the model's ``split_points`` (layer k + 1 starts at the k-th), in the JSON and in one line of the table."""
    monkeypatch.setenv("PIPEWEAVE_CACHE", str(tmp_path))
    entry = f"{Path(__file__).parents[1] / 'models' / 'tiny_modules.py'}:tied_sequential"
    argv = [
        "--model",
        entry,
        "--stages",
        "2",
        "--batch-size",
        "8",
        "--microbatches",
        "2",
        "--repeats",
        "1",
        "--layers-per-stage",
        "1,4",
    ]
    from pipeweave.models import ModelSpec

    assert ModelSpec(kind="custom", entry=entry).custom.split_points == ("1", "2", "3", "4")
    assert run_json(capsys, argv)["split_points"] == ["1"]
    assert main([*argv[:-1], "2,3"]) == 0
    assert capsys.readouterr().out.endswith("\nsplit: layers 0-1 | 2-4, cut before 2\n")


def train_config(argv: list[str]):  # type: ignore[no-untyped-def]
    from pipeweave.commands import train, train_run

    parser = argparse.ArgumentParser()
    train.add_parser(parser.add_subparsers()).set_defaults(run=train.run)
    return train_run.build_config(parser.parse_args(["train", "--model", "mlp", "--layers", "8", *argv]))


def test_train_takes_the_partition_and_the_data_parallel_degree(head_heavy: Path) -> None:
    config = train_config(["--stages", "4", "--partition", "explicit", "--layers-per-stage", "3,2,2,1"])
    assert config.layers_per_part == (3, 2, 2, 1)
    assert [len(r) for r in layer_ranges(config, prepare(config).schedule)] == [3, 2, 2, 1]
    config = train_config(["--stages", "2", "--partition", "time", "--costs", str(head_heavy), "--data-parallel", "3"])
    assert config.layers_per_part == (6, 2) and config.data_parallel == 3
    assert prepare(config).schedule.num_ranks == 6
    assert train_config(["--stages", "2"]).layers_per_part is None
    with pytest.raises(UserError, match="sums to 9 layers"):
        train_config(["--stages", "2", "--partition", "explicit", "--layers-per-stage", "5,4"])


def test_layers_per_stage_alone_is_explicit_and_is_never_ignored(head_heavy: Path) -> None:
    # It used to be dropped silently unless --partition explicit came with it.
    assert train_config(["--stages", "2", "--layers-per-stage", "7,1"]).layers_per_part == (7, 1)
    with pytest.raises(UserError, match="^--layers-per-stage applies to --partition explicit, not time; drop one"):
        train_config(["--stages", "2", "--partition", "time", "--costs", str(head_heavy), "--layers-per-stage", "7,1"])
