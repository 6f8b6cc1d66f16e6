"""Worker threads that never outlive the server, and a watchdog that cuts their work short.

``DaemonPool`` is a fixed pool of daemon threads: a thread busy in a tokenizer or a chat
template never keeps the process alive after the server stopped (``ThreadPoolExecutor``
joins its threads at interpreter exit, whatever they are doing: a render in flight at
SIGTERM held the process until a second signal).

``Watchdog.call`` runs a function in the calling thread and raises ``Overrun`` inside that
thread if the function is still running at its deadline, through
``PyThreadState_SetAsyncExc`` (CPython's C API for raising in another thread). The exception
arrives at the thread's next bytecode boundary: a Python loop (a chat template's
``{% for %}``) is cut at once, one long call into C (a tokenizer's encode) when it returns.
A trace function (``sys.settrace``) set in the thread could raise it too, but it costs a
call on every Python frame of every render, and on Python 3.12 and later it instruments
every thread's code while it is set (the MLX thread's included); this costs two lock takes
a call.
"""

from __future__ import annotations

import ctypes
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")


class Overrun(BaseException):
    """Raised inside a thread whose ``Watchdog.call`` ran past its deadline. A BaseException,
    so that the ``except Exception`` of the code it cuts short (Jinja's render) lets it by."""


def _raise_in(ident: int, exc: type[BaseException] | None) -> None:
    """Make thread ``ident`` raise ``exc`` at its next bytecode boundary; None takes back one
    it has not raised yet."""
    # Without argtypes, ctypes passes None as NULL, which is what takes an exception back.
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(ident), ctypes.py_object(exc) if exc is not None else None)


class Watchdog:
    """Bounds calls in other threads in time; one daemon thread watches every deadline."""

    def __init__(self, name: str = "watchdog") -> None:
        # A C lock: the thread told to raise may raise anywhere in Python code, and taking
        # this one involves none (a Condition's own __enter__ would: raised in there, after
        # the lock was taken, it would never be released).
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # waited on by the watching thread only
        self._due: dict[int, float] = {}  # thread id -> when its call is cut (monotonic s)
        self._fired: set[int] = set()  # thread ids told to raise, whose call has not ended
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name=name, daemon=True)
        self._thread.start()

    def call(self, seconds: float, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in this thread; ``Overrun`` if it is still running ``seconds``
        later.

        At most one ``Overrun`` is raised per call, and none after it returns: one that
        arrives after ``fn`` returned (on its way out) is dropped, and ``fn``'s answer
        stands."""
        ident = threading.get_ident()
        try:
            with self._lock:
                self._due[ident] = time.monotonic() + seconds
                self._wake.notify()
            return fn(*args, **kwargs)
        finally:
            while True:
                try:
                    self._end(ident)
                    break
                except Overrun:  # raised on its way out: the call ended all the same
                    pass

    def close(self) -> None:
        """Cut every call under way now, and stop watching (later calls are not cut)."""
        with self._lock:
            self._closed = True
            for ident in self._due:
                self._fired.add(ident)
                _raise_in(ident, Overrun)
            self._due.clear()
            self._wake.notify()

    def _end(self, ident: int) -> None:
        with self._lock:
            self._due.pop(ident, None)
            if ident in self._fired:
                self._fired.discard(ident)
                _raise_in(ident, None)  # told to raise but has not yet: it never will

    def _watch(self) -> None:
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                for ident, due in list(self._due.items()):
                    if due <= now:
                        del self._due[ident]
                        self._fired.add(ident)
                        _raise_in(ident, Overrun)
                nearest = min(self._due.values(), default=None)
                self._wake.wait(None if nearest is None else nearest - now)


_Job = tuple[Future, Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class DaemonPool(Executor):
    """``workers`` daemon threads named ``<name>_<i>`` that run what is submitted, in order:
    ``ThreadPoolExecutor`` without the join of its threads at interpreter exit."""

    def __init__(self, workers: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._shut = False
        self._threads = [threading.Thread(target=self._run, name=f"{name}_{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot schedule new work after shutdown")
            future: Future[T] = Future()
            self._jobs.put((future, fn, args, kwargs))
            return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if not self._shut:
                self._shut = True
                while cancel_futures:
                    try:
                        job = self._jobs.get_nowait()
                    except queue.Empty:
                        break
                    if job is not None:
                        job[0].cancel()
                for _ in self._threads:
                    self._jobs.put(None)  # each thread ends after the work it has
        if wait:
            for thread in self._threads:
                thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args, kwargs = job
            del job  # nothing of a job is kept while the thread waits for the next one
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # the submitter gets every failure
                    future.set_exception(exc)
            del future, fn, args, kwargs
