"""Speculative decoding with prompt-lookup drafts (actors/engine/speculate.py, the runner's
``_decode_drafts``): greedy answers are the tokens decoding without drafts gives, whatever the
batch holds, and the drafts are really taken (fewer steps, accepted tokens counted).

Tiny random-weight models (tests/tiny_model.py): their greedy answers fall into loops after a
while, which the drafts then predict, as an agent's answer repeats what it was shown.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import http_stack
import pytest
from engine_helpers import engine_config, greedy, ram_hit, run, run_aborting
from mlx_lm import load
from reference import reference_tokens
from tiny_model import make_tiny_model

from troupe.actors.engine.core import Engine
from troupe.actors.engine.speculate import MAX_DRAFT, Drafter
from troupe.actors.messages import AdmitChat, AdmitCompletion, SamplingParams, TokensGenerated

scripted, client = http_stack.scripted, http_stack.client

TEXTS = ["The quick brown fox jumps over the lazy dog. " * 5, "Numbers like 12345 and 12345 and",
         "def add(a, b): return a + b\n" * 3, "Paris"]


# -- the drafter -----------------------------------------------------------------------------


def test_a_draft_is_what_followed_the_latest_earlier_occurrence_of_the_longest_match() -> None:
    d = Drafter()
    d.extend([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2])
    # "2 3" then 3: the 3-gram (1, 2, 3) occurred at the start, followed by 4 5 9 ...
    assert d.draft(3, 4) == [4, 5, 9, 2]
    # (9, 2, 3) matches nothing longer; (2, 3) last ended before 7.
    d2 = Drafter()
    d2.extend([1, 2, 3, 4, 9, 2])
    assert d2.draft(3, 2) == [4, 9]
    assert d.draft(42, 4) == []  # nothing ends in 42
    assert d.draft(3, 0) == []


def test_the_drafter_catches_up_with_a_rows_tokens_and_what_it_carries() -> None:
    """A hybrid row's carried tokens (``Sequence.carried``) follow its cached ones: each is
    indexed once, whether it arrives carried, carried again, or cached."""
    d = Drafter()
    d.sync([1, 2], [3, 4])
    d.sync([1, 2], [3, 4, 1])
    d.sync([1, 2, 3, 4, 1, 2])
    assert d.draft(3, 3) == [4, 1, 2]
    d.sync([1, 2, 3, 4, 1, 2, 3, 9], [4, 1])
    assert d.draft(2, 3) == [3, 9, 4]


def test_the_draft_length_follows_what_was_accepted() -> None:
    d = Drafter()
    assert d.length == MAX_DRAFT
    d.verified(6, 1)
    assert d.length == 2
    d.verified(2, 2)
    assert d.length == 3
    d.verified(3, 0)
    assert d.length == 1 and (d.drafted, d.accepted) == (11, 3)


def test_drafts_of_which_nothing_is_kept_pause_drafting_longer_each_time() -> None:
    d = Drafter()
    d.extend([1, 2, 3, 4, 1, 2])
    assert d.draft(3, 4) == [4, 1, 2]
    paused = []
    for _ in range(3):
        d.verified(1, 0)
        n = 0
        while not d.draft(3, 4):
            n += 1
        paused.append(n)
    assert paused == [2, 4, 8]
    d.verified(1, 1)  # kept: the next miss pauses 2 steps again
    d.verified(1, 0)
    assert [d.draft(3, 4) for _ in range(3)] == [[], [], [4]]


# -- in the engine ---------------------------------------------------------------------------

# The one-pass step and mlx-lm's own call. (The tiny llama's answers do not fall into loops
# within a hundred tokens: its drafts are rarely right, and the test could not tell.)
ARCHS = [("qwen3", 2), ("qwen3_moe", 2)]


@pytest.fixture(scope="module", params=ARCHS, ids=[a for a, _ in ARCHS])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    arch, layers = request.param
    model_dir = make_tiny_model(tmp_path_factory.mktemp(arch) / arch, arch=arch, layers=layers)
    return load(str(model_dir))


def serve_all(tiny: Any, spec: str, requests: dict[str, tuple[list[int], SamplingParams]],
              **settings: Any) -> tuple[dict[str, dict], Engine]:
    model, tok = tiny
    e = Engine(model, tok, engine_config(speculative=spec, **settings))
    for rid, (prompt, sampling) in requests.items():
        e.add(rid, prompt, sampling)
    return run(e), e


def test_greedy_answers_with_drafts_are_those_without_in_a_batch(tiny: Any) -> None:
    model, tok = tiny
    requests = {f"r{i}": (tok.encode(t), greedy(100 + 7 * i, ignore_eos=True))
                for i, t in enumerate(TEXTS)}
    off, e_off = serve_all(tiny, "off", requests)
    on, e_on = serve_all(tiny, "ngram", requests)
    for rid in requests:
        assert on[rid]["tokens"] == off[rid]["tokens"]
        assert on[rid]["text"] == off[rid]["text"]
        assert on[rid]["finish"].usage.completion_tokens == len(off[rid]["tokens"])
    want = reference_tokens(model, tok, requests["r0"][0], 100)
    assert off["r0"]["tokens"][: len(want)] == want
    assert e_off.runner.drafted == 0
    assert e_on.runner.accepted > 0 and e_on.steps < e_off.steps


def test_a_stop_token_and_the_token_limit_inside_an_accepted_draft(tiny: Any) -> None:
    _, tok = tiny
    prompt = tok.encode(TEXTS[0])
    off, _ = serve_all(tiny, "off", {"a": (prompt, greedy(120, ignore_eos=True))})
    answer = off["a"]["tokens"]
    # The token that comes first the latest in the answer (drafts were taken before it).
    late = max(set(answer), key=answer.index)
    assert answer.index(late) > 8
    stop = SamplingParams(max_tokens=120, temperature=0.0, stop_token_ids=[late],
                          ignore_eos=True)
    for limit in (61, 77, 93):
        got, e = serve_all(tiny, "ngram", {"stop": (prompt, stop),
                                            "limit": (prompt, greedy(limit, ignore_eos=True))})
        assert got["stop"]["tokens"] == answer[: answer.index(late)]
        assert got["stop"]["finish"].finish_reason == "stop"
        assert got["limit"]["tokens"] == answer[:limit]
        assert got["limit"]["finish"].finish_reason == "length"
        assert e.runner.accepted > 0


def test_a_sampled_row_beside_drafting_rows_and_a_prefill_riding_the_step(tiny: Any) -> None:
    """Rows that sample (temperature, penalties) take no draft and sample their first
    position as a plain step does; a prompt prefilled in chunks rides the same passes."""
    _, tok = tiny
    long = tok.encode(TEXTS[2] * 6)
    requests = {
        "g": (tok.encode(TEXTS[0]), greedy(90, ignore_eos=True)),
        "s": (tok.encode(TEXTS[1]), SamplingParams(max_tokens=40, temperature=0.8, seed=7,
                                                   ignore_eos=True)),
        "p": (tok.encode(TEXTS[3]), SamplingParams(max_tokens=40, temperature=0.0,
                                                   repetition_penalty=1.3, ignore_eos=True)),
    }
    model, _ = tiny
    results = {}
    for spec in ("off", "ngram"):
        e = Engine(model, tok, engine_config(speculative=spec, prefill_step_size=16))
        for rid, (prompt, sampling) in requests.items():
            e.add(rid, prompt, sampling)
        got: dict[str, list[int]] = {rid: [] for rid in [*requests, "long"]}
        steps = 0
        while e.has_work:
            if steps == 30:
                e.add("long", long, greedy(20, ignore_eos=True))
            for ev in e.step():
                if isinstance(ev, TokensGenerated):
                    got[ev.request_id] += ev.token_ids
            steps += 1
        results[spec] = (got, e)
    (off, _), (on, e_on) = results["off"], results["ngram"]
    assert on["g"] == off["g"] and on["p"] == off["p"] and on["long"] == off["long"]
    assert len(on["s"]) == 40
    assert e_on.runner.accepted > 0


def test_an_abort_between_drafting_steps_leaves_the_others_answers(tiny: Any) -> None:
    _, tok = tiny
    requests = {f"r{i}": (tok.encode(t), greedy(80, ignore_eos=True))
                for i, t in enumerate(TEXTS)}
    off, _ = serve_all(tiny, "off", requests)
    model, _ = tiny
    e = Engine(model, tok, engine_config(speculative="ngram"))
    for rid, (prompt, sampling) in requests.items():
        e.add(rid, prompt, sampling)
    got = run_aborting(e, "r1", 40)
    for rid in ("r0", "r2", "r3"):
        assert got[rid] == off[rid]["tokens"]
    assert got["r1"] == off["r1"]["tokens"][: len(got["r1"])]


# -- sliding windows --------------------------------------------------------------------------

# Sliding-window layers (a rotating cache) beside global ones; at these sizes (windows of 8 to
# 18 tokens) every answer runs far past its window.
SLIDING = ["gemma3_text", "mistral", "gpt_oss", "gemma4_text"]


@pytest.fixture(scope="module", params=SLIDING)
def sliding(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    arch = request.param
    return load(str(make_tiny_model(tmp_path_factory.mktemp(arch) / arch, arch=arch,
                                    layers=4)))


def foreseeing(prompts: dict[str, list[int]], answers: dict[str, list[int]],
               wrong: bool) -> type[Drafter]:
    """A drafter that drafts each row's answer (decoding without drafts gives it) in runs of
    five steps with drafts and five without, so the windows wrap while the rows decode a
    token a step and then take a pass of several positions; ``wrong``: each draft's last
    token wrong (rejected), and every third row-step drafts nothing beside drafting rows."""

    class Foreseeing(Drafter):
        def sync(self, tokens: list[int], more: Any = ()) -> None:
            self.context = [*tokens, *more]

        def draft(self, last: int, most: int) -> list[int]:
            context = [*self.context, last]
            if (len(context) // 5) % 2 or (wrong and len(context) % 3 == 0):
                return []
            for rid, prompt in prompts.items():
                whole = prompt + answers[rid]
                if whole[:len(context)] == context:
                    draft = whole[len(context):len(context) + min(most, 4)]
                    if wrong and draft:
                        draft[-1] = (draft[-1] + 1) % 300
                    return draft
            return []

    return Foreseeing


@pytest.mark.parametrize("wrong", [False, True], ids=["right", "wrong"])
def test_sliding_window_models_take_drafts_with_the_same_answers(
        sliding: Any, monkeypatch: pytest.MonkeyPatch, wrong: bool) -> None:
    """Rows of different lengths (left padding) whose windows wrapped, drafts kept whole and
    in part, rows drafting beside rows that do not: the answers of decoding without drafts,
    and mlx-lm's own."""
    from troupe.actors.engine import runner

    model, tok = sliding
    prompts = {f"r{i}": tok.encode(t) for i, t in enumerate(TEXTS)}
    requests = {rid: (p, greedy(90, ignore_eos=True)) for rid, p in prompts.items()}
    off, _ = serve_all(sliding, "off", requests)
    answers = {rid: off[rid]["tokens"] for rid in requests}
    assert len(set(map(tuple, answers.values()))) == 4
    want = reference_tokens(model, tok, prompts["r0"], 90)  # cut at an end of sequence
    assert answers["r0"][:len(want)] == want
    monkeypatch.setattr(runner, "Drafter", foreseeing(prompts, answers, wrong))
    on, e = serve_all(sliding, "ngram", requests)
    for rid in requests:
        assert on[rid]["tokens"] == answers[rid], rid
    assert e.runner.accepted > 0
    assert (e.runner.accepted < e.runner.drafted) == wrong


