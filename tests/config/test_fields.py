"""One configuration, declared once: every field of ``TrainConfig``'s sections is one ``pipeweave train`` option
with its type and help, generated from the dataclasses; field names are unique over the sections."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from pipeweave.config import TrainConfig
from pipeweave.config.cli import add_arguments, flag_names, from_arguments
from pipeweave.config.schema import field_docs, hints, option_of, sections
from pipeweave.config.train import field_owners
from pipeweave.errors import UserError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_arguments(parser, TrainConfig)
    return parser


def _public_fields() -> list[tuple[str, type, dataclasses.Field]]:  # type: ignore[type-arg]
    return [
        (name, section, f)
        for name, section in sections(TrainConfig)
        for f in dataclasses.fields(section)
        if not option_of(f).internal
    ]


def test_the_parser_built_from_the_dataclasses_has_a_flag_type_and_help_for_every_field() -> None:
    actions = {action.dest: action for action in _parser()._actions}
    for name, section, f in _public_fields():
        assert f.name in hints(section), f"{name}.{f.name} has no type"
        assert field_docs(section).get(f.name), f"{name}.{f.name} has no docstring"
        if option_of(f).via is not None:  # set by another field's flag (--model sets kind and entry)
            assert option_of(f).via in flag_names(TrainConfig), f"{name}.{f.name} is set by an unknown flag"
            continue
        action = actions.get(f"{name}.{f.name}")
        assert action is not None, f"{name}.{f.name} has no flag"
        assert action.option_strings and action.help, f"{name}.{f.name}: {action}"
        if option_of(f).parse is not None:  # the text is read by its own parser (e.g. bytes with a unit)
            assert action.type is None, f"{name}.{f.name} parses as {action.type} before its parser"
        elif hints(section)[f.name] in (int, float, int | None, float | None):
            assert action.type in (int, float), f"{name}.{f.name} parses as {action.type}"


def test_field_names_are_unique_over_the_sections_and_every_section_is_frozen() -> None:
    owners = field_owners(TrainConfig)
    assert len(owners) == sum(len(dataclasses.fields(s)) for _, s in sections(TrainConfig))
    for _, section in sections(TrainConfig):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(section(), dataclasses.fields(section)[0].name, None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Extra:
    """A section added by a contributor."""

    warp_factor: int = 1
    """How fast."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    extra: Extra = dataclasses.field(default_factory=Extra)
    """The new section."""


def test_a_new_field_is_a_new_option() -> None:
    """Adding an option is one field: a section with one more field has one more flag, and it reaches the config."""

    parser = argparse.ArgumentParser()
    add_arguments(parser, Config)
    assert from_arguments(parser.parse_args(["--warp-factor", "9"]), Config).extra.warp_factor == 9
    assert "How fast." in parser.format_help()


def test_flags_and_defaults_are_pipeweave_trains() -> None:
    config = from_arguments(_parser().parse_args([]), TrainConfig)
    assert config == TrainConfig()
    assert (config.schedule.name, config.schedule.num_stages, config.schedule.num_microbatches) == ("zb-h1", 2, 4)
    assert (config.data.batch_size, config.training.steps, config.training.optimizer) == (16, 30, "adamw")
    args = ["--model", "mlp", "--tensor-parallel", "2", "--recompute", "--clip-grad-norm", "1", "-s", "1f1b"]
    config = from_arguments(_parser().parse_args(args), TrainConfig)
    assert config.model.kind == "mlp" and config.training.optimizer == "sgd" and config.training.lr == 0.1
    assert config.parallel.tensor_parallel == 2 and config.memory.recompute == "full"
    assert config.training.post_validation is not None and config.training.post_validation.max_norm == 1.0


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"zero": 4}, "--zero 4 is invalid; choose one of: 0, 1, 2, 3"),
        (
            {"optimizer": "lamb"},
            "--optimizer 'lamb' is unknown; choose one of: sgd, nesterov, adam, adamw, rmsprop, adabelief",
        ),
        ({"tensor_parallel": "2"}, "tensor_parallel='2' is a str; give an integer >= 1"),
        ({"warp": 1}, "'warp' is no field of TrainConfig"),
        ({"decay": 0.5}, "--decay applies to pipemare, not zb-h1; drop it"),
        ({"warmup_steps": 2}, "--warmup-steps applies to pipemare, not zb-h1; drop it"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_option(given: dict[str, object], message: str) -> None:
    with pytest.raises(UserError) as info:
        TrainConfig(**given)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_fields_read_by_name_and_sections_replace_alike() -> None:
    config = TrainConfig(num_stages=4, tensor_parallel=2, schedule="1f1b")
    assert config.num_stages == config.schedule.num_stages == 4 and config.get("tensor_parallel") == 2
    assert dataclasses.replace(config, steps=3).training.steps == 3
    assert config.replace(schedule="gpipe").schedule.num_stages == 4  # a name keeps the section's other fields


def test_every_default_shown_in_help_is_the_one_a_run_uses() -> None:
    """``--help``'s "(default X)" is the value ``TrainConfig()`` holds: the default model is a small gpt whose
    --seq-len is 64, where ModelSpec's own field says 128 (the help showed 128)."""
    import argparse

    from pipeweave.config import TrainConfig
    from pipeweave.config.cli import SEP, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser, TrainConfig)
    used = TrainConfig()
    shown = 0
    for action in parser._actions:
        said = re.search(r"\(default (.+)\)$", action.help or "")
        if said is None or SEP not in action.dest:
            continue
        section, name = action.dest.split(SEP)
        assert said.group(1) == str(getattr(getattr(used, section), name)), (action.option_strings, said.group(1))
        shown += 1
    assert shown > 20
