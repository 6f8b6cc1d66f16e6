"""Servers for the HTTP tests: a scripted admission actor (no model) and the real stack.

``ScriptedAdmission`` answers like the real admission actor; the text of the last message
(or the prompt) names the script its request plays (see ``SCRIPTS``). ``real_stack`` starts
the real serving actors on a model directory and serves them with ``api.server.serve_http``,
the embedding API ``troupe serve`` uses.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.config import ServeConfig
from actors.messages import (
    AdmissionError,
    AdmissionTicket,
    AdmitChat,
    AdmitCompletion,
    Admitted,
    CountTokens,
    ListModels,
    ModelCard,
    RequestFinished,
    RequestStarted,
    TokensGenerated,
    Usage,
)
from api.server import HttpServer, serve_http
from runtime import Actor, ActorRef, ActorSystem, Message, Reply
from runtime.reply import open_reply

MODEL = "tiny-test"
BUSY_MODEL = "busy-test"  # admission refuses it with 429 and Retry-After
DELTAS = ["Hel", "lo", " world"]
STOP = "END"


def _finished(rid: str, reason: str, completion: int, **extra: Any) -> RequestFinished:
    return RequestFinished(
        request_id=rid,
        finish_reason=reason,
        usage=Usage(prompt_tokens=5, completion_tokens=completion, cached_tokens=2),
        **extra,
    )


def _matched_stop() -> dict[str, Any]:
    # If the scheduler names the stop sequence it matched, a scripted match names it too.
    return {"stop_sequence": STOP} if "stop_sequence" in RequestFinished.__struct_fields__ else {}


async def _play(reply: Reply, rid: str, script: str) -> None:
    if script == "refuse-before-start":
        reply.send(
            RequestFinished(
                request_id=rid,
                finish_reason="error",
                usage=Usage(prompt_tokens=5, completion_tokens=0),
                error="The scheduler queue is full.",
                error_status=429,
            )
        )
        reply.close()
        return
    reply.send(RequestStarted(request_id=rid, prompt_tokens=5, cached_tokens=2))
    if script == "endless":
        for i in range(4000):
            if not reply.send(TokensGenerated(request_id=rid, text="x", token_ids=[i])):
                break
            await asyncio.sleep(0.005)
        reply.close()
        return
    if script == "fail-mid-stream":
        reply.send(TokensGenerated(request_id=rid, text="partial", token_ids=[1]))
        reply.send(
            RequestFinished(
                request_id=rid,
                finish_reason="error",
                usage=Usage(prompt_tokens=5, completion_tokens=1),
                error="Out of memory during decode.",
                error_status=503,
            )
        )
        reply.close()
        return
    for i, text in enumerate(DELTAS):
        reply.send(TokensGenerated(request_id=rid, text=text, token_ids=[i]))
        await asyncio.sleep(0.1 if script == "slow" else 0)
    if script == "length":
        reply.send(_finished(rid, "length", len(DELTAS)))
    elif script == "stop-string":
        # The token that completed the stop string was delivered: no token is missing.
        reply.send(_finished(rid, "stop", len(DELTAS), **_matched_stop()))
    else:
        # An end-of-sequence token ends it: counted in the usage, carried by no delta.
        reply.send(_finished(rid, "stop", len(DELTAS) + 1))
    reply.close()


def _script(msg: AdmitChat | AdmitCompletion) -> str:
    if isinstance(msg, AdmitChat):
        return msg.messages[-1]["content"]
    return msg.prompt if isinstance(msg.prompt, str) else "token ids"


class ScriptedAdmission(Actor):
    """Answers like the real admission actor; records what it was asked in ``seen``."""

    def __init__(self, seen: list[Message]) -> None:
        self.seen = seen
        self.tasks: set[asyncio.Task[None]] = set()

    async def handle(self, msg: Message) -> Any:
        self.seen.append(msg)
        match msg:
            case ListModels():
                return [ModelCard(id=MODEL, context_length=4096, source="test", path="/nowhere")]
            case CountTokens():
                self._check_model(msg.model)
                return 100 * len(msg.messages) + len(msg.tools or [])
            case AdmitChat() | AdmitCompletion():
                self._check_model(msg.model)
                script = _script(msg)
                if script == "crash-admission":
                    raise RuntimeError("admission bug")
                reply, events = open_reply()
                task = asyncio.create_task(_play(reply, msg.request_id, script))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
                admitted = Admitted(request_id=msg.request_id, model=msg.model, prompt_tokens=5)
                return AdmissionTicket(admitted=admitted, events=events)
        raise TypeError(f"unexpected message {msg!r}")

    def _check_model(self, model: str) -> None:
        if model == BUSY_MODEL:
            raise AdmissionError(429, "Too many requests queued.", type="rate_limit_error",
                                 retry_after=2.5)
        if model != MODEL:
            raise AdmissionError(404, f"The model '{model}' does not exist.", param="model",
                                 code="model_not_found")

    def report(self) -> dict[str, Any]:
        return {"admitted": len(self.seen), "refused": {"404": 1}}


@dataclass
class Scripted:
    """A scripted admission in a running actor system (what ``create_app`` needs)."""

    system: ActorSystem
    admission: ActorRef
    seen: list[Message]

    def config(self, **fields: Any) -> ServeConfig:
        return ServeConfig(port=0, default_max_tokens=77, max_body_bytes=4096, **fields)


@asynccontextmanager
async def scripted_system() -> AsyncIterator[Scripted]:
    async with ActorSystem() as system:
        seen: list[Message] = []
        admission = await system.spawn(ScriptedAdmission, name="admission", seen=seen)
        yield Scripted(system=system, admission=admission, seen=seen)


@dataclass
class RealStack:
    server: HttpServer
    system: ActorSystem
    model: str
    model_path: str


@asynccontextmanager
async def real_stack(model_dir: Path, **fields: Any) -> AsyncIterator[RealStack]:
    """The real serving actors on ``model_dir``, served on 127.0.0.1 on a free port."""
    from actors.serving import start_serving  # imports MLX: only tests that need it pay

    config = ServeConfig(model=str(model_dir), host="127.0.0.1", port=0, **fields)
    async with ActorSystem() as system:
        handles = await start_serving(system, config)
        async with serve_http(system, config, handles) as server:
            card = handles.models[0]
            yield RealStack(server=server, system=system, model=card.id, model_path=card.path)


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

