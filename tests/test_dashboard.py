"""The dashboard's routes and its event stream (``api.dashboard``), on the scripted stack.

The stream's promises: a snapshot every interval and one at once when an actor changes state
(a mailbox backing up, a restart); a slow viewer only ever misses snapshots, it never makes
an actor or another viewer wait. The page itself is tested in a browser in
test_dashboard_browser.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import http_stack
import pytest
from http_stack import BUSY_MODEL, MODEL, Scripted

from troupe.api.dashboard.board import RequestBoard
from troupe.api.dashboard.history import History
from troupe.api.dashboard.hub import INTERVAL_S, EventHub
from troupe.api.dashboard.routes import HUB, PUBLIC_PATHS
from troupe.runtime import Actor, ActorSnapshot, Message, Restart

scripted = http_stack.scripted

# "Within one interval", with slack for a loaded CI machine: generous, never flaky.
BOUND_S = 3 * INTERVAL_S


class Hold(Message):
    """Blocks the ``Holder`` until released."""


class Crash(Message):
    """Makes the ``Crasher`` fail."""


class Ping(Message):
    pass


class Holder(Actor):
    """Handles one message at a time, each held until ``release`` is set."""

    release: asyncio.Event

    async def handle(self, msg: Any) -> None:
        await self.release.wait()


class Crasher(Actor):
    """Fails on ``Crash``; a restart takes ``RESTART_S``, so "restarting" can be seen."""

    RESTART_S = 1.0
    starts = 0

    async def on_start(self) -> None:
        Crasher.starts += 1
        if Crasher.starts > 1:
            await asyncio.sleep(self.RESTART_S)

    async def handle(self, msg: Any) -> None:
        if isinstance(msg, Crash):
            raise RuntimeError("boom")


class Counter(Actor):
    def __init__(self) -> None:
        self.count = 0

    async def handle(self, msg: Any) -> int:
        self.count += 1
        return self.count

    def report(self) -> dict[str, Any]:
        return {"count": self.count}


async def snapshots(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The snapshots of an open ``/actors/events`` response, parsed as SSE."""
    name, data = None, []
    async for raw in resp.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            data.append(line[len("data: "):])
        elif not line and data:
            assert name == "snapshot"
            yield json.loads("\n".join(data))
            name, data = None, []


async def first(
    stream: AsyncIterator[dict[str, Any]], match: Any, timeout: float
) -> tuple[dict[str, Any], float]:
    """The first snapshot for which ``match(snapshot)`` is true, and when it came."""
    async with asyncio.timeout(timeout):
        async for snap in stream:
            if match(snap):
                return snap, time.monotonic()
    raise AssertionError("the stream ended")


def actor(snap: dict[str, Any], name: str) -> dict[str, Any]:
    return next(a for a in snap["actors"] if a["name"] == name)


async def test_page_and_files_are_open_the_stream_wants_the_key(
    aiohttp_client: Any, scripted: Scripted
) -> None:
    client = await aiohttp_client(scripted.app(api_key="sekret"))
    root = await client.get("/", allow_redirects=False)
    assert (root.status, root.headers["Location"]) == (302, "/dashboard")
    page = await client.get("/dashboard")
    assert page.status == 200 and page.content_type == "text/html"
    html = await page.text()
    assert '<script src="/dashboard/dashboard.js"' in html and "/dashboard/dashboard.css" in html
    # Its own files only: nothing from elsewhere, so it works offline.
    assert "http://" not in html and "https://" not in html
    assert "script-src 'self'" in page.headers["Content-Security-Policy"]
    for path, kind in (("/dashboard/dashboard.js", "text/javascript"),
                       ("/dashboard/dashboard.css", "text/css")):
        resp = await client.get(path)
        assert (resp.status, resp.content_type) == (200, kind), path
        assert "https://" not in await resp.text()
    assert {"/", "/dashboard"} <= PUBLIC_PATHS
    assert (await client.get("/actors/events")).status == 401
    assert (await client.get("/actors/events?key=sekret")).status == 401  # headers only
    async with client.get("/actors/events", headers={"x-api-key": "sekret"}) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        # The route is not taken for an actor named "events".
        snap, _ = await first(snapshots(resp), lambda s: True, timeout=BOUND_S)
    assert [a["name"] for a in snap["actors"]] == ["admission"]
    assert snap["interval_s"] == INTERVAL_S
    assert set(snap) >= {"actors", "requests", "totals", "cache", "memory", "models", "history"}


