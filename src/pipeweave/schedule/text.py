"""Text forms of actions and schedules: ``"2F0"`` and torch's compute-only CSV.

The CSV has one row per rank and one action per cell, as written by
``torch.distributed.pipelining`` (``_dump_csv(..., format="compute_only")``);
empty cells (torch's idle steps) are skipped on reading. torch has no ``U``:
exporting with ``updates=False`` drops them, and reading a CSV without any
``U`` appends each stage's update at the end of its rank, as torch does
implicitly after a step. torch's full vocabulary (``OVERLAP_F_B``, ``UNSHARD``,
``RESHARD``, ``REDUCE_GRAD``, its ``compute_comms`` format) is read as
``schedule.torch_form`` says, which also writes exactly what torch loads. An
``OVERLAP_F_B`` of an F and a B or I is an F&B pair (``Schedule.pairs``), and
pairs are written so.

Schedules torch's form cannot carry (several pipelines, as in Chimera, GEMS,
DualPipe, AvgPipe or data parallelism, a stage that is not its part, or an
asynchronous weight policy) get one header line before the rows::

    # pipeweave: policy=sync; num_microbatches=4; num_steps=1; stage_rank=0 1 1 0; stage_part=0 1 0 1; pipelines=0 1|2 3; microbatch_pipeline=0 0 1 1

so that they read back identical; torch's own reader cannot take those files.

pipeweave's text form, the grid that ``format_grid`` draws and the validator
prints, reads back too: one rank per line, actions separated by spaces (or
commas), an optional ``rank R |`` label first, a marked cell's brackets
ignored::

    rank 0 | 0F0 0F1 0B0 0B1 0U0
    rank 1 | 1F0 1B0 1F1 1B1 1U0

where an F&B pair is one cell, ``3F5&0B0``.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import re
from collections.abc import Iterable
from pathlib import Path

from pipeweave.schedule.ir import (
    Action,
    Op,
    Placement,
    Schedule,
    ScheduleError,
    WeightPolicy,
    append_updates,
)
from pipeweave.schedule.torch_form import check_pairs, is_torch_token, row_cells, torch_token_actions

_ACTION = re.compile(r"^\s*(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|OFFLOAD|RELOAD|EVICT|LOAD|F|B|I|W|U)(\d+)\s*$")


def parse_action(text: str) -> Action:
    """Parse ``"2F0"`` into ``Action(2, Op.F, 0)``.

    Raises:
        ScheduleError: the text is not ``<stage><op><microbatch>``.

    Example:
        >>> parse_action("1I3")
        Action(stage=1, op=<Op.I: 'I'>, microbatch=3)
    """
    match = _ACTION.match(text)
    if match is None:
        shown = repr(text) if len(text) <= 40 else repr(text[:40]) + "..."
        raise ScheduleError(
            f"cannot read action {shown}; write <stage><op><microbatch> with op one of "
            "F B I W U SEND_F RECV_F SEND_B RECV_B OFFLOAD RELOAD EVICT LOAD, e.g. 2F0 (torch's <stage>UNSHARD, "
            "<stage>RESHARD, <stage>REDUCE_GRAD and (<F>;<B>)OVERLAP_F_B are read too)"
        )
    stage, op, microbatch = match.groups()
    return Action(int(stage), Op(op), int(microbatch))


def parse_actions(text: str) -> list[Action]:
    """Parse whitespace- or comma-separated actions: ``"0F0 0F1, 0B0"``."""
    return [parse_action(tok) for tok in re.split(r"[\s,]+", text.strip()) if tok]


def format_actions(actions: Iterable[Action]) -> str:
    return " ".join(str(a) for a in actions)


_HEADER = "# pipeweave:"
_RANK_LABEL = re.compile(r"^\s*rank\s+\d+\s*\|")


def _cells(line: str) -> list[str]:
    """The actions of one row: CSV cells, each split at spaces (the text form), ``rank R |`` and marks dropped."""
    line = _RANK_LABEL.sub("", line, count=1)
    cells = next(csv.reader([line]), [])
    tokens = (t.strip("[]") for c in cells for t in c.split())
    return [t for t in tokens if t and t != "None"]


def _row_actions(tokens: list[str], pairs: list[tuple[Action, Action]]) -> list[Action]:
    """A row's actions: torch's grouped and stage-only actions read as ``torch_form`` says; an
    ``(<F>;<B or I>)OVERLAP_F_B`` is appended to ``pairs`` too (an F&B pair, ``Schedule.pairs``)."""
    out: list[Action] = []
    for token in tokens:
        if "&" in token:  # the grid's F&B pair, 3F5&0B0
            token = f"({token.replace('&', ';')})OVERLAP_F_B"
        actions = torch_token_actions(token) if is_torch_token(token) else [parse_action(token)]
        if token.startswith("(") and len(actions) == 2 and actions[0].op is Op.F and actions[1].op.computes_input_grad:
            pairs.append((actions[0], actions[1]))
        out.extend(actions)
    return out


def torch_compatible(schedule: Schedule) -> bool:
    """True when torch's CSV form carries the schedule: one pipeline 0..S-1, stage = part, synchronous."""
    stages = tuple(range(schedule.num_stages))
    placement = schedule.placement
    return placement.pipelines == (stages,) and placement.stage_part == stages and schedule.is_synchronous


