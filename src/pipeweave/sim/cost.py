"""The cost and memory model: per-part times of F, I, W, communication, memory.

A scalar is the cost of one D-th of the model (one stage of a straight D-rank
pipeline, D the ranks one pipeline spans, so data-parallel replicas do not
change it); the simulator divides it evenly among the parts of a pipeline, so
interleaved chunks of a looped placement cost f/v and ZB-V's chunks f/2, and
schedules with different chunk counts compare on the same model. A sequence
gives each part its own value, as is, for load imbalance.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipeweave.errors import UserError
from pipeweave.sim.recompute import per_part

Value = float | Sequence[float]

MAX_COST = 1e15
"""The largest time, latency or memory a cost model takes. A simulated step sums up to
billions of them: beyond 1e15 those sums overflow (1e308 is inf after one addition) or
lose every smaller cost beside them (float64 holds 16 digits), so bubble and makespan
come out nan or wrong. 1e15 is 31 years in microseconds or a petabyte in bytes."""


def cost_problem(value: float, what: str = "time") -> str | None:
    """Why ``value`` cannot be a cost, as the end of a one-line message naming the fix; None when it can.

    Example:
        >>> cost_problem(float("nan"))
        'is invalid; give a finite time >= 0'
        >>> cost_problem(2.5) is None
        True
    """
    if math.isnan(value) or math.isinf(value):
        return f"is invalid; give a finite {what} >= 0"
    if value < 0:
        return f"is invalid; give a {what} >= 0"
    if value > MAX_COST:
        return (
            f"is too large; give a {what} <= {MAX_COST:.0e} (larger ones overflow the simulator's sums "
            "or drown the smaller costs)"
        )
    return None


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Times and memory of the model's parts.

    Example:
        >>> CostModel(f=2.0, b=2.0, w=1.0).for_parts(num_parts=8, num_ranks=4).f
        (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
    """

    f: Value = 1.0
    """Forward time."""
    b: Value = 1.0
    """Input-gradient half of the backward (``I``); a full ``B`` costs b + w."""
    w: Value = 1.0
    """Weight-gradient half of the backward (``W``)."""
    u: Value = 0.0
    """Optimizer step (``U``); 0 by default, as in the bubble formulas of the papers. It matters where
    updates are frequent (the per-microbatch updaters of the asynchronous family) or uneven (weight stashing)."""
    comm: float = 0.0
    """Latency of one hop between stages on different ranks."""
    comm_rendezvous: bool = False
    """A hop's ``comm`` starts only once its receive is posted, as gloo and NCCL move a message: at the end of
    the receiving rank's action before the one that takes it, or before an F&B pair's F half for its B half
    (``Schedule.pairs``: that half's message moves while the F half computes). False: every message moves
    from its producer's end, as if received long before (a pair then costs what its halves cost apart)."""
    dispatch: float = 0.0
    """Host time a rank spends between two consecutive actions of its own (posting sends and
    receives, bookkeeping): idle in the bubble, as a runtime's is. 0 for the schedule alone;
    ``pipeweave train`` profiles its own (``runtime.report.trace.dispatch_time``)."""
    activation: Value = 1.0
    """Activation memory a microbatch holds from its F until its backward (M_a)."""
    mem_w: float = 0.5
    """Fraction of M_a still held between I and W (M_W / M_a); 0.5 as in the zero-bubble paper."""
    weight: Value = 1.0
    """Weight memory (M_theta)."""
    recompute: str | Sequence[str] = "none"
    """Activation recomputation (``sim.recompute``), one mode for every part or one per part. A part that
    recomputes replays before each backward (B or I): ``full`` its forward f, ``selective``
    ``replay_selective``; its M_a becomes what it keeps from F to the backward, ``kept_full`` or
    ``kept_selective`` of it (M_W a share of that, as without recomputation). Under ``full`` its backward
    replays the whole part first and holds the replayed rest while it runs (``PartCosts.replayed``: the
    microbatch's whole M_a for that B or I); ``selective`` replays each layer's region inside the backward,
    once the layers after it have freed theirs, which adds nothing to the peak measured
    (benchmarks/memory/README.md, "Replayed activations")."""
    replay_selective: Value = 0.0
    """Time of replaying a part's selective region (the attention core), resolved like f."""
    kept_selective: Value = 1.0
    """Fraction of M_a a part keeps under selective recomputation (1: nothing saved, no profile known)."""
    kept_full: Value = 0.0
    """Fraction of M_a a part keeps under full recomputation: its input (0: negligible, no profile known)."""
    microbatch: Sequence[float] | None = None
    """Per microbatch of the step, a factor on the times of its F, B, I and W (sequences of variable length:
    its tokens over the mean's); None: every microbatch costs alike."""

    def __post_init__(self) -> None:
        for name in ("kept_selective", "kept_full"):
            value = getattr(self, name)
            if any(not 0.0 <= v <= 1.0 for v in ([value] if isinstance(value, (int, float)) else value)):
                raise UserError(f"cost {name}={value!r} is invalid; give fractions of M_a in [0, 1]")
        for name in ("f", "b", "w", "u", "activation", "weight", "replay_selective"):
            value = getattr(self, name)
            values = [value] if isinstance(value, (int, float)) else list(value)
            if not values:
                raise UserError(f"cost {name}={value!r} is invalid; give times and memory >= 0")
            what = "memory" if name in ("activation", "weight") else "time"
            for v in values:
                problem = cost_problem(v, what)
                if problem is not None:
                    shown = f"cost {name}={value!r}" if v is value else f"cost {name}={list(values)!r}: {v!r}"
                    raise UserError(f"{shown} {problem}")
        for name, what in (("comm", "latency"), ("dispatch", "time")):
            problem = cost_problem(getattr(self, name), what)
            if problem is not None:
                raise UserError(f"{name}={getattr(self, name)!r} {problem}")
        if not 0.0 <= self.mem_w <= 1.0:
            raise UserError(f"mem_w={self.mem_w!r} is invalid; give a fraction in [0, 1]")
        for v in self.microbatch or ():
            problem = cost_problem(v, "factor")
            if problem is not None:
                raise UserError(f"cost microbatch={list(self.microbatch or ())!r}: {v!r} {problem}")

    def generator_options(self, generator: Callable[..., object]) -> dict[str, float]:
        """The scalars of this model that ``generator`` (a registry entry's) takes as options -- ``time_f``,
        ``time_b``, ``time_w`` (scalar times only), ``time_comm``, ``mem_w`` --: a searched schedule (zb-auto)
        is searched under them.

        Example:
            >>> def zb_auto(num_stages, num_microbatches, *, time_f=1.0, time_comm=0.0): ...
            >>> CostModel(f=2.0, b=[1.0, 2.0]).generator_options(zb_auto)
            {'time_f': 2.0, 'time_comm': 0.0}
        """
        params = inspect.signature(generator).parameters
        values = {"time_f": self.f, "time_b": self.b, "time_w": self.w, "time_comm": self.comm, "mem_w": self.mem_w}
        return {key: float(value) for key, value in values.items() if key in params and isinstance(value, (int, float))}

    def for_parts(self, *, num_parts: int, num_ranks: int) -> PartCosts:
        """Resolve every value to one number per part.

        Raises:
            ValueError: a per-part sequence whose length is not ``num_parts``.
        """
        scale = num_ranks / num_parts if num_parts else 1.0

        def resolve(name: str) -> tuple[float, ...]:
            value = getattr(self, name)
            if isinstance(value, (int, float)):
                return (float(value) * scale,) * num_parts
            if len(value) != num_parts:
                raise UserError(
                    f"cost {name} has {len(value)} values for {num_parts} parts; give one per part or a scalar"
                )
            return tuple(float(v) for v in value)

        f, b, activation = resolve("f"), resolve("b"), resolve("activation")
        micro = None if self.microbatch is None else tuple(float(v) for v in self.microbatch)
        modes = per_part(self.recompute, num_parts)
        if set(modes) == {"none"}:
            return PartCosts(
                f=f,
                b=b,
                w=resolve("w"),
                u=resolve("u"),
                comm=self.comm,
                comm_rendezvous=self.comm_rendezvous,
                dispatch=self.dispatch,
                activation=activation,
                mem_w=self.mem_w,
                weight=resolve("weight"),
                microbatch=micro,
            )
        replay = {"none": (0.0,) * num_parts, "selective": resolve("replay_selective"), "full": f}
        kept = {
            "none": (1.0,) * num_parts,
            "selective": self._fractions("kept_selective", num_parts),
            "full": self._fractions("kept_full", num_parts),
        }
        stored = tuple(a * kept[m][k] for k, (a, m) in enumerate(zip(activation, modes)))
        return PartCosts(
            f=f,
            b=tuple(x + replay[m][k] for k, (x, m) in enumerate(zip(b, modes))),
            w=resolve("w"),
            u=resolve("u"),
            comm=self.comm,
            comm_rendezvous=self.comm_rendezvous,
            dispatch=self.dispatch,
            activation=stored,
            mem_w=self.mem_w,
            weight=resolve("weight"),
            microbatch=micro,
            recompute=modes,
            replayed=tuple(a - s if m == "full" else 0.0 for a, s, m in zip(activation, stored, modes)),
        )

    def _fractions(self, name: str, num_parts: int) -> tuple[float, ...]:
        """A fraction per part: a scalar for every part (not scaled like times), or the per-part list."""
        value = getattr(self, name)
        if isinstance(value, (int, float)):
            return (float(value),) * num_parts
        if len(value) != num_parts:
            raise UserError(f"cost {name} has {len(value)} values for {num_parts} parts; give one per part or a scalar")
        return tuple(float(v) for v in value)


@dataclass(frozen=True)
class PartCosts:
    """A cost model resolved to one value per part (see ``CostModel.for_parts``)."""

    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[float, ...]
    u: tuple[float, ...]
    comm: float
    dispatch: float
    activation: tuple[float, ...]
    mem_w: float
    weight: tuple[float, ...]
    recompute: tuple[str, ...] = ()
    """Per part, its recomputation mode (empty: none anywhere)."""
    microbatch: tuple[float, ...] | None = None
    """Per microbatch, a factor on its F, B, I and W times (``CostModel.microbatch``)."""
    comm_rendezvous: bool = False
    """``CostModel.comm_rendezvous``."""
    replayed: tuple[float, ...] = ()
    """Per part, the activation memory its recomputation replays and holds on top of ``activation`` while one
    backward (B or I) runs: under ``full``, M_a less what the part keeps; 0 otherwise (``CostModel.recompute``;
    empty: no part recomputes)."""
