"""``ScheduleInfo.zero`` says what the run's ZeRO check (``runtime.run.prepare``) accepts, for every schedule."""

from __future__ import annotations

import pytest

from pipeweave.config import TrainConfig
from pipeweave.errors import UserError
from pipeweave.runtime.run.prepare import _check_zero
from pipeweave.schedule import SCHEDULES, generate
from pipeweave.schedule.data_parallel import data_parallel


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("zero", [1, 3])
def test_zero_is_what_the_run_accepts(name: str, zero: int) -> None:
    info = SCHEDULES[name]
    config = TrainConfig(schedule=name, num_stages=4, num_microbatches=8, data_parallel=2, zero=zero)
    base = generate(name, num_stages=4, num_microbatches=8)
    schedule = data_parallel(base, 2) if info.synchronous else base
    if info.zero:
        _check_zero(config, schedule)
    else:
        with pytest.raises(UserError, match=f"--zero {zero} "):
            _check_zero(config, schedule)
