"""Engine level: the batch engine on a tiny random model, against mlx-lm's own generation."""

from __future__ import annotations

import json

import pytest
from engine_helpers import encode, engine_config, fix_budget, greedy, run, run_arriving
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm import load
from reference import PROMPTS, detokenize, reference_tokens

from troupe.actors.engine.core import Engine
from troupe.actors.engine.grammar import Grammars
from troupe.actors.engine.schedule import MIN_PREFILL_CHUNK
from troupe.actors.engine.text import StopStringFilter
from troupe.actors.messages import (
    OutputFormat,
    OutputSpec,
    RequestFinished,
    SamplingParams,
    TokensGenerated,
)


def test_single_request_greedy_matches_mlx_lm(loaded):
    model, tok = loaded
    prompt = encode(tok, PROMPTS[0])
    engine = Engine(model, tok, engine_config())
    engine.add("a", prompt, greedy(24))
    res = run(engine)["a"]
    assert res["tokens"] == reference_tokens(model, tok, prompt, 24)
    assert res["finish"].usage.prompt_tokens == len(prompt)
    assert res["finish"].usage.completion_tokens >= len(res["tokens"])


def test_eight_requests_in_flight_match_each_alone(loaded):
    model, tok = loaded
    engine = Engine(model, tok, engine_config(prefill_step_size=8))
    prompts = {f"r{i}": encode(tok, p) for i, p in enumerate(PROMPTS)}
    lengths = {rid: 8 + 3 * i for i, rid in enumerate(prompts)}
    for rid, p in prompts.items():
        engine.add(rid, p, greedy(lengths[rid]))
    res = run(engine)
    for rid, p in prompts.items():
        assert res[rid]["tokens"] == reference_tokens(model, tok, p, lengths[rid]), rid


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "separate-calls"])
def test_requests_joining_a_running_batch_match_each_alone(loaded, mixed):
    model, tok = loaded
    engine = Engine(model, tok, engine_config(prefill_step_size=4, mixed_step=mixed))
    prompts = [encode(tok, p) for p in PROMPTS[:4]]
    results = run_arriving(engine, prompts, 20)
    for i, p in enumerate(prompts):
        assert results[f"r{i}"] == reference_tokens(model, tok, p, 20), i


def test_max_tokens_finishes_with_length(loaded):
    model, tok = loaded
    engine = Engine(model, tok, engine_config())
    engine.add("a", encode(tok, PROMPTS[1]), greedy(5, ignore_eos=True))
    res = run(engine)["a"]
    assert res["finish"].finish_reason == "length"
    assert len(res["tokens"]) == 5
    assert res["finish"].usage.completion_tokens == 5


def test_stop_string_ends_request_and_never_leaks(loaded):
    model, tok = loaded
    prompt = encode(tok, PROMPTS[0])
    full = detokenize(tok, reference_tokens(model, tok, prompt, 24))
    assert len(full) > 6
    stop = full[3:6]
    engine = Engine(model, tok, engine_config())
    engine.add("a", prompt, greedy(24, stop=[stop]))
    res = run(engine)["a"]
    assert res["finish"].finish_reason == "stop"
    assert res["finish"].stop_sequence == stop
    assert stop not in res["text"]
    assert res["text"] == full[: full.find(stop)]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.mark.parametrize("block_size", [0, 16], ids=["no-cache", "prefix-cache"])
def test_a_repeated_call_ends_the_request_at_once_with_tool_calls(loaded, block_size):
    """A grammar forces the same call three times: the request stops generating as the second
    one closes, with the first call alone and finish_reason tool_calls."""
    model, tok = loaded
    grammar = f"start: c \"\\n\" c \"\\n\" c\nc: {json.dumps(CALL)}"
    constraint = Grammars(tok, vocab_size=model.args.vocab_size).for_format(
        OutputFormat(type="lark", pattern=grammar))
    engine = Engine(model, tok, engine_config(block_size=block_size))
    engine.add("a", encode(tok, PROMPTS[0]), greedy(200), constraint=constraint,
               output=OutputSpec(tool_format="json_tools", tools=[WEATHER]))
    calls, tokens, finish = [], [], None
    while finish is None:
        for ev in engine.step():
            if isinstance(ev, TokensGenerated):
                calls += ev.tool_calls or []
                tokens += ev.token_ids
                assert not ev.text
            elif isinstance(ev, RequestFinished):
                finish = ev
    assert not engine.has_work and engine.runner.decoding == 0
    assert finish.finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Oslo"}')]
    assert tok.decode(tokens) == CALL + "\n" + CALL
    assert finish.usage.completion_tokens == len(tokens)


