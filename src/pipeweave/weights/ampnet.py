"""AMPNet (Gaunt et al., arXiv 1705.09786, 2017): local update triggers and bounded in-flight work.

No weight correction at all: forwards and backwards read the current weights.
What AMPNet adds are two counters: a stage applies an update once it holds
``min_update_frequency`` gradients, and at most ``max_active_keys``
microbatches are in flight in the pipeline (the first stage admits a new one
only when one has finished). The schedule (``schedule.ampnet``) already
encodes both; these counters are for executors that run without one.
"""

from __future__ import annotations


class UpdateTrigger:
    """Counts a stage's gradients; ``add()`` says when an update is due.

    Example:
        >>> t = UpdateTrigger(2)
        >>> [t.add() for _ in range(4)]
        [False, True, False, True]
    """

    def __init__(self, min_update_frequency: int = 1) -> None:
        if min_update_frequency < 1:
            raise ValueError(f"min_update_frequency={min_update_frequency} is invalid; give >= 1")
        self.min_update_frequency = min_update_frequency
        self.pending = 0

    def add(self) -> bool:
        """One more local gradient; True (and the count resets) when it completes a group."""
        self.pending += 1
        if self.pending >= self.min_update_frequency:
            self.pending = 0
            return True
        return False


class ActiveKeys:
    """Admission control: at most ``max_active_keys`` microbatches in flight.

    Example:
        >>> k = ActiveKeys(1)
        >>> k.admit(), k.admit(), k.retire(), k.admit()
        (True, False, None, True)
    """

    def __init__(self, max_active_keys: int) -> None:
        if max_active_keys < 1:
            raise ValueError(f"max_active_keys={max_active_keys} is invalid; give >= 1")
        self.max_active_keys = max_active_keys
        self.active = 0

    def admit(self) -> bool:
        """Start a microbatch if the bound allows."""
        if self.active >= self.max_active_keys:
            return False
        self.active += 1
        return True

    def retire(self) -> None:
        """A microbatch's last backward is done."""
        self.active = max(0, self.active - 1)