def test_a_sliding_window_prefix_hit_after_a_drafted_run_answers_the_same(
        sliding: Any) -> None:
    """The blocks cut from a window whose rejected positions were rolled out hold the
    window's tokens: a RAM hit on them answers as the first run did."""
    model, tok = sliding
    long = tok.encode(TEXTS[0] + TEXTS[2])
    e = Engine(model, tok, engine_config(speculative="ngram", block_size=16))
    e.add("a", long, greedy(60, ignore_eos=True))
    first = run(e)["a"]
    want = reference_tokens(model, tok, long, 60)  # cut at an end of sequence
    assert first["tokens"][:len(want)] == want
    again = long + first["tokens"][:40]
    e.add("b", again, greedy(30, ignore_eos=True))
    b = run(e)["b"]
    hit = ram_hit(e, again)
    assert hit
    e.add("c", again, greedy(30, ignore_eos=True), cached=hit)
    c = run(e)["c"]
    assert c["finish"].usage.cached_tokens >= len(hit) * 16
    assert c["tokens"] == b["tokens"]
    want = reference_tokens(model, tok, again, 30)
    assert b["tokens"][:len(want)] == want


# -- hybrid models ----------------------------------------------------------------------------

# Recurrent layers (``ArraysCache``) beside attention ones: Qwen3.5's gated delta net, lfm2's
# short convolutions. At this size (two layers, width 32) their greedy answers fall into loops
# that the drafts predict in part: drafts are kept whole, in part, and not at all.
HYBRIDS = ["qwen3_5", "lfm2"]
HYBRID_TEXTS = [TEXTS[0], "a b c d e f g a b c d e f g a b c d e f g a b c", TEXTS[2], TEXTS[3]]


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    arch = request.param
    return load(str(make_tiny_model(tmp_path_factory.mktemp(arch) / arch, arch=arch, layers=2,
                                    hidden=32)))


