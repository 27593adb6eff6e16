"""Tied parameters on asynchronous streams (``runtime.stage.tied_stream``): 2 gloo ranks equal the reference
executor, and both copies of a tie end equal.

The rule (each end applies ``first_k + last_k`` at its first update whose
partner's half has been sent; the last stage d = ``tied_lag`` updates late,
and d more steps at the drain) is implemented once and driven by both
executors, so distributed = reference alone would not catch a wrong rule:
every case also checks that the tie's copies on the first and the last stage
end bitwise equal, which fails if either end drops or misplaces its
partner's half; in one process the lag is measured against ``tied_lag``, and
a one-mini-batch 2BW stream against one synchronous step. Default run: a
declared tie (two linear layers, DeepSpeed's ``TiedLayerSpec`` way) on
pipedream-2bw, pipedream and ampnet. Slow, on pipedream-2bw: a transformer
split by ``pipeweave.pipeline`` with its head tied to its embedding, an
``nn.Sequential`` whose last layer reuses its first one's weight, tiny
Hugging Face GPT-2 and Llama with tied embeddings, the built-in gpt (also
through the command line, with data-parallel replicas, tensor-parallel
shards, on 3 stages), a run drained and saved halfway then resumed; the gpt
on pipedream and Llama on ampnet.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from config_defaults import train_config

from pipeweave.config import TrainConfig
from pipeweave.errors import UserError
from pipeweave.models import ModelSpec
from pipeweave.runtime.reference import run_reference, run_stream_reference
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import optimizer_factory, prepare
from pipeweave.runtime.run.record import RunRecord
from pipeweave.runtime.run.streams import stream_schedules
from pipeweave.runtime.stage.tied import tied_groups
from pipeweave.schedule import generate
from pipeweave.sim.versions import staleness, tied_lag

MODELS = Path(__file__).resolve().parent.parent / "models"
FILE = MODELS / "tiny_modules.py"
sys.path.insert(0, str(MODELS))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_split_module import HF, LOOPED, _launch, _run_all  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread")]


def _config(spec: ModelSpec, **overrides: Any) -> TrainConfig:
    fields: dict[str, Any] = dict(
        schedule="pipedream-2bw",
        num_stages=2,
        num_microbatches=2,
        model=spec,
        batch_size=4,
        steps=4,
        lr=0.05,
        momentum=0.9,
        collect_parameters=True,
    )
    fields.update(overrides)
    return train_config(**fields)


def _stage_parameters(record: RunRecord) -> dict[int, dict[str, torch.Tensor]]:
    return {stage: params for rank in record.ranks for stage, params in rank.parameters.items()}


def equals_reference_and_ties_agree(config: TrainConfig, record: RunRecord) -> None:
    """Losses and every stage's weights are the reference's (rtol 1e-5); each tie's copies end bitwise equal."""
    reference = run_stream_reference(
        stream_schedules(config),
        config.model,
        batch_size=config.batch_size,
        optimizer_factory=optimizer_factory(config),
    )
    torch.testing.assert_close(record.losses, reference.losses, rtol=1e-5, atol=1e-6)
    got = _stage_parameters(record)
    for stage, params in got.items():
        for name, value in params.items():
            torch.testing.assert_close(value, reference.stage_parameters[stage][name], rtol=1e-5, atol=1e-6)
    groups = tied_groups(config.model)
    assert groups
    for group in groups:
        copies = [params[name] for params in got.values() for name in group if name in params]
        assert len(copies) >= 2
        for copy in copies[1:]:
            assert torch.equal(copy, copies[0]), f"tied {group} differ: {(copy - copies[0]).abs().max()}"


DECLARED = ModelSpec(kind="custom", entry=f"{FILE}:declared")


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_declared_tie_on_each_tied_stream_equals_its_reference() -> None:
    """2BW at T = D = 2 (lag 1) and T = 1 < D (lag 2); pipedream and ampnet, an update per microbatch (lag 2)."""
    runs = _launch(
        {
            "T=2": _config(DECLARED),
            "T=1": _config(DECLARED, num_microbatches=1, batch_size=2),
            "pipedream": _config(DECLARED, schedule="pipedream"),
            "ampnet": _config(DECLARED, schedule="ampnet"),
        }
    )
    for config, record in runs.values():
        equals_reference_and_ties_agree(config, record)


