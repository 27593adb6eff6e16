"""Post-validation in a distributed run gives the weights of synchronous clipping and skipping.

A zb-auto (ZB-2p-like) run on 3 gloo ranks, with ``TrainConfig.post_validation``,
against plain single-process training whose optimizer clips the global norm
with torch.nn.utils.clip_grad_norm_ and skips a step with a non-finite
gradient. The NaN is put on the LAST stage only, so the first stages step
optimistically on finite partial state and must roll back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import pytest
import torch
from config_defaults import train_config

from pipeweave.config import TrainConfig
from pipeweave.errors import UserError
from pipeweave.models import ModelSpec
from pipeweave.runtime.context import RankContext
from pipeweave.runtime.plain import run_plain
from pipeweave.runtime.run.job import run_rank
from pipeweave.runtime.run.launch import LaunchOptions, launch
from pipeweave.runtime.run.prepare import optimizer_factory, prepare
from pipeweave.runtime.run.record import RunRecord
from pipeweave.runtime.stage.post_validation import PostValidation

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

RANKS, T, STEPS, FAULT_STEP = 3, 6, 5, 2
SPEC = ModelSpec(kind="mlp", layers=6, hidden=8)


class _Synchronous:
    """What a barrier before the step gives: global norm, then skip or clip, then the torch optimizer."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        inner: torch.optim.Optimizer,
        max_norm: float | None,
        fault_step: int | None,
        norms: list[float],
    ) -> None:
        self.params, self.inner, self.max_norm, self.fault_step, self.norms = params, inner, max_norm, fault_step, norms
        self.k = 0

    def step(self) -> None:
        k, self.k = self.k, self.k + 1
        if k == self.fault_step:
            self.params[-1].grad.view(-1)[0] = math.nan  # type: ignore[union-attr]
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.max_norm or math.inf))
        self.norms.append(norm)
        if math.isfinite(norm):
            self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)


def _plain(
    optimizer: str, max_norm: float | None, fault_step: int | None, norms: list[float] | None = None
) -> dict[str, torch.Tensor]:
    torch_factory = train_config(optimizer=optimizer, lr=0.05, momentum=0.9 if optimizer == "sgd" else 0.0)

    def factory(params: Iterable[torch.nn.Parameter]) -> _Synchronous:
        params = list(params)
        return _Synchronous(
            params, optimizer_factory(torch_factory)(params), max_norm, fault_step, norms if norms is not None else []
        )

    make: Callable[..., object] = factory
    return run_plain(SPEC, steps=STEPS, batch_size=2 * T, num_microbatches=T, optimizer_factory=make).parameters  # type: ignore[arg-type]


def _config(optimizer: str, options: PostValidation) -> TrainConfig:
    return train_config(
        schedule="zb-auto",
        num_stages=RANKS,
        num_microbatches=T,
        model=SPEC,
        batch_size=2 * T,
        steps=STEPS,
        lr=0.05,
        momentum=0.9 if optimizer == "sgd" else 0.0,
        optimizer=optimizer,
        collect_parameters=True,
        options=(("activation_limit", 2.0), ("time_b", 2.0)),
        post_validation=options,
        on_nonfinite="skip",
    )  # the NaN step is skipped, not the run stopped


def _run_all(context: RankContext, configs: list[TrainConfig]) -> list[RunRecord | None]:
    return [run_rank(context, prepare(c)) for c in configs]


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[TrainConfig, RunRecord, float]]:
    cases = {}
    for optimizer in ("sgd", "adamw"):
        norms: list[float] = []
        _plain(optimizer, None, None, norms)
        max_norm = sorted(norms)[len(norms) // 2]  # clips about half of the steps
        config = _config(optimizer, PostValidation(max_norm=max_norm, fault=(FAULT_STEP, RANKS - 1)))
        prepare(config)
        cases[optimizer] = (config, max_norm)
    records = launch(_run_all, [c for c, _ in cases.values()], RANKS, LaunchOptions(timeout_s=60))
    return {name: (c, r, m) for (name, (c, m)), r in zip(cases.items(), records)}


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_distributed_post_validation_equals_synchronous_clip_and_skip(
    runs: dict[str, tuple[TrainConfig, RunRecord, float]], optimizer: str
) -> None:
    config, record, max_norm = runs[optimizer]
    norms: list[float] = []
    expected = _plain(optimizer, max_norm, FAULT_STEP, norms)
    # the run exercises all three outcomes: skipped (the NaN), clipped, kept
    assert math.isnan(norms[FAULT_STEP])
    finite = [n for n in norms if math.isfinite(n)]
    assert any(n > max_norm for n in finite) and any(n < max_norm for n in finite)
    seen = set()
    for rank_record in record.ranks:
        for params in rank_record.parameters.values():
            for name, value in params.items():
                assert torch.isfinite(value).all()
                torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6)
                seen.add(name)
    assert seen == set(expected)


def _clipped(schedule: str) -> TrainConfig:
    """A 2-stage run of ``schedule`` post-validated (clipping at 1)."""
    return train_config(
        schedule=schedule,
        num_stages=2,
        num_microbatches=4,
        model=SPEC,
        batch_size=8,
        post_validation=PostValidation(max_norm=1.0),
    )


def test_post_validation_refuses_a_v_schedule() -> None:
    with pytest.raises(UserError, match="one stage per rank"):
        prepare(_clipped("zb-v-auto"))
    with pytest.raises(UserError, match="clip-grad-norm"):
        PostValidation(max_norm=0.0)


def test_post_validation_is_not_refused_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its messages are ordered like the schedule's, not paired by tag (tests/runtime/test_batched_p2p.py):
    NCCL-safe, so a CUDA run is prepared like a CPU one (it was refused while pairing rested on gloo's tags)."""
    import pipeweave.runtime.run.prepare as prepare_module

    monkeypatch.setattr(prepare_module, "device_for", lambda rank: torch.device("cuda", rank), raising=False)
    assert prepare(_clipped("1f1b")).config.training.post_validation == PostValidation(max_norm=1.0)