def _header(schedule: Schedule) -> str:
    placement = schedule.placement

    def ints(values: tuple[int, ...]) -> str:
        return " ".join(map(str, values))

    fields = {
        "policy": schedule.policy.value,
        "num_microbatches": str(schedule.num_microbatches),
        "num_steps": str(schedule.num_steps),
        "stage_rank": ints(placement.stage_rank),
        "stage_part": ints(placement.stage_part),
        "pipelines": "|".join(ints(p) for p in placement.pipelines),
        "microbatch_pipeline": ints(schedule.microbatch_pipeline),
    }
    return f"{_HEADER} " + "; ".join(f"{k}={v}" for k, v in fields.items()) + "\n"


def _parse_header(line: str, name: str, rows: list[list[Action]]) -> Schedule:
    try:
        fields = dict(item.strip().split("=", 1) for item in line[len(_HEADER) :].split(";"))

        def ints(key: str) -> tuple[int, ...]:
            return tuple(int(v) for v in fields[key].split())

        placement = Placement(
            ints("stage_rank"),
            ints("stage_part"),
            tuple(tuple(int(v) for v in p.split()) for p in fields["pipelines"].split("|")),
        )
        return Schedule(
            name,
            placement,
            int(fields["num_microbatches"]),
            tuple(tuple(r) for r in rows),
            microbatch_pipeline=ints("microbatch_pipeline"),
            policy=WeightPolicy(fields["policy"]),
            num_steps=int(fields["num_steps"]),
        )
    except (KeyError, ValueError) as exc:
        if isinstance(exc, ScheduleError):
            raise
        raise ScheduleError(f"cannot read the header line {line.strip()!r} ({exc}); write it as to_csv does") from None


def to_csv(schedule: Schedule, *, updates: bool = True) -> str:
    """The schedule as CSV text, one row per rank (after a header when torch's form cannot carry it).

    Args:
        schedule: any schedule.
        updates: keep ``U`` actions; pass False for torch.distributed.pipelining,
            which has no update action.
    """
    out = io.StringIO()
    if not torch_compatible(schedule):
        out.write(_header(schedule))
    writer = csv.writer(out, lineterminator="\n")
    for row in schedule.actions:
        writer.writerow(row_cells(row, schedule.pairs, updates=updates))
    return out.getvalue()


