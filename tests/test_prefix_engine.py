"""Prefix cache on the MLX side: blocks cut from the batch, rebuilt into caches, reused.

A request served from cached blocks must give exactly the same greedy tokens as without them.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from engine_helpers import engine_config, ram_hit
from mlx_lm import load
from tiny_model import make_tiny_model

from troupe.actors.engine.core import Engine
from troupe.actors.engine.kv_blocks import common_prefix, from_numpy, to_numpy
from troupe.actors.engine.prefix import block_hashes, model_fingerprint, usable_blocks
from troupe.actors.messages import RequestFinished, SamplingParams, TokensGenerated

BLOCK = 16
LONG = ("The quick brown fox jumps over the lazy dog. " * 6
        + "What is the capital of France? The capital of France is Paris. " * 2)


def greedy(n: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def run(engine: Engine, rid: str, prompt: list[int], cached=()) -> tuple[list[int], int]:
    engine.add(rid, prompt, greedy(), cached=cached)
    tokens, cached_tokens = [], None
    while engine.has_work:
        for ev in engine.step():
            if isinstance(ev, TokensGenerated):
                tokens += ev.token_ids
            elif isinstance(ev, RequestFinished):
                cached_tokens = ev.usage.cached_tokens
    return tokens, cached_tokens


def make_engine(model_dir: Path, **settings) -> Engine:
    model, tok = load(str(model_dir))
    return Engine(model, tok, engine_config(block_size=BLOCK, prefill_step_size=24, **settings),
                  fingerprint=model_fingerprint(model_dir))


@pytest.mark.parametrize("arch_fixture", ["tiny_model_dir", "tiny_hybrid_dir"])
def test_repeated_prompt_reuses_its_prefix_with_identical_output(arch_fixture, request):
    model_dir = request.getfixturevalue(arch_fixture)
    engine = make_engine(model_dir)
    prompt = engine.tokenizer.encode(LONG)
    n_usable = usable_blocks(len(prompt), BLOCK)
    assert n_usable >= 3, "the prompt must cross several block boundaries"

    cold, cold_cached = run(engine, "a", prompt)
    assert cold_cached == 0
    assert len(engine.prompt_hashes(prompt)) == n_usable
    hit = ram_hit(engine, prompt)
    assert len(hit) == n_usable, "every boundary crossed during prefill was captured"

    warm, warm_cached = run(engine, "b", prompt, cached=hit)
    if engine.hybrid:
        # Recurrent state exists only at block ends: whole blocks only.
        assert warm_cached == n_usable * BLOCK
    else:
        # The whole blocks, then the first request's tail up to the last prompt token (which
        # must run through the model for the first output's logits).
        assert warm_cached == len(prompt) - 1
    assert warm == cold


@pytest.mark.parametrize("arch_fixture", ["tiny_model_dir", "tiny_hybrid_dir"])
def test_a_request_that_ends_with_its_first_token_keeps_its_prompt_blocks(
        arch_fixture, request, caplog):
    """max_tokens=1: the request finishes in the step that answers its first token (with
    mixed steps, the step its prompt ends in). Its blocks are cut as it finishes, quietly,
    and a repeat of the prompt is served from them with the same token."""
    model_dir = request.getfixturevalue(arch_fixture)
    engine = make_engine(model_dir)
    prompt = engine.tokenizer.encode(LONG)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    answers, cached = [], {}
    for rid in ("a", "b"):
        engine.add(rid, prompt, one, cached=ram_hit(engine, prompt))
        while engine.has_work:
            for ev in engine.step():
                if isinstance(ev, TokensGenerated):
                    answers.append((rid, ev.token_ids))
                elif isinstance(ev, RequestFinished):
                    assert ev.finish_reason == "length", ev
                    cached[rid] = ev.usage.cached_tokens
    assert [rid for rid, _ in answers] == ["a", "b"]
    assert answers[0][1] == answers[1][1]
    assert cached["a"] == 0 and cached["b"] > 0
    assert len(ram_hit(engine, prompt)) == usable_blocks(len(prompt), BLOCK)
    assert "could not cut" not in caplog.text


@pytest.mark.parametrize("arch_fixture", ["tiny_model_dir", "tiny_hybrid_dir"])
def test_blocks_are_cut_after_the_step_answers_and_survive_an_abort(arch_fixture, request,
                                                                     caplog):
    """A step answers its tokens before it slices the prompts it completed into blocks;
    the blocks are cut when the caller takes them, or before anything changes the batch:
    a client that leaves right after its first token still leaves its prompt cached, and a
    repeat is served from it with the same first token."""
    model_dir = request.getfixturevalue(arch_fixture)
    engine = make_engine(model_dir)
    prompt = engine.tokenizer.encode(LONG)
    n_usable = usable_blocks(len(prompt), BLOCK)

    engine.add("a", prompt, greedy(8))
    first = []
    while not first:
        first = [ev.token_ids for ev in engine.step() if isinstance(ev, TokensGenerated)]
    assert engine.abort("a") is not None and not engine.has_work
    hit = ram_hit(engine, prompt)
    assert len(hit) == n_usable, "the abort cut the blocks the last step completed"
    taken = [blk.block_hash for _, blk in engine.take_new_blocks()]
    assert taken[:n_usable] == engine.prompt_hashes(prompt)

    engine.add("b", prompt, greedy(8), cached=hit)
    again = []
    while not again:
        again = [ev.token_ids for ev in engine.step() if isinstance(ev, TokensGenerated)]
    assert again[0][:1] == first[0][:1]
    assert "could not cut" not in caplog.text


def test_blocks_round_trip_through_numpy_give_identical_output(tiny_hybrid_dir):
    engine = make_engine(tiny_hybrid_dir)
    prompt = engine.tokenizer.encode(LONG)
    cold, _ = run(engine, "a", prompt)
    kinds, sizes = engine.kinds, engine.state_sizes
    restored = [from_numpy(to_numpy(b, engine.layout), kinds, sizes, engine.layout)
                for b in ram_hit(engine, prompt)]
    warm, warm_cached = run(engine, "b", prompt, cached=restored)
    assert warm_cached > 0 and warm == cold


def test_bfloat16_blocks_round_trip_bit_for_bit(tmp_path):
    model_dir = make_tiny_model(tmp_path / "bf16", dtype="bfloat16")
    engine = make_engine(model_dir)
    prompt = engine.tokenizer.encode(LONG)
    run(engine, "a", prompt)
    block = ram_hit(engine, prompt)[0]
    data = to_numpy(block, engine.layout)
    assert set(data.dtypes.values()) == {"bfloat16"}
    assert all(t.dtype == np.uint16 for t in data.tensors.values())
    back = from_numpy(data, engine.kinds, engine.state_sizes, engine.layout)
    for (k0, v0), (k1, v1) in zip(block.layers, back.layers, strict=True):
        assert k1.dtype == mx.bfloat16
        assert mx.array_equal(k0.view(mx.uint16), k1.view(mx.uint16)).item()
        assert mx.array_equal(v0.view(mx.uint16), v1.view(mx.uint16)).item()


def test_answer_blocks_serve_the_next_turn_of_a_conversation(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    tok = engine.tokenizer
    prompt = tok.encode(LONG)
    engine.add("t1", prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    answer: list[int] = []
    while engine.has_work:
        for ev in engine.step():
            if isinstance(ev, TokensGenerated):
                answer += ev.token_ids
    # The next turn resends prompt + answer (+ more): blocks beyond the first prompt hit too.
    turn2 = prompt + answer + tok.encode(" And Berlin?")
    hit = ram_hit(engine, turn2)
    assert len(hit) * BLOCK > len(prompt)
    expected_hashes = block_hashes(engine.fingerprint, turn2, BLOCK)[: len(hit)]
    assert [b.block_hash for b in hit] == expected_hashes

    reference = make_engine(tiny_model_dir)
    cold, _ = run(reference, "cold", turn2)
    warm, cached_tokens = run(engine, "t2", turn2, cached=hit)
    # Whole blocks, then the first turn's tail: everything its cache held, which is all but
    # the answer's last token (sampled, answered and never run through the model).
    assert cached_tokens == len(prompt) + len(answer) - 1
    assert warm == cold


def test_other_model_never_shares_block_names(tiny_model_dir, tmp_path):
    other = make_tiny_model(tmp_path / "other", seed=7, hidden=32)
    tokens = list(range(64))
    assert block_hashes(model_fingerprint(tiny_model_dir), tokens, BLOCK) != block_hashes(
        model_fingerprint(other), tokens, BLOCK)


def test_hybrid_blocks_hold_the_recurrent_state_at_their_own_boundary(tiny_hybrid_dir):
    from mlx_lm.models.cache import make_prompt_cache

    engine = make_engine(tiny_hybrid_dir)
    prompt = engine.tokenizer.encode(LONG)
    run(engine, "a", prompt)
    blocks = ram_hit(engine, prompt)
    assert len(blocks) >= 3
    for k, block in enumerate(blocks):
        # The state a fresh cache reaches after exactly this block's end.
        cache = make_prompt_cache(engine.model)
        engine.model(mx.array([prompt[: (k + 1) * BLOCK]]), cache=cache)
        for layer, c, kind in zip(block.layers, cache, engine.kinds, strict=True):
            if kind == "kv":
                continue
            for got, want in zip(layer, c.cache, strict=True):
                assert mx.allclose(got, want, atol=1e-4).item(), f"block {k}"


# -- partial hits: token-granular reuse after the whole blocks ---------------------------------


def test_a_shared_beginning_shorter_than_a_block_is_reused(tiny_model_dir):
    """Two prompts sharing a chat template's worth of tokens (less than a block) and then
    differing: the second takes the shared tokens from the first's first block."""
    engine = make_engine(tiny_model_dir)
    tok = engine.tokenizer
    first = tok.encode("Sys: terse. Tell me about foxes and dogs and the long grass.")
    second = tok.encode("Sys: terse. Where do rivers go when they reach the sea?")
    shared = first[: common_prefix(first, second)]
    assert 0 < len(shared) < BLOCK
    run(engine, "a", first)
    warm, cached = run(engine, "b", second)
    cold, _ = run(make_engine(tiny_model_dir), "cold", second)
    assert cached == len(shared)
    assert warm == cold
    assert engine.partial_hit_tokens == len(shared)


