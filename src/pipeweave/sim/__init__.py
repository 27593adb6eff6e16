"""Simulation of schedules under a cost and memory model (no torch)."""

from pipeweave.sim.cost import CostModel, PartCosts
from pipeweave.sim.metrics import Metrics, compute_metrics
from pipeweave.sim.parallel import Layout, simulate_layout
from pipeweave.sim.timeline import Event, Timeline, simulate
from pipeweave.sim.traffic import ModelBytes

__all__ = [
    "CostModel",
    "Event",
    "Layout",
    "Metrics",
    "ModelBytes",
    "PartCosts",
    "Timeline",
    "compute_metrics",
    "simulate",
    "simulate_layout",
]
