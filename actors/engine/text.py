"""A request's text on its way out: the engine's token ids become the client's deltas.

The engine emits plain events (``TokensSampled``, and its ``RequestFinished``); a
``TextStage`` turns them into ``TokensGenerated`` deltas and one final ``RequestFinished``:
it detokenizes, holds back and cuts at stop strings (``StopStringFilter``), takes reasoning and
tool calls out of the text (``delta``), formats logprobs and counts the answer's tokens. A
request the text ends (a stop string, a repeated tool call) gets its final event here, and the
stage gives a notice (``EndRequest``) that the engine must take it out; tokens the engine made
for it meanwhile are dropped, never shown nor counted.

No MLX here: the stage runs inside ``Engine.update`` (engine tests, followers, benchmarks) or on
a thread of its own beside the MLX thread (the scheduler's ``TextWorker``), the same class.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec

from troupe.actors.engine.agent_output import OutputParser, Parsed
from troupe.actors.messages import (
    OutputSpec,
    RequestFinished,
    SamplingParams,
    TokenLogprob,
    TokensGenerated,
    TopLogprob,
    Usage,
)

log = logging.getLogger("actors.engine.text")


class SampledLogprobs(msgspec.Struct, frozen=True, gc=False):
    """A sampled token's logprob and the most likely tokens' (id, logprob), most likely
    first: numbers the MLX thread took from the logits, for the stage to spell out."""

    logprob: float
    top: list[tuple[int, float]]


class TokensSampled(msgspec.Struct, kw_only=True, gc=False):
    """The tokens one step sampled for a request (one, or a draft's kept tokens and the one
    after them). ``finish_reason``: the engine finished the request at the last of them,
    "stop" (a stop token or EOS, which is not part of the text) or "length". ``logprobs``:
    one per token when the request asked for them. ``ttft_s``: on a request's first tokens,
    the time from its arrival to them."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[SampledLogprobs] | None = None
    ttft_s: float | None = None


class EndRequest(NamedTuple):
    """The stage ended a request that the engine still runs (``reason``: "stop string" or
    "repeated call"): the engine takes it out, keeping the blocks its answer completed.
    ``uid``: the engine's sequence, so that a later request given the same id is not ended;
    ``generated``: the answer's tokens up to the end (what its usage counts)."""

    request_id: str
    uid: int
    reason: str
    generated: int


Event = TokensGenerated | RequestFinished
EngineEvent = TokensSampled | RequestFinished


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


def delta(out: TextOutput, text: str, token_ids: list[int],
          logprobs: list[TokenLogprob] | None, *, last: bool, cut: bool = False
          ) -> TokensGenerated | None:
    """The client's delta for ``text`` of request ``out``: with a parser, reasoning and tool
    calls are taken out of it (markup that may begin one is held back, and flushed by the last
    delta; ``cut``: the output was cut short, not ended by the model). None when a delta
    without tokens carries nothing. When the parser has ``ended`` after it (a repeated call),
    the request is to end now."""
    reasoning, calls = "", None
    parser = out.parser
    if parser is not None:
        was_reasoning = parser.in_reasoning
        parsed = parser.feed(text)
        if last:
            end = parser.finish(cut=cut)
            parsed = Parsed(text=parsed.text + end.text,
                            reasoning=parsed.reasoning + end.reasoning,
                            tool_calls=parsed.tool_calls + end.tool_calls)
        if token_ids and (was_reasoning or parser.in_reasoning):
            out.reasoning_tokens += len(token_ids)
        text, reasoning, calls = parsed.text, parsed.reasoning, parsed.tool_calls or None
    if not (token_ids or text or reasoning or calls):
        return None
    return TokensGenerated(request_id=out.request_id, text=text, token_ids=token_ids,
                           logprobs=logprobs, reasoning=reasoning, tool_calls=calls)


def spell_logprobs(decode: Callable[[list[int]], str], token: int, sampled: SampledLogprobs
                   ) -> list[TokenLogprob]:
    """The sampled token's logprob and the most likely tokens', spelled out (OpenAI's shape)."""
    top = []
    for i, v in sampled.top:
        piece = decode([i])
        top.append(TopLogprob(token=piece, token_id=i, logprob=v,
                              bytes=list(piece.encode("utf-8"))))
    piece = decode([token])
    return [TokenLogprob(token=piece, token_id=token, logprob=sampled.logprob,
                         bytes=list(piece.encode("utf-8")), top_logprobs=top)]


