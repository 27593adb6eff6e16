"""GPUs and their clusters as the planner sees them: peak dense BF16 rate, memory and its bandwidth, NVLink (or
xGMI, or PCIe) and the network, GPUs per node (8 for every preset).

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
- A100 40GB SXM (the A100 datasheet, 2021): the 80GB's compute and NVLink, 40 GB
  HBM2 at 1,555 GB/s; DGX A100 (40GB) has the same 8 HDR 200 Gb/s cards.
- H100 PCIe 80GB (NVIDIA H100 PCIe product brief PB-11133-001, 2022): 756 TFLOP/s
  dense BF16 (1,513 with sparsity), 80 GB HBM2e at 2.0 TB/s; its NVLink bridge
  (600 GB/s) joins pairs of cards only, so a node's 8 GPUs talk over PCIe Gen5
  x16, 64 GB/s per direction; one 400 Gb/s ConnectX-7 per GPU assumed (as a DGX).
- B200 (NVIDIA HGX B200 specifications, 2024, at 1,000 W): 2,250 TFLOP/s dense
  BF16 (4,500 with sparsity), 180 GB HBM3e at 8 TB/s (DGX B200: 1,440 GB and 64
  TB/s for 8), NVLink 5 at 1.8 TB/s total (900 per direction); DGX B200 (its user
  guide): 8 ConnectX-7 400 Gb/s cards, one per GPU.
- MI300X (AMD Instinct MI300X data sheet, 2023): 1,307 TFLOP/s dense BF16 (2,615
  with sparsity), 192 GB HBM3 at 5.3 TB/s, seven Infinity Fabric (xGMI) links of
  128 GB/s (64 per direction) to the other 7 GPUs of its 8-GPU platform: 448 GB/s
  per direction in all; 8 x 400 Gb/s network cards per node, one per GPU.

Memory is what ``nvidia-smi`` reports as the card's total (40,960 MiB on an A100
40GB, 81,920 on an A100 80GB, 81,559 on an H100 80GB, 143,771 on an H200, 183,359
on a B200; ``rocm-smi``: 205,822,885,888 bytes on an MI300X): the "80 GB" of the
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
NCCL_NVLINK = 370 / 450
"""The share of NVLink's line rate NCCL's collectives move: about 20 % goes to its protocol (NCCL's maintainer,
NVIDIA/nccl-tests issue 212, 2024: "450GB/s is the line rate. With the protocol overhead (~20%) NCCL can get an
effective NVLink bandwidth of 370GB/s"). ``GPU.network`` applies it to every intra-node link (the datasheets
give line rates); the network cards' rate is taken as it is."""


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
    """NVLink bytes per second, per GPU and direction: the line rate (``network`` takes ``NCCL_NVLINK`` of it)."""
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
            intra_node=Link(bandwidth=self.intra_node * NCCL_NVLINK, latency=self.latency),
            inter_node=Link(bandwidth=self.inter_node, latency=self.latency),
            gpus_per_node=self.gpus_per_node,
        )


def _preset(name: str, tflops: float, memory: float, nvlink_gbs: float, hbm_tbps: float, nic_gbps: float) -> GPU:
    """A preset from its datasheet's units: dense BF16 TFLOP/s, bytes, GB/s per direction, TB/s, Gb/s per GPU."""
    return GPU(
        name=name,
        peak_flops=tflops * 1e12,
        memory_bytes=memory,
        intra_node=nvlink_gbs * GB,
        inter_node=nic_gbps * 1e9 / 8,
        memory_bandwidth=hbm_tbps * 1e12,
    )


GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        _preset("a100-80gb", 312, 81920 * MIB, 300, 2.039, 200),
        _preset("a100-40gb", 312, 40960 * MIB, 300, 1.555, 200),
        _preset("h100-sxm", 989, 81559 * MIB, 450, 3.35, 400),
        _preset("h100-pcie", 756, 81559 * MIB, 64, 2.0, 400),
        _preset("h200", 989, 143771 * MIB, 450, 4.8, 400),
        _preset("b200", 2250, 183359 * MIB, 900, 8.0, 400),
        _preset("mi300x", 1307, 205822885888.0, 448, 5.3, 400),
    )
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
