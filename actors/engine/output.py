"""What a request's answer goes through on its way out: stop strings (``StopStringFilter``)."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringFilter:
    """Holds back text that may be the start of a stop string, and cuts at the first match.

    Matching is on decoded text, not token ids: a stop string can be spelled by many token
    sequences, and it must never leak into the output.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        """Add decoded text; return (text safe to emit, whether a stop string matched).
        The stop string that matched first in the text is kept in ``matched``."""
        if not self.stops:
            return text, False
        buf = self.pending + text
        hits = [(i, s) for s, i in ((s, buf.find(s)) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            at, self.matched = min(hits)
            return buf[:at], True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        self.pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text
