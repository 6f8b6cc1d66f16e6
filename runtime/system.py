"""ActorSystem: spawns actors, finds them by name, stops them, and shows them."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Coroutine
from types import TracebackType
from typing import Any

from troupe.runtime.actor import Actor
from troupe.runtime.cell import ActorCell
from troupe.runtime.ref import ActorRef
from troupe.runtime.snapshot import ENDED, ActorSnapshot
from troupe.runtime.supervision import Restart, RestartBudget
from troupe.runtime.threads import ActorThread, run_on

log = logging.getLogger("runtime")


class ActorSystem:
    """A set of actors on one event loop: ``async with ActorSystem() as system: ...``.

    Leaving the block stops every actor in reverse start order (each drains its mailbox
    first) and joins the pinned threads. Methods may be awaited from any thread.
    """

    def __init__(self, *, thread_join_timeout: float = 5.0) -> None:
        self._thread_join_timeout = thread_join_timeout
        self._cells: dict[str, ActorCell] = {}
        self._threads: dict[str, ActorThread] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._closed = False
        self._start_order = itertools.count()
        self._anonymous = itertools.count(1)

    async def __aenter__(self) -> ActorSystem:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def spawn(
        self,
        actor_class: type[Actor],
        /,
        *,
        name: str | None = None,
        mailbox_size: int = 64,
        restart: Restart = Restart.TRANSIENT,
        thread: str | None = None,
        group: str | None = None,
        max_restarts: int = 3,
        restart_window: float = 5.0,
        **init_kwargs: Any,
    ) -> ActorRef:
        """Start an actor; returns its ref once ``on_start`` finished (raises its error).

        ``init_kwargs`` go to the class's ``__init__``. ``thread`` pins the actor to the OS
        thread of that name (created on first use, shared by every actor naming it).
        ``group`` members restart together. A name already taken by a live actor raises
        ValueError; one left by a stopped or failed actor is reused.
        """
        loop = self._require_loop()
        if asyncio.get_running_loop() is not loop:
            return await run_on(loop, self.spawn(
                actor_class, name=name, mailbox_size=mailbox_size, restart=restart,
                thread=thread, group=group, max_restarts=max_restarts,
                restart_window=restart_window, **init_kwargs,
            ))
        if self._closed:
            raise RuntimeError("the actor system has stopped")
        if not (isinstance(actor_class, type) and issubclass(actor_class, Actor)):
            raise TypeError(f"spawn() needs an Actor subclass, not {actor_class!r}")
        if name is None:
            name = f"{actor_class.__name__}-{next(self._anonymous)}"
        previous = self._cells.get(name)
        if previous is not None and previous.state not in ENDED:
            raise ValueError(f"an actor named {name!r} is already running")
        cell = ActorCell(
            self, loop, self._loop_thread, actor_class, name, init_kwargs,
            mailbox_size=mailbox_size, restart=restart, thread=self._thread(thread),
            group=group, budget=RestartBudget(max_restarts, restart_window),
        )
        # Registered while starting, so the name is taken and the snapshot shows it.
        self._cells.pop(name, None)
        self._cells[name] = cell
        cell.begin()
        try:
            await cell.started
        except asyncio.CancelledError:
            await cell.kill()
            raise
        except BaseException:
            if self._cells.get(name) is cell:
                del self._cells[name]
                if previous is not None:
                    self._cells[name] = previous
            raise
        cell.start_order = next(self._start_order)
        return cell.ref

    def get(self, name: str) -> ActorRef:
        """The ref of the actor called ``name``; KeyError if there is none."""
        cell = self._cells.get(name)
        if cell is None:
            raise KeyError(f"no actor named {name!r}")
        return cell.ref

    def find(self, name: str) -> ActorRef | None:
        """The ref of the actor called ``name``, or None."""
        cell = self._cells.get(name)
        return None if cell is None else cell.ref

    def snapshot(self) -> list[ActorSnapshot]:
        """Every actor, stopped and failed ones included, in spawn order."""
        return [cell.snapshot() for cell in list(self._cells.values())]

    async def stop(self, ref: ActorRef | None = None) -> None:
        """Stop one actor (it handles what is queued, then ``on_stop(None)``), or with no
        argument every actor in reverse start order, then the pinned threads.

        Messages sent to a stopped actor raise ``ActorDead``. An actor stopping itself from
        its own handler does not wait (it would wait for itself); its restart policy then
        decides, as for any actor that ends on its own.
        """
        if ref is None:
            await self._shutdown()
            return
        cell = ref._cell
        if cell.in_own_hook():
            cell.stop_self()
            return
        await self._on_loop(cell.stop())

    async def kill(self, ref: ActorRef) -> None:
        """Emergency stop: cancel the running handler, fail what is queued with
        ``ActorDead``; no drain, no ``on_stop``, no restart.
        """
        cell = ref._cell
        if cell.in_own_hook():
            # Waiting here would wait for this very handler: cancel it and return.
            if cell.task is not None:
                cell.loop.call_soon_threadsafe(cell.task.cancel)
            return
        await self._on_loop(cell.kill())

    def restart_group(self, cell: ActorCell, error: BaseException | None) -> None:
        """``cell`` restarted: restart its group-mates too, each after its current message."""
        for mate in self._mates(cell):
            log.warning("restarting actor %r with its group %r", mate.name, cell.group)
            self._background(mate.restart_with_group(mate.instance, error))

    def stop_group(self, cell: ActorCell) -> None:
        """``cell`` failed for good: its group-mates stop too (they live and die together)."""
        for mate in self._mates(cell):
            log.warning("stopping actor %r: group %r lost %r", mate.name, cell.group, cell.name)
            self._background(mate.stop())

    async def _shutdown(self) -> None:
        if self._loop is None or self._closed:
            return
        if asyncio.get_running_loop() is not self._loop:
            await run_on(self._loop, self._shutdown())
            return
        self._closed = True
        for cell in sorted(self._cells.values(), key=lambda c: c.start_order, reverse=True):
            await cell.stop()
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for thread in self._threads.values():
            await thread.join(self._thread_join_timeout)
        self._threads.clear()

    def _mates(self, cell: ActorCell) -> list[ActorCell]:
        if cell.group is None:
            return []
        return [
            c for c in self._cells.values()
            if c.group == cell.group and c is not cell and c.state == "running"
        ]

    def _thread(self, name: str | None) -> ActorThread | None:
        if name is None:
            return None
        thread = self._threads.get(name)
        if thread is None:
            thread = self._threads[name] = ActorThread(name)
        return thread

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = self._require_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _on_loop(self, coro: Coroutine[Any, Any, None]) -> None:
        loop = self._require_loop()
        if asyncio.get_running_loop() is loop:
            await coro
        else:
            await run_on(loop, coro)

    def _require_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("use the actor system inside 'async with ActorSystem() as system'")
        return self._loop