@dataclass
class TextOutput:
    """One request's text: its detokenizer, stop strings, parser and counts."""

    request_id: str
    uid: int  # the engine's sequence (``EndRequest``)
    detokenizer: Any
    stops: StopStringFilter
    decode: Callable[[list[int]], str]  # a logprob's token as text
    prompt_tokens: int
    cached_tokens: int = 0
    # Reads tool calls and reasoning out of a chat answer (None: the text is all content).
    parser: OutputParser | None = None
    logprobs: bool = False
    generated: int = 0  # the answer's tokens so far, an ending stop token included
    reasoning_tokens: int = 0
    ttft_s: float | None = None
    # A repeated call ended the answer at the token the engine finished it with.
    ended_by_call: bool = False

    @classmethod
    def of(cls, tokenizer: Any, request_id: str, uid: int, sampling: SamplingParams,
           output: OutputSpec | None, *, prompt_tokens: int, cached_tokens: int = 0
           ) -> TextOutput:
        """The text of a request the engine runs as sequence ``uid``."""
        return cls(request_id=request_id, uid=uid, detokenizer=tokenizer.detokenizer,
                   stops=StopStringFilter(sampling.stop), decode=tokenizer.decode,
                   prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                   parser=OutputParser(output) if output is not None else None,
                   logprobs=sampling.logprobs)

    def tokens(self, ev: TokensSampled) -> tuple[list[Event], EndRequest | None]:
        """The deltas of a step's tokens; when the text ends the request, its final event
        too and the notice for the engine (the tokens after the one it ended at are
        dropped)."""
        if self.ttft_s is None:
            self.ttft_s = ev.ttft_s
        events: list[Event] = []
        n = len(ev.token_ids)
        for i, token in enumerate(ev.token_ids):
            finish = ev.finish_reason if i == n - 1 else None
            self.generated += 1
            if finish == "stop":
                # EOS and stop token ids end the text; they are not part of it.
                self.detokenizer.finalize()
                text, _ = self.stops.feed(self.detokenizer.last_segment)
                text += self.stops.flush()
                if rest := delta(self, text, [], None, last=True):
                    events.append(rest)
                break
            self.detokenizer.add_token(token)
            if finish is not None:
                self.detokenizer.finalize()
            text, matched = self.stops.feed(self.detokenizer.last_segment)
            logprobs = (spell_logprobs(self.decode, token, ev.logprobs[i])
                        if self.logprobs and ev.logprobs else None)
            if matched:
                events.append(delta(self, text, [token], logprobs, last=True, cut=True))
                events.append(self.ended("stop", stop_sequence=self.stops.matched))
                return events, EndRequest(self.request_id, self.uid, "stop string",
                                           self.generated)
            if finish is not None:
                text += self.stops.flush()
            events.append(delta(self, text, [token], logprobs, last=finish is not None,
                                cut=finish == "length"))
            if self.parser is not None and self.parser.ended:
                # A call repeated an earlier one: the answer ended there, as at a stop string.
                if finish is None:
                    events.append(self.ended("tool_calls"))
                    return events, EndRequest(self.request_id, self.uid, "repeated call",
                                               self.generated)
                self.ended_by_call = True
        return events, None

    def ended(self, reason: str, *, stop_sequence: str | None = None) -> RequestFinished:
        """The final event of a request its text ended."""
        return RequestFinished(
            request_id=self.request_id, finish_reason=self._reason(reason),
            usage=Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.generated,
                        cached_tokens=self.cached_tokens,
                        reasoning_tokens=self.reasoning_tokens),
            ttft_s=self.ttft_s, stop_sequence=stop_sequence)

    def finished(self, ev: RequestFinished) -> RequestFinished:
        """The final event of a request the engine finished (EOS, length, abort, error)."""
        usage = msgspec.structs.replace(ev.usage, completion_tokens=self.generated,
                                        reasoning_tokens=self.reasoning_tokens)
        reason = "tool_calls" if self.ended_by_call else self._reason(ev.finish_reason)
        return msgspec.structs.replace(ev, finish_reason=reason, usage=usage)

    def _reason(self, reason: str) -> str:
        if reason == "stop" and self.parser is not None and self.parser.calls_made:
            return "tool_calls"  # the answer ended after calling tools
        return reason

    def failed(self, error: Exception) -> RequestFinished:
        """The final event of a request whose text work raised."""
        return RequestFinished(
            request_id=self.request_id, finish_reason="error",
            usage=Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.generated,
                        cached_tokens=self.cached_tokens,
                        reasoning_tokens=self.reasoning_tokens),
            error=str(error), error_kind="internal", ttft_s=self.ttft_s)


class TextStage:
    """The text of many requests: each ``open``ed, fed the engine's events in order, and
    closed by its one final event. Events of a request it does not hold (one it ended, whose
    tokens the engine made before it heard) are dropped. One thread at a time."""

    def __init__(self) -> None:
        self.outputs: dict[str, TextOutput] = {}

    def open(self, out: TextOutput) -> None:
        self.outputs[out.request_id] = out

    def feed(self, events: Iterable[EngineEvent]) -> tuple[list[Event], list[EndRequest]]:
        """The clients' events for the engine's, and the requests the engine must end."""
        out: list[Event] = []
        notices: list[EndRequest] = []
        outputs = self.outputs
        for ev in events:
            text = outputs.get(ev.request_id)
            if text is None:
                continue
            if isinstance(ev, RequestFinished):
                del outputs[ev.request_id]
                out.append(text.finished(ev))
                continue
            try:
                made, notice = text.tokens(ev)
            except Exception as exc:  # one request's text work failed: only it fails
                log.exception("request %s failed", ev.request_id)
                made = [text.failed(exc)]
                notice = EndRequest(ev.request_id, text.uid, "error", text.generated)
            out.extend(e for e in made if e is not None)
            if notice is not None:
                del outputs[ev.request_id]
                notices.append(notice)
        return out, notices
