"""ActorCell: the runtime's record of one actor, and the driver task that feeds it messages.

The driver runs on the system's event loop for every actor; for a thread-pinned actor it runs
each hook on the actor's thread and waits for it, so ordering, one-message-at-a-time, draining
and supervision are the same code for both kinds.

Actors pinned to one thread take turns on it, each hop through the driver letting the others
run, so a pinned actor's turn is every message queued for it when the turn begins, handled
back to back (they are in hand, no longer queued: the mailbox has room for as many more). A
turn a message made its cheap messages (a memory monitor's limits, four a second) each wait
for another actor's long handler (a model step) on that thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from troupe.runtime.actor import Actor
from troupe.runtime.errors import ActorDead, AskTimeout
from troupe.runtime.mailbox import Mailbox
from troupe.runtime.messages import Envelope
from troupe.runtime.ref import ActorRef
from troupe.runtime.reply import AskReply, Reply
from troupe.runtime.snapshot import ENDED, ActorSnapshot, ActorState, ErrorInfo
from troupe.runtime.supervision import Restart, RestartBudget
from troupe.runtime.threads import ActorThread, Lane

if TYPE_CHECKING:
    from troupe.runtime.system import ActorSystem

T = TypeVar("T")

log = logging.getLogger("runtime")


class ActorCell:
    """Everything the runtime keeps for one actor across its restarts."""

    def __init__(
        self,
        system: ActorSystem,
        loop: asyncio.AbstractEventLoop,
        loop_thread: int,
        actor_class: type[Actor],
        name: str,
        init_kwargs: dict[str, Any],
        *,
        mailbox_size: int,
        restart: Restart,
        thread: ActorThread | None,
        group: str | None,
        budget: RestartBudget,
    ) -> None:
        self.system = system
        self.loop = loop
        self.loop_thread = loop_thread
        self.actor_class = actor_class
        self.name = name
        self.init_kwargs = init_kwargs
        self.restart = restart
        self.thread = thread
        # A pinned actor's hooks all run in one lane (one long-lived task) on its thread.
        self._lane: Lane | None = None if thread is None else thread.lane()
        self.group = group
        self.budget = budget
        self.mailbox = Mailbox(name, mailbox_size)
        self.ref = ActorRef(self)
        self.state: ActorState = "starting"
        self.instance: Actor | None = None
        self.messages_handled = 0
        self.restarts = 0
        self.last_error: BaseException | None = None
        self.start_order = -1
        self.started: asyncio.Future[None] = loop.create_future()
        self.task: asyncio.Task[None] | None = None
        # Held while a message is handled or the instance replaced: a group-mate's restart
        # waits for the handler to finish instead of pulling the instance from under it.
        self._lock = asyncio.Lock()
        self._current: Envelope | None = None
        self._reply_taken = False
        self._answer: AskReply | None = None  # an ask's answer the handler took to give later
        self._hook_task: asyncio.Task[Any] | None = None
        self._open_replies: set[Reply] = set()
        # Messages taken from the mailbox for a turn and not handled yet (the turn stopped at
        # an error or a stop); they come before the mailbox's.
        self._held: deque[Envelope] = deque()
        self._stop_self = False
        self._stopping = False

    # -- lifecycle, as seen from the system -------------------------------------------------

    def begin(self) -> None:
        """Start the driver: construct, ``on_start``, then serve the mailbox."""
        self.task = self.loop.create_task(self._drive(), name=f"actor:{self.name}")

    def in_own_hook(self) -> bool:
        """True when called from this actor's own handler (or on_start/on_stop)."""
        return self._hook_task is not None and asyncio.current_task() is self._hook_task

    def stop_self(self) -> None:
        """The actor asked to stop itself: decided by its restart policy after the handler."""
        self._stop_self = True

    async def stop(self) -> None:
        """Refuse new messages, handle those queued, call ``on_stop(None)``; wait for it."""
        if self.state in ENDED or self.task is None:
            return
        self._stopping = True
        self.mailbox.close()
        await asyncio.wait({self.task})

    async def kill(self) -> None:
        """Cancel the driver (and the running handler); fail everything queued or open."""
        if self.state in ENDED or self.task is None:
            return
        self._stopping = True
        self.task.cancel()
        await asyncio.wait({self.task})

    async def restart_with_group(self, expected: Actor | None, error: BaseException | None) -> None:
        """Restart because a group-mate restarted, unless this instance is already gone."""
        async with self._lock:
            if self.instance is expected and self.state == "running":
                await self._restart(error)

    async def ask(self, msg: Any, timeout: float | None) -> Any:
        """Queue ``msg`` with a reply future and wait for the answer (on the system loop)."""
        future: asyncio.Future[Any] = self.loop.create_future()
        envelope = Envelope(msg, future)
        if timeout is None:
            await self.mailbox.put(envelope)
            return await future
        deadline = asyncio.timeout(timeout)
        try:
            async with deadline:
                await self.mailbox.put(envelope)
                return await future
        except TimeoutError:
            # A TimeoutError raised by the handler itself passes through unchanged.
            if deadline.expired():
                raise AskTimeout(f"{self.name!r} did not answer within {timeout}s") from None
            raise

    def take_reply(self) -> Reply:
        """See ``Actor.take_reply``."""
        envelope = self._current
        if envelope is None or not isinstance(envelope.reply, Reply):
            raise RuntimeError("take_reply(): the message being handled was not sent with stream()")
        reply = envelope.reply
        if not self._reply_taken:
            self._reply_taken = True
            if not reply.done:
                reply._on_finish = self._open_replies.discard
                self._open_replies.add(reply)
        return reply

    def take_answer(self) -> Reply:
        """For a message sent with ``ask``: its answer (an ``AskReply``), for the actor to give
        later, from any thread, so that a handler can start a long job, return, and take the
        next message meanwhile. The runtime no longer answers with ``handle``'s return value
        (an exception ``handle`` raises still fails the ask) and fails the answer with
        ``ActorDead`` if the actor ends before giving it.
        """
        envelope = self._current
        if envelope is None or not isinstance(envelope.reply, asyncio.Future):
            raise RuntimeError("take_answer(): the message being handled was not sent with ask()")
        if self._answer is None:
            self._answer = answer = AskReply(envelope.reply)
            self._reply_taken = True
            answer._on_finish = self._open_replies.discard
            self._open_replies.add(answer)
        return self._answer

    def snapshot(self) -> ActorSnapshot:
        """This actor now, for ``ActorSystem.snapshot``."""
        report = None
        instance = self.instance
        if instance is not None and self.state == "running":
            try:
                report = instance.report()
            except Exception as exc:
                report = {"report_error": repr(exc)}
        cls = self.actor_class
        return ActorSnapshot(
            name=self.name,
            actor_class=f"{cls.__module__}.{cls.__qualname__}",
            state=self.state,
            thread=None if self.thread is None else self.thread.name,
            group=self.group,
            restart=self.restart.value,
            mailbox_depth=self.mailbox.depth + len(self._held),
            mailbox_capacity=self.mailbox.capacity,
            waiting_senders=self.mailbox.waiting_senders,
            messages_handled=self.messages_handled,
            restarts=self.restarts,
            last_error=None if self.last_error is None else ErrorInfo.of(self.last_error),
            report=report,
        )

    # -- the driver ---------------------------------------------------------------------------

    async def _drive(self) -> None:
        try:
            try:
                self.instance = await self._on_thread(self._new_instance())
            except Exception as exc:
                self.last_error = exc
                self._end("failed")
                if not self.started.done():
                    self.started.set_exception(exc)
                return
            self.state = "running"
            if not self.started.done():
                self.started.set_result(None)
            await self._serve()
        except asyncio.CancelledError:
            self._end("stopped")
            if not self.started.done():
                self.started.set_exception(ActorDead(f"actor {self.name!r} was killed"))
            raise

    async def _serve(self) -> None:
        while True:
            if self._stop_self:
                self._stop_self = False
                async with self._lock:
                    if not await self._supervise(None):
                        return
            envelope = self._held.popleft() if self._held else await self.mailbox.get()
            async with self._lock:
                if self.state in ENDED:
                    # A group-mate's restart failed this actor while we waited for the lock.
                    if envelope is not None:
                        self._fail_reply(envelope.reply, self._dead())
                    return
                if envelope is None:
                    await self._stop_instance(None)
                    self._end("stopped")
                    return
                error = await self._take_turn(envelope)
                if error is not None and not await self._supervise(error):
                    return

    async def _take_turn(self, first: Envelope) -> BaseException | None:
        """One turn: ``first``, and for a pinned actor every message queued behind it, handled
        back to back in one hop to its thread; those after a ``tell``'s error or the actor's
        ``stop_self`` wait in ``_held`` for the next turn. Returns that error."""
        turn = [first]
        if self._lane is not None:
            turn += [*self._held, *self.mailbox.take_queued()]
        self._held.clear()
        try:
            handled, error = await self._on_thread(self._invoke_turn(turn))
        except asyncio.CancelledError:
            # Killed while handling: no asker may wait for an answer that won't come (one
            # already answered keeps its answer).
            for envelope in turn:
                self._fail_reply(envelope.reply, self._dead())
            raise
        except Exception as exc:
            # The pinned thread's lane ended under the handlers.
            for envelope in turn:
                self._fail_reply(envelope.reply, exc)
            return exc if any(envelope.reply is None for envelope in turn) else None
        self._held.extend(turn[handled:])
        return error

    async def _invoke_turn(self, turn: list[Envelope]) -> tuple[int, BaseException | None]:
        """Runs on the actor's thread: ``_invoke`` each envelope of ``turn`` in order, up to a
        ``tell``'s error or the actor stopping itself; returns how many it handled, and that
        error."""
        for handled, envelope in enumerate(turn, start=1):
            error = await self._invoke(envelope)
            if error is not None or self._stop_self:
                return handled, error
        return len(turn), None

    async def _invoke(self, envelope: Envelope) -> BaseException | None:
        """Runs on the actor's thread: handle and answer. An ask is answered from here, not
        from the driver, which saves the asker a hop through the driver.
        """
        self._hook_task = asyncio.current_task()
        self._current = envelope
        self._reply_taken = False
        self._answer = None
        try:
            result = await self.instance.handle(envelope.message)  # type: ignore[union-attr]
        except asyncio.CancelledError:
            if self._hook_task is not None and self._hook_task.cancelling():
                raise
            cancelled = RuntimeError(f"actor {self.name!r}: handler was cancelled")
            return self._answer_error(self._answer or envelope.reply, cancelled)
        except Exception as exc:
            # A taken answer fails through itself, so that it is no longer counted open.
            return self._answer_error(self._answer or envelope.reply, exc)
        finally:
            self._current = None
        # Counted before answering, so an asker that got its answer sees the count.
        self.messages_handled += 1
        reply = envelope.reply
        if isinstance(reply, Reply):
            if not self._reply_taken:
                if result is not None:
                    reply.send(result)
                reply.close()
        elif reply is not None and not self._reply_taken:
            self._complete(reply, result, None)
        return None

    def _answer_error(
        self, reply: asyncio.Future[Any] | Reply | None, error: BaseException
    ) -> BaseException | None:
        """An error goes to whoever waits for the answer; a tell's is returned for supervision."""
        self.messages_handled += 1
        if reply is None:
            return error
        self._fail_reply(reply, error)
        return None

    async def _new_instance(self) -> Actor:
        """Runs on the actor's thread: construct and start a fresh instance."""
        instance = self.actor_class(**self.init_kwargs)
        instance.ref = self.ref
        instance.system = self.system
        instance.name = self.name
        instance._cell = self
        self._hook_task = asyncio.current_task()
        await instance.on_start()
        return instance

    async def _run_on_stop(self, instance: Actor, error: BaseException | None) -> None:
        """Runs on the actor's thread."""
        self._hook_task = asyncio.current_task()
        await instance.on_stop(error)

    # -- supervision --------------------------------------------------------------------------

    async def _supervise(self, error: BaseException | None) -> bool:
        """The actor ended on its own (``error``, or None: it stopped itself). Applies the
        restart policy and budget; returns False when the actor is over.
        """
        if error is None:
            if self._stopping or not self.restart.restarts_after(None):
                # A stop, not a restart: drain what is queued like an ordered stop.
                self._stopping = True
                self.mailbox.close()
                return True
        else:
            self.last_error = error
            log.error("actor %r failed handling a message", self.name, exc_info=error)
            if not self.restart.restarts_after(error):
                await self._fail(error)
                return False
        if not self.budget.allow(time.monotonic()):
            log.error(
                "actor %r failed: more than %d restarts within %.1fs; not restarting again",
                self.name, self.budget.max_restarts, self.budget.window,
            )
            await self._fail(error)
            return False
        if not await self._restart(error):
            return False
        self.system.restart_group(self, error)
        return True

    async def _restart(self, error: BaseException | None) -> bool:
        """Replace the instance (same ref, same mailbox); False if none would start."""
        self.state = "restarting"
        await self._stop_instance(error)
        # The state changes under us only if the actor is killed meanwhile.
        while self.state == "restarting":
            try:
                instance = await self._on_thread(self._new_instance())
            except Exception as exc:
                self.last_error = exc
                log.error("actor %r failed to restart", self.name, exc_info=exc)
                if not self.budget.allow(time.monotonic()):
                    await self._fail(exc)
                    return False
                continue
            if self.state != "restarting":
                return False
            self.instance = instance
            self.restarts += 1
            self.state = "running"
            return True
        return False

    async def _fail(self, error: BaseException | None) -> None:
        self.mailbox.close()
        await self._stop_instance(error)
        self._end("failed")
        self.system.stop_group(self)

    async def _stop_instance(self, error: BaseException | None) -> None:
        """``on_stop`` on the current instance (errors logged), then fail replies left open."""
        instance, self.instance = self.instance, None
        if instance is not None:
            try:
                await self._on_thread(self._run_on_stop(instance, error))
            except Exception:
                log.exception("actor %r: on_stop failed", self.name)
        self._fail_open_replies()

    def _end(self, state: ActorState) -> None:
        """Final state; whatever is still queued or open fails with ``ActorDead``."""
        self.state = state
        held, self._held = list(self._held), deque()
        for envelope in [*held, *self.mailbox.discard()]:
            self._fail_reply(envelope.reply, self._dead())
        self._fail_open_replies()
        if self._lane is not None:
            self._lane.close()

    def _fail_open_replies(self) -> None:
        # Copied first: the actor's thread may close one of them meanwhile.
        replies = list(self._open_replies)
        self._open_replies.clear()
        for reply in replies:
            reply.fail(self._dead())

    def _dead(self) -> ActorDead:
        return ActorDead(f"actor {self.name!r} has stopped")

    def _fail_reply(self, reply: asyncio.Future[Any] | Reply | None, error: BaseException) -> None:
        if isinstance(reply, Reply):
            reply.fail(error)
        elif reply is not None:
            self._complete(reply, None, error)

    def _complete(
        self, future: asyncio.Future[Any], result: Any, error: BaseException | None
    ) -> None:
        """Answer an ask; from any thread. A future already done (the asker timed out or
        left) is left alone: a late reply is dropped quietly.
        """
        if threading.get_ident() != self.loop_thread:
            self.loop.call_soon_threadsafe(self._complete, future, result, error)
        elif not future.done():
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

    async def _on_thread(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._lane is None:
            return await coro
        return await self._lane.run(coro)
