"""The files and folders a command writes, checked before any work: one line for a path that cannot be written.

A training run that learns only at its end that ``--json`` names a folder, or
that ``--plot`` has a suffix matplotlib cannot draw, would lose what it
measured; so every command checks its output paths first: a file's folder
must exist, a folder option's folder is created. ``write_output`` and ``replaced_output``
write a file whole or not at all (a temporary file renamed into place), and
a failure is one line naming the path and the OS's reason.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipeweave.durable import replacing, write_atomic
from pipeweave.errors import OutputNotWritten, UserError
from pipeweave.side_output import cannot_write


def picture_file(flag: str, value: str | os.PathLike[str]) -> Path:
    """``output_file`` for a timeline picture: its suffix must be one ``sim.plot`` writes.

    Raises:
        UserError: as ``output_file``, or another suffix.

    Example:
        >>> picture_file("--plot", "timeline.xyz")
        Traceback (most recent call last):
        ...
        pipeweave.errors.UserError: --plot timeline.xyz: cannot draw a .xyz file; end the file name in .png, .svg or .pdf
    """
    from pipeweave.sim.plot import FORMATS

    path = Path(value)
    if path.suffix.lower() not in FORMATS:
        what = f"a {path.suffix} file" if path.suffix else "a file without a suffix"
        raise UserError(f"{flag} {value}: cannot draw {what}; end the file name in .png, .svg or .pdf")
    return output_file(flag, path)


def output_file(flag: str, value: str | os.PathLike[str]) -> Path:
    """``value`` of option ``flag`` as a file this command can write, in a folder that exists.

    A file option's folder is not created, as a shell's ``>`` creates none: a typo in it
    (``--markdown /nonexistent/dir/x.md``) is one line, not a tree of folders. Folder options
    (``output_folder``: ``--out``, ``--save``, ``--log-dir``) name folders the command owns, and are made.

    Raises:
        UserError: the path is a folder, its folder does not exist, or it cannot be written.

    Example:
        >>> output_file("--markdown", "/nonexistent/dir/x.md")
        Traceback (most recent call last):
        ...
        pipeweave.errors.UserError: --markdown /nonexistent/dir/x.md: no folder /nonexistent/dir; create it or give another path
    """
    path = Path(value)
    if path.is_dir():
        raise UserError(f"{flag} {value} is a folder; give a file path")
    blocking = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise UserError(f"{flag} {value}: {blocking} is a file, not a folder; give another path")
    if not path.parent.is_dir():
        raise UserError(f"{flag} {value}: no folder {path.parent}; create it or give another path")
    writable = os.access(path.parent, os.W_OK) and (not path.exists() or os.access(path, os.W_OK))
    if not path.parent.is_dir() or not writable:
        raise UserError(f"{flag} {value} cannot be written; give a writable path")
    return path


def output_folder(flag: str, value: str | os.PathLike[str]) -> Path:
    """``value`` of option ``flag`` as a folder this command can write into; it is created.

    Raises:
        UserError: the path or one of its parents is a file, or the folder cannot be made or written.
    """
    path = Path(value)
    blocking = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise UserError(f"{flag} {value}: {blocking} is a file, not a folder; give another path")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{flag} {value}: cannot create the folder ({exc.strerror}); give a writable path") from exc
    if not os.access(path, os.W_OK):
        raise UserError(f"{flag} {value} cannot be written; give a writable path")
    return path


def write_output(path: Path, data: str | bytes) -> None:
    """Write an output file whole or not at all (``durable.write_atomic``).

    Raises:
        OutputNotWritten: one line naming the path and the OS's reason (no space left, permission denied).
    """
    try:
        write_atomic(path, data)
    except OSError as exc:
        raise OutputNotWritten(cannot_write(path, exc)) from None


@contextmanager
def replaced_output(path: Path) -> Iterator[Path]:
    """A temporary path for a writer that takes a path (a plot), moved onto ``path`` when whole, else removed.

    Raises:
        OutputNotWritten: as ``write_output``.
    """
    try:
        with replacing(path) as tmp:
            yield tmp
    except OSError as exc:
        raise OutputNotWritten(cannot_write(path, exc)) from None