def restores_seen(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], int]]:
    """Each step's rows whose recurrent state went back (``runner._restore``), and the rows
    decoding then."""
    from troupe.actors.engine import runner

    seen: list[tuple[list[int], int]] = []
    restore = runner._restore

    def record(recurrent: Any, before: Any, rows: list[int], n: int) -> None:
        seen.append((list(rows), n))
        restore(recurrent, before, rows, n)

    monkeypatch.setattr(runner, "_restore", record)
    return seen


@pytest.mark.parametrize("n", [1, 4], ids=["alone", "batch4"])
def test_hybrid_greedy_answers_with_drafts_are_those_without(
        hybrid: Any, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rejected draft's tokens went through the recurrent layers too: the row's state goes
    back and it runs the kept tokens again in its next step, so the answers are one token a
    step's (and mlx-lm's), with drafts proposed, kept and rejected, in a batch by some rows
    and not others in one step."""
    model, tok = hybrid
    requests = {f"r{i}": (tok.encode(t), greedy(200, ignore_eos=True))
                for i, t in enumerate(HYBRID_TEXTS[:n] if n > 1 else HYBRID_TEXTS[1:2])}
    off, e_off = serve_all(hybrid, "off", requests)
    e = Engine(model, tok, engine_config(speculative="ngram"))
    seen = restores_seen(monkeypatch)
    for rid, (prompt, sampling) in requests.items():
        e.add(rid, prompt, sampling)
    on = run(e)
    assert len({tuple(r["tokens"]) for r in off.values()}) == n
    for rid in requests:
        assert on[rid]["tokens"] == off[rid]["tokens"]
    first = next(iter(requests.values()))[0]
    want = reference_tokens(model, tok, first, 200)
    assert off["r0"]["tokens"][: len(want)] == want and len(want) > 100
    r = e.runner
    assert r.accepted > 0 and r.drafted > r.accepted
    assert r.restored == sum(len(rows) for rows, _ in seen) > 0
    if n == 1:
        assert e.steps < e_off.steps
    else:
        assert any(len(rows) < rows_then for rows, rows_then in seen)


def test_a_hybrid_cache_after_drafts_holds_the_state_of_its_tokens(hybrid: Any) -> None:
    """Greedy and sampling rows drafting in one batch: each finished row's cache (recurrent
    state and KV) is what one pass over the tokens it holds gives, so every draw was made
    from the state of the tokens before it (the sampled rows' draws then follow
    ``RowSampler.verify``'s distribution, tested above)."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import ArraysCache, make_prompt_cache
    from mlx_lm.sample_utils import greedy_sampler

    from troupe.actors.engine.request import RowSampler
    from troupe.actors.engine.runner import Runner

    model, tok = hybrid
    runner = Runner(model, engine_config(speculative="ngram"))
    for i, t in enumerate(HYBRID_TEXTS[:3]):
        sampler = greedy_sampler if i != 1 else RowSampler(
            SamplingParams(max_tokens=150, temperature=0.7, ignore_eos=True))
        runner.insert([tok.encode(t)], max_tokens=150, cache=None, done=[], sampler=sampler,
                      processors=[], stop_ids=frozenset())
    finished = []
    while runner.waiting or runner.prefilling or runner.decoding:
        out = runner.execute(runner.whole_chunks())
        finished += [s for s in out.responses if s.finish_reason is not None]
    assert runner.accepted > 0 and runner.restored > 0 and len(finished) == 3
    for s in finished:
        fresh = make_prompt_cache(model)
        model(mx.array([s.all_tokens]), cache=fresh)
        for got, want in zip(s.prompt_cache, fresh, strict=True):
            if isinstance(want, ArraysCache):
                pairs = list(zip(got.cache, want.cache, strict=True))
            else:
                assert got.offset == want.offset == len(s.all_tokens)
                n = got.offset
                pairs = [(got.keys[..., :n, :], want.keys[..., :n, :]),
                         (got.values[..., :n, :], want.values[..., :n, :])]
            for a, b in pairs:
                np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-5)


