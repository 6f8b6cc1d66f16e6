"""The dashboard's request board: the generation requests in flight (their telemetry records)
and the last ones finished, kept by a middleware around each request's handler."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from troupe.api.telemetry import CLIENT_CLOSED, RECORD, RequestRecord

FINISHED_KEPT = 50


def _outcome(status: int, record: RequestRecord) -> str:
    """How a request ended, in a word or two."""
    if status == CLIENT_CLOSED:
        return "client closed"
    if status >= 400:
        return f"error {status}"
    return record.finish_reason or "done"


@dataclass
class RequestBoard:
    """The generation requests in flight (their telemetry records) and the last ones finished.

    Fed by ``board_middleware``; a request shows once its route has named it (``request_id``).
    """

    in_flight: dict[int, RequestRecord] = field(default_factory=dict)
    finished: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=FINISHED_KEPT))
    finished_count: int = 0
    # TTFTs (ms) of requests finished since the history last took them.
    ttfts: list[float] = field(default_factory=list)

    def start(self, record: RequestRecord) -> None:
        """A request came in (it may never name itself: not every route generates)."""
        self.in_flight[id(record)] = record

    def finish(self, record: RequestRecord, status: int) -> None:
        """A request was answered, with ``status``."""
        self.in_flight.pop(id(record), None)
        if record.request_id is None:
            return
        now = time.perf_counter()
        ttft = _ttft_ms(record)
        if ttft is not None:
            self.ttfts.append(ttft)
        self.finished_count += 1
        self.finished.appendleft({
            "id": record.request_id,
            "model": record.model,
            "status": status,
            "outcome": _outcome(status, record),
            "ttft_ms": ttft,
            "total_ms": round((now - record.started) * 1e3, 1),
            "prompt_tokens": record.prompt_tokens,
            "cached_tokens": record.cached_tokens,
            "completion_tokens": record.completion_tokens,
            "tokens_per_s": _rate(record, record.last_token_at or now),
            "ended": time.time(),
        })

    def take_ttfts(self) -> list[float]:
        """The TTFTs gathered since the last call."""
        ttfts, self.ttfts = self.ttfts, []
        return ttfts

    def rows(self, progress: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        """The named requests in flight, oldest first; ``progress``: what schedulers report
        of each request, by id (optional: see ``scheduler_progress``)."""
        now = time.perf_counter()
        rows = []
        for record in self.in_flight.values():
            if record.request_id is None:
                continue
            stage, detail = _stage(record, progress.get(record.request_id))
            rows.append({
                "id": record.request_id,
                "model": record.model,
                "stage": stage,
                "detail": detail,
                "prompt_tokens": record.prompt_tokens,
                "cached_tokens": record.cached_tokens,
                "tokens": record.completion_tokens,
                "tokens_per_s": _rate(record, now),
                "ttft_ms": _ttft_ms(record),
                "age_s": round(now - record.started, 2),
            })
        rows.sort(key=lambda row: -row["age_s"])
        return rows

    def signature(self) -> frozenset[tuple[str, str]]:
        """Which requests are in flight and at which stage: a change is worth a snapshot."""
        return frozenset(
            (r.request_id, _stage(r, None)[0]) for r in self.in_flight.values() if r.request_id
        )


def _ttft_ms(record: RequestRecord) -> float | None:
    if record.first_token_at is None:
        return None
    return round((record.first_token_at - record.started) * 1e3, 1)


def _rate(record: RequestRecord, end: float) -> float | None:
    """Tokens per second from the first token to ``end`` (None before the first token)."""
    if record.first_token_at is None:
        return None
    elapsed = end - record.first_token_at
    return round(record.completion_tokens / elapsed, 1) if elapsed > 1e-3 else None


def _stage(record: RequestRecord, progress: dict[str, Any] | None) -> tuple[str, str]:
    """(stage, detail): admitted, waiting, prefilling, decoding."""
    if record.first_token_at is not None:
        return "decoding", f"TTFT {_ttft_ms(record):.0f} ms"
    if record.prompt_tokens is None:
        return "admitted", ""
    prompt, cached = record.prompt_tokens, record.cached_tokens or 0
    if progress is not None:
        stage = str(progress.get("stage", "prefilling"))
        done = progress.get("prefilled_tokens")
        if stage == "prefilling" and isinstance(done, int):
            return "prefilling", f"{done} of {prompt}"
        if stage != "decoding":
            return stage, f"{prompt} prompt tokens"
    # The scheduler has it; which of waiting or prefilling, only the scheduler knows.
    return "prefilling", f"{prompt} tokens, {cached} cached"


def board_middleware(board: RequestBoard) -> Middleware:
    """Innermost middleware: puts each request on the board while its handler runs."""

    @web.middleware
    async def on_board(request: web.Request, handler: Handler) -> web.StreamResponse:
        record = request.get(RECORD)
        if record is None:
            return await handler(request)
        board.start(record)
        # Telemetry closes the record with its final status, whatever the outcome.
        record.on_close.append(lambda status: board.finish(record, status))
        return await handler(request)

    return on_board
