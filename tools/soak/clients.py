"""The clients: one phase's requests over an aiohttp session or raw sockets (bodies sent
slowly or stalled, connections that send nothing, the bad-input corpus), each closed in the
ledger with the outcome it got.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import TYPE_CHECKING

import aiohttp

from troupe.tools.soak.corpus import (
    Case,
    request_bytes,
)
from troupe.tools.soak.judge import (
    RawAnswer,
    Record,
    json_or_none,
    judge_answer,
    judge_refusal,
    parse_answer,
)
from troupe.tools.soak.settings import (
    BODY_TIMEOUT_S,
    CAPACITY_EWMA,
    IDLE_TIMEOUT_S,
    REQUEST_TIMEOUT_S,
    SLOW_BODY_PAUSE_S,
    SLOW_BODY_PIECES,
    SLOW_READ_S,
)
from troupe.tools.soak.traffic import Spec

if TYPE_CHECKING:
    from troupe.tools.soak.run import Soak


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