def test_a_namespace_reads_no_block_partial_hit_tail_or_hot_cache_of_another(tiny_model_dir):
    """Cache namespaces (an API key's, a ``cache_salt``'s): a prompt finds nothing another
    namespace left (whole blocks, a partial hit at its start, a tail, a hot cache), not even
    a chat template's shared beginning; its own namespace still finds all of it."""
    engine = make_engine(tiny_model_dir)
    tok = engine.tokenizer
    prompt = tok.encode(LONG)
    template = tok.encode("Sys: terse. Where do rivers go when they reach the sea?")
    assert 0 < common_prefix(tok.encode("Sys: terse. Tell me about foxes."), template) < BLOCK

    def run_in(rid: str, namespace: str, tokens: list[int]) -> tuple[list[int], int]:
        hit = engine.blocks.lookup(engine.prompt_hashes(tokens, namespace))
        engine.add(rid, tokens, greedy(), cached=hit, namespace=namespace)
        out, cached_tokens = [], None
        while engine.has_work:
            for ev in engine.step():
                if isinstance(ev, TokensGenerated):
                    out += ev.token_ids
                elif isinstance(ev, RequestFinished):
                    cached_tokens = ev.usage.cached_tokens
        return out, cached_tokens

    assert not set(engine.prompt_hashes(prompt, "a")) & set(engine.prompt_hashes(prompt, "b"))
    cold, cold_cached = run_in("a1", "a", prompt)
    other, other_cached = run_in("b1", "b", prompt)
    assert (cold_cached, other_cached) == (0, 0)
    assert other == cold
    roots = [engine.chain_root("a"), engine.chain_root("b")]
    # b's hot cache holds the same tokens as a's, and did not replace it.
    assert [e.root for e in engine.blocks.hot.entries()] == roots
    again, again_cached = run_in("a2", "a", prompt)
    assert again_cached == len(prompt) - 1 and again == cold
    # a's own hot cache served it (b's, newer, is still there); then a's new one was kept.
    assert [e.root for e in engine.blocks.hot.entries()] == roots[::-1]
    assert engine.blocks.hot.hits == 1

    run_in("a3", "a", tok.encode("Sys: terse. Tell me about foxes."))
    assert run_in("b2", "b", template)[1] == 0  # a's template start is not b's
    assert run_in("a4", "a", template)[1] == common_prefix(
        tok.encode("Sys: terse. Tell me about foxes."), template)


