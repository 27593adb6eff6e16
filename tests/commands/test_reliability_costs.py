"""Cost-model values: nan, inf and absurdly large times are one line (exit 2) in simulate, search and partition.

Before, ``simulate --time-f nan`` reported bubble 0.0000, ``search --time-f nan`` called its
schedule optimal, and ``--time-f inf`` or ``1e308`` ended in a traceback.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeweave.cli import main
from pipeweave.errors import UserError
from pipeweave.partition import LayerCosts
from pipeweave.sim import CostModel

WORK = {
    "simulate": "pipeweave.commands.simulate.simulate",
    "search": "pipeweave.autoschedule.exact",
    "partition": "pipeweave.commands.partition.plan_and_predict",
}


FINITE = "; give a finite {what} >= 0"
LARGE = "is too large; give a {what} <= 1e+15"


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--time-f", "nan", "--time-f nan is invalid" + FINITE.format(what="time")),
        ("--time-b", "nan", "--time-b nan is invalid" + FINITE.format(what="time")),
        ("--time-w", "nan", "--time-w nan is invalid" + FINITE.format(what="time")),
        ("--time-u", "nan", "--time-u nan is invalid" + FINITE.format(what="time")),
        ("--time-comm", "nan", "--time-comm nan is invalid" + FINITE.format(what="latency")),
        ("--time-dispatch", "nan", "--time-dispatch nan is invalid" + FINITE.format(what="time")),
        ("--mem-w", "nan", "--mem-w nan is invalid; give a fraction in [0, 1]"),
        ("--time-f", "1,nan,1,1", "--time-f '1,nan,1,1': nan is invalid" + FINITE.format(what="time")),
        ("--time-w", "1,1,inf,1", "--time-w '1,1,inf,1': inf is invalid" + FINITE.format(what="time")),
        ("--time-f", "inf", "--time-f inf is invalid" + FINITE.format(what="time")),
        ("--time-f", "1e308", "--time-f 1e308 " + LARGE.format(what="time")),
        ("--time-b", "1e16", "--time-b 1e16 " + LARGE.format(what="time")),
        ("--time-comm", "inf", "--time-comm inf is invalid" + FINITE.format(what="latency")),
        ("--time-comm", "1e308", "--time-comm 1e+308 " + LARGE.format(what="latency")),
        ("--time-dispatch", "1e300", "--time-dispatch 1e+300 " + LARGE.format(what="time")),
        ("--activation-limit", "nan", "--activation-limit nan holds less than one microbatch per rank; give K >= 1/4"),
    ],
)
def test_simulate_refuses_a_non_finite_or_absurd_cost(
    flag: str, value: str, message: str, cli_error: Callable[..., str]
) -> None:
    schedule = ["-s", "zb-auto"] if flag == "--activation-limit" else []
    err = cli_error(["simulate", *schedule, flag, value], WORK["simulate"])
    assert message in err, err


def test_simulate_takes_costs_up_to_the_bound(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--time-f", "1e15", "--time-b", "1e15", "--time-w", "1e15", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["bubble_ratio"] == pytest.approx(3 / 11) and math.isfinite(data["makespan"])


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--time-f", "nan", "--time-f nan is invalid" + FINITE.format(what="time")),
        ("--time-b", "inf", "--time-b inf is invalid" + FINITE.format(what="time")),
        ("--time-w", "1e308", "--time-w 1e+308 " + LARGE.format(what="time")),
        ("--time-comm", "nan", "--time-comm nan is invalid" + FINITE.format(what="latency")),
        ("--activation-limit", "nan", "--activation-limit nan holds less than one microbatch per rank; give K >= 1/4"),
        ("--work-limit", "nan", "--work-limit nan is invalid; give deterministic seconds > 0"),
    ],
)
def test_search_refuses_a_non_finite_or_absurd_cost(
    flag: str, value: str, message: str, cli_error: Callable[..., str]
) -> None:
    err = cli_error(["search", "--stages", "4", "--microbatches", "8", flag, value], WORK["search"])
    assert message in err, err


def _costs_file(tmp_path: Path, **changes: list[float]) -> str:
    data = LayerCosts.uniform(4).to_json()
    data.update(changes)
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(data))  # Python's json writes NaN and Infinity
    return str(path)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"forward": [1.0, 1e308, 1.0, 1.0]}, "forward sums to 1e+308 over the layers, more than 1e+15"),
        ({"params": [6e14, 6e14, 1.0, 1.0]}, "params sums to 1.2e+15 over the layers, more than 1e+15"),
        ({"weight_grad": [1.0, math.nan, 1.0, 1.0]}, "weight_grad=[1.0, nan, 1.0, 1.0] has a negative or non-finite"),
        ({"activation": [1.0, math.inf, 1.0, 1.0]}, "activation=[1.0, inf, 1.0, 1.0] has a negative or non-finite"),
    ],
)
def test_partition_refuses_non_finite_or_absurd_layer_costs(
    changes: dict[str, list[float]], message: str, tmp_path: Path, cli_error: Callable[..., str]
) -> None:
    path = _costs_file(tmp_path, **changes)
    err = cli_error(["partition", "--stages", "2", "--costs", path], WORK["partition"])
    assert f"costs file {path!r}: {message}" in err, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--optimizer-state", "nan"],
            "--optimizer-state nan is invalid; give a finite number of bytes per weight byte",
        ),
        (["--optimizer-state", "1e308"], "--optimizer-state 1e+308 is too large"),
        (["--optimizer-state", "-1"], "--optimizer-state -1.0 is invalid"),
        (
            ["--partition", "pipedream", "--bandwidth", "nan"],
            "--bandwidth nan is invalid; give finite bytes per second > 0",
        ),
        (["--partition", "pipedream", "--bandwidth", "inf"], "--bandwidth inf is invalid"),
        (["--partition", "memory", "--memory-limit", "nan"], "--memory-limit 'nan' is invalid; give bytes per rank"),
    ],
)
def test_partition_refuses_a_non_finite_or_absurd_flag(
    argv: list[str], message: str, tmp_path: Path, cli_error: Callable[..., str]
) -> None:
    err = cli_error(["partition", "--stages", "2", "--costs", _costs_file(tmp_path), *argv], WORK["partition"])
    assert message in err, err


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"f": math.nan}, "cost f=nan is invalid; give a finite time >= 0"),
        ({"b": [1.0, math.inf]}, "cost b=[1.0, inf]: inf is invalid; give a finite time >= 0"),
        ({"weight": 1e300}, "cost weight=1e+300 is too large; give a memory <= 1e+15"),
        ({"comm": math.inf}, "comm=inf is invalid; give a finite latency >= 0"),
        ({"dispatch": math.nan}, "dispatch=nan is invalid; give a finite time >= 0"),
    ],
)
def test_the_cost_model_itself_refuses_non_finite_or_absurd_values(changes: dict[str, object], message: str) -> None:
    with pytest.raises(UserError) as info:
        CostModel(**changes)  # type: ignore[arg-type]
    assert message in str(info.value)
    CostModel(f=1e15, comm=1e15)  # the bound itself (sim.cost.MAX_COST) is taken
