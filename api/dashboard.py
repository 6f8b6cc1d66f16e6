"""The live dashboard: ``GET /dashboard`` (``/`` redirects there) and its event stream,
``GET /actors/events``.

The page is one HTML file with its own script and stylesheet, served from package data
(``api/static``): no build step, no CDN, works offline. It reads one Server-Sent Events
stream: a snapshot of the whole server (actors, requests, cache, memory, models, the last ten
minutes of throughput and TTFT) every ``INTERVAL_S`` and as soon as an actor changes state
(a restart, a stop, a mailbox backing up) or a request starts, moves on or finishes.
``troupe top`` (``api.top``) reads the same stream.

One ``EventHub`` per application samples the actor system and builds each snapshot once,
whatever the number of viewers. Each viewer holds at most one snapshot not yet sent: a slow
one misses snapshots (they are dropped, never queued), and nothing waits for it, so no actor
and no other viewer is ever slowed by it.

The page itself holds no data, so it and its two files are served without the API key (a
browser cannot send a header when it navigates); the stream wants the key like every other
route. The page sends it with ``fetch`` streaming (``EventSource`` cannot send headers), so
the key never travels in a URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from troupe.api.introspection import encode_json
from troupe.api.sse import EventStream
from troupe.api.telemetry import CLIENT_CLOSED, RECORD, RequestRecord
from troupe.runtime import ActorSnapshot, ActorSystem

log = logging.getLogger(__name__)

# A snapshot at least this often; state changes go out at the next watch tick.
INTERVAL_S = 0.5
WATCH_S = 0.1
# The charts: the last ten minutes, one point per bucket.
HISTORY_S = 600.0
BUCKET_S = 2.0
FINISHED_KEPT = 50
# A mailbox at least this full counts as backed up (it stands out on the page).
BACKED_UP = 0.5
# The browser's reconnection delay, sent in the stream (ms).
RETRY_MS = 1000

STATIC = "static"
PAGE = "dashboard.html"
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
# The page and its files: no data, so no key (see the module's docstring).
PUBLIC_PATHS = frozenset({"/", "/dashboard", *(f"/dashboard/{name}" for name in ASSETS)})

_PRESSURE_RANK = {"ok": 0, "soft": 1, "hard": 2}


# -- requests -------------------------------------------------------------------------------


def _outcome(status: int, record: RequestRecord) -> str:
    """How a request ended, in a word or two."""
    if status == CLIENT_CLOSED:
        return "client closed"
    if status >= 400:
        return f"error {status}"
    return record.finish_reason or "done"


@dataclass
class RequestBoard:
    """The generation requests in flight (their telemetry records) and the last ones finished.

    Fed by ``board_middleware``; a request shows once its route has named it (``request_id``).
    """

    in_flight: dict[int, RequestRecord] = field(default_factory=dict)
    finished: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=FINISHED_KEPT))
    finished_count: int = 0
    # TTFTs (ms) of requests finished since the history last took them.
    ttfts: list[float] = field(default_factory=list)

    def start(self, record: RequestRecord) -> None:
        """A request came in (it may never name itself: not every route generates)."""
        self.in_flight[id(record)] = record

    def finish(self, record: RequestRecord, status: int) -> None:
        """A request was answered, with ``status``."""
        self.in_flight.pop(id(record), None)
        if record.request_id is None:
            return
        now = time.perf_counter()
        ttft = _ttft_ms(record)
        if ttft is not None:
            self.ttfts.append(ttft)
        self.finished_count += 1
        self.finished.appendleft({
            "id": record.request_id,
            "model": record.model,
            "status": status,
            "outcome": _outcome(status, record),
            "ttft_ms": ttft,
            "total_ms": round((now - record.started) * 1e3, 1),
            "prompt_tokens": record.prompt_tokens,
            "cached_tokens": record.cached_tokens,
            "completion_tokens": record.completion_tokens,
            "tokens_per_s": _rate(record, record.last_token_at or now),
            "ended": time.time(),
        })

    def take_ttfts(self) -> list[float]:
        """The TTFTs gathered since the last call."""
        ttfts, self.ttfts = self.ttfts, []
        return ttfts

    def rows(self, progress: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        """The named requests in flight, oldest first; ``progress``: what schedulers report
        of each request, by id (optional: see ``_scheduler_progress``)."""
        now = time.perf_counter()
        rows = []
        for record in self.in_flight.values():
            if record.request_id is None:
                continue
            stage, detail = _stage(record, progress.get(record.request_id))
            rows.append({
                "id": record.request_id,
                "model": record.model,
                "stage": stage,
                "detail": detail,
                "prompt_tokens": record.prompt_tokens,
                "cached_tokens": record.cached_tokens,
                "tokens": record.completion_tokens,
                "tokens_per_s": _rate(record, now),
                "ttft_ms": _ttft_ms(record),
                "age_s": round(now - record.started, 2),
            })
        rows.sort(key=lambda row: -row["age_s"])
        return rows

    def signature(self) -> frozenset[tuple[str, str]]:
        """Which requests are in flight and at which stage: a change is worth a snapshot."""
        return frozenset(
            (r.request_id, _stage(r, None)[0]) for r in self.in_flight.values() if r.request_id
        )


def _ttft_ms(record: RequestRecord) -> float | None:
    if record.first_token_at is None:
        return None
    return round((record.first_token_at - record.started) * 1e3, 1)


def _rate(record: RequestRecord, end: float) -> float | None:
    """Tokens per second from the first token to ``end`` (None before the first token)."""
    if record.first_token_at is None:
        return None
    elapsed = end - record.first_token_at
    return round(record.completion_tokens / elapsed, 1) if elapsed > 1e-3 else None


def _stage(record: RequestRecord, progress: dict[str, Any] | None) -> tuple[str, str]:
    """(stage, detail): admitted, waiting, prefilling, decoding."""
    if record.first_token_at is not None:
        return "decoding", f"TTFT {_ttft_ms(record):.0f} ms"
    if record.prompt_tokens is None:
        return "admitted", ""
    prompt, cached = record.prompt_tokens, record.cached_tokens or 0
    if progress is not None:
        stage = str(progress.get("stage", "prefilling"))
        done = progress.get("prefilled_tokens")
        if stage == "prefilling" and isinstance(done, int):
            return "prefilling", f"{done} of {prompt}"
        if stage != "decoding":
            return stage, f"{prompt} prompt tokens"
    # The scheduler has it; which of waiting or prefilling, only the scheduler knows.
    return "prefilling", f"{prompt} tokens, {cached} cached"


def board_middleware(board: RequestBoard) -> Middleware:
    """Innermost middleware: puts each request on the board while its handler runs."""

    @web.middleware
    async def on_board(request: web.Request, handler: Handler) -> web.StreamResponse:
        record = request.get(RECORD)
        if record is None:
            return await handler(request)
        board.start(record)
        # Telemetry closes the record with its final status, whatever the outcome.
        record.on_close.append(lambda status: board.finish(record, status))
        return await handler(request)

    return on_board


# -- the snapshot ---------------------------------------------------------------------------


def _key(name: str) -> str:
    """Which engine an actor belongs to: '' for the plain names, the model's key otherwise."""
    return name.partition(":")[2]


