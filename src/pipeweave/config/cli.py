"""The command line of a configuration class, generated from its fields; and the command line back to a config.

Every field of every section is one option: its flags (``--`` and the field's
name unless the field names others), its type, its choices (a ``Literal``),
its help (the field's docstring) and its default (shown, never applied by
argparse: an option left out is not in the namespace, so that a file given
with ``--config`` and the defaults fill it).

Example:
    >>> import argparse
    >>> from pipeweave.config.train import TrainConfig
    >>> parser = argparse.ArgumentParser()
    >>> add_arguments(parser, TrainConfig)
    >>> config = from_arguments(parser.parse_args(["--stages", "4", "--tensor-parallel", "2"]), TrainConfig)
    >>> config.schedule.num_stages, config.parallel.tensor_parallel
    (4, 2)
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import MISSING, Field
from typing import Any

from pipeweave.config.schema import choices_of, flag_of, help_of, hints, option_of, sections, unoptional

SEP = "."
"""Between section and field in the namespace's names: ``parallel.tensor_parallel``."""


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One option per field of each section of ``cls``, grouped by section."""
    for name, section in sections(cls):
        doc = (section.__doc__ or "").strip().split("\n")[0]
        group = parser.add_argument_group(name, doc)
        defaults = next(f for f in dataclasses.fields(cls) if f.name == name).default_factory()  # type: ignore[misc]
        for f in dataclasses.fields(section):
            if option_of(f).internal or option_of(f).via is not None:
                continue
            flags, kwargs = argument(section, f, getattr(defaults, f.name))
            group.add_argument(*flags, dest=f"{name}{SEP}{f.name}", default=argparse.SUPPRESS, **kwargs)


def argument(section: type, f: Field[Any], default: Any = MISSING) -> tuple[tuple[str, ...], dict[str, Any]]:
    """The flags and ``add_argument`` keywords of one field; ``default``: the value the command uses when the
    option is not given (the configuration's default section's, which may differ from the field's: the default
    model is a small gpt), shown in its help."""
    opt = option_of(f)
    flags = opt.flags or ("--" + f.name.replace("_", "-"),)
    base, _ = unoptional(hints(section)[f.name])
    text = help_of(section, f)
    if default is MISSING:
        default = f.default if f.default is not MISSING else None
    if base is bool and opt.const is None:
        return flags, {"action": "store_false" if opt.negate else "store_true", "help": text}
    kwargs: dict[str, Any] = {"help": text + ("" if default in (None, False, ()) else f" (default {default})")}
    choices = choices_of(base)
    if opt.parse is not None:
        pass  # parsed in ``build``, so that its one line is the run's (argparse would swallow it)
    elif choices is not None and isinstance(choices[0], str) and opt.check is None:
        kwargs["type"], kwargs["choices"] = str, choices
    elif choices is not None:  # numbers, or a field with its own words: its check says what is valid
        kwargs["type"], kwargs["metavar"] = type(choices[0]), "{" + ",".join(map(str, choices)) + "}"
    elif base in (int, float):
        kwargs["type"] = base
    if opt.const is not None:
        kwargs["nargs"], kwargs["const"] = "?", opt.const
    if choices is None:
        kwargs["metavar"] = opt.metavar or f.name.split("_")[-1].upper()
    return flags, kwargs


def given(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The options given on a command line, by section: ``{"parallel": {"tensor_parallel": 2}}``."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in vars(args).items():
        if SEP in key:
            section, name = key.split(SEP, 1)
            out.setdefault(section, {})[name] = value
    return out


def build(cls: type, values: dict[str, dict[str, Any]]) -> Any:
    """A ``cls`` from section values over its defaults; a field that spreads (``--model``) sets its siblings,
    and a section may check what is given together (``check_given``)."""
    kwargs: dict[str, Any] = {}
    for name, section in sections(cls):
        fields = dict(values.get(name, {}))
        spread(section, fields)
        check_given = getattr(section, "check_given", None)  # what a section refuses to be given together
        if check_given is not None:
            check_given(fields)
        if fields:
            base = _base(cls, name, section, fields)
            kwargs[name] = dataclasses.replace(base, **fields)
    return cls(**kwargs)


def spread(section: type, fields: dict[str, Any]) -> None:
    """Expand the fields whose value sets several of the section's fields (``kind="hf:gpt2"``)."""
    for f in dataclasses.fields(section):
        opt = option_of(f)
        if opt.parse is not None and isinstance(fields.get(f.name), str):
            fields[f.name] = opt.parse(fields[f.name])
        if opt.spread is not None and isinstance(fields.get(f.name), str):
            fields.update(opt.spread(fields[f.name]))


def _base(cls: type, name: str, section: type, fields: dict[str, Any]) -> Any:
    """What the given fields replace: the configuration's default section, or -- where the given fields choose
    another kind of thing (``--model mlp``) -- that kind's own defaults."""
    default = next(f for f in dataclasses.fields(cls) if f.name == name).default_factory()  # type: ignore[misc]
    kind = fields.get("kind")
    if kind is not None and getattr(default, "kind", kind) != kind:
        return section(kind=kind, entry=fields.get("entry"))
    return default


def from_arguments(args: argparse.Namespace, cls: type, base: dict[str, dict[str, Any]] | None = None) -> Any:
    """The configuration of a parsed command line, over ``base`` (a file's sections) and the defaults."""
    values: dict[str, dict[str, Any]] = {name: dict(fields) for name, fields in (base or {}).items()}
    for name, fields in given(args).items():
        values.setdefault(name, {}).update(fields)
    return build(cls, values)


def flag_names(cls: type) -> dict[str, str]:
    """Each option's long flag -> ``section.field`` (for messages and the contributor guide)."""
    return {
        flag_of(f): f"{name}{SEP}{f.name}"
        for name, section in sections(cls)
        for f in dataclasses.fields(section)
        if not option_of(f).internal and option_of(f).via is None
    }
