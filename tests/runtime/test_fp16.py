"""``--precision fp16``: dynamic loss scaling across a pipeline equals one process training with GradScaler.

Every synchronous schedule of the registry (read at test time) trains a tiny mlp on 2 gloo ranks under
CPU autocast to float16 (``torch.autocast("cpu", dtype=torch.float16)`` runs on this torch: the matmuls,
activations and the gradients between stages are float16, not fp32 with a scale applied). The first
step's loss scale, 2**40, makes every gradient overflow float16's 65504: that step's update is skipped on
every rank, the scale drops by the backoff 2**-30 to 2**10, and after ``growth_interval`` 2 clean steps
it doubles -- the plain oracle (``runtime.plain``) is ``torch.amp.GradScaler`` with the same four numbers.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
from config_defaults import train_config

from pipeweave.commands.train_report import build_report
from pipeweave.config import TrainConfig
from pipeweave.errors import UserError
from pipeweave.models import ModelSpec
from pipeweave.runtime.loss_scale import LossScale, check_row
from pipeweave.runtime.plain import TrainResult, run_plain
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import build_schedule, optimizer_factory
from pipeweave.runtime.run.record import RunRecord
from pipeweave.schedule import SCHEDULES
from pipeweave.schedule.ir import Action, Op

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_distributed import _config as distributed_config  # noqa: E402
from test_distributed import _run_all  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

STEPS = 4
SCALING = {"loss_scale": 2.0**40, "loss_scale_backoff": 2.0**-30, "loss_scale_growth": 2.0, "loss_scale_interval": 2}
"""Step 0 overflows at 2**40; steps 1 and 2 run at 2**10; step 3 at 2**11."""
SCALES = [2.0**40, 2.0**10, 2.0**10, 2.0**11]


def _config(name: str, recompute: bool = False, **overrides: object) -> TrainConfig | None:
    """A tiny fp16 mlp run of ``name`` on 2 ranks with the first T the schedule accepts (``test_distributed``'s)."""
    return distributed_config(name, 2, recompute, steps=STEPS, precision="fp16", **{**SCALING, **overrides})


def _cases() -> dict[str, TrainConfig]:
    cases = {name: _config(name) for name, info in SCHEDULES.items() if info.synchronous}
    cases["zb-h1+recompute"] = _config("zb-h1", True)
    cases["1f1b-adamw"] = _config("1f1b", optimizer="adamw", lr=1e-2)
    # unscaled before the norm: post-validation's (one pipeline) and the all-reduced one (data parallel, ZeRO-1)
    cases["zb-h1-clip"] = _config("zb-h1", clip_grad_norm=0.05)
    dp = _config("1f1b", num_stages=1, data_parallel=2, zero=1, clip_grad_norm=0.05, batch_size=14)
    cases["1f1b-dp2-zero1-clip"] = dp
    cases["1f1b-dp2-zero3"] = _config("1f1b", num_stages=1, data_parallel=2, zero=3, batch_size=14)
    gpt = ModelSpec(kind="gpt", layers=2, hidden=16, heads=2, seq_len=8)  # its tensor-parallel plan
    cases["gpt-tp2"] = train_config(
        schedule="1f1b",
        num_stages=1,
        tensor_parallel=2,
        num_microbatches=4,
        model=gpt,
        batch_size=7,
        lr=0.05,
        steps=STEPS,
        collect_parameters=True,
        precision="fp16",
        **SCALING,
    )
    return {k: v for k, v in cases.items() if v is not None}


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[TrainConfig, RunRecord]]:
    cases = _cases()
    records = launch(_run_all, list(cases.values()), 2, LaunchOptions(timeout_s=120))
    return dict(zip(cases, zip(cases.values(), records)))


@functools.cache
def _plain(model: ModelSpec, batch_size: int, t: int, optimizer: str, lr: float, clip: float | None) -> TrainResult:
    """One process, GradScaler with the run's four numbers."""
    scaler = torch.amp.GradScaler(
        "cpu",
        init_scale=SCALING["loss_scale"],
        growth_factor=SCALING["loss_scale_growth"],
        backoff_factor=SCALING["loss_scale_backoff"],
        growth_interval=SCALING["loss_scale_interval"],
    )
    return run_plain(
        model,
        steps=STEPS,
        batch_size=batch_size,
        num_microbatches=t,
        optimizer_factory=optimizer_factory(train_config(optimizer=optimizer, lr=lr)),
        precision="fp16",
        scaler=scaler,
        clip_grad_norm=clip,
    )


def _names() -> list[str]:
    names = [n for n, info in SCHEDULES.items() if info.synchronous]
    return names + ["zb-h1+recompute", "1f1b-adamw", "zb-h1-clip", "1f1b-dp2-zero1-clip", "1f1b-dp2-zero3", "gpt-tp2"]


