"""Weight versions implied by a schedule's order and its weight policy.

A stage's version is the number of ``U`` its rank ran for it before an action;
``U(s, k)`` turns version k into k + 1, applying the gradients
``schedule.dataflow.consumed_gradients`` assigns to it. The policy says which
version each action reads (DESIGN.md's table), as a ``VersionRead``:

| policy | F reads | B / I / W read |
|---|---|---|
| sync, none (AMPNet), averaging (own replica) | current | current |
| stash (PipeDream), double buffer (2BW, WPipe) | current | F's version |
| vertical sync | version stage 0 had at F(0, j) | same |
| discrepancy correction (PipeMare) | current | current, standing for F's version |
| prediction (SpecTrain) | current, predicted to k | current, predicted to k |
| prediction, bellwether (XPipe) | the bellwether's, predicted to k | same, per pass |

(k: the version the microbatch's gradient is applied to.) Staleness, F/B
inconsistency and the weight copies a stage holds follow from the order alone.

A tie between a pipeline's first and last stage on a stream
(``runtime.stage.tied_stream``: the last stage applies each summed tied
update d of its updates later) leaves the versions above as they are -- they
count a stage's updates -- but the last stage's tied members lag its other
weights by d updates (``tied_lag``), and the tied members' staleness is the
worse end's (``staleness(..., tied=True)``).
"""

from __future__ import annotations

from typing import NamedTuple, cast

from pipeweave.schedule.dataflow import consumed_gradients
from pipeweave.schedule.ir import Action, Op, Schedule, ScheduleError, WeightPolicy
from pipeweave.sim.cost import PartCosts

_STORED = (WeightPolicy.STASH, WeightPolicy.DOUBLE_BUFFER, WeightPolicy.VERTICAL_SYNC)
_BACKWARD = tuple(op for op in Op if op.is_backward)  # B, I, W: the order _backward_of tries


class VersionRead(NamedTuple):
    """The weights one action computes with.

    Attributes:
        version: the stored version whose values it starts from.
        target: the version those weights stand for: ``version`` itself,
            except under prediction (predicted forward to ``target``) and
            discrepancy correction (extrapolated back to the forward's).
    """

    version: int
    target: int

    @property
    def distance(self) -> int:
        """Versions between what is stored and what is stood for (SpecTrain's s; PipeMare's delay gap)."""
        return self.target - self.version


class StageWeights(NamedTuple):
    """Peak weight memory of one stage, in units of its own M_theta."""

    versions: int
    """Stored weight versions held at once (1 unless stashed or double-buffered)."""
    extra: int
    """Same-sized buffers the policy adds: PipeMare's velocity, a cached prediction."""
    extra_kind: str
    """What ``extra`` holds: "velocity", "prediction" or ""."""

    @property
    def total(self) -> int:
        return self.versions + self.extra


_PREDICTED = (WeightPolicy.PREDICTION, WeightPolicy.BELLWETHER_PREDICTION)


def is_bellwether_schedule(schedule: Schedule) -> bool:
    """XPipe: predictions are computed once per mini-batch by its first microbatch (its policy says so)."""
    return schedule.policy is WeightPolicy.BELLWETHER_PREDICTION


def current_versions(schedule: Schedule) -> dict[Action, int]:
    """Per action, how many updates its stage had done before it on its rank's list."""
    out: dict[Action, int] = {}
    for row in schedule.actions:
        done: dict[int, int] = {}
        for a in row:
            out[a] = done.get(a.stage, 0)
            if a.op is Op.U:
                done[a.stage] = out[a] + 1
    return out


def applied_to(schedule: Schedule) -> dict[tuple[int, int], int]:
    """Per (stage, microbatch), the version its gradient is applied to (k of the U that consumes it)."""
    out: dict[tuple[int, int], int] = {}
    for u, grads in consumed_gradients(schedule).items():
        for g in grads:
            out[(g.stage, g.microbatch)] = u.microbatch
    return out


def read_versions(schedule: Schedule, *, bellwether: bool | None = None) -> dict[Action, VersionRead]:
    """The version every F, B, I and W reads under the schedule's policy (the module's table).

    This is what a runtime records and asserts against.

    Args:
        schedule: any schedule of the IR.
        bellwether: XPipe's once-per-mini-batch prediction (default: the
            schedule's policy is ``BELLWETHER_PREDICTION``).

    Raises:
        ScheduleError: vertical sync asks a stage for a version it has not made yet.

    Example:
        >>> from pipeweave.schedule import generate
        >>> r = read_versions(generate("pipedream", num_stages=2, num_microbatches=2))
        >>> r[Action(0, Op.F, 2)], r[Action(0, Op.B, 2)]
        (VersionRead(version=1, target=1), VersionRead(version=1, target=1))
    """
    key = (id(schedule), bellwether)
    if _last_reads[0] == key and _last_reads[1] is schedule:
        return cast(dict[Action, VersionRead], _last_reads[2])
    out = _read_versions(schedule, bellwether)
    _last_reads[:] = [key, schedule, out]
    return out