async def test_snapshots_come_every_interval(aiohttp_client: Any, scripted: Scripted) -> None:
    client = await aiohttp_client(scripted.app())
    async with client.get("/actors/events") as resp:
        stream = snapshots(resp)
        # The first comes on connecting, the second at the hub's next tick: then the pace.
        for _ in range(2):
            await first(stream, lambda s: True, timeout=BOUND_S)
        began = time.monotonic()
        for _ in range(4):
            await first(stream, lambda s: True, timeout=BOUND_S)
    # Four more with nothing happening: about 2 s; bounds wide enough for a slow machine.
    assert 3 * INTERVAL_S <= time.monotonic() - began < 4 * INTERVAL_S + 2.0


async def test_a_filling_mailbox_reaches_a_subscriber_within_one_interval(
    aiohttp_client: Any, scripted: Scripted
) -> None:
    holder = await scripted.system.spawn(Holder, name="holder", mailbox_size=8)
    release = asyncio.Event()
    holder._cell.instance.release = release  # type: ignore[union-attr]
    client = await aiohttp_client(scripted.app())
    try:
        async with client.get("/actors/events") as resp:
            stream = snapshots(resp)
            await first(stream, lambda s: True, timeout=BOUND_S)
            holder.try_tell(Hold())
            while holder._cell.mailbox.depth:  # taken: the holder holds it
                await asyncio.sleep(0.01)
            for _ in range(8):  # eight more queued: full
                holder.try_tell(Hold())
            sent = time.monotonic()
            snap, seen = await first(
                stream, lambda s: actor(s, "holder")["mailbox_depth"] == 8, timeout=5.0)
            assert seen - sent < BOUND_S
            assert "holder" in snap["backed_up"]
            assert actor(snap, "holder")["mailbox_capacity"] == 8
    finally:
        release.set()


async def test_an_actor_restarting_reaches_a_subscriber_within_one_interval(
    aiohttp_client: Any, scripted: Scripted
) -> None:
    Crasher.starts = 0
    crasher = await scripted.system.spawn(Crasher, name="crasher", restart=Restart.TRANSIENT)
    client = await aiohttp_client(scripted.app())
    async with client.get("/actors/events") as resp:
        stream = snapshots(resp)
        await first(stream, lambda s: actor(s, "crasher")["state"] == "running", BOUND_S)
        await crasher.tell(Crash())
        sent = time.monotonic()
        # "restarting" lasts RESTART_S (less than an interval): sent as it happens.
        _, seen = await first(
            stream, lambda s: actor(s, "crasher")["state"] == "restarting", timeout=5.0)
        assert seen - sent < Crasher.RESTART_S
        snap, seen = await first(
            stream, lambda s: actor(s, "crasher")["restarts"] == 1, timeout=5.0)
        assert seen - sent < Crasher.RESTART_S + BOUND_S
    crashed = actor(snap, "crasher")
    assert crashed["state"] == "running"
    assert crashed["last_error"] == {"type": "RuntimeError", "message": "boom"}


