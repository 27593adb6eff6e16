"""F&B pairs in the IR: DualPipe's, their text forms, and what the validator refuses."""

from __future__ import annotations

import dataclasses

import pytest

from pipeweave.schedule import format_grid, generate, validate
from pipeweave.schedule.dualpipe import dualpipe_pairs, dualpipe_v_pairs
from pipeweave.schedule.ir import Action, Op
from pipeweave.schedule.lower import lower
from pipeweave.schedule.text import from_csv, to_csv
from pipeweave.schedule.validate import InvalidSchedule

GOLDEN_DUALPIPE_V = """\
rank 0 | 0F0      0F1      0F2      3F0      3I0      3W0      3F1      0F3&3B1  3F2&0B0  3B2      3F3&0B1  3B3      0I2      0W2      0I3      0W3      0U0      3U0
rank 1 | 1F0      2F0      1F1      2F1      1F2      2B0      2F2&1B0  1F3&2B1  2F3&1B1  2B2      1B2      2I3      1I3      2W3      1W3      1U0      2U0"""  # noqa: E501


def test_golden_picture_with_pairs() -> None:
    assert format_grid(generate("dualpipe-v", num_stages=2, num_microbatches=4)) == GOLDEN_DUALPIPE_V


@pytest.mark.parametrize(("name", "d", "t"), [("dualpipe", 2, 8), ("dualpipe", 4, 12), ("dualpipe-v", 3, 9)])
def test_dualpipe_pairs_are_deepseeks_and_the_order_is_unchanged(name: str, d: int, t: int) -> None:
    paired = generate(name, num_stages=d, num_microbatches=t)
    serial = generate(name, num_stages=d, num_microbatches=t, overlap_fb=False)
    assert paired.actions == serial.actions and not serial.pairs
    positions = (dualpipe_pairs if name == "dualpipe" else dualpipe_v_pairs)(d, t)
    assert paired.pairs == tuple((row[f], row[b]) for row, p in zip(paired.actions, positions) for f, b in p)
    validate(paired)


@pytest.mark.parametrize("name", ["dualpipe", "dualpipe-v"])
def test_pairs_read_back_from_csv_grid_and_torch_form(name: str) -> None:
    s = generate(name, num_stages=2, num_microbatches=8)
    text = to_csv(s)
    assert "(3F5;0B0)OVERLAP_F_B" in text or name == "dualpipe-v"
    assert from_csv(text, name=name) == s
    longest = max(len(row) for row in s.actions)
    if name == "dualpipe-v":  # torch's form: no header, the grid too
        assert from_csv(format_grid(s, max_steps=longest), name=name, num_microbatches=8) == s


def test_lowering_keeps_the_pairs_and_the_b_halfs_receive_between_the_halves() -> None:
    s = generate("dualpipe", num_stages=2, num_microbatches=4)
    (f, b), *_ = [p for p in s.pairs if s.placement.stage_rank[p[0].stage] == 1]
    row = [str(a) for a in lower(s).actions[1]]
    assert lower(s).schedule.pairs == s.pairs
    assert row[row.index(str(f)) : row.index(str(b)) + 1] == [
        "1F1",
        "2RECV_B2",
        "2B2",
    ]  # 1 ends the down pipeline: no send


@pytest.mark.parametrize(
    ("pair", "match"),
    [
        ((Action(0, Op.F, 1), Action(0, Op.B, 1)), "must come right after 0F1"),
        ((Action(0, Op.B, 0), Action(0, Op.F, 1)), "is not an F and a B or I"),
        ((Action(0, Op.F, 1), Action(0, Op.B, 7)), "which no rank runs"),
    ],
)
def test_validator_refuses_malformed_pairs(pair: tuple[Action, Action], match: str) -> None:
    s = generate("gpipe", num_stages=2, num_microbatches=2)
    with pytest.raises(InvalidSchedule, match=match):
        validate(dataclasses.replace(s, pairs=(pair,)))


def test_validator_refuses_a_pair_whose_b_half_waits_on_its_f_half_through_another_rank() -> None:
    # rank 0 runs 0F0 0F1 0B0 0B1: fine one after the other, but 0B0 needs 1B0, which rank 1 runs after
    # 1F1, which needs 0F1: paired, (0F1;0B0) can never start with both inputs there.
    s = generate("gpipe", num_stages=2, num_microbatches=2)
    validate(s)
    paired = dataclasses.replace(s, pairs=((Action(0, Op.F, 1), Action(0, Op.B, 0)),))
    with pytest.raises(InvalidSchedule, match=r"deadlock: rank 0 step 1 \(F&B pair \(0F1;0B0\)\) waits for 1B0"):
        validate(paired)


def test_a_pair_of_one_stage_and_microbatch_is_refused() -> None:
    s = generate("1f1b", num_stages=1, num_microbatches=2)  # 0F0 0B0 0F1 0B1
    with pytest.raises(InvalidSchedule, match="0B0 needs what 0F0 makes"):
        validate(dataclasses.replace(s, pairs=((Action(0, Op.F, 0), Action(0, Op.B, 0)),)))


def test_passes_that_drop_a_half_drop_its_pair() -> None:
    s = generate("dualpipe-v", num_stages=2, num_microbatches=4)
    assert s.with_actions([[a for a in row if a.op is Op.F] for row in s.actions]).pairs == ()
    assert s.with_actions(s.actions).pairs == s.pairs
