"""Server-sent events: ``data: <json>`` (OpenAI), or ``event: <name>`` then ``data: <json>``
(Anthropic); or newline-delimited JSON, a frame a line (Ollama).

A stream is written as frames; each frame is one whole event written at once, so a stream
that ends early (the client gone, the server stopping) never ends in the middle of an event.
"""

from __future__ import annotations

from aiohttp import web

NDJSON = "application/x-ndjson"
_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    # Reverse proxies (nginx) would otherwise buffer the stream and deliver it all at the end.
    "X-Accel-Buffering": "no",
}

# One event: its name (None: a plain ``data:`` event) and its payload (JSON, no newlines).
Frame = tuple[str | None, bytes]

DONE: Frame = (None, b"[DONE]")


def encode_frame(frame: Frame) -> bytes:
    """The bytes of one event, blank line included."""
    name, data = frame
    if name is None:
        return b"data: " + data + b"\n\n"
    return b"event: " + name.encode() + b"\ndata: " + data + b"\n\n"


class EventStream:
    """An open SSE (or NDJSON) response. Writing raises ``ConnectionResetError`` once the
    client has gone."""

    def __init__(self, response: web.StreamResponse, ndjson: bool = False) -> None:
        self.response = response
        self.ndjson = ndjson

    @classmethod
    async def open(cls, request: web.Request, ndjson: bool = False) -> EventStream:
        """Send the 200 status and the stream's headers: after this, failures go in the
        stream. ``ndjson``: a JSON object a line (a frame's name is not written)."""
        headers = {**_HEADERS, "Content-Type": NDJSON} if ndjson else _HEADERS
        response = web.StreamResponse(status=200, headers=headers)
        await response.prepare(request)
        return cls(response, ndjson)

    async def send(self, frames: list[Frame]) -> None:
        """Send these events in one write."""
        if frames and self.ndjson:
            await self.response.write(b"".join(data + b"\n" for _, data in frames))
        elif frames:
            await self.response.write(b"".join(encode_frame(frame) for frame in frames))

    async def close(self) -> None:
        """End the response."""
        await self.response.write_eof()
