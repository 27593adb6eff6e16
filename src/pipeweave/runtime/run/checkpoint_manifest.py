"""The schema of a checkpoint's ``manifest.json``, checked whenever one is read, before anything is spawned.

``checkpoint._manifest`` writes the fields below and ``checkpoint_files.commit``
adds ``format`` and ``serial``; a manifest edited by hand (``"steps": "six"``,
``"steps": -5``) was a ValueError, or trained and then failed in the report
with the run's record lost. Now it is one line naming the file, the field, its
value and what it must be. The model's options are checked as ``ModelSpec``
checks them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeweave.config import ModelSpec
from pipeweave.errors import UserError

Check = Callable[[Any], bool]


def _integer(low: int) -> tuple[Check, str]:
    return (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low), f"an integer >= {low}"


def _number() -> tuple[Check, str]:
    real = (int, float)
    return (lambda v: isinstance(v, real) and not isinstance(v, bool) and math.isfinite(v) and v >= 0), "a number >= 0"


def _string() -> tuple[Check, str]:
    return (lambda v: isinstance(v, str)), "a string"


def _parts() -> tuple[Check, str]:
    def valid(v: Any) -> bool:
        pairs = isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 for p in v)
        return pairs and all(_integer(0)[0](a) and _integer(0)[0](b) and a < b for a, b in v)

    return valid, "a list of [start, stop] layer ranges"


def _files() -> tuple[Check, str]:
    def entry(e: Any) -> bool:
        return (
            isinstance(e, dict)
            and isinstance(e.get("name"), str)
            and "/" not in e["name"]
            and ("bytes" not in e or _integer(0)[0](e["bytes"]))
            and ("sha256" not in e or isinstance(e["sha256"], str))
        )

    return (lambda v: isinstance(v, list) and all(entry(e) for e in v)), "a list of {name, bytes, sha256}"


def _loss_scale() -> tuple[Check, str]:
    def valid(v: Any) -> bool:
        return isinstance(v, dict) and _number()[0](v.get("scale")) and _integer(0)[0](v.get("_growth_tracker"))

    return valid, "an object of the loss scale (a number >= 0) and its _growth_tracker (an integer >= 0)"


SCHEMA: dict[str, tuple[bool, tuple[Check, str]]] = {
    # field: (required, (valid, what it must be))
    "steps": (True, _integer(1)),
    "model": (True, ((lambda v: isinstance(v, dict)), "an object of the model's options")),
    "data": (False, ((lambda v: isinstance(v, dict)), "an object of the data options")),
    "optimizer": (True, _string()),
    "files": (True, _files()),
    "run": (False, _string()),
    "serial": (False, _integer(0)),
    "updates": (False, _integer(0)),
    "annealed": (False, _integer(0)),
    "lr": (False, _number()),
    "momentum": (False, _number()),
    "schedule": (False, _string()),
    "data_parallel": (False, _integer(1)),
    "parts": (False, _parts()),
    "saved": (False, _string()),
    "writer": (False, _string()),
    "loss_scale": (False, _loss_scale()),  # --precision fp16's (runtime.loss_scale)
}
"""Each field a manifest holds: whether every format has it, and the check of its value."""


def check(manifest: dict[str, Any], path: Path) -> None:
    """Refuse a manifest that breaks ``SCHEMA`` (or whose model options ``ModelSpec`` refuses), in one line.

    Raises:
        UserError: e.g. ``.../manifest.json: "steps" is 'six', not an integer >= 1 (...); restore it ...``.
    """
    problem = _problem(manifest)
    if problem is not None:
        raise UserError(
            f"{path}: {problem} (edited or damaged since it was saved); restore it as --save wrote it, or move "
            f"{path.parent} away"
        )


def _problem(manifest: dict[str, Any]) -> str | None:
    for name, (required, (valid, want)) in SCHEMA.items():
        if name not in manifest:
            if required:
                return f'"{name}" is missing'
        elif not valid(manifest[name]):
            return f'"{name}" is {manifest[name]!r}, not {want}'
    return _model_problem(manifest["model"])


def _model_problem(model: dict[str, Any]) -> str | None:
    options = {f.name for f in dataclasses.fields(ModelSpec)}
    unknown = sorted(set(model) - options)
    if unknown:
        return f'"model" holds {unknown[0]!r}, no model option'
    try:
        ModelSpec(**model)
    except UserError as e:
        return f'"model": {e}'
    return None