def test_a_hybrid_row_runs_what_it_carries_in_a_batch_too_large_for_drafts(hybrid: Any) -> None:
    """A row carrying kept tokens when more rows join than drafts are verified for runs them
    in the plain step that follows, before its next input."""
    from mlx_lm.sample_utils import greedy_sampler

    from troupe.actors.engine.runner import SPECULATE_ROWS, Runner

    model, tok = hybrid
    runner = Runner(model, engine_config(speculative="ngram"))
    prompt = tok.encode(HYBRID_TEXTS[1])
    got: dict[int, list[int]] = {}

    def add(tokens: list[int], n: int) -> None:
        runner.insert([tokens], max_tokens=n, cache=None, done=[], sampler=greedy_sampler,
                      processors=[], stop_ids=frozenset())

    def step() -> None:
        for s in runner.execute(runner.whole_chunks()).responses:
            got.setdefault(s.uid, []).append(s.token)

    add(prompt, 200)
    while not (runner.decoding and runner.batch.decode.seqs[0].carried):
        step()
    joining = [[5 + i] for i in range(SPECULATE_ROWS)]
    for one in joining:  # one-token prompts join the decode rows in the next step
        add(one, 20)
    step()
    assert runner.decoding == SPECULATE_ROWS + 1 and not runner.batch.decode.seqs[0].carried
    while runner.decoding:
        step()
    want = reference_tokens(model, tok, prompt, 200)
    assert got[0][: len(want)] == want and len(want) > 100
    for uid, one in enumerate(joining, 1):
        want = reference_tokens(model, tok, one, 20)
        assert got[uid][: len(want)] == want


