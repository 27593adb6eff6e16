"""The sections of a training run's configuration that say what runs: schedule, data, parallelism, memory, split.

Each field is one option: its type, its default (``pipeweave train``'s),
its docstring (the ``--help`` text and the API reference) and its own check
(``config.schema``). What follows from several fields together is resolved
in one place, ``TrainConfig.__post_init__`` (cheap defaults) and
``runtime.run.resolve`` (what needs the model: the split, searched costs).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from pipeweave.config.schema import at_least, check_section, option
from pipeweave.errors import UserError
from pipeweave.schedule.ir import Schedule
from pipeweave.sim.cost import cost_problem
from pipeweave.sim.recompute import parse_recompute, per_part, spelled

MAX_BUCKET_MB = 4096.0
AUTO = "auto"
"""``--recompute auto``: chosen per part by ``--partition memory`` under ``--memory-limit``."""


def parse_counts(
    text: str, flag: str = "--layers-per-stage", what: str = "layer", example: str = "3,2,2,1"
) -> tuple[int, ...]:
    """``"3,2,2,1"`` -> ``(3, 2, 2, 1)`` (``flag``, ``what`` is counted and ``example``: what an error names).

    Raises:
        UserError: not a list of integers, or a negative count.

    Example:
        >>> parse_counts("3,2,2,1")
        (3, 2, 2, 1)
    """
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise UserError(f"{flag} {text!r} is not a list of integers; write e.g. {example}") from None
    negative = [c for c in counts if c < 0]
    if negative:
        raise UserError(
            f"{flag} {text} has a negative {what} count ({negative[0]}); give every part at least one {what}, "
            f"e.g. {example}"
        )
    return counts


def parse_replicas(text: str) -> tuple[int, ...]:
    """``--stage-replicas 2,1``: ranks per part (``schedule.round_robin`` checks them against the ranks)."""
    counts = parse_counts(text, "--stage-replicas", "rank", "2,1")
    if 0 in counts:
        raise UserError(f"--stage-replicas {text} gives a part no rank; give every part at least one rank, e.g. 2,1")
    return counts


def _activations(value: float, flag: str) -> None:
    if not value > 0:  # nan too
        raise UserError(f"{flag} {value} is invalid; give K > 0, e.g. 1 (ZB-1p) or 2 (ZB-2p), or inf for no limit")


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """Which schedule runs, on how many ranks and microbatches (``pipeweave schedules`` lists them).

    Example:
    >>> ScheduleConfig(name="interleaved-1f1b", num_stages=4, num_chunks=2).num_chunks
    2
    """

    name: str | None = option(None, flags=("-s", "--schedule"))
    """Schedule name (``pipeweave schedules`` lists them; default zb-h1); with ``--schedule-file``, the file's path."""
    schedule_path: str | None = option(None, flags=("--schedule-file",), metavar="FILE")
    """Train a schedule written by hand: torch.distributed.pipelining's CSV (one row of actions such as 0F1 per
    rank) or pipeweave's text form; validated first; --stages and --microbatches come from it."""
    num_stages: int | None = option(None, flags=("--stages",))
    """D, pipeline ranks (default 2, or the schedule file's)."""
    num_microbatches: int | None = option(None, flags=("--microbatches",))
    """T, microbatches per step (default 4, or the schedule file's)."""
    num_chunks: int | None = option(None, flags=("--chunks",))
    """v, chunks per rank, for schedules that take it."""
    warmup_steps: int | None = option(None)
    """pipemare: leading mini-batches run synchronously (default 0)."""
    vertical_sync: bool | None = option(None)
    """pipedream: every stage reads the version stage 0 read."""
    update_every: int | None = option(None)
    """pipedream, spectrain: microbatches per update (default 1)."""
    in_flight: int | None = option(None)
    """pipedream: microbatches stage 0 admits before its first backward (default NOAM = ceil(D / input replicas))."""
    stage_replicas: tuple[int, ...] | None = option(None, metavar="N,N,...", parse=parse_replicas)
    """pipedream: ranks per part, e.g. 2,1 (part 0 on two ranks taking alternate microbatches, PipeDream's
    1F1B-RR; --stages is their sum); --partition pipedream chooses them."""
    min_update_frequency: int | None = option(None)
    """ampnet: local gradients per update (default 1)."""
    max_active_keys: int | None = option(None)
    """ampnet: microbatches in flight (default D)."""
    pipelines: int | None = option(None, metavar="P")
    """avgpipe: replicated pipelines (default 2)."""
    own_ranks: bool | None = option(None)
    """avgpipe: each pipeline on D ranks of its own, P x D processes averaging by an all-reduce (the paper's
    layout); default: the P pipelines share D ranks and average in place."""
    overlap_fb: bool | None = option(None, flags=("--no-overlap-fb",), negate=True)
    """dualpipe, dualpipe-v: run DeepSeek's F&B pairs (one microbatch's F beside another's B) one after the other;
    default: overlapped, the B half's messages moving while the F half computes (the same results either way)."""
    activation_limit: float | None = option(None, metavar="K", check=_activations)
    """zb-auto, zb-v-auto: activations per rank as a multiple of 1F1B's peak D x M_a (default 1: ZB-1p's; 2:
    ZB-2p's)."""
    written: Schedule | None = option(None, internal=True)
    """The schedule read from ``schedule_path`` and validated (``runtime.run.resolve``)."""
    options: tuple[tuple[str, Any], ...] = option((), internal=True)
    """Options of the schedule's generator: the generator fields above that are set, and what the run adds (a
    searched schedule's per-part costs), e.g. ``(("warmup_steps", 2),)``."""

    def __post_init__(self) -> None:
        check_section(self)


