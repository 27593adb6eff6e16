"""The optimizer registry: each entry trains as torch.optim's (or its paper's) rule, and predicts its own look-ahead.

Oracles independent of ``weights.optimizers``: torch.optim's classes for plain
training; AdaBelief's Algorithm 2 (Zhuang et al. 2020) written out in scalars;
each optimizer's next step written from its paper's formulas and applied s
times, with the decoupled decay compounding.
"""

from __future__ import annotations

import math
import typing

import pytest
import torch

from pipeweave.config.run_sections import OptimizerName
from pipeweave.errors import UserError
from pipeweave.models import ModelSpec
from pipeweave.runtime.plain import run_plain
from pipeweave.weights.optimizers import OPTIMIZERS, AdaBelief, build_optimizer
from pipeweave.weights.prediction import check_predictable, predict_weights

SPEC = ModelSpec(kind="mlp", layers=3, hidden=8)


def test_the_registry_is_the_options_choices() -> None:
    assert set(typing.get_args(OptimizerName)) == set(OPTIMIZERS)


TORCH = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.05),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.05),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.05, momentum=0.9),
}


@pytest.mark.parametrize("name", list(TORCH))
def test_plain_training_with_each_optimizer_equals_torch_optims(name: str) -> None:
    ours = run_plain(
        SPEC,
        steps=20,
        batch_size=8,
        num_microbatches=2,
        optimizer_factory=lambda ps: build_optimizer(name, ps, 0.05, 0.9),
    )
    theirs = run_plain(SPEC, steps=20, batch_size=8, num_microbatches=2, optimizer_factory=TORCH[name])
    torch.testing.assert_close(ours.losses, theirs.losses, rtol=1e-6, atol=0)
    for key, value in theirs.parameters.items():
        torch.testing.assert_close(ours.parameters[key], value, rtol=1e-6, atol=1e-7)


def _adabelief_by_the_paper(w: float, grads: list[float], lr: float, b1: float, b2: float, eps: float, wd: float):
    m = s = 0.0
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        s = b2 * s + (1 - b2) * (g - m) ** 2 + eps
        m_hat, s_hat = m / (1 - b1**t), s / (1 - b2**t)
        w = w * (1 - lr * wd) - lr * m_hat / (math.sqrt(s_hat) + eps)
    return w, m, s


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adabelief_follows_its_papers_update_rule(wd: float) -> None:
    grads = [0.5, -1.0, 2.0, 0.25, 0.25, -0.75]
    p = torch.nn.Parameter(torch.tensor([1.5], dtype=torch.float64))
    opt = AdaBelief([p], lr=0.1, betas=(0.8, 0.9), eps=1e-8, weight_decay=wd)
    for g in grads:
        p.grad = torch.tensor([g], dtype=torch.float64)
        opt.step()
    w, m, s = _adabelief_by_the_paper(1.5, grads, 0.1, 0.8, 0.9, 1e-8, wd)
    assert p.item() == pytest.approx(w, rel=1e-12)
    assert opt.state[p]["exp_avg"].item() == pytest.approx(m, rel=1e-12)
    assert opt.state[p]["exp_avg_var"].item() == pytest.approx(s, rel=1e-12)
    assert int(opt.state[p]["step"]) == len(grads)


def _trained(name: str, momentum: float) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64))
    opt = build_optimizer(name, [p], lr=0.1, momentum=momentum)
    for group in opt.param_groups:
        if "weight_decay" in group and name in ("adamw", "adabelief"):
            group["weight_decay"] = 0.2  # a decay large enough to show
    for g in ([0.3, -1.0, 2.0], [0.1, -0.5, 1.0], [-0.2, 0.4, 0.7]):
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    return p, opt


def _next_step_by_hand(name: str, momentum: float, state: dict, lr: float = 0.1) -> tuple[torch.Tensor, float]:
    """(direction, decay) of the next update, from each optimizer's published rule."""
    if name in ("sgd", "nesterov") or (name == "rmsprop" and momentum):
        return lr * state["momentum_buffer"], 0.0
    if name == "rmsprop":  # Hinton's RMSprop: lr g / (sqrt(E[g^2]) + eps), the last gradient
        return lr * state["grad"] / (state["square_avg"].sqrt() + 1e-8), 0.0
    t = int(state["step"])
    second = state["exp_avg_var"] if name == "adabelief" else state["exp_avg_sq"]
    b2, eps = 0.999, 1e-16 if name == "adabelief" else 1e-8
    m_hat = state["exp_avg"] / (1 - 0.9**t)
    d = lr * m_hat / ((second / (1 - b2**t)).sqrt() + eps)
    return d, lr * 0.2 if name in ("adamw", "adabelief") else 0.0


