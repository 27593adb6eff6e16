"""pipeweave: pipeline-model-parallel schedules, simulated, searched and trained on PyTorch."""

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``pipeweave.pipeline`` and ``pipeweave.models``, imported on first use (the pure packages stay torch-free)."""
    if name == "pipeline":
        from pipeweave.pipelining import pipeline

        return pipeline
    if name == "models":
        import importlib

        return importlib.import_module("pipeweave.models")
    raise AttributeError(f"module 'pipeweave' has no attribute {name!r}")
