"""The server under test: ``troupe serve`` as a subprocess with the soak's small limits, started,
SIGTERMed and ``kill -9``ed, one log file per instance; its RSS and open fds from /proc.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from troupe.tools.soak.settings import (
    BODY_TIMEOUT_S,
    CACHE_DISK_MAX,
    CACHE_RAM_MAX,
    IDLE_TIMEOUT_S,
    MAX_BODY_BYTES,
    MAX_QUEUE,
    MAX_TOKENS_LIMIT,
    SHUTDOWN_GRACE_S,
    STARTUP_TIMEOUT_S,
)

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_usage(pid: int) -> tuple[int, int] | None:
    """(resident bytes, open fds) of a live process, from /proc; None when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        rss_kb = next(int(line.split()[1]) for line in status.splitlines()
                      if line.startswith("VmRSS:"))
        return rss_kb * 1024, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration, ValueError):
        return None


class Server:
    """``troupe serve`` as a subprocess on a fixed port and cache directory; each start is a
    new instance (numbered from 1) with a log file of its own."""

    def __init__(self, out: Path, port: int, model: str | None, cache_dir: Path) -> None:
        self.out = out
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.flags = [
            "--host", "127.0.0.1", "--port", str(port), "--cache-dir", str(cache_dir),
            "--max-queue", str(MAX_QUEUE), "--idle-timeout", str(IDLE_TIMEOUT_S),
            "--body-timeout", str(BODY_TIMEOUT_S), "--max-body-bytes", str(MAX_BODY_BYTES),
            "--cache-ram-max", str(CACHE_RAM_MAX), "--cache-disk-max", str(CACHE_DISK_MAX),
            "--shutdown-grace", str(SHUTDOWN_GRACE_S),
            "--max-tokens-limit", str(MAX_TOKENS_LIMIT),
        ] + (["--model", model] if model else [])
        self.proc: subprocess.Popen[bytes] | None = None
        self.instance = 0
        self.logs: list[Path] = []
        self.exit_codes: dict[int, int | None] = {}

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "troupe.api.cli", "serve", *self.flags]

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    async def start(self) -> float:
        """Start a new instance; return the seconds it took to answer /health."""
        self.instance += 1
        log = self.out / f"server-{self.instance}.log"
        self.logs.append(log)
        began = time.monotonic()
        with log.open("wb") as f:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                self.command, stdout=f, stderr=subprocess.STDOUT,
                cwd=REPO if (REPO / "api").is_dir() else None,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        deadline = began + STARTUP_TIMEOUT_S
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server instance {self.instance} exited during start-up "
                                       f"(status {self.proc.returncode}); see {log}")
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(f"{self.base}/health") as resp:
                        if resp.status == 200:
                            return time.monotonic() - began
                await asyncio.sleep(0.25)
        raise RuntimeError(f"server instance {self.instance} not healthy in "
                           f"{STARTUP_TIMEOUT_S:.0f}s; see {log}")

    async def terminate(self, timeout: float) -> int | None:
        """SIGTERM, then wait for the exit status (None: it did not exit in time, and was
        killed)."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return None if proc is None else proc.returncode
        proc.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.to_thread(proc.wait, timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait)
            code = None
        self.exit_codes[self.instance] = code
        return code

    async def kill(self) -> None:
        """``kill -9``."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            code = await asyncio.to_thread(self.proc.wait)
            self.exit_codes[self.instance] = code
