"""The text stage alone (actors/engine/text.py): the engine's token ids in, the clients' events
out, with no model and no MLX. Tokens here are characters (a token's id is its code point)."""

from __future__ import annotations

import json

import pytest

from troupe.actors.engine.text import (
    EndRequest,
    SampledLogprobs,
    TextOutput,
    TextStage,
    TokensSampled,
)
from troupe.actors.messages import (
    OutputSpec,
    RequestFinished,
    SamplingParams,
    TokensGenerated,
    Usage,
)

EOS = 0
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


class CharDetokenizer:
    """A streaming detokenizer of one character a token, as mlx-lm's are read: tokens
    added, the text since the last read in ``last_segment``."""

    def __init__(self) -> None:
        self.text, self.read = "", 0

    def add_token(self, token: int) -> None:
        self.text += chr(token)

    def finalize(self) -> None:
        pass

    @property
    def last_segment(self) -> str:
        segment, self.read = self.text[self.read:], len(self.text)
        return segment


class CharTokenizer:
    @property
    def detokenizer(self) -> CharDetokenizer:
        return CharDetokenizer()

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def stage_with(rid: str = "a", *, uid: int = 7, output: OutputSpec | None = None,
               prompt_tokens: int = 5, cached_tokens: int = 2, **sampling) -> TextStage:
    stage = TextStage()
    stage.open(TextOutput.of(CharTokenizer(), rid, uid,
                             SamplingParams(max_tokens=100, **sampling), output,
                             prompt_tokens=prompt_tokens, cached_tokens=cached_tokens))
    return stage


def engine_finish(rid: str, reason: str, completion: int) -> RequestFinished:
    """The engine's last event of a request: its own counts, no text."""
    return RequestFinished(request_id=rid, finish_reason=reason, ttft_s=0.5,
                           usage=Usage(prompt_tokens=5, completion_tokens=completion,
                                       cached_tokens=2))


def feed_text(stage: TextStage, rid: str, text: str, **kw):
    return stage.feed([TokensSampled(request_id=rid, token_ids=ids(text), **kw)])


def test_each_token_is_a_delta_of_its_text():
    stage = stage_with()
    events, notices = feed_text(stage, "a", "Hi ", ttft_s=0.25)
    events2, _ = feed_text(stage, "a", "you")
    assert notices == []
    assert [(e.text, e.token_ids) for e in events + events2] == [
        (c, [ord(c)]) for c in "Hi you"]


def test_a_stop_string_across_tokens_ends_the_request_with_a_notice_and_never_leaks():
    stage = stage_with(stop=["END"])
    first, _ = feed_text(stage, "a", "okEN")
    events, notices = feed_text(stage, "a", "Dmore", ttft_s=None)
    text = "".join(e.text for e in first + events if isinstance(e, TokensGenerated))
    assert text == "ok"
    final = events[-1]
    assert isinstance(final, RequestFinished)
    assert (final.finish_reason, final.stop_sequence) == ("stop", "END")
    # Counted up to the token the stop string ended at ("D"), not the ones after it.
    assert final.usage == Usage(prompt_tokens=5, completion_tokens=5, cached_tokens=2)
    assert notices == [EndRequest("a", 7, "stop string", 5)]


def test_tokens_and_the_engines_finish_after_a_notice_are_dropped():
    stage = stage_with(stop=["!"])
    _, notices = feed_text(stage, "a", "yes!")
    assert notices
    events, notices = stage.feed([TokensSampled(request_id="a", token_ids=ids("more")),
                                  engine_finish("a", "length", 8)])
    assert (events, notices) == ([], [])


def test_eos_ends_the_text_without_being_part_of_it_and_is_counted():
    stage = stage_with(stop=["xyz"])
    events, notices = stage.feed([
        TokensSampled(request_id="a", token_ids=[*ids("abxy"), EOS], finish_reason="stop"),
        engine_finish("a", "stop", 5)])
    assert notices == []
    # The held-back "xy" (a stop string's start) is flushed at the end.
    assert "".join(e.text for e in events if isinstance(e, TokensGenerated)) == "abxy"
    assert all(EOS not in e.token_ids for e in events if isinstance(e, TokensGenerated))
    final = events[-1]
    assert final.finish_reason == "stop" and final.usage.completion_tokens == 5
    assert final.ttft_s == 0.5  # the engine's, for a request the engine finished