@pytest.mark.parametrize("mixed", [True, False], ids=["one-pass", "two-calls"])
def test_a_hybrid_prefix_hit_after_a_drafted_run_answers_the_same(
        hybrid: Any, monkeypatch: pytest.MonkeyPatch, mixed: bool) -> None:
    """Hybrid models keep recurrent state only at block ends, cut from a prompt's prefill: a
    prompt prefilled in chunks while another row drafts (drafts kept and rejected, its
    recurrent state restored) leaves blocks that answer a repeat of it as the first run
    did."""
    from engine_helpers import ram_hit

    from troupe.actors.engine import runner
    from troupe.actors.engine.prefix import usable_blocks

    model, tok = hybrid
    # Two rows decode, so one prompt waiting for its first token leaves them their drafts
    # (``schedule.drafts_allowed``).
    prompts = {"a": tok.encode(HYBRID_TEXTS[1]), "a2": tok.encode(HYBRID_TEXTS[3])}
    off, _ = serve_all(hybrid, "off",
                       {rid: (p, greedy(200, ignore_eos=True)) for rid, p in prompts.items()})
    # The rows draft their own answers (a wrong last token each time) in runs of five steps.
    monkeypatch.setattr(runner, "Drafter", foreseeing(
        prompts, {rid: off[rid]["tokens"] for rid in prompts}, wrong=True))
    e = Engine(model, tok, engine_config(speculative="ngram", block_size=16,
                                         prefill_step_size=16, mixed_step=mixed))
    long = tok.encode(TEXTS[0] + TEXTS[2] * 2)
    for rid, p in prompts.items():
        e.add(rid, p, greedy(200, ignore_eos=True))
    got: dict[str, list[int]] = {"a": [], "a2": [], "b": []}
    steps, drafted = 0, 0
    while e.has_work:
        if steps == 20:
            drafted = e.runner.drafts
            e.add("b", long, greedy(40, ignore_eos=True))
        for ev in e.step():
            if isinstance(ev, TokensGenerated):
                if ev.request_id == "b" and not got["b"]:
                    assert e.runner.drafts > drafted, "the rows drafted while b prefilled"
                got[ev.request_id] += ev.token_ids
        steps += 1
    assert got["a"] == off["a"]["tokens"] and got["a2"] == off["a2"]["tokens"]
    assert e.runner.restored > 0
    hit = ram_hit(e, long)
    assert len(hit) == usable_blocks(len(long), 16) >= 3
    e.add("c", long, greedy(40, ignore_eos=True), cached=hit)
    again = run(e)["c"]
    assert again["finish"].usage.cached_tokens == len(hit) * 16
    assert again["tokens"] == got["b"]


