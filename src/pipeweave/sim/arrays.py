"""A schedule as numpy arrays: per action its rank, stage, op and microbatch, made once per schedule.

The fast simulator (``sim.rounds``) and the fast metrics work on these arrays
instead of on ``Action`` tuples. Reading the tuples costs one pass of C-level
iteration per field (``map`` + ``np.fromiter``; the ops joined as one string of
their one-letter values), about 0.04 microsecond per action and field; the encoding is
cached per schedule object, so a search that simulates one schedule under many
cost models pays it once.

``well_formed`` is ``validate.check_actions``' fast pass over the arrays:
True means that pass would accept the schedule; False sends the caller to the
reference code, which explains the problem (or accepts what this is too strict
about).
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from pipeweave.schedule.ir import Action, Schedule

F, B, I, W, U, OTHER = range(6)
"""Op codes of the arrays (``OTHER``: a communication op, which the simulator never sees)."""

_CODES = bytes.maketrans(b"FBIWU", bytes(range(5)))  # an op's letter to its code, for ``bytes.translate``

IntArray = NDArray[np.integer]
"""Indices: int32 where they fit (``encode``), int64 otherwise."""


@dataclass(frozen=True)
class ScheduleArrays:
    """Every action of a schedule, in row order (rank 0's actions first).

    Attributes:
        offsets: ``offsets[r]`` is the index of rank r's first action; ``offsets[-1]`` the count.
        rank, stage, op, microbatch: per action (op as the codes ``F, B, I, W, U, OTHER``).
        ok: the actions pass ``check_actions``' rules (``well_formed``).
    """

    offsets: NDArray[np.int64]
    rank: IntArray
    stage: IntArray
    op: NDArray[np.int8]
    microbatch: IntArray
    ok: bool

    @property
    def size(self) -> int:
        return int(self.offsets[-1])


_CACHE: dict[int, ScheduleArrays] = {}


def schedule_arrays(schedule: Schedule) -> ScheduleArrays:
    """The arrays of ``schedule``, made on first use and kept while the schedule lives.

    Example:
        >>> from pipeweave.schedule import generate
        >>> a = schedule_arrays(generate("1f1b", num_stages=2, num_microbatches=2))
        >>> a.offsets.tolist(), a.op[:4].tolist(), a.ok
        ([0, 5, 10], [0, 0, 1, 1], True)
    """
    key = id(schedule)
    found = _CACHE.get(key)
    if found is None:
        found = _CACHE[key] = encode(schedule)
        weakref.finalize(schedule, _CACHE.pop, key, None)
    return found


def encode(schedule: Schedule) -> ScheduleArrays:
    """``ScheduleArrays`` of ``schedule`` (uncached; ``schedule_arrays`` caches)."""
    rows = schedule.actions
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    n = int(offsets[-1])
    stage, microbatch = _column(rows, 0, n), _column(rows, 2, n)  # each field in one pass over the rows' tuples
    letters = "".join(map(operator.itemgetter(1), itertools.chain.from_iterable(rows)))  # Op: a str enum, F is "F"
    if len(letters) == n:  # read-only codes straight from the bytes: no index array in between
        op = np.frombuffer(letters.encode("ascii").translate(_CODES), dtype=np.int8)
    else:  # a communication op ("SEND_F", ...) among them
        op = np.full(n, OTHER, dtype=np.int8)
    rank = np.repeat(np.arange(len(rows), dtype=np.int32), lengths)
    arrays = ScheduleArrays(offsets, rank, stage, op, microbatch, ok=False)
    return ScheduleArrays(offsets, rank, stage, op, microbatch, ok=well_formed(schedule, arrays))


def _column(rows: Sequence[Sequence[Action]], field: int, n: int) -> IntArray:
    """One integer field of every action, as int32 (half the memory of int64: on this VM fresh pages cost more
    than the copying, benchmarks/simulator/README.md), int64 where a value does not fit. Chained straight from
    the rows: a flat list of the actions first costs more than a second pass over them."""
    get = operator.itemgetter(field)
    try:
        return np.fromiter(map(get, itertools.chain.from_iterable(rows)), dtype=np.int32, count=n)
    except OverflowError:
        return np.fromiter(map(get, itertools.chain.from_iterable(rows)), dtype=np.int64, count=n)


def well_formed(schedule: Schedule, a: ScheduleArrays) -> bool:
    """``check_actions``' rules on the arrays: placement, microbatch range and route, each of F and
    (B or I + W) once per stage and routed microbatch, each ``U`` once.

    Example:
        >>> from pipeweave.schedule import generate
        >>> s = generate("zb-h1", num_stages=2, num_microbatches=3)
        >>> well_formed(s, encode(s))
        True
    """
    placement = schedule.placement
    num_stages, t = placement.num_stages, schedule.num_microbatches
    if schedule.num_ranks != placement.num_ranks or (a.op == OTHER).any():
        return False
    stage, j = a.stage, a.microbatch
    if a.size and (stage.min() < 0 or stage.max() >= num_stages):
        return False
    if (np.asarray(placement.stage_rank, dtype=a.rank.dtype)[stage] != a.rank).any():
        return False
    updates = np.flatnonzero(a.op == U)
    counted = j[updates].astype(np.int64)  # a key per U below: wider than int32
    if counted.size and (counted.min() < 0 or not _unique(stage[updates] * (int(counted.max()) + 1) + counted)):
        return False
    # F, B, I and W's microbatches in range (a U's field counts its updates: any count >= 0 is fine)
    if j.size and (j.min() < 0 or (j.max() >= t and np.delete(j, updates).max(initial=-1) >= t)):
        return False
    # One byte per (stage, microbatch) and op F, B, I, W (U's all to a last, spare byte): an op twice
    # leaves fewer bytes set than actions; read as little-endian int32, a pair's four bytes say which it has.
    key = stage.astype(np.intp)
    key *= t
    key += j
    key *= 4
    key += a.op
    key[updates] = num_stages * t * 4
    mark = np.zeros(num_stages * t * 4 + 1, dtype=np.int8)
    mark[key] = 1
    if np.count_nonzero(mark[:-1]) != a.size - updates.size:
        return False  # an action twice
    has = mark[:-1].view("<i4")
    fine = (has == 0x0101) | (has == 0x01010001)  # F + B, or F + I + W
    if placement.shared:  # a stage on several routes: the detailed pass (``validate.check_actions``)
        return False
    if len(placement.pipelines) > 1:  # the pairs routed through the stage, and nothing on the others
        stage_pipe, mb_pipe = _pipeline_of(schedule)
        routed = (stage_pipe[:, None] == mb_pipe[None, :]).ravel()
        return bool(fine[routed].all() and not has[~routed].any())
    return bool(fine.all())


def _pipeline_of(schedule: Schedule) -> tuple[IntArray, IntArray]:
    """Per stage and per microbatch, its pipeline."""
    placement = schedule.placement
    stage_pipe = np.asarray([placement.pipeline_of(k) for k in range(placement.num_stages)], dtype=np.int64)
    return stage_pipe, np.asarray(schedule.microbatch_pipeline or (0,) * schedule.num_microbatches, dtype=np.int64)


def _unique(keys: IntArray) -> bool:
    """No key twice (sorted, not ``np.unique``, whose first call imports ``numpy.ma``: 40 ms)."""
    ordered = np.sort(keys)
    return bool((ordered[1:] != ordered[:-1]).all())
