"""Hot caches: finished sequences' caches kept whole, taken by a hit instead of a copy of its
blocks (actors/engine/hot_cache.py).

The tiny llama, real steps, no mocks: a hit that takes a hot cache gives exactly the greedy
tokens of a cold run and of the same hit served from blocks.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from engine_helpers import engine_config
from engine_helpers import greedy as engine_greedy
from engine_helpers import run as run_all
from mlx_lm import load

from troupe.actors.engine import core
from troupe.actors.engine.core import Engine
from troupe.actors.engine.hot_cache import HOT_ENTRIES
from troupe.actors.engine.kv_blocks import common_prefix
from troupe.actors.engine.memory_estimate import model_memory
from troupe.actors.engine.prefix import model_fingerprint
from troupe.actors.messages import RequestFinished, SamplingParams
from troupe.actors.scheduler import weights_profile

BLOCK = 16
LONG = ("The quick brown fox jumps over the lazy dog. " * 6
        + "What is the capital of France? The capital of France is Paris. " * 2)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path):
    model, tok, config = load(str(tiny_model_dir), return_config=True)
    return model, tok, config, model_fingerprint(tiny_model_dir)


def make_engine(tiny, hot: bool = True, memory: bool = False, **settings) -> Engine:
    model, tok, config, fingerprint = tiny
    mem = None
    if memory:
        weights, dtype_bytes = weights_profile(model)
        mem = model_memory(config, dtype_bytes=dtype_bytes, weights_bytes=weights)
    engine = Engine(model, tok, engine_config(block_size=BLOCK, prefill_step_size=24,
                                              **settings),
                    fingerprint=fingerprint, memory=mem)
    if not hot:
        engine.blocks.hot.max_entries = 0
    return engine


def greedy(n: int = 12) -> SamplingParams:
    return engine_greedy(n, ignore_eos=True)


def cached_for(engine: Engine, prompt: list[int]) -> list:
    return engine.blocks.lookup(engine.prompt_hashes(prompt))


def run(engine: Engine, rid: str, prompt: list[int], n: int = 12) -> tuple[list[int], int]:
    """One request to its end, with the prompt's blocks in RAM: (tokens, cached tokens)."""
    engine.add(rid, prompt, greedy(n), cached=cached_for(engine, prompt))
    done = run_all(engine)[rid]
    return done["tokens"], done["finish"].usage.cached_tokens


@pytest.fixture
def builds(monkeypatch) -> list[int]:
    """The calls of ``build_cache`` (the block path), as the numbers of tokens built."""
    calls: list[int] = []
    real = core.build_cache

    def counted(model, kinds, blocks):
        calls.append(sum(b.n_tokens for b in blocks))
        return real(model, kinds, blocks)

    monkeypatch.setattr(core, "build_cache", counted)
    return calls


def address(a: mx.array) -> int:
    """Where an (evaluated) array's data lies (a view of it, dropped at once)."""
    return np.asarray(a).__array_interface__["data"][0]


def test_a_repeated_prompt_takes_the_hot_cache_with_the_same_tokens(tiny, builds):
    prompt = tiny[1].encode(LONG)
    cold, _ = run(make_engine(tiny), "cold", prompt)

    engine = make_engine(tiny)
    first, _ = run(engine, "a", prompt)
    hot = engine.blocks.hot
    assert len(hot) == 1 and hot.entries()[0].tokens == tuple(prompt + first[:-1])
    builds.clear()
    again, cached = run(engine, "b", prompt)
    assert cached == len(prompt) - 1  # the same tokens as the block path: all but the last
    assert (hot.hits, hot.hit_tokens) == (1, cached)
    assert builds == []
    assert first == again == cold

    blocks_only = make_engine(tiny, hot=False)
    run(blocks_only, "a", prompt)
    from_blocks, cached_b = run(blocks_only, "b", prompt)
    assert builds == [cached_b] and cached_b == cached
    assert len(blocks_only.blocks.hot) == 0
    assert from_blocks == cold
    stats = engine.blocks.stats()
    assert stats["hot_hits"] == 1 and stats["hot_entries"] == 1  # b's cache is hot now
    assert stats["hot_bytes"] == hot.nbytes > 0


def test_the_next_turn_of_a_conversation_rebuilds_from_blocks(tiny, builds):
    """A next turn outgrows the finished cache's buffer at once (a copy anyway, and measured
    slower on the CPU from a hot cache): it rebuilds from blocks, and its own finished cache
    replaces the first turn's (it extends it)."""
    tok = tiny[1]
    prompt = tok.encode(LONG)
    engine = make_engine(tiny)
    answer, _ = run(engine, "t1", prompt, n=20)
    turn2 = prompt + answer + tok.encode(" And what about Berlin, the capital of Germany?")
    builds.clear()
    warm, cached = run(engine, "t2", turn2, n=20)
    assert cached == len(prompt) + len(answer) - 1
    assert engine.blocks.hot.hits == 0 and builds == [cached]
    assert len(engine.blocks.hot) == 1
    assert engine.blocks.hot.entries()[0].tokens == tuple(turn2 + warm[:-1])
    cold, _ = run(make_engine(tiny), "cold", turn2, n=20)
    assert warm == cold


def test_a_prompt_sharing_a_shorter_beginning_leaves_the_entry_alone(tiny, builds):
    tok = tiny[1]
    a = tok.encode(LONG)
    b = a[:20] + tok.encode(" Where do rivers go when they reach the sea?")
    engine = make_engine(tiny)
    first, _ = run(engine, "a", a)
    entry = engine.blocks.hot.entries()[0]
    got_b, cached_b = run(engine, "b", b)
    assert 0 < cached_b < len(a) // 2
    assert engine.blocks.hot.hits == 0  # too little of a's cache to use it up
    assert len(b) <= len(entry.tokens)  # though b would fit in its buffer
    assert entry in engine.blocks.hot.entries()
    assert got_b == run(make_engine(tiny), "cold", b)[0]
    again, _ = run(engine, "a2", a)
    assert engine.blocks.hot.hits == 1 and again == first


