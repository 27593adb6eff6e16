"""Where checkpoints meet ``torch.distributed.checkpoint``: a rank's share written, its keys read, failures in a line.

DCP is imported on first use, not with this module: importing it imports
DTensor, 0.7 s on a 2-core machine, which the launcher of every ``pipeweave
train`` would pay for nothing. Spawned ranks find it imported already: their
fork server preloads it once (``forkserver.context``), so that a test
session's many runs do not import it in every rank.

``torch.distributed.checkpoint.save`` writes each tensor with ``torch.save``
into the rank's file; when the disk fills, ``torch.save`` reports the failed
write as ``unexpected pos`` and the OS's reason is lost. ``write`` gives DCP's
``FileSystemWriter`` streams that remember the first ``OSError`` and the file
it hit, so the line can say ``cannot write DIR/.tmp-step-000004/__1_0.distcp:
No space left on device``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeweave.durable import reason
from pipeweave.errors import UserError
from pipeweave.side_output import cannot_write

Shapes = dict[str, tuple[torch.Size, torch.dtype]]
"""A checkpoint's tensors: key -> global size and dtype (what DCP's metadata says of each)."""


def write(folder: Path, state: dict[str, Any]) -> tuple[str | None, bool]:
    """Save ``state``, this process's share, into ``folder`` with DCP; every process calls it (DCP's save is
    collective).

    Returns:
        ``(None, False)`` where every share was written; else ``(line, mine)``: the one line saying why not
        (the file and the OS's reason where known) and whether it was this process's own write that failed.

    Raises:
        What a process raised that is no failed write (a bug): raised on every process.
    """
    from torch.distributed.checkpoint.api import CheckpointException  # on first use: see the module's docstring
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    writer = FileSystemWriter(folder)
    first: list[OSError] = []
    _watch(writer.fs, first)
    try:
        save(state, storage_writer=writer)
    except CheckpointException as exc:  # raised on every process, holding every process's failure
        if first:
            return cannot_write(first[0].filename, first[0]), True
        errors = [error for error, _ in exc.failures.values()]
        cause = next((e for e in errors if isinstance(e, OSError)), None)
        if cause is not None:
            return cannot_write(cause.filename or folder, cause), False
        if any(isinstance(e, RuntimeError) and "unexpected pos" in str(e) for e in errors):
            return f"cannot write {folder}: another process's write failed", False
        raise (errors[0] if errors else exc) from None
    return None, False


def read(folder: Path, wanted: Callable[[Shapes], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Load into ``wanted(shapes)`` -- the tensors this process asks for, given what the checkpoint in ``folder``
    holds -- with DCP; every process calls it (DCP's load is collective; one process alone loads alone).

    DCP's default load planner reads exactly the keys of the state dict it is given, however many more the
    checkpoint holds (the round-trip tests, on gloo), so no planner option is needed: ``wanted`` asks only for
    keys the checkpoint lists (``allow_partial_load`` stays off, so a key DCP cannot find is an error).

    Raises:
        UserError: the folder cannot be read, or is damaged (one line naming it), or what ``wanted`` raised.
    """
    from torch.distributed.checkpoint.api import CheckpointException  # on first use: see the module's docstring
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import load

    reader = FileSystemReader(folder)
    try:
        saved = {
            key: (m.size, m.properties.dtype)
            for key, m in reader.read_metadata().state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)
        }
        values = wanted(saved)
        with warnings.catch_warnings():  # one process (a tool, a test) has no group: DCP says so, loudly
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            load(values, storage_reader=reader, no_dist=not dist.is_initialized())
    except UserError:
        raise
    except OSError as exc:
        raise UserError(f"cannot read the checkpoint {folder} ({reason(exc)}); resume another checkpoint") from None
    except (CheckpointException, Exception) as exc:  # noqa: BLE001 - damaged after its manifest was checked
        raise UserError(
            f"the checkpoint {folder} is damaged or not pipeweave's ({type(exc).__name__}); resume another checkpoint"
        ) from None
    return values


def _watch(fs: Any, first: list[OSError]) -> None:
    """Make the streams DCP's file system ``fs`` opens for writing keep the first ``OSError`` in ``first``."""
    create = fs.create_stream

    @contextlib.contextmanager
    def create_stream(path: Any, mode: str) -> Iterator[Any]:
        with create(path, mode) as stream:
            yield _Watched(stream, Path(path), first) if "w" in mode else stream

    fs.create_stream = create_stream


class _Watched:
    """A written file that hands every call to the file and keeps the first OSError of a write."""

    def __init__(self, file: Any, path: Path, first: list[OSError]) -> None:
        self._file, self._path, self._first = file, path, first

    def write(self, data: Any) -> int:
        try:
            written: int = self._file.write(data)
        except OSError as exc:
            if not self._first:
                self._first.append(exc if exc.filename else type(exc)(exc.errno, exc.strerror, str(self._path)))
            raise
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)
