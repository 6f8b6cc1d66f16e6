"""A 429's Retry-After, estimated from how fast requests have been finishing.

Admission refuses when a scheduler's mailbox is full, a scheduler when its queue is; each
tells the client how long the requests ahead of it will take at the pace of the last
``DRAIN_WINDOW_S``, rather than a fixed second (a queue that took 48 s to drain said 1).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

# A 429's Retry-After: how long the requests in flight take to finish at the pace of the last
# DRAIN_WINDOW_S, kept within these bounds.
RETRY_AFTER_MIN_S = 1.0
RETRY_AFTER_MAX_S = 60.0
DRAIN_WINDOW_S = 30.0


def retry_after_estimate(in_flight: int, finished: int, span_s: float) -> float:
    """Seconds until ``in_flight`` requests have finished, at the pace of the last ``span_s``
    seconds in which ``finished`` requests finished, within [RETRY_AFTER_MIN_S,
    RETRY_AFTER_MAX_S]. With none finished yet, at best one finishes per span; a span under a
    second counts as one (a burst of finishes in one step is not a rate)."""
    rate = max(finished, 1) / max(span_s, 1.0)
    return min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, in_flight / rate))


class FinishPace:
    """How fast requests finish, kept on one thread: a scheduler's own (the Retry-After of a
    request its full queue refuses), and admission's ``Drain``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.busy_since = clock()  # when the work last went from idle to busy
        self._recent: deque[float] = deque()

    def busy(self, at: float | None = None) -> None:
        """The work, idle until now (or ``at``), took a request."""
        self.busy_since = self.clock() if at is None else at

    def finished(self, at: float | None = None) -> None:
        """A request finished now (or at ``at``, a time of this pace's clock)."""
        at = self.clock() if at is None else at
        self._recent.append(at)
        self._prune(at)  # bounded by the window, whether or not anything is ever refused

    def retry_after(self, in_flight: int) -> float:
        now = self.clock()
        self._prune(now)
        since = max(now - DRAIN_WINDOW_S, self.busy_since)
        finished = sum(1 for t in self._recent if t >= since)
        return retry_after_estimate(in_flight, finished, now - since)

    def _prune(self, now: float) -> None:
        while self._recent and self._recent[0] < now - DRAIN_WINDOW_S:
            self._recent.popleft()


class Drain:
    """How fast one model's admitted requests finish, for a 429's Retry-After.

    Admission counts requests in on its own thread; a request's end is recorded from whatever
    thread reads its events (the HTTP event loop), with only a ``deque.append`` (atomic, and
    safe from a finalizer, where a lock could deadlock), and counted on admission's thread,
    where the ``FinishPace`` lives.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._count = 0  # in flight as of the last settle: admission's thread
        self._ended: deque[float] = deque()  # ends not yet counted: any thread appends
        self.pace = FinishPace(clock)  # admission's thread

    @property
    def in_flight(self) -> int:
        """Requests admitted and not ended yet (exact on admission's thread; from another
        thread, for a report, it may be one off while an end is being counted)."""
        return max(0, self._count - len(self._ended))

    def started(self) -> None:
        """A request was admitted (admission's thread)."""
        self._settle()
        if self._count == 0:
            self.pace.busy()
        self._count += 1

    def ended(self) -> None:
        """A request's events ended (any thread)."""
        self._ended.append(self.clock())

    def retry_after(self) -> float:
        """The Retry-After for a request refused now (admission's thread)."""
        self._settle()
        return self.pace.retry_after(self.in_flight)

    def _settle(self) -> None:
        ended = self._ended
        while ended:
            self.pace.finished(ended.popleft())
            self._count = max(0, self._count - 1)