@pytest.mark.parametrize("ignore_eos", [False, True], ids=["eos-stops", "ignore-eos"])
def test_a_grammar_at_a_dead_end_ends_its_request_with_an_error(loaded, ignore_eos):
    """The grammar lets the answer begin "ab", then allows nothing (its rule x derives no
    finite text): the request ends there with an invalid-request error, never as a stop with
    the unfinished text, and the request beside it goes on alone."""
    model, tok = loaded
    constraint = Grammars(tok, vocab_size=model.args.vocab_size).for_format(
        OutputFormat(type="lark", pattern='start: "ab" x\nx: x "c"'))
    other = encode(tok, PROMPTS[1])
    engine = Engine(model, tok, engine_config())
    engine.add("a", encode(tok, PROMPTS[0]), greedy(40, ignore_eos=ignore_eos),
               constraint=constraint)
    engine.add("b", other, greedy(12))
    res = run(engine)
    finish = res["a"]["finish"]
    assert finish.finish_reason == "error" and finish.error_kind == "invalid", finish
    assert "dead end" in finish.error
    assert tok.decode(res["a"]["tokens"]) == "ab"
    assert res["b"]["tokens"] == reference_tokens(model, tok, other, 12)
    assert engine.runner.decoding == 0


def test_stop_string_filter_holds_back_partial_matches():
    f = StopStringFilter(["END"])
    assert f.feed("abc E") == ("abc ", False)
    assert f.feed("N") == ("", False)
    assert f.feed("X") == ("ENX", False)
    assert f.feed("..EN") == ("..", False)
    assert f.feed("D tail") == ("", True)
    assert f.matched == "END"


