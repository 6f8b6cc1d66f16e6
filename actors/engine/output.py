"""What a request's answer goes through on its way out: stop strings (``StopStringFilter``),
tool calls and reasoning taken out of the text (``delta``), and logprobs (``token_logprobs``)."""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence
from typing import Any, NamedTuple

import mlx.core as mx

from troupe.actors.engine.agent_output import Parsed
from troupe.actors.messages import TokenLogprob, TokensGenerated, TopLogprob


class StopStringFilter:
    """Holds back text that may be the start of a stop string, and cuts at the first match.

    Matching is on decoded text, not token ids: a stop string can be spelled by many token
    sequences, and it must never leak into the output. All the stop strings are matched in
    one pass over each delta (an Aho-Corasick automaton, ``_Automaton``), so a delta costs
    the same whatever their number; the automaton's state after the text so far is the
    longest end of it that begins a stop string, which is the text held back.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.matched: str | None = None
        self._automaton = _automaton(tuple(self.stops)) if self.stops else None
        self._state = 0  # the automaton's state after ``pending``

    def feed(self, text: str) -> tuple[str, bool]:
        """Add decoded text; return (text safe to emit, whether a stop string matched).
        The stop string that matched first in the text is kept in ``matched``."""
        auto = self._automaton
        if auto is None:
            return text, False
        buf = self.pending + text
        goto, fail, longest = auto.goto, auto.fail, auto.longest
        state, at, base = self._state, len(buf), len(self.pending) + 1
        for i, ch in enumerate(text):
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            if longest[state]:  # of the stop strings ending here, the longest starts first
                at = min(at, base + i - longest[state])
        if at < len(buf):
            self.pending, self._state = "", 0
            # Of those starting there, the least (as when each was looked for on its own).
            self.matched = min(s for s in self.stops if buf.startswith(s, at))
            return buf[:at], True
        hold = auto.depth[state]
        self.pending, self._state = buf[len(buf) - hold:], state
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        text, self.pending, self._state = self.pending, "", 0
        return text


class _Automaton(NamedTuple):
    """An Aho-Corasick automaton over stop strings: a trie (state 0 its root; ``goto`` the
    edges out of each state, ``depth`` its length), each state's failure link (the state of
    its longest proper suffix in the trie), and the length of the longest stop string that
    ends each state's text (0: none)."""

    goto: list[dict[str, int]]
    fail: list[int]
    depth: list[int]
    longest: list[int]


@functools.lru_cache(maxsize=16)
def _automaton(stops: tuple[str, ...]) -> _Automaton:
    """The automaton of ``stops``, built once for each set a client sends (agents send the same
    ones on every turn); it is never changed after, so requests share it."""
    goto: list[dict[str, int]] = [{}]
    depth = [0]
    word = [0]  # the length of the stop string that is exactly this state's text (0: none)
    for stop in stops:
        state = 0
        for ch in stop:
            nxt = goto[state].get(ch)
            if nxt is None:
                nxt = goto[state][ch] = len(goto)
                goto.append({})
                depth.append(depth[state] + 1)
                word.append(0)
            state = nxt
        word[state] = len(stop)
    fail = [0] * len(goto)
    longest = [0] * len(goto)
    queue = deque(goto[0].values())  # breadth first: a state's suffixes come before it
    while queue:
        state = queue.popleft()
        longest[state] = word[state] or longest[fail[state]]
        for ch, child in goto[state].items():
            if state:
                link = fail[state]
                while link and ch not in goto[link]:
                    link = fail[link]
                fail[child] = goto[link].get(ch, 0)
            queue.append(child)
    return _Automaton(goto, fail, depth, longest)


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