async def test_a_stream_with_drafts_carries_every_token_once_and_the_report_counts_them(
        aiohttp_client: Any, tmp_path: Path) -> None:
    """Through the serving stack: the streamed text is the whole answer's, each token once,
    in order (several tokens of a step arrive as deltas in order), the usage counts them,
    and the scheduler's report (and /metrics) counts the drafts."""
    import json

    from test_prefix_serving import report, serve

    model_dir = make_tiny_model(tmp_path / "q", arch="qwen3")
    body = {"prompt": TEXTS[0], "max_tokens": 90, "temperature": 0, "ignore_eos": True}
    texts = {}
    for spec in ("off", "ngram"):
        client, system, model = await serve(aiohttp_client, model_dir, tmp_path / spec,
                                            speculative=spec)
        whole = await (await client.post("/v1/completions", json={**body, "model": model})).json()
        resp = await client.post("/v1/completions",
                                 json={**body, "model": model, "stream": True,
                                       "stream_options": {"include_usage": True}})
        streamed, usage = "", None
        async for line in resp.content:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                streamed += chunk["choices"][0]["text"]
            if chunk.get("usage"):
                usage = chunk["usage"]
        assert streamed == whole["choices"][0]["text"]
        assert usage["completion_tokens"] == whole["usage"]["completion_tokens"] == 90
        texts[spec] = streamed
        sched = report(system, "scheduler")
        if spec == "ngram":
            assert sched["draft_accepted_tokens"] > 0 and sched["draft_mean_accepted"] > 0
            metrics = await (await client.get("/metrics")).text()
            assert "draft_accepted_tokens" in metrics
            # A hybrid's restores, and a draft model's passes, are counted there too.
            assert "draft_restores" in metrics and "draft_model_passes" in metrics
        else:
            assert sched["drafts"] == 0
        await system.__aexit__(None, None, None)
    assert texts["ngram"] == texts["off"]


# -- sampling rows ---------------------------------------------------------------------------

# Chi-squared critical values at alpha 0.001, by degrees of freedom.
CHI2_999 = {5: 20.52, 7: 24.32}


def chi2(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True) if p > 0)


