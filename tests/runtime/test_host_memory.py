"""Ranks keep freed host memory for reuse (glibc's mallopt), where the C library is glibc."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's"
)
def test_keep_freed_host_memory_takes_effect_on_glibc() -> None:
    # In a child: the setting is per process, and this one stays as it was.
    code = "from pipeweave.runtime.process import keep_freed_host_memory as k; print(k())"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "True"
