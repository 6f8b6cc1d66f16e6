"""Speculative decoding with a draft model (``--draft-model``, actors/engine/draft_model.py):
greedy answers are the tokens decoding without drafts gives, whichever model drafts and
whatever the batch does (a prefix hit, an abort, a long prompt the draft catches up with);
the draft model's cache follows each row; a draft model that cannot draft for the served one
is refused at start, by name.

Tiny random-weight models (tests/tiny_model.py) share one tokenizer, so any two are a pair.
The served model as its own draft proposes what the step then keeps (the accepting path); a
different random model proposes what it mostly rejects (the rejecting path).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_helpers import engine_config, greedy, ram_hit, run, run_aborting
from mlx_lm import load
from reference import reference_tokens
from tiny_model import make_tiny_model, write_tokenizer

from troupe.actors.config import ServeConfig
from troupe.actors.engine.config import speculation
from troupe.actors.engine.core import Engine
from troupe.actors.engine.draft_model import (
    DraftModel,
    DraftModelError,
    check_draft_model,
    vocabulary,
)
from troupe.actors.engine.speculate import MAX_DRAFT
from troupe.actors.messages import SamplingParams, TokensGenerated

TEXTS = ["The quick brown fox jumps over the lazy dog. " * 5, "Numbers like 12345 and 12345 and",
         "def add(a, b): return a + b\n" * 3, "Paris"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft")
    return {"main": make_tiny_model(root / "main", arch="qwen3", layers=2),
            "other": make_tiny_model(root / "other", arch="llama", layers=1, seed=5)}


@pytest.fixture(scope="module")
def main(dirs: dict[str, Path]) -> Any:
    return load(str(dirs["main"]))


def draft_of(model_dir: Path, tok: Any, catch_up: int = 512) -> DraftModel:
    model, _ = load(str(model_dir))
    return DraftModel(model, vocab=len(vocabulary(tok)), catch_up=catch_up)


def serve_all(main: Any, requests: dict[str, tuple[list[int], SamplingParams]],
              draft: DraftModel | None = None, **settings: Any) -> tuple[dict[str, dict], Engine]:
    model, tok = main
    config = (engine_config(draft_model="draft", **settings) if draft is not None
              else engine_config(speculative="off", **settings))
    e = Engine(model, tok, config, draft=draft)
    for rid, (prompt, sampling) in requests.items():
        e.add(rid, prompt, sampling)
    return run(e), e


def batch_of_four(tok: Any, n: int = 60) -> dict[str, tuple[list[int], SamplingParams]]:
    return {f"r{i}": (tok.encode(t), greedy(n + 7 * i, ignore_eos=True))
            for i, t in enumerate(TEXTS)}


def test_two_prompts_give_two_answers(main: Any) -> None:
    """Else the equalities below prove little."""
    model, tok = main
    a, b = (reference_tokens(model, tok, tok.encode(t), 12) for t in TEXTS[:2])
    assert a != b


@pytest.mark.parametrize("drafter", ["main", "other"])
def test_greedy_answers_with_a_draft_model_are_those_without_in_a_batch(
        main: Any, dirs: dict[str, Path], drafter: str) -> None:
    """The served model drafting for itself: its drafts are kept (nearly) whole and the
    answers take fewer steps; another model drafting: most of its drafts are rejected. Both:
    the same tokens as decoding one a step, and as mlx-lm's own generation."""
    model, tok = main
    requests = batch_of_four(tok)
    off, e_off = serve_all(main, requests)
    draft = draft_of(dirs[drafter], tok)
    on, e_on = serve_all(main, requests, draft)
    for rid in requests:
        assert on[rid]["tokens"] == off[rid]["tokens"]
        assert on[rid]["finish"].usage.completion_tokens == len(off[rid]["tokens"])
    assert off["r0"]["tokens"] == reference_tokens(model, tok, requests["r0"][0], 60)
    runner = e_on.runner
    assert runner.drafts > 0 and draft.passes > 0
    if drafter == "main":
        assert runner.accepted >= 0.9 * runner.drafted
        assert e_on.steps < e_off.steps / 2
    else:
        assert runner.accepted < 0.5 * runner.drafted