_last_reads: list[object] = [None, None, None]  # (key, schedule, reads) of the last call


def _read_versions(schedule: Schedule, bellwether: bool | None) -> dict[Action, VersionRead]:
    policy = schedule.policy
    now = current_versions(schedule)
    target = applied_to(schedule)
    bell = is_bellwether_schedule(schedule) if bellwether is None else bellwether
    first: dict[tuple[int, int], int] = {}  # (stage, k) -> the bellwether microbatch
    if bell:
        for (s, j), k in target.items():
            first[(s, k)] = min(j, first.get((s, k), j))
    out: dict[Action, VersionRead] = {}
    for a in now:
        if a.op is Op.U:
            continue
        s, op, j = a
        c, f = now[a], Action(s, Op.F, j)
        if policy is WeightPolicy.VERTICAL_SYNC:
            v0 = now[Action(schedule.route(j)[0], Op.F, j)]
            if op is Op.F and v0 > c:
                raise ScheduleError(f"{a} must read version {v0} under vertical sync but stage {s} has made {c}")
            out[a] = VersionRead(v0, v0)
        elif policy in _STORED and op in _BACKWARD:
            out[a] = VersionRead(now[f], now[f])
        elif policy is WeightPolicy.DISCREPANCY_CORRECTION and op in _BACKWARD:
            out[a] = VersionRead(c, now[f])
        elif policy in _PREDICTED:
            k = target.get((s, j), c)
            if bell:  # the bellwether's stored version, same pass (forward or backward)
                b = first.get((s, k), j)
                c = now[Action(s, op, b) if op is Op.F else _backward_of(schedule, now, s, b, op)]
            out[a] = VersionRead(c, k)
        else:
            out[a] = VersionRead(c, c)
    return out


def _backward_of(schedule: Schedule, now: dict[Action, int], stage: int, j: int, op: Op) -> Action:
    """The bellwether's action of the same backward kind (B, or I/W as split)."""
    for kind in (op, *_BACKWARD):
        if Action(stage, kind, j) in now:
            return Action(stage, kind, j)
    raise ScheduleError(f"stage {stage} has no backward for microbatch {j}")  # pragma: no cover


def staleness(schedule: Schedule, *, tied: bool = False) -> tuple[int, ...]:
    """Per stage, the most updates between a gradient's weights and the version it is applied to.

    A gradient of microbatch j is computed on the oldest stored version its
    F and backward read (before any prediction or correction): staleness is
    k - that, for the ``U(s, k)`` that applies it. 0 for every synchronous schedule.
    ``tied``: the model ties its first and last stage; on a stream the tied
    members' k-th update sums both ends' halves of mini-batch k, the last
    stage's computed with its tied members ``tied_lag`` behind: their staleness,
    counted in their own updates, is max(first's, last's + lag), and each end's
    staleness takes it in.

    Example:
        >>> from pipeweave.schedule import generate
        >>> staleness(generate("pipedream", num_stages=4, num_microbatches=4))
        (3, 2, 1, 0)
        >>> staleness(generate("pipedream-2bw", num_stages=2, num_microbatches=2), tied=True)
        (1, 1)
    """
    worst = _staleness(schedule)
    lag = tied_lag(schedule) if tied else (0,) * schedule.num_stages
    for line in schedule.placement.pipelines if any(lag) else ():
        both = max(worst[line[0]], worst[line[-1]] + lag[line[-1]])
        worst[line[0]], worst[line[-1]] = max(worst[line[0]], both), max(worst[line[-1]], both)
    return tuple(worst)


