"""The planner's space: every split of N GPUs into TP x CP x PP x DP (and EP of the DP ranks), chunks,
microbatch size, schedule, recomputation and ZeRO stage that the model's shape allows, with what the user fixed.

The rules are Megatron-LM's: TP inside a node (N divides the GPUs per node) and
dividing the heads; PP up to the layers, its blocks split evenly where they
divide and, where they do not, unevenly (``planner.split``: the even split, and
the one balancing the head and the embedding where it is faster; within
``UNEVEN_SLACK`` unless ``--stages`` is fixed),
interleaved chunks v dividing them into D x v equal parts; DP dividing the global batch B, and the microbatch size b
dividing B / DP, so that T = B / (DP x b). Schedules: the registry's
synchronous ones (``pipeweave schedules``), zb-auto and zb-v-auto included;
at D = 1 there is no pipeline and only ``1f1b`` (plain gradient accumulation)
is kept. ZeRO 1 and 3 only where the runtime shards a schedule's replicas
(``ScheduleInfo.zero``: not the bidirectional ones, which hold two copies of
each part), and ZeRO 2 there too where it holds fewer gradient bytes than
ZeRO 1: ``train --zero 2`` keeps every part's gradient in 1/P slices but one
part's whole while its B or W runs (``planner.memory``), so with v parts per
rank where ``v (P - 1) > P + 1``. Context parallelism C divides the GPUs and
splits the sequence into 2C chunks of at least ``MIN_CP_CHUNK`` tokens; expert
parallelism EP, for a model with experts, divides DP and the experts, and runs
without ZeRO (as ``train`` does).

Two limits keep the space one that can be enumerated and simulated in seconds:
a schedule of at most ``MAX_CELLS`` (part, microbatch) pairs, D x v x T (so
the microbatch size b starts where T = B / (DP x b) fits), and at most
``MAX_CONFIGURATIONS`` configurations in all (beyond, one line asks to fix a
dimension). Divisors are found in O(sqrt n), so any count up to 10^12 costs
milliseconds.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from itertools import islice, product

from pipeweave.errors import UserError
from pipeweave.planner.candidate import Config
from pipeweave.planner.profiled import Model
from pipeweave.planner.split import candidate_blocks
from pipeweave.planner.transformer import Transformer
from pipeweave.schedule.info import PlacementKind
from pipeweave.schedule.registry import SCHEDULES
from pipeweave.sim.parallel import ZERO_STAGES
from pipeweave.sim.recompute import RECOMPUTE


def synchronous() -> list[str]:
    """The registry's synchronous schedules, in its order, read when called (an entry added later counts)."""
    return [name for name, info in SCHEDULES.items() if info.synchronous]


