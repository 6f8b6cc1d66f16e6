"""Admission's worker threads (``actors.workers``): a watchdog that cuts a call short in its
own thread, and a pool whose threads never hold the process at exit."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError
from pathlib import Path
from typing import Any

import pytest

from troupe.actors.workers import DaemonPool, Overrun, Watchdog

ROOT = Path(__file__).resolve().parents[1]


def _forever() -> None:
    while True:
        pass


def _spin(n: int) -> int:
    for _ in range(n):
        pass
    return n


def _in_thread(work: Callable[[], Any]) -> Any:
    """``work()`` run in a thread of its own: what it returned, or the exception it raised."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(work())
        except BaseException as exc:
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the work never ended"
    return out[0]


def test_the_watchdog_cuts_a_python_loop_at_its_deadline_and_the_thread_goes_on() -> None:
    watchdog = Watchdog()

    def work() -> list[Any]:
        seen: list[Any] = []
        try:
            watchdog.call(0.2, _forever)
        except Overrun:
            seen.append("cut")
        seen.append(watchdog.call(5.0, sum, [1, 2, 3]))
        return seen

    assert _in_thread(work) == ["cut", 6]
    watchdog.close()


def test_no_overrun_arrives_after_a_call_returned() -> None:
    """Deadlines that fall as the calls end: each call is cut or answers, and nothing is ever
    raised once it has returned (the busy loop after each call would take it)."""
    watchdog = Watchdog()

    def work() -> tuple[int, int]:
        cut = answered = 0
        for i in range(300):
            try:
                watchdog.call(0.0005 * (i % 7), _spin, 20_000)
            except Overrun:
                cut += 1
            else:
                answered += 1
            _spin(20_000)  # Python bytecode: where a stray Overrun would land
        return cut, answered

    result = _in_thread(work)
    assert isinstance(result, tuple), result
    assert sum(result) == 300
    watchdog.close()


def test_closing_the_watchdog_cuts_the_calls_under_way() -> None:
    watchdog = Watchdog()
    started = threading.Event()

    def work() -> str:
        started.set()
        try:
            watchdog.call(3600.0, _forever)
        except Overrun:
            return "cut"
        return "ended"

    out: list[str] = []
    thread = threading.Thread(target=lambda: out.append(work()))
    thread.start()
    assert started.wait(60)
    watchdog.close()
    thread.join(60)
    assert out == ["cut"]


def test_the_daemon_pool_runs_work_in_order_and_cancels_what_waits_at_shutdown() -> None:
    pool = DaemonPool(1, "test-pool")
    started, gate = threading.Event(), threading.Event()

    def hold() -> bool:
        started.set()
        return gate.wait(60)

    first = pool.submit(hold)
    second = pool.submit(pow, 2, 10)
    third = pool.submit(pow, 3, 3)
    assert started.wait(60)  # the first is running: shutdown cancels only what waits
    pool.shutdown(wait=False, cancel_futures=True)
    gate.set()
    assert first.result(60) is True
    assert second.cancelled() and third.cancelled()
    with pytest.raises(CancelledError):
        second.result()
    with pytest.raises(RuntimeError):
        pool.submit(pow, 2, 2)
    failing = DaemonPool(1, "test-pool-2")
    with pytest.raises(ZeroDivisionError):
        failing.submit(divmod, 1, 0).result(60)
    failing.shutdown()


def test_a_busy_daemon_pool_thread_never_holds_the_process_at_exit() -> None:
    code = (
        "import threading\n"
        "from actors.workers import DaemonPool\n"
        "running = threading.Event()\n"
        "def forever():\n"
        "    running.set()\n"
        "    while True:\n"
        "        pass\n"
        "DaemonPool(2, 'busy').submit(forever)\n"
        "assert running.wait(60)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60)
    assert done.returncode == 0
