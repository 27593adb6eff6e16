"""``--hf-config``: its fields read, checked against the model type's config, and transformers' refusals as one line.

transformers accepts any key into a config (a misspelt ``n_embed`` becomes an
attribute nothing reads), and refuses bad values with its own exceptions, some
only when the model is built (``n_embd`` not divisible by ``n_head``: a
ValueError; ``activation_function: "banana"``: a KeyError). Here an unknown
key is refused with the closest valid one, the heads are checked before
transformers sees them, and what transformers still refuses is one line naming
the field, its value and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeweave.errors import UserError

_CONSUMED = {"torch_dtype", "num_labels", "output_attentions", "attn_implementation", "name_or_path"}
"""Keys every config's ``__post_init__`` takes that are not its fields (transformers' ``PreTrainedConfig``)."""
_ACTIVATION = re.compile(r"(^|_)act")
"""Fields naming an activation: gpt2's ``activation_function``, llama's ``hidden_act``, ..."""
_ROPE_LEGACY = {"rope_scaling", "rope_theta"}
"""Keys a config with ``rope_parameters`` turns into them."""


def config_fields(text: str | None) -> dict[str, Any]:
    """The JSON object ``--hf-config`` gives, inline or in a file.

    Raises:
        UserError: neither a JSON object nor a file holding one.
    """
    if text is None:
        return {}
    source = Path(text).read_text() if not text.lstrip().startswith("{") and Path(text).is_file() else text
    try:
        fields = json.loads(source)
    except json.JSONDecodeError as e:
        raise UserError(
            f"--hf-config {text[:60]!r} is not a JSON object ({e.msg}) nor a file holding one; give "
            'e.g. \'{"n_layer": 2, "n_embd": 64}\''
        ) from None
    if not isinstance(fields, dict):
        raise UserError(f"--hf-config gives {type(fields).__name__}; give a JSON object of config fields")
    return fields


def make_config(transformers: Any, entry: str, fields: dict[str, Any]) -> Any:
    """The config of model type ``entry`` (``hf:NAME``) with ``fields``, each checked first.

    Raises:
        UserError: an unknown model type, a key its config lacks (with the closest it has), heads that do not
            divide the width, a value transformers refuses.
    """
    name = entry.partition(":")[2]
    try:
        default = transformers.AutoConfig.for_model(name)
    except ValueError as e:
        raise UserError(
            f"--model {entry}: {str(e).split('.')[0]}; name a transformers model type such as gpt2 or llama"
        ) from None
    cls = type(default)
    _refuse_unknown(cls, default, fields, entry)
    _check_heads(cls, default, fields)
    for key, value in fields.items():  # before the model (and its module) is built: a KeyError then
        if isinstance(value, str) and _ACTIVATION.search(key):
            _check_activation(key, value)
    try:
        return cls(**{"use_cache": False, **fields})
    except Exception as e:  # noqa: BLE001 - huggingface_hub's strict validation errors share no base with ValueError
        raise UserError(refusal(entry, fields, e)) from None


def built(entry: str, fields: dict[str, Any], build: Callable[[], Any]) -> Any:
    """``build()`` (the model from its config), with what transformers refuses then as one line."""
    try:
        return build()
    except (KeyError, ValueError, TypeError, ZeroDivisionError, RuntimeError) as e:  # n_head 0, n_embd -4
        raise UserError(refusal(entry, fields, e)) from None


def known_keys(cls: type, default: Any) -> set[str]:
    """The keys a config of ``cls`` takes: its fields, their aliases, and the keys its base class consumes."""
    keys = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set(vars(default))
    keys |= set(getattr(cls, "attribute_map", {})) | _CONSUMED
    return keys | (_ROPE_LEGACY if "rope_parameters" in keys else set())


def _refuse_unknown(cls: type, default: Any, fields: dict[str, Any], entry: str) -> None:
    known = known_keys(cls, default)
    unknown = [key for key in fields if key not in known]
    if not unknown:
        return
    base = {f.name for f in dataclasses.fields(cls.__mro__[1])} if dataclasses.is_dataclass(cls.__mro__[1]) else set()
    # the model's own fields first: num_layers -> num_hidden_layers, not the base class's num_labels
    own = sorted(known - base - _CONSUMED)
    close = difflib.get_close_matches(unknown[0], own, n=1) or difflib.get_close_matches(unknown[0], sorted(known), n=1)
    fix = f"did you mean {close[0]!r}?" if close else f"give fields of {cls.__name__} (transformers' {entry[3:]})"
    raise UserError(f"--hf-config key {unknown[0]!r} is not a field of {cls.__name__}; {fix}")


def _check_heads(cls: type, default: Any, fields: dict[str, Any]) -> None:
    """The attention heads divide the width, unless the config has a head width of its own (``head_dim``)."""
    own = {f.name: f.default for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    if fields.get("head_dim") is not None or own.get("head_dim") is not None:  # qwen3's 128, whatever the width
        return
    aliases, canonical = getattr(cls, "attribute_map", {}), ("hidden_size", "num_attention_heads")
    names = [aliases.get(c, c) for c in canonical]  # gpt2's n_embd, n_head
    hidden, heads = (fields.get(n, fields.get(c, getattr(default, c, None))) for n, c in zip(names, canonical))
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (hidden, heads)):
        return  # absent, or of a type transformers refuses in its own words
    if hidden % heads:
        up = -(-hidden // heads) * heads
        raise UserError(
            f"--hf-config {names[0]}={hidden} is not divisible by {names[1]}={heads}; give {names[0]}={up} "
            f"(or another multiple of {heads}), or a {names[1]} dividing {hidden}"
        )


def refusal(entry: str, fields: dict[str, Any], error: Exception) -> str:
    """transformers' refusal of ``fields`` as one line: the field, its value, the fix."""
    cause = error.__cause__ if error.__cause__ is not None else error
    text = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    field = _field_named(str(error), fields) or _field_valued(error, fields)
    if isinstance(error, KeyError) and field is not None:
        return _unknown_value(field, fields[field], text)
    if field is not None:
        return f"--hf-config {field}={fields[field]!r} is refused by transformers ({text}); give {field} one it takes"
    return f"--hf-config gives a {entry[3:]} config transformers refuses ({text}); change the fields it names"