class OneStopAtATime:
    """The stop string filter as it was: each stop string looked for on its own in each
    delta, and a held-back prefix found for each (the reference for the automaton's)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
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
        self.pending = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text


# Few characters, so that stop strings overlap, share prefixes and recur in the text.
_STOP_TEXT = st.text(alphabet="ab\né<|>", max_size=12)


@settings(max_examples=400, deadline=None)
@given(stops=st.lists(_STOP_TEXT.filter(bool), min_size=1, max_size=64),
       deltas=st.lists(_STOP_TEXT, max_size=24))
def test_stop_string_filter_with_many_stops_matches_each_stop_looked_for_alone(
    stops: list[str], deltas: list[str]
) -> None:
    f, reference = StopStringFilter(stops), OneStopAtATime(stops)
    for text in deltas:
        assert f.feed(text) == reference.feed(text)
        assert f.matched == reference.matched
        assert f.pending == reference.pending
    assert f.flush() == reference.flush()


def test_abort_removes_request_and_frees_its_cache(loaded):
    model, tok = loaded
    engine = Engine(model, tok, engine_config())
    engine.add("keep", encode(tok, PROMPTS[0]), greedy(40, ignore_eos=True))
    engine.add("gone", encode(tok, PROMPTS[5]), greedy(40, ignore_eos=True))
    for _ in range(4):
        engine.step()
    with_both = engine.runner.cache_nbytes
    finished = engine.abort("gone")
    assert finished.finish_reason == "abort"
    assert "gone" not in engine.requests
    assert engine.runner.cache_nbytes < with_both
    res = run(engine)
    assert "gone" not in res and res["keep"]["finish"].finish_reason == "length"


def test_seeded_sampling_does_not_depend_on_batch_companions(loaded):
    model, tok = loaded
    prompt = encode(tok, PROMPTS[2])
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)

    alone = Engine(model, tok, engine_config())
    alone.add("s", prompt, params)
    a = run(alone)["s"]["tokens"]

    crowd = Engine(model, tok, engine_config())
    crowd.add("x", encode(tok, PROMPTS[0]), SamplingParams(max_tokens=12, temperature=1.0))
    crowd.add("s", prompt, params)
    b = run(crowd)["s"]["tokens"]
    assert a == b


def test_logprobs_report_chosen_token_and_sorted_top_alternatives(loaded):
    model, tok = loaded
    engine = Engine(model, tok, engine_config())
    engine.add("a", encode(tok, PROMPTS[0]), greedy(4, logprobs=True, top_logprobs=3,
                                                      ignore_eos=True))
    seen = []
    while engine.has_work:
        for ev in engine.step():
            if isinstance(ev, TokensGenerated):
                seen.extend(ev.logprobs)
    assert len(seen) == 4
    for lp in seen:
        assert len(lp.top_logprobs) == 3
        values = [t.logprob for t in lp.top_logprobs]
        assert values == sorted(values, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert lp.top_logprobs[0].token_id == lp.token_id
        assert lp.logprob == pytest.approx(values[0])
        assert lp.logprob <= 0.0


def test_a_failing_request_fails_alone(loaded):
    model, tok = loaded
    engine = Engine(model, tok, engine_config())
    good = encode(tok, PROMPTS[0])
    engine.add("good", good, greedy(16))
    bad = engine.add("bad", encode(tok, PROMPTS[1]), greedy(16))

    class Broken:
        def add_token(self, token):
            raise RuntimeError("detokenizer exploded")

    engine.text.outputs[bad.request_id].detokenizer = Broken()
    res = run(engine)
    assert res["bad"]["finish"].finish_reason == "error"
    assert "exploded" in res["bad"]["finish"].error
    assert res["good"]["tokens"] == reference_tokens(model, tok, good, 16)


def test_hybrid_model_batches_like_mlx_lm(tiny_hybrid_dir):
    model, tok = load(str(tiny_hybrid_dir))
    engine = Engine(model, tok, engine_config(prefill_step_size=8))
    prompts = {f"r{i}": encode(tok, p) for i, p in enumerate(PROMPTS[:3])}
    for rid, p in prompts.items():
        engine.add(rid, p, greedy(10))
    res = run(engine)
    for rid, p in prompts.items():
        assert res[rid]["tokens"] == reference_tokens(model, tok, p, 10), rid


def test_hybrid_requests_joining_a_running_batch_match_each_alone(tiny_hybrid_dir):
    """Recurrent and attention layers: sequences join while others decode (their last
    prompt token a row of the decode step), each as mlx-lm generates it alone."""
    model, tok = load(str(tiny_hybrid_dir))
    engine = Engine(model, tok, engine_config(prefill_step_size=4))
    assert not engine.runner.mixed
    prompts = [encode(tok, p) for p in PROMPTS[:3]]
    results = run_arriving(engine, prompts, 12)
    for i, p in enumerate(prompts):
        assert results[f"r{i}"] == reference_tokens(model, tok, p, 12), i


@pytest.mark.parametrize("kind", ["mixed", "separate-calls", "hybrid"])
def test_the_first_token_comes_in_the_step_that_samples_it(loaded, tiny_hybrid_dir, kind):
    """A short prompt alone. With mixed steps, one step prefills all of it and answers the
    first token, sampled from the chunk's logits at the last prompt token. Without, one step
    prefills all but its last token and the next runs that token and answers the first
    token. (mlx-lm's generator answers a step's tokens one step later, after the next
    forward pass has run: a third step.)"""
    model, tok = load(str(tiny_hybrid_dir)) if kind == "hybrid" else loaded
    engine = Engine(model, tok, engine_config(mixed_step=kind == "mixed"))
    prompt = encode(tok, PROMPTS[0])
    engine.add("a", prompt, greedy(8, ignore_eos=True))
    answered: list[tuple[int, int]] = []  # (step, token)
    for i in range(4):
        answered += [(i, t) for ev in engine.step() if isinstance(ev, TokensGenerated)
                     for t in ev.token_ids]
    first = 0 if kind == "mixed" else 1
    assert [i for i, _ in answered] == list(range(first, 4))  # then one token a step
    assert [t for _, t in answered] == reference_tokens(model, tok, prompt, 8)[:4 - first]


def test_warm_up_leaves_the_engine_as_it_was(loaded, tiny_hybrid_dir):
    for model, tok in (loaded, load(str(tiny_hybrid_dir))):
        engine = Engine(model, tok, engine_config(block_size=16))
        assert engine.warm_up() > 0
        assert not engine.has_work and engine.steps == 0 and not engine.blocks
        assert engine.prefill_tokens == 0 and engine.generated_tokens == 0
        prompt = encode(tok, PROMPTS[1])
        engine.add("a", prompt, greedy(12))
        assert run(engine)["a"]["tokens"] == reference_tokens(model, tok, prompt, 12)


# -- prefill interleaved with decode -------------------------------------------------------


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "separate-calls"])
def test_a_long_prompt_is_prefilled_in_budgeted_chunks_while_streams_decode(loaded, mixed):
    """With streams decoding, each step prefills only the budget (from the decode step's and a
    prompt token's times); every stream gets a token every step; the output is unchanged,
    whether the chunk rides in the decode step's forward pass or has a call of its own."""
    model, tok = loaded
    long_prompt = encode(tok, " ".join(PROMPTS) * 3)
    assert len(long_prompt) > 150
    short = {f"s{i}": encode(tok, p) for i, p in enumerate(PROMPTS[:4])}

    engine = Engine(model, tok, engine_config(prefill_step_size=512, prefill_interleave=1.0,
                                              mixed_step=mixed))
    assert engine.runner.mixed is mixed
    floor = MIN_PREFILL_CHUNK
    # Fixed timings so the budget is known: 8 tokens a step, raised to the floor.
    fix_budget(engine, 8)
    for rid, p in short.items():
        engine.add(rid, p, greedy(400, ignore_eos=True))
    got: dict[str, list[int]] = {rid: [] for rid in [*short, "long"]}
    while any(len(got[r]) == 0 for r in short):
        for ev in engine.step():
            if isinstance(ev, TokensGenerated):
                got[ev.request_id] += ev.token_ids
    engine.add("long", long_prompt, greedy(8))
    steps = 0
    while not got["long"]:
        before = engine.prefill_tokens
        counts = {r: len(got[r]) for r in short}
        for ev in engine.step():
            if isinstance(ev, TokensGenerated):
                got[ev.request_id] += ev.token_ids
        steps += 1
        assert engine.last_prefill_budget == floor
        assert engine.prefill_tokens - before <= floor
        assert all(len(got[r]) == counts[r] + 1 for r in short), "a stream missed a step"
    assert steps >= len(long_prompt) // floor
    while "long" in engine.requests:
        for ev in engine.step():
            if isinstance(ev, TokensGenerated):
                got[ev.request_id] += ev.token_ids
    assert got["long"] == reference_tokens(model, tok, long_prompt, 8)
    for r in short:
        engine.abort(r)


def test_a_short_prompt_is_never_split_even_beside_a_long_one(loaded):
    """Under the budget, a chat-sized prompt (its rest within SHORT_PROMPT budgets) is
    prefilled in one step: the budget holds back long prompts, not short ones."""
    from troupe.actors.engine.schedule import SHORT_PROMPT

    model, tok = loaded
    engine = Engine(model, tok, engine_config(prefill_step_size=512, prefill_interleave=1.0))
    fix_budget(engine, 32)
    # Three streams, more than the two prompts: the budget holds (schedule.first_tokens_first).
    for i in range(3):
        engine.add(f"decoder{i}", encode(tok, PROMPTS[i]), greedy(400, ignore_eos=True))
    while engine.runner.decoding < 3:
        engine.step()
    long_prompt = encode(tok, " ".join(PROMPTS) * 3)
    short = encode(tok, " ".join(reversed(PROMPTS)))[:40]
    budget = 32
    assert budget < len(short) <= SHORT_PROMPT * budget < len(long_prompt)
    engine.add("long", long_prompt, greedy(4))
    engine.add("short", short, greedy(4))
    before = engine.prefill_tokens
    engine.step()
    assert engine.last_prefill_budget == budget
    # Both joined with a chunk the size of the short prompt's rest: the short one prefilled
    # all of it (its last token too: the step samples its first token), the long one that
    # chunk.
    assert engine.runner.mixed
    assert engine.prefill_tokens - before == len(short) + len(short)
    assert "short" in engine.requests and engine.requests["short"].generated == 1
    for rid in list(engine.requests):
        engine.abort(rid)


def test_prefill_runs_whole_chunks_when_nothing_decodes_or_interleave_is_off(loaded):
    model, tok = loaded
    engine = Engine(model, tok, engine_config(prefill_step_size=32, prefill_interleave=1.0))
    engine._decode_s, engine._token_s = 0.08, 0.01
    engine.add("a", encode(tok, " ".join(PROMPTS)), greedy(4))
    engine.step()
    assert engine.last_prefill_budget is None  # nothing was decoding
    assert engine.prefill_tokens == 32

    off = Engine(model, tok, engine_config(prefill_step_size=64, prefill_interleave=0.0))
    fix_budget(off, 8)
    off.add("a", encode(tok, PROMPTS[0]), greedy(8))
    off.step()
    off.add("b", encode(tok, " ".join(PROMPTS) * 3), greedy(4))
    counted = off.prefill_tokens
    off.step()  # "a" decodes while "b" prefills a whole chunk
    assert off.last_prefill_budget is None
    assert off.prefill_tokens - counted == 64


def prefill_per_step(engine: Engine, rid: str, prompt: list[int]) -> list[int]:
    """Add ``prompt`` as ``rid`` and step until its first token: the prompt tokens each
    step ran."""
    engine.add(rid, prompt, greedy(4))
    done: list[int] = []
    while not engine.requests[rid].generated:
        before = engine.prefill_tokens
        engine.step()
        done.append(engine.prefill_tokens - before)
    return done


def test_a_long_prefill_beside_a_decoding_row_runs_chunks_that_fit_the_step_budget(loaded):
    """One chat answering while a long prompt prefills (as many prompts as streams: whole
    chunks by the interleave rules alone): under a 200 ms step budget, at 2 ms a prompt token
    and 40 ms a decode step, each step prefills 80 tokens; alone, the same prompt runs whole
    chunks, and so it does beside the stream with the budget off."""
    model, tok = loaded
    long_prompt = encode(tok, " ".join(PROMPTS) * 8)
    assert len(long_prompt) > 3 * 128

    def engine(budget_ms: float) -> Engine:
        made = Engine(model, tok, engine_config(prefill_step_size=128, prefill_interleave=1.2,
                                                step_budget_ms=budget_ms))
        made._measure = lambda *a: None  # fixed step timings: the rate is fed in
        made._decode_s, made._token_s = 0.04, 0.002
        return made

    def beside_a_stream(made: Engine) -> list[int]:
        made.add("chat", encode(tok, PROMPTS[0]), greedy(400, ignore_eos=True))
        while not made.requests["chat"].generated:
            made.step()
        chunks = prefill_per_step(made, "long", long_prompt)
        assert made.runner.decoding >= 1
        return chunks

    budgeted = engine(200.0)
    chunks = beside_a_stream(budgeted)
    assert budgeted.last_prefill_budget == 80
    assert max(chunks) == 80 and sum(chunks) == len(long_prompt)
    assert prefill_per_step(engine(200.0), "long", long_prompt)[0] == 128  # alone
    assert beside_a_stream(engine(0.0))[0] == 128  # budget off: today's whole chunks


def test_step_times_are_learned_from_whole_steps():
    from troupe.actors.engine.schedule import EMA

    engine = Engine.__new__(Engine)
    engine._decode_s = engine._token_s = None
    engine._measure(0, 4, 0.2)  # decode only: a decode step is 0.2 s
    assert engine._decode_s == pytest.approx(0.2)
    engine._measure(100, 4, 1.2)  # decode + 100 prompt tokens: 10 ms a token
    assert engine._token_s == pytest.approx(0.01)
    engine._measure(50, 0, 1.0)  # prefill alone: 20 ms a token, smoothed
    assert engine._token_s == pytest.approx(EMA * 0.02 + (1 - EMA) * 0.01)


def test_a_decode_step_is_learned_beside_a_prefill_that_never_stops():
    """A chat that joins a long prompt's prefill decodes only in steps that carry a chunk:
    its decode step is the step less the chunk at the rate the prefill ran alone, so the
    interleave and the step budget size the chunks from then on."""
    engine = Engine.__new__(Engine)
    engine._decode_s = engine._token_s = None
    engine._measure(100, 1, 1.0)  # decoding beside a chunk, nothing known: nothing learned
    assert engine._decode_s is None and engine._token_s is None
    engine._measure(500, 0, 5.0)  # the long prompt alone: 10 ms a token
    engine._measure(100, 1, 1.3)  # a chat decodes beside its chunk: 0.3 s of decode
    assert engine._decode_s == pytest.approx(0.3)
    assert engine._token_s == pytest.approx(0.01)


def test_progress_tells_waiting_prefilling_n_of_m_then_decoding(loaded):
    model, tok = loaded
    engine = Engine(model, tok, engine_config(prefill_step_size=8, prefill_batch_size=1))
    long = encode(tok, " ".join(PROMPTS))
    engine.add("long", long, greedy(4, ignore_eos=True))
    engine.add("next", encode(tok, PROMPTS[0]), greedy(4, ignore_eos=True))
    assert {p["id"]: p["stage"] for p in engine.progress()} == {"long": "waiting",
                                                                 "next": "waiting"}
    engine.step()
    first = {p["id"]: p for p in engine.progress()}
    assert first["long"]["stage"] == "prefilling"
    assert 0 < first["long"]["prefilled_tokens"] < first["long"]["prompt_tokens"] == len(long)
    assert first["next"]["stage"] == "waiting"  # one prompt prefills at a time here
    while engine.has_work and engine.progress()[0]["stage"] != "decoding":
        engine.step()
    decoding = engine.progress()[0]
    assert decoding["id"] == "long" and decoding["generated_tokens"] >= 1
    run(engine)
    assert engine.progress() == []
