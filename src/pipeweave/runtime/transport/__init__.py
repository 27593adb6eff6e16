"""Point-to-point messages between the ranks of a run, and their order (layer 2 of ``pipeweave.runtime``).

``p2p.P2P`` posts each rank's sends and receives in one per-pair order derived
from the lowered schedule (as NCCL needs), over gloo/NCCL or the shared-memory
rings of ``shm``, or ``host``'s buffers (ranks sharing one GPU); ``message``
describes what a message holds (dtypes, shapes, packed tuples) in its one-time
metadata; ``timing`` marks each action's start and end (host clock or CUDA
events); ``clock`` aligns the ranks' clocks on rank 0's; ``mesh`` is the run's device mesh (dp x pp x tp), its process groups,
and which process a stage rank's messages go to; ``delay`` slows messages (and any collective routed
through it) by a fixed, hideable delay, a testing aid (``--comm-delay-ms``). It imports only
``runtime.process`` of the runtime.
"""
