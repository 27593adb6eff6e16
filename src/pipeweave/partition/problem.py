"""A partitioning problem: the per-layer costs of a model, and a partition of its layers into parts.

Costs come from the profiler (``pipeweave.runtime.profile``) or from a JSON
file; every partitioner reads them from here and nothing else, so the
algorithms stay pure (no torch).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeweave.errors import UserError
from pipeweave.sim.cost import MAX_COST

_PER_LAYER = (
    "forward",
    "input_grad",
    "weight_grad",
    "activation",
    "params",
    "output",
    "flops",
    "selective_forward",
    "selective_activation",
)
_OPTIONAL = ("output", "flops", "selective_forward", "selective_activation")
"""Fields a costs file may leave out (older files): 0, 0, 0 and ``activation``."""


def _floats(name: str, values: Sequence[float], num_layers: int) -> tuple[float, ...]:
    if len(values) != num_layers:
        raise UserError(f"{name} has {len(values)} values for {num_layers} layers; give one per layer")
    out = tuple(float(v) for v in values)
    if any(not np.isfinite(v) or v < 0 for v in out):
        raise UserError(f"{name}={_short(values)} has a negative or non-finite cost; give costs >= 0")
    if name != "flops" and sum(out) > MAX_COST:  # each is >= 0: no single one is larger either
        raise UserError(
            f"{name} sums to {sum(out):g} over the layers, more than {MAX_COST:.0e}; give seconds and "
            "bytes (larger costs overflow the simulator's sums or drown the smaller ones)"
        )
    return out


def _short(values: Sequence[float], limit: int = 8) -> str:
    shown = ", ".join(repr(v) for v in list(values)[:limit])
    return f"[{shown}{', ...' if len(values) > limit else ''}]"


@dataclass(frozen=True, kw_only=True)
class LayerCosts:
    """Per-layer costs of one microbatch, layer 0 first.

    Times are in seconds, memory in bytes. ``forward + input_grad + weight_grad``
    is a layer's share of one microbatch's F + B.

    Example:
        >>> c = LayerCosts.uniform(4)
        >>> c.num_layers, c.time_of(0, 2)
        (4, 6.0)
    """

    names: tuple[str, ...]
    """Layer names (``"blocks.3"``), matched by ``type:REGEX``."""
    types: tuple[str, ...]
    """Layer class names (``"Block"``), matched by ``type:REGEX``."""
    forward: tuple[float, ...]
    """Forward time (F)."""
    input_grad: tuple[float, ...]
    """Input-gradient half of the backward (I)."""
    weight_grad: tuple[float, ...]
    """Weight-gradient half of the backward (W)."""
    activation: tuple[float, ...]
    """Bytes a microbatch keeps for the backward from its F until its backward, the layer's
    input included and its output excluded (the next layer keeps that as its input)."""
    params: tuple[float, ...]
    """Parameter bytes (M_theta)."""
    output: tuple[float, ...] = ()
    """Bytes of the layer's output: sent to the next stage, and kept until the backward, when a
    part ends here (default: 0)."""
    flops: tuple[float, ...] = ()
    """Floating-point operations of the layer's F, I and W together for one microbatch, as the profiler
    counts them (``torch.utils.flop_counter``); default 0, not counted (profiles written before it was)."""
    selective_forward: tuple[float, ...] = ()
    """Forward time of the layer's selective region (``--recompute selective`` replays it before the
    backward: the gpt's attention core; default: 0, no region)."""
    selective_activation: tuple[float, ...] = ()
    """``activation`` under selective recomputation (default: ``activation``, nothing saved)."""
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    """Where the costs come from (model spec, device, shapes); informative only."""
    _prefix: dict[str, np.ndarray] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", tuple(str(x) for x in self.names))
        object.__setattr__(self, "types", tuple(str(x) for x in self.types))
        n = len(self.names)
        if n == 0:
            raise UserError("the model has no layers; give at least one layer")
        if len(self.types) != n:
            raise UserError(f"types has {len(self.types)} values for {n} layers; give one per layer")
        for name in _OPTIONAL:
            if not getattr(self, name):
                object.__setattr__(self, name, self.activation if name == "selective_activation" else (0.0,) * n)
        for name in _PER_LAYER:
            object.__setattr__(self, name, _floats(name, getattr(self, name), n))
        totals = {name: np.concatenate(([0.0], np.cumsum(getattr(self, name)))) for name in _PER_LAYER}
        totals["time"] = totals["forward"] + totals["input_grad"] + totals["weight_grad"]
        object.__setattr__(self, "_prefix", totals)

    @property
    def num_layers(self) -> int:
        return len(self.names)

    def prefix(self, name: str) -> np.ndarray:
        """Prefix sums of a per-layer cost (or ``"time"``): ``prefix(x)[j]`` is layers ``0..j-1``."""
        return self._prefix[name]

    def total(self, name: str, start: int, stop: int) -> float:
        """Sum of cost ``name`` over layers ``start..stop-1``."""
        p = self.prefix(name)
        return float(p[stop] - p[start])

    def time_of(self, start: int, stop: int) -> float:
        """F + I + W time of layers ``start..stop-1`` for one microbatch."""
        return self.total("time", start, stop)

    @classmethod
    def uniform(cls, num_layers: int, *, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> LayerCosts:
        """``num_layers`` identical layers (a model with no profile)."""
        n = num_layers
        return cls(
            names=tuple(f"layers.{i}" for i in range(n)),
            types=("Layer",) * n,
            forward=(f,) * n,
            input_grad=(b,) * n,
            weight_grad=(w,) * n,
            activation=(1.0,) * n,
            params=(1.0,) * n,
        )

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {name: list(getattr(self, name)) for name in ("names", "types", *_PER_LAYER)}
        data["meta"] = dict(self.meta)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LayerCosts:
        known = {"names", "types", "meta", *_PER_LAYER}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UserError(f"unknown cost field {unknown[0]!r}; the fields are {sorted(known)}")
        missing = sorted({"names", "types", *_PER_LAYER} - set(_OPTIONAL) - set(data))
        if missing:
            raise UserError(f"the costs lack field {missing[0]!r}; give one value per layer")
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
        return cls(**fields)

    @classmethod
    def load(cls, path: str | Path) -> LayerCosts:
        """Read costs written by ``save`` (or by ``pipeweave partition --save-costs``)."""
        try:
            data = json.loads(Path(path).read_bytes().decode("utf-8-sig"))
        except UnicodeDecodeError as exc:
            raise UserError(
                f"cannot read costs from {str(path)!r}: byte {exc.start} is not UTF-8 text; give the "
                "JSON file of layer costs that --save-costs writes"
            ) from None
        except OSError as exc:
            raise UserError(
                f"cannot read costs from {str(path)!r} ({exc.strerror or exc}); give a JSON file of layer costs"
            ) from None
        except (json.JSONDecodeError, RecursionError) as exc:
            reason = exc if isinstance(exc, json.JSONDecodeError) else "nested too deep"
            raise UserError(
                f"cannot read costs from {str(path)!r} ({reason}); give a JSON file of layer costs"
            ) from None
        if not isinstance(data, dict):
            raise UserError(f"costs file {str(path)!r} holds no JSON object; give one object of per-layer lists")
        try:
            return cls.from_json(data)
        except UserError as exc:
            raise UserError(f"costs file {str(path)!r}: {exc}") from None
        except (TypeError, ValueError) as exc:  # a field of the wrong JSON type
            raise UserError(
                f"costs file {str(path)!r} has a field of the wrong type ({exc}); give lists of "
                "names and of numbers, one value per layer"
            ) from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))


