"""GPUs and their clusters as the planner sees them: peak dense BF16 rate, memory, NVLink and InfiniBand.

Bandwidths are per GPU and per direction (``sim.network``'s convention). Sources,
the vendors' datasheets:

- A100 80GB SXM (NVIDIA A100 Tensor Core GPU datasheet, 2021): 312 TFLOP/s dense
  BF16 (624 is with 2:4 sparsity), 80 GB HBM2e, NVLink 3 at 600 GB/s total, i.e.
  300 GB/s per direction; DGX A100 (its datasheet): 8 GPUs and 8 ConnectX-6
  200 Gb/s HDR InfiniBand cards for compute traffic, one per GPU, i.e. 25 GB/s.
  HBM at 2,039 GB/s. Megatron-LM's Table 1 (Narayanan et al., SC21) ran on these nodes.
- H100 SXM5 80GB (NVIDIA H100 Tensor Core GPU datasheet, 2023): 989 TFLOP/s dense
  BF16 (1,979 with sparsity), 80 GB HBM3, NVLink 4 at 900 GB/s total (450 per
  direction), HBM at 3.35 TB/s; DGX H100: 8 ConnectX-7 400 Gb/s cards, one per GPU (50 GB/s).
- H200 SXM 141GB (NVIDIA H200 datasheet, 2024): the H100's compute (989 TFLOP/s
  dense BF16), 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s total; DGX H200 has the DGX H100's
  network (8 x 400 Gb/s).

Memory is what ``nvidia-smi`` reports as the card's total (81,920 MiB on an A100
80GB, 81,559 MiB on an H100 80GB, 143,771 MiB on an H200): the "80 GB" of the
datasheets is in fact about 80 GiB.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeweave.errors import UserError
from pipeweave.sim.network import Link, Network

GB = 1e9
GIB = 2.0**30
MIB = 2.0**20


@dataclass(frozen=True, kw_only=True)
class GPU:
    """One GPU kind and the nodes it comes in.

    Example:
        >>> GPUS["a100-80gb"].network().inter_node.bandwidth / 1e9
        25.0
    """

    name: str
    """Preset name, or "custom"."""
    peak_flops: float
    """Peak dense BF16 FLOP/s (tensor cores, no sparsity)."""
    memory_bytes: float
    """Device memory in bytes."""
    intra_node: float
    """NVLink bytes per second, per GPU and direction."""
    inter_node: float
    """InfiniBand bytes per second, per GPU and direction."""
    memory_bandwidth: float = 2.039e12
    """HBM bytes per second (element-wise kernels run at it: ``planner.efficiency``)."""
    gpus_per_node: int = 8
    latency: float = 5e-6
    """Seconds per message or ring step (a few microseconds on NVLink and InfiniBand; NCCL's own tests)."""

    def __post_init__(self) -> None:
        for name in ("peak_flops", "memory_bytes", "intra_node", "inter_node"):
            value = getattr(self, name)
            if not 0 < value < math.inf:
                raise UserError(f"GPU {name.replace('_', ' ')} {value:g} is invalid; give a finite value > 0")
        if self.gpus_per_node < 1:
            raise UserError(f"--gpus-per-node {self.gpus_per_node} is invalid; give an integer >= 1")

    def network(self) -> Network:
        """The cluster's links, for ``sim.parallel.Layout``."""
        return Network(
            intra_node=Link(bandwidth=self.intra_node, latency=self.latency),
            inter_node=Link(bandwidth=self.inter_node, latency=self.latency),
            gpus_per_node=self.gpus_per_node,
        )


GPUS: dict[str, GPU] = {
    "a100-80gb": GPU(
        name="a100-80gb", peak_flops=312e12, memory_bytes=81920 * MIB, intra_node=300 * GB, inter_node=200e9 / 8
    ),
    "h100-sxm": GPU(
        name="h100-sxm",
        peak_flops=989e12,
        memory_bytes=81559 * MIB,
        intra_node=450 * GB,
        inter_node=400e9 / 8,
        memory_bandwidth=3.35e12,
    ),
    "h200": GPU(
        name="h200",
        peak_flops=989e12,
        memory_bytes=143771 * MIB,
        intra_node=450 * GB,
        inter_node=400e9 / 8,
        memory_bandwidth=4.8e12,
    ),
}
"""The presets, by ``--gpu`` name (sources in the module docstring)."""


def custom_gpu(
    *,
    peak_tflops: float,
    memory_gib: float,
    intra_node_gbps: float,
    inter_node_gbps: float,
    gpus_per_node: int,
    memory_tbps: float | None = None,
) -> GPU:
    """A GPU from ``--gpu custom``'s flags: TFLOP/s, GiB and Gb/s (as network cards are sold).

    Example:
        >>> custom_gpu(peak_tflops=100, memory_gib=16, intra_node_gbps=800, inter_node_gbps=100,
        ...            gpus_per_node=4).intra_node / 1e9
        100.0
    """
    for flag, value in (
        ("--peak-tflops", peak_tflops),
        ("--memory-gib", memory_gib),
        ("--intra-node-gbps", intra_node_gbps),
        ("--inter-node-gbps", inter_node_gbps),
    ):
        if value is None or not 0 < value < math.inf:
            raise UserError(
                f"--gpu custom needs {flag} > 0 (got {value}); give e.g. --peak-tflops 312 "
                "--memory-gib 80 --intra-node-gbps 2400 --inter-node-gbps 200"
            )
    if memory_tbps is not None and not 0 < memory_tbps < math.inf:
        raise UserError(f"--memory-tbps {memory_tbps} is invalid; give the HBM bandwidth in TB/s > 0, e.g. 2.039")
    return GPU(
        name="custom",
        peak_flops=peak_tflops * 1e12,
        memory_bytes=memory_gib * GIB,
        intra_node=intra_node_gbps * 1e9 / 8,
        inter_node=inter_node_gbps * 1e9 / 8,
        gpus_per_node=gpus_per_node,
        memory_bandwidth=(memory_tbps or 2.039) * 1e12,
    )


def gpu_named(name: str) -> GPU:
    """A preset by name.

    Raises:
        UserError: an unknown name.
    """
    gpu = GPUS.get(name)
    if gpu is None:
        raise UserError(f"unknown --gpu {name!r}; choose one of: {', '.join(GPUS)}, custom")
    return gpu
