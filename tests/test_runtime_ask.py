"""ask: the handler's value or exception comes back to the asker; timeouts never leak."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import anyio
import pytest

from troupe.runtime import Actor, ActorDead, ActorSystem, AskTimeout, Message


class Double(Message):
    n: int


class Fail(Message):
    reason: str


class Slow(Message):
    fail: bool = False


class Calc(Actor):
    def __init__(self, gate: asyncio.Event | None = None) -> None:
        self.gate = gate

    async def handle(self, msg: Any) -> Any:
        match msg:
            case Double(n=n):
                return (2 * n, id(self))
            case Fail(reason=reason):
                raise KeyError(reason)
            case Slow(fail=fail):
                assert self.gate is not None
                await self.gate.wait()
                if fail:
                    raise RuntimeError("late failure")
                return "late"
        return None


@pytest.mark.parametrize("thread", [None, "pinned"])
async def test_ask_returns_the_handlers_value(thread: str | None) -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Calc, name="calc", thread=thread)
        value, _ = await ref.ask(Double(n=21), timeout=5.0)
        assert value == 42


@pytest.mark.parametrize("thread", [None, "pinned"])
async def test_an_error_in_ask_reaches_the_asker_and_the_actor_keeps_running(
    thread: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="runtime")
    with anyio.fail_after(5):
        async with ActorSystem() as system:
            ref = await system.spawn(Calc, name="calc", thread=thread)
            _, before = await ref.ask(Double(n=1))
            with pytest.raises(KeyError, match="no such thing"):
                await ref.ask(Fail(reason="no such thing"))
            _, after = await ref.ask(Double(n=1))
            snap = system.snapshot()[0]
            # Same instance, no restart, nothing for the supervisor.
            assert after == before
            assert snap.state == "running"
            assert snap.restarts == 0
            assert snap.last_error is None
    assert not caplog.records


@pytest.mark.parametrize("fail", [False, True])
async def test_ask_timeout_raises_ask_timeout_and_the_late_reply_is_dropped_quietly(
    fail: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    loop_errors: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, ctx: loop_errors.append(ctx))
    gate = asyncio.Event()
    with anyio.fail_after(5):
        async with ActorSystem() as system:
            ref = await system.spawn(Calc, name="calc", gate=gate)
            with pytest.raises(AskTimeout) as info:
                await ref.ask(Slow(fail=fail), timeout=0.05)
            assert isinstance(info.value, TimeoutError)
            gate.set()
            value, _ = await ref.ask(Double(n=2))  # handled after the late reply was made
            assert value == 4
            assert system.snapshot()[0].messages_handled == 2
    assert loop_errors == []
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_a_timeout_error_raised_by_the_handler_is_not_an_ask_timeout() -> None:
    class Raises(Actor):
        async def handle(self, msg: Any) -> Any:
            raise TimeoutError("the handler's own")

    async with ActorSystem() as system:
        ref = await system.spawn(Raises, name="raises")
        with pytest.raises(TimeoutError, match="the handler's own") as info:
            await ref.ask(Double(n=1), timeout=5.0)
        assert not isinstance(info.value, AskTimeout)


# --- an answer given later (ActorCell.take_answer) -------------------------------------------


class Later(Message):
    key: str
    fail: bool = False


class Now(Message):
    pass


class Deferring(Actor):
    """Takes the answer of each ``Later`` and gives it when the test opens its gate, from a
    task on its own loop; answers ``Now`` at once, meanwhile."""

    def __init__(self) -> None:
        self.gates: dict[str, asyncio.Event] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    async def handle(self, msg: Any) -> Any:
        match msg:
            case Later(key=key, fail=fail):
                answer = self._cell.take_answer()
                assert self._cell.take_answer() is answer  # the same one, however often taken
                gate = self.gates[key] = asyncio.Event()
                task = asyncio.get_running_loop().create_task(self.give(answer, key, fail, gate))
                self.tasks.add(task)
                return "ignored: the answer was taken"
            case Now():
                return "now"
        return None

    async def give(self, answer: Any, key: str, fail: bool, gate: asyncio.Event) -> None:
        await gate.wait()
        if fail:
            answer.fail(LookupError(f"{key} failed"))
        elif key == "none":
            answer.close()
        else:
            assert answer.send(f"{key}:{threading.current_thread().name}")
            assert not answer.send("twice")  # the first answer stands

    def open(self, key: str) -> None:
        """Any thread: open one gate on the actor's own loop."""
        gate = self.gates[key]
        gate._loop.call_soon_threadsafe(gate.set)  # type: ignore[attr-defined]


