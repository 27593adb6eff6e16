"""Where a model cut at module names is split: the names that start its parts, as JSON and as one line.

A model that ``pipeweave.pipeline`` cut (a traced module, a Hugging Face
model, or one split into D parts by the profiler) carries the module names
where its layers start (``LayerModel.split_points``: layer k + 1 at the
k-th); a partition groups those layers into parts, and the names at the
parts' starts are the cut points the run uses -- the ``split_points`` to
give ``pipeweave.pipeline`` to cut the module there again. ``train`` and
``partition`` say them once. Imports no torch (the spec is given).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def split_fields(spec: Any, parts: Sequence[range]) -> dict[str, Any]:
    """``{"split_points": [...]}``: the module names where parts 1, 2, ... start; ``{}`` for a model without
    names (the built-in ones, a ``LayerModel`` written by hand).

    Args:
        spec: the run's ``ModelSpec``.
        parts: the layers of each part, in order.
    """
    names = spec.custom.split_points if spec.kind == "custom" else ()
    return {"split_points": [names[part.start - 1] for part in parts[1:]]} if names else {}


def split_line(spec: Any, parts: Sequence[range]) -> str | None:
    """The one line saying where a model cut at module names is split, None for a model without names.

    Example:
        ``split: layers 0-2 | 3-4, cut before transformer.h.2`` (hf:gpt2 of 4 blocks on 2 parts)
    """
    fields = split_fields(spec, parts)
    if not fields:
        return None
    layers = " | ".join(f"{p.start}-{p.stop - 1}" if len(p) > 1 else f"{p.start}" for p in parts)
    return f"split: layers {layers}, cut before {', '.join(fields['split_points']) or 'nothing (one part)'}"
