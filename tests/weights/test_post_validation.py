"""Post-validation gives the weights of synchronous clipping and skipping (float64, rel 1e-12)."""

from __future__ import annotations

import math

import pytest
import torch

from pipeweave.weights.post_validation import SGD, AdamW, GradState, PostValidatedStep


def _grads(step: int, stage: int) -> torch.Tensor:
    g = torch.linspace(-1, 1, 5, dtype=torch.float64) * (1 + step + stage)
    if step == 2 and stage == 1:
        g[3] = math.nan  # a NaN on stage 1 only: every stage must skip step 2
    if step == 4:
        g = g * 50  # a step that needs clipping
    return g


def _synchronous(make: type, steps: int, max_norm: float) -> list[torch.Tensor]:
    """Reference: all-reduce first, then skip or clip, then step (what a barrier would do)."""
    params = [torch.ones(5, dtype=torch.float64) for _ in range(2)]
    opts = [make() for _ in params]
    for k in range(steps):
        grads = [_grads(k, s) for s in range(2)]
        sq = sum(float(g.pow(2).sum()) for g in grads)
        if not math.isfinite(sq):
            continue
        norm = math.sqrt(sq)
        factor = max_norm / (norm + 1e-6) if norm > max_norm else 1.0
        for p, g, opt in zip(params, grads, opts):
            opt.step([p], [g * factor])
    return params


def _post_validated(make: type, steps: int, max_norm: float) -> tuple[list[torch.Tensor], list[str]]:
    params = [torch.nn.Parameter(torch.ones(5, dtype=torch.float64)) for _ in range(2)]
    stages = [PostValidatedStep([p], make(), max_norm) for p in params]
    outcomes = []
    for k in range(steps):
        partial = GradState()
        for s, (p, stage) in enumerate(zip(params, stages)):
            p.grad = _grads(k, s)
            partial = partial.combine(GradState.of([p]))  # passed down the pipeline
            stage.step_optimistic(partial)  # stage 0 steps before seeing stage 1's NaN
        outcomes += [stage.validate(partial) for stage in stages]
    return [p.detach() for p in params], outcomes


@pytest.mark.parametrize(
    "make",
    [
        lambda: SGD(lr=0.05, momentum=0.9, weight_decay=0.01),
        lambda: SGD(lr=0.05),
        lambda: AdamW(lr=0.01, weight_decay=0.1),
    ],
)
def test_post_validation_equals_synchronous_clip_and_skip(make: type) -> None:
    expected = _synchronous(make, 6, max_norm=20.0)
    got, outcomes = _post_validated(make, 6, max_norm=20.0)
    assert outcomes[4:6] == ["skipped", "skipped"]  # step 2: the NaN on stage 1
    assert "clipped" in outcomes and "kept" in outcomes
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-14)


def test_undo_inverts_a_step_to_a_few_ulps() -> None:
    p = torch.randn(100, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    g = torch.randn(100, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for opt in (SGD(lr=0.1, momentum=0.9, weight_decay=0.01), AdamW(lr=0.01)):
        q = p.clone()
        opt.step([q], [g])
        opt.step([q], [g * 2])
        before = q.clone()
        opt.step([q], [g * 3])
        opt.undo([q], [g * 3], first=False)
        assert (q - before).abs().max() <= 8 * torch.finfo(torch.float64).eps * before.abs().max()


def test_a_parameter_without_gradient_is_refused() -> None:
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    a.grad = torch.ones(2)  # b has none: the optimizers index their state by position
    with pytest.raises(ValueError, match=r"parameters \[1\] have no gradient"):
        PostValidatedStep([a, b], SGD(lr=0.1)).step_optimistic(GradState.of([a, b]))
