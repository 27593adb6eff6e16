"""What the soak reads of a run's processes, from ``/proc`` alone (no psutil).

A run is the process the soak started (``pipeweave train``, or ``torchrun``)
and everything below it. Each process gets a label: ``launcher`` (the one
started), ``forkserver`` and ``tracker`` (multiprocessing's fork server and
resource tracker beside a spawning launcher), ``rank<r>`` (a rank: its
``RANK`` from its environment where torchrun set it, else its place among
the fork server's children in order of start), ``other<pid>`` for anything
else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
SHM = Path("/dev/shm")


@dataclass
class ProcessSample:
    """One process at one moment."""

    label: str
    pid: int
    rss_bytes: int
    fds: int
    threads: int


def _stat_fields(pid: int) -> list[str]:
    """``/proc/PID/stat`` after the command name (field 3 on), which may hold spaces and parentheses."""
    return (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()


def parents() -> dict[int, int]:
    """Every live process's parent."""
    found: dict[int, int] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                found[int(entry.name)] = int(_stat_fields(int(entry.name))[1])
            except (OSError, IndexError, ValueError):
                continue
    return found


def descendants(root: int) -> list[int]:
    """``root`` and every process below it, if alive."""
    tree = parents()
    below: list[int] = [root] if root in tree else []
    frontier = [root]
    while frontier:
        children = [pid for pid, parent in tree.items() if parent in frontier]
        below += children
        frontier = children
    return below


def _cmdline(pid: int) -> str:
    return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def _env_rank(pid: int) -> int | None:
    for item in (PROC / str(pid) / "environ").read_bytes().split(b"\0"):
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def labels(root: int, pids: list[int]) -> dict[int, str]:
    """A label for each of ``pids`` (the tree below ``root``); see the module's docstring."""
    tree = parents()
    named: dict[int, str] = {}
    servers: list[int] = []
    for pid in pids:
        try:
            command = _cmdline(pid)
            rank = _env_rank(pid) if pid != root else None
        except (OSError, ValueError):
            continue
        if pid == root:
            named[pid] = "launcher"
        elif "forkserver" in command and tree.get(pid) == root:  # its forks (the ranks) share its command line
            named[pid], servers = "forkserver", [*servers, pid]
        elif "resource_tracker" in command and tree.get(pid) == root:
            named[pid] = "tracker"
        elif rank is not None and tree.get(pid) == root:
            named[pid] = f"rank{rank}"
    forked = [pid for pid in pids if tree.get(pid) in servers and pid not in named]
    for rank, pid in enumerate(sorted(forked, key=_start_ticks)):
        named[pid] = f"rank{rank}"
    return {pid: named.get(pid, f"other{pid}") for pid in pids}


def _start_ticks(pid: int) -> int:
    try:
        return int(_stat_fields(pid)[19])
    except (OSError, IndexError, ValueError):
        return 0


def sample(pid: int, label: str) -> ProcessSample | None:
    """The process's resident set, open descriptors and threads; None once it is gone."""
    try:
        status = (PROC / str(pid) / "status").read_text().splitlines()
        fields = {line.split(":", 1)[0]: line.split(":", 1)[1].split() for line in status if ":" in line}
        fds = len(os.listdir(PROC / str(pid) / "fd"))
        rss = int(fields.get("VmRSS", ["0"])[0]) * 1024  # kB; a zombie has none
        return ProcessSample(label, pid, rss, fds, int(fields["Threads"][0]))
    except (OSError, KeyError, ValueError, IndexError):
        return None


def shm_bytes(pids: list[int]) -> tuple[int, int]:
    """Bytes and count of the ``/dev/shm`` files the processes hold open or mapped, removed ones included.

    A segment torch shares is unlinked at once and lives on in its mappings
    (``/dev/shm/torch_... (deleted)``): each is found by inode through
    ``/proc/PID/fd`` and ``/proc/PID/map_files`` and counted once, by its
    allocated blocks (tmpfs holds only what was written).
    """
    held: dict[tuple[int, int], int] = {}
    for pid in pids:
        base = PROC / str(pid)
        links: list[Path] = []
        try:
            for fd in os.listdir(base / "fd"):
                try:
                    if os.readlink(base / "fd" / fd).startswith(f"{SHM}/"):
                        links.append(base / "fd" / fd)
                except OSError:
                    continue
            for line in (base / "maps").read_text().splitlines():
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith(f"{SHM}/"):
                    links.append(base / "map_files" / parts[0])
        except OSError:
            continue
        for link in links:
            try:
                stat = link.stat()
            except OSError:
                continue
            held[(stat.st_dev, stat.st_ino)] = stat.st_blocks * 512
    return sum(held.values()), len(held)


def shm_listing() -> dict[Path, int]:
    """Every file of ``/dev/shm`` with its allocated bytes."""
    listing: dict[Path, int] = {}
    for root, _, names in os.walk(SHM):
        for name in names:
            path = Path(root) / name
            try:
                listing[path] = path.stat().st_blocks * 512
            except OSError:
                continue
    return listing