@dataclass(frozen=True, kw_only=True)
class Fixed:
    """The dimensions the user fixed (None: searched)."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    chunks: int | None = None
    microbatch_size: int | None = None
    schedule: str | None = None
    recompute: str | None = None
    zero: int | None = None
    ep: int | None = None
    cp: int | None = None

    def __post_init__(self) -> None:
        if self.schedule is not None and self.schedule not in synchronous():
            raise UserError(
                f"-s {self.schedule!r} is not a synchronous schedule the planner can size; choose one "
                f"of: {', '.join(synchronous())}"
            )
        if self.recompute is not None and self.recompute not in RECOMPUTE:
            raise UserError(f"--recompute {self.recompute!r} is invalid; choose one of: {', '.join(RECOMPUTE)}")
        if self.zero is not None and self.zero not in (*ZERO_STAGES, 2):
            raise UserError(f"--zero {self.zero} is invalid; give 0, 1, 2 or 3")
        for name in ("tp", "pp", "dp", "chunks", "microbatch_size", "ep", "cp"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"{FLAGS[name]} {value} is invalid; give an integer >= 1")

    def allows(self, name: str, value: object) -> bool:
        fixed = getattr(self, name)
        return fixed is None or fixed == value


FLAGS = {
    "tp": "--tensor-parallel",
    "pp": "--stages",
    "dp": "--data-parallel",
    "chunks": "--chunks",
    "microbatch_size": "--microbatch-size",
    "schedule": "-s",
    "recompute": "--recompute",
    "zero": "--zero",
    "ep": "--expert-parallel",
    "cp": "--context-parallel",
}


MAX_CELLS = 2**15
"""The most (part, microbatch) pairs, D x v x T, of a schedule the planner simulates: ~100k actions, about a
second to generate and simulate, and every published Megatron-LM configuration (``planner.published``)."""
MAX_CONFIGURATIONS = 50_000
"""The most configurations the planner bounds: ~10 s at ~0.2 ms each (``pipeweave plan --help``)."""


@functools.lru_cache(maxsize=64)
def _divisors(n: int) -> tuple[int, ...]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(small + [n // d for d in reversed(small) if d * d != n])


def divisors(n: int) -> list[int]:
    """Ascending divisors of ``n``, in O(sqrt n) (10^12: ~0.1 s, then cached).

    Example:
        >>> divisors(12)
        [1, 2, 3, 4, 6, 12]
    """
    return list(_divisors(n))


def microbatch_sizes(batch: int, dp: int, parts: int) -> list[int]:
    """The microbatch sizes b dividing ``batch`` / ``dp`` whose T = batch / (dp x b) microbatches over ``parts``
    parts stay within ``MAX_CELLS`` (the divisors of the whole batch found once, and filtered).

    Example:
        >>> microbatch_sizes(64, 2, 4)
        [1, 2, 4, 8, 16, 32]
        >>> microbatch_sizes(2**20, 1, 4)[:3]  # T <= 2^15 / 4
        [128, 256, 512]
    """
    per_replica, most = batch // dp, MAX_CELLS // parts
    return [b for b in _divisors(batch) if per_replica % b == 0 and per_replica // b <= most]


def tensor_parallel_sizes(model: Model, gpus_per_node: int, fixed: Fixed) -> list[int]:
    """TP sizes inside a node that split the heads (and the hidden size) evenly."""
    return [t for t in divisors(gpus_per_node) if model.splits_tensors(t) and fixed.allows("tp", t)]


def splits(
    model: Model, gpus: int, batch: int, gpus_per_node: int, fixed: Fixed, uneven: bool = True
) -> list[tuple[int, int, int]]:
    """Every ``(tp, pp, dp)`` with tp x pp x dp = gpus, pp dividing the layers, dp the batch.

    Example:
        >>> from pipeweave.planner.transformer import Transformer
        >>> m = Transformer(layers=4, hidden=64, heads=4)
        >>> splits(m, 4, 8, 2, Fixed())
        [(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1)]
    """
    out = []
    for tp in tensor_parallel_sizes(model, gpus_per_node, fixed):
        for pp in divisors(gpus // tp) if gpus % tp == 0 else ():
            if searched_parts(model, pp, fixed, uneven) and fixed.allows("pp", pp):
                dp = gpus // (tp * pp)
                if batch % dp == 0 and fixed.allows("dp", dp):
                    out.append((tp, pp, dp))
    return out


UNEVEN_SLACK = 0.05
"""How unevenly the free search cuts the blocks: the most loaded of D parts holds at most 5 % more than an even
share, ceil(L / D) x D <= 1.05 L (126 blocks on 16 stages, 70 on 12: yes; 128 on 48: no, 16 of its 144 block
slots idle). A fixed ``--stages`` is searched however unevenly it cuts them."""


def searched_parts(model: Model, parts: int, fixed: Fixed, uneven: bool = True) -> bool:
    """Whether the space cuts the blocks into ``parts`` parts: evenly, within ``UNEVEN_SLACK`` (where ``uneven``),
    or any way the user fixed.

    Example:
        >>> from pipeweave.planner.transformer import Transformer
        >>> m = Transformer(layers=126, hidden=64, heads=4)
        >>> searched_parts(m, 16, Fixed()), searched_parts(m, 40, Fixed()), searched_parts(m, 40, Fixed(pp=40))
        (True, False, True)
    """
    if not model.splits_into(parts):
        return False
    slack = -(-model.layers // parts) * parts <= (1 + UNEVEN_SLACK) * model.layers
    even = model.splits_evenly(parts) or (uneven and slack)
    return even or fixed.pp is not None


def chunk_counts(model: Model, schedule: str, pp: int, fixed: Fixed | None = None, uneven: bool = True) -> list[int]:
    """The chunks v a schedule may run with at D = ``pp`` (interleaved: its layers split evenly into D x v
    parts)."""
    info = SCHEDULES[schedule]
    if info.chunks is None:  # --chunks v: looped, D x v parts (at most MAX_CELLS: T >= 1)
        return [v for v in range(2, min(model.layers, MAX_CELLS) // pp + 1) if model.splits_evenly(pp * v)]
    if info.placement is PlacementKind.BIDIRECTIONAL:  # one part per rank and direction, D even
        return [1] if pp % 2 == 0 else []
    return [info.chunks] if searched_parts(model, pp * info.chunks, fixed or Fixed(), uneven) else []


def cells_per_microbatch(schedule: str, pp: int, chunks: int) -> int:
    """The stages a microbatch crosses: D x v, and both directions' D of a bidirectional schedule."""
    both = SCHEDULES[schedule].placement is PlacementKind.BIDIRECTIONAL
    return pp * (2 if both else chunks)


