"""The dashboard's charts: throughput, TTFT, memory and pressure over the last minutes."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from troupe.api.dashboard.views import is_scheduler, memory_view, reports
from troupe.runtime import ActorSnapshot

# The charts: the last ten minutes, one point per bucket.
HISTORY_S = 600.0
BUCKET_S = 2.0

_PRESSURE_RANK = {"ok": 0, "soft": 1, "hard": 2}


class History:
    """The charts' data: one point per ``BUCKET_S`` over ``HISTORY_S``: tokens per second,
    mean TTFT of the requests finished then, memory in use and the worst pressure seen."""

    def __init__(self, bucket_s: float = BUCKET_S, window_s: float = HISTORY_S) -> None:
        self.bucket_s = bucket_s
        self.points: deque[tuple[float, float, float | None, int | None, str | None]] = deque(
            maxlen=max(1, int(window_s / bucket_s)))
        # Every token the schedulers generated: their counters, summed across reloads.
        self.generated = 0
        self._counters: dict[str, int] = {}
        self._bucket_start: float | None = None
        self._bucket_tokens = 0
        self._ttfts: list[float] = []
        # The worst level seen in the bucket; None without a memory monitor.
        self._pressure: str | None = None
        self._usage: int | None = None

    def observe(self, now: float, snaps: list[ActorSnapshot], ttfts: list[float]) -> None:
        """One sample (``now``: monotonic seconds); closes the bucket when it is over."""
        for name, report in reports(snaps, is_scheduler):
            count = report.get("generated_tokens")
            if not isinstance(count, int):
                continue
            last = self._counters.get(name, 0)
            # A scheduler that was unloaded and loaded again counts from zero.
            delta = count - last if count >= last else count
            self._counters[name] = count
            self.generated += delta
            self._bucket_tokens += delta
        self._ttfts.extend(ttfts)
        memory = memory_view(snaps)
        if memory is not None:
            self._usage = memory["usage_bytes"]
            rank = _PRESSURE_RANK.get
            if self._pressure is None or rank(memory["pressure"], 0) > rank(self._pressure, 0):
                self._pressure = memory["pressure"]
        if self._bucket_start is None:
            self._bucket_start = now
            self._bucket_tokens = 0  # tokens counted before the first bucket are history
        elif now - self._bucket_start >= self.bucket_s:
            ttft = sum(self._ttfts) / len(self._ttfts) if self._ttfts else None
            tps = self._bucket_tokens / (now - self._bucket_start)
            self.points.append((time.time(), round(tps, 2), None if ttft is None else
                                round(ttft, 1), self._usage, self._pressure))
            self._bucket_start, self._bucket_tokens, self._ttfts = now, 0, []
            self._pressure = None if memory is None else memory["pressure"]

    def view(self) -> dict[str, Any]:
        """Columns, oldest first."""
        columns = list(zip(*self.points, strict=True)) or [[], [], [], [], []]
        return {
            "bucket_s": self.bucket_s,
            "window_s": self.bucket_s * (self.points.maxlen or 0),
            "t": list(columns[0]),
            "tokens_per_s": list(columns[1]),
            "ttft_ms": list(columns[2]),
            "memory_bytes": list(columns[3]),
            "pressure": list(columns[4]),
        }