def _is_scheduler(report: dict[str, Any]) -> bool:
    # Known by what they report, not their class: api/ never imports the actors. An unloaded
    # scheduler reports only its model and ``loaded: False``.
    return isinstance(report.get("model"), str) and isinstance(report.get("loaded"), bool) \
        and ("steps" in report or report["loaded"] is False)


def _is_cache_index(report: dict[str, Any]) -> bool:
    return "disk_max_bytes" in report and "skipped" in report


def _is_ssd_writer(report: dict[str, Any]) -> bool:
    return "persisted" in report and "pending" in report


def _is_memory_monitor(report: dict[str, Any]) -> bool:
    return "limit_bytes" in report and "usage_bytes" in report and "pressure" in report


def _is_pool(report: dict[str, Any]) -> bool:
    return isinstance(report.get("pinned"), list) and isinstance(report.get("models"), list)


def _reports(snaps: Iterable[ActorSnapshot], kind: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(s.name, s.report) for s in snaps if s.report and kind(s.report)]


def _scheduler_progress(snaps: list[ActorSnapshot]) -> dict[str, dict[str, Any]]:
    """Per-request progress, where a scheduler reports it (``report()["requests"]``: a list
    of ``{"id", "stage", "prefilled_tokens", ...}``); empty otherwise."""
    progress: dict[str, dict[str, Any]] = {}
    for _, report in _reports(snaps, _is_scheduler):
        for item in report.get("requests") or []:
            if isinstance(item, dict) and isinstance(item.get("id"), str):
                progress[item["id"]] = item
    return progress


