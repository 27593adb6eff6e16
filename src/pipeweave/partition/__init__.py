"""Load balance: per-layer costs and the partitioners that cut a model into parts (no torch)."""

from pipeweave.partition.memory import MemoryProfile
from pipeweave.partition.methods import PARTITIONERS, PartitionContext, Partitioner, partition
from pipeweave.partition.pipedream import pipedream_plan, plan_time
from pipeweave.partition.problem import LayerCosts, Partition

__all__ = [
    "LayerCosts",
    "MemoryProfile",
    "PARTITIONERS",
    "Partition",
    "PartitionContext",
    "Partitioner",
    "partition",
    "pipedream_plan",
    "plan_time",
]