def test_a_draft_model_drafts_for_a_sampling_row(main: Any, dirs: dict[str, Path]) -> None:
    """A sampling row's drafts are verified by its sampler (speculative sampling, as for
    lookup drafts): with the served model as its own draft most are kept."""
    _, tok = main
    sampling = SamplingParams(max_tokens=48, temperature=0.7, ignore_eos=True)
    got, e = serve_all(main, {"s": (tok.encode(TEXTS[1]), sampling)}, draft_of(dirs["main"], tok))
    assert len(got["s"]["tokens"]) == 48
    assert e.runner.drafts > 0 and e.runner.accepted > e.runner.drafted / 2


def test_the_draft_cache_follows_its_row_through_rejections(main: Any,
                                                            dirs: dict[str, Path]) -> None:
    """After drafts the row rejected, the draft model's cache holds exactly the row's tokens
    it shares (trimmed back, then run on), and it drafts what a drafter made fresh on the
    row's tokens drafts."""
    _, tok = main
    draft = draft_of(dirs["other"], tok)
    context = tok.encode(TEXTS[0])
    d = draft.drafter()
    d.sync(context[:20])
    first = d.draft(context[20], MAX_DRAFT)
    assert len(first) == MAX_DRAFT and d.fed == context[:21] + first[:-1]
    # The row kept one drafted token, then answered something else.
    row = [*context[:21], first[0], (first[1] + 1) % 300]
    d.verified(len(first), 1)
    d.sync(row)
    again = d.draft(7, MAX_DRAFT)
    draft.forget()  # a fresh drafter runs the row's tokens itself, from no other's cache
    fresh = draft.drafter()
    fresh.sync(row)
    assert again == fresh.draft(7, MAX_DRAFT)[:len(again)] and again
    assert d.cache[0].offset == len(d.fed) == len(row) + len(again)
    assert d.fed[:len(row) + 1] == [*row, 7]


def test_a_long_prompt_is_caught_up_over_steps(main: Any, dirs: dict[str, Path]) -> None:
    """The draft cache takes at most ``catch_up`` of a row's tokens a step: a prompt of
    several times that drafts nothing until it is caught up, then drafts; the answers are
    unchanged."""
    _, tok = main
    draft = draft_of(dirs["main"], tok, catch_up=16)
    prompt = tok.encode(TEXTS[0] + TEXTS[2])
    d = draft.drafter()
    d.sync(prompt[:-1])
    empty = 0
    while not (got := d.draft(prompt[-1], 3)):
        empty += 1
        assert d.cache[0].offset == len(d.fed) == 16 * empty
    assert empty == (len(prompt) - 1) // 16 and len(got) == 3
    off, _ = serve_all(main, {"a": (prompt, greedy(50, ignore_eos=True))})
    on, e = serve_all(main, {"a": (prompt, greedy(50, ignore_eos=True))},
                      draft_of(dirs["main"], tok, catch_up=16))
    assert on["a"]["tokens"] == off["a"]["tokens"] and e.runner.accepted > 0


def test_the_draft_model_keeps_pace_with_a_prefill(main: Any, dirs: dict[str, Path]) -> None:
    """A prompt prefilled in chunks runs through the draft model chunk by chunk too: the row
    drafts from its first decode step (not after catching up then), with the same answer."""
    model, tok = main
    prompt = tok.encode(TEXTS[0] + TEXTS[2])
    assert len(prompt) > 4 * 16
    off, _ = serve_all(main, {"a": (prompt, greedy(20, ignore_eos=True))},
                       prefill_step_size=16)
    draft = draft_of(dirs["main"], tok, catch_up=16)
    e = Engine(model, tok, engine_config(draft_model="draft", prefill_step_size=16),
               draft=draft)
    e.add("a", prompt, greedy(20, ignore_eos=True))
    got: list[int] = []
    while not got:
        got += [t for ev in e.step() if isinstance(ev, TokensGenerated) for t in ev.token_ids]
    assert draft.passes >= len(prompt) // 16 and e.runner.drafts == 0
    got += [t for ev in e.step() if isinstance(ev, TokensGenerated) for t in ev.token_ids]
    assert e.runner.drafts == 1 and len(got) > 2
    got += run(e)["a"]["tokens"]
    assert got == off["a"]["tokens"]


