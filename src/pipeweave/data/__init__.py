"""Offline data for the main job, and the split of a batch into microbatches.

``data_source(spec, ...)`` gives an object with ``batch(step) -> (inputs,
targets)``; every rank calls it with the same arguments and keeps what it
needs (the first stage the inputs, the last stage the targets).
"""

from __future__ import annotations

import os
from typing import Protocol

import torch

from pipeweave.data import documents
from pipeweave.data.corpus import ByteCorpus, read_text_file, stdlib_sources
from pipeweave.data.dataset import DatasetSource, sequence_length
from pipeweave.data.packed import TokenCorpus
from pipeweave.data.synthetic import RandomRegression
from pipeweave.data.tokenized import load_tokenizer, tokenize
from pipeweave.errors import UserError
from pipeweave.models import boundary
from pipeweave.models.boundary import Boundary, num_samples
from pipeweave.models.hf import default_tokenizer, hf_vocab, is_hf
from pipeweave.models.spec import ModelSpec


class DataSource(Protocol):
    def batch(self, step: int) -> tuple[Boundary, Boundary]: ...


def data_source(
    spec: ModelSpec,
    *,
    batch_size: int,
    seed: int = 0,
    path: str | os.PathLike[str] | None = None,
    min_seq_len: int | None = None,
    text_field: str = "text",
    tokenizer: str | os.PathLike[str] | None = None,
    eval_path: str | os.PathLike[str] | None = None,
) -> DataSource:
    """The model's data: fixed random regression for the mlp, byte windows of a corpus for the gpt,
    a custom model's own dataset (``DatasetSource``), the tokenized documents of ``path`` (``TokenCorpus``).

    Args:
        spec: the model.
        batch_size: samples per mini-batch.
        seed: data seed.
        path: gpt, llama or hf:: a text, JSON Lines or Parquet file, or a ``datasets`` folder, to train on
            instead of the standard library sources (``data.documents``).
        min_seq_len: sequences of variable length (``ByteCorpus``, ``DatasetSource``), each microbatch its own.
        text_field: the documents' field in a JSON Lines, Parquet or ``datasets`` file.
        tokenizer: a local Hugging Face tokenizer (folder or tokenizer.json) that encodes ``path``; None:
            bytes (for ``hf:PATH``: the tokenizer saved in PATH, if any).
        eval_path: held-out documents for evaluation, read and encoded as ``path``.

    Raises:
        UserError: a path or min_seq_len given for the mlp, min_seq_len for a dataset of no sequences, a
            vocabulary too small for the tokens, an unreadable file or record.

    Example:
        >>> x, y = data_source(ModelSpec(kind="mlp", hidden=8), batch_size=4).batch(0)
        >>> tuple(y.shape)
        (4, 8)
    """
    if min_seq_len is not None and spec.kind == "mlp":
        raise UserError(
            f"--min-seq-len applies to models of sequences (gpt, llama, hf:TYPE, your own); a "
            f"{spec.kind} model brings fixed shapes: drop --min-seq-len"
        )
    if spec.kind != "mlp" and (tokenizer is not None or eval_path is not None or _is_documents(path)):
        if path is None:
            raise UserError("--tokenizer and --eval-data encode --data's documents; give --data FILE")
        return documents_source(
            spec,
            path,
            batch_size=batch_size,
            seed=seed,
            min_seq_len=min_seq_len,
            text_field=text_field,
            tokenizer=tokenizer,
            eval_path=eval_path,
        )
    if spec.kind == "custom":
        if path is not None and is_hf(spec.entry):
            return documents_source(spec, path, batch_size=batch_size, seed=seed, min_seq_len=min_seq_len)
        if path is not None:
            raise UserError(
                "--data applies to --model gpt, llama or hf:; a custom model brings its own dataset: drop --data"
            )
        model = spec.custom
        return DatasetSource(
            model.dataset, batch_size=batch_size, seed=seed, eval_dataset=model.eval_dataset, min_seq_len=min_seq_len
        )
    if spec.kind == "mlp":
        if path is not None:
            raise UserError(
                "--data applies to --model gpt, llama or hf:; the mlp fits fixed random targets: drop --data"
            )
        return RandomRegression(hidden=spec.hidden, batch_size=batch_size, seed=seed)
    if spec.vocab < 256:
        raise UserError(f"vocab={spec.vocab} cannot hold bytes; give vocab >= 256 for the byte-level corpus")
    text = None if path is None else read_text_file(path)
    return ByteCorpus(text, seq_len=spec.seq_len, batch_size=batch_size, seed=seed, min_seq_len=min_seq_len)


