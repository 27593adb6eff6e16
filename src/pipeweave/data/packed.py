"""A tokenized ``--data`` as training windows: packed across documents, or within one with ``--min-seq-len``.

Packed (the default, as pre-training packs): windows of ``seq_len + 1`` tokens
anywhere in the stream, documents separated by their end-of-sequence token,
the held-out blocks as ``corpus.split_blocks`` cuts them. With
``--min-seq-len`` (sequences of variable length, as a dataset without packing
gives them) every window lies inside one document, so no sample crosses a
document boundary whatever length its microbatch is cut to; one document in
``corpus.HELD_OUT`` is held out. ``--eval-data`` replaces the held-out part by
windows of its own stream.
"""

from __future__ import annotations

import torch

from pipeweave.data.corpus import HELD_OUT, ByteCorpus, Segments, split_blocks
from pipeweave.data.tokenized import TokenStream
from pipeweave.errors import UserError


class TokenCorpus(ByteCorpus):
    """``batch(step)`` / ``eval_batch(k)`` over a ``TokenStream``, the same on every rank (seeded per step).

    Args:
        stream: the tokenized data (``data.tokenized.tokenize``).
        seq_len, batch_size, seed, min_seq_len: as ``ByteCorpus``.
        shifted: targets are the inputs shifted by one token (the built-in models); False: the targets are
            the inputs themselves (a Hugging Face model shifts its labels inside its loss).
        held_out: the ``--eval-data`` stream; None holds part of ``stream`` out.

    Raises:
        UserError: no window of ``seq_len + 1`` tokens fits (in one document, with ``min_seq_len``).

    Example:
        >>> stream = TokenStream(torch.arange(40, dtype=torch.int32), torch.tensor([0, 40]), 64, None)
        >>> x, y = TokenCorpus(stream, seq_len=4, batch_size=2).batch(0)
        >>> bool(torch.equal(x[:, 1:], y[:, :-1])), tuple(x.shape)
        (True, (2, 4))
    """

    def __init__(
        self,
        stream: TokenStream,
        *,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        min_seq_len: int | None = None,
        shifted: bool = True,
        held_out: TokenStream | None = None,
    ) -> None:
        if batch_size < 1:
            raise UserError(f"batch_size={batch_size} is invalid; give batch_size >= 1")
        if min_seq_len is not None and not 1 <= min_seq_len <= seq_len:
            raise UserError(f"--min-seq-len {min_seq_len} is invalid; give a length in [1, --seq-len {seq_len}]")
        self.seq_len, self.batch_size, self.seed, self.min_seq_len = seq_len, batch_size, seed, min_seq_len
        self.shifted = shifted
        self._window = torch.arange(seq_len + 1)
        self.tokens = stream.tokens
        if min_seq_len is None:
            _check_length(len(stream.tokens), seq_len, "the data")
            self.train_segments, self.held_out = split_blocks(len(stream.tokens), seq_len)
        else:
            self.train_segments, self.held_out = _documents(stream, seq_len)
        self._eval_tokens = self.tokens
        if held_out is not None:
            _check_length(len(held_out.tokens), seq_len, "--eval-data")
            self.train_segments = [(0, len(self.tokens))] if min_seq_len is None else self.train_segments
            self._eval_tokens, self.held_out = held_out.tokens, [(0, len(held_out.tokens))]

    def eval_batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out batch ``k``: windows of the held-out documents or blocks, or of ``--eval-data``."""
        if not self.held_out:
            raise UserError(
                f"the data has too few tokens to hold out a window of seq_len+1={self.seq_len + 1} for evaluation; "
                "give --eval-data, a longer file or a smaller seq_len"
            )
        return self._windows(-(self.seed * 1_000_003 + k + 1), self.held_out, self._eval_tokens)

    def _windows(
        self, seed: int, segments: Segments, tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = super()._windows(seed, segments, tokens)
        if self.shifted:
            return inputs, targets
        return inputs, inputs.clone()


def _check_length(length: int, seq_len: int, what: str) -> None:
    if length < seq_len + 1:
        raise UserError(
            f"{what} has {length} tokens, fewer than one window of seq_len+1={seq_len + 1}; "
            "give more text or a smaller --seq-len"
        )


def _documents(stream: TokenStream, seq_len: int) -> tuple[Segments, Segments]:
    """Each document long enough for a window, as its own segment; every ``HELD_OUT``-th of them held out."""
    starts = stream.starts.tolist()
    fits = [(a, b) for a, b in zip(starts[:-1], starts[1:]) if b - a >= seq_len + 1]
    if not fits:
        longest = max(b - a for a, b in zip(starts[:-1], starts[1:]))
        raise UserError(
            f"--min-seq-len keeps windows inside one document, and no document has seq_len+1={seq_len + 1} tokens "
            f"(the longest: {longest}); give --seq-len {max(1, longest - 1)} or less, or drop --min-seq-len to pack"
        )
    held = fits[HELD_OUT - 1 :: HELD_OUT]
    train = [s for i, s in enumerate(fits) if i % HELD_OUT != HELD_OUT - 1]
    return (train, held) if train else (fits, [])
