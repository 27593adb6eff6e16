"""One run at a time writes into a folder (``--save``, ``--out``): ``DIR/pipeweave.lock`` names the run that does.

``save_lock(DIR)`` is taken by the launcher process (``pipeweave train``,
rank 0's under torchrun) before any other work and released when it ends.
The lock file is created exclusively (``O_CREAT | O_EXCL``) and holds the
owner's PID, host and process start time. Where it exists:

- its owner is alive (or on another host, where pipeweave cannot tell):
  one line naming the owner, and the run does not start;
- its owner is dead (a PID on this host that no longer runs, a zombie, or a
  PID reused by a process started later): the lock is stale -- a run killed
  before it could release it -- and is taken over. Two runs taking over one
  stale lock at once cannot both win: the stale file is renamed away first,
  and only the run whose rename moved the stale file goes on.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pipeweave.durable import fsync_dir, reason
from pipeweave.errors import UserError

LOCK = "pipeweave.lock"


@contextmanager
def save_lock(folder: str | None, flag: str = "--save") -> Iterator[None]:
    """Hold ``folder``'s lock for the ``with`` block (nothing where ``folder`` is None); ``flag``: the option
    that named the folder, for the messages.

    Raises:
        UserError: another live run holds it, or it cannot be created.
    """
    if folder is None:
        yield
        return
    path = Path(folder) / LOCK
    mine = owner_of(os.getpid())
    _take(path, mine, flag)
    try:
        yield
    finally:
        if _read(path) == mine:
            try:
                path.unlink(missing_ok=True)
            except OSError:  # a folder made read-only: the lock stays, stale, and the next run takes it over
                pass


def owner_of(pid: int) -> dict[str, Any]:
    """What a lock records of its owner: PID, host, and the process's start time (to tell a reused PID)."""
    return {"pid": pid, "host": socket.gethostname(), "started": _start_time(pid)}


def _take(path: Path, mine: dict[str, Any], flag: str) -> None:
    for _ in range(5):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _create(path, mine)
            return
        except FileExistsError:
            owner = _read(path)
            if owner is not None and _alive(owner):
                raise UserError(
                    f"{flag} {path.parent} is in use by another run (pid {owner.get('pid')} on "
                    f"{owner.get('host')}); wait for it to end or give another {flag} folder (if "
                    f"that run is gone, remove {path})"
                ) from None
            _take_over(path, owner)
        except OSError as exc:
            raise UserError(
                f"{flag} {path.parent}: cannot create {path} ({reason(exc)}); give a writable folder"
            ) from None
    raise UserError(f"{flag} {path.parent}: other runs keep taking {path}; give another {flag} folder")


def _create(path: Path, mine: dict[str, Any]) -> None:
    """Create the lock with its content in one step (a hard link of a written file), so none sees it empty.

    Raises:
        FileExistsError: someone holds it.
    """
    tmp = path.with_name(f".{LOCK}.{os.getpid()}.tmp")
    try:
        with tmp.open("w") as f:
            f.write(json.dumps(mine) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise
        except OSError:  # a file system without hard links: exclusive creation, then the content
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(mine) + "\n")
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def _take_over(path: Path, stale: dict[str, Any] | None) -> None:
    """Move a stale lock out of the way; if what moved is not the stale lock (a run took it meanwhile), put it back."""
    aside = path.with_name(f".{LOCK}.{os.getpid()}.stale")
    try:
        os.rename(path, aside)
    except FileNotFoundError:  # another run took it over first: try again
        return
    if _read(aside) != stale:
        try:
            os.link(aside, path)  # fails if yet another run holds it now: its lock stands
        except OSError:
            pass
    aside.unlink(missing_ok=True)


def _read(path: Path) -> dict[str, Any] | None:
    """The owner a lock file names (None: absent, empty or unreadable -- a stale or half-written lock)."""
    try:
        owner = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def _alive(owner: dict[str, Any]) -> bool:
    """Whether the lock's owner may still run (another host's: assumed so)."""
    if owner.get("host") != socket.gethostname():
        return True
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    started = _start_time(pid)
    if started is None:
        return True
    return started != "zombie" and owner.get("started") in (None, started)


def _start_time(pid: int) -> str | None:
    """The process's start time since boot (``/proc/PID/stat``), "zombie" for a dead unreaped one, None: unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return "zombie" if fields[0] in ("Z", "X") else fields[19]