@pytest.mark.parametrize("settings", [
    {"temperature": 1.0}, {"temperature": 0.7, "top_k": 6}, {"temperature": 1.3, "top_p": 0.9},
], ids=["t1", "t0.7-topk6", "t1.3-topp0.9"])
def test_verified_drafts_are_distributed_as_tokens_drawn_one_a_step(settings: dict) -> None:
    """Over 3,000 seeds (a fixed set), the first token a two-token draft leaves, and the second
    where the first was the draft's, follow the row's distribution at each position, whether
    the draft is likely or not."""
    import mlx.core as mx

    from troupe.actors.engine.request import RowSampler

    logits = mx.array([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -9.0],
                       [0.0, 1.0, 2.0, 0.3, -1.0, 0.8, 1.2, -9.0]])
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    probe = RowSampler(SamplingParams(max_tokens=2, **settings))
    want = mx.softmax(probe._scaled(logprobs), axis=-1).tolist()
    for draft in ([0, 2], [4, 1]):  # likely, then unlikely, first tokens
        first, second = [0] * 8, [0] * 8
        for seed in range(3000):
            got = RowSampler(SamplingParams(max_tokens=2, seed=seed, **settings)).verify(
                logprobs, draft)
            first[got[0]] += 1
            if got[0] == draft[0]:
                second[got[1]] += 1
        support = [i for i in range(8) if want[0][i] > 1e-4]
        df = len(support) - 1
        assert chi2([first[i] for i in support], [want[0][i] for i in support]) \
            < CHI2_999.get(df, 24.32), (first, want[0])
        support = [i for i in range(8) if want[1][i] > 1e-4]
        assert chi2([second[i] for i in support], [want[1][i] for i in support]) \
            < CHI2_999.get(len(support) - 1, 24.32), (second, want[1])
        assert sum(1 for i in range(8) if want[0][i] <= 1e-4 and first[i]) == 0


def test_sampling_rows_draft_and_a_seeded_one_draws_as_it_would_alone(tiny: Any) -> None:
    """Rows that sample take drafts (verified as ``RowSampler.verify`` does); a seeded one
    takes none, so its answer is its seed's whatever the batch (drafts are verified only in
    small batches)."""
    _, tok = tiny
    sampled = SamplingParams(max_tokens=80, temperature=0.3, ignore_eos=True)
    got, e = serve_all(tiny, "ngram", {f"r{i}": (tok.encode(t), sampled)
                                       for i, t in enumerate(TEXTS[:2])})
    assert e.runner.accepted > 0 and all(len(r["tokens"]) == 80 for r in got.values())
    seeded = SamplingParams(max_tokens=60, temperature=0.8, seed=5, ignore_eos=True)
    alone, e = serve_all(tiny, "ngram", {"s": (tok.encode(TEXTS[0]), seeded)})
    assert e.runner.drafted == 0
    crowd, _ = serve_all(tiny, "ngram", {"s": (tok.encode(TEXTS[0]), seeded),
                                         **{f"g{i}": (tok.encode(t), greedy(60))
                                            for i, t in enumerate(TEXTS * 2)}})
    assert crowd["s"]["tokens"] == alone["s"]["tokens"]


def test_a_request_may_turn_its_drafts_off(tiny: Any) -> None:
    _, tok = tiny
    prompt = tok.encode(TEXTS[0])
    off = SamplingParams(max_tokens=90, temperature=0.0, ignore_eos=True, speculative=False)
    got, e = serve_all(tiny, "ngram", {"off": (prompt, off)})
    assert e.runner.drafted == 0
    both, e = serve_all(tiny, "ngram", {"off": (prompt, off),
                                        "on": (prompt, greedy(90, ignore_eos=True))})
    assert e.runner.drafts > 0 and both["off"]["tokens"] == both["on"]["tokens"]
    assert both["off"]["tokens"] == got["off"]["tokens"]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"input": "hi"}),
], ids=["chat", "completions", "anthropic", "responses"])
async def test_every_route_takes_the_speculative_extension_field(
        client: Any, scripted: Any, path: str, body: dict[str, Any]) -> None:
    for sent, want in ((None, True), (False, False), (True, True)):
        extra = {} if sent is None else {"speculative": sent}
        resp = await client.post(path, json={"model": http_stack.MODEL, **body, **extra})
        assert resp.status == 200, await resp.text()
        msg = scripted.seen[-1]
        assert isinstance(msg, AdmitChat | AdmitCompletion)
        assert msg.sampling.speculative is want