def test_a_length_finish_flushes_the_held_back_text():
    stage = stage_with(stop=["xyz"])
    events, _ = stage.feed([
        TokensSampled(request_id="a", token_ids=ids("abxy"), finish_reason="length"),
        engine_finish("a", "length", 4)])
    assert "".join(e.text for e in events if isinstance(e, TokensGenerated)) == "abxy"
    assert events[-1].finish_reason == "length"


def test_reasoning_and_tool_calls_are_taken_out_and_counted():
    spec = OutputSpec(tool_format="json_tools", tools=[WEATHER], think=("<think>", "</think>"))
    stage = stage_with(output=spec)
    answer = "<think>hmm</think>" + CALL
    events, notices = stage.feed([
        TokensSampled(request_id="a", token_ids=[*ids(answer), EOS], finish_reason="stop"),
        engine_finish("a", "stop", len(answer) + 1)])
    assert notices == []
    deltas = [e for e in events if isinstance(e, TokensGenerated)]
    assert "".join(d.reasoning for d in deltas) == "hmm"
    assert "".join(d.text for d in deltas) == ""
    calls = [c for d in deltas for c in d.tool_calls or []]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"})]
    final = events[-1]
    # The answer ended after calling a tool: "tool_calls", whatever the engine said.
    assert final.finish_reason == "tool_calls"
    assert final.usage.completion_tokens == len(answer) + 1
    # The reasoning's tokens: from the one that completes the opening tag to the one that
    # completes the closing tag.
    assert final.usage.reasoning_tokens == len(">hmm</think>")


def test_a_repeated_call_ends_the_request_with_tool_calls_and_a_notice():
    stage = stage_with(output=OutputSpec(tool_format="json_tools", tools=[WEATHER]))
    events, notices = feed_text(stage, "a", CALL + "\n" + CALL + "\nmore", ttft_s=0.25)
    final = events[-1]
    assert notices == [EndRequest("a", 7, "repeated call", final.usage.completion_tokens)]
    assert isinstance(final, RequestFinished) and final.finish_reason == "tool_calls"
    calls = [c for e in events if isinstance(e, TokensGenerated) for c in e.tool_calls or []]
    assert len(calls) == 1
    assert final.usage.completion_tokens == len(CALL + "\n" + CALL)
    assert final.ttft_s == 0.25  # the first tokens', for a request the text ended


def test_logprobs_are_spelled_in_openais_shape():
    stage = stage_with(logprobs=True, top_logprobs=2)
    sampled = SampledLogprobs(-0.5, [(ord("h"), -0.5), (ord("j"), -1.5)])
    events, _ = stage.feed([TokensSampled(request_id="a", token_ids=ids("h"),
                                          logprobs=[sampled])])
    (lp,) = events[0].logprobs
    assert (lp.token, lp.token_id, lp.logprob, lp.bytes) == ("h", ord("h"), -0.5, [ord("h")])
    assert [(t.token, t.logprob) for t in lp.top_logprobs] == [("h", -0.5), ("j", -1.5)]


def test_no_logprobs_unless_asked():
    stage = stage_with()
    events, _ = stage.feed([TokensSampled(request_id="a", token_ids=ids("h"),
                                          logprobs=[SampledLogprobs(-0.5, [])])])
    assert events[0].logprobs is None


def test_a_failing_request_fails_alone_with_a_notice():
    stage = stage_with("bad")
    stage.open(TextOutput.of(CharTokenizer(), "good", 8, SamplingParams(max_tokens=9), None,
                             prompt_tokens=3))

    class Broken(CharDetokenizer):
        def add_token(self, token: int) -> None:
            raise RuntimeError("detokenizer exploded")

    stage.outputs["bad"].detokenizer = Broken()
    events, notices = stage.feed([TokensSampled(request_id="bad", token_ids=ids("x")),
                                  TokensSampled(request_id="good", token_ids=ids("y"))])
    assert notices == [EndRequest("bad", 7, "error", 1)]
    final = events[0]
    assert final.finish_reason == "error" and "exploded" in final.error
    assert [(e.request_id, e.text) for e in events[1:]] == [("good", "y")]


@pytest.mark.parametrize("reason", ["abort", "error", "length"])
def test_exactly_one_final_event_per_request(reason):
    stage = stage_with()
    events, _ = stage.feed([TokensSampled(request_id="a", token_ids=ids("ab")),
                            engine_finish("a", reason, 2), engine_finish("a", reason, 2)])
    finals = [e for e in events if isinstance(e, RequestFinished)]
    assert [f.finish_reason for f in finals] == [reason]
    assert finals[0].usage.completion_tokens == 2
    assert "a" not in stage.outputs
