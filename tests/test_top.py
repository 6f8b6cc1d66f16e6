"""``troupe top`` against a running server, in a pseudo-terminal: it draws the actors in place
(the terminal's alternate screen) and quits on ``q``.

A pty from the standard library is what tmux would give the command, with nothing to install;
the screen is read from the bytes the command writes, escape sequences taken out.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import http_stack
import pytest

from troupe.api.server import HttpServer
from troupe.runtime import Actor

ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\x1b[=>]")
ALT_SCREEN_ON, ALT_SCREEN_OFF = b"\x1b[?1049h", b"\x1b[?1049l"


class Gadget(Actor):
    async def handle(self, msg: Any) -> None:
        return None


@pytest.fixture
async def server() -> AsyncIterator[HttpServer]:
    async with http_stack.scripted_system() as stack:
        await stack.system.spawn(Gadget, name="gadget", thread="gadget-thread")
        served = await stack.start(api_key="sekret")
        try:
            yield served
        finally:
            await served.close()


def _top(*args: str, **popen: Any) -> subprocess.Popen[bytes]:
    env = {**os.environ, "TERM": "xterm-256color"}
    env.pop("TROUPE_API_KEY", None)
    return subprocess.Popen([sys.executable, "-m", "troupe.api.cli", "top", *args], cwd=ROOT,
                            env=env, **popen)


def _read_until(fd: int, want: list[bytes], timeout: float) -> bytes:
    """What the command wrote until the screen (escape sequences taken out) shows ``want``."""
    seen = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                seen += os.read(fd, 65536)
            except OSError:  # the command ended and closed the terminal
                break
            if all(w in ANSI.sub(b"", seen) for w in want):
                return seen
    raise AssertionError(f"never drew {want}: {ANSI.sub(b'', seen)[-2000:]!r}")


async def test_top_draws_the_actors_in_place_and_quits_on_q(server: HttpServer) -> None:
    master, slave = pty.openpty()
    # A terminal of 140 x 40: what rich lays the screen out for.
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 140, 0, 0))
    top = _top("--url", server.url, "--api-key", "sekret",
               stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    try:
        drawn = await asyncio.to_thread(
            _read_until, master, [b"admission", b"gadget", b"gadget-thread", b"live"], 30.0)
        assert ALT_SCREEN_ON in drawn  # redrawn in place, not scrolled
        os.write(master, b"q")
        assert await asyncio.to_thread(top.wait, 10) == 0
        rest = await asyncio.to_thread(_drain, master)
        assert ALT_SCREEN_OFF in drawn + rest  # the terminal is given back as it was
    finally:
        if top.poll() is None:
            top.kill()
            top.wait(5)
        os.close(master)


def _drain(fd: int) -> bytes:
    out = b""
    while select.select([fd], [], [], 0.2)[0]:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    return out


async def test_top_once_prints_a_snapshot_and_says_when_the_key_is_missing(
    server: HttpServer,
) -> None:
    pipes: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    ok = _top("--url", server.url, "--api-key", "sekret", "--once", **pipes)
    out, err = await asyncio.to_thread(ok.communicate, timeout=30)
    assert ok.returncode == 0, err
    text = ANSI.sub(b"", out).decode()
    assert "admission" in text and "gadget" in text and "running" in text
    refused = _top("--url", server.url, "--once", **pipes)
    out, err = await asyncio.to_thread(refused.communicate, timeout=30)
    assert refused.returncode == 1 and b"API key" in err
