"""The gpt's data: byte-level windows of a text corpus, by default the Python standard library's own source.

Every machine with Python has the standard library's ``.py`` files, so the
built-in corpus needs no download; it is read in sorted path order, so it is
the same bytes on every run (for one Python version).
"""

from __future__ import annotations

import os
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


def read_text_file(path: str | os.PathLike[str]) -> bytes:
    """The bytes of a text file given by the user.

    Raises:
        UserError: the file cannot be read.
    """
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read --data {str(path)!r} ({exc.strerror}); give a readable text file") from exc


class ByteCorpus:
    """Random windows of a byte string: inputs ``text[o:o+seq_len]``, targets shifted by one byte.

    Batch ``step`` draws its window offsets from a generator seeded by
    ``(seed, step)``, so every rank (the first stage wants the inputs, the last
    the targets) gets the same batch without communication.

    Args:
        text: the corpus; None reads the standard library sources.
        seq_len: tokens per sample.
        batch_size: samples per batch.
        seed: data seed.

    Raises:
        UserError: the corpus is shorter than one window.

    Example:
        >>> corpus = ByteCorpus(b"abcdefgh" * 4, seq_len=4, batch_size=2)
        >>> x, y = corpus.batch(0)
        >>> bool(torch.equal(x[:, 1:], y[:, :-1])), x.dtype
        (True, torch.int64)
    """

    def __init__(self, text: bytes | None = None, *, seq_len: int, batch_size: int, seed: int = 0) -> None:
        text = stdlib_sources() if text is None else text
        if len(text) < seq_len + 1:
            raise UserError(
                f"the corpus has {len(text)} bytes, fewer than one window of seq_len+1={seq_len + 1}; "
                "give a longer text file or a smaller seq_len"
            )
        if batch_size < 1:
            raise UserError(f"batch_size={batch_size} is invalid; give batch_size >= 1")
        self.tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self._window = torch.arange(seq_len + 1)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of step ``step``: int64 tensors of shape (batch_size, seq_len)."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        offsets = torch.randint(0, len(self.tokens) - self.seq_len, (self.batch_size,), generator=generator)
        windows = self.tokens[offsets[:, None] + self._window].long()
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