def test_a_next_turn_starts_from_the_last_turns_draft_cache(main: Any,
                                                             dirs: dict[str, Path]) -> None:
    """A conversation's next turn (its prompt: the last one, its answer and more) starts
    from a copy of the last turn's draft cache: the draft model runs only what is new, and
    the answers are those without drafts. A row beside it that shares nothing starts empty."""
    _, tok = main
    first = tok.encode(TEXTS[0])
    off1, _ = serve_all(main, {"a": (first, greedy(30, ignore_eos=True))})
    second = first + off1["a"]["tokens"] + tok.encode(TEXTS[2])
    other = tok.encode(TEXTS[1])
    off2, _ = serve_all(main, {"b": (second, greedy(30, ignore_eos=True)),
                               "c": (other, greedy(30, ignore_eos=True))})
    draft = draft_of(dirs["main"], tok)
    model, _ = main
    e = Engine(model, tok, engine_config(draft_model="draft"), draft=draft)
    e.add("a", first, greedy(30, ignore_eos=True))
    assert run(e)["a"]["tokens"] == off1["a"]["tokens"]
    assert draft.reused == 0
    e.add("b", second, greedy(30, ignore_eos=True))
    e.add("c", other, greedy(30, ignore_eos=True))
    got = run(e)
    assert got["b"]["tokens"] == off2["b"]["tokens"]
    assert got["c"]["tokens"] == off2["c"]["tokens"]
    # What the first turn's row had run: its prompt and its answer but the last token.
    assert draft.reused >= len(first) + 25
    assert draft.reused < len(first) + 30 + 5
    # An idle engine lets the finished rows' caches go: a third turn starts afresh.
    e.release_idle()
    before = draft.reused
    e.add("d", second, greedy(5, ignore_eos=True))
    run(e)
    assert draft.reused == before


def test_a_prefix_hit_and_an_abort_beside_draft_model_rows(main: Any,
                                                           dirs: dict[str, Path]) -> None:
    """A prompt served from the prefix cache (the draft model runs it whole: its cache is its
    own) and a row aborted between drafting steps leave every other answer as without
    drafts."""
    model, tok = main
    requests = batch_of_four(tok, 50)
    off, _ = serve_all(main, requests)
    e = Engine(model, tok, engine_config(draft_model="draft", block_size=16),
               draft=draft_of(dirs["other"], tok))
    for rid, (prompt, sampling) in requests.items():
        e.add(rid, prompt, sampling)
    got = run_aborting(e, "r1", 20)
    for rid in ("r0", "r2", "r3"):
        assert got[rid] == off[rid]["tokens"]
    assert got["r1"] == off["r1"]["tokens"][:len(got["r1"])]
    prompt, sampling = requests["r0"]
    e.add("again", prompt, sampling, cached=ram_hit(e, prompt))
    again = run(e)["again"]
    assert again["finish"].usage.cached_tokens > 0
    assert again["tokens"] == off["r0"]["tokens"]


@pytest.mark.parametrize("settings", [{"temperature": 1.0},
                                      {"temperature": 0.7, "top_k": 6}],
                         ids=["t1", "t0.7-topk6"])
