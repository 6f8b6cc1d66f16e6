"""Supervision: errors in tell go to the supervisor, which restarts per policy and budget."""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

import anyio
import pytest

from troupe.runtime import Actor, ActorDead, ActorSystem, Message, Restart
from troupe.runtime.supervision import RestartBudget


class Crash(Message):
    reason: str = "crash"


class Who(Message):
    pass


class QuitSelf(Message):
    pass


class Worker(Actor):
    """Writes its lifecycle into ``events`` as (name, instance number, what, detail)."""

    instances = itertools.count(1)

    def __init__(self, events: list[tuple[str, int, str, Any]], tag: str) -> None:
        self.events = events
        self.tag = tag
        self.number = next(Worker.instances)

    def _log(self, what: str, detail: Any = None) -> None:
        self.events.append((self.name, self.number, what, detail))

    async def on_start(self) -> None:
        self._log("start", self.tag)

    async def handle(self, msg: Any) -> Any:
        match msg:
            case Crash(reason=reason):
                raise ValueError(reason)
            case Who():
                self._log("who")
                return self.number
            case QuitSelf():
                await self.system.stop(self.ref)
        return None

    async def on_stop(self, error: BaseException | None) -> None:
        self._log("stop", None if error is None else repr(error))


def what(events: list[tuple[str, int, str, Any]], name: str) -> list[tuple[int, str, Any]]:
    return [(n, w, d) for actor, n, w, d in events if actor == name]


async def wait_for(predicate: Any) -> None:
    while not predicate():
        await asyncio.sleep(0.001)


def state(system: ActorSystem, name: str) -> Any:
    return next(s for s in system.snapshot() if s.name == name)