def test_a_one_minibatch_tied_stream_is_one_synchronous_step() -> None:
    """An independent oracle, in one process: a stream of one mini-batch has no staleness, so the rule (the
    first stage sums at its U, the last stage skips its tied members there and sums at the drain) must give
    one synchronous 1F1B step with the tie summed, bitwise; fails if either end's sum or the drain is dropped."""
    stream = run_stream_reference(
        generate("pipedream-2bw", num_stages=2, num_microbatches=2, num_steps=1), DECLARED, batch_size=4
    )
    step = run_reference(generate("1f1b", num_stages=2, num_microbatches=2), DECLARED, steps=1, batch_size=4)
    assert stream.losses == step.losses
    for got, want in zip(stream.stage_parameters, step.stage_parameters):
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    untrained = _untrained(DECLARED)["0.weight"]  # in one stage the tie is one Parameter, one name
    assert not torch.equal(step.stage_parameters[1]["1.weight"], untrained)


class _Recording(torch.optim.SGD):
    """SGD that keeps a copy of its first parameter after every step (``steps``: one list per optimizer)."""

    steps: list[list[torch.Tensor]] = []

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.1, momentum=0.9)
        self.mine: list[torch.Tensor] = []
        _Recording.steps.append(self.mine)

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        out = super().step(closure)
        self.mine.append(self.param_groups[0]["params"][0].detach().clone())
        return out


@pytest.mark.parametrize(
    ("name", "t", "lag"), [("pipedream-2bw", 2, 1), ("pipedream-2bw", 1, 2), ("pipedream", 2, 2), ("ampnet", 2, 2)]
)
def test_the_last_stages_tied_copy_lags_as_the_simulator_says(name: str, t: int, lag: int) -> None:
    """After its U_(k+d) the last stage's copy is the first stage's after U_k, d = ``sim.versions.tied_lag``;
    after its first d updates still the initial value, and the drain's d steps bring it level."""
    schedule = generate(name, num_stages=2, num_microbatches=t, num_steps=4)
    _Recording.steps = []
    run_stream_reference(schedule, DECLARED, batch_size=2 * t, optimizer_factory=_Recording)
    first, last = _Recording.steps  # the tied weight is each stage's first parameter
    assert tied_lag(schedule) == (0, lag) and len(last) == len(first) + lag  # the drain's steps
    for k in range(lag):
        assert torch.equal(last[k], _untrained(DECLARED)["0.weight"])
    for k in range(len(first)):
        assert torch.equal(last[k + lag], first[k])
        assert k == 0 or not torch.equal(first[k], first[k - 1])


def test_the_report_shows_a_tied_lag_only_for_a_tie_between_parts_of_a_stream() -> None:
    """``staleness_figures`` (train's record): a stream's staleness, the tie's lag where a tie spans parts, nothing
    for a synchronous schedule; the same in ``pipeweave compare`` (test_compare_cli) and the CLI (test_train_cli)."""
    from pipeweave.runtime.report.stream_summary import staleness_figures

    stream = generate("pipedream", num_stages=2, num_microbatches=2, num_steps=4)
    halves = [range(0, 1), range(1, 2)]
    assert staleness_figures(stream, DECLARED, halves) == {"staleness": [2, 2], "tied_lag": [0, 2]}
    untied = ModelSpec(kind="mlp", layers=2, hidden=4)
    assert staleness_figures(stream, untied, halves) == {"staleness": list(staleness(stream))} == {"staleness": [1, 0]}
    assert staleness_figures(stream, DECLARED, [range(0, 2), range(2, 2)]) == {"staleness": [1, 0]}  # one part
    assert staleness_figures(generate("1f1b", num_stages=2, num_microbatches=2), DECLARED, halves) == {}


def _untrained(spec: ModelSpec) -> dict[str, torch.Tensor]:
    return run_reference(
        generate("1f1b", num_stages=1, num_microbatches=1),
        spec,
        steps=1,
        batch_size=4,
        optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.0),
    ).parameters


def test_a_tie_on_another_stream_or_a_scheduled_rate_is_one_line() -> None:
    with pytest.raises(UserError, match=r"^tied parameters .* pipedream-2bw, pipedream, ampnet only, not pipemare; "):
        run_stream_reference(
            generate("pipemare", num_stages=2, num_microbatches=2, num_steps=2), DECLARED, batch_size=4
        )
    with pytest.raises(UserError, match="take a constant learning rate"):
        prepare(_config(DECLARED, lr_schedule="cosine"))


