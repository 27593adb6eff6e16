"""What this host has free, read before a command builds anything large (no torch: every command may ask).

``pipeweave simulate`` and ``search`` refuse problems larger than the free
memory; ``pipeweave train`` refuses a schedule too large to build and a run
whose ranks would not fit (``runtime.run.sizes``, ``runtime.run.memory``).
"""

from __future__ import annotations

import os


def available_memory() -> int | None:
    """Bytes of memory a new allocation can have: Linux's MemAvailable (free plus reclaimable cache), else free pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
