"""DualPipe and DualPipeV against DeepSeek's reference order (deepseek-ai/DualPipe, ``DualPipe.step``).

The programs below were written out by hand from the eight loops of the reference's
``step`` (``dualpipe/dualpipe.py`` and ``dualpipe/dualpipev.py``), one rank at a time, in
the reference's own terms: ``<op><local phase>.<chunk id>``, chunk ids counted per phase as
the reference's ``current_f_chunk_id``/``current_b_chunk_id`` count them; ``B`` a backward
with ``enable_zb=False``, ``I`` one with ``enable_zb=True``; ``W`` a ``_weight_chunk``, named
by the ``I`` it pops from the FIFO ``WeightGradStore``; ``X&Y`` one
``_forward_backward_chunk`` call (the overlapped pair). ``|`` separates the eight steps.
A rank of DualPipe's second half runs the program of its mirror rank with its phases
swapped (the reference's ``phase ^= self.is_in_second_half``).
"""

from __future__ import annotations

import pytest

from pipeweave.schedule.dualpipe import dualpipe, dualpipe_pairs, dualpipe_v, dualpipe_v_pairs
from pipeweave.schedule.ir import Op

# DualPipe, 6 ranks (n = 3), 12 microbatches (6 per direction); keyed by h = min(r, D-1-r).
DUALPIPE_6_12 = {
    0: "F0.0 F0.1 F0.2 F0.3 | F0.4 F1.0 | I1.0 W1.0 F1.1 I1.1 W1.1 F1.2 | F0.5&B1.2 F1.3&B0.0 "
    "| B1.3 F1.4&B0.1 B1.4 F1.5&B0.2 | B1.5 I0.3 | W0.3 I0.4 W0.4 I0.5 | W0.5",
    1: "F0.0 F0.1 | F0.2 F1.0 F0.3 F1.1 | I1.0 W1.0 F1.2 | F0.4&B1.1 F1.3&B0.0 F0.5&B1.2 F1.4&B0.1 "
    "| B1.3 F1.5&B0.2 | B1.4 B0.3 I1.5 I0.4 | W1.5 I0.5 | W0.4 W0.5",
    2: "| F0.0 F1.0 F0.1 F1.1 F0.2 F1.2 | | F0.3 B1.0 F1.3&B0.0 F0.4&B1.1 F1.4&B0.1 F0.5&B1.2 F1.5&B0.2 "
    "| | B1.3 B0.3 B1.4 I0.4 I1.5 I0.5 | | W0.4 W1.5 W0.5",
}

# DualPipeV, 3 ranks (6 stages, n = 3), 7 microbatches; keyed by rank.
DUALPIPE_V_3_7 = {
    0: "F0.0 F0.1 F0.2 F0.3 | F0.4 F1.0 | I1.0 W1.0 F1.1 I1.1 W1.1 F1.2 "
    "| F0.5&B1.2 F1.3&B0.0 F0.6&B1.3 F1.4&B0.1 | B1.4 F1.5&B0.2 B1.5 F1.6&B0.3 | B1.6 I0.4 "
    "| W0.4 I0.5 W0.5 I0.6 | W0.6",
    1: "F0.0 F0.1 | F0.2 F1.0 F0.3 F1.1 | I1.0 W1.0 F1.2 "
    "| F0.4&B1.1 F1.3&B0.0 F0.5&B1.2 F1.4&B0.1 F0.6&B1.3 F1.5&B0.2 | B1.4 F1.6&B0.3 "
    "| B1.5 B0.4 I1.6 I0.5 | W1.6 I0.6 | W0.5 W0.6",
    2: "| F0.0 F1.0 F0.1 F1.1 F0.2 F1.2 | | F0.3 B1.0 F1.3&B0.0 F0.4&B1.1 F1.4&B0.1 F0.5&B1.2 "
    "F1.5&B0.2 F0.6&B1.3 F1.6&B0.3 | | B1.4 B0.4 B1.5 I0.5 I1.6 I0.6 | | W0.5 W1.6 W0.6",
}


def reference_row(program: str, rank: int, d: int, swap: bool, offset: int) -> tuple[list[str], list[tuple[int, int]]]:
    """A transcribed program as pipeweave actions of ``rank``, and its overlapped (F, B) positions.

    Local phase p is the reference's phase p ^ swap: phase 0 is stage ``rank``, phase 1 stage
    2D-1-rank; a phase-1 chunk c is microbatch ``offset + c`` (DualPipe's second direction).
    """
    actions: list[str] = []
    pairs: list[tuple[int, int]] = []
    for token in program.replace("|", " ").split():
        calls = token.split("&")
        if len(calls) == 2:
            pairs.append((len(actions), len(actions) + 1))
        for call in calls:
            op, (phase, chunk) = call[0], map(int, call[1:].split("."))
            phase ^= swap
            stage = rank if phase == 0 else 2 * d - 1 - rank
            actions.append(f"{stage}{op}{chunk + offset * phase}")
    return actions, pairs


def generated(schedule_actions: tuple[object, ...]) -> list[str]:
    return [str(a) for a in schedule_actions if a.op is not Op.U]  # type: ignore[attr-defined]


def test_dualpipe_is_the_references_order_action_for_action() -> None:
    d, t = 6, 12
    schedule, pairs = dualpipe(d, t), dualpipe_pairs(d, t)
    for rank in range(d):
        h = min(rank, d - 1 - rank)
        want, want_pairs = reference_row(DUALPIPE_6_12[h], rank, d, swap=rank >= d // 2, offset=t // 2)
        assert generated(schedule.actions[rank]) == want, rank
        assert list(pairs[rank]) == want_pairs, rank


def test_dualpipe_v_is_the_references_order_action_for_action() -> None:
    d, t = 3, 7
    schedule, pairs = dualpipe_v(d, t), dualpipe_v_pairs(d, t)
    for rank in range(d):
        want, want_pairs = reference_row(DUALPIPE_V_3_7[rank], rank, d, swap=False, offset=0)
        assert generated(schedule.actions[rank]) == want, rank
        assert list(pairs[rank]) == want_pairs, rank


@pytest.mark.parametrize(
    ("name", "d", "t"), [("dualpipe", 2, 4), ("dualpipe", 4, 10), ("dualpipe-v", 2, 5), ("dualpipe-v", 4, 9)]
)
def test_overlapped_pairs_are_a_forward_then_a_backward_of_the_other_stage(name: str, d: int, t: int) -> None:
    generator, pairs_of = (dualpipe, dualpipe_pairs) if name == "dualpipe" else (dualpipe_v, dualpipe_v_pairs)
    schedule = generator(d, t)
    for rank, pairs in enumerate(pairs_of(d, t)):
        row = schedule.actions[rank]
        for f, b in pairs:
            assert b == f + 1 and row[f].op is Op.F and row[b].op is Op.B and row[f].stage != row[b].stage
