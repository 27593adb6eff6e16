"""Plans that run: what ``pipeweave train`` accepts of the planner's space, and the command that runs a plan.

The planner proposes only configurations ``train`` runs for the model at hand
(``refusal``), by the runtime's own rules (``runtime.run.prepare``): the ZeRO
stages ``--zero`` offers (read from ``ParallelConfig``, so a stage the runtime
gains is proposed with it); no ZeRO 2 or 3 over replicas with a tied head (a
tie is summed on whole gradients, which ZeRO 2 keeps only inside the action
that made them and FSDP only inside its backward); sequence parallelism only with TP > 1, no
ZeRO, no tie, and a sequence the TP ranks split; an untied head's vocabulary
split evenly by TP. Each proposal carries the ``train`` command that runs it
(``train_command``): the model's flags as ``train`` names them, the schedule,
the mesh, the global batch and its microbatches, recomputation, ZeRO, BF16
mixed precision and the optimizer the memory was counted for, and the planner's
split of the layers as ``--partition explicit --layers-per-stage`` (the
runtime's gpt and llama count the embedding and the head as layers of their
own: the first and the last part carry one more). Expert parallelism dividing
DP and the experts, without ZeRO, and context parallelism whose 2C chunks split
the sequence, as ``train`` checks them; the model's experts as ``--moe-experts
--moe-top-k --moe-every``.
"""

from __future__ import annotations

import functools
import shlex
import typing

from pipeweave.planner.candidate import Config
from pipeweave.planner.split import blocks_of, runtime_counts
from pipeweave.planner.transformer import Transformer


@functools.cache
def train_zero_stages() -> tuple[int, ...]:
    """The ZeRO stages ``train --zero`` takes (``ParallelConfig.zero``'s choices).

    Example:
        >>> 0 in train_zero_stages() and 1 in train_zero_stages()
        True
    """
    from pipeweave.config.sections import ParallelConfig

    return tuple(typing.get_args(typing.get_type_hints(ParallelConfig)["zero"]))


def refusal(config: Config, model: object, *, sequence_parallel: bool = False) -> str | None:
    """Why ``pipeweave train`` would refuse ``config`` for ``model`` (one line naming the fix), None if it runs
    it (module docstring).

    Example:
        >>> from pipeweave.planner.transformer import MODELS
        >>> c = Config(tp=8, pp=4, dp=2, chunks=1, microbatch_size=1, microbatches=8, schedule="1f1b",
        ...            recompute="full", zero=3)
        >>> refusal(c, MODELS["gpt-39b"])
        '--zero 3 with a tied head is not run by pipeweave train (FSDP shards the two copies apart); use --zero 1'
    """
    if config.zero not in train_zero_stages():
        return (
            f"--zero {config.zero} is not run by pipeweave train (it runs {', '.join(map(str, train_zero_stages()))})"
        )
    tied = isinstance(model, Transformer) and model.tied
    if config.zero >= 2 and config.dp > 1 and tied:
        why = "FSDP shards the two copies apart" if config.zero == 3 else "it keeps no whole gradient to sum the tie"
        return f"--zero {config.zero} with a tied head is not run by pipeweave train ({why}); use --zero 1"
    if not isinstance(model, Transformer):
        return None if config.ep == config.cp == 1 else "--expert-parallel and --context-parallel need a gpt or llama"
    problem = _moe_refusal(config, model)
    if problem is not None:
        return problem
    if sequence_parallel and config.tp > 1:
        if config.zero or tied:
            what = f"--zero {config.zero}" if config.zero else "a tied head"
            return f"--sequence-parallel with {what} is not run by pipeweave train; drop one of them"
        if model.seq_len % config.tp:
            return f"--sequence-parallel needs --seq-len {model.seq_len} divisible by TP {config.tp}"
    if not tied and model.vocab % config.tp:
        return (
            f"an untied head's vocabulary {model.vocab} does not split over TP {config.tp}; give a --vocab it divides"
        )
    return None