def test_a_prompt_that_takes_anothers_entry_does_not_change_what_the_other_gets(tiny):
    """A prompt sharing most of a's tokens takes a's cache and writes its own ending over a's
    answer in it: a, repeated, then comes from blocks, with the same tokens."""
    tok = tiny[1]
    a = tok.encode(LONG)
    b = a[:-6] + tok.encode(" Rome is the capital of Italy.")
    engine = make_engine(tiny)
    first, _ = run(engine, "a", a)
    got_b, cached_b = run(engine, "b", b)
    assert cached_b == common_prefix(a, b) and engine.blocks.hot.hits == 1
    assert got_b == run(make_engine(tiny), "cold", b)[0]
    hits = engine.blocks.hot.hits
    again, _ = run(engine, "a2", a)
    assert engine.blocks.hot.hits == hits  # b's entry does not hold a's ending
    assert again == first


def test_the_hit_writes_into_the_hot_buffers_in_place(tiny):
    prompt = tiny[1].encode(LONG)
    engine = make_engine(tiny)
    run(engine, "a", prompt)
    (entry,) = engine.blocks.hot.entries()
    n = len(entry.tokens)
    size = entry.cache[0].keys.shape[2]
    assert size == n  # as extracted from the batch: kept without a copy
    where = [address(c.keys) for c in entry.cache]
    del entry
    engine.add("b", prompt, greedy(4), cached=cached_for(engine, prompt))
    engine.step()  # the prompt's last token, and the first answer token
    engine.step()  # a decode step
    assert engine.blocks.hot.hits == 1
    layers = engine.runner.decode_cache
    for layer, was in zip(layers, where, strict=True):
        (group,) = getattr(layer, "groups", [layer])
        assert group.keys.shape[2] == size  # not regrown
        assert group._idx == len(prompt) + 1  # the prompt and the first answer token
        assert address(group.keys) == was  # the same buffer: written in place
    while engine.has_work:
        engine.step()


def test_entries_are_bounded_in_number_and_by_the_ram_budget(tiny):
    tok = tiny[1]
    prompts = [tok.encode(f"Prompt number {i}: " + LONG) for i in range(HOT_ENTRIES + 2)]
    engine = make_engine(tiny)
    for i, p in enumerate(prompts):
        run(engine, f"r{i}", p)
    hot = engine.blocks.hot
    assert len(hot) == HOT_ENTRIES
    assert [e.tokens[: len(prompts[0])] for e in hot.entries()] == [
        tuple(p) for p in prompts[2:]]  # the oldest went first
    assert hot.kept == HOT_ENTRIES + 2 and hot.dropped == 2
    one = hot.entries()[0].nbytes

    # A budget with room for the blocks and about two entries.
    blocks = engine.blocks.nbytes
    tight = make_engine(tiny, cache_ram_max=blocks + 2 * one + one // 2)
    for i, p in enumerate(prompts):
        run(tight, f"r{i}", p)
        assert tight.blocks.nbytes + tight.blocks.hot.nbytes <= tight.blocks.max_bytes
    assert 1 <= len(tight.blocks.hot) <= 2

    # Blocks needing room take it from the hot caches first.
    evicted = tight.blocks.evicted
    tight.blocks.max_bytes = tight.blocks.nbytes + tight.blocks.hot.nbytes
    run(tight, "more", tok.encode("Something else entirely: " + LONG))
    assert tight.blocks.nbytes + tight.blocks.hot.nbytes <= tight.blocks.max_bytes
    assert tight.blocks.hot.dropped > 0
    assert tight.blocks.evicted - evicted < len(tight.blocks) // 2

    # Too small a budget for one entry: none is kept; blocks still are.
    small = make_engine(tiny, cache_ram_max=one // 2)
    run(small, "a", prompts[0])
    assert len(small.blocks.hot) == 0 and len(small.blocks) > 0


def test_memory_pressure_and_a_reset_drop_them(tiny):
    prompt = tiny[1].encode(LONG)
    engine = make_engine(tiny, memory=True)
    run(engine, "a", prompt)
    assert len(engine.blocks.hot) == 1
    # The gate holds a prompt for want of memory: the hot caches go first.
    mx.clear_cache()
    engine.add("b", tiny[1].encode("A different prompt. " * 20), greedy(2))
    events = []
    while engine.has_work:
        events += engine.step(limit=mx.get_active_memory() + 1_000)
    assert len(engine.blocks.hot) == 0
    assert any(isinstance(ev, RequestFinished) and ev.finish_reason == "error"
               for ev in events)

    run(engine, "c", prompt)
    assert len(engine.blocks.hot) == 1
    engine.blocks.spill([])  # memory pressure (the scheduler's spill)
    assert len(engine.blocks.hot) == 0

    run(engine, "d", prompt)
    assert len(engine.blocks.hot) == 1
    engine.reset("test")
    assert len(engine.blocks.hot) == 0


def test_hybrid_models_keep_no_hot_cache(tiny_hybrid_dir):
    model, tok = load(str(tiny_hybrid_dir))
    engine = Engine(model, tok, engine_config(block_size=BLOCK, prefill_step_size=24),
                    fingerprint=model_fingerprint(tiny_hybrid_dir))
    run(engine, "a", tok.encode(LONG))
    assert len(engine.blocks) > 0 and len(engine.blocks.hot) == 0
