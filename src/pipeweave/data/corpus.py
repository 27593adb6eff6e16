"""The gpt's data: byte-level windows of a text corpus, by default the Python standard library's own source.

Every machine with Python has the standard library's ``.py`` files, so the
built-in corpus needs no download; it is read in sorted path order, so it is
the same bytes on every run (for one Python version).
"""

from __future__ import annotations

import mmap
import os
import stat
import sysconfig
from pathlib import Path

import torch

from pipeweave.errors import UserError

DEFAULT_MAX_BYTES = 8 << 20
"""Bytes of the standard library read by default (8 MiB: plenty for short runs, read in well under a second)."""


def stdlib_sources(max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """The standard library's ``.py`` files in sorted path order, concatenated, up to ``max_bytes``.

    Installed third-party packages (``site-packages``) are left out.

    Raises:
        UserError: no source file found (a Python without its standard library sources).

    Example:
        >>> len(stdlib_sources(max_bytes=1000))
        1000
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorting in place makes os.walk itself visit directories in a fixed order.
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            chunks.append((Path(dirpath) / name).read_bytes())
            total += len(chunks[-1])
            if total >= max_bytes:
                return b"".join(chunks)[:max_bytes]
    if not chunks:
        raise UserError(f"no .py files under {root}; give a text file with --data")
    return b"".join(chunks)


WHOLE_BYTES = 1 << 30
"""A ``--data`` file up to this size (1 GiB) is read whole; a larger one is memory-mapped (``read_text_file``)."""

Text = bytes | mmap.mmap
"""A corpus: its bytes, or a private (copy-on-write, never written back) mapping of a large file."""


def read_text_file(path: str | os.PathLike[str], whole_bytes: int | None = None) -> Text:
    """The bytes of a text file given by the user: read whole up to ``whole_bytes``, memory-mapped beyond.

    A mapped file's pages are the page cache's, read as windows are drawn
    and reclaimable, so a file larger than memory trains without being
    loaded (a private mapping: nothing is ever written back). Only a regular
    file is accepted: a device or a pipe (``/dev/zero``, a FIFO) has no end
    to read to, so it is refused instead of read until memory runs out.

    Raises:
        UserError: the file cannot be read, or is not a regular file.
    """
    whole_bytes = WHOLE_BYTES if whole_bytes is None else whole_bytes
    try:
        mode = os.stat(path).st_mode  # before opening: opening a FIFO waits for a writer
        if not stat.S_ISREG(mode):
            raise UserError(f"--data {str(path)!r} is {_kind(mode)}, not a regular file; give a text file")
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size <= whole_bytes:
                return file.read()
            return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    except OSError as exc:
        raise UserError(f"cannot read --data {str(path)!r} ({exc.strerror}); give a readable text file") from exc


def _kind(mode: int) -> str:
    """What a file that is not a regular one is, for messages."""
    for test, name in (
        (stat.S_ISCHR, "a character device (read without end)"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO (read without end)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a regular file"


HELD_OUT = 20
"""One block in this many is held out for evaluation (``split_blocks``)."""
BLOCK_BYTES = 64 << 10
"""Size of the corpus's blocks (smaller for short texts, so that there are at least ``HELD_OUT`` of them)."""

Segments = list[tuple[int, int]]


def split_blocks(length: int, seq_len: int) -> tuple[Segments, Segments]:
    """``(train, held_out)``: the byte ranges of a text of ``length`` bytes that each side draws windows from.

    The text is cut into blocks of ``BLOCK_BYTES`` (at least ``seq_len + 1``,
    and at most ``length // HELD_OUT`` so that a short text still has
    ``HELD_OUT`` of them); every ``HELD_OUT``-th block is held out, spread over
    the whole text (the standard library's sources end with codec tables: a
    held-out tail would not be like the rest). Training windows lie within the
    runs of blocks between them, evaluation windows within one held-out block,
    so no window of one side shares a byte with the other. A text too short
    for a window on each side holds nothing out: ``([(0, length)], [])``.

    Example:
        >>> split_blocks(100, 4)
        ([(0, 95)], [(95, 100)])
    """
    block = max(seq_len + 1, min(BLOCK_BYTES, length // HELD_OUT))
    held = [(b, min(b + block, length)) for b in range(block * (HELD_OUT - 1), length, block * HELD_OUT)]
    held = [(a, b) for a, b in held if b - a >= seq_len + 1]
    bounds = [0] + [x for ab in held for x in ab] + [length]
    train = [(a, b) for a, b in zip(bounds[::2], bounds[1::2]) if b - a >= seq_len + 1]
    if not held or not train:
        return [(0, length)], []
    return train, held


def _draw(segments: Segments, seq_len: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` window starts, uniform over every window that fits inside one of ``segments``."""
    first = torch.tensor([a for a, _ in segments])
    fits = torch.tensor([b - a - seq_len for a, b in segments])
    ends = fits.cumsum(0)
    u = torch.randint(0, int(ends[-1]), (count,), generator=generator)
    i = torch.searchsorted(ends, u, right=True)
    return first[i] + u - (ends[i] - fits[i])


def microbatch_lengths(seed: int, step: int, num_microbatches: int, min_seq_len: int, seq_len: int) -> list[int]:
    """The sequence length of each microbatch of step ``step``: uniform in ``[min_seq_len, seq_len]``, from a
    generator seeded by ``(seed, step)`` apart from the windows' (``ByteCorpus.microbatch_lengths``)."""
    generator = torch.Generator().manual_seed((1 << 40) + seed * 1_000_003 + step)
    return torch.randint(min_seq_len, seq_len + 1, (num_microbatches,), generator=generator).tolist()


class ByteCorpus:
    """Random windows of a byte string: inputs ``text[o:o+seq_len]``, targets shifted by one byte.

    Batch ``step`` draws its window offsets from a generator seeded by
    ``(seed, step)``, so every rank (the first stage wants the inputs, the last
    the targets) gets the same batch without communication. One block in
    ``HELD_OUT`` of the text is never trained on: ``eval_batch(k)`` draws
    from those alone (``split_blocks``).

    Args:
        text: the corpus (a large file's mapping: ``read_text_file``); None reads the standard library sources.
        seq_len: tokens per sample (the longest, with ``min_seq_len``).
        batch_size: samples per batch.
        seed: data seed.
        min_seq_len: sequences of variable length, as a dataset without packing gives them: each
            microbatch of each step is cut to its own length, drawn uniformly from
            ``[min_seq_len, seq_len]`` (``microbatch_lengths``); None: every sequence ``seq_len`` long.

    Raises:
        UserError: the corpus is shorter than one window.

    Example:
        >>> corpus = ByteCorpus(b"abcdefgh" * 4, seq_len=4, batch_size=2)
        >>> x, y = corpus.batch(0)
        >>> bool(torch.equal(x[:, 1:], y[:, :-1])), x.dtype
        (True, torch.int64)
    """

    def __init__(
        self, text: Text | None = None, *, seq_len: int, batch_size: int, seed: int = 0, min_seq_len: int | None = None
    ) -> None:
        text = stdlib_sources() if text is None else text
        if len(text) < seq_len + 1:
            raise UserError(
                f"the corpus has {len(text)} bytes, fewer than one window of seq_len+1={seq_len + 1}; "
                "give a longer text file or a smaller seq_len"
            )
        if batch_size < 1:
            raise UserError(f"batch_size={batch_size} is invalid; give batch_size >= 1")
        # A mapping is used in place (its pages shared with the page cache); bytes are copied to be writable.
        self.tokens = torch.frombuffer(text if isinstance(text, mmap.mmap) else bytearray(text), dtype=torch.uint8)
        if min_seq_len is not None and not 1 <= min_seq_len <= seq_len:
            raise UserError(f"--min-seq-len {min_seq_len} is invalid; give a length in [1, --seq-len {seq_len}]")
        self.seq_len, self.batch_size, self.seed, self.min_seq_len = seq_len, batch_size, seed, min_seq_len
        self._window = torch.arange(seq_len + 1)
        self.train_segments, self.held_out = split_blocks(len(text), seq_len)
        """Byte ranges the training and the held-out windows are drawn from (``split_blocks``)."""

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of step ``step``: int64 tensors of shape (batch_size, seq_len)."""
        return self._windows(self.seed * 1_000_003 + step, self.train_segments)

    def microbatch_lengths(self, step: int, num_microbatches: int) -> list[int] | None:
        """The sequence length of each microbatch of step ``step`` (None: all ``seq_len``), the same on every
        rank: drawn from a generator seeded by ``(seed, step)``, apart from the windows' own.

        Example:
            >>> corpus = ByteCorpus(b"abcdefgh" * 4, seq_len=8, batch_size=4, min_seq_len=2)
            >>> lengths = corpus.microbatch_lengths(0, 3)
            >>> len(lengths), all(2 <= n <= 8 for n in lengths), lengths == corpus.microbatch_lengths(0, 3)
            (3, True, True)
        """
        if self.min_seq_len is None:
            return None
        return microbatch_lengths(self.seed, step, num_microbatches, self.min_seq_len, self.seq_len)

    def eval_batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out batch ``k``: windows of the held-out blocks, never trained on.

        Raises:
            UserError: the text is too short to hold any window out.
        """
        if not self.held_out:
            raise UserError(
                f"the corpus has {len(self.tokens)} bytes, too few to hold out a window of "
                f"seq_len+1={self.seq_len + 1} for evaluation; give a longer text or a smaller seq_len"
            )
        return self._windows(-(self.seed * 1_000_003 + k + 1), self.held_out)

    def _windows(
        self, seed: int, segments: Segments, tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows of ``tokens`` (default: the corpus's own) at offsets drawn within ``segments``."""
        offsets = _draw(segments, self.seq_len, self.batch_size, torch.Generator().manual_seed(seed))
        windows = (self.tokens if tokens is None else tokens)[offsets[:, None] + self._window].long()
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