GPT = ModelSpec(kind="gpt", layers=4, hidden=16, heads=2, seq_len=8, tie_embeddings=True)
TIED_SEQUENTIAL = ModelSpec(kind="custom", entry=f"{FILE}:tied_sequential")
SLOW = {
    "looped": _config(LOOPED),
    "tied sequential": _config(TIED_SEQUENTIAL),
    "gpt2": _config(HF["gpt2"]),
    "llama": _config(HF["llama"]),
    "gpt": _config(GPT),
    "gpt pipedream": _config(GPT, schedule="pipedream"),
    "llama ampnet": _config(HF["llama"], schedule="ampnet"),
}


@pytest.fixture(scope="module")
def slow_runs() -> dict[str, tuple[TrainConfig, RunRecord]]:
    return _launch(SLOW)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(SLOW))
def test_split_and_hugging_face_ties_on_pipedream_2bw_equal_the_reference(slow_runs: dict[str, Any], case: str) -> None:
    equals_reference_and_ties_agree(*slow_runs[case])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_tied_stream_saved_halfway_and_resumed_equals_the_run_drained_there(tmp_path: Path) -> None:
    """Drains at every save leave the copies equal: training 2 mini-batches, saving and resuming for 2 equals
    training 4 with a drain after 2 (which itself equals its reference)."""
    straight = _config(GPT, save=str(tmp_path / "straight"), save_every=2)
    first = _config(GPT, steps=2, save=str(tmp_path / "first"))
    runs = _launch({"straight": straight, "first": first})
    assert len(stream_schedules(straight)) == 2
    equals_reference_and_ties_agree(*runs["straight"])
    second = dataclasses.replace(first, steps=2, resume=first.save, save=str(tmp_path / "second"))
    got = _launch({"second": second})["second"][1]
    torch.testing.assert_close(got.losses, runs["straight"][1].losses[2:], rtol=1e-5, atol=1e-6)
    want = _stage_parameters(runs["straight"][1])
    for stage, params in _stage_parameters(got).items():
        for name, value in params.items():
            torch.testing.assert_close(value, want[stage][name], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_cli_trains_the_tied_gpt_on_pipedream_2bw(tmp_path: Path) -> None:
    """``pipeweave train -s pipedream-2bw --tie-embeddings`` (AdamW, the shared-memory transport): the losses are
    the reference's; pipemare refuses in one line."""
    argv = [
        "--stages",
        "2",
        "--microbatches",
        "2",
        "--model",
        "gpt",
        "--tie-embeddings",
        "--layers",
        "4",
        "--hidden",
        "16",
        "--heads",
        "2",
        "--seq-len",
        "8",
        "--batch",
        "4",
        "--steps",
        "4",
        "--lr",
        "0.05",
        "--quiet",
    ]
    record = tmp_path / "record.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeweave.cli",
            "train",
            "-s",
            "pipedream-2bw",
            *argv,
            "--out",
            str(tmp_path),
            "--json",
            str(record),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    adamw = optimizer_factory(_config(GPT, optimizer="adamw"))  # the gpt's default: the tie's first skip included
    reference = run_stream_reference(
        generate("pipedream-2bw", num_stages=2, num_microbatches=2, num_steps=4),
        GPT,
        batch_size=4,
        optimizer_factory=adamw,
    )
    assert json.loads(record.read_text())["losses"] == pytest.approx(reference.losses, rel=1e-5)
    bad = subprocess.run(
        [sys.executable, "-m", "pipeweave.cli", "train", "-s", "pipemare", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().startswith(
        "pipeweave train: error: tied parameters (tied embeddings) train on the "
        "asynchronous pipedream-2bw, pipedream, ampnet only, not pipemare"
    )


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "grid",
    [
        {"data_parallel": 2, "batch_size": 8},
        {"tensor_parallel": 2},
        {"num_stages": 3, "num_microbatches": 3, "batch_size": 6},
    ],
    ids=["dp2", "tp2", "d3"],
)
def test_a_tied_stream_with_replicas_shards_or_a_middle_stage_equals_the_reference(grid: dict[str, int]) -> None:
    """PipeDream's hybrid (DP = 2, D = 2): each update sums the replicas' gradients, then the tie's halves.
    Tensor parallelism (TP = 2, D = 2): the tied embedding and head are whole on every process, each exchanging
    with the other end's process of its own tp coordinate. D = 3: the middle stage holds no part of the tie."""
    config = _config(GPT, **grid)
    record = launch(_run_all, [config], prepare(config).num_processes, LaunchOptions(timeout_s=180))[0]
    assert record is not None
    equals_reference_and_ties_agree(config, record)
