"""What a schedule supports is said once, on its registry entry (``ScheduleInfo``), and agrees with what
its generator builds; no module keeps its own list of schedule names."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import pipeweave
from pipeweave.schedule import Placement, Schedule, ScheduleError, generate, validate
from pipeweave.schedule.data_parallel import data_parallel
from pipeweave.schedule.ir import Op, WeightPolicy
from pipeweave.schedule.registry import SCHEDULES, DataParallel, PlacementKind, ScheduleInfo, schedule_defaults
from pipeweave.sim.versions import tied_lag

SRC = Path(pipeweave.__file__).parent
REGISTRY = SRC / "schedule" / "registry.py"
SIZES = ((2, 4), (4, 8), (3, 6))  # (D, T); some families need D even or T >= 2D


def name_lists(source: str, names: set[str]) -> list[tuple[int, list[str]]]:
    """Each tuple, list or set literal in ``source`` holding two or more of ``names``, as (line, those names)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            held = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names]
            if len(held) >= 2:
                found.append((node.lineno, held))
    return found


def test_the_scan_finds_a_list_of_names() -> None:
    names = {"zb-auto", "zb-v-auto", "1f1b"}
    source = 'SEARCHED = ("zb-auto", "zb-v-auto")\nif s in ["1f1b", "x"]: pass\nok = {"1f1b", "zb-auto"}\n'
    assert sorted(name_lists(source, names)) == [(1, ["zb-auto", "zb-v-auto"]), (3, ["1f1b", "zb-auto"])]
    assert name_lists('one = ("1f1b",)\nuse = {"1f1b": 1, "zb-auto": 2}\n', names) == []


def test_no_module_lists_schedule_names() -> None:
    """A fact about several schedules is a field of their entries (``SCHEDULES[name].searched``), not a
    tuple of their names somewhere else: adding a schedule then needs no edit outside its entry."""
    names = set(SCHEDULES)
    found = [
        f"{path.relative_to(SRC)}:{line}: {held}"
        for path in sorted(SRC.rglob("*.py"))
        if path != REGISTRY
        for line, held in name_lists(path.read_text(), names)
    ]
    assert not found, "name lists outside schedule/registry.py (make them ScheduleInfo fields):\n" + "\n".join(found)


def _built(name: str) -> list[Schedule]:
    """The schedule ``name`` at the sizes of ``SIZES`` its family accepts (at least one)."""
    out = []
    for d, t in SIZES:
        try:
            out.append(generate(name, num_stages=d, num_microbatches=t))
        except ScheduleError:
            continue
    assert out, f"{name} accepts none of {SIZES}"
    return out


def _kind(schedule: Schedule) -> PlacementKind | None:
    """The kind of a generated schedule's placement, None if it is none of them."""
    p, d = schedule.placement, schedule.num_ranks
    v = p.num_stages // d
    if p == Placement.straight(d):
        return PlacementKind.STRAIGHT
    if v > 1 and p == Placement.looped(d, v):
        return PlacementKind.LOOPED
    if p == Placement.vshape(d):
        return PlacementKind.V_SHAPE
    if p == Placement.bidirectional(d):
        return PlacementKind.BIDIRECTIONAL
    straight = tuple(range(d))
    if len(p.pipelines) > 1 and all(tuple(p.stage_rank[s] for s in line) == straight for line in p.pipelines):
        return PlacementKind.REPLICATED
    return None


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_placement_is_the_generated_ones(name: str) -> None:
    for schedule in _built(name):
        assert _kind(schedule) is SCHEDULES[name].placement, (name, schedule.placement)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_splits_backward_iff_the_schedule_has_i_and_w(name: str) -> None:
    for schedule in _built(name):
        ops = {a.op for row in schedule.actions for a in row}
        assert SCHEDULES[name].splits_backward == (Op.I in ops and Op.W in ops), (name, ops)
        assert SCHEDULES[name].splits_backward or Op.I not in ops and Op.W not in ops


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_searched_iff_the_generator_takes_the_runs_costs(name: str) -> None:
    """``train`` and the planner give a searched schedule its costs and memory limit as generator options."""
    params = inspect.signature(SCHEDULES[name].generator).parameters
    takes = {"time_f", "time_b", "time_w", "activation_limit"} <= set(params)
    assert SCHEDULES[name].searched == takes


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_data_parallel_and_synchrony_agree(name: str) -> None:
    info = SCHEDULES[name]
    assert (info.data_parallel is DataParallel.SYNCHRONOUS) == info.synchronous
    schedule = _built(name)[0]
    if info.data_parallel is DataParallel.SYNCHRONOUS:
        validate(data_parallel(schedule, 2))  # P replicas of its step side by side
    else:
        with pytest.raises(ScheduleError, match="asynchronous"):
            data_parallel(schedule, 2)


# The weight policies of the streams that train a tie (runtime.stage.tied_stream's rule): the last stage
# applies each tied update some updates later, on a straight pipeline, without predictions, per-stage
# rates or averaged replicas.
TIED_POLICIES = {WeightPolicy.STASH, WeightPolicy.VERTICAL_SYNC, WeightPolicy.DOUBLE_BUFFER, WeightPolicy.NONE}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_ties_follow_the_rule(name: str) -> None:
    info = SCHEDULES[name]
    for schedule in _built(name):
        rule = info.synchronous or (schedule.policy in TIED_POLICIES and info.placement is PlacementKind.STRAIGHT)
        assert info.ties == rule, (name, schedule.policy)
        if info.ties and not info.synchronous:
            assert len(tied_lag(schedule)) == schedule.placement.num_stages


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_default_momentum_for_predicting_policies(name: str) -> None:
    """SpecTrain and XPipe predict weights along the momentum: theirs defaults to 0.9, every other's to 0."""
    predicts = _built(name)[0].policy in (WeightPolicy.PREDICTION, WeightPolicy.BELLWETHER_PREDICTION)
    assert schedule_defaults(name).get("momentum", 0.0) == (0.9 if predicts else 0.0)


def test_defaults_of_an_unregistered_schedule_are_the_usual_ones() -> None:
    assert schedule_defaults("my-schedule.csv") == {}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_chunks_are_the_generated_ones(name: str) -> None:
    """Parts per rank and pipeline: the entry's fixed chunks, or interleaved 1F1B's default v = 2."""
    for schedule in _built(name):
        assert schedule.placement.num_parts // schedule.num_ranks == (SCHEDULES[name].chunks or 2), name


def test_every_entry_fills_every_field() -> None:
    for name, info in SCHEDULES.items():
        assert isinstance(info, ScheduleInfo) and info.name == name
        assert isinstance(info.placement, PlacementKind) and isinstance(info.data_parallel, DataParallel)
        assert isinstance(info.splits_backward, bool) and isinstance(info.ties, bool)
