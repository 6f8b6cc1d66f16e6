"""Running code on the right thread: hops between event loops, and pinned actor threads."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from troupe.runtime.errors import ActorDead

T = TypeVar("T")

log = logging.getLogger("runtime")

# The ActorThread running the current OS thread, if any (for ``at_thread_exit``).
_current = threading.local()


def at_thread_exit(fn: Callable[[], object]) -> bool:
    """Call ``fn()`` on the current actor thread as it ends: after its loop has stopped, while
    the interpreter still runs (``ActorSystem`` joins the thread before it returns). A function
    registered several times runs once. Returns False (and registers nothing) off an actor
    thread.

    For a native library's per-thread state that holds Python objects: C++ ``thread_local``
    destructors run after ``Thread.join`` has returned, and one that needs the GIL while the
    interpreter finalizes kills the thread inside a destructor, which aborts the process
    ("terminate called without an active exception"). Released here, there is nothing left
    for them to do.
    """
    thread: ActorThread | None = getattr(_current, "thread", None)
    if thread is None:
        return False
    if fn not in thread._exit_hooks:
        thread._exit_hooks.append(fn)
    return True


async def run_on(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
    """Await ``coro`` on ``loop`` from a coroutine running on another loop."""
    try:
        future = asyncio.run_coroutine_threadsafe(coro, loop)
    except RuntimeError:
        coro.close()
        raise ActorDead("the actor system's event loop is closed") from None
    return await asyncio.wrap_future(future)


def call_on(loop: asyncio.AbstractEventLoop, fn: Callable[..., T], *args: Any) -> T:
    """Call ``fn(*args)`` on ``loop`` from another thread and wait for it (microseconds)."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def call() -> None:
        try:
            done.set_result(fn(*args))
        except Exception as exc:
            done.set_exception(exc)

    try:
        loop.call_soon_threadsafe(call)
    except RuntimeError:
        raise ActorDead("the actor system's event loop is closed") from None
    return done.result()


