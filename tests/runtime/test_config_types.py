"""``TrainConfig`` refuses a field of the wrong type in one line (a ``UserError``), not a raw TypeError."""

from __future__ import annotations

import pytest
from config_defaults import train_config

from pipeweave.errors import UserError


@pytest.mark.parametrize(
    ("field", "value"),
    [("batch_size", "16"), ("steps", "10"), ("lr", "0.1"), ("recompute", 1), ("steps", True), ("save_every", 2.5)],
)
def test_a_field_of_the_wrong_type_is_a_user_error(field: str, value: object) -> None:
    with pytest.raises(UserError) as info:
        train_config(**{field: value})  # type: ignore[arg-type]  # check() runs on construction
    message = str(info.value)
    assert field.split("_")[0] in message and repr(value) in message and "\n" not in message, message


def test_check_refuses_a_value_set_after_construction() -> None:
    config = train_config()
    object.__setattr__(config.data, "batch_size", "16")  # frozen: only by force
    with pytest.raises(UserError, match="batch_size='16' is a str; give an integer >= 1"):
        config.check()
