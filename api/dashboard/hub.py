"""The dashboard's event hub: samples the actor system, builds each snapshot once, and offers it
to every viewer; a slow viewer misses snapshots and never holds anyone up."""

from __future__ import annotations

import asyncio
import logging
import time

from troupe.api.dashboard.board import RequestBoard
from troupe.api.dashboard.history import History
from troupe.api.dashboard.views import (
    actor_signature,
    backed_up,
    cache_view,
    is_scheduler,
    memory_view,
    models_view,
    reports,
    scheduler_progress,
)
from troupe.api.introspection import encode_json
from troupe.runtime import ActorSnapshot, ActorSystem

log = logging.getLogger(__name__)

# A snapshot at least this often; state changes go out at the next watch tick.
INTERVAL_S = 0.5
WATCH_S = 0.1


class Subscriber:
    """One viewer of the stream: holds at most one snapshot not yet sent.

    ``offer`` never waits: a snapshot still pending is replaced (and counted in ``dropped``).
    """

    def __init__(self) -> None:
        self._pending: bytes | None = None
        self._ready = asyncio.Event()
        self._closed = False
        self.dropped = 0
        self.sent = 0

    def offer(self, data: bytes) -> None:
        """The newest snapshot; the one not yet taken, if any, is dropped."""
        if self._pending is not None:
            self.dropped += 1
        self._pending = data
        self._ready.set()

    def close(self) -> None:
        """End the stream: ``next`` returns None once the pending snapshot is taken."""
        self._closed = True
        self._ready.set()

    @property
    def pending(self) -> bool:
        """A snapshot waits to be taken."""
        return self._pending is not None

    async def next(self) -> bytes | None:
        """The newest snapshot, waiting for one; None once closed."""
        while self._pending is None:
            if self._closed:
                return None
            self._ready.clear()
            await self._ready.wait()
        data, self._pending = self._pending, None
        self.sent += 1
        return data


class EventHub:
    """Samples the actor system, keeps the history and the request board, and sends each
    snapshot to every subscriber. ``run()`` is its loop (one task per application)."""

    def __init__(
        self, system: ActorSystem, *, interval: float = INTERVAL_S, watch: float = WATCH_S,
        board: RequestBoard | None = None, history: History | None = None,
    ) -> None:
        self.system = system
        self.interval = interval
        self.watch = min(watch, interval)
        self.board = board or RequestBoard()
        self.history = history or History()
        self.subscribers: set[Subscriber] = set()
        self.snapshots_built = 0
        self.closed = False
        self._signature: object = None
        self._last_sent = 0.0

    def subscribe(self) -> Subscriber:
        """A new viewer; it gets a snapshot at once (built now: the last may be old)."""
        subscriber = Subscriber()
        self.subscribers.add(subscriber)
        subscriber.offer(self.build())
        if self.closed:
            subscriber.close()
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        """The viewer has gone."""
        self.subscribers.discard(subscriber)

    def close(self) -> None:
        """End every stream (the server is shutting down)."""
        self.closed = True
        for subscriber in list(self.subscribers):
            subscriber.close()

    async def run(self) -> None:
        """Sample until cancelled: every ``watch`` seconds while someone views, else every
        ``interval`` (the history goes on without viewers)."""
        last = 0.0
        while True:
            # Always wake at the watch pace, so a viewer who just came in is watched at once.
            await asyncio.sleep(self.watch)
            now = time.monotonic()
            if not self.subscribers and now - last < self.interval:
                continue
            last = now
            try:
                self.tick()
            except Exception:  # a report that cannot be encoded must not end the stream
                log.exception("dashboard: could not build a snapshot")

    def tick(self) -> None:
        """One sample: publish when something changed or an interval has passed."""
        now = time.monotonic()
        snaps = self.system.snapshot()
        self.history.observe(now, snaps, self.board.take_ttfts())
        signature = (actor_signature(snaps), self.board.signature())
        due = now - self._last_sent >= self.interval - 1e-3
        if self.subscribers and (due or signature != self._signature):
            self.publish(self.build(snaps), now)
        self._signature = signature

    def build(self, snaps: list[ActorSnapshot] | None = None) -> bytes:
        """The snapshot of the server, encoded (``snaps``: the actors, read now if None)."""
        if snaps is None:
            snaps = self.system.snapshot()
        in_flight = self.board.rows(scheduler_progress(snaps))
        schedulers = reports(snaps, is_scheduler)
        view = {
            "type": "snapshot",
            "time": time.time(),
            "interval_s": self.interval,
            "actors": snaps,
            "backed_up": [s.name for s in snaps if backed_up(s)],
            "requests": {"in_flight": in_flight, "finished": list(self.board.finished)},
            "totals": {
                "tokens_per_s": round(sum(r.get("tokens_per_s", 0.0) for _, r in schedulers), 2),
                "generated_tokens": self.history.generated,
                "in_flight": len(in_flight),
                "finished": self.board.finished_count,
                "actors": len(snaps),
            },
            "cache": cache_view(snaps),
            "memory": memory_view(snaps),
            "models": models_view(snaps),
            "history": self.history.view(),
        }
        self.snapshots_built += 1
        return encode_json(view)

    def publish(self, data: bytes, now: float | None = None) -> None:
        """Offer ``data`` to every subscriber; never waits."""
        self._last_sent = time.monotonic() if now is None else now
        for subscriber in list(self.subscribers):
            subscriber.offer(data)
