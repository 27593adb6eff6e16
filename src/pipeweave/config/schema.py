"""How a configuration field is declared: its type, its docstring, its flag and its check, all in one place.

A section of the configuration is a frozen dataclass whose fields are made
by ``option``; each field's docstring (the string literal under it) is its
help. From these alone ``config.cli`` builds the command line, ``config.toml``
reads and writes files, and ``check_section`` refuses a value of the wrong
type or outside its set in one line naming the option and the fix.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import operator
import textwrap
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, Field
from typing import Any, Literal, Union

from pipeweave.errors import UserError

KEY = "pipeweave"
"""The key of a field's ``Option`` in its dataclass metadata."""


@dataclasses.dataclass(frozen=True)
class Option:
    """What the command line and files need to know of one field beyond its type and docstring."""

    flags: tuple[str, ...] = ()
    """The option's names; () means ``--`` and the field's name with dashes."""
    metavar: str | None = None
    """The value's placeholder in ``--help``."""
    internal: bool = False
    """Filled by the run's resolution (``runtime.run.resolve``), never given: no flag, not in files."""
    const: Any = None
    """The value of the flag given bare (``--recompute`` alone means ``full``); None: the flag needs a value."""
    negate: bool = False
    """A boolean whose flag sets it False (``--no-correction``)."""
    check: Callable[[Any, str], None] | None = None
    """``check(value, flag)``: raise ``UserError`` for a value invalid on its own."""
    parse: Callable[[str], Any] | None = None
    """Text of the command line -> value, where the type alone does not say (``3,2,2,1`` -> a tuple)."""
    spread: Callable[[Any], dict[str, Any]] | None = None
    """The flag sets several fields of its section: value -> ``{field: value}`` (``--model hf:gpt2``)."""
    via: str | None = None
    """Set by another field's flag (``spread``), named here; the field has none of its own."""


def option(
    default: Any = MISSING,
    *,
    default_factory: Any = MISSING,
    flags: tuple[str, ...] = (),
    metavar: str | None = None,
    internal: bool = False,
    const: Any = None,
    negate: bool = False,
    check: Callable[[Any, str], None] | None = None,
    parse: Callable[[str], Any] | None = None,
    spread: Callable[[Any], dict[str, Any]] | None = None,
    via: str | None = None,
) -> Any:
    """A configuration field: ``dataclasses.field`` with its ``Option``."""
    meta = {
        KEY: Option(
            flags=flags,
            metavar=metavar,
            internal=internal,
            const=const,
            negate=negate,
            check=check,
            parse=parse,
            spread=spread,
            via=via,
        )
    }
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def option_of(f: Field[Any]) -> Option:
    """The ``Option`` of a field (a plain dataclass field has the default one)."""
    return f.metadata.get(KEY, Option())  # type: ignore[no-any-return]


def flag_of(f: Field[Any]) -> str:
    """The long flag of a field, as messages name it: ``--tensor-parallel``."""
    given = option_of(f).flags
    long = [name for name in given if name.startswith("--")]
    return long[0] if long else "--" + f.name.replace("_", "-")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring, read from the class's source (the string literal under the field)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0]
        if not isinstance(body, ast.ClassDef):
            continue
        for node, after in zip(body.body, body.body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def help_of(cls: type, f: Field[Any]) -> str:
    """The first paragraph of a field's docstring on one line (``--help``)."""
    doc = field_docs(cls).get(f.name, "")
    return " ".join(doc.split("\n\n")[0].split()).replace("``", "")


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    """The fields' types, evaluated."""
    return typing.get_type_hints(cls)


def unoptional(hint: Any) -> tuple[Any, bool]:
    """``X | None`` -> ``(X, True)``; any other type -> ``(type, False)``."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) < len(typing.get_args(hint)):
            return functools.reduce(operator.or_, args), True
    return hint, False


def choices_of(hint: Any) -> tuple[Any, ...] | None:
    """The values of a ``Literal`` type (None for any other)."""
    base, _ = unoptional(hint)
    return typing.get_args(base) if typing.get_origin(base) is Literal else None


def _kind(value: Any, hint: Any) -> str | None:
    """What ``value`` should have been for ``hint`` (None: it is of that type)."""
    base, optional = unoptional(hint)
    if value is None:
        return None if optional else "a value"
    choices = choices_of(base)
    if choices is not None:
        base = type(choices[0])
    if base is bool:
        return None if isinstance(value, bool) else "True or False"
    if base is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer >= 1"
    if base is float:
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else "a number"
    if base is str:
        return None if isinstance(value, str) else "a string"
    origin = typing.get_origin(base)
    if origin in (Union, types.UnionType):  # one of simple types (``str | bool``)
        ok = any(_kind(value, arg) is None for arg in typing.get_args(base))
        return None if ok else " or ".join(getattr(a, "__name__", str(a)) for a in typing.get_args(base))
    if origin is tuple:
        return None if isinstance(value, tuple) else "a tuple"
    if isinstance(base, type) and not isinstance(value, base):
        return f"a {base.__name__}"
    return None


def check_section(section: Any) -> None:
    """Refuse a field of the wrong type, outside its set, or failing its own check, in one line.

    Raises:
        UserError: e.g. ``batch_size='16' is a str; give an integer >= 1``.
    """
    cls = type(section)
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        hint = hints(cls)[f.name]
        want = _kind(value, hint)
        if want is not None:
            raise UserError(f"{f.name}={value!r} is a {type(value).__name__}; give {want}")
        check = option_of(f).check
        if check is not None and value is not None:  # its own words first (--lr inf: finite)
            check(value, flag_of(f))
        choices = choices_of(hint)
        if value is not None and choices is not None and value not in choices:
            word = "unknown" if isinstance(value, str) else "invalid"
            raise UserError(
                f"{flag_of(f)} {value!r} is {word}; choose one of: {', '.join(map(str, choices))}"
                if isinstance(value, str)
                else f"{flag_of(f)} {value} is {word}; choose one of: {', '.join(map(str, choices))}"
            )


def at_least(low: int | float, fix: str = "give an integer >= 1") -> Callable[[Any, str], None]:
    """A check: the value is at least ``low`` (``fix``: what the message tells the user to give)."""

    def check(value: Any, flag: str) -> None:
        if not value >= low:  # nan too
            raise UserError(f"{flag} {value} is invalid; {fix}")

    return check


def sections(cls: type) -> list[tuple[str, type]]:
    """The sections of a configuration class: ``(field name, section class)`` in declaration order."""
    return [
        (f.name, hints(cls)[f.name]) for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints(cls)[f.name])
    ]
