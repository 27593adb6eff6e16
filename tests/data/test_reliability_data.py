"""``--data``: a file that is not a regular one is refused in one line; one beyond 1 GiB is mapped, not read.

Before, ``pipeweave train --data /dev/zero`` read /dev/zero until the OOM killer fired (at 23.7 GB),
a FIFO blocked forever, and any file was read whole into every rank's memory.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from pipeweave.data.corpus import ByteCorpus, read_text_file

GPT = [
    "train",
    "--model",
    "gpt",
    "--layers",
    "1",
    "--hidden",
    "16",
    "--heads",
    "2",
    "--seq-len",
    "8",
    "--steps",
    "1",
    "--quiet",
]
NOTHING_SPAWNED = ("pipeweave.runtime.run.launch._spawn",)


def _refused(cli_error: Callable[..., str], argv: list[str]) -> str:
    started = time.perf_counter()
    err = cli_error(argv, *NOTHING_SPAWNED)
    assert time.perf_counter() - started < 2.0, "a refusal takes no time"
    return err


def test_data_that_is_not_a_regular_file_is_one_line(cli_error: Callable[..., str], tmp_path: Path) -> None:
    err = _refused(cli_error, [*GPT, "--data", "/dev/zero"])
    assert "--data '/dev/zero' is a character device (read without end), not a regular file; give a text file" in err, (
        err
    )
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it would wait for a writer
    err = _refused(cli_error, [*GPT, "--data", str(fifo)])
    assert f"--data '{fifo}' is a FIFO (read without end), not a regular file; give a text file" in err, err


def test_a_data_file_beyond_the_bound_is_mapped_not_read(tmp_path: Path) -> None:
    path = tmp_path / "big.txt"
    with open(path, "wb") as f:
        f.write(b"hello, world. " * 1000)
        f.truncate((1 << 30) + (1 << 20))  # sparse: 1 GiB of zero bytes after the text, on no disk
    before = _rss()
    text = read_text_file(path)
    assert len(text) == (1 << 30) + (1 << 20) and text[:5] == b"hello"
    assert _rss() - before < 64 << 20, "a file beyond WHOLE_BYTES is mapped, not read into memory"
    corpus = ByteCorpus(text, seq_len=8, batch_size=4)
    x, y = corpus.batch(0)
    assert x.shape == (4, 8) and _rss() - before < 64 << 20, "windows are read from the mapping"


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
