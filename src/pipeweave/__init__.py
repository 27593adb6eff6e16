"""pipeweave: pipeline-model-parallel schedules, simulated, searched and trained on PyTorch."""

__version__ = "0.1.0"