GENERATOR_OPTIONS = {
    "warmup_steps": "warmup_steps",
    "vertical_sync": "vertical_sync",
    "update_every": "update_every",
    "in_flight": "in_flight",
    "stage_replicas": "replicas",
    "min_update_frequency": "min_update_frequency",
    "max_active_keys": "max_active_keys",
    "pipelines": "num_pipelines",
    "own_ranks": "own_ranks",
    "overlap_fb": "overlap_fb",
    "activation_limit": "activation_limit",
}
"""``ScheduleConfig`` field -> the generator's keyword it sets."""


def _text_file(value: str, flag: str) -> None:
    if not value:
        raise UserError(f"{flag} '' is invalid; give a text file")


def _not_empty(value: str, flag: str) -> None:
    if not value:
        raise UserError(f"{flag} '' is invalid; give a field name or a path")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What the model trains on, in what batches, and what it is evaluated on.

    Example:
    >>> DataConfig(batch_size=32).eval_batches
    4
    """

    batch_size: int = option(16, flags=("--batch", "--batch-size"), check=at_least(1))
    """Samples per step, split into T microbatches (the last ones may be smaller)."""
    path: str | None = option(None, flags=("--data",), metavar="FILE", check=_text_file)
    """gpt, llama, hf:: what to train on (default: the Python standard library's sources): a text file, a JSON
    Lines or Parquet file of documents, or a folder written by datasets' save_to_disk; documents are encoded by
    --tokenizer (bytes without one), cached beside the data, and packed into --seq-len windows."""
    text_field: str = option("text", metavar="FIELD", check=_not_empty)
    """The field holding each document's text in a JSON Lines, Parquet or datasets --data."""
    tokenizer: str | None = option(None, metavar="PATH", check=_not_empty)
    """A local Hugging Face tokenizer (a save_pretrained folder or a tokenizer.json) that encodes --data
    (default: bytes; for --model hf:PATH the tokenizer saved in PATH)."""
    eval_path: str | None = option(None, flags=("--eval-data",), metavar="FILE", check=_text_file)
    """Held-out documents for --eval-every, read and encoded as --data (default: part of --data held out)."""
    data_seed: int | None = option(None)
    """Seed of the data order (default: the model's --seed)."""
    min_seq_len: int | None = option(None, metavar="N")
    """Sequences of variable length (gpt, hf:TYPE, your own model of sequences), as a dataset without packing
    gives them: each microbatch cut to its own length drawn from [N, --seq-len or the dataset's length], sent
    between ranks as it is, not padded."""
    eval_every: int | None = option(None, metavar="N", check=at_least(1))
    """Every N steps and after the last, the mean loss of held-out batches through a forward-only pipeline (gpt:
    one block in 20 of the corpus, never trained on; a custom model: its eval_dataset); an asynchronous schedule
    drains its stream there."""
    eval_batches: int = option(4, metavar="K", check=at_least(1))
    """Held-out batches per evaluation, the same every time."""

    def __post_init__(self) -> None:
        check_section(self)


def _bucket(value: float, flag: str) -> None:
    if not 0 < value <= MAX_BUCKET_MB:  # nan too
        raise UserError(f"{flag} {value} is invalid; give MiB > 0 and at most {MAX_BUCKET_MB:g}")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the pipeline composes with tensor, context and data parallelism on one device mesh (P x D x C x N
    processes).

    Example:
    >>> ParallelConfig(data_parallel=2, tensor_parallel=2, zero=1).zero
    1
    """

    data_parallel: int = option(1, metavar="P", check=at_least(1, "give P >= 1 pipeline replicas (1: none)"))
    """Pipeline replicas, gradients all-reduced across them; ranks P x D."""
    tensor_parallel: int = option(1, metavar="N", check=at_least(1, "give N >= 1 processes per stage (1: none)"))
    """Processes splitting every stage's layers (Megatron's tensor parallelism); processes P x D x N on one
    device mesh."""
    context_parallel: int = option(1, metavar="C", check=at_least(1, "give C >= 1 processes per sequence (1: none)"))
    """Processes splitting every sequence (gpt, llama): each holds 2 of its 2C chunks (the load-balanced causal
    layout) and the attention passes keys and values around them (ring attention); processes P x D x C x N."""
    sequence_parallel: bool = option(False)
    """With --tensor-parallel N > 1 (gpt): layer norms and residual adds on 1/N of the sequence,
    all-gather/reduce-scatter instead of all-reduce (Korthikanti et al. 2022)."""
    zero: Literal[0, 1, 2, 3] = option(0, metavar="STAGE")
    """ZeRO stage of data parallelism: 0 (none), 1 (optimizer state sharded over the P replicas), 2 (gradients too:
    reduce-scattered after each B or W, each replica keeping its slice) or 3 (parameters too: gathered before each
    F, B, I and freed after)."""
    bucket_mb: float = option(25.0, metavar="MIB", check=_bucket)
    """MiB of gradients per all-reduce across replicas."""
    expert_parallel: int = option(1, metavar="E", check=at_least(1, "give E >= 1 ranks per expert group (1: none)"))
    """Split each mixture-of-experts layer's experts over E of the --data-parallel replicas (E divides P),
    tokens exchanged by all-to-all; the experts' gradients summed over the P/E replicas holding the same ones."""

    def __post_init__(self) -> None:
        check_section(self)

    @property
    def per_stage_rank(self) -> int:
        """C x N: the processes of one stage rank (its context- and tensor-parallel groups), which run its
        actions alike."""
        return self.context_parallel * self.tensor_parallel