def _field_named(message: str, fields: dict[str, Any]) -> str | None:
    """The given field a strict-validation message names (``Validation error for field 'n_layer'``)."""
    return next((k for k in fields if f"field '{k}'" in message), None)


def _field_valued(error: Exception, fields: dict[str, Any]) -> str | None:
    """The given field whose value the error is about: a KeyError's key (``activation_function: "banana"``),
    the one zero a ZeroDivisionError divided by, the one number the message quotes (``negative dimension -4``)."""
    if isinstance(error, KeyError):
        return next((k for k, v in fields.items() if isinstance(v, str) and error.args and v == error.args[0]), None)
    numbers = {k: v for k, v in fields.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if isinstance(error, ZeroDivisionError):
        named = [k for k, v in numbers.items() if v == 0]
    else:
        quoted = set(re.findall(r"(?<![\w.])-?\d+(?:\.\d+)?(?![\w.])", str(error)))
        named = [k for k, v in numbers.items() if str(v) in quoted]
        named = [k for k in named if numbers[k] <= 0] if len(named) > 1 else named  # of several, the one below 1
    return named[0] if len(named) == 1 else None


def _check_activation(field: str, value: str) -> None:
    from transformers.activations import ACT2FN

    if value not in ACT2FN:
        names = sorted(ACT2FN)
        close = difflib.get_close_matches(value, names, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UserError(
            f"--hf-config {field}={value!r} is no activation transformers knows; {hint}choose one of: {', '.join(names)}"
        )


def _unknown_value(field: str, value: Any, text: str) -> str:
    if _ACTIVATION.search(field) and isinstance(value, str):
        try:
            _check_activation(field, value)
        except UserError as e:
            return str(e)
    return f"--hf-config {field}={value!r} is a name transformers does not know ({text}); give {field} one it does"
