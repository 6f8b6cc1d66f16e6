"""``troupe soak``: a bounded soak-and-fault run against a real ``troupe serve`` (issue 18).

One script starts the server on 127.0.0.1 (the bundled model unless ``--model``), with small
limits so that every fault is reachable in minutes, and drives it through phases:

- **baseline**: one request of every kind, the held-back greedy answers, the warm RSS and fds;
- **load**: OpenAI and Anthropic, streamed and whole, short chats, long prompts sharing
  prefixes (prefix hits from RAM and disk), ``tools`` and ``response_format`` requests, at a
  concurrency that steps between 1 and 64; a fifth of the streams cut mid-answer, slow
  readers, slow and stalled bodies, connections that send nothing;
- **burst**: 256 requests at once, against ``--max-queue 64``: what does not fit gets 429;
- **disk_full**, **disk_deleted**, **disk_readonly**, **disk_corrupt**: the cache directory
  (on a small tmpfs when run as root) filled to ENOSPC, deleted, made read-only, its block
  files truncated and overwritten, all while serving;
- **kill9**: ``kill -9`` while blocks are being written, then a restart on the same cache;
- **sigterm**: SIGTERM with streams in flight: each ends cleanly, the exit status is 0;
- **final**: traffic again, then a clean stop.

The bad-input corpus (``api/soak_corpus.py``) is replayed throughout. After every phase: the
server answers ``/health``; greedy answers to held-back prompts are those of the baseline; no
corrupt block was loaded; RSS and open fds are within their bounds; every request got exactly
one terminal outcome. A lost request, a 5xx, a crash, a changed greedy answer, a corrupt
block loaded or a leak fails the run (exit status 1). Writes ``soak.json``, ``soak.md`` and
``soak.png`` (RSS, latency and throughput over time) and the server logs to ``--out``.

    troupe soak                       # 10 minutes, results in soak-results/
    troupe soak --minutes 2 --out /tmp/soak
    make soak ARGS="--minutes 2"

A client only: aiohttp and raw sockets, never MLX.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import platform
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from api.soak_corpus import (
    CHAT,
    MESSAGES,
    Case,
    Shape,
    build_corpus,
    error_shape_problem,
    request_bytes,
)

# --- settings --------------------------------------------------------------------------------

DEFAULT_MINUTES = 10.0
# The server's limits: small, so that a short run reaches each of them.
MAX_QUEUE = 64  # a burst of 256 overflows it; the load's 64 clients fit
IDLE_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 3.0
MAX_BODY_BYTES = 256 * 1024
SHUTDOWN_GRACE_S = 3.0
# The longest answer the soak asks for (sigterm's stories); a huge max_tokens is cut to it.
MAX_TOKENS_LIMIT = 256
# About 8 blocks of the default model (64 tokens, ~2.9 MB each): most prefix hits come from
# disk, where corrupt blocks can be served if anything is wrong.
CACHE_RAM_MAX = 24 * 10**6
# A disk smaller than the cache's quota (the case ENOSPC comes from): with a quota below the
# disk's size, the index evicts before each write once at its quota, so a write never finds
# the disk full. The tmpfs holds what a long run writes before disk_full fills it (about 20
# blocks a minute here), and disk_deleted empties it for the phases after.
CACHE_DISK_MAX = 2**30
TMPFS_BYTES = 256 * 2**20

MAX_CONCURRENCY = 64
CONCURRENCY_LEVELS = (1, 8, 32, MAX_CONCURRENCY, 16, 4, 48, 2)
BURST = 256
REQUEST_TIMEOUT_S = 180.0
STARTUP_TIMEOUT_S = 600.0  # the first start may convert the default model
CORPUS_EVERY_S = 0.5
CORPUS_IN_FLIGHT = 4
# The answers per second the server keeps up (paces how much work a phase starts): a
# moving average, and its floor.
CAPACITY_EWMA = 0.2
MIN_RATE = 0.2
# How long probes look for a fault's effect on the SSD writer (or half the phase, if longer).
FAULT_WINDOW_S = 30.0
SLOW_READ_S = 0.2
SLOW_BODY_PIECES, SLOW_BODY_PAUSE_S = 3, 0.3  # 0.9 s in all: well inside the body timeout
MIN_PHASE_S = 5.0
# What a crash leaves in the server's log: a traceback, a fatal error, a C++ abort at exit.
CRASH_MARKS = ("Traceback (most recent call last)", "Fatal Python error", "terminate called")
# Leak bounds over the warm baseline (Soak.check_resources says why these).
RSS_SLACK = 0.5
FD_SLACK = 16
# How long the soak leaves the server quiet after a phase before it reads RSS: the engine
# gives back what it holds beyond the model and the cache 2 s after its last request
# (IDLE_RELEASE_S in actors/scheduler.py), then the C heap and MLX's buffer cache shrink.
RELEASE_WAIT_S = 4.0

# Outcomes: every request gets exactly one. The first are answers a server may give; the
# last three fail the run.
ACCEPTED = ("complete", "refused", "rate_limited", "unavailable", "client_cut", "idle_closed",
            "killed", "shutdown")
FAILED = ("server_error", "bad_answer", "lost")

REPO = Path(__file__).resolve().parents[1]


# --- what the clients send -------------------------------------------------------------------

_WORDS = (
    "river valley stone mountain village harbour lantern orchard meadow bridge tower market "
    "winter summer autumn spring keeper ship storm candle letter garden forest island road "
    "miller baker weaver sailor teacher bell clock window door roof field wheat barley salt "
    "copper silver quiet bright slow early late old new distant narrow wide green grey"
).split()
_QUESTIONS = (
    "Summarise the text in one sentence.", "Which place is named first?",
    "What is the mood of the text?", "Name one object in the text.",
    "Give the text a short title.", "Which season does the text describe?",
)
_SHORT = (
    "What is the capital of Italy?", "Name a fruit that is red.", "How many legs has a cat?",
    "Say hello in French.", "What colour is the sky?", "Name a large ocean.",
    "What is two plus three?", "Name a musical instrument.",
)
FAMILIES = 6  # long documents whose prompts share a prefix


def document(key: str, words: int) -> str:
    """A deterministic text of about ``words`` words (~1.3 tokens each), different per key."""
    rng = random.Random(key)
    sentences, count = [], 0
    while count < words:
        n = rng.randint(8, 14)
        sentence = " ".join(rng.choice(_WORDS) for _ in range(n))
        sentences.append(sentence[0].upper() + sentence[1:] + ".")
        count += n
    return f"Document {key}. " + " ".join(sentences)


WEATHER_TOOL = {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]},
}
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24},
                   "country": {"type": "string", "maxLength": 24}},
    "required": ["city", "country"], "additionalProperties": False,
}


@dataclass(frozen=True, slots=True)
class Spec:
    """One request to make: its kind (for the report), route, JSON body and client fault."""

    kind: str
    path: str
    body: dict[str, Any]
    # None, "cut" (close the stream mid-answer), "slow_read", "slow_body" (the body sent in
    # pieces, within the body timeout), "stall_body" (half a body, then nothing: 408).
    fault: str | None = None
    cut_after: int = 0  # content events read before a "cut"

    @property
    def shape(self) -> Shape:
        return "anthropic" if self.path.startswith(MESSAGES) else "openai"

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


class Traffic:
    """Makes the requests of the mix: ``spec(kind, rng)`` for one of ``KINDS``."""

    KINDS = ("chat", "messages", "prefix", "tools", "json", "unique", "idle")

    def __init__(self, model: str) -> None:
        self.model = model
        self.families = [document(f"family-{i}", 110) for i in range(FAMILIES)]
        self._unique = 0

    def _messages(self, text: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": text}]

    def _body(self, anthropic: bool, text: str, max_tokens: int, rng: random.Random,
              stream: bool, **fields: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": self._messages(text),
                                "max_tokens": max_tokens,
                                "temperature": rng.choice((0.0, 0.7)), **fields}
        if stream:
            body["stream"] = True
            if not anthropic:
                body["stream_options"] = {"include_usage": True}
        return body

    def unique_text(self) -> str:
        """A long prompt no other request shares: its blocks are new, so they are written."""
        self._unique += 1
        return document(f"unique-{self._unique}-{time.monotonic_ns()}", 100)

    def spec(self, kind: str, rng: random.Random) -> Spec:
        """One request of ``kind``, with its route, streaming and client fault drawn."""
        anthropic = rng.random() < 0.4
        path = MESSAGES if anthropic else CHAT
        if kind == "idle":
            return Spec("idle", path, {})
        if kind in ("tools", "json"):
            return Spec(kind, path, self._agent_body(kind, anthropic, rng))
        stream = rng.random() < (0.3 if kind in ("prefix", "unique") else 0.5)
        if kind == "prefix":
            text = f"{rng.choice(self.families)}\n\n{rng.choice(_QUESTIONS)}"
            max_tokens = 6
        elif kind == "unique":
            text, max_tokens = f"{self.unique_text()}\n\n{rng.choice(_QUESTIONS)}", 4
        else:
            text = f"Question {rng.randrange(10**6)}: {rng.choice(_SHORT)}"
            max_tokens = 8
        fault, cut_after = None, 0
        if stream:
            roll = rng.random()
            if roll < 0.2:  # about a fifth of the streams are cut mid-answer
                fault, cut_after, max_tokens = "cut", rng.randint(1, 3), 32
            elif roll < 0.3:
                fault = "slow_read"
        else:
            roll = rng.random()
            if roll < 0.06:
                fault = "slow_body"
            elif roll < 0.08:
                fault = "stall_body"
        body = self._body(anthropic, text, max_tokens, rng, stream)
        return Spec(kind, path, body, fault, cut_after)

    def _agent_body(self, kind: str, anthropic: bool, rng: random.Random) -> dict[str, Any]:
        text = "What is the weather in Paris?" if kind == "tools" else \
            f"Name a city and its country ({rng.randrange(1000)})."
        body = self._body(anthropic, text, 32, rng, stream=False)
        required = rng.random() < 0.6
        if kind == "tools" and anthropic:
            body["tools"] = [{"name": WEATHER_TOOL["name"],
                              "description": WEATHER_TOOL["description"],
                              "input_schema": WEATHER_TOOL["parameters"]}]
            body["tool_choice"] = {"type": "any" if required else "auto"}
        elif kind == "tools":
            body["tools"] = [{"type": "function", "function": WEATHER_TOOL}]
            body["tool_choice"] = "required" if required else "auto"
        elif anthropic:
            body["output_config"] = {"format": {"type": "json_schema", "schema": CITY_SCHEMA}}
        else:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "city", "schema": CITY_SCHEMA, "strict": True}}
        return body

    def probe(self, family: int | None = None) -> Spec:
        """A greedy two-token request that drives the prefix cache: a unique long prompt
        (new blocks for the SSD writer) or, with ``family``, a traffic family's prompt (its
        blocks read back from RAM or disk)."""
        text = self.unique_text() if family is None else self.families[family % FAMILIES]
        return Spec("probe", CHAT, {"model": self.model, "max_tokens": 2, "temperature": 0,
                                    "messages": self._messages(f"{text}\n\n{_QUESTIONS[0]}")})

    def held_back(self) -> list[Spec]:
        """The greedy probes, never part of the traffic's mix: a short chat, a long prompt
        of their own (its blocks go to RAM and disk, and come back from disk after a
        restart) and, on Anthropic's route, a long prompt sharing a traffic family's prefix."""
        def body(text: str) -> dict[str, Any]:
            return {"model": self.model, "messages": self._messages(text), "max_tokens": 6,
                    "temperature": 0}
        return [
            Spec("held_back", CHAT, body("What is the capital of France?")),
            Spec("held_back", CHAT, body(f"{document('held-back', 150)}\n\n{_QUESTIONS[0]}")),
            Spec("held_back", MESSAGES, body(f"{self.families[0]}\n\nList three words from it.")),
        ]


# --- the ledger: one terminal outcome per request ---------------------------------------------


@dataclass(slots=True)
class Record:
    """One request: when it started (seconds into the run), on which server instance, and
    the one outcome it got."""

    id: int
    phase: str
    kind: str
    fault: str | None
    instance: int
    started: float
    ended: float | None = None
    outcome: str | None = None
    status: int | None = None
    ttft: float | None = None
    tokens: int = 0
    detail: str = ""

    @property
    def latency(self) -> float | None:
        return None if self.ended is None else self.ended - self.started


class Ledger:
    """Every request the soak makes, and the outcome each got: a second outcome for the same
    request is a violation of its own."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.records: list[Record] = []
        self.violations: list[str] = []

    def open(self, phase: str, kind: str, fault: str | None, instance: int) -> Record:
        record = Record(len(self.records), phase, kind, fault, instance, self.clock())
        self.records.append(record)
        return record

    def close(self, record: Record, outcome: str, *, status: int | None = None,
              detail: str = "", tokens: int = 0, ttft: float | None = None) -> None:
        if outcome not in ACCEPTED + FAILED:
            raise ValueError(f"unknown outcome {outcome!r}")
        if record.outcome is not None:
            self.violations.append(f"request {record.id} ({record.kind}) got a second outcome "
                                   f"{outcome!r} after {record.outcome!r}")
            return
        record.ended, record.outcome, record.status = self.clock(), outcome, status
        record.detail, record.tokens, record.ttft = detail[:300], tokens, ttft

    def of_phase(self, phase: str) -> list[Record]:
        return [r for r in self.records if r.phase == phase]


