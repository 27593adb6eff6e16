"""``TrainConfig`` refuses a field of the wrong type in one line (a ``UserError``), not a raw TypeError.

``TrainConfig(batch_size="16").check()`` raises ``TypeError: '<' not supported between
instances of 'str' and 'int'`` today. The fix belongs in ``runtime/config.py``, which is
being restructured, so these tests are expected to fail until it lands.
"""

from __future__ import annotations

import pytest

from pipeweave.errors import UserError


@pytest.mark.xfail(strict=True, reason="TrainConfig field types are checked in runtime/config.py, being restructured")
@pytest.mark.parametrize(("field", "value"), [("batch_size", "16"), ("steps", "10"), ("lr", "0.1")])
def test_a_field_of_the_wrong_type_is_a_user_error(field: str, value: str) -> None:
    from pipeweave.runtime.config import TrainConfig

    with pytest.raises(UserError) as info:
        TrainConfig(**{field: value}).check()  # type: ignore[arg-type]
    message = str(info.value)
    assert field.split("_")[0] in message and value in message and "\n" not in message, message