def cache_view(snaps: list[ActorSnapshot]) -> list[dict[str, Any]]:
    """The prefix cache of each engine: blocks and bytes against quotas, hits, disk writes.

    The RAM tier and the hits are the scheduler's (nothing while its model is unloaded), the
    disk the cache index's, the writes the SSD writer's."""
    writers = {_key(name): (name, r) for name, r in _reports(snaps, _is_ssd_writer)}
    depth = {s.name: s.mailbox_depth for s in snaps}
    schedulers = {_key(name): r for name, r in _reports(snaps, _is_scheduler)}
    engines = []
    for name, index in _reports(snaps, _is_cache_index):
        key = _key(name)
        writer_name, writer = writers.get(key, (None, {}))
        scheduler = schedulers.get(key, {})
        # Prompt tokens served from the cache (RAM, disk, partial hits), and prefilled.
        hit, miss = scheduler.get("hit_tokens", 0), scheduler.get("miss_tokens", 0)
        engines.append({
            "name": name,
            "model": scheduler.get("model") or key or None,
            "ram_blocks": scheduler.get("ram_blocks", 0),
            "disk_blocks": index.get("blocks", 0),
            "ram_bytes": scheduler.get("ram_block_bytes", 0),
            "ram_max_bytes": scheduler.get("ram_max_bytes", 0),
            "disk_bytes": index.get("disk_bytes", 0),
            "disk_max_bytes": index.get("disk_max_bytes", 0),
            "hit_rate": hit / (hit + miss) if hit + miss else 0.0,
            "hit_tokens": hit,
            "miss_tokens": miss,
            # Queued: in the writer's own queue and still in its mailbox. Dropped: by the
            # writer, and by the scheduler when the writer's mailbox was full.
            "writes_queued": writer.get("pending", 0) + depth.get(writer_name or "", 0),
            "writes_dropped": writer.get("dropped", 0) + scheduler.get("blocks_dropped", 0),
            "persisted": writer.get("persisted", 0),
        })
    return engines


def memory_view(snaps: list[ActorSnapshot]) -> dict[str, Any] | None:
    """The memory monitor's reading: usage against the limit, and the pressure level."""
    monitors = _reports(snaps, _is_memory_monitor)
    if not monitors:
        return None
    report = monitors[0][1]
    return {
        "usage_bytes": report.get("usage_bytes", 0),
        "limit_bytes": report.get("limit_bytes", 0),
        "high_water_bytes": report.get("high_water_bytes", 0),
        "rss_bytes": report.get("rss_bytes"),
        "pressure": report.get("pressure", "ok"),
        "limit_source": report.get("limit_source"),
    }


def models_view(snaps: list[ActorSnapshot]) -> dict[str, Any]:
    """The models in the pool: loaded or not, busy or idle, pinned, and their memory."""
    pools = _reports(snaps, _is_pool)
    schedulers = {r.get("model"): r for _, r in _reports(snaps, _is_scheduler)}
    pool = pools[0][1] if pools else {}
    ids = list(pool.get("models") or schedulers)
    loaded = set(pool.get("loaded") or [m for m, r in schedulers.items() if r.get("loaded")])
    pinned = set(pool.get("pinned") or [])
    weights = pool.get("loaded_weights_bytes")
    # Per model where the pool says (``per_model``); with one model loaded, it is all of it.
    per_model = pool.get("per_model") if isinstance(pool.get("per_model"), dict) else {}
    rows = []
    for model in ids:
        scheduler = schedulers.get(model, {})
        busy = scheduler.get("running", 0) + scheduler.get("waiting", 0)
        memory = (per_model.get(model) or {}).get("weights_bytes")
        if memory is None and model in loaded and len(loaded) == 1:
            memory = weights
        rows.append({
            "id": model,
            "loaded": model in loaded,
            "state": ("retiring" if scheduler.get("retired") else "busy" if busy else "idle")
            if model in loaded else "not loaded",
            "running": scheduler.get("running", 0),
            "waiting": scheduler.get("waiting", 0),
            "pinned": model in pinned,
            "weights_bytes": memory,
            "tokens_per_s": scheduler.get("tokens_per_s", 0.0),
        })
    return {
        "models": rows,
        "loaded_weights_bytes": weights,
        "budget_bytes": pool.get("models_memory_bytes") or None,
    }


