"""Servers for the HTTP tests: a scripted admission actor (no model) and the real stack.

This is the one place the tests start a server stack. ``ScriptedAdmission`` answers like the
real admission actor; the text of the last message (or the prompt) names the script its
request plays (see ``_play``). The ``scripted`` and ``client`` fixtures serve it (a test module
binds them by name: ``scripted, client = http_stack.scripted, http_stack.client``), and
``Scripted.app``/``Scripted.start`` serve it with other settings. ``real_stack`` starts the
real serving actors on a model directory and serves them with ``api.server.serve_http``, the
embedding API ``troupe serve`` uses; ``real_client`` puts them behind a test client.
``serve_default_model`` runs ``troupe serve`` on the bundled model in a subprocess, for the
end-to-end tests; ``serve_logged`` runs it with any arguments and hands back its log lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from troupe.actors.config import ServeConfig
from troupe.actors.messages import (
    AdmissionError,
    AdmissionTicket,
    AdmitChat,
    AdmitCompletion,
    AdmitEmbed,
    AdmitRerank,
    Admitted,
    CountTokens,
    DescribeModel,
    EmbedAnswer,
    ErrorKind,
    ListModels,
    ModelCard,
    RequestFinished,
    RequestStarted,
    TokenLogprob,
    TokensGenerated,
    ToolCall,
    TopLogprob,
    Usage,
)
from troupe.api.app import create_app
from troupe.api.server import HttpServer, serve_http, start_http
from troupe.runtime import Actor, ActorRef, ActorSystem, Message, Reply, ReplyStream
from troupe.runtime.reply import open_reply

if TYPE_CHECKING:
    from troupe.actors.serving import ServingHandles

MODEL = "tiny-test"
BUSY_MODEL = "busy-test"  # admission refuses it with 429 and Retry-After
DELTAS = ["Hel", "lo", " world"]
STOP = "END"
MAX_BODY = 4096
ENDLESS = 4000  # how many tokens the "endless" script sends at the most
# The "tool-call" script: text, then two whole calls; "reasoning": thinking, then the answer.
TOOL_TEXT = "Let me check."
TOOL_CALLS = [
    ToolCall(index=0, id="call_0", name="get_weather", arguments='{"city": "Paris"}'),
    ToolCall(index=1, id="call_1", name="get_time", arguments='{"zone": "CET"}'),
]
REASONING = ["The user ", "asks hello."]
# "custom-call": a call of the freeform tool apply_patch (its input holds what JSON escapes);
# "shell-call": a call of local_shell.
PATCH = '*** Begin Patch\n*** Add File: a "b".txt\n+tab\there \\ é\n*** End Patch\n'
CUSTOM_CALL = ToolCall(index=0, id="call_p", name="apply_patch",
                       arguments=json.dumps({"input": PATCH}, ensure_ascii=False))
SHELL_CALL = ToolCall(index=0, id="call_s", name="local_shell",
                      arguments='{"command": ["ls", "-la"], "working_directory": "/tmp"}')


@dataclass
class Record:
    """What the scripted admission saw and did, for the tests to assert on."""

    seen: list[Message] = field(default_factory=list)
    # Held here so that only an explicit close (not garbage collection of the handler's
    # last reference) can mark a consumer gone: the tests pin the explicit close.
    streams: list[ReplyStream[Any]] = field(default_factory=list)
    consumer_gone: asyncio.Event = field(default_factory=asyncio.Event)
    tokens_sent: int = 0


def _finished(
    rid: str, reason: str, completion: int, cached: int = 2, **extra: Any
) -> RequestFinished:
    return RequestFinished(
        request_id=rid,
        finish_reason=reason,
        usage=Usage(prompt_tokens=5, completion_tokens=completion, cached_tokens=cached),
        **extra,
    )


def _failed(rid: str, completion: int, error: str, kind: ErrorKind) -> RequestFinished:
    return _finished(rid, "error", completion, cached=0, error=error, error_kind=kind)


def _matched_stop() -> dict[str, Any]:
    # If the scheduler names the stop sequence it matched, a scripted match names it too.
    return {"stop_sequence": STOP} if "stop_sequence" in RequestFinished.__struct_fields__ else {}


def _logprob(token: str, token_id: int) -> TokenLogprob:
    top = TopLogprob(token=token, token_id=token_id, logprob=-0.25, bytes=list(token.encode()))
    alt = TopLogprob(token="X", token_id=99, logprob=-2.5, bytes=[88])
    return TokenLogprob(
        token=token,
        token_id=token_id,
        logprob=-0.25,
        bytes=list(token.encode()),
        top_logprobs=[top, alt],
    )


async def _play(reply: Reply, rid: str, script: str, logprobs: bool, record: Record) -> None:
    if script == "refuse-before-start":
        reply.send(_failed(rid, 0, "The scheduler queue is full.", "overloaded"))
        reply.close()
        return
    reply.send(RequestStarted(request_id=rid, prompt_tokens=5, cached_tokens=2))
    if script == "endless":
        for i in range(ENDLESS):
            if not reply.send(TokensGenerated(request_id=rid, text="x", token_ids=[i])):
                break
            record.tokens_sent += 1
            await asyncio.sleep(0.005)
        if reply.consumer_gone:
            record.consumer_gone.set()
        reply.close()
        return
    if script == "fail-mid-stream":
        reply.send(TokensGenerated(request_id=rid, text="partial", token_ids=[1]))
        reply.send(_failed(rid, 1, "Out of memory during decode.", "unavailable"))
        reply.close()
        return
    if script == "tool-call":
        reply.send(TokensGenerated(request_id=rid, text=TOOL_TEXT, token_ids=[1]))
        reply.send(TokensGenerated(request_id=rid, text="", token_ids=[2, 3],
                                   tool_calls=TOOL_CALLS[:1]))
        reply.send(TokensGenerated(request_id=rid, text="", token_ids=[4, 5],
                                   tool_calls=TOOL_CALLS[1:]))
        reply.send(_finished(rid, "tool_calls", 6))
        reply.close()
        return
    if script in ("custom-call", "shell-call"):
        call = CUSTOM_CALL if script == "custom-call" else SHELL_CALL
        reply.send(TokensGenerated(request_id=rid, text="", token_ids=[1, 2], tool_calls=[call]))
        reply.send(_finished(rid, "tool_calls", 2))
        reply.close()
        return
    if script == "reasoning":
        for i, thought in enumerate(REASONING):
            reply.send(TokensGenerated(request_id=rid, text="", token_ids=[10 + i],
                                       reasoning=thought))
    for i, text in enumerate(DELTAS):
        token_logprobs = [_logprob(text, i)] if logprobs else None
        reply.send(TokensGenerated(request_id=rid, text=text, token_ids=[i],
                                   logprobs=token_logprobs))
        await asyncio.sleep(0.1 if script == "slow" else 0)
    if script == "length":
        reply.send(_finished(rid, "length", len(DELTAS)))
    elif script == "stop-string":
        # The token that completed the stop string was delivered: no token is missing.
        reply.send(_finished(rid, "stop", len(DELTAS), **_matched_stop()))
    elif script == "reasoning":
        n = len(REASONING) + len(DELTAS) + 1
        reply.send(RequestFinished(
            request_id=rid, finish_reason="stop",
            usage=Usage(prompt_tokens=5, completion_tokens=n, cached_tokens=2,
                        reasoning_tokens=len(REASONING))))
    else:
        # An end-of-sequence token ends it: counted in the usage, carried by no delta.
        reply.send(_finished(rid, "stop", len(DELTAS) + 1))
    reply.close()


def _script(msg: AdmitChat | AdmitCompletion) -> str:
    if isinstance(msg, AdmitChat):
        return msg.messages[-1]["content"]
    return msg.prompt if isinstance(msg.prompt, str) else "token ids"


_CARD = ModelCard(id=MODEL, context_length=4096, source="test", path="/nowhere",
                  capabilities=("completion", "tools"), loaded=True)


class ScriptedAdmission(Actor):
    """Answers like the real admission actor; records what it was asked and did in ``record``."""

    def __init__(self, record: Record) -> None:
        self.record = record
        self.tasks: set[asyncio.Task[None]] = set()

    async def handle(self, msg: Message) -> Any:
        self.record.seen.append(msg)
        match msg:
            case ListModels():
                return [_CARD]
            case DescribeModel(name=name):
                self._check_model(name)
                return _CARD
            case CountTokens():
                self._check_model(msg.model)
                return 100 * len(msg.messages) + len(msg.tools or [])
            case AdmitChat() | AdmitCompletion():
                self._check_model(msg.model)
                script = _script(msg)
                if script == "crash-admission":
                    raise RuntimeError("admission bug")
                reply, events = open_reply()
                self.record.streams.append(events)
                play = _play(reply, msg.request_id, script, msg.sampling.logprobs, self.record)
                task = asyncio.create_task(play)
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
                admitted = Admitted(request_id=msg.request_id, model=msg.model, prompt_tokens=5)
                return AdmissionTicket(admitted=admitted, events=events)
            case AdmitEmbed() | AdmitRerank():
                # Embeddings: a unit vector of 4 per input; rerank: scores falling by index.
                self._check_model(msg.model)
                n = len(msg.inputs if isinstance(msg, AdmitEmbed) else msg.documents)
                if n == 0:
                    raise AdmissionError("invalid", "nothing to embed", param="input")
                results = ([[1.0, 0.0, 0.0, 0.0]] * n if isinstance(msg, AdmitEmbed)
                           else [1 / (i + 1) for i in range(n)])
                return EmbedAnswer(model=MODEL, results=results, prompt_tokens=5 * n)
        raise TypeError(f"unexpected message {msg!r}")

    def _check_model(self, model: str) -> None:
        if model == BUSY_MODEL:
            raise AdmissionError("overloaded", "Too many requests queued.", retry_after=2.5)
        if model != MODEL:
            raise AdmissionError("unknown_model", f"The model '{model}' does not exist.",
                                 param="model",
                                 code="model_not_found")

    def report(self) -> dict[str, Any]:
        return {"admitted": len(self.record.seen), "refused": {"unknown_model": 1}}


@dataclass
class Scripted:
    """A scripted admission in a running actor system (what ``create_app`` needs)."""

    system: ActorSystem
    admission: ActorRef
    record: Record

    @property
    def seen(self) -> list[Message]:
        """Every message the admission was asked, in order."""
        return self.record.seen

    def config(self, **fields: Any) -> ServeConfig:
        return ServeConfig.of(port=0, default_max_tokens=77, max_body_bytes=MAX_BODY, **fields)

    def app(self, **fields: Any) -> web.Application:
        """The HTTP app on the scripted admission, with ``config(**fields)``."""
        return create_app(system=self.system, admission=self.admission,
                          config=self.config(**fields))

    async def start(self, **fields: Any) -> HttpServer:
        """The HTTP app served on a free port of 127.0.0.1; the caller closes it."""
        return await start_http(self.system, self.config(**fields), self)


@asynccontextmanager
async def scripted_system() -> AsyncIterator[Scripted]:
    async with ActorSystem() as system:
        record = Record()
        admission = await system.spawn(ScriptedAdmission, name="admission", record=record)
        yield Scripted(system=system, admission=admission, record=record)


@pytest.fixture
async def scripted() -> AsyncIterator[Scripted]:
    """A scripted admission in a running actor system."""
    async with scripted_system() as stack:
        yield stack


@pytest.fixture
async def client(aiohttp_client: Any, scripted: Scripted) -> TestClient:
    """A test client of the app on the scripted admission."""
    return await aiohttp_client(scripted.app())


@pytest.fixture
async def openai_client(scripted: Scripted) -> AsyncIterator[openai.AsyncOpenAI]:
    """The official openai client, on the scripted stack served on 127.0.0.1."""
    server = await scripted.start()
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    try:
        yield client
    finally:
        await client.close()
        await server.close()


@dataclass
class RealStack:
    server: HttpServer
    system: ActorSystem
    model: str
    model_path: str


@asynccontextmanager
async def real_stack(model_dir: Path, **fields: Any) -> AsyncIterator[RealStack]:
    """The real serving actors on ``model_dir``, served on 127.0.0.1 on a free port."""
    from troupe.actors.serving import start_serving  # imports MLX: only tests that need it pay

    config = ServeConfig.of(model=str(model_dir), host="127.0.0.1", port=0, **fields)
    async with ActorSystem() as system:
        handles = await start_serving(system, config)
        async with serve_http(system, config, handles) as server:
            card = handles.models[0]
            yield RealStack(server=server, system=system, model=card.id, model_path=card.path)


async def real_client(
    aiohttp_client: Any, config: ServeConfig
) -> tuple[TestClient, ActorSystem, ServingHandles]:
    """The real serving actors behind a test client; they stop when its app cleans up."""
    from troupe.actors.serving import start_serving  # imports MLX: only tests that need it pay

    system = ActorSystem()
    await system.__aenter__()
    handles = await start_serving(system, config)
    app = create_app(system=system, admission=handles.admission, config=config)

    async def close_system(_app: web.Application) -> None:
        await system.__aexit__(None, None, None)

    app.on_cleanup.append(close_system)
    return await aiohttp_client(app), system, handles


async def real_client_with_room(
    aiohttp_client: Any, config: ServeConfig, room: int
) -> tuple[TestClient, ServingHandles]:
    """``real_client`` under a memory limit of ``room`` bytes above what the process uses once
    the model is loaded (the guard's 413 tests)."""
    from troupe.actors.memory_messages import SetMemoryLimit

    client, system, handles = await real_client(aiohttp_client, config)
    usage = next(s for s in system.snapshot() if s.name == "memory_monitor").report
    await handles.monitor.ask(SetMemoryLimit(limit=usage["usage_bytes"] + room), timeout=5.0)
    return client, handles


def parse_named_sse(body: str) -> list[tuple[str, dict[str, Any]]]:
    """Parse Anthropic's SSE exactly: ``event: X`` then ``data: <json>`` whose type is X."""
    assert body.endswith("\n\n"), body[-200:]
    events = []
    for block in body[: -len("\n\n")].split("\n\n"):
        lines = block.split("\n")
        assert len(lines) == 2, block
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        name, data = lines[0][len("event: "):], json.loads(lines[1][len("data: "):])
        assert data["type"] == name, block
        events.append((name, data))
    return events


def parse_data_sse(body: str) -> list[Any]:
    """Parse OpenAI's SSE exactly: ``data: <json>`` events, ``data: [DONE]`` last."""
    assert body.endswith("\n\n"), body[-200:]
    payloads = body[: -len("\n\n")].split("\n\n")
    for event in payloads:
        assert event.startswith("data: ") and "\n" not in event, event
    payloads = [event[len("data: "):] for event in payloads]
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]