def _moe_refusal(config: Config, model: Transformer) -> str | None:
    """``refusal``'s rules of expert and context parallelism (``config.train``'s and ``runtime.run.resolve``'s):
    EP divides DP and the experts, with no ZeRO; 2C divides the sequence.

    Example:
        >>> from pipeweave.planner.transformer import MODELS
        >>> c = Config(tp=1, pp=1, dp=4, chunks=1, microbatch_size=1, microbatches=8, schedule="1f1b",
        ...            recompute="full", zero=1, ep=2)
        >>> _moe_refusal(c, MODELS["mixtral-8x7b"])
        '--expert-parallel 2 with --zero 1 is not run by pipeweave train; drop --zero'
    """
    if config.ep > 1:
        if not model.moe_experts or model.moe_experts % config.ep or config.dp % config.ep:
            return (
                f"--expert-parallel {config.ep} needs --moe-experts and --data-parallel {config.dp} it divides "
                f"(experts: {model.moe_experts})"
            )
        if config.zero:
            return f"--expert-parallel {config.ep} with --zero {config.zero} is not run by pipeweave train; drop --zero"
    if config.cp > 1 and model.seq_len % (2 * config.cp):
        return f"--context-parallel {config.cp} needs --seq-len {model.seq_len} divisible by 2C = {2 * config.cp}"
    return None


def layers_per_part(config: Config, model: object) -> tuple[int, ...]:
    """The layers of each part as ``train --layers-per-stage`` counts them: the planner's split of the blocks
    (``config.blocks``, uneven where it chose so, else the even split), and a transformer's embedding on the
    first part and its head on the last (``planner.split.runtime_counts``)."""
    parts = config.pp * config.chunks
    if isinstance(model, Transformer):
        return runtime_counts(blocks_of(model, parts, config.blocks))
    layers: int = model.layers
    return tuple([layers // parts] * parts)


def model_flags(model: object) -> list[str]:
    """``model`` as ``train``'s flags name it: ``--model gpt`` or ``llama`` and its shape; a profiled model's
    own flags are the profile's (a placeholder, and ``--costs``)."""
    if not isinstance(model, Transformer):
        return ["<the profiled model's --model flags>"]
    kind = "llama" if model.gated else "gpt"
    flags = ["--model", kind, "--layers", model.layers, "--hidden", model.hidden, "--heads", model.heads]
    if kind == "llama":
        flags += ["--kv-heads", model.kv_heads, "--ffn-hidden", model.ffn_hidden]
    flags += ["--seq-len", model.seq_len, "--vocab", model.vocab]
    if model.tied:
        flags.append("--tie-embeddings")
    if model.moe_experts:
        flags += ["--moe-experts", model.moe_experts, "--moe-top-k", model.moe_top_k, "--moe-every", model.moe_every]
    return [str(f) for f in flags]


def train_command(
    config: Config, model: object, *, batch: int, sequence_parallel: bool = False, optimizer: str = "adam"
) -> list[str]:
    """The arguments of ``pipeweave train`` that run ``config`` (module docstring), ``pipeweave train`` first.

    Example:
        >>> from pipeweave.planner.transformer import Transformer
        >>> m = Transformer(name="gpt", layers=4, hidden=64, heads=4, seq_len=32, vocab=256)
        >>> c = Config(tp=1, pp=2, dp=2, chunks=1, microbatch_size=2, microbatches=2, schedule="1f1b",
        ...            recompute="none", zero=1)
        >>> " ".join(train_command(c, m, batch=8)[2:])  # doctest: +NORMALIZE_WHITESPACE
        '--model gpt --layers 4 --hidden 64 --heads 4 --seq-len 32 --vocab 256 --tie-embeddings -s 1f1b
         --stages 2 --microbatches 2 --batch 8 --data-parallel 2 --tensor-parallel 1 --recompute none --zero 1
         --partition explicit --layers-per-stage 3,3 --precision bf16 --optimizer adam'
    """
    args = ["pipeweave", "train", *model_flags(model), "-s", config.schedule, "--stages", str(config.pp)]
    args += ["--microbatches", str(config.microbatches), "--batch", str(batch)]
    if config.takes_chunks:
        args += ["--chunks", str(config.chunks)]
    args += ["--data-parallel", str(config.dp), "--tensor-parallel", str(config.tp)]
    if config.ep > 1:
        args += ["--expert-parallel", str(config.ep)]
    if config.cp > 1:  # the runtime's flag of context parallelism
        args += ["--context-parallel", str(config.cp)]
    if sequence_parallel and config.tp > 1:
        args.append("--sequence-parallel")
    args += ["--recompute", config.recompute, "--zero", str(config.zero)]
    if not isinstance(model, Transformer):
        args += ["--costs", "<the profile>"]
    counts = layers_per_part(config, model)
    args += ["--partition", "explicit", "--layers-per-stage", ",".join(map(str, counts))]
    return args + ["--precision", "bf16", "--optimizer", optimizer]


def command_line(args: list[str]) -> str:
    """``train_command``'s arguments as one shell line."""
    return shlex.join(args)
