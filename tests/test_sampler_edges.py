"""Sampling settings at their edges, found by ``troupe soak``'s bad-input corpus.

A ``top_k`` past the vocabulary made mlx-lm raise inside a function compiled over MLX's global
random state: that request got a 500, and so did every sampled request after it until the
server restarted. A seed outside mlx's unsigned 64 bits (``-1``, ``2**64``) was a 500 too.
"""

from __future__ import annotations

from engine_helpers import encode, engine_config, run
from reference import PROMPTS

from troupe.actors.engine.core import Engine
from troupe.actors.messages import SamplingParams


def sampled(**fields) -> SamplingParams:
    return SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True, **fields)


def test_top_k_past_the_vocabulary_samples_and_later_requests_still_sample(loaded):
    model, tok = loaded
    engine = Engine(model, tok, engine_config())
    prompt = encode(tok, PROMPTS[0])
    engine.add("huge", prompt, sampled(top_k=2**31))
    engine.add("huge-seeded", prompt, sampled(top_k=2**31, seed=7))
    first = run(engine)
    engine.add("after", prompt, sampled())
    engine.add("after-top-k", prompt, sampled(top_k=5))
    after = run(engine)
    for res in (first["huge"], first["huge-seeded"], after["after"], after["after-top-k"]):
        assert res["finish"].finish_reason == "length", res["finish"]
        assert len(res["tokens"]) == 4


def test_a_top_k_as_large_as_the_vocabulary_draws_as_no_top_k(loaded):
    model, tok = loaded
    prompt = encode(tok, PROMPTS[1])
    draws = []
    for top_k in (0, 10**9):
        engine = Engine(model, tok, engine_config())
        engine.add("s", prompt, sampled(seed=1234, top_k=top_k))
        draws.append(run(engine)["s"]["tokens"])
    assert draws[0] == draws[1]


def test_any_integer_seeds_the_sampler_wrapping_into_64_bits(loaded):
    model, tok = loaded
    prompt = encode(tok, PROMPTS[2])
    tokens = {}
    for seed in (-1, 2**64 - 1, 2**64, 0, -(10**30)):
        engine = Engine(model, tok, engine_config())
        engine.add("s", prompt, sampled(seed=seed))
        res = run(engine)["s"]
        assert res["finish"].finish_reason == "length", (seed, res["finish"])
        tokens[seed] = res["tokens"]
    assert tokens[-1] == tokens[2**64 - 1] and tokens[2**64] == tokens[0]