def test_drafts_drawn_from_a_draft_model_leave_tokens_distributed_as_one_a_step(
        settings: dict) -> None:
    """Over 3,000 seeds (a fixed set): a two-token draft drawn from a draft distribution q
    unlike the row's p (``RowSampler.draw``), verified against p with q (min(1, p/q), the
    residual max(0, p - q) on refusal), leaves a first token distributed as p at the first
    position and, where the first was kept, a second distributed as p at the second. (Any
    rule that keeps a token x with p(x) and else draws from p without x is distributed so;
    what q adds is how often a draft is kept: sum over x of min(p(x), q(x)), all of it when
    q is p.)"""
    import mlx.core as mx
    from test_speculative import CHI2_999, chi2

    from troupe.actors.engine.request import RowSampler

    def normed(rows: list[list[float]]) -> mx.array:
        x = mx.array(rows)
        return x - mx.logsumexp(x, axis=-1, keepdims=True)

    target = normed([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -9.0],
                     [0.0, 1.0, 2.0, 0.3, -1.0, 0.8, 1.2, -9.0]])
    drafts = normed([[0.0, 0.5, 2.5, 0.0, 1.0, -0.5, 0.0, -9.0],
                     [1.5, 0.0, 0.0, 0.3, 2.0, 0.0, 0.0, -9.0]])
    probe = RowSampler(SamplingParams(max_tokens=2, **settings))
    want = mx.softmax(probe._scaled(target), axis=-1).tolist()
    q0 = mx.softmax(probe._scaled(drafts), axis=-1).tolist()[0]
    first, second = [0] * 8, [0] * 8
    refused = 0
    for seed in range(3000):
        row = RowSampler(SamplingParams(max_tokens=2, seed=seed, **settings))
        drawn = [row.draw(drafts[j]) for j in range(2)]
        got = row.verify(target, [t for t, _ in drawn], mx.stack([q for _, q in drawn]))
        first[got[0]] += 1
        refused += got[0] != drawn[0][0]
        if len(got) > 2 or got[0] == drawn[0][0]:
            second[got[1]] += 1
    assert refused > 300  # q is far from p: the residual path is taken often
    kept = sum(min(a, b) for a, b in zip(want[0], q0, strict=True))
    assert abs((3000 - refused) / 3000 - kept) < 0.04
    # A draft model that is the row's own distribution: every draft token is kept.
    for seed in range(200):
        row = RowSampler(SamplingParams(max_tokens=2, seed=seed, **settings))
        drawn = [row.draw(target[j]) for j in range(2)]
        got = row.verify(target, [t for t, _ in drawn], mx.stack([q for _, q in drawn]))
        assert got[:2] == [t for t, _ in drawn]
    for counts, probs in ((first, want[0]), (second, want[1])):
        support = [i for i in range(8) if probs[i] > 1e-4]
        assert chi2([counts[i] for i in support], [probs[i] for i in support]) \
            < CHI2_999.get(len(support) - 1, 24.32), (counts, probs)
        assert sum(1 for i in range(8) if probs[i] <= 1e-4 and counts[i]) == 0


# -- what is refused ---------------------------------------------------------------------------


def test_a_draft_model_of_another_vocabulary_is_refused_by_name(main: Any,
                                                                tmp_path: Path) -> None:
    _, tok = main
    other = make_tiny_model(tmp_path / "v", arch="llama", layers=1)
    write_tokenizer(other, vocab_size=300)  # the same model, another tokenizer
    model, other_tok = load(str(other))
    with pytest.raises(DraftModelError, match=r"draft model v does not share main's vocabulary"):
        check_draft_model("v", model, other_tok, "main", tok)


def test_a_draft_model_that_cannot_take_back_positions_is_refused(main: Any,
                                                                  tmp_path: Path) -> None:
    _, tok = main
    model, draft_tok = load(str(make_tiny_model(tmp_path / "h", arch="lfm2", layers=2)))
    with pytest.raises(DraftModelError, match="plain attention layers"):
        check_draft_model("h", model, draft_tok, "main", tok)


def test_the_speculative_setting_and_the_draft_model_agree() -> None:
    base = engine_config()
    assert speculation(base) == "ngram"
    assert speculation(engine_config(draft_model="d")) == "draft"
    assert speculation(engine_config(speculative="off", draft_model="d")) == "off"
    with pytest.raises(ValueError, match="needs a draft model"):
        speculation(engine_config(speculative="draft"))
    with pytest.raises(ValueError, match="give one or the other"):
        speculation(engine_config(speculative="ngram", draft_model="d"))


