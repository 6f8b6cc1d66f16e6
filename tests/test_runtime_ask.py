"""ask: the handler's value or exception comes back to the asker; timeouts never leak."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import anyio
import pytest

from runtime import Actor, ActorSystem, AskTimeout, Message


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