def _is_documents(path: str | os.PathLike[str] | None) -> bool:
    """A ``--data`` of records (JSON Lines, Parquet, a ``datasets`` folder) rather than one text."""
    return path is not None and documents.kind(path) != "text"


def documents_source(
    spec: ModelSpec,
    path: str | os.PathLike[str],
    *,
    batch_size: int,
    seed: int = 0,
    min_seq_len: int | None = None,
    text_field: str = "text",
    tokenizer: str | os.PathLike[str] | None = None,
    eval_path: str | os.PathLike[str] | None = None,
) -> TokenCorpus:
    """``path``'s documents encoded by ``tokenizer`` (cached: ``data.tokenized``), as windows of the model's
    sequence length; a Hugging Face model's targets are its inputs (it shifts them inside its loss).

    Raises:
        UserError: a bad file or tokenizer; a tokenizer whose ids the model's vocabulary cannot hold.
    """
    hf = is_hf(spec.entry)
    coder = load_tokenizer(tokenizer if tokenizer is not None else (default_tokenizer(spec.entry) if hf else None))
    vocab = hf_vocab(spec.entry, spec.hf_config) if hf else spec.vocab
    if coder.vocab_size > vocab:
        what = f"--tokenizer {coder.path}" if coder.path is not None else "bytes (no --tokenizer)"
        fix = "vocab_size in --hf-config" if hf else "--vocab"
        raise UserError(
            f"{what} has {coder.vocab_size} tokens, more than the model's vocabulary of {vocab}; give {fix} "
            f">= {coder.vocab_size}, or a smaller tokenizer"
        )
    stream = tokenize(path, text_field, coder)
    held = None if eval_path is None else tokenize(eval_path, text_field, coder)
    return TokenCorpus(
        stream,
        seq_len=spec.seq_len,
        batch_size=batch_size,
        seed=seed,
        min_seq_len=min_seq_len,
        shifted=not hf,
        held_out=held,
    )


def longest_sequence(spec: ModelSpec) -> int:
    """The length ``--min-seq-len`` cuts sequences from: the gpt's ``seq_len``, a custom model's samples' length.

    Raises:
        UserError: the mlp, or a custom dataset of no sequences (``dataset.sequence_length``).
    """
    if spec.kind == "mlp":
        raise UserError(
            "--min-seq-len applies to models of sequences (gpt, llama, hf:TYPE, your own), not mlp; drop --min-seq-len"
        )
    return spec.seq_len if spec.is_transformer else sequence_length(spec.custom.dataset)


def step_microbatches(source: DataSource, step: int, num_microbatches: int) -> tuple[list[Boundary], list[Boundary]]:
    """Batch ``step``'s inputs and targets, each split into ``num_microbatches`` (``split_microbatches``), each
    microbatch cut to its own sequence length where the source varies them (``ByteCorpus.microbatch_lengths``).

    Example:
        >>> source = ByteCorpus(b"abcdefgh" * 8, seq_len=8, batch_size=4, min_seq_len=2)
        >>> inputs, targets = step_microbatches(source, 0, 2)
        >>> [tuple(x.shape) for x in inputs] == [tuple(y.shape) for y in targets], len(inputs)
        (True, 2)
    """
    inputs, targets = source.batch(step)
    xs, ys = split_microbatches(inputs, num_microbatches), split_microbatches(targets, num_microbatches)
    lengths = getattr(source, "microbatch_lengths", lambda *_: None)(step, num_microbatches)
    if lengths is None:
        return xs, ys
    return ([x[:, :n] for x, n in zip(xs, lengths)], [y[:, :n] for y, n in zip(ys, lengths)])


def split_microbatches(batch: Boundary, num_microbatches: int) -> list[Boundary]:
    """Split along the batch dimension with ``torch.tensor_split``: the last ones may be one sample smaller.

    A tuple of tensors (``models.boundary``) is split tensor by tensor into tuples.

    Raises:
        UserError: fewer samples than microbatches, or ``num_microbatches`` < 1.

    Example:
        >>> [len(m) for m in split_microbatches(torch.zeros(7, 2), 3)]
        [3, 2, 2]
    """
    if num_microbatches < 1:
        raise UserError(f"num_microbatches={num_microbatches} is invalid; give at least 1")
    if num_samples(batch) < num_microbatches:
        raise UserError(
            f"a batch of {num_samples(batch)} samples cannot make {num_microbatches} microbatches; "
            "increase --batch or reduce --microbatches"
        )
    return boundary.split(batch, num_microbatches, torch.tensor_split)


__all__ = [
    "ByteCorpus",
    "DataSource",
    "DatasetSource",
    "RandomRegression",
    "TokenCorpus",
    "data_source",
    "documents_source",
    "read_text_file",
    "split_microbatches",
    "stdlib_sources",
    "step_microbatches",
]
