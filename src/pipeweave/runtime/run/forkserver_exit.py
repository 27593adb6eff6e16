"""Imported by the fork server alone (its last preload, ``forkserver.context``): it leaves at once when its launcher goes.

The fork server leaves when its launcher does (its end of a pipe closes). It
has torch imported, and an interpreter that has imported torch takes seconds
to finalize on a busy machine (5.2 s measured here, against 1.3 s leaving
through ``os._exit``; benchmarks/cleanup/README.md): a killed launcher's run
was not gone until then. Nothing of the server's needs finalizing -- its
children, the ranks, leave through ``os._exit`` themselves and never run
its exit handlers -- so the handler registered here, the last, runs first
and ends the process.

Never imported by a launcher or a rank: importing it makes the importing
process skip its own finalization.
"""

from __future__ import annotations

import atexit
import os
import sys


def _leave() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or detached: nothing to flush
            pass
    os._exit(0)


atexit.register(_leave)