async def test_a_slow_subscriber_never_slows_an_actor_or_other_subscribers(
    scripted: Scripted,
) -> None:
    counter = await scripted.system.spawn(Counter, name="counter")
    hub = EventHub(scripted.system, interval=0.05, watch=0.01)
    slow = hub.subscribe()  # never reads until the end
    fast = hub.subscribe()
    received: list[bytes] = []

    async def read_fast() -> None:
        while (data := await fast.next()) is not None:
            received.append(data)

    runner = asyncio.create_task(hub.run())
    reader = asyncio.create_task(read_fast())
    try:
        answers = 0
        async with asyncio.timeout(10.0):
            while len(received) < 10:
                answers = await counter.ask(Ping())
                await asyncio.sleep(0)
        # Held, not queued: one snapshot waits for the slow viewer, every other was dropped.
        # Both were offered the same snapshots, so the slow one dropped all the fast one
        # read but one.
        assert slow.pending and slow.sent == 0
        assert slow.dropped >= len(received) - 1
        counts = [actor(json.loads(d), "counter")["report"]["count"] for d in received]
        assert counts == sorted(counts) and counts[-1] > counts[0]
        # The slow viewer, reading at last, gets the newest snapshot, not the oldest.
        latest = await asyncio.wait_for(slow.next(), timeout=1.0)
        assert latest is not None
        assert actor(json.loads(latest), "counter")["report"]["count"] >= counts[-1]
        assert answers > 10
    finally:
        hub.close()
        runner.cancel()
        await asyncio.gather(runner, reader, return_exceptions=True)


async def test_requests_show_in_flight_then_among_the_finished(
    aiohttp_client: Any, scripted: Scripted
) -> None:
    client = await aiohttp_client(scripted.app())
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "slow"}]}
    async with client.get("/actors/events") as resp:
        stream = snapshots(resp)
        await first(stream, lambda s: True, timeout=BOUND_S)
        post = asyncio.create_task(client.post("/v1/chat/completions", json=body))
        snap, _ = await first(stream, lambda s: s["requests"]["in_flight"], timeout=5.0)
        row = snap["requests"]["in_flight"][0]
        assert row["id"].startswith("chatcmpl-") and row["model"] == MODEL
        assert row["stage"] in ("admitted", "prefilling", "decoding")
        answer = await post
        assert answer.status == 200
        await answer.read()
        snap, _ = await first(stream, lambda s: s["requests"]["finished"], timeout=5.0)
        done = snap["requests"]["finished"][0]
        assert done["id"] == row["id"] and not snap["requests"]["in_flight"]
        assert done["outcome"] == "stop" and done["status"] == 200
        assert done["completion_tokens"] == 4 and done["ttft_ms"] is not None
        # A refusal is listed with its status.
        refused = await client.post("/v1/chat/completions", json={**body, "model": BUSY_MODEL})
        assert refused.status == 429
        snap, _ = await first(stream, lambda s: len(s["requests"]["finished"]) == 2, 5.0)
        assert snap["requests"]["finished"][0]["outcome"] == "error 429"
        assert snap["totals"]["finished"] == 2


async def test_shutdown_ends_open_streams_at_once(scripted: Scripted) -> None:
    server = await scripted.start()
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{server.url}/actors/events") as resp:
            await first(snapshots(resp), lambda s: True, timeout=BOUND_S)
            began = time.monotonic()
            await server.close()
            # Not held for aiohttp's shutdown timeout (5 s): the hub ends the stream.
            assert time.monotonic() - began < 3.0
            assert server.app[HUB].closed


def _snap(name: str, report: dict[str, Any], **fields: Any) -> ActorSnapshot:
    values: dict[str, Any] = dict(
        name=name, actor_class="x.Y", state="running", thread=None, group=None,
        restart="permanent", mailbox_depth=0, mailbox_capacity=64, waiting_senders=0,
        messages_handled=0, restarts=0, last_error=None, report=report,
    )
    values.update(fields)
    return ActorSnapshot(**values)