def test_troupe_serve_refuses_contradicting_flags_before_loading(tmp_path: Path) -> None:
    import subprocess
    import sys

    for flags, said in ((["--speculative", "draft"], "needs a draft model"),
                        (["--draft-model", "x", "--distributed", "tensor"],
                         "not served with --distributed")):
        out = subprocess.run([sys.executable, "-m", "troupe.api.cli", "serve", "--model",
                              str(tmp_path / "none"), *flags], capture_output=True, text=True,
                             timeout=60, env={"TROUPE_HOME": str(tmp_path), "PATH": ""})
        assert out.returncode == 1 and said in out.stderr


# -- serving -----------------------------------------------------------------------------------


async def test_a_server_with_a_draft_model_answers_and_counts_its_drafts(
        aiohttp_client: Any, dirs: dict[str, Path], tmp_path: Path) -> None:
    """Through the serving stack: the same answer as a server without a draft model; the
    scheduler's report counts the draft model's passes; the memory guard's shape of the model
    holds the draft's weights and cache."""
    from test_prefix_serving import report, serve

    body = {"prompt": TEXTS[0], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    texts, weights = {}, {}
    for name, extra in (("off", {"speculative": "off"}), ("draft",
                                                           {"draft_model": str(dirs["main"])})):
        client, system, model = await serve(aiohttp_client, dirs["main"], tmp_path / name,
                                            **extra)
        resp = await client.post("/v1/completions", json={**body, "model": model})
        assert resp.status == 200
        texts[name] = (await resp.json())["choices"][0]["text"]
        sched = report(system, "scheduler")
        pool = report(system, "engine_pool")
        if name == "draft":
            assert sched["draft_model_passes"] > 0 and sched["draft_accepted_tokens"] > 0
        weights[name] = pool["loaded_weights_bytes"]
        await system.__aexit__(None, None, None)
    assert texts["draft"] == texts["off"]
    assert weights["draft"] == 2 * weights["off"]


async def test_a_server_refuses_a_draft_model_of_another_vocabulary_at_start(
        dirs: dict[str, Path], tmp_path: Path) -> None:
    from troupe.actors.serving import start_serving
    from troupe.runtime import ActorSystem

    other = make_tiny_model(tmp_path / "v", arch="llama", layers=1)
    write_tokenizer(other, vocab_size=300)
    config = ServeConfig.of(model=str(dirs["main"]), draft_model=str(other))
    async with ActorSystem() as system:
        with pytest.raises(Exception, match="does not share"):
            await start_serving(system, config)



async def test_an_embedding_model_beside_a_draft_model_serves(
        aiohttp_client: Any, dirs: dict[str, Path], tmp_path: Path) -> None:
    """The draft model drafts for chat models only: an embedding model served beside it
    loads and embeds, and the chat model drafts."""
    from embed_models import make_embedding_model
    from http_stack import real_client
    from test_prefix_serving import report

    embedder = make_embedding_model(tmp_path / "tiny-qwen3-embedding", context=256)
    config = ServeConfig.of(model=[str(dirs["main"]), str(embedder)],
                            draft_model=str(dirs["main"]), cache_dir=str(tmp_path / "c"))
    client, system, handles = await real_client(aiohttp_client, config)
    chat, embed = (card.id for card in handles.models)
    resp = await client.post("/v1/embeddings", json={"model": embed, "input": TEXTS[:2]})
    assert resp.status == 200 and len((await resp.json())["data"]) == 2
    resp = await client.post("/v1/completions", json={
        "model": chat, "prompt": TEXTS[0], "max_tokens": 20, "temperature": 0,
        "ignore_eos": True})
    assert resp.status == 200
    assert report(system, "scheduler")["draft_model_passes"] > 0