@pytest.mark.parametrize("case", _names())
def test_fp16_run_equals_one_process_with_grad_scaler(
    runs: dict[str, tuple[TrainConfig, RunRecord]], case: str
) -> None:
    if case not in runs:
        pytest.skip(f"{case} cannot run on 2 ranks (see its ScheduleError)")
    config, record = runs[case]
    plain = _plain(
        config.model,
        config.batch_size,
        config.num_microbatches * config.parallel.data_parallel,
        config.optimizer,
        config.lr,
        config.training.clip_grad_norm,
    )
    # tensor parallelism splits the float16 matmuls, whose sums round apart from one process's (bf16's tolerance)
    tolerance = {"rtol": 1e-2, "atol": 1e-3} if config.parallel.tensor_parallel > 1 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(record.losses, plain.losses, **tolerance)
    # the overflowing step skipped on every rank, the scale lowered, then grown after 2 clean steps
    assert [r.overflow_steps for r in record.ranks] == [[0]] * len(record.ranks)
    assert [r.loss_scales for r in record.ranks] == [SCALES] * len(record.ranks)
    assert record.skipped_steps == []  # not --on-nonfinite's: the run neither stopped nor counted it as divergence
    assert record.losses[-1] < record.losses[1]  # it trains after the skipped step
    seen = set()
    for rank_record in record.ranks:
        for params in rank_record.parameters.values():
            for name, value in params.items():
                torch.testing.assert_close(value, plain.parameters[name], **tolerance)
                seen.add(name)
    assert seen == set(plain.parameters)


def test_the_overflowing_step_moves_no_weight(runs: dict[str, tuple[TrainConfig, RunRecord]]) -> None:
    """One step, its scale overflowing: every stage's parameters are still the initial ones, bitwise."""
    config = _config("1f1b")
    assert config is not None
    (record,) = launch(_run_all, [config.replace(steps=1)], 2, LaunchOptions(timeout_s=60))
    initial = run_plain(config.model, steps=0, batch_size=config.batch_size, num_microbatches=4).parameters
    assert record.overflow_steps == [0]
    report = build_report(build_schedule(config), record)  # the JSON record says it
    assert report["overflow_steps"] == [0] and report["loss_scales"] == [2.0**40]
    for rank_record in record.ranks:
        for params in rank_record.parameters.values():
            for name, value in params.items():
                assert torch.equal(value, initial[name]), name


def test_resume_goes_on_with_the_scale_and_its_growth_count(tmp_path: Path) -> None:
    """2 steps, saved, 2 more resumed: the scale after the overflow (2**10) and the clean step counted carry over,
    so the 4th step grows it as an unbroken run does."""
    config = _config("1f1b", save=str(tmp_path / "ckpt"))
    assert config is not None
    first, straight = launch(
        _run_all, [config.replace(steps=2), config.replace(save=None)], 2, LaunchOptions(timeout_s=60)
    )
    (resumed,) = launch(
        _run_all,
        [config.replace(steps=2, save=None, resume=str(tmp_path / "ckpt"))],
        2,
        LaunchOptions(timeout_s=60),
    )
    assert first.ranks[0].loss_scales + resumed.ranks[0].loss_scales == SCALES == straight.ranks[0].loss_scales
    torch.testing.assert_close(first.losses + resumed.losses, straight.losses, rtol=0, atol=0)


def test_loss_scale_follows_grad_scaler() -> None:
    """The update rule and the state dict are GradScaler's, step for step, through backoffs and growths."""
    ours = LossScale(4.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=3)
    theirs = torch.amp.GradScaler("cpu", init_scale=4.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=3)
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.1)
    for found in (False, False, False, True, False, False, False, False, True):
        theirs.scale(torch.ones(()))  # creates its scale tensor
        param.grad = torch.full((1,), float("inf") if found else 1.0)
        theirs.step(optimizer)
        theirs.update()
        ours.update(found)
        assert ours.value == theirs.get_scale()
    assert ours.state_dict() == theirs.state_dict()
    again = LossScale(1.0)
    again.load_state_dict(theirs.state_dict())
    assert again.state_dict()["_growth_tracker"] == theirs.state_dict()["_growth_tracker"]


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"schedule": "pipedream"}, "--precision fp16 skips the update of a step whose gradients overflow"),
        ({"loss_scale": 0.0}, "--loss-scale 0.0 is invalid; give a finite loss scale > 0"),
        ({"loss_scale_backoff": 1.0}, "--loss-scale-backoff 1.0 is invalid; give a factor in (0, 1)"),
        ({"loss_scale_growth": 1.0}, "--loss-scale-growth 1.0 is invalid; give a finite factor > 1"),
        ({"loss_scale_interval": 0}, "--loss-scale-interval 0 is invalid"),
        ({"precision": "bf16", "loss_scale": 8.0}, "--loss-scale applies to --precision fp16; give --precision fp16"),
    ],
)
def test_fp16_refusals_are_one_line(fields: dict[str, object], said: str) -> None:
    with pytest.raises(UserError, match=said.replace("(", r"\(").replace(")", r"\)")):
        train_config(**{"precision": "fp16", "num_stages": 2, **fields})


def test_a_written_schedule_with_a_backward_after_its_first_update_is_refused() -> None:
    """The overflow check at a rank's first U must see every gradient of the step: a later W is one line."""
    row = [Action(0, Op.F, 0), Action(0, Op.I, 0), Action(0, Op.U, 0), Action(0, Op.W, 0)]
    check_row(row[:2] + row[3:] + row[2:3], 0)  # U last: fine
    with pytest.raises(UserError, match=r"rank 0: --precision fp16 checks every gradient .* and 0W0 comes after it"):
        check_row(row, 0)