def test_history_counts_tokens_per_bucket_across_a_scheduler_reload() -> None:
    history = History(bucket_s=1.0, window_s=10.0)

    def scheduler(generated: int) -> list[ActorSnapshot]:
        report = {"model": "m", "loaded": True, "steps": 1, "running": 0, "waiting": 0,
                  "batch_size": 0, "generated_tokens": generated}
        return [_snap("scheduler", report)]

    history.observe(0.0, scheduler(100), [])  # what came before the dashboard is not history
    history.observe(0.5, scheduler(150), [20.0])
    history.observe(1.0, scheduler(200), [40.0])
    history.observe(1.5, scheduler(10), [])  # unloaded and loaded again: counts from zero
    history.observe(2.0, scheduler(30), [])
    view = history.view()
    assert view["tokens_per_s"] == [100.0, 30.0]
    assert view["ttft_ms"] == [30.0, None]
    assert history.generated == 230  # the total counts what came before the dashboard


def test_request_board_keeps_the_last_fifty() -> None:
    from troupe.api.metrics import Metrics
    from troupe.api.telemetry import RequestRecord
    from troupe.runtime import ActorSystem

    board = RequestBoard()
    metrics = Metrics(ActorSystem())
    for i in range(60):
        record = RequestRecord(metrics=metrics, started=time.perf_counter(), request_id=f"r{i}")
        board.start(record)
        board.finish(record, 499 if i % 2 else 200)
    assert len(board.finished) == 50 and board.finished_count == 60
    assert [row["id"] for row in list(board.finished)[:2]] == ["r59", "r58"]
    assert board.finished[0]["outcome"] == "client closed"
    assert board.finished[1]["outcome"] == "done"
    assert not board.in_flight


@pytest.mark.parametrize("pinned", [False, True])
def test_views_read_the_serving_actors_reports(pinned: bool) -> None:
    snaps = [
        _snap("engine_pool", {"models": ["m"], "loaded": ["m"], "pinned": ["m"] if pinned else [],
                              "loaded_weights_bytes": 1000, "models_memory_bytes": 0}),
        _snap("cache_index", {"blocks": 2, "disk_bytes": 5, "disk_max_bytes": 50,
                              "hit_rate": 1.0, "hit_tokens": 32, "miss_tokens": 0,
                              "skipped": {}}),
        _snap("ssd_writer", {"persisted": 2, "pending": 1, "dropped": 3, "disk_max_bytes": 50},
              mailbox_depth=2),
        _snap("scheduler", {"model": "m", "loaded": True, "steps": 5, "running": 1,
                            "waiting": 0, "batch_size": 1, "blocks_dropped": 1,
                            "tokens_per_s": 12.5, "ram_blocks": 4, "ram_block_bytes": 10,
                            "ram_max_bytes": 100, "hit_tokens": 64, "miss_tokens": 64}),
        _snap("memory_monitor", {"limit_bytes": 100, "usage_bytes": 40, "pressure": "soft"}),
    ]
    from troupe.api.dashboard.views import cache_view, memory_view, models_view

    (cache,) = cache_view(snaps)
    # RAM and the hits from the scheduler (every prompt token served from cache), the disk
    # from the index.
    assert (cache["ram_blocks"], cache["ram_bytes"], cache["ram_max_bytes"]) == (4, 10, 100)
    assert (cache["disk_blocks"], cache["disk_bytes"], cache["disk_max_bytes"]) == (2, 5, 50)
    assert (cache["hit_rate"], cache["hit_tokens"], cache["miss_tokens"]) == (0.5, 64, 64)
    assert (cache["writes_queued"], cache["writes_dropped"], cache["model"]) == (3, 4, "m")
    assert memory_view(snaps) == {"usage_bytes": 40, "limit_bytes": 100, "high_water_bytes": 0,
                                  "rss_bytes": None, "pressure": "soft", "limit_source": None}
    (model,) = models_view(snaps)["models"]
    assert (model["state"], model["pinned"], model["weights_bytes"]) == ("busy", pinned, 1000)
