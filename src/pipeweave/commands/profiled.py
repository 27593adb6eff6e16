"""Per-layer costs measured by the profiler (``runtime.profile``), for ``partition`` and ``train``.

Imported when a command needs to profile, so that parsing and the other
subcommands start without torch.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from pipeweave.partition import LayerCosts
from pipeweave.runtime.profile import profile_model


def profiled_costs(
    args: argparse.Namespace, spec: Any, microbatch_size: int, device: str, threads: int | None = None
) -> LayerCosts:
    """The model's per-layer costs on ``device`` (cached), with ``--repeats``, ``--refresh`` and ``--precision``."""
    if threads is not None:
        torch.set_num_threads(threads)
    return profile_model(
        spec, microbatch_size, device=device, repeats=args.repeats, refresh=args.refresh, precision=args.precision
    )
