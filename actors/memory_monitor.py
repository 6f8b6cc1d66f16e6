"""The memory monitor: polls MLX and process memory, publishes the limits, relieves pressure.

MLX's memory counters (active, cache, peak) belong to its allocator, which is process-wide
and locked: they can be read from any thread, so the monitor runs on its own thread and
never waits behind a model step. It resets MLX's peak counter at every poll, so each reading
holds the peak reached since the previous one: short prefill transients between two polls
still reach the high-water mark. On rank 0 of a sharded model the limit is each rank's, and
the fullest rank counts: the other ranks' memory as they report it after each step, which
rank 0's scheduler sends here (``RanksMemory``).

Every poll it tells admission and every running scheduler the limits (``MemoryLimits``),
looking the schedulers up by name in the actor system each time, so an engine loaded after
start gets them within one poll. Under soft pressure it asks every running scheduler to spill
prefix-cache blocks from RAM; under hard pressure also the engine pool to unload idle models (and
admission then answers new requests with 503).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import os
import sys
import time
from collections import deque
from typing import Any

import mlx.core as mx

from troupe.actors.cache_messages import SpillRam
from troupe.actors.engine.memory_estimate import (
    HARD,
    OK,
    SOFT,
    default_memory_limit,
    machine_memory,
    pressure_level,
)
from troupe.actors.memory_messages import (
    GetMemoryLimits,
    MemoryLimits,
    PollMemory,
    RanksMemory,
    SetMemoryLimit,
    UnloadIdle,
)
from troupe.runtime import Actor, ActorDead, ActorRef, MailboxFull

log = logging.getLogger("actors.memory_monitor")

MEMORY_THREAD = "memory"
MONITOR_NAME = "memory_monitor"
# How far back the high-water mark looks.
HIGH_WATER_WINDOW_S = 3.0
# Hard pressure asks the pool to unload at most this often (an unload takes a while to show).
UNLOAD_EVERY_S = 1.0


def metal_working_set() -> int | None:
    """Metal's recommended working set in bytes, or None (CPU, CUDA)."""
    try:
        if not mx.metal.is_available():
            return None
        info = mx.device_info()
    except (AttributeError, RuntimeError):
        return None
    size = info.get("max_recommended_working_set_size")
    return int(size) if size else None