def _recompute(value: str | bool, flag: str) -> None:
    if value != AUTO:
        parse_recompute(value)


def _offload(value: str, flag: str) -> None:
    from pipeweave.schedule.levers import parse_offload

    if value not in ("all", "none", AUTO):
        parse_offload(value, 1 << 30)  # numbers; the run's plan checks them against the schedule's parts


@dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    """The memory levers: recomputation, offload, BPipe's balancing, compression of saved activations.

    Example:
    >>> MemoryConfig(recompute="full,none").recompute_of(2)
    ('full', 'none')
    """

    recompute: str | bool = option("none", const="full", metavar="none|selective|full|auto", check=_recompute)
    """Activation recomputation: none, selective (the attention core, Korthikanti et al.) or full, for every part
    or one per part comma-separated, e.g. full,selective,none,none (bare: full); auto: chosen per part by
    --partition memory under --memory-limit. True means full, False none."""
    offload: str | None = option(None, metavar="PARTS", check=_offload)
    """Offload the saved activations of these parts to host memory after F and reload them before the backward:
    all, or part numbers comma-separated (on CPU a memory-mapped file on local disk, on CUDA pinned memory)."""
    balance_activations: bool = option(False)
    """BPipe: a rank above its pair's mean peak sends a share of its activations to rank D-1-r after F and takes
    it back before the backward."""
    compress_activations: Literal["bf16"] | None = option(None)
    """Stash saved activations in this format between F and the backward (lossy; default off)."""
    memory_every_step: bool = option(False)
    """Count activation bytes (saved-tensor hooks) in every step, not only the first.

    Every step holds the same tensors (same microbatch sizes, same schedule), so the first step's peak is every
    step's; the hooks cost a few % of compute time. Sequences of variable length are counted in every step
    regardless."""

    def __post_init__(self) -> None:
        if isinstance(self.recompute, (bool, str)) and self.recompute != AUTO:  # any other type: named below
            object.__setattr__(self, "recompute", spelled(parse_recompute(self.recompute)))
        if self.offload == "none":
            object.__setattr__(self, "offload", None)
        check_section(self)

    def recompute_of(self, num_parts: int) -> tuple[str, ...]:
        """The recomputation mode of each of ``num_parts`` parts.

        Raises:
            UserError: a per-part list of another length.
        """
        return per_part(self.recompute, num_parts)

    @property
    def recomputes(self) -> bool:
        """Whether any part recomputes."""
        return self.recompute != AUTO and any(m != "none" for m in parse_recompute(self.recompute))


