"""Writing a rank's share of a checkpoint with DCP, and saying in one line why it could not be written.

``torch.distributed.checkpoint.save`` writes each tensor with ``torch.save``
into the rank's file; when the disk fills, ``torch.save`` reports the failed
write as ``unexpected pos`` and the OS's reason is lost. ``_WatchedFileSystem``
gives DCP's ``FileSystemWriter`` streams that remember the first ``OSError``
and the file it hit, so the line can say ``cannot write DIR/.tmp-step-000004/__1_0.distcp:
No space left on device``.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem

from pipeweave.durable import reason


def write(folder: Path, state: dict[str, Any]) -> tuple[str | None, bool]:
    """Save ``state``, this rank's share, into ``folder`` with DCP; every rank calls it (DCP's save is collective).

    Returns:
        ``(None, False)`` where every rank's share was written; else ``(line, mine)``: the one line saying why not
        (the file and the OS's reason where known) and whether it was this rank's own write that failed.

    Raises:
        What a rank raised that is no failed write (a bug): raised on every rank.
    """
    fs = _WatchedFileSystem()
    writer = FileSystemWriter(folder)
    writer.fs = fs
    try:
        dcp.save(state, storage_writer=writer)
    except CheckpointException as exc:  # raised on every rank, holding every rank's failure
        if fs.error is not None:
            return f"cannot write {fs.error.filename}: {reason(fs.error)}", True
        errors = [error for error, _ in exc.failures.values()]
        cause = next((e for e in errors if isinstance(e, OSError)), None)
        if cause is not None:
            return f"cannot write {cause.filename or folder}: {reason(cause)}", False
        if any(isinstance(e, RuntimeError) and "unexpected pos" in str(e) for e in errors):
            return f"cannot write {folder}: another rank's write failed", False
        raise (errors[0] if errors else exc) from None
    return None, False


class _WatchedFileSystem(FileSystem):
    """DCP's local file system, whose written streams keep the first ``OSError`` (``error``, with its file)."""

    def __init__(self) -> None:
        super().__init__()
        self.error: OSError | None = None

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Generator[Any, None, None]:
        with super().create_stream(path, mode) as stream:
            yield _Watched(stream, Path(path), self) if "w" in mode else stream


class _Watched:
    """A written file that hands every call to the file and keeps the first OSError of a write."""

    def __init__(self, file: Any, path: Path, fs: _WatchedFileSystem) -> None:
        self._file, self._path, self._fs = file, path, fs

    def write(self, data: Any) -> int:
        try:
            written: int = self._file.write(data)
        except OSError as exc:
            if self._fs.error is None:
                self._fs.error = exc if exc.filename else type(exc)(exc.errno, exc.strerror, str(self._path))
            raise
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)
