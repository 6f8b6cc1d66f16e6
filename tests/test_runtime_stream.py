"""Streamed replies: one request, many items, in order; nobody waits forever."""

from __future__ import annotations

import asyncio
import gc
import threading
from typing import Any

import anyio
import pytest

from troupe.runtime import Actor, ActorDead, ActorSystem, MailboxFull, Message, Reply


class Count(Message):
    to: int


class Open(Message):
    """Take the reply and keep it open."""


class Push(Message):
    item: Any


class Finish(Message):
    pass


class Crash(Message):
    pass


class Plain(Message):
    value: Any = None
    fail: bool = False


class Streamer(Actor):
    """Counts into a stream, or keeps a taken reply for later messages to feed."""

    def __init__(self) -> None:
        self.held: Reply | None = None
        self.sent: list[bool] = []

    async def handle(self, msg: Any) -> Any:
        match msg:
            case Count(to=to):
                reply = self.take_reply()
                for n in range(to):
                    reply.send(n)
                reply.close()
            case Open():
                self.held = self.take_reply()
            case Push(item=item):
                assert self.held is not None
                self.sent.append(self.held.send(item))
                return self.sent
            case Finish():
                assert self.held is not None
                self.held.close()
            case Crash():
                raise ValueError("crash")
            case Plain(value=value, fail=fail):
                if fail:
                    raise LookupError("plain failure")
                return value
        return None


@pytest.mark.parametrize("thread", [None, "pinned"])
async def test_streamed_items_arrive_in_order_and_close_ends_iteration(
    thread: str | None,
) -> None:
    with anyio.fail_after(5):
        async with ActorSystem() as system:
            ref = await system.spawn(Streamer, name="s", thread=thread)
            stream = await ref.stream(Count(to=500))
            assert [item async for item in stream] == list(range(500))
            stream = ref.try_stream(Count(to=2))
            assert await stream.next() == 0
            assert await stream.next() == 1
            with pytest.raises(StopAsyncIteration):
                await stream.next()


async def test_a_reply_kept_after_handle_feeds_the_stream_from_later_messages() -> None:
    with anyio.fail_after(5):
        async with ActorSystem() as system:
            ref = await system.spawn(Streamer, name="s")
            stream = await ref.stream(Open())
            for item in ("a", "b"):
                await ref.tell(Push(item=item))
            assert await stream.next() == "a"
            await ref.tell(Finish())
            assert [item async for item in stream] == ["b"]


async def test_a_consumer_leaving_makes_send_return_false() -> None:
    with anyio.fail_after(5):
        async with ActorSystem() as system:
            ref = await system.spawn(Streamer, name="s")
            async with await ref.stream(Open()) as stream:
                assert await ref.ask(Push(item=1)) == [True]
                assert await stream.next() == 1
            assert await ref.ask(Push(item=2)) == [True, False]


async def test_dropping_the_stream_counts_as_leaving() -> None:
    with anyio.fail_after(5):
        async with ActorSystem() as system:
            ref = await system.spawn(Streamer, name="s")
            stream = await ref.stream(Open())
            del stream
            gc.collect()
            assert await ref.ask(Push(item=1)) == [False]


@pytest.mark.parametrize("end", ["restart", "stop", "kill"])
async def test_replies_left_open_by_an_actor_that_ends_fail_with_actor_dead(end: str) -> None:
    with anyio.fail_after(5):
        async with ActorSystem() as system:
            ref = await system.spawn(Streamer, name="s", thread="pinned")
            stream = await ref.stream(Open())
            await ref.ask(Push(item="before"))
            if end == "restart":
                await ref.tell(Crash())
            elif end == "stop":
                await system.stop(ref)
            else:
                await system.kill(ref)
            assert await stream.next() == "before"
            with pytest.raises(ActorDead):
                await stream.next()


async def test_a_stream_whose_handler_did_not_take_the_reply_gets_the_return_value() -> None:
    with anyio.fail_after(5):
        async with ActorSystem() as system:
            ref = await system.spawn(Streamer, name="s")
            assert [x async for x in await ref.stream(Plain(value={"v": 1}))] == [{"v": 1}]
            assert [x async for x in await ref.stream(Plain(value=None))] == []
            stream = await ref.stream(Plain(fail=True))
            with pytest.raises(LookupError, match="plain failure"):
                await stream.next()
            snap = system.snapshot()[0]
            assert (snap.state, snap.restarts) == ("running", 0)  # the consumer had the error


async def test_take_reply_outside_a_streamed_message_raises_runtime_error() -> None:
    class Taker(Actor):
        async def handle(self, msg: Any) -> Any:
            self.take_reply()

    async with ActorSystem() as system:
        ref = await system.spawn(Taker, name="t")
        with pytest.raises(RuntimeError, match="not sent with stream"):
            await ref.ask(Plain())


async def test_a_pinned_actor_sends_from_its_own_thread_after_handle_returned() -> None:
    class Background(Actor):
        """Hands the reply to a task on its own loop that sends after handle returned."""

        async def handle(self, msg: Any) -> Any:
            reply = self.take_reply()
            self.task = asyncio.get_running_loop().create_task(self.feed(reply))

        async def feed(self, reply: Reply) -> None:
            for _ in range(3):
                await asyncio.sleep(0.001)
                reply.send(threading.current_thread().name)
            reply.close()

    with anyio.fail_after(5):
        async with ActorSystem() as system:
            ref = await system.spawn(Background, name="bg", thread="mlx")
            stream = await ref.stream(Open())
            assert [x async for x in stream] == ["mlx", "mlx", "mlx"]


async def test_a_stream_can_be_read_on_another_thread_than_it_was_made_on() -> None:
    """A pinned actor calls try_stream; the event loop reads the stream (admission does this)."""

    class Middle(Actor):
        def __init__(self, target: Any) -> None:
            self.target = target

        async def handle(self, msg: Any) -> Any:
            return self.target.try_stream(Count(to=3))

    with anyio.fail_after(5):
        async with ActorSystem() as system:
            streamer = await system.spawn(Streamer, name="s", thread="mlx")
            middle = await system.spawn(Middle, name="m", thread="admission", target=streamer)
            stream = await middle.ask(Plain())
            assert [x async for x in stream] == [0, 1, 2]


async def test_try_stream_raises_mailbox_full_at_once() -> None:
    entered, gate = asyncio.Event(), asyncio.Event()

    class Stuck(Actor):
        async def handle(self, msg: Any) -> Any:
            entered.set()
            await gate.wait()

    with anyio.fail_after(5):
        async with ActorSystem() as system:
            ref = await system.spawn(Stuck, name="stuck", mailbox_size=1)
            try:
                first = ref.try_stream(Plain())
                await entered.wait()
                second = ref.try_stream(Plain())  # fills the mailbox
                with pytest.raises(MailboxFull):
                    ref.try_stream(Plain())
            finally:
                gate.set()
            assert [x async for x in first] == [] and [x async for x in second] == []
