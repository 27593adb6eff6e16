"""Text I/O: the ``2F0`` form and torch.distributed.pipelining's compute-only CSV, both ways."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest

from pipeweave.schedule import (
    SCHEDULES,
    Action,
    Op,
    Schedule,
    ScheduleError,
    from_csv,
    generate,
    parse_action,
    read_csv,
    to_csv,
    validate,
    write_csv,
)
from pipeweave.schedule.text import torch_compatible
from pipeweave.schedule.torch_form import torch_token_actions
from pipeweave.sim import compute_metrics, simulate

SIZES = [(1, 1), (2, 4), (3, 6), (4, 8)]


def _registry_schedules() -> list[Schedule]:
    out = []
    for name in SCHEDULES:
        for d, t in SIZES if not name.endswith("-auto") else [(2, 4)]:
            try:
                out.append(generate(name, num_stages=d, num_microbatches=t))
            except ScheduleError:
                continue
    return out


ALL = _registry_schedules()


def _id(s: Schedule) -> str:
    return f"{s.name}-D{s.num_ranks}-T{s.num_microbatches}"


def _straight_pipeline(s: Schedule) -> bool:
    """One pipeline through stages 0..S-1: the only placement a CSV can carry."""
    return s.placement.pipelines == (tuple(range(s.num_stages)),)


@pytest.mark.parametrize("schedule", ALL, ids=_id)
def test_csv_round_trip_is_identical(schedule: Schedule) -> None:
    back = from_csv(to_csv(schedule), name=schedule.name, num_microbatches=schedule.num_microbatches)
    assert back.actions == schedule.actions
    assert to_csv(back) == to_csv(schedule)
    assert back == schedule  # placement, routes, policy, everything (a header carries what torch cannot)


@pytest.mark.parametrize("schedule", [s for s in ALL if s.is_synchronous], ids=_id)
def test_torch_form_without_updates_reads_back_with_updates_at_the_end(schedule: Schedule) -> None:
    text = to_csv(schedule, updates=False)
    assert "U" not in text
    back = from_csv(text, num_microbatches=schedule.num_microbatches)
    no_u = [[a for a in row if a.op is not Op.U] for row in back.actions]
    assert no_u == [[a for a in row if a.op is not Op.U] for row in schedule.actions]
    if _straight_pipeline(schedule):
        validate(back)


def test_torch_parses_every_cell_we_export() -> None:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    for schedule in ALL:
        text = to_csv(schedule, updates=False)
        assert text.startswith("#") != torch_compatible(schedule)  # a header only where torch's form falls short
        body = "".join(line for line in text.splitlines(keepends=True) if not line.startswith("#"))
        for row in csv.reader(io.StringIO(body)):
            for cell in row:
                parsed = schedules._Action.from_str(cell)
                assert str(parsed) == cell
                if cell.startswith("("):  # an F&B pair, torch's OVERLAP_F_B
                    subs = [(a.stage_index, a.microbatch_index) for a in parsed.sub_actions]
                    assert subs == [(a.stage, a.microbatch) for a in torch_token_actions(cell)]
                    continue
                ours = parse_action(cell)
                assert (parsed.stage_index, parsed.microbatch_index) == (ours.stage, ours.microbatch)


def test_torch_idle_cells_are_skipped() -> None:
    # torch._dump_csv writes None steps (idle) as empty cells.
    text = "0F0,0F1,,0B0,,0B1\n,1F0,1B0,1F1,1B1,\n"
    s = from_csv(text)
    assert [[str(a) for a in row] for row in s.actions] == [
        ["0F0", "0F1", "0B0", "0B1", "0U0"],
        ["1F0", "1B0", "1F1", "1B1", "1U0"],
    ]
    validate(s)


def test_hand_written_csv_is_simulated(tmp_path: Path) -> None:
    # GPipe on 2 ranks with 2 microbatches, written by hand: with f = b = w = 1
    # rank 1 runs F0 [1,2] F1 [2,3] B0 [3,5] B1 [5,7]; rank 0's B0 starts at 5.
    path = tmp_path / "mine.csv"
    path.write_text("0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1\n")
    s = read_csv(path)
    assert s.name == "mine" and s.num_microbatches == 2
    t = simulate(s)
    assert [(str(e.action), e.start, e.end) for e in t.events[0]] == [
        ("0F0", 0.0, 1.0),
        ("0F1", 1.0, 2.0),
        ("0B0", 5.0, 7.0),
        ("0B1", 7.0, 9.0),
        ("0U0", 9.0, 9.0),
    ]
    assert compute_metrics(t).makespan == 9.0


def test_write_and_read_csv_files(tmp_path: Path) -> None:
    s = generate("zb-h1", num_stages=3, num_microbatches=4)
    write_csv(s, tmp_path / "zb.csv")
    assert read_csv(tmp_path / "zb.csv", name="zb-h1") == s


@pytest.mark.parametrize(
    "text,match",
    [
        ("0F0,0X1\n", "cannot read action '0X1'"),
        ("", "holds no actions"),
        ("0F0,1F0\n1B0\n", "stage 1 appears on ranks 0 and 1"),
        ("0F0,0B0\n2F0,2B0\n", r"stages \[1\] have no actions"),
    ],
)
def test_bad_csv_is_one_clear_error(text: str, match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        from_csv(text)


def test_parse_action_rejects_garbage() -> None:
    for bad in ("F0", "0F", "0Q0", "a0F0", "0 F 0"):
        with pytest.raises(ScheduleError, match="<stage><op><microbatch>"):
            parse_action(bad)
    assert parse_action(" 3W12 ") == Action(3, Op.W, 12)


@pytest.mark.parametrize("schedule", [s for s in ALL if torch_compatible(s)], ids=_id)
def test_text_form_reads_back_as_the_csv(schedule: Schedule) -> None:
    from pipeweave.schedule.grid import format_grid

    longest = max(len(row) for row in schedule.actions)
    text = format_grid(schedule, mark=(0, 0), max_steps=longest)  # a marked cell too, as the validator prints it
    assert from_csv(text, name=schedule.name, num_microbatches=schedule.num_microbatches) == schedule


def test_text_form_without_labels_and_a_bad_token_names_its_line() -> None:
    one_f_one_b = generate("1f1b", num_stages=2, num_microbatches=2)
    assert from_csv("0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1\n", name="1f1b") == one_f_one_b
    with pytest.raises(ScheduleError, match=r"^line 2: cannot read action '\.\.\.'"):
        from_csv("0F0 0F1 0B0 0B1\n1F0 1B0 ...\n")
