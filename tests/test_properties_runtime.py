"""The actor runtime against a plain model: random interleavings of tell, ask, stop, kill,
crash and restart (Hypothesis's ``RuleBasedStateMachine``).

Three actors (two on the event loop, one pinned to a thread), each with a small mailbox and a
restart budget, handle ``Work`` only when the test lets them: a handler waits at its gate for
one permit per message. So the test decides exactly what is handled when, and the model
(``ActorModel``) can say, after every step, what must be true:

- every ask gets exactly one outcome: its answer, the handler's error, or ``ActorDead``; none
  is left waiting once its actor has ended;
- the mailbox holds at most its capacity; what does not fit waits (``ask``) or is refused
  (``try_tell``: ``MailboxFull``), and a closed mailbox refuses with ``ActorDead``;
- messages are handled one at a time, in the order they were accepted; the pinned actor's
  turn takes every message queued when it begins (they leave the mailbox, which has room for
  as many more), a loop actor's one message;
- a stop handles what is queued, then calls ``on_stop`` once, and nothing is handled after;
  an error in a ``tell`` restarts the actor within its budget and fails it beyond; a kill
  fails what is queued at once; the system stops its actors in reverse start order.

The test waits ("settles") after each step until the system shows what the model says, so a
step that never settles (a hang) fails with the state it was stuck in.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from troupe.runtime import Actor, ActorDead, ActorRef, ActorSystem, MailboxFull, Message, Restart

# How long one step may take to settle before it counts as hung.
SETTLE_S = 5.0
# Restart budgets are counted, not timed: a window no test run outlasts.
WINDOW_S = 3600.0

Action = Literal["ok", "raise", "stop"]


class Work(Message):
    id: int
    action: str


class Boom(Exception):
    """A handler's error, carrying the message's id."""


class Journal:
    """What every actor instance did, in order: (actor key, event, detail). Any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.events: list[tuple[str, str, Any]] = []

    def add(self, key: str, event: str, detail: Any = None) -> None:
        with self._lock:
            self.events.append((key, event, detail))

    def of(self, key: str) -> list[tuple[str, Any]]:
        with self._lock:
            return [(event, detail) for k, event, detail in self.events if k == key]


class Gate:
    """Lets one handler through per permit; polled, so that it works on a pinned thread's
    loop too and a kill (which cancels the poll) ends it."""

    def __init__(self) -> None:
        self._permits = threading.Semaphore(0)
        self.open = False

    def allow(self, n: int) -> None:
        if n:
            self._permits.release(n)

    async def wait(self) -> None:
        while not (self.open or self._permits.acquire(blocking=False)):
            await asyncio.sleep(0.0005)


class Probe(Actor):
    """Journals its lifecycle; handles ``Work`` once its gate lets it: answers the id, raises
    ``Boom``, or stops itself (and answers the id)."""

    def __init__(self, key: str, journal: Journal, gate: Gate) -> None:
        self.key = key
        self.journal = journal
        self.gate = gate

    async def on_start(self) -> None:
        self.journal.add(self.key, "start")

    async def handle(self, msg: Work) -> int:
        self.journal.add(self.key, "enter", msg.id)
        await self.gate.wait()
        self.journal.add(self.key, "handled", msg.id)
        if msg.action == "raise":
            raise Boom(msg.id)
        if msg.action == "stop":
            await self.system.stop(self.ref)  # from its own handler: decided after it returns
        return msg.id

    async def on_stop(self, error: BaseException | None) -> None:
        self.journal.add(self.key, "stop", None if error is None else repr(error))


@dataclass
class Sent:
    """One message the model follows; ``task`` is the asker's (None for a tell)."""

    id: int
    action: Action
    task: asyncio.Task[Any] | None = None
    # What its ask must end with: ("answer", id), ("error", Boom id) or ("dead", None).
    expected: tuple[str, Any] | None = None


