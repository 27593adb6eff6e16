"""A configuration as a TOML file: sections are the configuration's sections, keys their fields.

``pipeweave train --config run.toml`` reads one (command-line options override
it); ``--print-config`` writes the resolved configuration back, and every run's
JSON record holds it (``--config pipeweave-out/train.json`` reruns the run).
A key or value that is unknown or of the wrong type is one line naming the key,
the file and line, and the closest valid key.

Example:
    >>> from pipeweave.config.train import TrainConfig
    >>> text = dumps(TrainConfig(num_stages=4, steps=5))
    >>> loads(text, TrainConfig) == TrainConfig(num_stages=4, steps=5)
    True
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

from pipeweave.config.cli import build
from pipeweave.config.schema import option_of, sections
from pipeweave.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def load(path: str | Path, cls: type) -> dict[str, dict[str, Any]]:
    """The sections a TOML file gives (checked against ``cls``'s fields, not yet built).

    Raises:
        UserError: no such file, a TOML syntax error, an unknown section or key, a value of the wrong type.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--config {path}: cannot read it ({exc.__class__.__name__}); give a TOML file") from None
    if path.suffix == ".json":  # a run's JSON record holds its configuration as TOML
        try:
            text = json.loads(text)["config"]
        except (ValueError, KeyError, TypeError):
            raise UserError(
                f"--config {path}: a JSON file here is a run's record (train.json) holding its "
                "configuration; this one holds none; give a TOML file"
            ) from None
    return parse(text, cls, str(path))


def loads(text: str, cls: type) -> Any:
    """The configuration a TOML text describes, over ``cls``'s defaults."""
    return build(cls, parse(text, cls, "<string>"))


def parse(text: str, cls: type, where: str) -> dict[str, dict[str, Any]]:
    """The sections of a TOML text, every key known and every value of its field's type (one line otherwise)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{where}: {exc}; fix the TOML syntax") from None
    known = dict(sections(cls))
    out: dict[str, dict[str, Any]] = {}
    for name, values in data.items():
        if name not in known or not isinstance(values, dict):
            raise UserError(
                f"{where}:{_line(text, None, name)}: [{name}] is no section{_closest(name, known)}; "
                f"sections are {', '.join(known)}"
            )
        fields = {f.name: f for f in dataclasses.fields(known[name]) if not option_of(f).internal}
        for key, value in values.items():
            if key not in fields:
                raise UserError(f"{where}:{_line(text, name, key)}: {key} is no key of [{name}]{_closest(key, fields)}")
            out.setdefault(name, {})[key] = tuple(value) if isinstance(value, list) else value
        try:
            dataclasses.replace(known[name](), **out.get(name, {})) if name != "model" else None
        except UserError as exc:
            key = next((k for k in out.get(name, {}) if k in str(exc) or k.replace("_", "-") in str(exc)), "")
            raise UserError(f"{where}:{_line(text, name, key)}: [{name}] {exc}") from None
    return out


def _closest(word: str, names: Any) -> str:
    close = difflib.get_close_matches(word, list(names), n=1, cutoff=0.5)
    return f"; did you mean {close[0]}?" if close else ""


def _line(text: str, section: str | None, key: str) -> int:
    """The line of ``key`` in ``[section]`` (of the section header when ``section`` is None); 1 if not found."""
    current = None
    for number, line in enumerate(text.splitlines(), 1):
        header = re.match(r"\s*\[([^\]]+)\]", line)
        if header:
            current = header.group(1).strip()
            if section is None and current == key:
                return number
        elif current == section and re.match(rf"\s*{re.escape(key)}\s*=", line):
            return number
    return 1


def dumps(config: Any) -> str:
    """``config`` as TOML: every section, each field that is not internal and not None.

    Values are strings, numbers, booleans and arrays; a field that is None (its default: unset) is left out.
    """
    lines: list[str] = []
    for name, _ in sections(type(config)):
        section = getattr(config, name)
        lines.append(f"[{name}]")
        unused = section.unused_fields() if hasattr(section, "unused_fields") else set()
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if option_of(f).internal or value is None or f.name in unused:
                continue
            lines.append(f"{f.name} = {_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value) if math.isfinite(value) else json.dumps(str(value))
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return json.dumps(str(value))
