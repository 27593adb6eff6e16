"""The public Python API: ``pipeweave.__all__`` resolves, each name documented with an example, ``import
pipeweave`` stays light, and the functions give what the commands of the same names print."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest

import pipeweave
from pipeweave.cli import main
from pipeweave.errors import UserError


def test_import_lists_the_public_names_and_imports_no_torch() -> None:
    code = (
        "import sys, pipeweave; print(pipeweave.__all__); "
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    names, heavy = out.splitlines()
    assert names == str(pipeweave.__all__)
    assert heavy == "[]"
    for name in (
        "pipeline",
        "Pipeline",
        "simulate",
        "search",
        "plan",
        "compare",
        "SCHEDULES",
        "ScheduleInfo",
        "Schedule",
    ):
        assert name in pipeweave.__all__


@pytest.mark.parametrize("name", pipeweave.__all__)
def test_every_public_name_resolves_with_a_documented_example(name: str) -> None:
    value = getattr(pipeweave, name)
    assert name in dir(pipeweave)
    own = inspect.getdoc(value) if inspect.isclass(value) or inspect.isroutine(value) else None
    in_package = any(
        line.lstrip().startswith(">>>") and f"pipeweave.{name}" in line
        for line in (pipeweave.__doc__ or "").splitlines()
    )
    # data (the registry) has its example in the package's docstring (run by the doctests too)
    assert (own is not None and ">>>" in own) or in_package, f"pipeweave.{name} has no documented example"


def test_unknown_names_are_attribute_errors() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        pipeweave.nope  # noqa: B018


def test_the_subpackages_keep_their_names() -> None:
    """``pipeweave.autoschedule`` and ``pipeweave.planner`` stay the subpackages, beside the functions."""
    import pipeweave.autoschedule.offload
    import pipeweave.planner.search

    assert inspect.ismodule(pipeweave.autoschedule) and inspect.ismodule(pipeweave.planner)
    assert pipeweave.autoschedule.offload.__name__ == "pipeweave.autoschedule.offload"
    assert callable(pipeweave.search) and callable(pipeweave.plan)


def _printed(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, object]:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_simulate_is_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    cost = pipeweave.CostModel(f=1.0, b=2.0, w=1.0, comm=0.5)
    sim = pipeweave.simulate("interleaved-1f1b", 2, 4, num_chunks=2, cost=cost)
    out = _printed(
        capsys,
        [
            "simulate",
            "-s",
            "interleaved-1f1b",
            "-D",
            "2",
            "-T",
            "4",
            "-v",
            "2",
            "--time-b",
            "2",
            "--time-comm",
            "0.5",
            "--json",
        ],
    )
    assert {k: out[k] for k in sim.metrics.as_dict()} == sim.metrics.as_dict()


def test_simulate_searches_under_the_cost(capsys: pytest.CaptureFixture[str]) -> None:
    sim = pipeweave.simulate("zb-auto", 3, 6, cost=pipeweave.CostModel(f=2.0), activation_limit=2.0)
    out = _printed(
        capsys,
        ["simulate", "-s", "zb-auto", "-D", "3", "-T", "6", "--time-f", "2", "--activation-limit", "2", "--json"],
    )
    assert out["bubble_ratio"] == sim.metrics.bubble_ratio
    assert out["peak_activations"] == list(sim.metrics.peak_activations)


def test_simulate_a_given_schedule() -> None:
    schedule = pipeweave.SCHEDULES["1f1b"].generator(num_stages=3, num_microbatches=6)
    assert pipeweave.simulate(schedule).metrics == pipeweave.simulate("1f1b", 3, 6).metrics


def test_search_is_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    result = pipeweave.search(3, 6, activation_limit=1.0, solver="heuristic")
    out = _printed(capsys, ["search", "--stages", "3", "--microbatches", "6", "--solver", "heuristic", "--json"])
    assert out["bubble_ratio"] == result.bubble_ratio and out["lower_bound"] == result.lower_bound


def test_memory_limit_keyword_names_the_activation_limit() -> None:
    line = "memory_limit=2 is bytes per rank now; the activation multiple K is activation_limit=2"
    with pytest.raises(UserError, match=f"^{line}$"):
        pipeweave.search(3, 6, memory_limit=2.0, solver="heuristic")
    with pytest.raises(UserError, match=f"^{line}$"):
        pipeweave.simulate("zb-auto", 3, 6, memory_limit=2.0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'k'"):
        pipeweave.search(3, 6, k=2.0)


def test_plan_is_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    plan = pipeweave.plan("gpt-1.7b", 16, 32, top=3)
    out = _printed(
        capsys, ["plan", "--model", "gpt-1.7b", "--gpus", "16", "--global-batch", "32", "--top", "3", "--json"]
    )
    configurations = out["configurations"]
    assert isinstance(configurations, list)
    assert [c["step_time_s"] for c in configurations[:3]] == [r.step_time for r in plan.best[:3]]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: pipeweave.simulate("nope"), "unknown schedule 'nope'"),
        (lambda: pipeweave.plan("gpt-1.7b", 8, 16, pipeline=2), "unknown dimension 'pipeline'"),
        (lambda: pipeweave.compare(["1f1b"], depth=3), "unknown model option 'depth'"),
        (lambda: pipeweave.compare(["nope"], model="mlp", layers=4, hidden=8), "nope"),
    ],
)
def test_bad_input_is_one_user_error(call: object, message: str) -> None:
    with pytest.raises(UserError, match=message) as caught:
        call()  # type: ignore[operator]
    assert "\n" not in str(caught.value)