async def _wait_for(predicate: Any) -> None:
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


@pytest.mark.parametrize("thread", [None, "pinned"])
async def test_a_taken_answer_lets_the_actor_handle_the_next_message_and_answers_later(
    thread: str | None,
) -> None:
    with anyio.fail_after(10):
        async with ActorSystem() as system:
            ref = await system.spawn(Deferring, name="later", thread=thread)
            actor: Deferring = ref._cell.instance  # type: ignore[assignment]
            first = asyncio.ensure_future(ref.ask(Later(key="a")))
            second = asyncio.ensure_future(ref.ask(Later(key="b")))
            # Both handled (their answers taken) while neither is answered: no head of line.
            await _wait_for(lambda: set(actor.gates) == {"a", "b"})
            assert await ref.ask(Now()) == "now"
            assert not first.done() and not second.done()
            actor.open("b")
            expected = "pinned" if thread else threading.current_thread().name
            assert await second == f"b:{expected}"
            assert not first.done()
            actor.open("a")
            assert await first == f"a:{expected}"
            assert not ref._cell._open_replies


async def test_a_taken_answer_can_fail_the_ask_or_answer_none() -> None:
    with anyio.fail_after(10):
        async with ActorSystem() as system:
            ref = await system.spawn(Deferring, name="later", thread="pinned")
            actor: Deferring = ref._cell.instance  # type: ignore[assignment]
            failing = asyncio.ensure_future(ref.ask(Later(key="x", fail=True)))
            empty = asyncio.ensure_future(ref.ask(Later(key="none")))
            await _wait_for(lambda: set(actor.gates) == {"x", "none"})
            actor.open("x")
            actor.open("none")
            with pytest.raises(LookupError, match="x failed"):
                await failing
            assert await empty is None
            assert system.snapshot()[0].state == "running"


async def test_an_answer_still_open_when_the_actor_stops_fails_with_actor_dead() -> None:
    with anyio.fail_after(10):
        async with ActorSystem() as system:
            ref = await system.spawn(Deferring, name="later", thread="pinned")
            pending = asyncio.ensure_future(ref.ask(Later(key="never")))
            actor: Deferring = ref._cell.instance  # type: ignore[assignment]
            await _wait_for(lambda: "never" in actor.gates)
            await system.stop(ref)
            with pytest.raises(ActorDead):
                await pending


async def test_a_handler_that_raises_after_taking_the_answer_fails_the_ask() -> None:
    class TakesThenRaises(Actor):
        async def handle(self, msg: Any) -> Any:
            self._cell.take_answer()
            raise KeyError("after taking")

    async with ActorSystem() as system:
        ref = await system.spawn(TakesThenRaises, name="raises", thread="pinned")
        with pytest.raises(KeyError, match="after taking"):
            await ref.ask(Now(), timeout=5.0)
        assert not ref._cell._open_replies  # failed through the answer: nothing left open


async def test_take_answer_outside_an_ask_raises_runtime_error() -> None:
    errors: list[str] = []

    class Taker(Actor):
        async def handle(self, msg: Any) -> Any:
            try:
                self._cell.take_answer()
            except RuntimeError as exc:
                errors.append(str(exc))

    async with ActorSystem() as system:
        ref = await system.spawn(Taker, name="t")
        await ref.tell(Now())
        stream = await ref.stream(Now())
        assert [x async for x in stream] == []
        assert len(errors) == 2 and all("not sent with ask" in e for e in errors)
