"""Prefix cache on the MLX side: blocks cut from the batch, rebuilt into caches, reused.

A request served from cached blocks must give exactly the same greedy tokens as without them.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from tiny_model import make_tiny_model

from actors.engine import Engine
from actors.kv_blocks import from_numpy, to_numpy
from actors.messages import RequestFinished, SamplingParams, TokensGenerated
from actors.prefix import block_hashes, model_fingerprint, usable_blocks

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


def make_engine(model_dir: Path, **kw) -> Engine:
    model, tok = load(str(model_dir))
    return Engine(model, tok, block_size=BLOCK, fingerprint=model_fingerprint(model_dir),
                  prefill_step_size=24, **kw)


def cached_for(engine: Engine, prompt: list[int]) -> list:
    out = []
    for h in engine.prompt_hashes(prompt):
        if h not in engine.blocks:
            break
        out.append(engine.blocks[h])
    return out


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
    hit = cached_for(engine, prompt)
    assert len(hit) == n_usable, "every boundary crossed during prefill was captured"

    warm, warm_cached = run(engine, "b", prompt, cached=hit)
    assert warm_cached == n_usable * BLOCK
    assert warm == cold


def test_blocks_round_trip_through_numpy_give_identical_output(tiny_hybrid_dir):
    engine = make_engine(tiny_hybrid_dir)
    prompt = engine.tokenizer.encode(LONG)
    cold, _ = run(engine, "a", prompt)
    kinds, sizes = engine.kinds, engine.state_sizes
    restored = [from_numpy(to_numpy(b), kinds, sizes) for b in cached_for(engine, prompt)]
    warm, warm_cached = run(engine, "b", prompt, cached=restored)
    assert warm_cached > 0 and warm == cold


def test_bfloat16_blocks_round_trip_bit_for_bit(tmp_path):
    model_dir = make_tiny_model(tmp_path / "bf16", dtype="bfloat16")
    engine = make_engine(model_dir)
    prompt = engine.tokenizer.encode(LONG)
    run(engine, "a", prompt)
    block = cached_for(engine, prompt)[0]
    data = to_numpy(block)
    assert set(data.dtypes.values()) == {"bfloat16"}
    assert all(t.dtype == np.uint16 for t in data.tensors.values())
    back = from_numpy(data, engine.kinds, engine.state_sizes)
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
    hit = cached_for(engine, turn2)
    assert len(hit) * BLOCK > len(prompt)
    expected_hashes = block_hashes(engine.fingerprint, turn2, BLOCK)[: len(hit)]
    assert [b.block_hash for b in hit] == expected_hashes

    reference = make_engine(tiny_model_dir)
    cold, _ = run(reference, "cold", turn2)
    warm, cached_tokens = run(engine, "t2", turn2, cached=hit)
    assert cached_tokens == len(hit) * BLOCK
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
    blocks = cached_for(engine, prompt)
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
