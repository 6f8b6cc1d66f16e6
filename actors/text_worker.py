"""One scheduler's text stage (``engine.text.TextStage``) on a thread of its own.

The scheduler, on the MLX thread, hands it each step's events from the engine (``feed``) and
each new request's text with its reply (``open``); the worker turns them into the clients'
events and sends them to the replies (thread-safe: ``runtime.reply``). A request whose text
ended it (a stop string, a repeated tool call) leaves a notice, which the scheduler takes at
the start of its next step (``take_notices``) and the engine applies; the notice is recorded
before the client is sent its final event, so the scheduler never takes a client that closed
after that event for one that went away mid-answer (which would abort the request and lose the
blocks its answer completed).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

from troupe.actors.engine.text import EndRequest, EngineEvent, TextOutput, TextStage
from troupe.actors.messages import RequestFinished
from troupe.runtime import Reply

log = logging.getLogger("actors.text_worker")

# How long stopping waits for the worker to send what it was given.
STOP_TIMEOUT_S = 5.0


class TextWorker:
    """A thread with a queue that runs one ``TextStage``: items are handled in the order they
    were given, so a request's ``open`` comes before its tokens and its tokens before its end."""

    def __init__(self, name: str) -> None:
        self.stage = TextStage()
        self._replies: dict[str, Reply] = {}  # the worker thread's alone
        self._queue: queue.SimpleQueue[tuple[str, Any] | None] = queue.SimpleQueue()
        self._notices: deque[EndRequest] = deque()  # appended here, taken by the scheduler
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stopped = False

    def start(self) -> None:
        self._thread.start()
        # A process that exits without stopping the scheduler joins the thread before the
        # interpreter finalizes: a daemon thread that takes the GIL then (back from the
        # tokenizer's native code) is stopped where it stands.
        atexit.register(self.stop)

    def open(self, out: TextOutput, reply: Reply) -> None:
        """A new request's text, and the reply its events go to."""
        self._queue.put(("open", (out, reply)))

    def feed(self, events: Sequence[EngineEvent]) -> None:
        """One step's events from the engine (``TokensSampled``, its ``RequestFinished``)."""
        if events:
            self._queue.put(("feed", list(events)))

    def take_notices(self) -> list[EndRequest]:
        """The requests the text ended since the last call, for the engine to end."""
        out = []
        while self._notices:
            out.append(self._notices.popleft())
        return out

    def stop(self) -> None:
        """Send what is queued, then end the thread (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.stop)
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(STOP_TIMEOUT_S)
            if self._thread.is_alive():
                log.warning("text worker %r did not finish within %.1fs", self._thread.name,
                            STOP_TIMEOUT_S)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._handle(*item)
            except Exception:  # a bug here must not stop every later request's text
                log.exception("text worker %r failed on an item", self._thread.name)

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "open":
            out, reply = payload
            self.stage.open(out)
            self._replies[out.request_id] = reply
            return
        events, notices = self.stage.feed(payload)
        # Before the final events go out: see the module's docstring.
        self._notices.extend(notices)
        replies = self._replies
        for event in events:
            reply = replies.get(event.request_id)
            if reply is None:
                continue
            reply.send(event)
            if isinstance(event, RequestFinished):
                reply.close()
                del replies[event.request_id]