@dataclass
class ActorModel:
    """What must be true of one actor: its queue (the messages of its turn first, the first
    of them in its handler, then its mailbox, then the asks waiting for room), its state, its
    restarts left."""

    name: str
    capacity: int
    max_restarts: int
    pinned: bool
    key: str
    ref: ActorRef
    gate: Gate
    start_order: int
    state: Literal["running", "stopping", "ended"] = "running"
    ended_as: Literal["stopped", "failed"] = "stopped"
    queue: deque[Sent] = field(default_factory=deque)
    restarts: int = 0
    handled: int = 0
    starts: int = 1
    stops: int = 0
    stoppers: list[asyncio.Task[None]] = field(default_factory=list)
    in_hand: int = 0  # the queue's first messages, taken for the actor's turn

    @property
    def buffered(self) -> int:
        """Messages in the mailbox itself (those of the turn are in hand)."""
        return min(self.capacity, max(0, len(self.queue) - self.in_hand))

    @property
    def waiting(self) -> int:
        return max(0, len(self.queue) - self.in_hand - self.capacity)

    def accepted(self, sent: Sent) -> None:
        """``sent`` joins the queue; an idle actor's turn begins with it alone."""
        self.queue.append(sent)
        if len(self.queue) == 1:
            self.in_hand = 1

    def next_turn(self) -> None:
        """The turn is over: the next one takes every message queued (a pinned actor; asks
        waiting for room included), or the first (a loop actor)."""
        self.in_hand = min(len(self.queue), len(self.queue) if self.pinned else 1)


# name -> (mailbox capacity, restart budget, pinned to a thread)
ACTORS = {"a": (1, 1, False), "b": (2, 100, False), "p": (2, 2, True)}
NAMES = sorted(ACTORS)
# Mostly work that succeeds, so that queues build up between the stops, crashes and kills.
ACTIONS: list[Action] = ["ok", "ok", "ok", "raise", "stop"]


async def _all_done(tasks: list[asyncio.Task[Any]]) -> None:
    """Wait for ``tasks`` (errors kept in them), or fail after ``SETTLE_S``: a hang."""
    if tasks:
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), SETTLE_S)