class ActorThread:
    """One named OS thread with an asyncio loop; pinned actors' coroutines all run on it.

    The thread is a daemon only as a last resort: ``ActorSystem`` stops and joins it.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.loop = asyncio.new_event_loop()
        self._exit_hooks: list[Callable[[], object]] = []
        self._turns = Turns()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def lane(self) -> Lane:
        """A new lane on this thread: one actor's coroutines, run one after another."""
        return Lane(self.loop, self._turns)

    async def join(self, timeout: float) -> None:
        """Stop the loop (cancelling what still runs on it) and wait for the thread to end."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
        await asyncio.to_thread(self._thread.join, timeout)
        if self._thread.is_alive():
            log.warning("thread %r did not finish within %.1fs; left as a daemon", self.name,
                        timeout)

    def _run(self) -> None:
        _current.thread = self
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
            # Tasks actors left behind (a background loop, a killed handler) end here.
            leftover = asyncio.all_tasks(self.loop)
            for task in leftover:
                task.cancel()
            if leftover:
                self.loop.run_until_complete(
                    asyncio.gather(*leftover, return_exceptions=True)
                )
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        finally:
            self.loop.close()
            self._run_exit_hooks()

    def _run_exit_hooks(self) -> None:
        """The ``at_thread_exit`` functions, on this thread, each once; errors are logged."""
        hooks, self._exit_hooks = self._exit_hooks, []
        for fn in hooks:
            try:
                fn()
            except Exception:
                log.exception("thread %r: exit hook %r failed", self.name, fn)


class Turns:
    """The order in which the lanes of one thread start their jobs: the order the jobs came
    in (an entry a job, added when its lane is kicked on the thread), skipping lanes still
    busy with a job (one may await another lane's answer). A lane whose next job came while
    its job ran went on with it at once, ahead of another lane's job that came first: an
    embedding model's steps ran two and three in a row while a chat model's step waited.
    Only the thread's own loop touches it."""

    def __init__(self) -> None:
        self._queue: deque[Lane] = deque()

    def came(self, lane: Lane) -> None:
        """A job of ``lane`` came."""
        self._queue.append(lane)
        self._wake_next()

    def mine(self, lane: Lane) -> bool:
        """Whether ``lane`` (idle, with a job) starts one now."""
        return self._next() is lane

    def take(self, lane: Lane) -> None:
        """``lane`` starts the job its first entry stands for; the next idle lane may too."""
        self._queue.remove(lane)
        self._wake_next()

    def free(self) -> None:
        """A lane's job ended: the next in line may start."""
        self._wake_next()

    def drop(self, lane: Lane) -> None:
        """``lane`` ended: its jobs will never start."""
        self._queue = deque(other for other in self._queue if other is not lane)
        self._wake_next()

    def _next(self) -> Lane | None:
        return next((lane for lane in self._queue if not lane.busy), None)

    def _wake_next(self) -> None:
        lane = self._next()
        if lane is not None:
            lane.wake()


class Lane:
    """Runs coroutines handed over from the system loop, one at a time, inside one long-lived
    task on a pinned thread's loop, starting each in its turn among the thread's lanes
    (``Turns``).

    Cheaper than a task per coroutine (``run_coroutine_threadsafe``), which measured about
    twice the round trip; and the hooks see the same ``asyncio.current_task()`` every time.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, turns: Turns) -> None:
        self._loop = loop
        self._turns = turns
        self.busy = False  # running a job
        self._jobs: deque[tuple[Coroutine[Any, Any, Any], asyncio.Future[Any]]] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._ended = False
        loop.call_soon_threadsafe(self._begin)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` in the lane and wait for it; cancelling the wait ends the lane."""
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._jobs.append((coro, done))
        try:
            self._loop.call_soon_threadsafe(self._kick)
        except RuntimeError:
            self._fail_jobs()
        try:
            return await done
        except asyncio.CancelledError:
            self.close()
            raise

    def close(self) -> None:
        """End the lane, cancelling what runs in it. Any thread."""
        try:
            self._loop.call_soon_threadsafe(self._cancel)
        except RuntimeError:
            self._fail_jobs()

    def _begin(self) -> None:
        self._task = self._loop.create_task(self._work())

    def _kick(self) -> None:
        if self._ended:
            # Runs on the lane's thread after the job was queued: no job can slip past this.
            self._fail_jobs()
            return
        self._turns.came(self)

    def wake(self) -> None:
        """Its turn has come (on the lane's thread)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _work(self) -> None:
        jobs = self._jobs
        task = asyncio.current_task()
        try:
            while True:
                while not self._turns.mine(self):
                    self._waiter = self._loop.create_future()
                    await self._waiter
                self.busy = True
                self._turns.take(self)
                coro, done = jobs.popleft()
                try:
                    result = await coro
                except asyncio.CancelledError:
                    if task is not None and task.cancelling():
                        _settle(done, None, ActorDead("the actor's lane was cancelled"))
                        raise
                    # The coroutine cancelled itself: an error of that call, not the lane's end.
                    _settle(done, None, RuntimeError("the actor's coroutine was cancelled"))
                except Exception as exc:
                    _settle(done, None, exc)
                else:
                    _settle(done, result, None)
                finally:
                    self.busy = False
                    self._turns.free()
        finally:
            self._ended = True
            self._turns.drop(self)
            self._fail_jobs()

    def _fail_jobs(self) -> None:
        while self._jobs:
            coro, done = self._jobs.popleft()
            coro.close()
            _settle(done, None, ActorDead("the actor's thread has stopped"))


def _settle(done: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    """Complete ``done`` (which belongs to another thread's loop) from this thread."""

    def apply() -> None:
        if done.done():
            return
        if error is None:
            done.set_result(result)
        else:
            done.set_exception(error)

    try:
        done.get_loop().call_soon_threadsafe(apply)
    except RuntimeError:
        # The waiting loop is closed: nobody is left to tell.
        pass
