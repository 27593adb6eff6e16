"""Files that are either whole or absent: written under a temporary name, fsynced, then renamed into place.

``write_atomic(path, data)`` and ``replacing(path)`` (for writers that take a
path, such as matplotlib's) never leave a half-written ``path``: a reader
sees the old file or the new one, and after a crash of the machine, too
(the file and its folder are fsynced). The temporary file is removed on
every exit path but a kill. ``reason(exc)`` is what an ``OSError`` says to a
user: "No space left on device", "Permission denied".
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def fsync_dir(folder: str | os.PathLike[str]) -> None:
    """Make the entries of ``folder`` (a file created or renamed in it) durable; a no-op where unsupported."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot fsync a folder: nothing more to do there
        pass
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush ``path``'s data to its disk (a file another library wrote)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary(path: Path) -> Path:
    """The temporary name ``path`` is written under beside it: hidden, this process's, ``path``'s suffix kept."""
    return path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")


_TEMPORARY = re.compile(r"\.(?P<stem>.+)\.(?P<pid>\d+)\.tmp(?P<suffix>\.[^.]*)?")


def remove_stale_temporaries(folder: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporary files of ``temporary`` in ``folder`` whose writer is gone (a killed process's).

    A file of a live process (another run writing there now) is left alone. Returns what was removed.

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> _ = (folder / ".latest.999999999.tmp").write_text("half")
        >>> [p.name for p in remove_stale_temporaries(folder)]
        ['.latest.999999999.tmp']
    """
    removed = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _TEMPORARY.fullmatch(entry.name)
        if match and entry.is_file() and not _alive(int(match["pid"])):
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return pid < 2**22  # another user's live process; an absurd number is no process
    return True


@contextmanager
def replacing(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces ``path`` atomically, else it is removed.

    Example:
        >>> import tempfile
        >>> target = Path(tempfile.mkdtemp()) / "record.json"
        >>> with replacing(target) as tmp:
        ...     _ = tmp.write_text("{}")
        >>> target.read_text(), sorted(p.name for p in target.parent.iterdir())
        ('{}', ['record.json'])
    """
    target = Path(path)
    tmp = temporary(target)
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, target)
        fsync_dir(target.parent)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all (``replacing``); raises OSError (``reason`` says why)."""
    with replacing(path) as tmp:
        if isinstance(data, str):
            tmp.write_text(data)
        else:
            tmp.write_bytes(data)


def reason(exc: OSError) -> str:
    """What went wrong, in the operating system's words: ``No space left on device``, ``Permission denied``."""
    return exc.strerror or str(exc) or type(exc).__name__