class RuntimeMachine(RuleBasedStateMachine):
    """The runtime of one ActorSystem, driven step by step from a loop of the test's own."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.journal = Journal()
        self.ids = itertools.count()
        self.generations = itertools.count()
        self.start_orders = itertools.count()
        self.resolved: list[Sent] = []  # asks whose outcome is known, to check once done
        self.models: dict[str, ActorModel] = {}
        self.system = ActorSystem()
        self._run(self.system.__aenter__())
        for name in NAMES:
            self._spawn(name)

    # -- plumbing -------------------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return self.loop.run_until_complete(coro)

    def _spawn(self, name: str) -> None:
        capacity, budget, pinned = ACTORS[name]
        key = f"{name}#{next(self.generations)}"
        gate = Gate()
        ref = self._run(self.system.spawn(
            Probe, name=name, mailbox_size=capacity, restart=Restart.TRANSIENT,
            thread="pinned" if pinned else None, max_restarts=budget, restart_window=WINDOW_S,
            key=key, journal=self.journal, gate=gate,
        ))
        self.models[name] = ActorModel(
            name=name, capacity=capacity, max_restarts=budget, pinned=pinned, key=key, ref=ref,
            gate=gate, start_order=next(self.start_orders),
        )

    def _dead(self, sent: Sent) -> None:
        if sent.task is not None:
            sent.expected = ("dead", None)
            self.resolved.append(sent)

    def _end(self, model: ActorModel, as_: Literal["stopped", "failed"]) -> None:
        model.state, model.ended_as = "ended", as_
        for sent in model.queue:
            self._dead(sent)
        model.queue.clear()

    def _close_mailbox(self, model: ActorModel, *, in_handler: bool) -> None:
        """The mailbox closes (a stop): asks still waiting for room are turned away; the
        turn's messages in hand are handled (``in_handler``: a stop from outside, the first of
        them in the handler; else a stop from the handler, which has just returned)."""
        model.state = "stopping"
        room = model.capacity + model.in_hand
        while len(model.queue) > room:
            self._dead(model.queue.pop())
        if not model.queue:
            model.stops += 1  # nothing left to drain: on_stop(None) at once
            self._end(model, "stopped")

    def _handle_next(self, model: ActorModel) -> None:
        """The model of the runtime handling the first queued message."""
        sent = model.queue.popleft()
        model.in_hand -= 1
        model.handled += 1
        if sent.task is not None:
            answer = ("error", sent.id) if sent.action == "raise" else ("answer", sent.id)
            sent.expected = answer
            self.resolved.append(sent)
        if sent.action == "raise" and sent.task is None:
            # A tell's error goes to the supervisor: restart within the budget, else fail.
            model.stops += 1  # on_stop(error) of the instance that failed
            if model.restarts < model.max_restarts:
                model.restarts += 1
                model.starts += 1
                model.next_turn()  # the turn ends at the error, a new one after the restart
            else:
                self._end(model, "failed")
                return
        if sent.action == "stop" and model.state == "running":
            self._close_mailbox(model, in_handler=False)
            if model.state != "ended":
                model.next_turn()  # the turn ends at the stop; the drain takes the rest
            return
        if not model.in_hand:
            model.next_turn()
        if model.state == "stopping" and not model.queue:
            model.stops += 1
            self._end(model, "stopped")

    def _settle(self) -> None:
        """Wait until the system shows what the models say (or fail: a hang)."""
        self._run(self._settled())

    async def _settled(self) -> None:
        deadline = time.monotonic() + SETTLE_S
        while True:
            problem = self._mismatch()
            if problem is None:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"did not settle in {SETTLE_S}s: {problem}")
            await asyncio.sleep(0.001)

    def _mismatch(self) -> str | None:
        snapshots = {s.name: s for s in self.system.snapshot()}
        for model in self.models.values():
            snap = snapshots[model.name]
            events = self.journal.of(model.key)
            counts = {what: sum(1 for e, _ in events if e == what)
                      for what in ("start", "stop", "handled")}
            seen = (counts["start"], counts["stop"], counts["handled"])
            if seen != (model.starts, model.stops, model.handled):
                return f"{model.key}: journal (start, stop, handled) {seen}, model " \
                       f"{(model.starts, model.stops, model.handled)}"
            if model.state == "ended":
                if snap.state != model.ended_as:
                    return f"{model.name}: state {snap.state}, model {model.ended_as}"
                continue
            if snap.state != "running":
                return f"{model.name}: state {snap.state}, model {model.state}"
            if model.queue and events[-1] != ("enter", model.queue[0].id):
                return f"{model.name}: message {model.queue[0].id} not in its handler yet"
            depth = (snap.mailbox_depth, snap.waiting_senders)
            if depth != (model.buffered, model.waiting):
                return f"{model.name}: (mailbox, waiting) {depth}, model " \
                       f"{(model.buffered, model.waiting)}"
        for sent in self.resolved:
            if sent.task is not None and not sent.task.done():
                return f"ask {sent.id} not answered yet (expected {sent.expected})"
        return None

    # -- rules ----------------------------------------------------------------------------------

    @rule(name=st.sampled_from(NAMES), action=st.sampled_from(ACTIONS))
    def try_tell(self, name: str, action: Action) -> None:
        model = self.models[name]
        sent = Sent(id=next(self.ids), action=action)
        try:
            self._run(self._try_tell(model.ref, sent))
            outcome = "ok"
        except MailboxFull:
            outcome = "full"
        except ActorDead:
            outcome = "dead"
        if model.state != "running":
            assert outcome == "dead"
        elif len(model.queue) - model.in_hand >= model.capacity:
            # Full: the turn's in hand plus ``capacity`` queued (and maybe waiting asks).
            assert outcome == "full"
        else:
            assert outcome == "ok"
            model.accepted(sent)
        self._settle()

    async def _try_tell(self, ref: ActorRef, sent: Sent) -> None:
        ref.try_tell(Work(id=sent.id, action=sent.action))

    @rule(name=st.sampled_from(NAMES), action=st.sampled_from(ACTIONS))
    def ask(self, name: str, action: Action) -> None:
        model = self.models[name]
        sent = Sent(id=next(self.ids), action=action)
        sent.task = self.loop.create_task(model.ref.ask(Work(id=sent.id, action=action)))
        if model.state != "running":
            self._dead(sent)
        else:
            model.accepted(sent)  # in hand, in the mailbox, or waiting for room there
        self._settle()

    @rule(name=st.sampled_from(NAMES), action=st.sampled_from(ACTIONS))
    def ask_again(self, name: str, action: Action) -> None:
        """Asks twice as often as the rest: they are what waits for room and for answers."""
        self.ask(name, action)

    @precondition(lambda self: any(m.queue for m in self.models.values()))
    @rule(data=st.data(), n=st.integers(1, 3))
    def release(self, data: st.DataObject, n: int) -> None:
        """Let an actor with queued messages handle up to ``n`` of them."""
        name = data.draw(st.sampled_from([m for m in NAMES if self.models[m].queue]))
        self._release(name, n)

    def _release(self, name: str, n: int) -> None:
        model = self.models[name]
        for _ in range(min(n, len(model.queue))):
            if model.state == "ended":
                break
            # One permit per message, and only once it is in the handler: a permit left over
            # would let a later message through unasked.
            model.gate.allow(1)
            self._handle_next(model)
            self._settle()

    @rule(name=st.sampled_from(NAMES), how=st.sampled_from(["stop", "kill"]))
    def end(self, name: str, how: str) -> None:
        """An ordered stop from outside (it waits for the drain, so it runs as a task), or a
        kill (no drain, no on_stop: what is queued fails at once)."""
        model = self.models[name]
        if how == "stop":
            task = self.loop.create_task(self.system.stop(model.ref))
            if model.state == "running":
                self._close_mailbox(model, in_handler=True)
            model.stoppers.append(task)
        else:
            self._run(self.system.kill(model.ref))
            if model.state != "ended":
                self._end(model, "stopped")
        self._settle()

    @precondition(lambda self: any(m.state == "ended" for m in self.models.values()))
    @rule(data=st.data())
    def respawn(self, data: st.DataObject) -> None:
        ended = [name for name in NAMES if self.models[name].state == "ended"]
        name = data.draw(st.sampled_from(ended))
        self._spawn(name)
        self._settle()

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def every_known_outcome_is_the_expected_one(self) -> None:
        for sent in self.resolved:
            assert sent.task is not None and sent.task.done()
            kind, value = sent.expected  # type: ignore[misc]
            error = sent.task.exception()
            if kind == "answer":
                assert error is None and sent.task.result() == value, sent
            elif kind == "error":
                assert isinstance(error, Boom) and error.args == (value,), (sent, error)
            else:
                assert isinstance(error, ActorDead), (sent, error)
        self.resolved.clear()
        # Asks still queued have no outcome yet: none is answered twice or early.
        for model in self.models.values():
            for sent in model.queue:
                assert sent.task is None or not sent.task.done(), sent

    @invariant()
    def mailboxes_hold_at_most_their_capacity(self) -> None:
        for snap in self.system.snapshot():
            assert 0 <= snap.mailbox_depth <= snap.mailbox_capacity

    @invariant()
    def each_instance_handles_only_between_its_start_and_its_stop(self) -> None:
        for model in self.models.values():
            up = False
            handled: list[int] = []
            for event, detail in self.journal.of(model.key):
                if event == "start":
                    assert not up, (model.key, "started twice")
                    up = True
                elif event == "stop":
                    assert up, (model.key, "stopped while not started")
                    up = False
                else:
                    assert up, (model.key, event, detail, "outside start..stop")
                    if event == "handled":
                        handled.append(detail)
            assert handled == sorted(handled), (model.key, "not handled in order", handled)

    @invariant()
    def a_stop_returns_once_its_actor_has_ended(self) -> None:
        for model in self.models.values():
            if model.state == "ended":
                self._run(_all_done(model.stoppers))
                assert all(t.done() and t.exception() is None for t in model.stoppers)
            else:
                assert not any(t.done() for t in model.stoppers)

    # -- the end --------------------------------------------------------------------------------

    def teardown(self) -> None:
        """Handle everything still queued, then stop the system: every ask has ended, and
        the actors still running stop in reverse start order."""
        try:
            for model in self.models.values():
                while model.queue and model.state != "ended":
                    self._release(model.name, len(model.queue))
            self.every_known_outcome_is_the_expected_one()
            self.a_stop_returns_once_its_actor_has_ended()
            running = [m for m in self.models.values() if m.state != "ended"]
            assert all(m.state == "running" and not m.queue for m in running)
            self._run(asyncio.wait_for(self.system.stop(), SETTLE_S))
            for model in running:
                model.stops += 1
                self._end(model, "stopped")
            self._settle()
            order = [k for k, e, _ in self.journal.events if e == "stop"]
            last = {m.key: max(i for i, k in enumerate(order) if k == m.key) for m in running}
            by_time = sorted(running, key=lambda m: last[m.key])
            assert [m.start_order for m in by_time] == sorted(
                (m.start_order for m in running), reverse=True)
        finally:
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            self.loop.run_until_complete(_all_done(list(pending)))
            self.loop.close()


RuntimeMachine.TestCase.settings = settings(
    max_examples=50,
    stateful_step_count=50,
    derandomize=True,  # the same interleavings every run: CI is deterministic
    database=None,
    deadline=None,  # each step waits for the system to settle; SETTLE_S bounds it
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    # No shrinking: a failing step waits SETTLE_S, so shrinking could run for many minutes.
    # A failure prints its whole sequence of steps, the same every run.
    phases=[Phase.explicit, Phase.generate],
)


@pytest.mark.timeout(240)
def test_the_runtime_keeps_its_promises_under_random_interleavings() -> None:
    run: Callable[[], None] = RuntimeMachine.TestCase().runTest
    run()