# --- the default model in a subprocess: what the end-to-end tests talk to ----------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_default_model(server_log: Path, *args: str) -> Iterator[str]:
    """`troupe serve` on the bundled default model with ``args``, its output in
    ``server_log`` and its prefix cache beside it (unless ``args`` name a --cache-dir), until
    the block ends: its base URL."""
    port = _free_port()
    log = server_log.open("w")
    # A directory of its own: one server at a time may use a cache directory, and the
    # session's servers (and in-process stacks on $TROUPE_HOME's) run side by side.
    cache = [] if "--cache-dir" in args else ["--cache-dir", str(server_log.parent / "kv-cache")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "troupe.api.cli", "serve", "--host", "127.0.0.1", "--port",
         str(port),
         *cache, *args],
        stdout=log, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"server exited early:\n{server_log.read_text()}")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            pytest.fail("server did not become healthy in time")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


SERVING = re.compile(r"serving (?P<model>\S+) on (?P<url>http://(?P<host>[\d.]+):(?P<port>\d+))")


def serve_logged(args: list[str], env: dict[str, str], cwd: Path
                 ) -> tuple[subprocess.Popen[str], list[str], re.Match[str]]:
    """``troupe serve *args`` in a subprocess, once it logs where it serves: the process, its
    log lines so far (a thread keeps appending them, so the server never blocks on a full
    pipe) and the match of ``SERVING`` (model, url, host, port). The caller stops it."""
    proc = subprocess.Popen([sys.executable, "-m", "troupe.api.cli", "serve", *args], cwd=cwd,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env)
    log: list[str] = []
    ready = threading.Event()

    def drain() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            log.append(line)
            if SERVING.search(line):
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    ready.wait(120)
    match = next((m for line in log if (m := SERVING.search(line))), None)
    if match is None:
        proc.kill()
        proc.wait()
        raise AssertionError("the server did not start: " + "".join(log))
    return proc, log, match