def from_csv(text: str, *, name: str = "csv", num_microbatches: int | None = None) -> Schedule:
    """Read a compute-only CSV (ours or torch's), or the text form, into a schedule.

    With our header line, placement, policy and microbatch routes come from it.
    Without, the placement is inferred: one pipeline through stages 0..S-1 in
    order, each stage on the rank whose row holds it (torch's convention, which
    covers its straight, looped and V-shaped schedules), synchronous.

    Raises:
        ScheduleError: a cell is not an action, or a stage appears on two ranks.
    """
    header = next((line for line in text.splitlines() if line.startswith(_HEADER)), None)
    rows: list[list[Action]] = []
    pairs: list[tuple[Action, Action]] = []
    row_lines: list[int] = []  # each row's line in the text, counting comment lines
    for line_no, line in enumerate(text.splitlines(), start=1):
        if line.startswith("#"):
            continue
        try:
            rows.append(_row_actions(_cells(line), pairs))
        except ScheduleError as exc:
            raise ScheduleError(f"line {line_no}: {exc}") from None
        row_lines.append(line_no)
    while rows and not rows[-1]:  # blank lines at the end are not ranks
        rows.pop()
    if not rows:
        raise ScheduleError("the CSV holds no actions; give one row of actions per rank")
    for rank, row in enumerate(rows):
        if not row:  # torch would read it as a rank with nothing to do: a pipeline has none
            raise ScheduleError(
                f"line {row_lines[rank]} holds no actions, so rank {rank} would have none; "
                "give every rank its row of actions and delete blank lines between rows"
            )
    if header is not None:
        schedule = dataclasses.replace(_parse_header(header, name, rows), pairs=tuple(pairs))
        rows = _compute_only(rows, schedule.placement)
        if schedule.is_synchronous and not any(a.op is Op.U for row in rows for a in row):
            append_updates(rows, schedule.placement)
            schedule = schedule.with_actions(rows)
        return schedule
    stage_rank: dict[int, int] = {}
    for rank, row in enumerate(rows):
        for a in row:
            if stage_rank.setdefault(a.stage, rank) != rank:
                raise ScheduleError(
                    f"stage {a.stage} appears on ranks {stage_rank[a.stage]} and {rank}; a stage lives on one rank"
                )
    num_stages = max(stage_rank) + 1
    missing = [s for s in range(num_stages) if s not in stage_rank]
    if missing:
        raise ScheduleError(f"stages {missing} have no actions; number stages 0..S-1 without gaps")
    stages = tuple(range(num_stages))
    placement = Placement(tuple(stage_rank[s] for s in stages), stages, (stages,))
    compute = [a for row in rows for a in row if a.op.is_compute and a.op is not Op.U]
    t = num_microbatches if num_microbatches is not None else 1 + max(a.microbatch for a in compute)
    rows = [[a for a in row if a.op.is_compute] for row in _compute_only(rows, placement)]
    if not any(a.op is Op.U for row in rows for a in row):
        append_updates(rows, placement)
    return Schedule(name, placement, t, tuple(tuple(r) for r in rows), policy=WeightPolicy.SYNC, pairs=tuple(pairs))


def _compute_only(rows: list[list[Action]], placement: Placement) -> list[list[Action]]:
    """The rows without sends and receives, once checked to pair (torch's ``compute_comms`` form)."""
    if any(a.op.is_comm for row in rows for a in row):
        check_pairs(rows, placement)
    return [[a for a in row if not a.op.is_comm] for row in rows]


def write_csv(schedule: Schedule, path: str | Path, *, updates: bool = True) -> None:
    Path(path).write_text(to_csv(schedule, updates=updates))


def read_csv(path: str | Path, *, name: str | None = None) -> Schedule:
    """Read a CSV file (see ``from_csv``); the schedule is named after the file.

    Raises:
        ScheduleError: the file cannot be read, is not UTF-8 text (a byte-order mark is
            allowed), or holds a bad CSV (``from_csv``).
    """
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ScheduleError(f"cannot read {str(path)!r} ({exc.strerror or exc}); give a CSV schedule file") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        utf16 = data[:2] in (b"\xff\xfe", b"\xfe\xff")
        raise ScheduleError(
            f"{str(path)!r} is not UTF-8 text ({'UTF-16' if utf16 else f'byte {exc.start} is not UTF-8'}); "
            "give a CSV schedule saved as UTF-8"
        ) from None
    if "\x00" in text:
        raise ScheduleError(f"{str(path)!r} holds NUL bytes, so it is no text file; give a CSV schedule saved as UTF-8")
    try:
        return from_csv(text, name=name or Path(path).stem)
    except ScheduleError as exc:
        if type(exc) is not ScheduleError:
            raise
        raise ScheduleError(f"{str(path)!r}: {exc}") from None