def tied_lag(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the updates by which its tied members (a tie between its pipeline's first and last stage)
    lag its other weights under ``runtime.stage.tied_stream``'s rule; 0 but on the last stage of a stream.

    There it is the fewest d such that the first stage's ``U_(k-d)`` comes before the last stage's ``U_k`` in
    the order the schedule's dependencies impose, for every k: the first stage's half of update k - d is
    then sent before the last stage needs it. At least 1: the first stage's ``U_k`` waits for the last
    stage's half of k.

    Raises:
        ScheduleError: a first stage's ``U_k`` that must come before the last stage's (the wait would close
            a cycle).

    Example:
        >>> from pipeweave.schedule import generate
        >>> tied_lag(generate("pipedream-2bw", num_stages=3, num_microbatches=3))
        (0, 0, 1)
        >>> tied_lag(generate("pipedream", num_stages=3, num_microbatches=3))
        (0, 0, 3)
    """
    lag = [0] * schedule.num_stages
    if schedule.is_synchronous:
        return tuple(lag)
    for line in schedule.placement.pipelines:
        if line[0] == line[-1]:
            continue
        seen = _updates_before(schedule, line[0])
        for a, n in seen.items():
            if a.op is Op.U and a.stage == line[-1]:
                if n > a.microbatch:
                    raise ScheduleError(
                        f"{schedule.name}: {Action(line[0], Op.U, a.microbatch)} comes before {a}; "
                        "a tie between them would wait in a cycle"
                    )
                lag[line[-1]] = max(lag[line[-1]], a.microbatch + 1 - n, 1)
    return tuple(lag)


def _updates_before(schedule: Schedule, stage: int) -> dict[Action, int]:
    """Per action, how many updates of ``stage`` come before it (a ``U`` of ``stage`` counting itself) in the
    order the dependencies impose: each rank's row, F after the previous stage's F, a backward after its F
    and the next stage's input gradient, W after I."""
    done: dict[tuple[int, str, int], int] = {}  # per (stage, F | G | W, microbatch), its place in the order
    out: dict[Action, int] = {}
    ptr, clock = [0] * schedule.num_ranks, [0] * schedule.num_ranks
    progressed = True
    while progressed:
        progressed = False
        for r, row in enumerate(schedule.actions):
            while ptr[r] < len(row):
                s, op, j = a = row[ptr[r]]
                prev, nxt = schedule.prev_of(s, j), schedule.next_of(s, j)
                needs = (
                    [(prev, "F", j)]
                    if op is Op.F and prev is not None
                    else [(s, "F", j)] + ([(nxt, "G", j)] if nxt is not None else [])
                    if op.computes_input_grad
                    else [(s, "G", j)]
                    if op is Op.W
                    else []
                )
                if any(n not in done for n in needs):
                    break
                clock[r] = max([clock[r]] + [done[n] for n in needs] + [j + 1 if op is Op.U and s == stage else 0])
                out[a] = clock[r]
                done[(s, "F" if op is Op.F else "G" if op.computes_input_grad else op.name, j)] = clock[r]
                ptr[r] += 1
                progressed = True
    return out


def _staleness(schedule: Schedule) -> list[int]:
    reads = read_versions(schedule)
    worst = [0] * schedule.num_stages
    for u, grads in consumed_gradients(schedule).items():
        for g in grads:
            used = min(reads[g].version, reads[Action(g.stage, Op.F, g.microbatch)].version)
            inp = reads.get(Action(g.stage, Op.I, g.microbatch))
            if inp is not None:
                used = min(used, inp.version)
            worst[u.stage] = max(worst[u.stage], u.microbatch - used)
    return worst


def inconsistency(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most versions by which a backward's stored weights differ from its forward's.

    0 when F and B read the same version (sync, stash, 2BW, vertical sync,
    averaging). PipeMare and SpecTrain/XPipe show their raw gap here; their
    correction (``VersionRead.target``) is what narrows it.

    Example:
        >>> from pipeweave.schedule import generate
        >>> inconsistency(generate("ampnet", num_stages=3, num_microbatches=3))
        (2, 1, 0)
    """
    reads = read_versions(schedule)
    worst = [0] * schedule.num_stages
    for a, r in reads.items():
        if a.op in _BACKWARD:
            gap = abs(r.version - reads[Action(a.stage, Op.F, a.microbatch)].version)
            worst[a.stage] = max(worst[a.stage], gap)
    return tuple(worst)


def stage_weights(schedule: Schedule) -> tuple[StageWeights, ...]:
    """Per stage, the peak stored versions and the policy's extra buffers.

    Stored versions: the current one plus those still needed by microbatches
    between their F and their last backward (stash, double buffer, vertical
    sync). Extras: PipeMare's velocity (1); SpecTrain's prediction buffer (1);
    XPipe's cached predictions, forward and backward of possibly different
    mini-batches (peak live, computed from the order).

    Example:
        >>> from pipeweave.schedule import generate
        >>> [w.total for w in stage_weights(generate("pipedream", num_stages=4, num_microbatches=4))]
        [4, 3, 2, 1]
    """
    policy = schedule.policy
    reads = read_versions(schedule)
    versions = _stored_versions(schedule, reads) if policy in _STORED else [1] * schedule.num_stages
    if policy is WeightPolicy.DOUBLE_BUFFER and max(versions) > 2:
        s = versions.index(max(versions))
        raise ScheduleError(
            f"{schedule.name}: stage {s} needs {versions[s]} weight versions, more than a double buffer holds; "
            f"give more microbatches per mini-batch (T >= D)"
        )
    extra, kind = [0] * schedule.num_stages, ""
    if policy is WeightPolicy.DISCREPANCY_CORRECTION:
        extra, kind = [1] * schedule.num_stages, "velocity"
    elif policy in _PREDICTED:
        kind = "prediction"
        extra = _cached_predictions(schedule, reads) if is_bellwether_schedule(schedule) else [1] * len(extra)
    return tuple(StageWeights(v, e, kind) for v, e in zip(versions, extra))


def _stored_versions(schedule: Schedule, reads: dict[Action, VersionRead]) -> list[int]:
    """Per stage, the peak number of versions alive at once on its rank's list.

    Version v of stage s lives from the U that makes it until the U that
    supersedes it (updates are in place) or, if later, the last action that
    reads it (a stashed backward, a vertical-sync forward of an older version).
    """
    peak = [1] * schedule.num_stages
    for row in schedule.actions:
        life: dict[tuple[int, int], list[int]] = {}  # (stage, version) -> [born, last needed]
        for i, a in enumerate(row):
            if a.op is Op.U:  # updated in place: the old version dies here unless read later
                span = life.setdefault((a.stage, a.microbatch), [-1, i - 1])
                span[1] = max(span[1], i - 1)
                life[(a.stage, a.microbatch + 1)] = [i, i]
            else:
                v = reads[a].version
                span = life.setdefault((a.stage, v), [-1, i])
                span[1] = max(span[1], i)
        _peak_alive(row, life, peak)
    return peak


def _peak_alive(row: tuple[Action, ...], life: dict[tuple[int, int], list[int]], peak: list[int]) -> None:
    """Raise ``peak[s]`` to the most intervals of stage s alive at one of s's positions in ``row``.

    A sweep over interval ends: O(n log n) where counting at every position was O(n^2).
    """
    events: dict[int, list[tuple[int, int]]] = {}  # stage -> (position, +1 at birth / -1 after death)
    for key, (lo, hi) in life.items():
        events.setdefault(key[0], []).extend(((lo, 1), (hi + 1, -1)))
    positions: dict[int, list[int]] = {}
    for i, a in enumerate(row):
        positions.setdefault(a.stage, []).append(i)
    for stage, evs in events.items():
        evs.sort()
        alive = k = 0
        for i in positions.get(stage, ()):
            while k < len(evs) and evs[k][0] <= i:
                alive += evs[k][1]
                k += 1
            peak[stage] = max(peak[stage], alive)


def _cached_predictions(schedule: Schedule, reads: dict[Action, VersionRead]) -> list[int]:
    """XPipe: per stage, the peak number of (pass, mini-batch) predictions alive at once."""
    peak = [0] * schedule.num_stages
    for row in schedule.actions:
        # A cache lives from the pass's first action of a mini-batch to its last.
        span: dict[tuple[int, int], list[int]] = {}
        for i, a in enumerate(row):
            if a.op is not Op.U:
                key = (a.stage, 2 * reads[a].target + (a.op is Op.F))  # (stage, (mini-batch, pass))
                span.setdefault(key, [i, i])[1] = i
        _peak_alive(row, span, peak)
    return peak


def weight_copies(schedule: Schedule, costs: PartCosts) -> tuple[float, ...]:
    """Per rank, the peak weight memory held, in M_theta: every stage it hosts, copies and extras.

    Example:
        >>> from pipeweave.schedule import generate
        >>> from pipeweave.sim.cost import CostModel
        >>> weight_copies(generate("pipedream", num_stages=3, num_microbatches=3),
        ...               CostModel().for_parts(num_parts=3, num_ranks=3))
        (3.0, 2.0, 1.0)
    """
    held = [0.0] * schedule.num_ranks
    part_of = schedule.placement.stage_part
    for stage, w in enumerate(stage_weights(schedule)):
        held[schedule.placement.stage_rank[stage]] += w.total * costs.weight[part_of[stage]]
    return tuple(round(h, 9) for h in held)