def zero_stages(schedule: str, dp: int, chunks: int = 1) -> tuple[int, ...]:
    """The ZeRO stages a configuration may use: 1, 2 and 3 only with replicas to shard over, and only where the
    runtime shards the schedule's (``ScheduleInfo.zero``); 2 only where it pays, with ``chunks`` parts per rank
    (module docstring).

    Example:
        >>> zero_stages("1f1b", 8), zero_stages("interleaved-1f1b", 8, chunks=2), zero_stages("1f1b", 1)
        ((0, 1, 3), (0, 1, 2, 3), (0,))
    """
    if dp == 1 or not SCHEDULES[schedule].zero:
        return (0,)
    return (0, 1, 2, 3) if chunks * (dp - 1) > dp + 1 else ZERO_STAGES


def _zero_stages(schedule: str, dp: int, chunks: int, fixed: Fixed) -> tuple[int, ...]:
    """``zero_stages`` the user allows, or ZeRO 2 where it is fixed and the schedule is sharded (evaluated where
    it does not pay too)."""
    stages = zero_stages(schedule, dp, chunks)
    if fixed.zero == 2:
        return (2,) if 1 in stages else ()
    return tuple(z for z in stages if fixed.allows("zero", z))


def configurations(model: Model, gpus: int, batch: int, gpus_per_node: int, fixed: Fixed) -> Iterator[Config]:
    """The space (module docstring), in a fixed order.

    Where the space with uneven splits (depths within ``UNEVEN_SLACK``, and each depth's balanced split beside
    its even one) holds more than ``MAX_CONFIGURATIONS``, the even splits alone are searched.

    Raises:
        UserError: more than ``MAX_CONFIGURATIONS`` even then (when the one past the limit is reached).
    """
    every = _configurations(model, gpus, batch, gpus_per_node, fixed, uneven=True)
    uneven = sum(1 for _ in islice(every, MAX_CONFIGURATIONS + 1)) <= MAX_CONFIGURATIONS
    for count, config in enumerate(_configurations(model, gpus, batch, gpus_per_node, fixed, uneven), 1):
        if count > MAX_CONFIGURATIONS:
            raise UserError(
                f"--gpus {gpus} with --global-batch {batch} make more than {MAX_CONFIGURATIONS} configurations "
                "to search (the planner's limit, ~10 s); fix some of them (--microbatch-size, --stages, "
                "--data-parallel, -s), or give a --global-batch with fewer divisors"
            )
        yield config


def part_blocks(model: Model, num_parts: int, recompute: str, uneven: bool = True) -> list[tuple[int, ...]]:
    """The splits of a transformer's blocks the space holds (``planner.split.candidate_blocks``: even, and
    balanced where faster, unless not ``uneven``); a profiled model's one (``train --partition uniform``'s)."""
    if isinstance(model, Transformer):
        return candidate_blocks(model, num_parts, recompute)[: None if uneven else 1]
    return [()]


