"""Introspection: a JSON-encodable snapshot of every actor, its own report included."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import msgspec
import pytest

from troupe.runtime import Actor, ActorSnapshot, ActorSystem, Message, Restart


class Hit(Message):
    fail: bool = False


class Reporter(Actor):
    def __init__(self, label: str) -> None:
        self.label = label
        self.hits = 0

    async def handle(self, msg: Any) -> Any:
        self.hits += 1
        if msg.fail:
            raise ArithmeticError("bad sum")

    def report(self) -> dict[str, Any]:
        return {"label": self.label, "hits": self.hits}


class Silent(Actor):
    async def handle(self, msg: Any) -> Any:
        return None


class BrokenReport(Silent):
    def report(self) -> dict[str, Any]:
        raise ValueError("oops")


async def test_snapshot_shows_every_field_per_actor_and_encodes_to_json() -> None:
    async with ActorSystem() as system:
        rep = await system.spawn(
            Reporter, name="rep", mailbox_size=8, thread="io", group="g",
            restart=Restart.PERMANENT, label="L",
        )
        await system.spawn(Silent, name="silent")
        await rep.tell(Hit(fail=True))
        await rep.ask(Hit())
        rep_snap, silent_snap = system.snapshot()

    assert rep_snap == ActorSnapshot(
        name="rep",
        actor_class=f"{__name__}.Reporter",
        state="running",
        thread="io",
        group="g",
        restart="permanent",
        mailbox_depth=0,
        mailbox_capacity=8,
        waiting_senders=0,
        messages_handled=2,
        restarts=1,
        last_error=rep_snap.last_error,
        report={"label": "L", "hits": 1},  # the fresh instance's count
    )
    assert rep_snap.last_error is not None
    assert (rep_snap.last_error.type, rep_snap.last_error.message) == (
        "ArithmeticError", "bad sum",
    )
    assert silent_snap.report is None
    assert silent_snap.thread is None and silent_snap.last_error is None

    decoded = msgspec.json.decode(msgspec.json.encode([rep_snap, silent_snap]))
    assert decoded[0]["last_error"] == {"type": "ArithmeticError", "message": "bad sum"}
    assert decoded[0]["report"] == {"label": "L", "hits": 1}
    assert decoded[1]["state"] == "running"


async def test_stopped_and_failed_actors_stay_visible_with_their_final_state() -> None:
    async with ActorSystem() as system:
        stopped = await system.spawn(Reporter, name="stopped", label="s")
        failed = await system.spawn(
            Reporter, name="failed", label="f", restart=Restart.TEMPORARY
        )
        await system.stop(stopped)
        await failed.tell(Hit(fail=True))
        while failed.alive:
            await asyncio.sleep(0.001)
        states = {s.name: (s.state, s.report) for s in system.snapshot()}
    assert states == {"stopped": ("stopped", None), "failed": ("failed", None)}


async def test_a_report_that_raises_shows_its_error_instead_of_breaking_the_snapshot() -> None:
    async with ActorSystem() as system:
        await system.spawn(BrokenReport, name="broken")
        (snap,) = system.snapshot()
    assert snap.report == {"report_error": "ValueError('oops')"}


@pytest.mark.parametrize("thread", [None, "pinned"])
async def test_the_snapshot_shows_a_starting_actor_as_starting(thread: str | None) -> None:
    gate, thread_gate = asyncio.Event(), threading.Event()

    class SlowStart(Silent):
        async def on_start(self) -> None:
            if thread is None:
                await gate.wait()
            else:
                thread_gate.wait(5)  # blocks the pinned thread only

    async with ActorSystem() as system:
        spawning = asyncio.create_task(system.spawn(SlowStart, name="slow", thread=thread))
        while not system.snapshot():
            await asyncio.sleep(0)
        assert system.snapshot()[0].state == "starting"
        gate.set()
        thread_gate.set()
        await spawning
        assert system.snapshot()[0].state == "running"
