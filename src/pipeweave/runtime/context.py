"""What one rank of a run knows of its run: its place, the mesh and its groups, its transport, its progress sink
and its wait timeout, passed to what needs it rather than installed in modules.

The launcher (``runtime.run.launch``) builds a ``RankContext`` when a process
becomes a rank and hands it to the rank function, ``fn(context, payload)``; the
run (``runtime.run.workers.join_mesh``) adds the mesh once every group exists
(``with_mesh``); executors, transports, workers and the run's helpers take it
as an argument. Code run outside a launched rank (the reference executor, a
test on one process) takes ``RankContext()``: no mesh, gloo or NCCL messages,
a 60-second wait, progress dropped.

Example:
    >>> context = RankContext()
    >>> context.process_of(3), context.reporting, context.pipeline_group
    (3, True, None)
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pipeweave.runtime.transport.delay import delayed
from pipeweave.runtime.transport.host import HostTransport
from pipeweave.runtime.transport.mesh import Mesh
from pipeweave.runtime.transport.shm import ShmTransport

ProgressSink = Callable[[Any], None]


@dataclass(frozen=True, kw_only=True)
class RankContext:
    """One rank's run state (module docstring)."""

    process: int = 0
    """This process's rank in the default group."""
    world: int = 1
    """Processes of the run."""
    device: torch.device = torch.device("cpu")
    timeout: datetime.timedelta = datetime.timedelta(seconds=60)
    """How long a rank waits on a peer's message before failing (the launch's ``timeout_s``). Gloo applies the
    process group's timeout to collectives but not to a bare ``Work.wait()`` of a send or receive: p2p waits
    pass this."""
    sink: ProgressSink | None = None
    """Where ``progress`` reports go: the launcher's queue in a spawned rank, the caller's callback on rank 0
    under torchrun, nowhere otherwise."""
    transport: ShmTransport | HostTransport | None = None
    """The shared-memory rings of spawned CPU ranks (``--transport shm``), or the host-staged messages of ranks
    sharing a GPU (``--transport host``, ``transport.host``); None: gloo or NCCL."""
    mesh: Mesh | None = None
    """This process's place in the run's device mesh and its groups (``transport.mesh``); None: a run
    without tensor parallelism or replicas on several ranks, or before the mesh is built."""
    comm_delay: float = 0.0
    """Seconds every message between ranks takes beyond its transfer (``--comm-delay-ms``, a testing aid;
    ``transport.delay``); 0: none."""

    def delayed(self, work: Any) -> Any:
        """``work`` (a posted message's, or a collective's posted with ``async_op=True``) completing the run's
        ``comm_delay`` after it would have: the one hook every communication a run wants measured as slower
        calls (``transport.delay``; the point-to-point messages already do)."""
        return delayed(work, self.comm_delay, self.timeout)

    def with_mesh(self, mesh: Mesh | None) -> RankContext:
        """This context, in the run's ``mesh``."""
        return dataclasses.replace(self, mesh=mesh)

    def progress(self, value: Any) -> None:
        """Report progress; reaches ``launch``'s ``on_progress(rank, value)``."""
        if self.sink is not None:
            self.sink(value)

    def process_of(self, stage_rank: int) -> int:
        """The process of ``stage_rank`` with this process's ``tp`` coordinate (itself without a mesh)."""
        return stage_rank if self.mesh is None else self.mesh.process_of(stage_rank)

    @property
    def reporting(self) -> bool:
        """Whether this process reports for its stage rank: its ``tp`` coordinate is 0 (the others run alike)."""
        return self.mesh is None or self.mesh.tp_rank == 0

    @property
    def pipeline_group(self) -> Any:
        """The group of this ``tp`` coordinate's processes (None: the default group, without tensor parallelism)."""
        return None if self.mesh is None else self.mesh.pipeline_group

    @property
    def stage_rank(self) -> int:
        """This process's rank in the lowered schedule (the process itself without a mesh)."""
        return self.process if self.mesh is None else self.mesh.stage_rank
