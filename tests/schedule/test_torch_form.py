"""torch.distributed.pipelining's CSV formats both ways, checked against torch 2.13's own parser and validator.

No processes: torch's ``_Action.from_str``, ``_validate_schedule`` and its lowering pass ``_add_send_recv``
are pure functions; its schedule classes compute ``pipeline_order`` in their constructor from stand-in stages.
"""

from __future__ import annotations

import csv
import io
import json
from collections import defaultdict
from pathlib import Path

import pytest
from torch_orders import TORCH_CLASSES, torch_order, write_torch_csv

from pipeweave.schedule import SCHEDULES, Op, Schedule, ScheduleError, from_csv, generate, read_csv, validate
from pipeweave.schedule import parse_action as parse
from pipeweave.schedule.torch_form import to_torch_csv, torch_refusal

torch = pytest.importorskip("torch")
schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

SIZES = [(2, 4, None), (4, 8, None), (2, 4, 2), (4, 8, 3), (3, 5, None)]


def _all() -> list[Schedule]:
    out = []
    for name, info in SCHEDULES.items():
        if not info.synchronous:
            continue
        for d, t, v in SIZES if not name.endswith("-auto") else [(2, 4, None), (4, 8, None)]:
            try:
                out.append(generate(name, num_stages=d, num_microbatches=t, num_chunks=v))
            except ScheduleError:
                continue
    return out


EXPRESSIBLE = [s for s in _all() if torch_refusal(s) is None]


def _id(s: Schedule) -> str:
    return f"{s.name}-D{s.num_ranks}-T{s.num_microbatches}-S{s.num_stages}"


def _torch_rows(text: str) -> dict[int, list]:
    return {
        rank: [schedules._Action.from_str(c) for c in row] for rank, row in enumerate(csv.reader(io.StringIO(text)))
    }


