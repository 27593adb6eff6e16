"""Plain single-process training with gradient accumulation: the oracle every pipelined run must equal."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from pipeweave.data import DataSource, data_source, step_microbatches
from pipeweave.models import boundary
from pipeweave.models.boundary import Boundary, num_samples
from pipeweave.models.build import build_layers
from pipeweave.models.moe import AuxLosses, attach_aux_losses
from pipeweave.models.precision import autocast
from pipeweave.models.precision import check as precision_check
from pipeweave.models.randomness import is_keyed, run_keyed
from pipeweave.models.spec import ModelSpec, loss_fn
from pipeweave.runtime.stage.lr_schedule import set_lr
from pipeweave.runtime.stage.worker import OptimizerFactory, sgd


@dataclass
class TrainResult:
    """The outcome of a training run.

    Attributes:
        losses: the mini-batch mean loss of each step (before that step's update).
        parameters: final parameters by global name ``"<layer>.<name>"``.
        stage_parameters: per stage, its final parameters (pipelined runs only;
            the replicas of a part must agree).
        peak_activation_bytes: per stage, the most activation bytes it held
            at once over the run (pipelined runs only).
    """

    losses: list[float]
    parameters: dict[str, torch.Tensor]
    stage_parameters: list[dict[str, torch.Tensor]] = field(default_factory=list)
    peak_activation_bytes: list[int] = field(default_factory=list)


def run_plain(
    spec: ModelSpec,
    *,
    steps: int,
    batch_size: int,
    num_microbatches: int,
    optimizer_factory: OptimizerFactory | None = None,
    seed: int = 0,
    data: DataSource | None = None,
    lr_at: Callable[[int], float] | None = None,
    precision: str = "fp32",
    scaler: torch.amp.GradScaler | None = None,
    clip_grad_norm: float | None = None,
) -> TrainResult:
    """Train the whole model in one process, accumulating gradients over the microbatches of each step.

    Each microbatch's loss is scaled by its share of the mini-batch, so the
    accumulated gradient is the mini-batch mean loss's gradient whatever the
    split (the last microbatch may be smaller). A mixture of experts' auxiliary
    losses are scaled alike and are part of the loss (``models.moe``).

    Args:
        spec: the model (its seed fixes the initialisation).
        steps: optimizer steps.
        batch_size: samples per mini-batch.
        num_microbatches: T, microbatches per mini-batch.
        optimizer_factory: builds the optimizer (default SGD, lr 0.1).
        seed: data seed.
        data: a data source (default ``data_source(spec, ...)``).
        lr_at: the learning rate of each step (``LrSchedule.at``); None keeps the optimizer's.
        precision: ``fp32``, ``bf16`` or ``fp16`` (forwards under bfloat16 or float16 autocast,
            ``models.precision``).
        scaler: ``fp16``'s loss scaling (default ``torch.amp.GradScaler("cpu")``, its defaults): each
            microbatch's backward from ``scaler.scale(loss)``, then ``scaler.step`` and ``scaler.update``.
        clip_grad_norm: clip the gradient norm to this before each step (``torch.nn.utils.clip_grad_norm_``;
            under ``fp16`` after ``scaler.unscale_``, as PyTorch's AMP recipe does).

    Raises:
        UserError: fewer samples than microbatches.

    Example:
        >>> spec = ModelSpec(kind="mlp", layers=2, hidden=8)
        >>> r = run_plain(spec, steps=3, batch_size=8, num_microbatches=2)
        >>> r.losses[0] > r.losses[-1]
        True
    """
    precision_check(precision)
    model = nn.ModuleDict({str(i): layer for i, layer in enumerate(build_layers(spec, range(spec.num_layers)))})
    optimizer = (optimizer_factory or sgd())(list(model.parameters()))
    aux = attach_aux_losses(model, batch_size)
    loss = loss_fn(spec)
    source = data if data is not None else data_source(spec, batch_size=batch_size, seed=seed)
    if precision == "fp16" and scaler is None:
        scaler = torch.amp.GradScaler("cpu")
    losses = []
    for step in range(steps):
        if scaler is not None and precision == "fp16":  # the auxiliary losses' backward scaled as the loss's
            aux.grad_scale = scaler.get_scale()
        pairs = zip(*step_microbatches(source, step, num_microbatches))
        step_losses = [
            _microbatch_loss(model, spec, loss, x, target, batch_size, precision, step, j, scaler) + _taken(aux)
            for j, (x, target) in enumerate(pairs)
        ]
        losses.append(sum(step_losses))
        if lr_at is not None:
            set_lr(optimizer, lr_at(step))
        _step(optimizer, list(model.parameters()), scaler if precision == "fp16" else None, clip_grad_norm)
        optimizer.zero_grad(set_to_none=True)
    return TrainResult(losses, {k: p.detach().clone() for k, p in model.named_parameters()})


def _taken(aux: AuxLosses) -> float:
    """The auxiliary losses of the microbatch just run (0 without experts)."""
    value = aux.take()
    return 0.0 if value is None else value.item()


def _step(
    optimizer: torch.optim.Optimizer,
    params: list[torch.Tensor],
    scaler: torch.amp.GradScaler | None,
    clip_grad_norm: float | None,
) -> None:
    """The optimizer step: gradients unscaled (fp16), clipped, then applied -- or skipped where one overflowed."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    if clip_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
    if scaler is None:
        optimizer.step()
        return
    scaler.step(optimizer)  # skipped if a gradient is inf or NaN
    scaler.update()


def _microbatch_loss(
    model: nn.ModuleDict,
    spec: ModelSpec,
    loss: Callable[..., torch.Tensor],
    x: Boundary,
    target: Boundary,
    batch_size: int,
    precision: str,
    step: int,
    j: int,
    scaler: torch.amp.GradScaler | None = None,
) -> float:
    """Forward and backward of microbatch ``j`` of ``step``, its loss scaled by its share of the mini-batch."""
    with autocast(precision, torch.device("cpu")):
        if is_keyed(spec):  # dropout masks keyed as the pipeline's (models.randomness)
            x = run_keyed(enumerate(model.values()), x, seed=spec.seed, step=step, microbatch=j)
        else:
            for layer in model.values():
                x = boundary.call(layer, x)
        mb_loss = loss(x, target) * (num_samples(target) / batch_size)
    (scaler.scale(mb_loss) if scaler is not None and precision == "fp16" else mb_loss).backward()
    return mb_loss.item()
