"""The random numbers a layer draws (dropout masks), keyed by (seed, step, microbatch, layer).

Plain training draws its dropout masks from one generator in the order it runs
its layers: layer 0 to L-1 for microbatch 0, then for microbatch 1, and so on.
A pipeline runs the same layer calls in another order, spread over ranks, the
replicas of a part (Chimera, GEMS, data parallelism) on different ranks, and
under activation recomputation each forward twice. Reseeding torch's default
generator before every layer call from the key ``(model seed, step,
microbatch, layer)`` makes each mask a function of what it masks, not of when
it is drawn: every synchronous schedule draws the masks plain training draws,
and a replayed forward draws the ones of its first run, so its gradients are
those of the forward that was actually sent on (Megatron-LM and DeepSpeed
keep RNG trackers for the same reason). The caller's own random stream is
saved before a keyed forward and restored after it, so anything else drawing
from torch's generator (a dataset's augmentation) does not see the reseeding.

The reference models (``mlp``, ``gpt``) draw no random numbers, so only
custom models are keyed; the cost per layer call is small (measured in
benchmarks/runtime/README.md).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable

import torch
from torch import nn

from pipeweave.models import boundary
from pipeweave.models.boundary import Boundary
from pipeweave.models.spec import ModelSpec


def is_keyed(spec: ModelSpec) -> bool:
    """Whether ``spec``'s layer calls are keyed: a custom model's (the reference models draw no random numbers)."""
    return spec.kind == "custom"


def draw_seed(seed: int, step: int, microbatch: int, layer: int) -> int:
    """The seed of ``layer``'s forward on ``microbatch`` of ``step`` (63 bits, a hash of the key).

    Example:
        >>> draw_seed(0, 0, 0, 1) == draw_seed(0, 0, 0, 1) != draw_seed(0, 0, 1, 0)
        True
    """
    digest = hashlib.blake2b(struct.pack("<4q", seed, step, microbatch, layer), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _generators(device: torch.device) -> list[torch.Generator]:
    generators = [torch.default_generator]
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        generators.append(torch.cuda.default_generators[index])
    return generators


def run_keyed(
    layers: Iterable[tuple[int, nn.Module]],
    x: Boundary,
    *,
    seed: int,
    step: int,
    microbatch: int,
    device: torch.device | str = "cpu",
) -> Boundary:
    """Run ``(index, layer)`` pairs in turn on ``x``, torch's generator reseeded by the key before each.

    Args:
        layers: the layers with their indices in the whole model.
        x: the input of the first.
        seed: the model's seed (``ModelSpec.seed``).
        step: optimizer steps done before this forward.
        microbatch: the microbatch's index in its mini-batch (the IR's microbatch index).
        device: where the layers run (its generator is reseeded too on CUDA).

    Example:
        >>> drop = nn.Dropout(0.5)
        >>> a = run_keyed([(3, drop)], torch.ones(8), seed=0, step=2, microbatch=1)
        >>> b = run_keyed([(3, drop)], torch.ones(8), seed=0, step=2, microbatch=1)
        >>> bool(torch.equal(a, b))
        True
    """
    generators = _generators(torch.device(device))
    states = [g.get_state() for g in generators]
    try:
        for index, layer in layers:
            value = draw_seed(seed, step, microbatch, index)
            for g in generators:
                g.manual_seed(value)
            x = boundary.call(layer, x)
    finally:
        for g, state in zip(generators, states):
            g.set_state(state)
    return x
