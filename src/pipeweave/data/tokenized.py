"""Documents turned into one token stream, once, cached beside the data.

``tokenize(path, text_field, tokenizer)`` reads the documents of ``--data``
(``data.documents``), encodes them with a local Hugging Face tokenizer
(``--tokenizer``: a folder written by ``save_pretrained``, or a
``tokenizer.json`` file; without one, each document's UTF-8 bytes), and
writes the stream -- every document's tokens followed by the tokenizer's
end-of-sequence token where it has one (a NUL byte for bytes) -- with the
documents' start offsets as two ``.npy`` files in ``<data>.tokens/``, named
by a digest of the data's bytes, the text field and the tokenizer's own
serialisation. The launcher calls it before any rank starts; each rank then
finds the cache under the same digest and maps it (``numpy.load``,
copy-on-write), so a stream larger than memory is read as windows are drawn.
Where the data's folder cannot be written, the cache goes to
``$XDG_CACHE_HOME/pipeweave/tokens`` (default ``~/.cache``).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeweave.data.documents import read_documents
from pipeweave.errors import UserError

FORMAT = b"pipeweave-tokens-1"
"""Part of every digest: a new layout of the cache gets new names."""
BYTE_EOS = 0
"""The end-of-document token of the byte-level stream (no --tokenizer)."""
_BATCH = 256
"""Documents encoded per call of the tokenizer."""


@dataclass(frozen=True)
class Tokenizer:
    """A loaded ``--tokenizer`` (or the byte-level encoding: ``hf is None``)."""

    path: str | None
    hf: Any = None

    @property
    def vocab_size(self) -> int:
        """Token ids it can produce: its vocabulary with added tokens (256 for bytes)."""
        return 256 if self.hf is None else len(self.hf)

    @property
    def eos(self) -> int | None:
        """The token that ends every document in the stream (None: the tokenizer has none)."""
        return BYTE_EOS if self.hf is None else self.hf.eos_token_id

    def encode(self, documents: list[str]) -> list[list[int]]:
        """Each document's token ids, without special tokens (the stream adds ``eos`` itself)."""
        if self.hf is None:
            return [list(d.encode("utf-8")) for d in documents]
        return self.hf(documents, add_special_tokens=False)["input_ids"]  # type: ignore[no-any-return]

    def identity(self) -> bytes:
        """What the cache's digest knows the tokenizer by: its full serialisation (vocabulary, merges, rules)."""
        if self.hf is None:
            return b"bytes"
        backend = getattr(self.hf, "backend_tokenizer", None)
        own = backend.to_str() if backend is not None else repr(sorted(self.hf.get_vocab().items()))
        return f"{type(self.hf).__name__}|{self.eos}|{own}".encode()


def load_tokenizer(path: str | os.PathLike[str] | None) -> Tokenizer:
    """The tokenizer at ``path`` (a ``save_pretrained`` folder or a ``tokenizer.json``), offline; None: bytes.

    Raises:
        UserError: transformers missing, or nothing at ``path`` that transformers loads as a tokenizer.
    """
    if path is None:
        return Tokenizer(None)
    try:
        import transformers
    except ImportError:
        raise UserError(f"--tokenizer {path} needs transformers; pip install -c constraints.txt -e '.[hf]'") from None
    where = Path(path)
    if not where.exists():
        raise UserError(f"--tokenizer {str(path)!r} does not exist; give a tokenizer folder or tokenizer.json")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        if where.is_file():
            hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(where))
        else:
            hf = transformers.AutoTokenizer.from_pretrained(str(where), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"--tokenizer {str(path)!r} is not a tokenizer transformers can load ({first}); give a folder written "
            "by a tokenizer's save_pretrained, or a tokenizer.json"
        ) from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    return Tokenizer(str(path), hf)


@dataclass(frozen=True)
class TokenStream:
    """A tokenized ``--data``: the stream, each document's start in it, and the tokenizer's facts."""

    tokens: torch.Tensor
    """int32 (or uint8 for bytes), every document followed by ``eos``."""
    starts: torch.Tensor
    """int64: where each document begins in ``tokens``; one more entry, the stream's length, at the end."""
    vocab_size: int
    eos: int | None


def tokenize(path: str | os.PathLike[str], text_field: str = "text", tokenizer: Tokenizer | None = None) -> TokenStream:
    """The token stream of ``path``'s documents: from the cache when its digest is there, else encoded and cached.

    Raises:
        UserError: a bad file (``data.documents``); no document.
    """
    tokenizer = Tokenizer(None) if tokenizer is None else tokenizer
    digest = _digest(Path(path), text_field, tokenizer)
    for folder in _cache_folders(Path(path)):
        tokens_file, starts_file = folder / f"{digest}.npy", folder / f"{digest}.starts.npy"
        if tokens_file.is_file() and starts_file.is_file():
            return _stream(tokens_file, starts_file, tokenizer)
    tokens, starts = _encode(path, text_field, tokenizer)
    for folder in _cache_folders(Path(path)):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            _write(folder / f"{digest}.starts.npy", starts)
            _write(folder / f"{digest}.npy", tokens)  # last: its presence says the pair is complete
            return _stream(folder / f"{digest}.npy", folder / f"{digest}.starts.npy", tokenizer)
        except OSError:
            continue
    return TokenStream(torch.from_numpy(tokens), torch.from_numpy(starts), tokenizer.vocab_size, tokenizer.eos)


def _encode(path: str | os.PathLike[str], text_field: str, tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    pieces: list[np.ndarray] = []
    lengths: list[int] = []
    batch: list[str] = []
    dtype = np.uint8 if tokenizer.hf is None else np.int32
    tail = [] if tokenizer.eos is None else [tokenizer.eos]

    def flush() -> None:
        for ids in tokenizer.encode(batch):
            pieces.append(np.asarray(ids + tail, dtype=dtype))
            lengths.append(len(pieces[-1]))
        batch.clear()

    for document in read_documents(path, text_field):
        batch.append(document)
        if len(batch) == _BATCH:
            flush()
    flush()
    if not pieces:
        raise UserError(f"--data {str(path)!r} holds no document; give a file with at least one")
    starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    return np.concatenate(pieces), starts


def _stream(tokens_file: Path, starts_file: Path, tokenizer: Tokenizer) -> TokenStream:
    # copy-on-write: torch wants a writable array; nothing is ever written back to the file
    tokens = np.load(tokens_file, mmap_mode="c")
    starts = np.load(starts_file)
    return TokenStream(torch.from_numpy(tokens), torch.from_numpy(starts), tokenizer.vocab_size, tokenizer.eos)


def _write(target: Path, array: np.ndarray) -> None:
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".part")
    try:
        with os.fdopen(handle, "wb") as file:
            np.save(file, array)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _cache_folders(path: Path) -> list[Path]:
    """Beside the data first, then the user's cache."""
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return [path.parent / f"{path.name}.tokens", home / "pipeweave" / "tokens"]


def _digest(path: Path, text_field: str, tokenizer: Tokenizer) -> str:
    h = hashlib.blake2b(FORMAT, digest_size=12)
    h.update(text_field.encode() + b"\0" + tokenizer.identity() + b"\0")
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    try:
        for file in files:
            h.update(str(file.relative_to(path) if path.is_dir() else "").encode() + b"\0")
            with open(file, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
    except OSError as exc:
        raise UserError(f"cannot read --data {str(path)!r} ({exc.strerror}); give a readable file") from None
    return h.hexdigest()
