"""An actor thread's end: exit hooks (``runtime.threads.at_thread_exit``), and the MLX thread's
per-thread state released before the interpreter finalizes.

``troupe serve`` once exited with "terminate called without an active exception" (SIGABRT):
the MLX thread's C++ ``thread_local`` compile cache holds Python objects, and its destructor
runs after ``Thread.join`` has returned; when the interpreter was finalizing by then, taking the
GIL killed the thread inside that destructor. The scheduler now clears MLX's per-thread state on
its thread as the thread ends.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from troupe.runtime import Actor, ActorSystem
from troupe.runtime.threads import at_thread_exit

ROOT = Path(__file__).resolve().parents[1]


class Hooks(Actor):
    """Registers an exit hook (twice) on its thread in ``on_start``."""

    def __init__(self, seen: list[tuple[str, bool]], stopped: list[str]) -> None:
        self.seen = seen
        self.stopped = stopped

    async def on_start(self) -> None:
        def hook() -> None:
            # Runs on the actor's thread, after the actor stopped.
            self.seen.append((threading.current_thread().name, bool(self.stopped)))

        assert at_thread_exit(hook)
        assert at_thread_exit(hook)

    async def on_stop(self, error: BaseException | None) -> None:
        self.stopped.append("hooks")

    async def handle(self, msg: object) -> None:
        return None


async def test_exit_hooks_run_once_on_the_actor_thread_after_its_actors_stopped() -> None:
    seen: list[tuple[str, bool]] = []
    stopped: list[str] = []
    async with ActorSystem() as system:
        await system.spawn(Hooks, name="hooks", thread="hooked", seen=seen, stopped=stopped)
        assert seen == []
    # Joined by the system's stop: the hook has run by the time it returns.
    assert seen == [("hooked", True)]
    assert not at_thread_exit(lambda: None)  # not on an actor thread: nothing registered


# Serves the tiny model on the MLX thread, then makes that thread's end fall inside interpreter
# finalization, every time: a libc ``usleep`` registered as a thread_local destructor after
# MLX's own (so it runs first) delays them 0.1 s past ``Thread.join``, and an object whose
# ``__del__`` sleeps keeps finalization going for 1 s with the GIL free.
SCRIPT = r"""
import asyncio, ctypes, sys, time

from troupe.actors.engine.config import EngineConfig
from troupe.actors.messages import AddRequest, RequestFinished, SamplingParams
from troupe.actors.scheduler import MLX_THREAD, Scheduler
from troupe.runtime import Actor, ActorSystem

libc = ctypes.CDLL(None)
register = libc.__cxa_thread_atexit_impl
register.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
USLEEP = ctypes.cast(libc.usleep, ctypes.c_void_p).value


class DelayThreadExit(Actor):
    async def on_start(self):
        register(USLEEP, 100_000, None)

    async def handle(self, msg):
        return None


class SlowFinalization:
    def __del__(self):
        time.sleep(1.0)


async def main():
    async with ActorSystem() as system:
        scheduler = await system.spawn(Scheduler, name="scheduler", thread=MLX_THREAD,
                                       model=sys.argv[1], config=EngineConfig(block_size=0))
        events = await scheduler.stream(AddRequest(
            request_id="r", prompt_tokens=[1, 2, 3, 4],
            sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))
        assert [e async for e in events if isinstance(e, RequestFinished)]
        await system.spawn(DelayThreadExit, name="delay", thread=MLX_THREAD)
    print("stopped", flush=True)


asyncio.run(main())
slow = SlowFinalization()
"""


def _has_thread_atexit() -> bool:
    try:
        ctypes.CDLL(None).__cxa_thread_atexit_impl  # noqa: B018 (glibc's, as C++ uses it)
    except (AttributeError, OSError):
        return False
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _has_thread_atexit(),
                    reason="delays thread_local destructors through glibc")
def test_the_mlx_thread_ending_during_interpreter_finalization_does_not_abort(
    tiny_model_dir: Path, tmp_path: Path,
) -> None:
    script = tmp_path / "serve_then_exit.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(tiny_model_dir)], cwd=ROOT, capture_output=True,
        text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TROUPE_HOME": str(tmp_path)},
    )
    assert "stopped" in proc.stdout, proc.stderr[-3000:]
    # Before the fix: -6, "terminate called without an active exception".
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr
