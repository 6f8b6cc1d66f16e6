"""A 429's Retry-After is estimated from the queue and the pace requests finish at (issue 18),
not a constant 1 s: the estimate with plain numbers, then one refusal over HTTP."""

from __future__ import annotations

import asyncio
import gc
import math
from pathlib import Path
from typing import Any

import pytest

from troupe.actors.admission import Admission, TrackedEvents
from troupe.actors.config import ServeConfig
from troupe.actors.messages import AddRequest, ModelCard, RequestFinished, Usage
from troupe.actors.retry import (
    DRAIN_WINDOW_S,
    RETRY_AFTER_MAX_S,
    RETRY_AFTER_MIN_S,
    Drain,
    FinishPace,
    retry_after_estimate,
)
from troupe.api.app import create_app
from troupe.runtime import Actor, ActorSystem
from troupe.runtime.reply import open_reply


def test_the_estimate_grows_with_the_queue_and_stays_within_its_bounds() -> None:
    # 4 requests finished in the last 8 s: 0.5 per second.
    estimates = [retry_after_estimate(n, finished=4, span_s=8.0) for n in range(0, 200, 5)]
    assert estimates == sorted(estimates)
    assert retry_after_estimate(10, 4, 8.0) == 20.0
    assert retry_after_estimate(20, 4, 8.0) == 40.0
    assert min(estimates) == RETRY_AFTER_MIN_S and max(estimates) == RETRY_AFTER_MAX_S
    # A faster pace gives a shorter wait for the same queue.
    assert retry_after_estimate(20, 40, 8.0) < retry_after_estimate(20, 4, 8.0)
    # Nothing finished yet: at best one per span (and a span under a second counts as one).
    assert retry_after_estimate(7, 0, 0.01) == 7.0
    assert retry_after_estimate(7, 0, 5.0) == 35.0
    assert retry_after_estimate(7, 0, 10.0) == RETRY_AFTER_MAX_S
    assert retry_after_estimate(0, 0, 0.0) == RETRY_AFTER_MIN_S


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_drain_reads_the_pace_of_the_requests_that_finished() -> None:
    clock = Clock()
    drain = Drain(clock)
    for _ in range(10):
        drain.started()
    clock.now += 0.5
    assert (drain.in_flight, drain.retry_after()) == (10, 10.0)  # none finished yet
    for _ in range(5):
        clock.now += 2.0
        drain.ended()
    # 5 finished in the 10.5 s since the queue filled: 5 left take 10.5 s.
    assert drain.retry_after() == pytest.approx(10.5)
    assert drain.in_flight == 5
    for _ in range(20):
        drain.started()
    assert drain.retry_after() == pytest.approx(25 * 10.5 / 5)  # a longer queue, longer wait
    for _ in range(25):
        drain.ended()
    assert drain.in_flight == 0
    # Idle past the window, then a new burst: the old pace is forgotten.
    clock.now += DRAIN_WINDOW_S + 1
    for _ in range(3):
        drain.started()
    assert drain.retry_after() == 3.0


async def test_tracked_events_tell_the_drain_once_however_the_stream_ends() -> None:
    drain = Drain(Clock())
    finished = RequestFinished(request_id="r", finish_reason="stop",
                               usage=Usage(prompt_tokens=1, completion_tokens=0))

    reply, stream = open_reply()
    drain.started()
    events = TrackedEvents(stream, drain)
    reply.send(finished)
    reply.close()
    assert [e async for e in events] == [finished]
    await events.aclose()
    assert drain.in_flight == 0

    _, stream = open_reply()
    drain.started()
    events = TrackedEvents(stream, drain)
    await events.aclose()  # the client went away
    await events.aclose()
    assert drain.in_flight == 0

    _, stream = open_reply()
    drain.started()
    TrackedEvents(stream, drain)  # dropped unread
    gc.collect()
    assert drain.in_flight == 0


class Stuck(Actor):
    """A scheduler that takes each request and starts none until the test lets it: its
    mailbox fills up behind the first."""

    def __init__(self, gate: asyncio.Event) -> None:
        self.gate = gate

    async def handle(self, msg: Any) -> Any:
        assert isinstance(msg, AddRequest)
        reply = self.take_reply()
        await self.gate.wait()
        reply.send(RequestFinished(request_id=msg.request_id, finish_reason="stop",
                                   usage=Usage(prompt_tokens=len(msg.prompt_tokens),
                                               completion_tokens=0)))
        reply.close()


async def test_a_full_queue_answers_429_with_the_estimate(aiohttp_client: Any,
                                                          tiny_model_dir: Path) -> None:
    gate = asyncio.Event()
    system = ActorSystem()
    await system.__aenter__()
    try:
        scheduler = await system.spawn(Stuck, name="scheduler", mailbox_size=2, gate=gate)
        card = ModelCard(id="tiny", context_length=2048, source="local",
                         path=str(tiny_model_dir))
        admission = await system.spawn(Admission, name="admission", thread="admission",
                                       models=[(card, scheduler)], pool=None)
        client = await aiohttp_client(create_app(system=system, admission=admission,
                                                 config=ServeConfig()))
        actor: Admission = admission._cell.instance  # type: ignore[assignment]
        body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 4}

        async def post() -> Any:
            resp = await client.post("/v1/completions", json=body)
            await resp.read()
            return resp

        # One request taken by the scheduler, two queued behind it: its mailbox is full.
        held = []
        for n in range(1, 4):
            held.append(asyncio.ensure_future(post()))
            for _ in range(1000):
                if actor.report()["in_flight"]["tiny"] == n:
                    break
                await asyncio.sleep(0.01)
            assert actor.report()["in_flight"]["tiny"] == n
        refused = await post()
        assert refused.status == 429
        assert (await refused.json())["error"]["code"] == "queue_full"
        estimate = actor.report()["last_retry_after_s"]
        # Three in flight and none finished: at least three seconds, not the old constant 1.
        assert estimate >= 3.0
        assert refused.headers["Retry-After"] == str(math.ceil(estimate))

        gate.set()
        assert [r.status for r in await asyncio.gather(*held)] == [200, 200, 200]
        for _ in range(1000):
            if actor.report()["in_flight"]["tiny"] == 0:
                break
            await asyncio.sleep(0.01)
        assert actor.report()["in_flight"]["tiny"] == 0
    finally:
        await system.__aexit__(None, None, None)


def test_a_schedulers_pace_counts_finishes_since_it_got_busy_within_the_window() -> None:
    now = [100.0]
    pace = FinishPace(clock=lambda: now[0])
    pace.busy()
    now[0] = 104.0
    for _ in range(4):
        pace.finished()
    now[0] = 108.0  # 4 finished in the 8 s since it got busy: one every 2 s
    assert pace.retry_after(10) == 20.0
    now[0] = 108.0 + DRAIN_WINDOW_S + 1  # those finishes left the window: at best 1 a window
    assert pace.retry_after(10) == RETRY_AFTER_MAX_S


def test_failure_of_relays_the_schedulers_retry_after() -> None:
    from troupe.api.generation import failure_of

    full = RequestFinished(request_id="r", finish_reason="error", error="queue full",
                           error_kind="overloaded", retry_after=12.5,
                           usage=Usage(prompt_tokens=1, completion_tokens=0))
    assert failure_of(full).retry_after == 12.5