@dataclass(frozen=True)
class Partition:
    """Consecutive layers per part, part 0 first (and, for PipeDream, replicas per part).

    Example:
        >>> Partition((3, 2, 2)).bounds
        ((0, 3), (3, 5), (5, 7))
    """

    counts: tuple[int, ...]
    """Layers in each part."""
    replicas: tuple[int, ...] = ()
    """Data-parallel replicas of each part (PipeDream); empty means one each."""
    recompute: tuple[str, ...] = ()
    """Recomputation of each part (``sim.recompute``; ``--partition memory`` may choose it); empty means none."""

    def __post_init__(self) -> None:
        if not self.replicas:
            object.__setattr__(self, "replicas", (1,) * len(self.counts))
        if not self.recompute:
            object.__setattr__(self, "recompute", ("none",) * len(self.counts))

    @property
    def num_parts(self) -> int:
        return len(self.counts)

    @property
    def bounds(self) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` layer range of each part."""
        stops = np.cumsum(self.counts).tolist()
        return tuple(zip([0, *stops[:-1]], stops))

    def layers(self, part: int) -> range:
        """The layer indices of ``part``."""
        start, stop = self.bounds[part]
        return range(start, stop)

    @classmethod
    def from_cuts(cls, cuts: Sequence[int], num_layers: int, replicas: Sequence[int] = ()) -> Partition:
        """From the first layer of each part after part 0 (ascending)."""
        edges = [0, *cuts, num_layers]
        return cls(tuple(int(b - a) for a, b in zip(edges, edges[1:])), tuple(replicas))
