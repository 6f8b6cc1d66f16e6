"""Mailboxes: one message at a time, in order; bounded, with backpressure and admission control."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import msgspec
import pytest

from troupe.runtime import Actor, ActorSystem, MailboxFull, Message


class Note(Message):
    n: int


class Overlap(Actor):
    """Records the order of messages and whether two handle calls ever overlapped."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.active = 0
        self.max_active = 0

    async def handle(self, msg: Any) -> Any:
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        await asyncio.sleep(0)  # a handler that awaits must still not let the next one in
        self.seen.append(msg.n)
        self.active -= 1
        return (list(self.seen), self.max_active)


class Gate(Actor):
    """Blocks in handle until the test opens the gate."""

    def __init__(self, entered: asyncio.Event, gate: asyncio.Event) -> None:
        self.entered = entered
        self.gate = gate

    async def handle(self, msg: Any) -> Any:
        self.entered.set()
        await self.gate.wait()
        return msg.n


async def wait_for(predicate: Any) -> None:
    while not predicate():
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("thread", [None, "pinned"])
async def test_messages_from_one_sender_are_handled_in_order_one_at_a_time(
    thread: str | None,
) -> None:
    with anyio.fail_after(5):
        async with ActorSystem() as system:
            ref = await system.spawn(Overlap, name="overlap", thread=thread, mailbox_size=8)
            for n in range(100):
                await ref.tell(Note(n=n))
            seen, max_active = await ref.ask(Note(n=100))
    assert seen == list(range(101))
    assert max_active == 1


async def test_full_mailbox_makes_tell_wait_and_try_tell_raise_and_shows_in_snapshot() -> None:
    entered, gate = asyncio.Event(), asyncio.Event()
    with anyio.fail_after(5):
        async with ActorSystem() as system:
            ref = await system.spawn(
                Gate, name="gate", mailbox_size=2, entered=entered, gate=gate
            )
            await ref.tell(Note(n=0))
            await entered.wait()  # the first message is being handled: the mailbox is empty
            await ref.tell(Note(n=1))
            ref.try_tell(Note(n=2))
            with pytest.raises(MailboxFull):
                ref.try_tell(Note(n=3))
            blocked = asyncio.create_task(ref.tell(Note(n=4)))
            await wait_for(lambda: system.snapshot()[0].waiting_senders == 1)
            assert not blocked.done()

            snap = system.snapshot()[0]
            assert (snap.mailbox_depth, snap.mailbox_capacity, snap.waiting_senders) == (2, 2, 1)

            gate.set()
            await blocked
            assert await ref.ask(Note(n=5)) == 5
            assert system.snapshot()[0].messages_handled == 5


async def test_anything_but_a_msgspec_struct_is_refused_with_type_error() -> None:
    class Plain(msgspec.Struct):
        x: int = 1

    async with ActorSystem() as system:
        ref = await system.spawn(Overlap, name="overlap")
        for bad in ({"n": 1}, "n", 1):
            with pytest.raises(TypeError):
                await ref.tell(bad)  # type: ignore[arg-type]
            with pytest.raises(TypeError):
                ref.try_tell(bad)  # type: ignore[arg-type]
            with pytest.raises(TypeError):
                await ref.ask(bad)  # type: ignore[arg-type]
            with pytest.raises(TypeError):
                await ref.stream(bad)  # type: ignore[arg-type]
        ref.try_tell(Plain())  # any Struct will do, not only Message subclasses


def test_messages_are_tagged_by_lowercase_class_name() -> None:
    assert msgspec.json.encode(Note(n=1)) == b'{"kind":"note","n":1}'
    assert msgspec.json.decode(b'{"kind":"note","n":2}', type=Note) == Note(n=2)
