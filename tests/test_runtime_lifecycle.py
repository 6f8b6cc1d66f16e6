"""Spawning, stopping and killing: start before serve, drain before stop, never hang."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import anyio
import pytest

from troupe.runtime import Actor, ActorDead, ActorSystem, Message


class Job(Message):
    n: int


class Slow(Actor):
    """on_start takes a while; handle waits at the gate, then records the job."""

    def __init__(self, log: list[Any], gate: asyncio.Event | None = None) -> None:
        self.log = log
        self.gate = gate
        self.ready = False

    async def on_start(self) -> None:
        await asyncio.sleep(0.01)
        self.ready = True

    async def handle(self, msg: Any) -> Any:
        if self.gate is not None:
            await self.gate.wait()
        self.log.append((self.name, msg.n))
        return self.ready

    async def on_stop(self, error: BaseException | None) -> None:
        self.log.append((self.name, "stop"))


class BadStart(Actor):
    async def on_start(self) -> None:
        raise ConnectionError("no model here")


async def wait_for(predicate: Any) -> None:
    while not predicate():
        await asyncio.sleep(0.001)


async def test_spawn_returns_only_after_on_start_finished() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Slow, name="slow", log=[])
        assert system.snapshot()[0].state == "running"
        assert await ref.ask(Job(n=0)) is True


@pytest.mark.parametrize("thread", [None, "pinned"])
async def test_a_failing_on_start_fails_spawn_and_leaves_no_actor(thread: str | None) -> None:
    async with ActorSystem() as system:
        with pytest.raises(ConnectionError, match="no model here"):
            await system.spawn(BadStart, name="bad", thread=thread)
        assert system.find("bad") is None
        assert system.snapshot() == []
        with pytest.raises(KeyError, match="no actor named 'bad'"):
            system.get("bad")
        await system.spawn(Slow, name="bad", log=[])  # the name is free


async def test_stop_handles_what_is_queued_before_on_stop() -> None:
    log: list[Any] = []
    gate = asyncio.Event()
    with anyio.fail_after(5):
        async with ActorSystem() as system:
            ref = await system.spawn(Slow, name="a", log=log, gate=gate)
            for n in range(3):
                await ref.tell(Job(n=n))
            stopping = asyncio.create_task(system.stop(ref))
            await asyncio.sleep(0)  # the stop task runs up to waiting for the drain
            with pytest.raises(ActorDead):
                await ref.tell(Job(n=99))  # refused once the stop began
            gate.set()
            await stopping
            assert log == [("a", 0), ("a", 1), ("a", 2), ("a", "stop")]
            assert system.snapshot()[0].state == "stopped"


async def test_leaving_the_system_stops_actors_in_reverse_start_order() -> None:
    log: list[Any] = []
    async with ActorSystem() as system:
        for name in ("first", "second", "third"):
            await system.spawn(Slow, name=name, log=log)
    assert log == [("third", "stop"), ("second", "stop"), ("first", "stop")]


async def test_tell_and_ask_to_a_stopped_actor_raise_actor_dead() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Slow, name="a", log=[])
        await system.stop(ref)
        assert not ref.alive
        with pytest.raises(ActorDead):
            await ref.tell(Job(n=1))
        with pytest.raises(ActorDead):
            ref.try_tell(Job(n=1))
        with pytest.raises(ActorDead):
            await ref.ask(Job(n=1), timeout=5.0)
        with pytest.raises(ActorDead):
            await ref.stream(Job(n=1))


async def test_kill_fails_the_running_and_queued_asks_with_actor_dead() -> None:
    log: list[Any] = []
    gate = asyncio.Event()  # never opened: the handler is stuck
    with anyio.fail_after(5):
        async with ActorSystem() as system:
            ref = await system.spawn(Slow, name="stuck", log=log, gate=gate, mailbox_size=2)
            asks = [asyncio.create_task(ref.ask(Job(n=n))) for n in range(4)]
            await wait_for(lambda: system.snapshot()[0].waiting_senders == 1)
            await system.kill(ref)
            for ask in asks:
                with pytest.raises(ActorDead):
                    await ask
            assert system.snapshot()[0].state == "stopped"
    assert log == []  # no drain, no on_stop


async def test_kill_of_a_pinned_actor_stuck_in_its_thread_returns_at_once() -> None:
    release = threading.Event()

    class Stuck(Actor):
        async def handle(self, msg: Any) -> Any:
            release.wait(5)  # blocks the pinned thread, not the event loop

    with anyio.fail_after(5):
        async with ActorSystem() as system:
            ref = await system.spawn(Stuck, name="stuck", thread="worker")
            ask = asyncio.create_task(ref.ask(Job(n=1)))
            await asyncio.sleep(0.01)
            await system.kill(ref)
            with pytest.raises(ActorDead):
                await ask
            release.set()


async def test_an_error_in_on_stop_is_logged_and_shutdown_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log: list[Any] = []

    class BadStop(Actor):
        async def on_stop(self, error: BaseException | None) -> None:
            raise OSError("disk gone")

    async with ActorSystem() as system:
        await system.spawn(Slow, name="first", log=log)
        await system.spawn(BadStop, name="bad")
    assert log == [("first", "stop")]
    assert [s.state for s in system.snapshot()] == ["stopped", "stopped"]
    assert any(
        r.name == "runtime" and "on_stop failed" in r.getMessage() and r.exc_info
        for r in caplog.records
    )


async def test_a_running_name_cannot_be_spawned_twice_but_a_stopped_one_can() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Slow, name="a", log=[])
        with pytest.raises(ValueError, match="already running"):
            await system.spawn(Slow, name="a", log=[])
        await system.stop(ref)
        assert [(s.name, s.state) for s in system.snapshot()] == [("a", "stopped")]
        again = await system.spawn(Slow, name="a", log=[])
        assert again is not ref
        assert system.get("a") is again
        assert [(s.name, s.state) for s in system.snapshot()] == [("a", "running")]
        with pytest.raises(ActorDead):
            await ref.tell(Job(n=1))  # the old ref still points at the old, stopped actor


async def test_spawn_after_the_system_stopped_is_refused() -> None:
    async with ActorSystem() as system:
        pass
    with pytest.raises(RuntimeError, match="stopped"):
        await system.spawn(Slow, name="late", log=[])


async def test_leaving_the_system_joins_the_pinned_threads() -> None:
    async with ActorSystem() as system:
        await system.spawn(Slow, name="a", log=[], thread="pinned-a")
        await system.spawn(Slow, name="b", log=[], thread="pinned-b")
        assert {"pinned-a", "pinned-b"} <= {t.name for t in threading.enumerate()}
    assert not {"pinned-a", "pinned-b"} & {t.name for t in threading.enumerate()}


async def test_the_runtime_logs_nothing_for_a_clean_run(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="runtime")
    async with ActorSystem() as system:
        ref = await system.spawn(Slow, name="a", log=[], thread="pinned")
        await ref.ask(Job(n=1))
    assert caplog.records == []