def backed_up(snap: ActorSnapshot) -> bool:
    """A mailbox at least half full, or senders waiting for room."""
    return snap.waiting_senders > 0 or snap.mailbox_depth >= BACKED_UP * snap.mailbox_capacity


def _actor_signature(snaps: list[ActorSnapshot]) -> tuple[tuple[str, str, int, bool], ...]:
    """What of the actors is worth a snapshot at once when it changes."""
    return tuple((s.name, s.state, s.restarts, backed_up(s)) for s in snaps)


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
        for name, report in _reports(snaps, _is_scheduler):
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


# -- the hub --------------------------------------------------------------------------------


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
        signature = (_actor_signature(snaps), self.board.signature())
        due = now - self._last_sent >= self.interval - 1e-3
        if self.subscribers and (due or signature != self._signature):
            self.publish(self.build(snaps), now)
        self._signature = signature

    def build(self, snaps: list[ActorSnapshot] | None = None) -> bytes:
        """The snapshot of the server, encoded (``snaps``: the actors, read now if None)."""
        if snaps is None:
            snaps = self.system.snapshot()
        in_flight = self.board.rows(_scheduler_progress(snaps))
        schedulers = _reports(snaps, _is_scheduler)
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


# -- the routes -----------------------------------------------------------------------------

HUB = web.AppKey("dashboard_hub", EventHub)


def _static(name: str) -> bytes:
    return (importlib.resources.files("api") / STATIC / name).read_bytes()


# The page loads only its own files and talks only to this server.
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


class DashboardRoutes:
    """The dashboard's routes, its request board and its event hub, for one application."""

    def __init__(self, system: ActorSystem, *, interval: float = INTERVAL_S) -> None:
        self.hub = EventHub(system, interval=interval)

    def register(self, app: web.Application) -> None:
        """Add the routes, the board's middleware and the hub's lifetime to ``app``.

        Register before ``IntrospectionRoutes``: ``/actors/events`` must come before
        ``/actors/{name}``.
        """
        app[HUB] = self.hub
        app.router.add_get("/actors/events", self.events)
        app.router.add_get("/", self.root)
        app.router.add_get("/dashboard", self.page)
        for name in ASSETS:
            app.router.add_get(f"/dashboard/{name}", self.asset)
        # Innermost: only requests that passed the key reach the board.
        app.middlewares.append(board_middleware(self.hub.board))
        app.cleanup_ctx.append(self._lifetime)
        app.on_shutdown.append(self._shutdown)

    async def _lifetime(self, app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(self.hub.run(), name="dashboard-hub")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _shutdown(self, app: web.Application) -> None:
        # Open streams would otherwise hold the shutdown for aiohttp's whole timeout.
        self.hub.close()

    async def root(self, request: web.Request) -> web.Response:
        """``GET /``: to the dashboard."""
        raise web.HTTPFound("/dashboard")

    async def page(self, request: web.Request) -> web.Response:
        """``GET /dashboard``: the page."""
        return web.Response(body=_static(PAGE), content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-cache",
                                     "Content-Security-Policy": _CSP})

    async def asset(self, request: web.Request) -> web.Response:
        """``GET /dashboard/<file>``: the page's script and stylesheet."""
        name = request.path.rpartition("/")[2]
        return web.Response(body=_static(name), content_type=ASSETS[name], charset="utf-8",
                            headers={"Cache-Control": "no-cache"})

    async def events(self, request: web.Request) -> web.StreamResponse:
        """``GET /actors/events``: the snapshots as SSE (``event: snapshot``), until the
        client leaves or the server shuts down."""
        stream = await EventStream.open(request)
        subscriber = self.hub.subscribe()
        try:
            # Sent at once: the client knows it is connected, and how soon to reconnect.
            await stream.response.write(f"retry: {RETRY_MS}\n\n".encode())
            while (data := await subscriber.next()) is not None:
                await stream.send([("snapshot", data)])
            await stream.close()
        except ConnectionResetError:
            pass  # the viewer has gone
        finally:
            self.hub.unsubscribe(subscriber)
        return stream.response
