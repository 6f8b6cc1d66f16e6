"""What a request's answer goes through on its way out: stop strings (``StopStringFilter``),
tool calls and reasoning taken out of the text (``delta``), and logprobs (``token_logprobs``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from actors.engine.agent_output import Parsed
from actors.messages import TokenLogprob, TokensGenerated, TopLogprob


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


def delta(req: Any, text: str, token_ids: list[int], logprobs: list[TokenLogprob] | None, *,
          last: bool, cut: bool = False) -> TokensGenerated | None:
    """The client's delta for ``text`` of request ``req`` (``request.Request``): with a
    parser, reasoning and tool calls are taken out of it (markup that may begin one is held
    back, and flushed by the last delta; ``cut``: the output was cut short, not ended by the
    model). None when a delta without tokens carries nothing. When the parser has ``ended``
    after it (a repeated call), the request is to end now."""
    reasoning, calls = "", None
    parser = req.parser
    if parser is not None:
        was_reasoning = parser.in_reasoning
        parsed = parser.feed(text)
        if last:
            end = parser.finish(cut=cut)
            parsed = Parsed(text=parsed.text + end.text,
                            reasoning=parsed.reasoning + end.reasoning,
                            tool_calls=parsed.tool_calls + end.tool_calls)
        if token_ids and (was_reasoning or parser.in_reasoning):
            req.reasoning_tokens += len(token_ids)
        text, reasoning, calls = parsed.text, parsed.reasoning, parsed.tool_calls or None
    if not (token_ids or text or reasoning or calls):
        return None
    return TokensGenerated(request_id=req.request_id, text=text, token_ids=token_ids,
                           logprobs=logprobs, reasoning=reasoning, tool_calls=calls)


def token_logprobs(tokenizer: Any, token: int, logprobs: mx.array, k: int
                   ) -> list[TokenLogprob]:
    """The sampled token's logprob and the ``k`` most likely tokens' (OpenAI's shape)."""
    top: list[TopLogprob] = []
    if k > 0:
        idx = mx.argpartition(-logprobs, kth=k - 1)[:k]
        vals = logprobs[idx]
        order = mx.argsort(-vals)
        for i, v in zip(idx[order].tolist(), vals[order].tolist(), strict=True):
            piece = tokenizer.decode([i])
            top.append(TopLogprob(token=piece, token_id=i, logprob=v,
                                  bytes=list(piece.encode("utf-8"))))
    piece = tokenizer.decode([token])
    return [TokenLogprob(token=piece, token_id=token, logprob=logprobs[token].item(),
                         bytes=list(piece.encode("utf-8")), top_logprobs=top)]
