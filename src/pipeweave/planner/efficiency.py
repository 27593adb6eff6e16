"""How fast a GEMM runs: a fraction of the GPU's peak that grows with the GEMM's smallest dimension.

The model is Hockney's half-performance length (Hockney and Jesshope, "Parallel
Computers 2", 1988), applied to the smallest of a GEMM's m, n, k after the
tensor-parallel split::

    rate(n) = peak x eta_max x n / (n + n_half)

A thin GEMM (attention's head dimension d = h/a, or h/N and 4h/N once N ranks
split a layer) cannot fill the tensor cores' tiles and waits on memory; a wide
one approaches ``eta_max``. The two constants are not taken from a GEMM
benchmark: ``calibrate`` fits them to whole training steps, so they also hold
what the planner does not model separately (kernel launches, the element-wise
kernels' HBM traffic beyond ``planner.costs``' count or below the datasheet's
bandwidth). What is modelled apart is not left to them: the optimizer step, the loss, and NCCL's share of
NVLink's line rate (``planner.hardware.NCCL_NVLINK``). ``A100_CALIBRATED`` is that fit on the four rows of Megatron-LM's Table 1
without pipeline parallelism (``planner.published``; benchmarks/plan/README.md);
other GPUs reuse it as a fraction of their own peak, an assumption.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pipeweave.errors import UserError
from pipeweave.planner.flops import Gemm


@dataclass(frozen=True, kw_only=True)
class Efficiency:
    """``eta_max`` and ``n_half`` of the rate model (module docstring).

    Example:
        >>> Efficiency(eta_max=0.5, n_half=100).of(Gemm(100, 100, 100))
        0.25
    """

    eta_max: float
    """The fraction of peak a wide GEMM reaches."""
    n_half: float
    """The smallest dimension at which a GEMM reaches half of ``eta_max``."""

    def __post_init__(self) -> None:
        if not 0 < self.eta_max <= 1 or not self.n_half >= 0:
            raise UserError(
                f"matmul efficiency eta_max={self.eta_max}, n_half={self.n_half} is invalid; "
                "give 0 < eta_max <= 1 and n_half >= 0"
            )

    def of(self, gemm: Gemm) -> float:
        """The fraction of peak ``gemm`` runs at."""
        n = gemm.smallest
        return self.eta_max * n / (n + self.n_half)

    def seconds(self, gemm: Gemm, peak_flops: float) -> float:
        """Time of ``gemm`` on a GPU of ``peak_flops``."""
        return gemm.flops / (peak_flops * self.of(gemm))

    def streaming_seconds(self, nbytes: float, peak_flops: float) -> float:
        """The time the rate model charges for moving ``nbytes`` of a GEMM's operands through memory.

        ``seconds`` is ``flops / (peak eta_max) x (1 + n_half / n)``: for a GEMM whose smallest dimension is n
        and whose two others are p and q, the second term is ``2 p q n_half / (peak eta_max)``, the time of
        streaming its largest matrix (p x q, ``2 p q`` bytes in 16 bits) at ``peak eta_max / n_half`` bytes a
        second (A100: 2.9 TB/s with ``A100_CALIBRATED``, against its HBM's 2.0: the part of the traffic a GEMM
        does not hide behind its products). Operand bytes a GEMM reads beyond its own are charged at that rate.

        Example:
            >>> e = Efficiency(eta_max=0.5, n_half=100)
            >>> g = Gemm(1000, 1000, 10)  # the 1000 x 1000 matrix: 2 MB
            >>> round(e.seconds(g, 1e12) - g.flops / 0.5e12, 12) == round(e.streaming_seconds(2e6, 1e12), 12)
            True
        """
        return nbytes * self.n_half / (peak_flops * self.eta_max)


A100_CALIBRATED = Efficiency(eta_max=0.66, n_half=70.0)
"""Fitted by ``calibrate`` on Table 1's rows without pipeline parallelism (1.7B, 3.6B, 7.5B, 18.4B);
tests/planner/test_published.py fits it again and checks it matches."""


ETA_GRID = tuple(round(0.30 + 0.01 * k, 2) for k in range(71))
N_HALF_GRID = tuple(10.0 * k for k in range(61))


def calibrate(
    predict: Callable[[Efficiency], Iterable[tuple[float, float]]],
    *,
    eta_grid: Iterable[float] = ETA_GRID,
    n_half_grid: Iterable[float] = N_HALF_GRID,
) -> Efficiency:
    """The grid point that minimises the mean squared relative error of ``predict``'s (predicted, published) pairs.

    Args:
        predict: for an efficiency, the (predicted, published) figure of each calibration row.
        eta_grid, n_half_grid: the values tried (default: eta_max 0.30..1.00 by 0.01, n_half 0..600 by 10).

    Example:
        >>> calibrate(lambda e: [(e.eta_max, 0.5)], n_half_grid=[0.0]).eta_max
        0.5
    """
    best: tuple[float, Efficiency] | None = None
    etas = [round(e, 4) for e in eta_grid]
    for n_half in n_half_grid:
        for eta in etas:
            candidate = Efficiency(eta_max=eta, n_half=n_half)
            pairs = list(predict(candidate))
            error = sum((p / q - 1.0) ** 2 for p, q in pairs) / len(pairs)
            if best is None or error < best[0] - 1e-15:
                best = (error, candidate)
    assert best is not None, "empty grid"
    return best[1]
