"""Parameters kept sharded between a stage's actions, and whole while code reads them (ZeRO-3).

A stage whose part is sharded over its data-parallel replicas
(``runtime.fsdp.FullyShardedPart``: FSDP2, which gathers a layer around its
own forward and backward) holds only its shards of the parameters between
actions; ``StageWorker.whole_weights()`` makes them whole, and ``gathered``
does so for every stage of a rank, around code that reads parameters outside
an action (a checkpoint, the run's final parameters, the finiteness check).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol


class Shards(Protocol):
    """A stage's parameters kept sharded between actions (``runtime.fsdp.FullyShardedPart``)."""

    def gathered(self) -> AbstractContextManager[None]:
        """The parameters whole inside (a collective of the part's replicas), freed after; values written
        into them inside are kept."""
        ...

    def weight_bytes(self) -> int:
        """Bytes of parameters kept between actions."""
        ...


@contextlib.contextmanager
def gathered(workers: Mapping[int, Any]) -> Iterator[None]:
    """Every worker's parameters whole inside (sharded ones gathered, in stage order: a collective of their
    replicas, every one of which opens it at the same point); e.g. around a checkpoint's save."""
    with contextlib.ExitStack() as stack:
        for stage in sorted(workers):
            stack.enter_context(workers[stage].whole_weights())
        yield