def test_a_new_ending_reuses_every_shared_token(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    tok = engine.tokenizer
    text = tok.encode(LONG)
    a = text + tok.encode(" Summarise this in one word.")
    b = text + tok.encode(" Translate the last sentence into French.")
    common = common_prefix(a, b)
    assert common % BLOCK, "the prompts must part inside a block"
    run(engine, "a", a)
    warm, cached = run(engine, "b", b, cached=ram_hit(engine, b))
    cold, _ = run(make_engine(tiny_model_dir), "cold", b)
    assert cached == common
    assert warm == cold


def test_partial_hits_of_different_lengths_batch_together(tiny_model_dir):
    """Several requests in flight at once, each with a prefix of another length (whole blocks
    plus part of one, part of one only, none): each gives its cold greedy tokens."""
    engine = make_engine(tiny_model_dir)
    tok = engine.tokenizer
    text = tok.encode(LONG)
    run(engine, "seed", text)
    prompts = {
        "repeat": text,
        "ending": text[:50] + tok.encode(" and then the dog slept."),
        "short": text[:5] + tok.encode(" rivers and seas"),
        "fresh": tok.encode("Entirely different words here, nothing shared at all."),
    }
    reference = make_engine(tiny_model_dir)
    want = {rid: run(reference, rid, p)[0] for rid, p in prompts.items()}
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    cached: dict[str, int] = {}
    for rid, p in prompts.items():
        engine.add(rid, p, greedy(), cached=ram_hit(engine, p))
    while engine.has_work:
        for ev in engine.step():
            if isinstance(ev, TokensGenerated):
                got[ev.request_id] += ev.token_ids
            elif isinstance(ev, RequestFinished):
                cached[ev.request_id] = ev.usage.cached_tokens
    assert cached == {"repeat": len(text) - 1, "ending": 50, "short": 5, "fresh": 0}
    assert got == want


def test_hybrid_models_take_whole_blocks_only(tiny_hybrid_dir):
    engine = make_engine(tiny_hybrid_dir)
    tok = engine.tokenizer
    text = tok.encode(LONG)
    run(engine, "a", text)
    b = text[: BLOCK + 5] + tok.encode(" something else entirely")
    _, cached = run(engine, "b", b, cached=ram_hit(engine, b))
    assert cached == BLOCK
    assert engine.partial_hit_tokens == 0
    assert not any(blk.tail for blk in engine.blocks.values())


def test_tails_are_ram_only_and_named_by_what_precedes_them(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    prompt = engine.tokenizer.encode(LONG)
    run(engine, "a", prompt)
    new = engine.take_new_blocks()
    tails = [blk for _, blk in new if blk.tail]
    assert len(tails) == 1
    (tail,) = tails
    whole = [blk for _, blk in new if not blk.tail]
    total = len(prompt) + 11  # prompt and answer, but its last token (never run through the model)
    assert tail.n_tokens == total % BLOCK
    assert tail.parent_hash == whole[-1].block_hash
    assert len(whole) == total // BLOCK
    assert tail.layers[0][0].shape[2] == tail.n_tokens


def test_the_ram_budget_keeps_a_prompts_beginning_and_every_new_block_still_goes_to_disk(
        tiny_model_dir):
    """Blocks are evicted from RAM as they are stored, leaves first, so the RAM tier stays
    within ``cache_ram_max``; the blocks evicted at once are still handed out for the disk."""
    probe = make_engine(tiny_model_dir)
    prompt = probe.tokenizer.encode(LONG)
    run(probe, "a", prompt)
    per_block = ram_hit(probe, prompt)[0].nbytes
    engine = make_engine(tiny_model_dir, cache_ram_max=3 * per_block)
    run(engine, "a", prompt)
    assert engine.blocks.nbytes <= 3 * per_block
    assert engine.blocks.evicted > 0
    assert len(ram_hit(engine, prompt)) == 3  # the first blocks stayed
    new = [blk for _, blk in engine.take_new_blocks()]
    assert [b.block_hash for b in new if not b.tail][: usable_blocks(len(prompt), BLOCK)] == \
        engine.prompt_hashes(prompt)