def process_rss() -> int:
    """The process's resident set in bytes (Linux: now; elsewhere: its peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource  # macOS reports ru_maxrss in bytes

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 (musl has no malloc_trim)
    except (OSError, AttributeError):
        return None
    return libc


def trim_heap() -> bool:
    """Give the C heap's free memory back to the system (glibc's ``malloc_trim``, Linux only):
    glibc keeps what a burst freed (numpy snapshots, MLX's buffers once cleared) resident, in
    every thread's arena. False where there is no glibc to ask."""
    if not sys.platform.startswith("linux"):
        return False
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


class MemoryMonitor(Actor):
    """Polls memory every ``poll_s`` and publishes ``MemoryLimits``.

    ``limit``: bytes of MLX memory (active + cache) to stay under; None picks the default
    (``actors.engine.memory_estimate.default_memory_limit``). ``schedulers``: the names of every
    scheduler that may run (looked up at each poll).
    """

    def __init__(
        self,
        *,
        limit: int | None = None,
        poll_s: float = 0.25,
        guard: bool = True,
        admission: str = "admission",
        pool: ActorRef | None = None,
        schedulers: list[str] | tuple[str, ...] = ("scheduler",),
    ) -> None:
        self.poll_s = poll_s
        self.guard = guard
        self.admission_name = admission
        # Injected by the wiring; None where no pool can unload models (a test of the limits).
        self.pool = pool
        self.scheduler_names = list(schedulers)
        self.configured_limit = limit
        self.limit = limit or 0
        self.limit_source = "flag" if limit else "default"
        self._window: deque[tuple[float, int]] = deque()
        self._last_unload = 0.0
        self._ticker: asyncio.Task[None] | None = None
        self.latest: MemoryLimits | None = None
        self.reading: dict[str, int] = {}
        self.peak_max = 0
        self.floor: int | None = None
        self.polls = 0
        self.published = 0
        self.spills = 0
        self.unloads = 0
        self.pressure_changes = 0
        # The other ranks of a sharded model (rank 0): the fullest one's memory as last told,
        # and the highest peak told since the last poll.
        self.ranks_active = self.ranks_peak = 0

    async def on_start(self) -> None:
        if not self.limit:
            total, available = machine_memory()
            working_set = metal_working_set()
            # What MLX already holds (models loaded before the monitor) is ours to count.
            held = mx.get_active_memory() + mx.get_cache_memory()
            self.limit = default_memory_limit(
                total=total, available=None if available is None else available + held,
                working_set=working_set,
            )
            self.limit_source = "working_set" if working_set else "ram"
        log.info("memory limit %.0f MB (%s)", self.limit / 1e6, self.limit_source)
        mx.reset_peak_memory()  # peaks before the monitor started are not ours to report
        self._poll()
        self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def on_stop(self, error: BaseException | None) -> None:
        if self._ticker is not None:
            self._ticker.cancel()

    async def _tick(self) -> None:
        """Queue a poll every period; a full mailbox skips one (the next catches up)."""
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                self.ref.try_tell(PollMemory())
            except MailboxFull:
                pass
            except ActorDead:
                return

    async def handle(self, msg: PollMemory | SetMemoryLimit | GetMemoryLimits | RanksMemory
                     ) -> Any:
        match msg:
            case RanksMemory(active_bytes=active, peak_bytes=peak):
                self.ranks_active = active
                self.ranks_peak = max(self.ranks_peak, peak)
            case PollMemory():
                self._poll()
            case SetMemoryLimit(limit=limit):
                self.limit = limit
                self.limit_source = "set"
                self._poll()
            case GetMemoryLimits():
                return self.latest
            case _:
                raise TypeError(f"memory monitor cannot handle {type(msg).__name__}")
        return None

    # -- one poll --------------------------------------------------------------------------

    def _poll(self) -> None:
        now = time.monotonic()
        active = mx.get_active_memory()
        cache = mx.get_cache_memory()
        peak = mx.get_peak_memory()
        mx.reset_peak_memory()
        others, others_peak = self.ranks_active, self.ranks_peak
        self.ranks_peak = 0
        usage = max(active + cache, others)
        self.peak_max = max(self.peak_max, peak, others_peak)
        self.floor = usage if self.floor is None else min(self.floor, usage)
        # Peak counts active memory only; the cache held now counts on top of it.
        self._window.append((now, max(peak + cache, usage, others_peak)))
        while self._window and self._window[0][0] < now - HIGH_WATER_WINDOW_S:
            self._window.popleft()
        high_water = max(v for _, v in self._window)
        previous = OK if self.latest is None else self.latest.pressure
        pressure = pressure_level(usage, self.limit, previous=previous)
        if self.latest is not None and pressure != self.latest.pressure:
            self.pressure_changes += 1
            log.log(logging.INFO if pressure == OK else logging.WARNING,
                    "memory pressure %s: %.0f MB of %.0f MB", pressure, usage / 1e6,
                    self.limit / 1e6)
        self.latest = MemoryLimits(limit=self.limit, high_water=high_water, usage=usage,
                                   pressure=pressure, floor=self.floor, guard=self.guard)
        self.reading = {"active_bytes": active, "cache_bytes": cache, "peak_bytes": peak,
                        "rss_bytes": process_rss(),
                        **({"followers_active_bytes": others} if others else {})}
        self.polls += 1
        self._publish(self.latest)
        if pressure in (SOFT, HARD):
            self._relieve(pressure, now)

    def _publish(self, limits: MemoryLimits) -> None:
        for name in [self.admission_name, *self.scheduler_names]:
            if self._tell(name, limits):
                self.published += 1

    def _relieve(self, pressure: str, now: float) -> None:
        """Soft: schedulers drop RAM copies of prefix-cache blocks already on disk. Hard: also
        blocks not on disk, and the pool unloads idle models."""
        for name in self.scheduler_names:
            if self._tell(name, SpillRam(unpersisted=pressure == HARD)):
                self.spills += 1
        if pressure == HARD and now - self._last_unload >= UNLOAD_EVERY_S:
            self._last_unload = now
            if self.pool is not None and self._try_tell(self.pool, UnloadIdle()):
                self.unloads += 1

    def _tell(self, name: str, msg: Any) -> bool:
        """To an actor by name: a scheduler is there only while its model is loaded."""
        ref = self.system.find(name)
        return ref is not None and self._try_tell(ref, msg)

    def _try_tell(self, ref: ActorRef, msg: Any) -> bool:
        """Never wait: a busy actor gets the next poll's message instead."""
        if not ref.alive:
            return False
        try:
            ref.try_tell(msg)
        except (MailboxFull, ActorDead):
            return False
        return True

    def report(self) -> dict[str, Any]:
        latest = self.latest
        return {
            "limit_bytes": self.limit,
            "limit_source": self.limit_source,
            "usage_bytes": 0 if latest is None else latest.usage,
            "high_water_bytes": 0 if latest is None else latest.high_water,
            "floor_bytes": self.floor or 0,
            "pressure": OK if latest is None else latest.pressure,
            **self.reading,
            "peak_max_bytes": self.peak_max,
            "guard": self.guard,
            "polls": self.polls,
            "published": self.published,
            "spills_asked": self.spills,
            "unloads_asked": self.unloads,
            "pressure_changes": self.pressure_changes,
        }
