"""Numeric precision of a run: float32, or bfloat16 or float16 mixed precision through ``torch.autocast``.

``bf16`` is PyTorch's automatic mixed precision: parameters, gradients and
optimizer state stay float32; inside each layer call autocast runs the matmuls
(linear layers, attention) in bfloat16 and keeps float32 where autocast keeps
it (the losses, reductions). Every forward of a stage -- F, a recomputation's
replay, evaluation -- and plain training's forward run under the same
autocast, so a pipelined run still equals plain training with the same
precision. Backward passes run outside autocast, as PyTorch recommends; the
layers of ``models.layers`` accumulate their bfloat16 weight gradients into
float32 ``.grad`` as autograd does for ``nn.Linear``.

``fp16`` is the same with float16, whose range is small (up to 65504, down to
about 6e-8): its gradients underflow unless the loss is scaled, so a run in
fp16 scales it dynamically as ``torch.amp.GradScaler`` does
(``runtime.loss_scale``; plain training uses GradScaler itself).

Example:
    >>> with autocast("bf16", torch.device("cpu")):
    ...     torch.ones(2, 3).matmul(torch.ones(3, 1)).dtype
    torch.bfloat16
    >>> with autocast("fp16", torch.device("cpu")):
    ...     torch.ones(2, 3).matmul(torch.ones(3, 1)).dtype
    torch.float16
    >>> check("bfloat16")
    Traceback (most recent call last):
    ...
    pipeweave.errors.UserError: --precision 'bfloat16' is unknown; give one of: fp32, bf16, fp16
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from pipeweave.config.run_sections import PRECISIONS, check_precision  # noqa: F401  (PRECISIONS re-exported)

"""What ``--precision`` takes."""


def check(precision: str) -> str:
    """``precision`` if it is one of ``PRECISIONS``; one line naming the value otherwise (``config``'s check)."""
    check_precision(precision)
    return precision


def autocast(precision: str, device: torch.device) -> Any:
    """The context a forward runs in: ``torch.autocast`` to bfloat16 for ``bf16``, to float16 for ``fp16``,
    nothing for ``fp32``."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    return torch.autocast(autocast_device_type(device), dtype=dtype)


def autocast_device_type(device: torch.device) -> str:
    """The autocast state ``device`` follows: its own, but the CPU's for ``meta`` tensors, which have none.

    ``runtime.run.memory`` runs a stage on the meta device to count its activation bytes
    without computing or allocating them; there a forward casts as on the CPU.
    """
    return "cpu" if device.type == "meta" else device.type
