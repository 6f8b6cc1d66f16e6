"""Supervision policy: when an actor restarts, and how often it may (plain synchronous code)."""

from __future__ import annotations

import enum
from collections import deque


class Restart(enum.Enum):
    """What happens when an actor ends on its own (OTP's restart types).

    PERMANENT restarts on any such end: an error, or the actor stopping itself.
    TRANSIENT restarts only after an error. TEMPORARY never restarts.
    A stop ordered from outside (``system.stop``, ``system.kill``) never restarts.
    """

    PERMANENT = "permanent"
    TRANSIENT = "transient"
    TEMPORARY = "temporary"

    def restarts_after(self, error: BaseException | None) -> bool:
        """Whether an actor that ended with ``error`` (None: it stopped itself) restarts."""
        if self is Restart.PERMANENT:
            return True
        return self is Restart.TRANSIENT and error is not None


class RestartBudget:
    """At most ``max_restarts`` restarts within any ``window`` seconds."""

    def __init__(self, max_restarts: int, window: float) -> None:
        if max_restarts < 0 or window <= 0:
            raise ValueError("max_restarts must be >= 0 and restart_window > 0")
        self.max_restarts = max_restarts
        self.window = window
        self._times: deque[float] = deque()

    def allow(self, now: float) -> bool:
        """Spend one restart at time ``now`` (monotonic seconds); False when none is left."""
        while self._times and now - self._times[0] >= self.window:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True
