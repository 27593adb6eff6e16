"""A model the planner knows only from a profile (``pipeweave partition --save-costs``), scaled to the target GPU.

A profile holds, per layer and for one microbatch of ``m0`` samples on the
machine that profiled it, the measured F, I and W seconds, the activation,
output and parameter bytes, and the FLOPs ``torch.utils.flop_counter`` counted
(``runtime.profile``). On the target, for a microbatch of ``b`` samples::

    time = measured time x (b / m0) x R_profile / R_target

or, given profiles at several microbatch sizes (``--costs A B ...``), each
layer's measured time interpolated linearly in ``b`` between the two nearest
(scaled by ``b / m`` beyond the smallest or the largest size), since a small
microbatch runs less efficiently than a large one (on a CPU a block of 2
samples takes about half the time of one of 8, not a quarter):

- ``R_profile``, the profiling machine's effective rate on these layers: the
  counted FLOPs over the measured F + I + W seconds (or ``--profile-tflops``);
- ``R_target``, the target's: its peak x ``eta_max`` (the fraction of peak a
  wide GEMM reaches, ``planner.efficiency``'s calibration). Without a peak
  (``--gpu custom`` without ``--peak-tflops``) the target is the profiling
  machine itself and the times are used as measured.

One ratio for every layer: it cannot capture what does not scale with FLOP
rate -- element-wise kernels bound by memory bandwidth, GEMMs too small to fill
the target (or, profiled on a GPU, a CPU's different balance), a change of
precision between the profile and the run (profile under ``--precision bf16``
for a BF16 target), time that does not grow linearly with the microbatch,
per-action launch or dispatch overhead (``dispatch``, given apart). A profiled
layer cannot be split over tensor-parallel ranks (its structure is unknown):
such a model is planned with TP 1. Parts are cut as ``pipeweave train`` cuts
them by default (``partition.methods.uniform``). Activations scale with
``b / m0``; with recomputation (``"full"``: the stage's forward replayed before
its backward, as ``train --recompute`` does) a part keeps its input only, and
the replay adds the part's F to its I. Between I and W a part is counted as
still holding all its activations (an upper bound: the profile does not split
them). Parameters are counted from their bytes at 4 per parameter (FP32
master weights, which ``--precision bf16`` keeps too).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from pipeweave.errors import UserError
from pipeweave.partition.methods import PartitionContext, uniform
from pipeweave.partition.problem import LayerCosts
from pipeweave.planner.transformer import Transformer

PROFILE_PARAM_BYTES = 4.0
"""Bytes per parameter in a profile (FP32 weights)."""


@dataclass(frozen=True, kw_only=True)
class ProfiledModel:
    """A profiled model and its scaling to the target (module docstring).

    Example:
        >>> costs = LayerCosts.uniform(4, f=2.0, b=2.0, w=2.0)
        >>> m = ProfiledModel(costs=costs, profile_microbatch=2, scale=0.5)
        >>> m.part_times(2, microbatch_size=4, recompute="none")[0]
        (4.0, 4.0)
    """

    costs: LayerCosts
    profile_microbatch: int
    """m0, the samples of the microbatch the profile measured."""
    others: tuple[tuple[int, LayerCosts], ...] = ()
    """Profiles of the same model at other microbatch sizes, ``(m, costs)``, for the times alone."""
    scale: float = 1.0
    """R_profile / R_target: target seconds per measured second."""
    name: str = "profiled"
    recomputations = ("none", "full")
    """What a profiled model can recompute: nothing, or the whole stage (``train --recompute``)."""

    def __post_init__(self) -> None:
        if self.profile_microbatch < 1 or not 0 < self.scale < math.inf:
            raise UserError(
                f"profile microbatch {self.profile_microbatch}, scale {self.scale} are invalid; give "
                "a profile of >= 1 sample per microbatch and finite rates > 0"
            )

    @property
    def layers(self) -> int:
        return self.costs.num_layers

    @property
    def parameters(self) -> float:
        return sum(self.costs.params) / PROFILE_PARAM_BYTES

    def splits_into(self, parts: int) -> bool:
        """Whether the layers can be cut into ``parts`` non-empty parts."""
        return 1 <= parts <= self.layers

    def splits_evenly(self, parts: int) -> bool:
        """``splits_into``: a profiled model's parts are cut as ``train --partition uniform`` cuts them."""
        return self.splits_into(parts)

    @staticmethod
    def splits_tensors(tp: int) -> bool:
        """TP 1 only (module docstring)."""
        return tp == 1

    @functools.lru_cache(maxsize=256)  # noqa: B019 - a profile lives as long as the search that asks
    def bounds(self, num_parts: int) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` layers of each part, as ``train --partition uniform`` cuts them."""
        return uniform(self.costs, num_parts, PartitionContext()).bounds

    def _per_part(self, name: str, num_parts: int, factor: float) -> tuple[float, ...]:
        return tuple(self.costs.total(name, a, z) * factor for a, z in self.bounds(num_parts))

    def part_times(
        self, num_parts: int, *, microbatch_size: int, recompute: str
    ) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
        """Per part, target seconds of F, I (the replayed F in it with recomputation) and W."""
        f = self._times("forward", num_parts, microbatch_size)
        i = self._times("input_grad", num_parts, microbatch_size)
        if recompute == "full":
            i = tuple(a + b for a, b in zip(i, f))
        return f, i, self._times("weight_grad", num_parts, microbatch_size)

    def _times(self, name: str, num_parts: int, b: int) -> tuple[float, ...]:
        """Per part, target seconds of one op at microbatch ``b``, interpolated between profiles (module
        docstring)."""
        sizes = sorted(((self.profile_microbatch, self.costs), *self.others), key=lambda x: x[0])
        below, above = [x for x in sizes if x[0] <= b], [x for x in sizes if x[0] >= b]
        if not below or not above or below[-1][0] == above[0][0]:
            m, costs = below[-1] if below else above[0]
            return tuple(self.scale * b / m * costs.total(name, a, z) for a, z in self.bounds(num_parts))
        (m0, c0), (m1, c1) = below[-1], above[0]
        w = (b - m0) / (m1 - m0)
        return tuple(
            self.scale * ((1 - w) * c0.total(name, a, z) + w * c1.total(name, a, z)) for a, z in self.bounds(num_parts)
        )

    def part_parameters(self, num_parts: int) -> tuple[float, ...]:
        return self._per_part("params", num_parts, 1.0 / PROFILE_PARAM_BYTES)

    def part_activations(
        self, num_parts: int, *, microbatch_size: int, recompute: str
    ) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
        """Per part, bytes ``(held, stash, during)`` for one microbatch of ``microbatch_size``: held from F to
        the backward, held between I and W, used on top while a replayed forward runs (module docstring)."""
        factor = microbatch_size / self.profile_microbatch
        whole = tuple(
            self.costs.total("activation", a, z) * factor + self.costs.output[z - 1] * factor
            for a, z in self.bounds(num_parts)
        )
        if recompute != "full":
            return whole, whole, (0.0,) * num_parts
        inputs = tuple(self.costs.output[a - 1] * factor if a else 0.0 for a, _ in self.bounds(num_parts))
        return inputs, whole, whole

    def boundary_bytes(self, num_parts: int, microbatch_size: int) -> float:
        """The largest message between parts: a part's output for one microbatch."""
        cuts = [z - 1 for _, z in self.bounds(num_parts)[:-1]]
        factor = microbatch_size / self.profile_microbatch
        return max((self.costs.output[k] * factor for k in cuts), default=0.0)

    def step_flops(self, batch: int) -> float:
        """FLOPs of a step on ``batch`` samples, as counted (recomputation not counted)."""
        return sum(self.costs.flops) * batch / self.profile_microbatch


Model = Transformer | ProfiledModel
"""What the planner plans: a GPT by its shape, or a profiled model."""


def profile_rate(*profiles: LayerCosts) -> float:
    """R_profile: counted FLOPs over the measured F + I + W seconds of every layer (of every profile).

    Raises:
        UserError: a profile without counted FLOPs (written before the profiler counted them) or times.
    """
    seconds = sum(c.time_of(0, c.num_layers) for c in profiles)
    flops = sum(sum(c.flops) for c in profiles)
    if any(sum(c.flops) <= 0 for c in profiles) or seconds <= 0:
        raise UserError(
            "the profile holds no counted FLOPs (written before pipeweave counted them) or no times; "
            "profile again (pipeweave partition --refresh --save-costs FILE) or give --profile-tflops"
        )
    return flops / seconds


def profiled_model(
    costs: LayerCosts,
    *,
    target_flops: float | None,
    eta_max: float,
    rate: float | None = None,
    name: str = "profiled",
    others: tuple[LayerCosts, ...] = (),
) -> ProfiledModel:
    """The profile scaled to a target of peak ``target_flops`` (None: the profiling machine itself).

    Args:
        costs: the profile; its ``meta["microbatch_size"]`` is m0 (1 if absent).
        target_flops: the target's peak FLOP/s, or None.
        eta_max: the fraction of peak the target's wide GEMMs reach.
        rate: R_profile in FLOP/s (None: measured from the profiles, ``profile_rate``).
        others: profiles of the same model at other microbatch sizes (module docstring).

    Raises:
        UserError: ``others`` of another model (other layers) or of a microbatch size given twice.

    Example:
        >>> costs = LayerCosts(**{**LayerCosts.uniform(2).to_json(), "flops": [3e9, 3e9]})
        >>> profiled_model(costs, target_flops=1e12, eta_max=0.5).scale  # 1 GFLOP/s profiled, 500 on the target
        0.002
    """
    sized = tuple((_microbatch_of(c), c) for c in (costs, *others))
    if len({m for m, _ in sized}) < len(sized):
        raise UserError(f"--costs: two profiles at microbatch size {sorted(m for m, _ in sized)}; give one per size")
    if any(c.names != costs.names for c in others):
        raise UserError("--costs: the profiles are of different models (other layers); give profiles of one model")
    scale = 1.0
    if target_flops is not None:
        scale = (profile_rate(costs, *others) if rate is None else rate) / (target_flops * eta_max)
    return ProfiledModel(costs=costs, profile_microbatch=sized[0][0], scale=scale, name=name, others=sized[1:])


def _microbatch_of(costs: LayerCosts) -> int:
    """The microbatch size a profile measured (``meta``; 1 if it does not say)."""
    return int(costs.meta.get("microbatch_size", 1)) if isinstance(costs.meta, dict) else 1
