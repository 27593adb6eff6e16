"""Schedules as data: the IR, the generators, validation and text I/O (no torch)."""

from pipeweave.schedule.dataflow import Execution, execute
from pipeweave.schedule.grid import format_grid
from pipeweave.schedule.info import DataParallel, PlacementKind, ScheduleInfo
from pipeweave.schedule.ir import (
    Action,
    Op,
    Placement,
    Schedule,
    ScheduleError,
    WeightPolicy,
)
from pipeweave.schedule.lower import LoweredSchedule, lower
from pipeweave.schedule.registry import SCHEDULES, generate
from pipeweave.schedule.text import from_csv, parse_action, parse_actions, read_csv, to_csv, write_csv
from pipeweave.schedule.torch_form import to_torch_csv, torch_refusal
from pipeweave.schedule.validate import InvalidSchedule, is_valid, validate

__all__ = [
    "Action",
    "DataParallel",
    "Execution",
    "InvalidSchedule",
    "LoweredSchedule",
    "Op",
    "Placement",
    "PlacementKind",
    "SCHEDULES",
    "Schedule",
    "ScheduleError",
    "ScheduleInfo",
    "WeightPolicy",
    "execute",
    "format_grid",
    "from_csv",
    "generate",
    "is_valid",
    "lower",
    "parse_action",
    "parse_actions",
    "read_csv",
    "to_csv",
    "to_torch_csv",
    "torch_refusal",
    "validate",
    "write_csv",
]