def test_every_synchronous_schedule_with_one_pipeline_is_expressible() -> None:
    names = {s.name for s in EXPRESSIBLE}
    assert {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipe-v", "zb-auto"} <= names
    refused = {s.name for s in _all()} - names
    assert refused == {"chimera", "gems", "dualpipe"}  # two pipelines each: parts replicated


@pytest.mark.parametrize("schedule", EXPRESSIBLE, ids=_id)
def test_compute_only_loads_in_torch_and_validates(schedule: Schedule) -> None:
    text = to_torch_csv(schedule)
    assert "U" not in text and not text.startswith("#")
    actions = _torch_rows(text)
    stage_rank = schedules._validate_schedule(
        actions, schedule.num_ranks, schedule.num_stages, schedule.num_microbatches
    )
    assert stage_rank == dict(enumerate(schedule.placement.stage_rank))
    schedules._add_send_recv(  # torch's own lowering of the file: it gets through every action
        {r: list(row) for r, row in actions.items()},
        stage_to_rank=lambda s: stage_rank[s],
        num_stages=schedule.num_stages,
    )
    assert from_csv(text, num_microbatches=schedule.num_microbatches).actions == schedule.actions  # U back at the end


def _channel_orders(rows: dict[int, list], stage_rank: dict[int, int]) -> None:
    """Between two ranks torch matches messages in order: the receiver's RECVs follow the sender's SENDs."""
    sent: dict[tuple[int, int], list[tuple[str, int, int]]] = defaultdict(list)
    got: dict[tuple[int, int], list[tuple[str, int, int]]] = defaultdict(list)
    for rank, row in rows.items():
        for a in row:
            kind = a.computation_type.value
            if kind in ("SEND_F", "SEND_B"):
                peer = a.stage_index + (1 if kind == "SEND_F" else -1)
                sent[(rank, stage_rank[peer])].append((kind[-1], peer, a.microbatch_index))
            elif kind in ("RECV_F", "RECV_B"):
                peer = a.stage_index + (-1 if kind == "RECV_F" else 1)
                got[(stage_rank[peer], rank)].append((kind[-1], a.stage_index, a.microbatch_index))
    assert sent == got


@pytest.mark.parametrize("schedule", EXPRESSIBLE, ids=_id)
def test_compute_comms_pairs_in_order_and_reduces_each_stage_once(schedule: Schedule) -> None:
    text = to_torch_csv(schedule, format="compute_comms")
    rows = _torch_rows(text)
    compute = {r: [a for a in row if a.computation_type.value in "FBIW"] for r, row in rows.items()}
    stage_rank = schedules._validate_schedule(
        compute, schedule.num_ranks, schedule.num_stages, schedule.num_microbatches
    )
    _channel_orders(rows, stage_rank)
    reduces = [a.stage_index for row in rows.values() for a in row if a.computation_type.value == "REDUCE_GRAD"]
    assert sorted(reduces) == list(range(schedule.num_stages))
    for row in rows.values():  # REDUCE_GRAD after the stage's last weight gradient
        for i, a in enumerate(row):
            if a.computation_type.value == "REDUCE_GRAD":
                assert not any(b.stage_index == a.stage_index and b.computation_type.value in "BW" for b in row[i:])
    assert "UNSHARD" not in text
    back = from_csv(text, num_microbatches=schedule.num_microbatches)
    assert back.actions == schedule.actions


def test_compute_comms_under_sharding_unshards_before_and_reshards_after_each_stage() -> None:
    text = to_torch_csv(generate("zb-v", num_stages=2, num_microbatches=4), format="compute_comms", shard=True)
    for row in csv.reader(io.StringIO(text)):
        for stage in {c[0] for c in row}:
            mine = [c for c in row if c[0] == stage]
            assert mine[0] == f"{stage}UNSHARD" and mine[-1] == f"{stage}RESHARD" and mine[-2] == f"{stage}REDUCE_GRAD"
    assert read_csv_text(text).actions == generate("zb-v", num_stages=2, num_microbatches=4).actions


def read_csv_text(text: str) -> Schedule:
    return from_csv(text, num_microbatches=4)


@pytest.mark.parametrize(
    ("name", "match"),
    [
        (
            "chimera",
            r"^chimera cannot be written for torch.distributed.pipelining: rank 0's 0F0 runs stage 0, one of 2 ",
        ),
        (
            "dualpipe",
            r"^dualpipe cannot .*: rank 0's 0F0 runs stage 0, one of 2 replicas of part 0; .*holds each part once",
        ),
        ("pipedream", r"^pipedream cannot .*: 0U0 updates mid-stream \(stash weights, no flush\)"),
        ("pipedream-2bw", r"^pipedream-2bw cannot .*: 0U0 updates mid-stream \(double-buffer weights"),
    ],
)
def test_what_torch_cannot_express_is_one_line_naming_the_action(name: str, match: str) -> None:
    with pytest.raises(ScheduleError, match=match) as caught:
        to_torch_csv(generate(name, num_stages=2, num_microbatches=4))
    assert "\n" not in str(caught.value)


def test_a_memory_action_is_refused_by_name_and_an_unknown_format_too() -> None:
    s = generate("1f1b", num_stages=2, num_microbatches=2)
    rows = [list(r) for r in s.actions]
    rows[0].insert(1, rows[0][0]._replace(op=Op.OFFLOAD))
    with pytest.raises(ScheduleError, match=r"rank 0's 0OFFLOAD0 moves saved activations; .*no memory actions"):
        to_torch_csv(s.with_actions(rows))
    with pytest.raises(
        ScheduleError, match=r"^CSV format 'comms' is unknown; give one of compute_only, compute_comms$"
    ):
        to_torch_csv(s, format="comms")


@pytest.mark.parametrize("cls_name", TORCH_CLASSES)
@pytest.mark.parametrize(("num_ranks", "num_microbatches"), [(2, 4), (4, 8)])
def test_torch_own_orders_read_validate_and_keep_their_order(
    cls_name: str, num_ranks: int, num_microbatches: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    order = torch_order(cls_name, num_ranks, num_microbatches)
    path = tmp_path / "torch.csv"
    write_torch_csv(order, path)
    schedule = read_csv(path)
    validate(schedule)
    expected = []
    for r in sorted(order):
        row = []
        for a in order[r]:
            for sub in a.sub_actions or (a,) if a is not None else ():
                row.append(str(sub))
        expected.append(row)
    assert [[str(a) for a in row if a.op is not Op.U] for row in schedule.actions] == expected
    if cls_name == "ScheduleDualPipeV":
        assert "OVERLAP_F_B" in path.read_text()  # the grouped action was read, as its F then its B
    from pipeweave.cli import main

    assert main(["simulate", "--from-csv", str(path), "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    assert (simulated["valid"], simulated["stages"], simulated["microbatches"]) == (True, num_ranks, num_microbatches)


def test_a_send_on_another_stage_s_rank_is_one_line_under_a_header() -> None:
    from pipeweave.schedule.text import check_pairs

    placement = generate("1f1b", num_stages=2, num_microbatches=1).placement
    rows = [[parse("0F0"), parse("0B0")], [parse("0SEND_F0"), parse("1F0"), parse("1B0")]]
    with pytest.raises(ScheduleError, match=r"^rank 1's 0SEND_F0 acts for stage 0, which lives on rank 0; a SEND"):
        check_pairs(rows, placement)


def test_torch_comms_form_reads_and_its_stage_only_actions_are_dropped(tmp_path: Path) -> None:
    s = generate("zb-v", num_stages=2, num_microbatches=4)
    text = to_torch_csv(s, format="compute_comms", shard=True)
    path = tmp_path / "comms.csv"
    path.write_text(text)
    assert read_csv(path).actions == s.actions


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (
            "0F0,0SEND_F0,0RECV_B0,0B0\n1F0,1B0,1SEND_B0\n",
            r"^0SEND_F0 sends to rank 1, which has no 1RECV_F0; pair every SEND",
        ),
        (
            "0F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n",
            r"rank 1's 1RECV_F0 receives what no send delivers; pair every RECV",
        ),
        (
            "0F0,0SEND_F0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n",
            r"1SEND_B0 sends to rank 0, which has no 0RECV_B0; pair every SEND",
        ),
        (
            "0F0,0FOO0,0B0\n1F0,1B0\n",
            r"line 1: cannot read action .0FOO0.; write .* e.g. 2F0 \(torch.s <stage>UNSHARD, ",
        ),
        (
            "(0F0;1F0)OVERLAP_X,0B0\n1F0,1B0\n",
            r"cannot read action '\(0F0;1F0\)OVERLAP_X': torch's only grouped action",
        ),
        ("(0F0;0SEND_F0)OVERLAP_F_B,0B0\n1F0,1B0\n", r"cannot run .*: its part '0SEND_F0' is no F, B, I or W action"),
    ],
)
def test_bad_torch_input_is_one_line(text: str, match: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ScheduleError, match=match) as caught:
        from_csv(text)
    assert "\n" not in str(caught.value)
    from pipeweave.cli import main

    path = tmp_path / "bad.csv"
    path.write_text(text)
    assert main(["simulate", "--from-csv", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"pipeweave simulate: error: '{path}': ")


def test_simulate_csv_writes_torch_forms_and_refuses_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeweave.cli import main

    out = tmp_path / "s.csv"
    assert main(["simulate", "-s", "zb-h1", "-D", "2", "-T", "4", "--csv", str(out), "--json"]) == 0
    assert out.read_text() == to_torch_csv(generate("zb-h1", num_stages=2, num_microbatches=4))
    args = ["simulate", "-s", "zb-v", "-D", "2", "-T", "4", "--csv", str(out), "--csv-format", "compute_comms"]
    assert main([*args, "--zero", "3", "--data-parallel", "2", "--json"]) == 0
    assert out.read_text() == to_torch_csv(
        generate("zb-v", num_stages=2, num_microbatches=4), format="compute_comms", shard=True
    )
    assert (
        main(
            [
                "simulate",
                "-s",
                "chimera",
                "-D",
                "2",
                "-T",
                "4",
                "--csv",
                str(out),
                "--csv-format",
                "pipeweave",
                "--json",
            ]
        )
        == 0
    )
    assert out.read_text().startswith("# pipeweave: policy=sync")  # pipeweave's own form, a header and U
    capsys.readouterr()
    for extra, named in (
        (["-s", "chimera"], "rank 0's 0F0 runs stage 0, one of 2 replicas of part 0"),
        (["-s", "pipedream"], "0U0 updates mid-stream (stash weights, no flush)"),
        (["-s", "1f1b", "--offload", "0"], "rank 0's 0OFFLOAD0 moves saved activations"),
    ):
        assert main(["simulate", *extra, "-D", "2", "-T", "4", "--csv", str(tmp_path / "no.csv")]) == 2
        err = capsys.readouterr().err.strip()
        assert named in err and "\n" not in err and err.endswith("or give --csv-format pipeweave, pipeweave's own form")
        assert not (tmp_path / "no.csv").exists()
