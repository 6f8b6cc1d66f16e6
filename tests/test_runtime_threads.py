"""Thread-pinned actors: every hook on one OS thread, so MLX arrays stay on their stream."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import anyio
import mlx.core as mx
import pytest

from troupe.runtime import Actor, ActorRef, ActorSystem, MailboxFull, Message
from troupe.runtime.threads import ActorThread


class Where(Message):
    pass


class Evaluate(Message):
    pass


class Forward(Message):
    text: str


class Note(Message):
    text: str


class Tracker(Actor):
    """Records the thread of every hook into the shared ``threads`` list."""

    def __init__(self, threads: list[tuple[str, int, str]]) -> None:
        self.threads = threads
        self._record("init")

    def _record(self, hook: str) -> None:
        current = threading.current_thread()
        self.threads.append((hook, current.ident or 0, current.name))

    async def on_start(self) -> None:
        self._record("on_start")

    async def handle(self, msg: Any) -> Any:
        await asyncio.sleep(0)  # awaiting inside a pinned handler resumes on the same thread
        self._record("handle")

    async def on_stop(self, error: BaseException | None) -> None:
        self._record("on_stop")


async def test_a_pinned_actor_runs_every_hook_on_its_own_thread() -> None:
    threads: list[tuple[str, int, str]] = []
    with anyio.fail_after(5):
        async with ActorSystem() as system:
            ref = await system.spawn(Tracker, name="t", thread="mlx", threads=threads)
            for _ in range(5):
                await ref.tell(Where())
            await ref.ask(Where())
            assert system.snapshot()[0].thread == "mlx"
    assert [hook for hook, _, _ in threads] == ["init", "on_start"] + ["handle"] * 6 + ["on_stop"]
    assert {name for _, _, name in threads} == {"mlx"}
    assert len({ident for _, ident, _ in threads}) == 1
    assert threads[0][1] != threading.get_ident()


async def test_actors_naming_the_same_thread_share_it() -> None:
    threads: list[tuple[str, int, str]] = []
    async with ActorSystem() as system:
        a = await system.spawn(Tracker, name="a", thread="shared", threads=threads)
        b = await system.spawn(Tracker, name="b", thread="shared", threads=threads)
        await a.ask(Where())
        await b.ask(Where())
    assert len({ident for _, ident, _ in threads}) == 1


class MlxOwner(Actor):
    """Makes an array on its own stream in on_start and evaluates it in a later handle."""

    array: mx.array
    spare: mx.array

    async def on_start(self) -> None:
        stream = mx.new_stream(mx.cpu)
        with mx.stream(stream):
            self.array = mx.ones(4) * 2
            self.spare = mx.ones(4) * 3

    async def handle(self, msg: Any) -> Any:
        match msg:
            case Evaluate():
                return self.array.tolist()
            case Where():
                return self.spare  # unevaluated: to show what happens off the owning thread
        return None


async def test_an_mlx_array_made_in_on_start_evaluates_in_a_later_handle_on_the_pinned_thread(
) -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(MlxOwner, name="mlx", thread="mlx")
        assert await ref.ask(Evaluate()) == [2.0, 2.0, 2.0, 2.0]
        # The same array evaluated on the event loop's thread: MLX refuses.
        array = await ref.ask(Where())
        with pytest.raises(RuntimeError, match=r"There is no Stream\(cpu, \d+\) in current thread"):
            mx.eval(array)


class Relay(Actor):
    """Pinned: forwards to a loop actor with tell, ask and try_tell from its own thread."""

    def __init__(self, target: ActorRef) -> None:
        self.target = target

    async def handle(self, msg: Any) -> Any:
        match msg:
            case Forward(text=text):
                await self.target.tell(Note(text=f"tell {text}"))
                answer = await self.target.ask(Note(text=f"ask {text}"), timeout=5.0)
                stream = await self.target.stream(Note(text=f"stream {text}"))
                items = [item async for item in stream]
                return answer, items, threading.current_thread().name
            case Where():
                try:
                    self.target.try_tell(Note(text="one too many"))
                except MailboxFull:
                    return "full"
                return "queued"
        return None


class Inbox(Actor):
    def __init__(self, gate: asyncio.Event) -> None:
        self.gate = gate
        self.notes: list[tuple[str, str]] = []

    async def handle(self, msg: Any) -> Any:
        await self.gate.wait()
        self.notes.append((msg.text, threading.current_thread().name))
        return list(self.notes)


async def test_a_pinned_actor_can_tell_ask_and_stream_to_a_loop_actor() -> None:
    gate = asyncio.Event()
    gate.set()
    with anyio.fail_after(5):
        async with ActorSystem() as system:
            inbox = await system.spawn(Inbox, name="inbox", gate=gate)
            relay = await system.spawn(Relay, name="relay", thread="worker", target=inbox)
            answer, items, thread = await relay.ask(Forward(text="x"))
    main = threading.current_thread().name
    assert answer == [("tell x", main), ("ask x", main)]
    assert items == [[("tell x", main), ("ask x", main), ("stream x", main)]]
    assert thread == "worker"


async def test_try_tell_from_a_pinned_thread_raises_mailbox_full_synchronously() -> None:
    gate = asyncio.Event()
    with anyio.fail_after(5):
        async with ActorSystem() as system:
            inbox = await system.spawn(Inbox, name="inbox", gate=gate, mailbox_size=1)
            relay = await system.spawn(Relay, name="relay", thread="worker", target=inbox)
            await inbox.tell(Note(text="taken"))  # handled, then stuck at the gate
            await inbox.tell(Note(text="queued"))  # fills the one slot
            assert await relay.ask(Where()) == "full"
            gate.set()
            await inbox.ask(Note(text="drained"))
            assert await relay.ask(Where()) == "queued"


class Parent(Actor):
    """Pinned: spawns, asks, kills and stops a child through the system from its own thread."""

    async def handle(self, msg: Any) -> Any:
        threads: list[tuple[str, int, str]] = []
        child = await self.system.spawn(Tracker, name="child", threads=threads)
        await child.ask(Where(), timeout=5.0)
        await self.system.stop(child)
        again = await self.system.spawn(Tracker, name="child", threads=threads)
        await self.system.kill(again)
        return [hook for hook, _, _ in threads], child.alive, again.alive


async def test_a_pinned_actor_can_spawn_and_stop_actors_from_its_own_thread() -> None:
    with anyio.fail_after(5):
        async with ActorSystem() as system:
            parent = await system.spawn(Parent, name="parent", thread="worker")
            hooks, first_alive, second_alive = await parent.ask(Where())
            assert hooks == ["init", "on_start", "handle", "on_stop", "init", "on_start"]
            assert (first_alive, second_alive) == (False, False)
            assert [s.state for s in system.snapshot()] == ["running", "stopped"]


@pytest.mark.parametrize("thread", [None, "pinned"])
async def test_an_actor_can_kill_itself_from_its_own_handler(thread: str | None) -> None:
    class Doomed(Actor):
        async def handle(self, msg: Any) -> Any:
            await self.system.kill(self.ref)  # must not wait for itself

    with anyio.fail_after(5):
        async with ActorSystem() as system:
            ref = await system.spawn(Doomed, name="doomed", thread=thread)
            await ref.tell(Where())
            while ref.alive:
                await asyncio.sleep(0.001)
            assert system.snapshot()[0].state == "stopped"


class Tick(Message):
    pass


class Stepper(Actor):
    """Steps as a model's scheduler does: each Tick queues the next one to itself until
    ``until`` is in the shared ``log``, where every message handled goes."""

    def __init__(self, log: list[str], until: str) -> None:
        self.log = log
        self.until = until

    async def handle(self, msg: Any) -> Any:
        self.log.append(f"{self.name}:{type(msg).__name__}")
        if isinstance(msg, Tick) and self.until not in self.log:
            self.ref.try_tell(Tick())


async def test_a_pinned_actors_turn_on_a_shared_thread_takes_every_message_queued_for_it() -> None:
    # Two models' schedulers on the MLX thread: a scheduler's next step must not wait for the
    # other's steps once per message queued before it (a memory monitor's limits, 4 a second,
    # each waited for an embedding step, and a chat stream's next token for seconds).
    log: list[str] = []
    with anyio.fail_after(10):
        async with ActorSystem() as system:
            busy = await system.spawn(Stepper, name="busy", thread="mlx", log=log,
                                      until="other:Tick")
            other = await system.spawn(Stepper, name="other", thread="mlx", log=log,
                                       until="other:Tick")
            await busy.tell(Tick())
            while log.count("busy:Tick") < 5:
                await asyncio.sleep(0.001)
            for _ in range(20):  # queued together, as a burst of messages piles up
                other.try_tell(Where())
            other.try_tell(Tick())
            while "other:Tick" not in log:
                await asyncio.sleep(0.001)
    mine = [i for i, entry in enumerate(log) if entry.startswith("other:")]
    assert len(mine) == 21
    # Handled back to back: none of the busy actor's steps ran between them.
    assert mine == list(range(mine[0], mine[0] + 21))


async def test_lanes_on_one_thread_start_their_jobs_in_the_order_the_jobs_came() -> None:
    # A lane whose next job came while its job ran went on with it at once, ahead of another
    # lane's job that came first: an embedding model's steps ran two and three in a row while
    # a chat model's step waited on the same thread.
    thread = ActorThread("shared")
    first, second = thread.lane(), thread.lane()
    order: list[str] = []
    running, release = threading.Event(), threading.Event()

    async def job(name: str) -> None:
        if name == "first 1":
            running.set()
            release.wait()  # holds the thread while the other jobs come
        order.append(name)

    try:
        with anyio.fail_after(5):
            jobs = [asyncio.create_task(first.run(job("first 1")))]
            await asyncio.to_thread(running.wait)
            jobs.append(asyncio.create_task(second.run(job("second"))))
            await asyncio.sleep(0)  # its job is queued on its lane before the next one
            jobs.append(asyncio.create_task(first.run(job("first 2"))))
            await asyncio.sleep(0)
            release.set()
            await asyncio.gather(*jobs)
    finally:
        release.set()
        await thread.join(5)
    assert order == ["first 1", "second", "first 2"]


async def test_a_lane_waiting_in_its_job_for_another_lane_lets_that_lane_start_first() -> None:
    # The engine pool's handler asks a scheduler on the MLX thread: the lane busy with its
    # job must not hold back the other lane's job behind its own next one.
    thread = ActorThread("shared")
    waiting, answering = thread.lane(), thread.lane()
    answered = asyncio.Event()
    order: list[str] = []

    async def wait_for_answer() -> None:
        await answered.wait()
        order.append("waited")

    async def record(name: str) -> None:
        order.append(name)

    async def answer() -> None:
        thread.loop.call_soon(answered.set)  # the event belongs to the thread's loop
        order.append("answered")

    try:
        with anyio.fail_after(5):
            jobs = [asyncio.create_task(waiting.run(wait_for_answer()))]
            await asyncio.sleep(0)
            jobs.append(asyncio.create_task(waiting.run(record("next"))))
            await asyncio.sleep(0)
            jobs.append(asyncio.create_task(answering.run(answer())))
            await asyncio.gather(*jobs)
    finally:
        await thread.join(5)
    assert order == ["answered", "waited", "next"]