@pytest.mark.parametrize("policy", [Restart.TRANSIENT, Restart.PERMANENT])
@pytest.mark.parametrize("thread", [None, "pinned"])
async def test_an_error_in_tell_restarts_a_fresh_instance_with_the_same_ref_and_mailbox(
    policy: Restart, thread: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    events: list[tuple[str, int, str, Any]] = []
    with anyio.fail_after(5):
        async with ActorSystem() as system:
            ref = await system.spawn(
                Worker, name="w", restart=policy, thread=thread, events=events, tag="kw"
            )
            first = await ref.ask(Who())
            # Both queued before the crash is handled: the message behind it must survive.
            await ref.tell(Crash(reason="boom"))
            await ref.tell(Who())
            second = await ref.ask(Who())
            assert second != first
            assert system.get("w") is ref
            snap = state(system, "w")
            assert (snap.state, snap.restarts) == ("running", 1)
            assert snap.last_error is not None
            assert (snap.last_error.type, snap.last_error.message) == ("ValueError", "boom")
    assert what(events, "w") == [
        (first, "start", "kw"),
        (first, "who", None),
        (first, "stop", "ValueError('boom')"),
        (second, "start", "kw"),  # constructed again with the same init kwargs
        (second, "who", None),
        (second, "who", None),
        (second, "stop", None),
    ]
    assert any("'w' failed handling a message" in r.getMessage() for r in caplog.records)


async def test_a_temporary_actor_is_not_restarted_and_ends_failed() -> None:
    events: list[tuple[str, int, str, Any]] = []
    with anyio.fail_after(5):
        async with ActorSystem() as system:
            ref = await system.spawn(
                Worker, name="w", restart=Restart.TEMPORARY, events=events, tag="t"
            )
            await ref.tell(Crash())
            await wait_for(lambda: not ref.alive)
            assert state(system, "w").state == "failed"
            with pytest.raises(ActorDead):
                await ref.ask(Who())
    assert [w for _, w, _ in what(events, "w")] == ["start", "stop"]


@pytest.mark.parametrize(
    ("policy", "restarts"), [(Restart.PERMANENT, True), (Restart.TRANSIENT, False)]
)
@pytest.mark.parametrize("thread", [None, "pinned"])
async def test_only_a_permanent_actor_restarts_after_stopping_itself(
    policy: Restart, restarts: bool, thread: str | None
) -> None:
    events: list[tuple[str, int, str, Any]] = []
    with anyio.fail_after(5):
        async with ActorSystem() as system:
            ref = await system.spawn(
                Worker, name="w", restart=policy, thread=thread, events=events, tag="p"
            )
            await ref.ask(QuitSelf())  # returns: stopping itself must not wait for itself
            if restarts:
                await ref.ask(Who())
                assert state(system, "w").restarts == 1
            else:
                await wait_for(lambda: not ref.alive)
                assert state(system, "w").state == "stopped"


async def test_an_actor_stopped_from_outside_is_never_restarted() -> None:
    events: list[tuple[str, int, str, Any]] = []
    async with ActorSystem() as system:
        ref = await system.spawn(
            Worker, name="w", restart=Restart.PERMANENT, events=events, tag="p"
        )
        await system.stop(ref)
        assert state(system, "w").state == "stopped"
        assert state(system, "w").restarts == 0


async def test_an_actor_that_keeps_failing_exhausts_its_budget_and_is_marked_failed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    events: list[tuple[str, int, str, Any]] = []
    with anyio.fail_after(5):
        async with ActorSystem() as system:
            ref = await system.spawn(
                Worker, name="w", restart=Restart.PERMANENT, max_restarts=2,
                restart_window=60.0, events=events, tag="b",
            )
            for n in range(3):
                await ref.tell(Crash(reason=f"crash {n}"))
            await wait_for(lambda: not ref.alive)
            snap = state(system, "w")
            assert (snap.state, snap.restarts) == ("failed", 2)
            assert snap.last_error is not None and snap.last_error.message == "crash 2"
            with pytest.raises(ActorDead):
                await ref.tell(Who())
    assert [w for _, w, _ in what(events, "w")] == ["start", "stop"] * 3
    assert any("more than 2 restarts" in r.getMessage() for r in caplog.records)


async def test_a_restart_that_fails_in_on_start_is_retried_within_the_budget() -> None:
    starts: list[int] = []

    class Flaky(Actor):
        async def on_start(self) -> None:
            starts.append(len(starts))
            if len(starts) in (2, 3):  # the first restart attempts fail
                raise OSError("not yet")

        async def handle(self, msg: Any) -> Any:
            if isinstance(msg, Crash):
                raise ValueError("crash")
            return len(starts)

    with anyio.fail_after(5):
        async with ActorSystem() as system:
            ref = await system.spawn(Flaky, name="f", max_restarts=5)
            await ref.tell(Crash())
            assert await ref.ask(Who()) == 4
            snap = state(system, "f")
            assert (snap.state, snap.restarts) == ("running", 1)


async def test_group_members_restart_together() -> None:
    events: list[tuple[str, int, str, Any]] = []
    with anyio.fail_after(5):
        async with ActorSystem() as system:
            index = await system.spawn(
                Worker, name="index", group="kv", events=events, tag="i"
            )
            sched = await system.spawn(
                Worker, name="sched", group="kv", thread="mlx", events=events, tag="s"
            )
            await system.spawn(Worker, name="other", events=events, tag="o")
            old_index = await index.ask(Who())
            await sched.tell(Crash(reason="kv lost"))
            await wait_for(lambda: state(system, "index").restarts == 1)
            assert await index.ask(Who()) != old_index
            assert state(system, "sched").restarts == 1
            assert state(system, "other").restarts == 0
    index_events = what(events, "index")
    assert index_events[2] == (old_index, "stop", "ValueError('kv lost')")
    assert [w for _, w, _ in what(events, "other")] == ["start", "stop"]


async def test_when_a_group_member_fails_for_good_its_mates_are_stopped() -> None:
    events: list[tuple[str, int, str, Any]] = []
    with anyio.fail_after(5):
        async with ActorSystem() as system:
            mate = await system.spawn(Worker, name="mate", group="g", events=events, tag="m")
            ref = await system.spawn(
                Worker, name="w", group="g", max_restarts=0, events=events, tag="w"
            )
            await ref.tell(Crash())
            await wait_for(lambda: not mate.alive)
            assert state(system, "w").state == "failed"
            assert state(system, "mate").state == "stopped"


def test_restart_budget_allows_n_restarts_per_sliding_window() -> None:
    budget = RestartBudget(max_restarts=2, window=5.0)
    assert budget.allow(0.0)
    assert budget.allow(1.0)
    assert not budget.allow(2.0)
    assert budget.allow(5.0)  # the restart at 0.0 has left the window
    assert not budget.allow(5.5)


def test_restart_policies_follow_otp() -> None:
    error = ValueError()
    assert Restart.PERMANENT.restarts_after(error) and Restart.PERMANENT.restarts_after(None)
    assert Restart.TRANSIENT.restarts_after(error)
    assert not Restart.TRANSIENT.restarts_after(None)
    assert not Restart.TEMPORARY.restarts_after(error)
    assert not Restart.TEMPORARY.restarts_after(None)


async def test_budget_failures_are_logged_on_the_runtime_logger(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="runtime")
    events: list[tuple[str, int, str, Any]] = []
    async with ActorSystem() as system:
        ref = await system.spawn(Worker, name="w", max_restarts=0, events=events, tag="x")
        await ref.tell(Crash())
        await wait_for(lambda: not ref.alive)
    assert {r.name for r in caplog.records} == {"runtime"}


class Relay(Actor):
    """Forwards ``Who`` to the peer it was given at spawn."""

    def __init__(self, peer: Any) -> None:
        self.peer = peer

    async def handle(self, msg: Any) -> Any:
        if isinstance(msg, Crash):
            raise ValueError(msg.reason)
        return await self.peer.ask(Who())


async def test_a_ref_injected_at_spawn_reaches_its_peer_across_both_restarts() -> None:
    """The wiring gives refs at spawn: a restarted actor is built with the same arguments, so
    it keeps its peer's ref, and that ref still reaches the peer after the peer restarts."""
    events: list[tuple[str, int, str, Any]] = []
    with anyio.fail_after(5):
        async with ActorSystem() as system:
            peer = await system.spawn(Worker, name="peer", events=events, tag="p")
            relay = await system.spawn(Relay, name="relay", peer=peer)
            first = await relay.ask(Who())
            await peer.tell(Crash())
            await wait_for(lambda: state(system, "peer").restarts == 1)
            second = await relay.ask(Who())
            assert second != first  # a new instance answered, through the same ref
            await relay.tell(Crash())
            await wait_for(lambda: state(system, "relay").restarts == 1)
            assert await relay.ask(Who()) == second