MIN_CP_CHUNK = 1024
"""The fewest tokens of each of the 2C chunks a free search gives context parallelism: shorter chunks leave too
little attention to hide the ring behind (``planner.moe``); a fixed ``--context-parallel`` is searched anyway."""


def context_parallel_sizes(model: Model, gpus: int, fixed: Fixed) -> list[int]:
    """The C searched: 1, and for a transformer the divisors of the GPUs that split its sequence into 2C chunks
    of at least ``MIN_CP_CHUNK`` tokens; the fixed C where it divides the GPUs and 2C the sequence.

    Example:
        >>> from pipeweave.planner.transformer import Transformer
        >>> m = Transformer(layers=4, hidden=64, heads=4, seq_len=8192)
        >>> context_parallel_sizes(m, 16, Fixed()), context_parallel_sizes(m, 16, Fixed(cp=8))
        ([1, 2, 4], [8])
    """
    seq = model.seq_len if isinstance(model, Transformer) else 0
    if fixed.cp is not None:
        return [fixed.cp] if gpus % fixed.cp == 0 and (fixed.cp == 1 or seq % (2 * fixed.cp) == 0) else []
    return [c for c in divisors(gpus) if c == 1 or (seq % (2 * c) == 0 and seq // (2 * c) >= MIN_CP_CHUNK)]


def expert_parallel_sizes(model: Model, dp: int, fixed: Fixed) -> list[int]:
    """The EP searched for ``dp`` replicas: 1, and for a model with E experts the divisors of dp that divide E
    (``train``'s rules: ``planner.runnable``).

    Example:
        >>> from pipeweave.planner.transformer import Transformer
        >>> m = Transformer(layers=4, hidden=64, heads=4, moe_experts=8)
        >>> expert_parallel_sizes(m, 12, Fixed()), expert_parallel_sizes(m, 12, Fixed(ep=8))
        ([1, 2, 4], [])
    """
    experts = getattr(model, "moe_experts", 0)
    sizes = [e for e in divisors(dp) if experts % e == 0] if experts else [1]
    return [e for e in sizes if fixed.allows("ep", e)]


def _configurations(
    model: Model, gpus: int, batch: int, gpus_per_node: int, fixed: Fixed, uneven: bool
) -> Iterator[Config]:
    for cp in context_parallel_sizes(model, gpus, fixed):
        for config in _configurations_at(model, gpus // cp, batch, gpus_per_node, fixed, uneven):
            for ep in expert_parallel_sizes(model, config.dp, fixed):
                if ep == 1 or config.zero == 0:  # train runs no ZeRO with expert parallelism
                    yield replace(config, ep=ep, cp=cp) if ep > 1 or cp > 1 else config


def _configurations_at(
    model: Model, gpus: int, batch: int, gpus_per_node: int, fixed: Fixed, uneven: bool
) -> Iterator[Config]:
    for tp, pp, dp in splits(model, gpus, batch, gpus_per_node, fixed, uneven):
        names = ["1f1b"] if pp == 1 else synchronous()
        for schedule in (n for n in names if fixed.allows("schedule", n)):
            for chunks in (v for v in chunk_counts(model, schedule, pp, fixed, uneven) if fixed.allows("chunks", v)):
                for b in (
                    b
                    for b in microbatch_sizes(batch, dp, cells_per_microbatch(schedule, pp, chunks))
                    if fixed.allows("microbatch_size", b)
                ):
                    for recompute in (r for r in model.recomputations if fixed.allows("recompute", r)):
                        for zero, blocks in product(
                            _zero_stages(schedule, dp, chunks, fixed),
                            part_blocks(model, pp * chunks, recompute, uneven),
                        ):
                            yield Config(
                                tp=tp,
                                pp=pp,
                                dp=dp,
                                chunks=chunks,
                                microbatch_size=b,
                                microbatches=batch // (dp * b),
                                schedule=schedule,
                                recompute=recompute,
                                zero=zero,
                                blocks=blocks,
                            )