def _finite_cost(what: str) -> Any:
    def check(value: float, flag: str) -> None:
        problem = cost_problem(value, what)
        if problem is not None:
            raise UserError(f"{flag} {value} {problem}")

    return check


BYTE_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str, flag: str = "--memory-limit") -> float:
    """``"64MiB"`` -> 67108864.0, ``"2e9"`` -> 2e9: a size in bytes > 0, bare or with a unit (B, kB, MB, GB, KiB,
    MiB, GiB).

    Raises:
        UserError: not a finite size > 0.

    Example:
        >>> parse_bytes("8GiB"), parse_bytes("2e9")
        (8589934592.0, 2000000000.0)
    """
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    try:
        value = float(match.group(1)) if match else math.nan
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)) or unit not in ("", *BYTE_UNITS):
        raise UserError(f"{flag} {text!r} is invalid; give bytes per rank, e.g. 64MiB, 8GiB or 2e9")
    return value * BYTE_UNITS.get(unit, 1)


def _bytes(value: float, flag: str) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise UserError(f"{flag} {value} is invalid; give bytes per rank > 0, e.g. 8GiB or 2e9")


def _bandwidth(value: float, flag: str) -> None:
    if not 0 < value < math.inf:
        raise UserError(f"{flag} {value} is invalid; give finite bytes per second > 0, e.g. 1e10")


@dataclass(frozen=True, kw_only=True)
class PartitionConfig:
    """How the model's layers are split over the stages (``pipeweave.partition``).

    Example:
    >>> PartitionConfig(method="explicit", layers_per_stage=(3, 3)).layers_per_stage
    (3, 3)
    """

    method: str = option("uniform", flags=("--partition",), metavar="METHOD")
    """uniform, parameters, type:REGEX, time, pipedream, memory or explicit."""
    memory_limit: float | None = option(None, metavar="BYTES", parse=parse_bytes, check=_bytes)
    """memory: bytes one rank may hold, e.g. 8GiB or 2e9 (the activation multiple K of zb-auto and zb-v-auto is
    --activation-limit)."""
    layers_per_stage: tuple[int, ...] | None = option(None, metavar="N,N,...", parse=parse_counts)
    """explicit: layer count of each part, e.g. 3,2,2,1 (the gpt's layers are its embedding, its --layers blocks
    and its head)."""
    first_stage_layers: int | None = option(None, metavar="N", check=at_least(0, "give blocks >= 0"))
    """uniform: blocks of the first part, the embedding besides (Megatron-LM's first pipeline stage; Llama 3
    puts one block fewer there); the parts between share the rest evenly."""
    last_stage_layers: int | None = option(None, metavar="N", check=at_least(0, "give blocks >= 0"))
    """uniform: blocks of the last part, the head besides (Megatron-LM's last pipeline stage)."""
    optimizer_state: float = option(1.0, metavar="X", check=_finite_cost("number of bytes per weight byte"))
    """Bytes of gradient and optimizer state per weight byte (SGD 1, Adam 3)."""
    bandwidth: float = option(1e10, check=_bandwidth)
    """pipedream: bytes/s between ranks."""
    costs: str | None = option(None, metavar="FILE")
    """Per-layer costs (JSON) instead of profiling the model."""
    repeats: int = option(5, check=at_least(1))
    """Timed runs per layer when profiling."""
    refresh: bool = option(False)
    """Profile again even if a cached profile exists."""
    layers_per_part: tuple[int, ...] | None = option(None, internal=True)
    """Layer count of each part as the method chose it (``runtime.run.resolve``); None: uniform."""

    def __post_init__(self) -> None:
        check_section(self)
        ends = [f for f in ("first_stage_layers", "last_stage_layers") if getattr(self, f) is not None]
        if ends and (self.method != "uniform" or self.layers_per_stage is not None):
            given = "--layers-per-stage" if self.layers_per_stage is not None else f"--partition {self.method}"
            raise UserError(
                f"--{ends[0].replace('_', '-')} applies to --partition uniform, not {given}; drop one of them "
                "(--layers-per-stage gives every part's count)"
            )