CASES = [("sgd", 0.9), ("nesterov", 0.9), ("adam", 0.0), ("adamw", 0.0), ("rmsprop", 0.0), ("rmsprop", 0.9)]
CASES += [("adabelief", 0.0)]


@pytest.mark.parametrize(("name", "momentum"), CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("s", [1, 3])
def test_predicted_weights_are_the_optimizers_own_s_step_look_ahead(name: str, momentum: float, s: int) -> None:
    p, opt = _trained(name, momentum)
    d, decay = _next_step_by_hand(name, momentum, opt.state[p])
    w = p.detach().clone()
    for _ in range(s):
        w = w * (1 - decay) - d
    torch.testing.assert_close(predict_weights(opt, [p], s)[0], w, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(w, p.detach())


def test_momentum_sgd_prediction_is_exact_when_the_velocity_holds() -> None:
    """SpecTrain's assumption: with g = (1 - mu) v the velocity stays, and s real steps land on the prediction."""
    p, opt = _trained("sgd", 0.9)
    predicted = predict_weights(opt, [p], 3)[0]
    for _ in range(3):
        p.grad = (1 - 0.9) * opt.state[p]["momentum_buffer"].clone()
        opt.step()
    torch.testing.assert_close(p.detach(), predicted, rtol=1e-12, atol=1e-12)


def test_before_any_step_the_prediction_is_the_weights() -> None:
    for name in OPTIMIZERS:
        p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
        opt = build_optimizer(name, [p], lr=0.1, momentum=0.9)
        assert torch.equal(predict_weights(opt, [p], 2)[0], p.detach())


def test_an_optimizer_prediction_cannot_follow_is_one_line() -> None:
    p = torch.nn.Parameter(torch.tensor([1.0]))
    with pytest.raises(UserError, match="give --momentum 0.9"):
        check_predictable(build_optimizer("sgd", [p], lr=0.1))
    with pytest.raises(UserError, match="Adagrad has no next-step rule; give --optimizer one of"):
        check_predictable(torch.optim.Adagrad([p]))
    with pytest.raises(UserError, match="--optimizer 'lion' is unknown"):
        build_optimizer("lion", [p], lr=0.1)


def test_config_resolves_each_optimizers_defaults_and_refuses_nesterov_without_momentum() -> None:
    from pipeweave.config import TrainConfig

    assert TrainConfig(optimizer="nesterov").momentum == 0.9
    assert TrainConfig(optimizer="adabelief").lr == 3e-3
    assert TrainConfig(optimizer="rmsprop", schedule="xpipe").momentum == 0.9
    with pytest.raises(UserError, match="--optimizer nesterov needs a momentum; give --momentum 0.9"):
        TrainConfig(optimizer="nesterov", momentum=0.0)


def test_the_post_validated_step_refuses_an_optimizer_it_cannot_invert() -> None:
    from pipeweave.config import TrainConfig
    from pipeweave.runtime.run.prepare import prepare

    config = TrainConfig(schedule="1f1b", num_stages=2, optimizer="rmsprop", clip_grad_norm=1.0, model=SPEC)
    with pytest.raises(UserError, match="inverts sgd or adamw, not --optimizer rmsprop; give --optimizer sgd"):
        prepare(config)


def test_a_prediction_without_a_direction_is_refused_before_spawning() -> None:
    from pipeweave.config import TrainConfig
    from pipeweave.runtime.run.prepare import prepare

    for schedule in ("spectrain", "xpipe"):
        config = TrainConfig(schedule=schedule, num_stages=2, optimizer="sgd", momentum=0.0, model=SPEC)
        with pytest.raises(UserError, match="give --momentum 0.9 \\(sgd\\) or another --optimizer"):
            prepare(config)