# --- the server process ----------------------------------------------------------------------


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
        return [sys.executable, "-m", "api.cli", "serve", *self.flags]

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


# --- the cache directory and its faults ------------------------------------------------------


@dataclass(slots=True)
class Corruption:
    """A block file the soak damaged: how, and what it held and when, right after."""

    path: Path
    how: str  # "truncate", "garbage" (every byte) or "flip" (tensor bytes only, header intact)
    digest: str
    mtime_ns: int


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class CacheDisk:
    """The server's cache directory: on a small tmpfs of its own when run as root (so that
    it can fill up and be remounted read-only), else a plain directory under --out."""

    def __init__(self, out: Path) -> None:
        self.mount = out / "cache-mount"
        self.dir = self.mount / "kv"
        self.tmpfs = False  # the cache was put on a tmpfs of its own
        self.mounted = False
        self.tmpfs_reason: str | None = None
        self.filler = self.mount / "filler"
        self.corruptions: list[Corruption] = []
        self._chmodded: list[Path] = []
        self._readonly_remount = False

    def setup(self) -> None:
        self.mount.mkdir(parents=True, exist_ok=True)
        if os.geteuid() != 0:
            self.tmpfs_reason = "not root: cannot mount a tmpfs"
        elif shutil.which("mount") is None:
            self.tmpfs_reason = "no mount command"
        else:
            done = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES},mode=0755", "tmpfs",
                 str(self.mount)], capture_output=True, text=True)
            self.tmpfs = self.mounted = done.returncode == 0
            if not self.tmpfs:
                self.tmpfs_reason = f"mount -t tmpfs failed: {done.stderr.strip()[:200]}"
        self.dir.mkdir(parents=True, exist_ok=True)

    def teardown(self) -> None:
        """Put everything back: writable, unmounted, the cache's files gone (hundreds of MB
        that no later run reads). Safe to call more than once."""
        with contextlib.suppress(OSError, subprocess.CalledProcessError):
            self.set_writable()
        if self.mounted:
            done = subprocess.run(["umount", str(self.mount)], capture_output=True)
            if done.returncode != 0:  # still busy (a server that would not die): detach it
                subprocess.run(["umount", "-l", str(self.mount)], capture_output=True)
            self.mounted = False
        shutil.rmtree(self.mount, ignore_errors=True)

    # -- faults --

    def fill(self) -> int:
        """Fill the file system with one file until it is full (ENOSPC); its size."""
        written = 0
        block = b"\0" * (1 << 20)
        with open(self.filler, "wb", buffering=0) as f:
            while True:
                try:
                    written += f.write(block)
                except OSError:
                    break
        return written

    def unfill(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.filler.unlink()

    def set_readonly(self) -> str | None:
        """Make the cache read-only; the reason it cannot be, or None. As root the permission
        bits do not bind, so the tmpfs is remounted read-only instead."""
        if os.geteuid() == 0:
            if not self.tmpfs:
                return f"root ignores permission bits and there is no tmpfs ({self.tmpfs_reason})"
            for _ in range(50):  # EBUSY while the writer has a temp file open: try again
                done = subprocess.run(["mount", "-o", "remount,ro", str(self.mount)],
                                      capture_output=True, text=True)
                if done.returncode == 0:
                    self._readonly_remount = True
                    return None
                time.sleep(0.1)
            return f"remount read-only failed: {done.stderr.strip()[:200]}"
        dirs = [self.dir, *(p for p in self.dir.iterdir() if p.is_dir())]
        for d in dirs:
            d.chmod(0o555)
        self._chmodded = dirs
        return None

    def set_writable(self) -> None:
        if self._readonly_remount:
            subprocess.run(["mount", "-o", "remount,rw", str(self.mount)], check=True,
                           capture_output=True)
            self._readonly_remount = False
        for d in self._chmodded:
            with contextlib.suppress(FileNotFoundError):
                d.chmod(0o755)
        self._chmodded = []

    def delete(self) -> int:
        """Delete the whole cache directory; how many block files it held."""
        blocks = len(self.block_files())
        shutil.rmtree(self.dir, ignore_errors=True)
        return blocks

    def block_files(self) -> list[Path]:
        return sorted(self.dir.glob("??/*.safetensors"))

    def temp_files(self) -> list[Path]:
        return sorted(self.dir.glob("??/.*.tmp"))

    def corrupt(self, rng: random.Random, limit: int) -> list[Corruption]:
        """Damage up to ``limit`` block files in place, the three ways in turn. A file the
        server replaced or removed meanwhile is passed over."""
        files = self.block_files()
        rng.shuffle(files)
        done: list[Corruption] = []
        for i, path in enumerate(files[:limit]):
            how = ("truncate", "garbage", "flip")[i % 3]
            try:
                with open(path, "r+b") as f:
                    data = bytearray(f.read())
                    if how == "truncate":
                        data = data[: len(data) // 2]
                    elif how == "garbage":
                        data = bytearray(rng.randbytes(len(data)))
                    else:  # 4 KB of 0xFF (NaN) inside the tensor data; size and header kept
                        start = 8 + int.from_bytes(data[:8], "little")
                        at = start + max(0, (len(data) - start - 4096) // 2)
                        data[at:at + 4096] = b"\xff" * len(data[at:at + 4096])
                    f.seek(0)
                    f.write(data)
                    f.truncate(len(data))
                mtime_ns = path.stat().st_mtime_ns
            except (OSError, ValueError):
                continue
            done.append(Corruption(path, how, _digest(bytes(data)), mtime_ns))
        self.corruptions += done
        return done

    def corrupt_loaded(self) -> list[Corruption]:
        """Damaged files the server read and took: still as the soak left them, but touched
        since. The SSD writer sets a block's mtime when it serves it (the LRU order a restart
        rebuilds); nothing else touches a file without rewriting it."""
        loaded = []
        for c in self.corruptions:
            try:
                st = c.path.stat()
                if st.st_mtime_ns != c.mtime_ns and _digest(c.path.read_bytes()) == c.digest:
                    loaded.append(c)
            except OSError:
                continue
        return loaded

    def corrupt_present(self, hows: tuple[str, ...]) -> list[Corruption]:
        """Damaged files still on disk as the soak left them, of the given kinds."""
        present = []
        for c in self.corruptions:
            if c.how not in hows:
                continue
            with contextlib.suppress(OSError):
                if _digest(c.path.read_bytes()) == c.digest:
                    present.append(c)
        return present


# --- HTTP on raw sockets (bodies sent slowly, nothing sent, the corpus) ------------------------


@dataclass(frozen=True, slots=True)
class RawAnswer:
    status: int
    headers: dict[str, str]
    body: bytes


def parse_answer(raw: bytes) -> RawAnswer | None:
    """The HTTP/1.1 response in ``raw`` (read until the server closed), None for no bytes.
    Raises ValueError for bytes that are not a whole response."""
    if not raw:
        return None
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        raise ValueError("a response head that never ended")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        out, rest = b"", body
        while True:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2:]
        body = out
    elif "content-length" in headers and len(body) < int(headers["content-length"]):
        raise ValueError(f"{len(body)} of {headers['content-length']} body bytes")
    return RawAnswer(status, headers, body)


async def raw_exchange(port: int, parts: list[bytes], *, pause: float = 0.0,
                       timeout: float = 30.0) -> RawAnswer | None:
    """Send ``parts`` on a new connection, ``pause`` seconds apart, then read until the server
    closes it. A server that stops reading (it answered early) is not an error: the answer
    is read all the same."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        async with asyncio.timeout(timeout):
            for i, part in enumerate(parts):
                if i and pause:
                    await asyncio.sleep(pause)
                try:
                    writer.write(part)
                    await writer.drain()
                except ConnectionError:
                    break
            chunks: list[bytes] = []
            try:
                while chunk := await reader.read(1 << 16):
                    chunks.append(chunk)
            except ConnectionError:
                if not chunks:  # a reset after the answer loses nothing; before it, all
                    raise
            return parse_answer(b"".join(chunks))
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def json_or_none(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None


# --- judging answers -------------------------------------------------------------------------


def judge_refusal(status: int, retry_after: str | None, body: bytes, shape: Shape
                  ) -> tuple[str, str]:
    """The outcome of a non-200 answer, and why: a 4xx, 429 or 503 must come with its error
    body in the route's shape (a 429 with Retry-After in seconds); any other 5xx fails."""
    parsed = json_or_none(body)
    if status >= 500 and status != 503:
        return "server_error", f"HTTP {status}: {body[:200]!r}"
    problem = error_shape_problem(shape, status, parsed)
    if problem:
        return "bad_answer", f"HTTP {status}: {problem}: {body[:200]!r}"
    if status == 429:
        if retry_after is None or not retry_after.isdigit():
            return "bad_answer", f"429 with Retry-After {retry_after!r}"
        return "rate_limited", f"Retry-After {retry_after}"
    message = parsed["error"]["message"]
    return ("unavailable" if status == 503 else "refused"), f"HTTP {status}: {message[:200]}"


def judge_answer(spec: Spec, body: Any) -> tuple[str | None, int]:
    """What is wrong with a whole 200 answer (None: nothing), and its completion tokens.
    Constrained answers that ended by themselves must hold to their constraint."""
    if not isinstance(body, dict):
        return "not a JSON object", 0
    try:
        if spec.shape == "openai":
            choice = body["choices"][0]
            finish, message = choice["finish_reason"], choice["message"]
            tokens = body["usage"]["completion_tokens"]
            if finish not in ("stop", "length", "tool_calls"):
                return f"finish_reason {finish!r}", tokens
            if spec.kind == "tools" and spec.body.get("tool_choice") == "required":
                if finish == "tool_calls":
                    for call in message["tool_calls"]:
                        json.loads(call["function"]["arguments"])
                elif finish != "length":
                    return f"tool_choice required but finish_reason {finish!r}", tokens
            if spec.kind == "json" and finish == "stop":
                return _schema_problem(message["content"]), tokens
            return None, tokens
        stop, blocks = body["stop_reason"], body["content"]
        tokens = body["usage"]["output_tokens"]
        if stop not in ("end_turn", "max_tokens", "stop_sequence", "tool_use"):
            return f"stop_reason {stop!r}", tokens
        if spec.kind == "tools" and spec.body.get("tool_choice") == {"type": "any"}:
            if stop == "tool_use":
                if not all(isinstance(b["input"], dict) for b in blocks if b["type"] == "tool_use"):
                    return "a tool_use block whose input is not an object", tokens
            elif stop != "max_tokens":
                return f"tool_choice any but stop_reason {stop!r}", tokens
        if spec.kind == "json" and stop == "end_turn":
            text = "".join(b["text"] for b in blocks if b["type"] == "text")
            return _schema_problem(text), tokens
        return None, tokens
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        return f"malformed answer ({type(exc).__name__}: {exc})", 0


def _schema_problem(text: str) -> str | None:
    value = json_or_none(text.encode())
    if not isinstance(value, dict) or set(value) != set(CITY_SCHEMA["required"]):
        return f"JSON output not matching its schema: {text[:120]!r}"
    return None


# --- the clients -----------------------------------------------------------------------------


class Clients:
    """Sends requests for one phase over one aiohttp session (and raw sockets), and closes
    each in the ledger with its outcome. Never raises for what the server does."""

    def __init__(self, soak: Soak, phase: str) -> None:
        self.soak = soak
        self.phase = phase
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Clients:
        # Keep-alive shorter than the server's idle timeout: a connection is never reused
        # just as the server closes it (a race no server can win).
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=IDLE_TIMEOUT_S / 2)
        self.session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.session is not None
        await self.session.close()

    @property
    def base(self) -> str:
        return self.soak.server.base

    async def send(self, spec: Spec, first: asyncio.Event | None = None) -> Record:
        """Make one request; ``first`` is set when a stream's first content arrives."""
        soak = self.soak
        record = soak.ledger.open(self.phase, spec.kind, spec.fault, soak.server.instance)
        model = spec.kind != "idle"
        soak.busy += model
        soak.busy_peak = max(soak.busy_peak, soak.busy)
        sharing = soak.busy
        try:
            if spec.kind == "idle":
                await self._idle(record)
            elif spec.fault in ("slow_body", "stall_body"):
                await self._raw_body(record, spec)
            else:
                await self._http(record, spec, first)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            soak.broken(record, exc)
        finally:
            soak.busy -= model
            if record.outcome == "complete" and record.latency and spec.kind != "burst":
                # Little's law: the requests in flight over the time each took (a burst's
                # refusals would count as work).
                soak.capacity += CAPACITY_EWMA * (sharing / record.latency - soak.capacity)
        return record

    async def replay(self, case: Case) -> Record:
        """Send one corpus case; it must get exactly the status and shape it names."""
        soak = self.soak
        record = soak.ledger.open(self.phase, "corpus", case.name, soak.server.instance)
        try:
            answer = await raw_exchange(soak.server.port, [case.raw], timeout=60)
        except (OSError, TimeoutError, ValueError) as exc:
            soak.broken(record, exc)
            return record
        if answer is None:
            soak.broken(record, ConnectionError("closed without an answer"))
            return record
        soak.corpus_seen[case.name][answer.status] += 1
        if answer.status == 200:
            outcome, detail = "complete", ""
            body = json_or_none(answer.body)
            if not isinstance(body, dict) or not (body.get("choices") or body.get("content")):
                outcome, detail = "bad_answer", f"200 without an answer: {answer.body[:200]!r}"
        else:
            outcome, detail = judge_refusal(answer.status, answer.headers.get("retry-after"),
                                            answer.body, case.shape)
            if not answer.headers.get("content-type", "").startswith("application/json"):
                outcome, detail = "bad_answer", f"HTTP {answer.status} not in JSON"
        # Queue-full and overload answers are right for any request that reached a model.
        if answer.status != case.status and outcome not in ("rate_limited", "unavailable",
                                                            "server_error"):
            outcome = "bad_answer"
            detail = f"{case.name}: HTTP {answer.status}, expected {case.status}: {detail}"
        soak.ledger.close(record, outcome, status=answer.status, detail=detail)
        return record

    async def _http(self, record: Record, spec: Spec, first: asyncio.Event | None) -> None:
        assert self.session is not None
        ledger = self.soak.ledger
        async with self.session.post(self.base + spec.path, json=spec.body) as resp:
            if resp.status != 200:
                outcome, detail = judge_refusal(resp.status, resp.headers.get("Retry-After"),
                                                await resp.read(), spec.shape)
                if outcome == "refused":  # every request of the traffic is a valid one
                    outcome = "bad_answer"
                ledger.close(record, outcome, status=resp.status, detail=detail)
            elif not spec.stream:
                problem, tokens = judge_answer(spec, json_or_none(await resp.read()))
                ledger.close(record, "bad_answer" if problem else "complete", status=200,
                             detail=problem or "", tokens=tokens)
            else:
                await self._stream(record, spec, resp, first)

    async def _stream(self, record: Record, spec: Spec, resp: aiohttp.ClientResponse,
                      first: asyncio.Event | None) -> None:
        """Read a stream to its end marker (``[DONE]``, ``message_stop``), or cut it."""
        soak, openai = self.soak, spec.shape == "openai"
        contents, tokens, ttft = 0, 0, None
        finish = error = None
        done = False
        async for raw in resp.content:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if openai and data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            content = False
            if openai:
                if "error" in event:
                    error = event["error"]
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    content |= bool(delta.get("content") or delta.get("tool_calls"))
                    finish = choice.get("finish_reason") or finish
            else:
                kind = event.get("type")
                if kind == "error":
                    error = event["error"]
                elif kind == "content_block_delta":
                    content = True
                elif kind == "message_delta":
                    finish = event["delta"]["stop_reason"]
                    tokens = event["usage"]["output_tokens"]
                elif kind == "message_stop":
                    done = True
                    break
            if content:
                contents += 1
                if ttft is None:
                    ttft = soak.clock() - record.started
                    if first is not None:
                        first.set()
                if spec.fault == "cut" and contents >= spec.cut_after:
                    resp.close()  # the client goes away mid-answer
                    soak.ledger.close(record, "client_cut", status=200, ttft=ttft,
                                      tokens=contents)
                    return
            if spec.fault == "slow_read":
                await asyncio.sleep(SLOW_READ_S)
        if error is not None:
            message = str(error.get("message", error))
            if record.instance in soak.terminating and "shutting down" in message:
                soak.ledger.close(record, "shutdown", status=200, ttft=ttft, tokens=tokens,
                                  detail=message)
            else:
                soak.ledger.close(record, "server_error", status=200, ttft=ttft,
                                  detail=f"error event mid-stream: {message}")
        elif done and finish is not None:
            soak.ledger.close(record, "complete", status=200, ttft=ttft,
                              tokens=tokens or contents)
        elif done:
            soak.ledger.close(record, "bad_answer", status=200, detail="ended without a finish")
        else:
            soak.broken(record, ConnectionError("the stream ended without its end marker"))

    async def _raw_body(self, record: Record, spec: Spec) -> None:
        """A body sent in pieces (inside the body timeout: answered), or half a body and then
        nothing (408 once the body timeout passes, and the connection closed)."""
        body = json.dumps(spec.body).encode()
        head = request_bytes("POST", spec.path, b"", content_length=len(body))
        if spec.fault == "stall_body":
            parts, pause, timeout = [head + body[: len(body) // 2]], 0.0, BODY_TIMEOUT_S + 30
        else:
            step = -(-len(body) // SLOW_BODY_PIECES)
            parts = [head] + [body[i:i + step] for i in range(0, len(body), step)]
            pause, timeout = SLOW_BODY_PAUSE_S, REQUEST_TIMEOUT_S
        answer = await raw_exchange(self.soak.server.port, parts, pause=pause, timeout=timeout)
        ledger = self.soak.ledger
        if answer is None:
            self.soak.broken(record, ConnectionError("closed without an answer"))
        elif answer.status == 200:
            problem, tokens = judge_answer(spec, json_or_none(answer.body))
            ledger.close(record, "bad_answer" if problem else "complete", status=200,
                         detail=problem or "", tokens=tokens)
        else:
            outcome, detail = judge_refusal(answer.status, answer.headers.get("retry-after"),
                                            answer.body, spec.shape)
            if outcome == "refused" and not (spec.fault == "stall_body" and answer.status == 408):
                outcome = "bad_answer"
            ledger.close(record, outcome, status=answer.status, detail=detail)

    async def _idle(self, record: Record) -> None:
        """Open a connection and send nothing: the server must close it after its idle
        timeout, without an answer."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.soak.server.port)
        try:
            async with asyncio.timeout(IDLE_TIMEOUT_S + 15):
                data = await reader.read()
        except TimeoutError:
            self.soak.ledger.close(record, "bad_answer", detail="idle connection still open "
                                                                f"after {IDLE_TIMEOUT_S + 15}s")
            return
        finally:
            writer.close()
        if data:
            self.soak.ledger.close(record, "bad_answer", detail=f"idle answered {data[:80]!r}")
        else:
            self.soak.ledger.close(record, "idle_closed")


# --- the run ---------------------------------------------------------------------------------

# (phase, weight): a phase's share of the traffic time. Faults: one per phase after "burst".
PLAN = (("baseline", 1), ("load", 4), ("burst", 1), ("disk_full", 1), ("disk_deleted", 1),
        ("disk_readonly", 1), ("disk_corrupt", 1), ("kill9", 1), ("sigterm", 1), ("final", 1))
RESTARTING = ("kill9", "sigterm")
LOAD_MIX = {"chat": 3, "messages": 2, "prefix": 3, "tools": 1, "json": 1, "unique": 0.5,
            "idle": 0.3}
# New prompt blocks, so that the SSD writer is busy when the server is killed.
WRITE_MIX = {"unique": 3, "prefix": 1, "chat": 1, "messages": 1}


@dataclass
class Phase:
    """One phase as it ran: its traffic time, the fault it injected, what was checked after."""

    name: str
    started: float
    seconds: float
    ended: float = 0.0
    fault: dict[str, Any] | None = None
    checks: dict[str, Any] = field(default_factory=dict)
    concurrency_max: int = 0  # model requests in flight at once, at most

    def inject(self, name: str, **evidence: Any) -> dict[str, Any]:
        self.fault = {"name": name, "injected": True, "skipped": None, "evidence": evidence}
        return self.fault["evidence"]

    def skip(self, name: str, reason: str) -> None:
        self.fault = {"name": name, "injected": False, "skipped": reason, "evidence": {}}


class Soak:
    """The whole run: the server, its disk, the ledger, the phases, the checks, the report."""

    def __init__(self, minutes: float, out: Path, model: str | None, seed: int,
                 port: int, command: str = "troupe soak") -> None:
        self.minutes = minutes
        self.command = command
        self.out = out
        self.seed = seed
        self.rng = random.Random(seed)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + minutes * 60
        self.ledger = Ledger(self.clock)
        self.disk = CacheDisk(out)
        self.server = Server(out, port or free_port(), model, self.disk.dir)
        self.traffic = Traffic(model or "")
        self.corpus: list[Case] = []
        self.corpus_next = 0
        self.corpus_seen: dict[str, Counter[int]] = {}
        self.phases: list[Phase] = []
        self.failures: list[str] = []
        self.samples: list[tuple[float, int, str, float, int]] = []
        self.reference: list[str] | None = None
        self.baseline: dict[str, float] | None = None
        # RSS at the first start, and after the load once the idle engine gave memory back.
        self.rss: dict[str, Any] = {}
        self.bursts: list[dict[str, Any]] = []
        self.killed: set[int] = set()
        self.terminating: set[int] = set()
        self.counters: dict[int, dict[str, Any]] = {}
        self.crashes_seen: dict[Path, int] = {}
        self.loaded_seen: set[Path] = set()
        self.current = "start"
        self.check_s = 8.0  # a checkpoint's time, then as measured
        self.start_s = 15.0  # a restart's time, then as measured
        self.first_start_s = 0.0
        # Requests to the model in flight, the most at once this phase, and the answers per
        # second the server has kept up: how long what is in flight will take to drain.
        self.busy = 0
        self.busy_peak = 0
        self.capacity = 1.0

    def clock(self) -> float:
        """Seconds since the run began."""
        return time.monotonic() - self.t0

    def fail(self, phase: str, message: str) -> None:
        self.failures.append(f"{phase}: {message}")

    def reached(self, phase: Phase, reached: bool) -> None:
        """Record whether the phase's fault had its effect: one that never did tested
        nothing, and fails the run as surely as a server that did not survive it."""
        assert phase.fault is not None
        phase.fault["evidence"]["exercised"] = reached
        if not reached:
            self.fail(phase.name, f"fault {phase.fault['name']} injected, but its effect was "
                                  f"never seen: {phase.fault['evidence']}")

    def broken(self, record: Record, exc: BaseException) -> None:
        """A request whose connection failed. On an instance the soak killed, that is the
        fault it injected; anywhere else (a stream cut by SIGTERM included) it is lost."""
        if record.outcome is not None:
            return
        detail = f"{type(exc).__name__}: {exc}"
        if record.instance in self.killed:
            self.ledger.close(record, "killed", detail=detail)
        else:
            self.ledger.close(record, "lost", detail=detail)

    # -- the server's side --

    async def get_json(self, path: str) -> Any:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            async with session.get(self.server.base + path) as resp:
                resp.raise_for_status()
                return await resp.json(content_type=None)

    async def health(self) -> bool:
        try:
            return (await self.get_json("/health")) == {"status": "ok"}
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return False

    async def writer(self) -> dict[str, Any]:
        """The SSD writer's report (counters of the running instance)."""
        return (await self.get_json("/actors/ssd_writer"))["report"]

    async def snapshot(self) -> dict[str, Any]:
        """The running instance's counters: the cache actors' reports, admission's, and the
        5xx answers /metrics counted. Kept per instance (each restart starts from zero)."""
        actors = {a["name"]: a for a in await self.get_json("/actors")}
        errors = 0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            async with session.get(self.server.base + "/metrics") as resp:
                for line in (await resp.text()).splitlines():
                    if line.startswith("troupe_http_requests_total{") and 'status="5' in line \
                            and 'status="503"' not in line:
                        errors += int(float(line.rsplit(" ", 1)[1]))
        snap = {
            "ssd_writer": actors.get("ssd_writer", {}).get("report", {}),
            "cache_index": actors.get("cache_index", {}).get("report", {}),
            "admission": actors.get("admission", {}).get("report", {}),
            "restarts": {name: a.get("restarts", 0) for name, a in actors.items()},
            "server_5xx": errors,
        }
        self.counters[self.server.instance] = snap
        return snap

    async def sample_resources(self) -> None:
        """RSS and open fds of the server every second, for the report and the plot."""
        while True:
            pid = self.server.pid
            usage = proc_usage(pid) if pid else None
            if usage is not None:
                self.samples.append((round(self.clock(), 2), self.server.instance, self.current,
                                     round(usage[0] / 2**20, 1), usage[1]))
            await asyncio.sleep(1.0)

    # -- traffic --

    def drains_by(self, end: float) -> bool:
        """Whether one more request would still be answered by ``end`` at the pace the
        server has kept: a phase adds no work its time cannot drain (machines differ)."""
        return time.monotonic() + (self.busy + 1) / max(self.capacity, MIN_RATE) <= end

    def next_case(self) -> Case:
        case = self.corpus[self.corpus_next % len(self.corpus)]
        self.corpus_next += 1
        return case

    async def run_traffic(self, clients: Clients, seconds: float, *,
                      levels: tuple[int, ...] = CONCURRENCY_LEVELS,
                      mix: dict[str, float] | None = None,
                      stop: asyncio.Event | None = None, corpus: bool = True) -> None:
        """Closed-loop clients for ``seconds`` (or until ``stop``): their number steps through
        ``levels``, each drawing requests from ``mix``; the corpus replayed beside them.
        Returns once every request started has its outcome."""
        mix = mix or LOAD_MIX
        end = time.monotonic() + seconds
        stop = stop or asyncio.Event()
        level = levels[0]
        kinds, weights = list(mix), list(mix.values())

        def going() -> bool:
            return not stop.is_set() and time.monotonic() < end

        async def client(i: int) -> None:
            rng = random.Random(f"{self.seed}:{clients.phase}:{i}")
            while going():
                if i >= level or not self.drains_by(end):
                    await asyncio.sleep(0.25)
                    continue
                await clients.send(self.traffic.spec(rng.choices(kinds, weights)[0], rng))

        async def pace() -> None:
            nonlocal level
            step = max(1.0, seconds / len(levels))
            while True:
                for n in levels:
                    level = n
                    await asyncio.sleep(step)

        async def replay() -> None:
            sent: set[asyncio.Task[Record]] = set()
            while going():
                if len(sent) < CORPUS_IN_FLIGHT:  # a case that reaches the model may queue
                    task = asyncio.create_task(clients.replay(self.next_case()))
                    sent.add(task)
                    task.add_done_callback(sent.discard)
                await asyncio.sleep(CORPUS_EVERY_S)
            await asyncio.gather(*sent)

        pacer = asyncio.create_task(pace())
        try:
            await asyncio.gather(*(client(i) for i in range(max(levels))),
                                 *([replay()] if corpus else []))
        finally:
            pacer.cancel()

    async def burst(self, clients: Clients) -> dict[str, Any]:
        """``BURST`` requests at once: each answered or refused with 429 and Retry-After."""
        rng = random.Random(f"{self.seed}:burst:{len(self.bursts)}")
        specs = []
        for _ in range(BURST):
            spec = self.traffic.spec(rng.choice(("chat", "messages")), rng)
            specs.append(Spec("burst", spec.path, {**spec.body, "max_tokens": 8}))
        records = await asyncio.gather(*(clients.send(s) for s in specs))
        outcomes = Counter(r.outcome for r in records)
        retry = [int(r.detail.split()[-1]) for r in records if r.outcome == "rate_limited"]
        result = {"size": BURST, "outcomes": dict(outcomes),
                  "retry_after_s": [min(retry), max(retry)] if retry else None,
                  "overflowed": outcomes["rate_limited"] > 0}
        self.bursts.append(result)
        return result

    # -- phases and checks --

    def phase_seconds(self, name: str) -> float:
        """This phase's traffic time: its weight's share of what the budget has left once
        the remaining checkpoints and restarts are paid for."""
        names = [n for n, _ in PLAN]
        rest = PLAN[names.index(name):]
        overhead = len(rest) * self.check_s + sum(n in RESTARTING for n, _ in rest) * self.start_s
        left = self.deadline - time.monotonic() - overhead
        weight = dict(PLAN)[name]
        return max(MIN_PHASE_S, left * weight / sum(w for _, w in rest))

    @contextlib.asynccontextmanager
    async def phase(self, name: str) -> AsyncIterator[tuple[Phase, Clients]]:
        """Run a phase: the caller's traffic and fault, then the checkpoint."""
        phase = Phase(name, self.clock(), self.phase_seconds(name))
        self.current = name
        self.busy_peak = self.busy
        async with Clients(self, name) as clients:
            yield phase, clients
        phase.concurrency_max = self.busy_peak
        began = time.monotonic()
        phase.checks = await self.checkpoint(phase)
        self.check_s = time.monotonic() - began
        phase.checks["checkpoint_s"] = round(self.check_s, 1)
        phase.ended = self.clock()
        self.phases.append(phase)

    async def held_back(self, phase: str) -> list[str]:
        """The held-back prompts' greedy answers, one at a time, on a quiet server."""
        answers = []
        async with Clients(self, phase) as clients:
            for spec in self.traffic.held_back():
                assert clients.session is not None
                record = self.ledger.open(phase, spec.kind, None, self.server.instance)
                try:
                    async with clients.session.post(self.server.base + spec.path,
                                                    json=spec.body) as resp:
                        body = json_or_none(await resp.read())
                        status = resp.status
                except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                    self.broken(record, exc)
                    answers.append(f"<{type(exc).__name__}>")
                    continue
                if status != 200 or not isinstance(body, dict):
                    self.ledger.close(record, "server_error" if status >= 500 else "bad_answer",
                                      status=status, detail=f"held-back prompt: HTTP {status}")
                    answers.append(f"<HTTP {status}>")
                    continue
                if spec.shape == "openai":
                    text = body["choices"][0]["message"]["content"]
                else:
                    text = "".join(b.get("text", "") for b in body["content"])
                self.ledger.close(record, "complete", status=200)
                answers.append(text)
        return answers

    async def checkpoint(self, phase: Phase) -> dict[str, Any]:
        """The checks after every phase; each failure is recorded, none stops the run."""
        name = phase.name
        checks: dict[str, Any] = {}
        # The phase's connections are closed; give the server a moment to see it.
        await asyncio.sleep(0.5)
        checks["health"] = await self.health()
        if not checks["health"]:
            self.fail(name, "GET /health did not answer {'status': 'ok'}")
        answers = await self.held_back(name)
        if self.reference is None:
            self.reference = answers
        changed = [i for i, (a, b) in enumerate(zip(answers, self.reference, strict=True))
                   if a != b]
        checks["greedy_identical"] = not changed
        for i in changed:
            self.fail(name, f"held-back prompt {i}'s greedy answer changed: "
                            f"{self.reference[i]!r} -> {answers[i]!r}")
        snap = await self.snapshot()
        checks["server_5xx"] = snap["server_5xx"]
        if snap["server_5xx"]:
            self.fail(name, f"the server counted {snap['server_5xx']} 5xx answers (not 503) "
                            f"in instance {self.server.instance}")
        restarted = {name: n for name, n in snap["restarts"].items() if n}
        checks["actor_restarts"] = sum(restarted.values())
        if restarted:
            self.fail(name, f"actors crashed and were restarted: {restarted}")
        checks["corrupt_loaded"] = self.check_corrupt_loaded(name)
        # RSS is read once the quiet engine gave back what the phase freed, at every check
        # alike: the baseline's bound means nothing against a reading taken before it.
        await asyncio.sleep(RELEASE_WAIT_S)
        checks.update(self.check_resources(name))
        checks.update(self.check_ledger(name))
        checks["log_crashes"] = self.check_logs(name)
        return checks

    def check_corrupt_loaded(self, phase: str) -> int:
        """Damaged files the server served since the last look (``CacheDisk.corrupt_loaded``):
        each fails the run."""
        loaded = [c for c in self.disk.corrupt_loaded() if c.path not in self.loaded_seen]
        for c in loaded:
            self.loaded_seen.add(c.path)
            self.fail(phase, f"a corrupt block was loaded ({c.how}): {c.path.name}")
        return len(loaded)

    def check_logs(self, phase: str) -> int:
        """Crashes the server's logs show that no client saw (a traceback, an abort at
        exit), new since the last look; each fails the run."""
        found = 0
        for log in self.server.logs:
            try:
                lines = log.read_text(errors="replace").splitlines()
            except OSError:
                continue
            hits = [i for i, line in enumerate(lines) if any(m in line for m in CRASH_MARKS)]
            new = hits[self.crashes_seen.get(log, 0):]
            self.crashes_seen[log] = len(hits)
            for i in new:
                context = lines[i - 1] if i and "Traceback" in lines[i] else lines[i]
                self.fail(phase, f"{log.name}: {lines[i].strip()[:80]} after {context[:200]!r}")
            found += len(new)
        return found

    def check_resources(self, phase: str) -> dict[str, Any]:
        """RSS and open fds of the quiet server against bounds set from the warm baseline.

        The baseline is taken after the first phase, which has run every kind of request at
        the largest concurrency: the model is loaded, MLX's buffer cache and the grammar
        compiler have their working size. From there a server that does not leak stays flat
        at quiet points. RSS may grow by the RAM cache's budget (it fills over the run) plus
        RSS_SLACK of the baseline (allocator fragmentation, MLX's buffer cache at a larger
        batch); fds by FD_SLACK (log files, the odd connection still closing)."""
        pid = self.server.pid
        usage = proc_usage(pid) if pid else None
        if usage is None:
            self.fail(phase, "the server process is gone")
            return {"rss_mb": None, "fds": None}
        rss_mb, fds = usage[0] / 2**20, usage[1]
        if self.baseline is None:
            self.baseline = {"rss_mb": rss_mb, "fds": fds,
                             "rss_bound_mb": rss_mb * (1 + RSS_SLACK) + CACHE_RAM_MAX / 2**20,
                             "fd_bound": fds + FD_SLACK}
        within = rss_mb <= self.baseline["rss_bound_mb"] and fds <= self.baseline["fd_bound"]
        if not within:
            self.fail(phase, f"resources past their bound: RSS {rss_mb:.0f} MB (bound "
                             f"{self.baseline['rss_bound_mb']:.0f}), {fds} fds (bound "
                             f"{self.baseline['fd_bound']})")
        return {"rss_mb": round(rss_mb, 1), "fds": fds, "resources_within_bounds": within}

    def check_ledger(self, phase: str) -> dict[str, Any]:
        """Every request of the phase has exactly one outcome, and none failed."""
        records = self.ledger.of_phase(phase)
        for r in records:
            if r.outcome is None:
                self.ledger.close(r, "lost", detail="no outcome by the end of its phase")
        outcomes = Counter(r.outcome for r in records)
        failed = [r for r in records if r.outcome in FAILED]
        if failed:
            kinds = Counter(f"{r.outcome}/{r.kind}" for r in failed)
            self.fail(phase, f"{len(failed)} requests failed ({dict(kinds)}); first: "
                             f"{failed[0].detail}")
        return {"requests": len(records), "outcomes": dict(outcomes), "failed": len(failed)}

    async def writer_delta(self, before: dict[str, Any]) -> dict[str, int]:
        """How the SSD writer's counters moved since ``before`` (same instance)."""
        after = await self.writer()
        keys = ("persisted", "failed", "read_blocks", "read_missing", "read_corrupt",
                "blocks_corrupt", "checksum_failures")
        delta = {k: after[k] - before[k] for k in keys}
        delta["dropped_no_space"] = (after["dropped_by_reason"]["no_space"]
                                     - before["dropped_by_reason"]["no_space"])
        return delta

    async def probe_until(self, clients: Clients, probe: Callable[[int], Spec],
                          before: dict[str, Any], reached: Callable[[dict[str, int]], bool],
                          timeout: float) -> dict[str, int]:
        """Send ``probe(i)`` one after the other until the SSD writer's counters since
        ``before`` show ``reached`` (or ``timeout``); the counters' movement."""
        deadline = time.monotonic() + timeout
        delta = await self.writer_delta(before)
        i = 0
        while not reached(delta) and time.monotonic() < deadline:
            await clients.send(probe(i))
            i += 1
            await asyncio.sleep(0.3)  # the blocks go to the writer after the answer
            delta = await self.writer_delta(before)
        return delta

    async def disk_fault(self, name: str, fault: str,
                         inject: Callable[[], dict[str, Any] | str],
                         undo: Callable[[], None] | None, probe: Callable[[int], Spec],
                         reached: Callable[[dict[str, int]], bool],
                         prepare: Callable[[Clients], Awaitable[None]] | None = None) -> None:
        """Traffic throughout; the fault injected once the phase is under way, held while
        probes look for its effect on the SSD writer (the evidence it was reached), then
        undone, and the traffic goes on."""
        async with self.phase(name) as (phase, clients):
            background = asyncio.create_task(
                self.run_traffic(clients, phase.seconds, levels=(2, 4)))
            try:
                if prepare is not None:
                    await prepare(clients)
                before = await self.writer()
                injected = inject()
                if isinstance(injected, str):
                    phase.skip(fault, injected)
                    return
                evidence = phase.inject(fault, **injected)
                try:
                    window = max(FAULT_WINDOW_S, phase.seconds / 2)
                    delta = await self.probe_until(clients, probe, before, reached, window)
                finally:
                    if undo is not None:
                        undo()
                evidence["writer"] = delta
                self.reached(phase, reached(delta))
            finally:
                await background

    async def settle_writer(self, timeout: float = 30.0) -> None:
        """Wait until the SSD writer has nothing queued."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (await self.writer())["pending"]:
            await asyncio.sleep(0.2)

    async def phase_baseline(self) -> None:
        async with self.phase("baseline") as (phase, clients):
            rng = random.Random(f"{self.seed}:warm")
            # Every kind of request once, every family's blocks cached, the whole corpus.
            await asyncio.gather(
                *(clients.send(self.traffic.spec(kind, rng))
                  for kind in ("chat", "messages", "tools", "json", "unique")),
                *(clients.send(self.traffic.probe(i)) for i in range(FAMILIES)),
                *(clients.replay(case) for case in self.corpus))
            # The load's mix at its largest concurrency once, so that the warm baseline has
            # seen what the load does to memory (MLX's buffer cache keeps its high water).
            kinds = [kind for kind in LOAD_MIX if kind != "idle"]
            weights = [LOAD_MIX[kind] for kind in kinds]
            await asyncio.gather(*(clients.send(self.traffic.spec(rng.choices(kinds, weights)[0],
                                                                  rng))
                                   for _ in range(MAX_CONCURRENCY)))
            await self.run_traffic(clients, phase.seconds, levels=(1, 8))

    async def phase_load(self) -> None:
        async with self.phase("load") as (phase, clients):
            await self.run_traffic(clients, phase.seconds)
        await self.released_rss()

    async def released_rss(self) -> None:
        """The quiet server's RSS once its engine has given back the memory the load left
        (MLX's buffer cache, the C heap's free pages: the phase's checks waited for it), and
        how often it did."""
        report = (await self.get_json("/actors/scheduler"))["report"]
        usage = proc_usage(self.server.pid) if self.server.pid else None
        self.rss["after_load_mb"] = round(usage[0] / 2**20, 1) if usage else None
        self.rss["memory_releases"] = report.get("memory_releases")

    async def phase_burst(self) -> None:
        async with self.phase("burst") as (phase, clients):
            evidence = phase.inject("burst_256")
            background = asyncio.create_task(
                self.run_traffic(clients, phase.seconds, levels=(4,)))
            # Two bursts in a long run; a short one has time to drain one.
            bursts = 2 if self.minutes >= 5 else 1
            try:
                for _ in range(bursts):
                    await asyncio.sleep(phase.seconds / 4)
                    await self.burst(clients)
            finally:
                await background
            evidence["bursts"] = self.bursts
            self.reached(phase, all(b["overflowed"] for b in self.bursts))

    async def phase_disk_full(self) -> None:
        def inject() -> dict[str, Any] | str:
            if not self.disk.tmpfs:
                return f"no tmpfs to fill ({self.disk.tmpfs_reason})"
            return {"filled_bytes": self.disk.fill()}

        await self.disk_fault("disk_full", "enospc", inject, self.disk.unfill,
                              lambda i: self.traffic.probe(),
                              lambda w: w["failed"] + w["dropped_no_space"] > 0)

    async def phase_disk_readonly(self) -> None:
        def inject() -> dict[str, Any] | str:
            reason = self.disk.set_readonly()
            if reason is not None:
                return reason
            return {"how": "remount,ro" if os.geteuid() == 0 else "chmod 0555"}

        await self.disk_fault("disk_readonly", "readonly", inject, self.disk.set_writable,
                              lambda i: self.traffic.probe(), lambda w: w["failed"] > 0)

    async def phase_disk_deleted(self) -> None:
        # Families whose blocks the index still places on disk (read_missing), and new
        # blocks that need the directory back (persisted).
        await self.disk_fault(
            "disk_deleted", "deleted", lambda: {"block_files_deleted": self.disk.delete()},
            None, lambda i: self.traffic.probe(None if i % 3 == 2 else i),
            lambda w: w["read_missing"] > 0 and w["persisted"] > 0)

    async def phase_disk_corrupt(self) -> None:
        async def prepare(clients: Clients) -> None:
            # Every family's blocks on disk, then more families than RAM holds: reading
            # them back must come from the damaged files.
            await asyncio.gather(*(clients.send(self.traffic.probe(i)) for i in range(FAMILIES)))
            await self.settle_writer()

        def inject() -> dict[str, Any] | str:
            done = self.disk.corrupt(self.rng, limit=10_000)
            return {"corrupted": dict(Counter(c.how for c in done))}

        await self.disk_fault("disk_corrupt", "corrupt_blocks", inject, None,
                              lambda i: self.traffic.probe(i), lambda w: w["read_corrupt"] > 0,
                              prepare)

    async def phase_kill9(self) -> None:
        async with self.phase("kill9") as (phase, clients):
            evidence = phase.inject("kill9")
            stop = asyncio.Event()
            background = asyncio.create_task(self.run_traffic(
                clients, phase.seconds, levels=(8,), mix=WRITE_MIX, stop=stop))

            async def write() -> None:
                while not stop.is_set():
                    await clients.send(self.traffic.probe())

            writers = [asyncio.create_task(write()) for _ in range(3)]
            # Kill while blocks are being written: queued in the writer, or its count moving.
            began, writing = time.monotonic(), None
            persisted = (await self.writer())["persisted"]
            while writing is None and time.monotonic() - began < FAULT_WINDOW_S:
                await asyncio.sleep(0.05)
                report = await self.writer()
                if report["pending"] > 0:
                    writing = f"{report['pending']} blocks queued in the writer"
                elif report["persisted"] > persisted:
                    writing = "a block just written"
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                await self.snapshot()  # the instance's counters, as late as can be
            stop.set()
            self.killed.add(self.server.instance)
            await self.server.kill()
            evidence["writes_in_flight"] = writing
            await asyncio.gather(background, *writers)
            evidence["temp_files_left"] = len(self.disk.temp_files())
            damaged = self.disk.corrupt_present(("truncate", "garbage"))
            evidence["corrupt_files_at_restart"] = len(damaged)
            self.start_s = await self.server.start()
            skipped = (await self.snapshot())["cache_index"].get("skipped", {})
            evidence["skipped_at_start"] = skipped
            evidence["temp_files_after_restart"] = len(self.disk.temp_files())
            survivors = [c for c in damaged if c.path.exists()]
            if survivors:
                self.fail("kill9", f"{len(survivors)} corrupt block files survived the "
                                   f"restart's scan, e.g. {survivors[0].path.name}")
            if evidence["temp_files_after_restart"]:
                self.fail("kill9", "temp files of the killed writer left after the restart")
            self.reached(phase, writing is not None)
            async with Clients(self, "kill9") as fresh:  # the old connections died with it
                await self.run_traffic(fresh, phase.seconds / 3, levels=(8,))

    async def phase_sigterm(self) -> None:
        async with self.phase("sigterm") as (phase, clients):
            evidence = phase.inject("sigterm")
            specs, firsts = [], []
            for i in range(8):
                # Answers longer than the grace: the shutdown ends them.
                path = CHAT if i % 2 else MESSAGES
                body: dict[str, Any] = {
                    "model": self.traffic.model, "max_tokens": 256, "stream": i < 6,
                    "messages": [{"role": "user", "content": f"Write a long story ({i})."}]}
                if path == CHAT:
                    body["ignore_eos"] = True
                    if i < 6:
                        body["stream_options"] = {"include_usage": True}
                specs.append(Spec("sigterm", path, body))
                firsts.append(asyncio.Event())
            tasks = [asyncio.create_task(clients.send(s, f)) for s, f in zip(specs, firsts,
                                                                            strict=True)]
            with contextlib.suppress(TimeoutError):  # every stream under way, if it can be
                async with asyncio.timeout(60):
                    await asyncio.gather(*(f.wait() for f in firsts[:6]))
            evidence["streams_under_way"] = sum(f.is_set() for f in firsts[:6])
            self.terminating.add(self.server.instance)
            code = await self.server.terminate(SHUTDOWN_GRACE_S + 60)
            records = await asyncio.gather(*tasks)
            evidence["exit_code"] = code
            evidence["outcomes"] = dict(Counter(r.outcome for r in records))
            if code != 0:
                self.fail("sigterm", f"exit status {code} after SIGTERM (expected 0)")
            # A stream under way must end with its answer or the shutdown's error event (one
            # not started by then may get a 503 instead, which the ledger judges).
            unclean = [r for r, first in zip(records[:6], firsts[:6], strict=True)
                       if first.is_set() and r.outcome not in ("complete", "shutdown")]
            if unclean:
                self.fail("sigterm", f"{len(unclean)} streams did not end cleanly: "
                                     f"{unclean[0].outcome}: {unclean[0].detail}")
            self.reached(phase, evidence["streams_under_way"] > 0)
            self.start_s = await self.server.start()
            async with Clients(self, "sigterm") as fresh:
                await self.run_traffic(fresh, max(MIN_PHASE_S, phase.seconds - self.start_s),
                                   levels=(8,))

    async def phase_final(self) -> None:
        async with self.phase("final") as (phase, clients):
            await self.run_traffic(clients, phase.seconds, levels=(8, 32, 1))

    async def run(self) -> dict[str, Any]:
        """Every phase, then the report; the server stopped and the disk put back whatever
        happens."""
        self.out.mkdir(parents=True, exist_ok=True)
        sampler: asyncio.Task[None] | None = None
        started = time.time()
        try:
            self.disk.setup()
            self.first_start_s = await self.server.start()
            usage = proc_usage(self.server.pid) if self.server.pid else None
            self.rss["start_mb"] = round(usage[0] / 2**20, 1) if usage else None
            # The budget counts from here: a first start may convert the model first.
            self.t0 = time.monotonic()
            self.deadline = self.t0 + self.minutes * 60
            models = await self.get_json("/v1/models")
            self.traffic = Traffic(models["data"][0]["id"])
            self.corpus = build_corpus(self.traffic.model, MAX_BODY_BYTES)
            self.corpus_seen = {case.name: Counter() for case in self.corpus}
            sampler = asyncio.create_task(self.sample_resources())
            for run_phase in (self.phase_baseline, self.phase_load, self.phase_burst,
                              self.phase_disk_full, self.phase_disk_deleted,
                              self.phase_disk_readonly, self.phase_disk_corrupt,
                              self.phase_kill9, self.phase_sigterm, self.phase_final):
                await run_phase()
            self.current = "stop"
            self.terminating.add(self.server.instance)
            code = await self.server.terminate(SHUTDOWN_GRACE_S + 60)
            if code != 0:
                self.fail("final", f"exit status {code} on the final SIGTERM (expected 0)")
            self.check_logs("stop")
            self.check_corrupt_loaded("stop")
        except Exception as exc:  # the soak cannot go on: say why, and still report
            self.fail(self.current, f"the run stopped: {type(exc).__name__}: {exc}")
        finally:
            if sampler is not None:
                sampler.cancel()
            if self.server.pid is not None:
                await self.server.kill()
            self.disk.teardown()
        self.failures += [f"ledger: {v}" for v in self.ledger.violations]
        return self.report(started)

    # -- the report --

    def report(self, started: float) -> dict[str, Any]:
        """Everything the run saw, as JSON-ready data (``soak.json``)."""
        records = self.ledger.records
        phases = []
        for p in self.phases:
            recs = self.ledger.of_phase(p.name)
            answered = [r.latency for r in recs if r.outcome == "complete"
                        and r.kind not in ("held_back", "corpus") and r.latency is not None]
            ttfts = [r.ttft for r in recs if r.ttft is not None]
            phases.append({
                "name": p.name, "started_s": round(p.started, 1), "ended_s": round(p.ended, 1),
                "traffic_s": round(p.seconds, 1), "requests": len(recs),
                "concurrency_max": p.concurrency_max,
                "outcomes": dict(Counter(r.outcome for r in recs)),
                "latency_s": {"p50": percentile(answered, 50), "p99": percentile(answered, 99)},
                "ttft_s": {"p50": percentile(ttfts, 50), "p99": percentile(ttfts, 99)},
                "fault": p.fault, "checks": p.checks,
            })
        faults = []
        for p in self.phases:
            if p.fault is not None:
                failed_here = any(f.startswith(f"{p.name}:") for f in self.failures)
                faults.append({"phase": p.name, **p.fault,
                               "survived": p.fault["injected"] and not failed_here})
        client_faults: defaultdict[str, Counter[str | None]] = defaultdict(Counter)
        for r in records:
            if r.fault is not None and r.kind != "corpus":
                client_faults[r.fault][r.outcome] += 1
            elif r.kind == "idle":
                client_faults["idle"][r.outcome] += 1
        writers = [c["ssd_writer"] for c in self.counters.values() if c.get("ssd_writer")]
        indexes = [c["cache_index"] for c in self.counters.values() if c.get("cache_index")]
        skipped: Counter[str] = Counter()
        for index in indexes:
            skipped.update(index.get("skipped", {}))
        blocks = {
            "written": sum(w["persisted"] for w in writers),
            "write_failures": sum(w["failed"] for w in writers),
            "dropped_by_reason": dict(sum((Counter(w["dropped_by_reason"]) for w in writers),
                                          Counter())),
            "read_and_verified": sum(w["read_blocks"] for w in writers),
            "read_missing": sum(w["read_missing"] for w in writers),
            "dropped_corrupt_at_read": sum(w["blocks_corrupt"] for w in writers),
            "checksum_failures": sum(w["checksum_failures"] for w in writers),
            "skipped_at_start": dict(skipped),
            "corrupted_by_soak": dict(Counter(c.how for c in self.disk.corruptions)),
            "corrupt_loaded": len(self.loaded_seen),
            "counted_until": "each instance's last snapshot (the killed one's, just before "
                             "the kill)",
        }
        corpus = {
            "cases": len(self.corpus),
            "replays": sum(sum(c.values()) for c in self.corpus_seen.values()),
            "by_case": {case.name: {"expected": case.status,
                                    "got": {str(k): v for k, v in
                                            sorted(self.corpus_seen[case.name].items())}}
                        for case in self.corpus},
        }
        rss = [s[3] for s in self.samples]
        fds = [s[4] for s in self.samples]
        return {
            "passed": not self.failures,
            "failures": self.failures,
            "command": self.command,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "minutes": self.minutes,
            "wall_s": round(self.clock(), 1),
            "first_start_s": round(self.first_start_s, 1),
            "machine": {
                "platform": platform.platform(), "python": platform.python_version(),
                "cpus": os.cpu_count(), "root": os.geteuid() == 0,
                "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
            },
            "server": {"command": shlex.join(self.server.command),
                       "instances": self.server.instance,
                       "exit_codes": {str(k): v for k, v in self.server.exit_codes.items()},
                       "cache_on_tmpfs": self.disk.tmpfs,
                       "no_tmpfs_because": self.disk.tmpfs_reason},
            "requests": {
                "total": len(records),
                "by_outcome": dict(Counter(r.outcome for r in records)),
                "by_kind": dict(Counter(r.kind for r in records)),
                "lost": sum(r.outcome == "lost" for r in records),
                "server_errors": sum(r.outcome == "server_error" for r in records),
                "bad_answers": sum(r.outcome == "bad_answer" for r in records),
                "without_outcome": sum(r.outcome is None for r in records),
            },
            "phases": phases,
            "faults": faults,
            "client_faults": {k: dict(v) for k, v in client_faults.items()},
            "bursts": self.bursts,
            "corpus": corpus,
            "blocks": blocks,
            "resources": {
                "baseline": self.baseline,
                "rss_start_mb": self.rss.get("start_mb"),
                "rss_after_load_mb": self.rss.get("after_load_mb"),
                "memory_releases_after_load": self.rss.get("memory_releases"),
                "rss_peak_mb": max(rss, default=None), "fds_peak": max(fds, default=None),
                "samples": [list(s) for s in self.samples],
                "sample_fields": ["t_s", "instance", "phase", "rss_mb", "fds"],
            },
            "timeline": [[round(r.ended, 2), r.phase, r.kind, r.outcome,
                          round(r.latency, 3) if r.latency is not None else None, r.tokens]
                         for r in records if r.ended is not None],
            "timeline_fields": ["ended_s", "phase", "kind", "outcome", "latency_s", "tokens"],
        }


def interpolated_percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile by linear interpolation; None for no values (the benchmarks'
    harness uses it too)."""
    ordered = sorted(values)
    if not ordered:
        return None
    pos = q / 100 * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile of seconds, rounded to ms; None for no values."""
    value = interpolated_percentile(values, q)
    return None if value is None else round(value, 3)


# --- writing the report ----------------------------------------------------------------------


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _evidence(fault: dict[str, Any]) -> str:
    if fault["skipped"]:
        return f"skipped: {fault['skipped']}"
    shown = {k: v for k, v in fault["evidence"].items() if k not in ("bursts",)}
    return ", ".join(f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in shown.items())


def markdown(report: dict[str, Any]) -> str:
    """``soak.md``: the report's figures as tables."""
    req = report["requests"]
    lines = [
        "# troupe soak",
        "",
        f"`{report['command']}`: {'**passed**' if report['passed'] else '**FAILED**'} in "
        f"{report['wall_s']:.0f} s ({report['minutes']:g}-minute budget, after a "
        f"{report['first_start_s']:.0f} s first start), {report['started']}, "
        f"{report['machine']['cpus']} CPUs, load average at the end "
        f"{report['machine']['loadavg_at_end']}.",
        "",
    ]
    if report["failures"]:
        lines += ["## Failures", ""] + [f"- {f}" for f in report["failures"]] + [""]
    lines += [
        "## Requests", "",
        f"{req['total']} requests: {req['lost']} lost, {req['server_errors']} server errors, "
        f"{req['bad_answers']} bad answers, {req['without_outcome']} without an outcome.", "",
        "| outcome | requests |", "|---|---|",
        *(f"| {k} | {v} |" for k, v in sorted(req["by_outcome"].items(),
                                              key=lambda kv: -kv[1])),
        "",
        "## Phases", "",
        "Latency: complete answers of the traffic (not the corpus or the held-back probes); "
        "TTFT: streams.", "",
        "| phase | s | requests | in flight, most | complete | 429 | latency p50 / p99 ms | "
        "TTFT p50 / p99 ms | RSS MB | fds | checks |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in report["phases"]:
        c = p["checks"]
        ok = c.get("health") and c.get("greedy_identical") and not c.get("failed") \
            and not c.get("corrupt_loaded") and c.get("resources_within_bounds") \
            and not c.get("server_5xx")
        lines.append(
            f"| {p['name']} | {p['ended_s'] - p['started_s']:.0f} | {p['requests']} | "
            f"{p['concurrency_max']} | {p['outcomes'].get('complete', 0)} | "
            f"{p['outcomes'].get('rate_limited', 0)} | "
            f"{_ms(p['latency_s']['p50'])} / {_ms(p['latency_s']['p99'])} | "
            f"{_ms(p['ttft_s']['p50'])} / {_ms(p['ttft_s']['p99'])} | {c.get('rss_mb')} | "
            f"{c.get('fds')} | {'ok' if ok else 'FAILED'} |")
    lines += ["", "## Faults", "", "| phase | fault | survived | evidence |", "|---|---|---|---|"]
    for f in report["faults"]:
        survived = "skipped" if f["skipped"] else ("yes" if f["survived"] else "NO")
        lines.append(f"| {f['phase']} | {f['name']} | {survived} | {_evidence(f)} |")
    lines += ["", "Client faults (outcomes):", ""]
    for name, outcomes in sorted(report["client_faults"].items()):
        lines.append(f"- {name}: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    for b in report["bursts"]:
        lines.append(f"- burst of {b['size']}: " + ", ".join(
            f"{k} {v}" for k, v in sorted(b["outcomes"].items()))
            + (f"; Retry-After {b['retry_after_s'][0]}-{b['retry_after_s'][1]} s"
               if b["retry_after_s"] else ""))
    corpus = report["corpus"]
    wrong = [name for name, c in corpus["by_case"].items()
             if any(int(s) not in (c["expected"], 429, 503) for s in c["got"])]
    unsent = [name for name, c in corpus["by_case"].items() if not c["got"]]
    blocks = report["blocks"]
    res = report["resources"]
    base = res["baseline"] or {}
    lines += [
        "", "## Bad input", "",
        f"{corpus['cases']} cases, replayed {corpus['replays']} times: "
        f"{len(wrong)} answered otherwise than expected{': ' + ', '.join(wrong) if wrong else ''}"
        f"; {len(unsent)} never sent{': ' + ', '.join(unsent) if unsent else ''}.",
        "", "## Blocks", "",
        f"- written {blocks['written']}, write failures {blocks['write_failures']}, dropped "
        f"{blocks['dropped_by_reason']}",
        f"- read back and verified {blocks['read_and_verified']}, missing "
        f"{blocks['read_missing']}, corrupt dropped at read {blocks['dropped_corrupt_at_read']} "
        f"({blocks['checksum_failures']} by checksum), skipped at start "
        f"{blocks['skipped_at_start']}",
        f"- corrupted by the soak {blocks['corrupted_by_soak']}; corrupt blocks loaded: "
        f"**{blocks['corrupt_loaded']}**",
        "", "## Resources", "",
        f"Warm baseline {base.get('rss_mb', 0):.0f} MB RSS, {base.get('fds')} fds; bounds "
        f"{base.get('rss_bound_mb', 0):.0f} MB and {base.get('fd_bound')} fds at each "
        f"checkpoint; peaks over the run {res['rss_peak_mb']} MB and {res['fds_peak']} fds "
        "(sampled every second).",
        "",
        f"RSS at the first start {res['rss_start_mb']} MB; after the load, once the idle "
        f"engine gave memory back ({res['memory_releases_after_load']} releases so far), "
        f"{res['rss_after_load_mb']} MB.",
        "", "![RSS, latency and throughput over time](soak.png)", "",
    ]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """``soak.png``: RSS and fds, latency, and throughput over the run, phases marked."""
    import matplotlib  # lazy: only the report needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_lat, ax_tput) = plt.subplots(3, 1, figsize=(12, 9), sharex=True)
    samples = report["resources"]["samples"]
    if samples:
        t = [s[0] for s in samples]
        ax_mem.plot(t, [s[3] for s in samples], color="tab:blue", lw=1)
        fds = ax_mem.twinx()
        fds.plot(t, [s[4] for s in samples], color="tab:orange", lw=1)
        fds.set_ylabel("open fds", color="tab:orange")
    ax_mem.set_ylabel("RSS (MB)", color="tab:blue")
    timeline = report["timeline"]
    done = [(e[0], e[4]) for e in timeline if e[3] == "complete" and e[4] is not None
            and e[2] not in ("corpus", "held_back")]
    refused = [(e[0], e[4]) for e in timeline if e[3] == "rate_limited" and e[4] is not None]
    if done:
        ax_lat.scatter(*zip(*done, strict=True), s=4, alpha=0.5, label="complete")
    if refused:
        ax_lat.scatter(*zip(*refused, strict=True), s=4, alpha=0.5, color="tab:red",
                       label="429")
    ax_lat.set_yscale("log")
    ax_lat.set_ylabel("latency (s)")
    ax_lat.legend(loc="upper left", fontsize=8)
    end = max((e[0] for e in timeline), default=0.0)
    bin_s = max(5.0, end / 120)
    bins = int(end // bin_s) + 1
    tokens, answers = [0.0] * bins, [0.0] * bins
    for e in timeline:
        if e[3] == "complete":
            tokens[int(e[0] // bin_s)] += e[5] / bin_s
            answers[int(e[0] // bin_s)] += 1 / bin_s
    x = [i * bin_s for i in range(bins)]
    ax_tput.step(x, tokens, where="post", label="tokens/s")
    ax_tput.step(x, answers, where="post", label="answers/s")
    ax_tput.set_ylabel(f"throughput ({bin_s:.0f} s bins)")
    ax_tput.set_xlabel("seconds")
    ax_tput.legend(loc="upper left", fontsize=8)
    for p in report["phases"]:
        for ax in (ax_mem, ax_lat, ax_tput):
            ax.axvline(p["started_s"], color="grey", lw=0.5, ls="--")
        ax_mem.annotate(p["name"], (p["started_s"], 1.0), xycoords=("data", "axes fraction"),
                        fontsize=7, rotation=90, va="top")
    fig.suptitle(f"troupe soak: {'passed' if report['passed'] else 'FAILED'}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(report: dict[str, Any], out: Path) -> None:
    (out / "soak.json").write_text(json.dumps(report, indent=1))
    (out / "soak.md").write_text(markdown(report))
    plot(report, out / "soak.png")


# --- command line ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="troupe soak",
        description="A bounded soak-and-fault run against a real `troupe serve` (see "
                    "docs/reliability.md). Exit status 1 when anything failed.")
    p.add_argument("--minutes", type=float, default=DEFAULT_MINUTES,
                   help=f"the run's budget, after the server's first start "
                        f"(default: {DEFAULT_MINUTES:g})")
    p.add_argument("--out", default="soak-results",
                   help="directory for soak.json, soak.md, soak.png and the server logs")
    p.add_argument("--model", default=None, help="model to serve (default: the bundled one)")
    p.add_argument("--seed", type=int, default=0, help="seed of the traffic's draws")
    p.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``troupe soak``; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.minutes <= 0:
        build_parser().error("--minutes must be positive")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["troupe", "soak", *(sys.argv[1:] if argv is None else argv)])
    soak = Soak(args.minutes, out, args.model, args.seed, args.port, command)
    print(f"troupe soak: {args.minutes:g} minutes, results in {out}/", file=sys.stderr)
    report = asyncio.run(soak.run())
    write_report(report, out)
    print(markdown(report).split("## Phases")[0].rstrip(), file=sys.stderr)
    status = "passed" if report["passed"] else f"FAILED ({len(report['failures'])} failures)"
    print(f"troupe soak {status}: {out / 'soak.md'}", file=sys.stderr)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
