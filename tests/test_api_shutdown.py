"""SIGTERM on ``troupe serve`` (a real process on the tiny model): streams end cleanly, new
connections are refused at once, and the process exits 0 within the grace period. SIGHUP (the
terminal that started it closed) stops it the same way; a second server on its cache
directory refuses to start.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from http_stack import parse_data_sse, serve_logged

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Served:
    proc: subprocess.Popen[str]
    host: str
    port: int
    model: str
    log: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def refuses_connections(self) -> bool:
        try:
            socket.create_connection((self.host, self.port), timeout=0.5).close()
        except ConnectionRefusedError:
            return True
        return False


def _args(model_dir: Path, *args: str) -> list[str]:
    """``troupe serve``'s arguments on ``model_dir`` and a free port."""
    return ["--model", str(model_dir), "--port", "0", *args]


def _env(home: Path) -> dict[str, str]:
    # TROUPE_HOME: the default cache directory is $TROUPE_HOME/kv-cache.
    return {**os.environ, "PYTHONPATH": str(ROOT), "TROUPE_HOME": str(home),
            "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def serve(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Callable[[float], Served]]:
    procs: list[subprocess.Popen[str]] = []

    def start(grace: float) -> Served:
        proc, log, match = serve_logged(
            _args(tiny_model_dir, "--shutdown-grace", str(grace)), _env(tmp_path), ROOT)
        procs.append(proc)
        return Served(proc, match["host"], int(match["port"]), match["model"], log)

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _stream(served: Served, max_tokens: int) -> Iterator[bytes]:
    body = {"model": served.model, "prompt": "The quick brown fox", "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        yield from resp.iter_raw()


def test_sigterm_ends_a_long_stream_cleanly_refuses_new_connections_and_exits_0(
    serve: Callable[[float], Served],
) -> None:
    grace = 1.0
    served = serve(grace)
    chunks = _stream(served, max_tokens=1900)  # far longer than the grace period
    received = next(chunks)
    served.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    deadline = signalled + 1.5
    while not served.refuses_connections():
        assert time.monotonic() < deadline, "new connections are still accepted"
        time.sleep(0.05)
    assert served.proc.poll() is None  # still finishing the request in flight
    received += b"".join(chunks)  # ends without an error: the connection was not cut
    ended = time.monotonic() - signalled
    events = parse_data_sse(received.decode())
    assert all("choices" in event for event in events[:-1])
    assert served.proc.wait(timeout=grace + 10) == 0, "".join(served.log)
    log = "".join(served.log)
    assert "stopping the actors" in log
    if "error" in events[-1]:
        assert events[-1] == {"error": {"message": "The server is shutting down.",
                                        "type": "server_error", "param": None, "code": None}}
        assert "aborting 1 request(s)" in log
        assert ended >= grace - 0.5  # it had its grace period
    else:  # a machine fast enough to generate 1900 tokens within the grace period
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert ended < grace + 0.5


def test_sigterm_lets_a_request_in_flight_finish_then_exits_0(
    serve: Callable[[float], Served],
) -> None:
    served = serve(30.0)
    chunks = _stream(served, max_tokens=600)
    received = next(chunks)
    served.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    received += b"".join(chunks)
    events = parse_data_sse(received.decode())
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert served.proc.wait(timeout=30) == 0, "".join(served.log)
    assert time.monotonic() - signalled < 20  # it did not sit out the whole grace period


def test_sighup_stops_the_server_as_sigterm_does_with_a_log_line(
    serve: Callable[[float], Served],
) -> None:
    served = serve(30.0)
    chunks = _stream(served, max_tokens=600)
    received = next(chunks)
    served.proc.send_signal(signal.SIGHUP)
    received += b"".join(chunks)
    events = parse_data_sse(received.decode())
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert served.proc.wait(timeout=30) == 0, "".join(served.log)
    log = "".join(served.log)
    assert "received SIGHUP" in log and "stopping the actors" in log


def test_a_second_server_on_the_same_cache_directory_exits_naming_it_and_the_first(
    serve: Callable[[float], Served], tiny_model_dir: Path, tmp_path: Path,
) -> None:
    served = serve(30.0)
    second = subprocess.run([sys.executable, "-m", "troupe.api.cli", "serve",
                             *_args(tiny_model_dir)], cwd=ROOT, env=_env(tmp_path),
                            capture_output=True, text=True, timeout=120)
    assert second.returncode == 1
    assert f"the cache directory {tmp_path / 'kv-cache'} is in use by another troupe server " \
           f"(pid {served.proc.pid})" in second.stderr, second.stderr
    assert f"loaded {served.model} from" not in second.stderr  # it stopped before a load
    with httpx.Client() as client:  # the first serves on
        assert client.get(f"{served.url}/health").status_code == 200
