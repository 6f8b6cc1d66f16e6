"""Mixed steps (actors/engine/forward.py, batch.py): decode and prefill in one forward pass,
ragged decode caches."""

from __future__ import annotations

import json
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from engine_helpers import encode, engine_config, fix_budget, greedy, run
from mlx_lm import load
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache, make_prompt_cache
from mlx_lm.models.rope_utils import YarnRoPE
from reference import PROMPTS, reference_tokens
from tiny_model import make_tiny_model

from troupe.actors.engine.core import Engine
from troupe.actors.engine.forward import mixed_forward, supports_mixed
from troupe.actors.engine.ragged_cache import MERGE_SLACK, RaggedKVCache
from troupe.actors.engine.runner import Runner
from troupe.actors.messages import TokensGenerated


def batch_cache(model, prompts: list[list[int]]) -> list:
    """Each prompt run alone into the model's own caches, merged per layer by its own batch
    class into one left-padded batch cache (``BatchKVCache``, or ``BatchRotatingKVCache`` for
    a rotating layer)."""
    per = []
    for p in prompts:
        cache = make_prompt_cache(model)
        if p:
            model(mx.array([p]), cache=cache)
        mx.eval([c.state for c in cache])
        per.append(cache)
    return [type(layer[0]).merge(list(layer)) for layer in zip(*per, strict=True)]


def count_passes(monkeypatch, model) -> list[int]:
    """A list that grows by one each forward pass of ``model``, of either kind: the final norm
    runs once per pass."""
    passes: list[int] = []

    class Counting(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def __call__(self, x):
            passes.append(1)
            return self.inner(x)

    monkeypatch.setitem(model.model, "norm", Counting(model.model.norm))
    return passes


def test_llama_shaped_models_are_supported_and_hybrids_are_not(loaded, tiny_hybrid_dir):
    model, _ = loaded
    assert supports_mixed(model)
    hybrid, _ = load(str(tiny_hybrid_dir))
    assert not supports_mixed(hybrid)
    assert not Runner(hybrid, engine_config()).mixed  # the model's own call


@pytest.fixture(scope="module")
def loaded_qwen3(tmp_path_factory: pytest.TempPathFactory):
    """A tiny qwen3 (llama's layer with per-head q/k norms), loaded with mlx-lm."""
    return load(str(make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3") / "m", arch="qwen3")))


@pytest.fixture(scope="module")
def loaded_qwen3_5(tmp_path_factory: pytest.TempPathFactory):
    """A tiny qwen3_5 (hybrid: layers 0 and 2 gated delta-net, 1 and 3 gated attention)."""
    model_dir = make_tiny_model(tmp_path_factory.mktemp("qwen3_5") / "m", arch="qwen3_5",
                                layers=4)
    return load(str(model_dir))


@pytest.fixture(scope="module")
def loaded_qwen3_5_moe(tmp_path_factory: pytest.TempPathFactory):
    """The same with routed and shared experts."""
    model_dir = make_tiny_model(tmp_path_factory.mktemp("qwen3_5_moe") / "m",
                                arch="qwen3_5_moe", layers=4)
    return load(str(model_dir))


# The fixture of each architecture the step tests below run.
LOADED = {"llama": "loaded", "qwen3": "loaded_qwen3", "qwen3_5": "loaded_qwen3_5",
          "qwen3_5_moe": "loaded_qwen3_5_moe"}


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_qwen3_and_its_hybrids_take_the_one_pass_step(request, arch):
    model, _ = request.getfixturevalue(LOADED[arch])
    assert supports_mixed(model)
    assert Runner(model, engine_config()).mixed


def two_calls_and_one_pass(model: Any, caches: Any, nxt: mx.array, piece: list[int]) -> Any:
    """The decode rows' logits from the model's own two calls (the decode step, then the
    chunk ``piece``) and from one ``mixed_forward``, each on fresh caches from ``caches()``
    (the decode rows', the prompt's): (the two calls' logits, the one pass's, the two calls'
    caches, the one pass's caches)."""
    d_sep, p_sep = caches()
    want = model(nxt, cache=d_sep)
    model(mx.array([piece]), cache=p_sep)
    d_mix, p_mix = caches()
    got = mixed_forward(model, nxt, d_mix, mx.array([piece]), p_mix)
    mx.eval(want, got)
    return want, got, (d_sep, p_sep), (d_mix, p_mix)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize(("decoding", "prior", "chunk"), [
    ([4, 25], 10, 12),  # rows of two lengths; a chunk after a prompt's first tokens
    ([4, 25], 0, 30),  # a prompt's first chunk (no recurrent state yet)
    ([30], 40, 1),  # a one-token chunk
])
def test_a_hybrid_mixed_forward_computes_what_two_calls_do(request, arch, decoding, prior,
                                                           chunk):
    """qwen3_5's recurrent layers (convolution and delta-rule state per group) and gated
    attention layers: the decode rows' logits and every layer's cache, recurrent state
    included, are those of the model's own two calls."""
    model, tok = request.getfixturevalue(LOADED[arch])
    text = tok.encode(" ".join(PROMPTS) * 2)
    rows = [text[i * 7:i * 7 + n] for i, n in enumerate(decoding)]
    prompt, piece = text[:prior], text[prior:prior + chunk]
    nxt = mx.array([[t] for t in text[-len(decoding):]])

    want, got, (d_sep, p_sep), (d_mix, p_mix) = two_calls_and_one_pass(
        model, lambda: (batch_cache(model, rows), batch_cache(model, [prompt])), nxt, piece)
    assert mx.allclose(got, want, atol=1e-4).item()
    assert mx.array_equal(got.argmax(-1), want.argmax(-1)).item()
    kinds = set()
    for a, b in zip(d_sep + p_sep, d_mix + p_mix, strict=True):
        assert type(a) is type(b)
        kinds.add(type(a))
        ours = b.cache if isinstance(b, ArraysCache) else b.keys_and_values()
        theirs = a.cache if isinstance(a, ArraysCache) else a.keys_and_values()
        for x, y in zip(theirs, ours, strict=True):
            assert x.shape == y.shape and mx.allclose(x, y, atol=1e-5).item()
    assert kinds == {ArraysCache, BatchKVCache}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_mixed_forward_computes_what_two_calls_do(request, arch):
    """The decode rows' logits and the prefill rows' cache are those of separate calls (to
    float rounding: a matrix product's rows may round differently with more rows)."""
    model, tok = request.getfixturevalue(LOADED[arch])
    decoding = [encode(tok, p) for p in PROMPTS[:3]]
    chunk = encode(tok, PROMPTS[5])[:12]
    prior = encode(tok, PROMPTS[4])
    nxt = mx.array([[7], [9], [11]])

    want, got, (_, p_sep), (_, p_mix) = two_calls_and_one_pass(
        model, lambda: (batch_cache(model, decoding), batch_cache(model, [prior])), nxt, chunk)
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=1e-4).item()
    assert mx.array_equal(got.argmax(-1), want.argmax(-1)).item()
    for a, b in zip(p_sep, p_mix, strict=True):
        ka, va = a.keys_and_values()
        kb, vb = b.keys_and_values()
        assert ka.shape == kb.shape and mx.allclose(ka, kb, atol=1e-5).item()
        assert mx.allclose(va, vb, atol=1e-5).item()
        assert a.offset.tolist() == b.offset.tolist()


def test_ragged_groups_attend_on_their_own(loaded):
    """A 2-row group and a much longer 1-row group in one RaggedKVCache: one forward gives
    each row what a call on its own group gives, and no row is padded to the longest."""
    model, tok = loaded
    short = [encode(tok, PROMPTS[0]), encode(tok, PROMPTS[1])]
    long = [encode(tok, " ".join(PROMPTS) * 4)]
    assert len(long[0]) > 200 > max(map(len, short))
    nxt_s, nxt_l = mx.array([[5], [6]]), mx.array([[8]])
    want_s = model(nxt_s, cache=batch_cache(model, short))
    want_l = model(nxt_l, cache=batch_cache(model, long))

    layers = [RaggedKVCache([a]) for a in batch_cache(model, short)]
    for c, b in zip(layers, batch_cache(model, long), strict=True):
        c.extend(b)
    assert [len(c.groups) for c in layers] == [2] * len(layers)
    assert [g.size() for g in layers[0].groups] == [max(map(len, short)), len(long[0])]
    got = mixed_forward(model, mx.concatenate([nxt_s, nxt_l]), layers)
    want = mx.concatenate([want_s, want_l])
    assert mx.allclose(got, want, atol=1e-4).item()
    assert mx.array_equal(got.argmax(-1), want.argmax(-1)).item()


def test_one_set_of_rope_angles_per_group_gives_the_same_bits(loaded, monkeypatch):
    """With troupe's CPU kernels, a forward pass makes each group's rotary angles once, from
    the first layer's offsets copied before any layer moves them, and every layer reuses
    them: the logits and the caches are bit for bit those of angles made layer by layer
    from each layer's own cache (two decode groups and a prefill chunk at three positions)."""
    from troupe.actors.engine import cpu_kernels
    from troupe.actors.engine import forward as forward_pass

    model, tok = loaded
    short = [encode(tok, PROMPTS[0]), encode(tok, PROMPTS[1])]
    long = [encode(tok, " ".join(PROMPTS) * 2)]
    prior = [encode(tok, PROMPTS[4])]
    chunk = mx.array([encode(tok, PROMPTS[5])[:12]])
    nxt = mx.array([[5], [6], [8]])

    def run_once():
        layers = [RaggedKVCache([a]) for a in batch_cache(model, short)]
        for c, b in zip(layers, batch_cache(model, long), strict=True):
            c.extend(b)
        prompt_cache = batch_cache(model, prior)
        logits = mixed_forward(model, nxt, layers, chunk, prompt_cache)
        state = [a for c in layers for g in c.groups for a in g.state[:2]]
        state += [a for c in prompt_cache for a in c.state[:2]]
        mx.eval(logits, state)
        return logits, state

    was = cpu_kernels.enabled()
    cpu_kernels.enable("native")
    real = mx.fast.rope
    calls = []

    def counting(*args, **kwargs):
        calls.append(kwargs["offset"])
        return real(*args, **kwargs)

    mx.fast.rope = counting
    try:
        shared_logits, shared_state = run_once()
        offsets = {id(o) for o in calls}
        calls.clear()
        monkeypatch.setattr(forward_pass, "_frozen", lambda offset: None)  # each layer's own
        own_logits, own_state = run_once()
        per_layer = {id(o) for o in calls}
    finally:
        mx.fast.rope = real
        if not was:
            cpu_kernels.disable()
    assert len(offsets) == 3 and len(per_layer) > 3  # one per group, against per layer
    assert mx.array_equal(shared_logits, own_logits).item()
    assert all(mx.array_equal(a, b).item() for a, b in zip(shared_state, own_state, strict=True))


def test_ragged_cache_merges_cheap_groups_and_filters_in_order():
    def group(rows: int, length: int, fill: float) -> BatchKVCache:
        c = BatchKVCache([0] * rows)
        kv = mx.full((rows, 1, length, 2), fill)
        c.update_and_fetch(kv, kv)
        return c

    r = RaggedKVCache([group(2, 40, 1.0)])
    r.extend(group(1, 40 + MERGE_SLACK, 2.0))  # little padding: merged
    assert len(r.groups) == 1 and r.groups[0].offset.shape[0] == 3
    r.extend(group(1, 1000, 3.0))  # 3 rows padded to 1,000 would cost far more: a group
    r.extend(group(2, 30, 4.0))  # short again: not merged into the long one
    assert [(a, b) for a, b, _ in r.spans()] == [(0, 3), (3, 4), (4, 6)]
    assert r.size() == 1000
    # Row 3 (the long one) is extracted from its own group, unpadded.
    one = r.extract(3)
    assert isinstance(one, KVCache) and one.offset == 1000
    assert mx.all(one.keys == 3.0).item()
    # The long row finishes: its group goes, and its neighbours are close enough to merge.
    r.filter([0, 1, 2, 4, 5])
    assert len(r.groups) == 1 and r.groups[0].offset.shape[0] == 5
    assert mx.all(r.extract(4).keys == 4.0).item()
    assert mx.all(r.extract(0).keys[..., -40:, :] == 1.0).item()


def test_a_long_prompt_joining_short_decoders_gets_its_own_group(loaded):
    """Greedy tokens match mlx-lm alone for every request; the long one decodes in a group of
    its own instead of padding the short ones to its length."""
    model, tok = loaded
    engine = Engine(model, tok, engine_config(prefill_step_size=64, prefill_interleave=1.0))
    fix_budget(engine, 8)
    short = {f"s{i}": encode(tok, p) for i, p in enumerate(PROMPTS[:3])}
    for rid, p in short.items():
        engine.add(rid, p, greedy(60, ignore_eos=True))
    got: dict[str, list[int]] = {}

    def step() -> None:
        for ev in engine.step():
            if isinstance(ev, TokensGenerated):
                got.setdefault(ev.request_id, []).extend(ev.token_ids)

    for _ in range(4):
        step()
    long_prompt = encode(tok, " ".join(PROMPTS) * 4)
    engine.add("long", long_prompt, greedy(12, ignore_eos=True))
    while "long" not in got:
        step()
    caches = engine.runner.decode_cache
    assert all(isinstance(c, RaggedKVCache) and len(c.groups) == 2 for c in caches)
    while engine.requests:
        step()
    for rid, p in short.items():
        assert got[rid] == reference_tokens(model, tok, p, 60), rid
    assert got["long"] == reference_tokens(model, tok, long_prompt, 12)


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "separate-calls"])
def test_one_forward_pass_a_step_while_a_prompt_is_prefilled(request, monkeypatch, arch, mixed):
    """While streams decode and a prompt is prefilled in chunks, a mixed step is one forward
    pass; mlx-lm's step is two (and a third as the prompt's last token joins)."""
    model, tok = request.getfixturevalue(LOADED[arch])
    passes = count_passes(monkeypatch, model)
    engine = Engine(model, tok, engine_config(prefill_step_size=16, prefill_interleave=1.0,
                                              mixed_step=mixed))
    fix_budget(engine, 16)
    for i, p in enumerate(PROMPTS[:2]):
        engine.add(f"d{i}", encode(tok, p), greedy(200, ignore_eos=True))
    while engine.runner.decoding < 2:
        engine.step()
    long_prompt = encode(tok, " ".join(PROMPTS) * 2)
    engine.add("long", long_prompt, greedy(4))
    per_step = []
    while engine.requests["long"].first_token_at is None:
        passes.clear()
        engine.step()
        per_step.append(len(passes))
    assert len(per_step) >= len(long_prompt) // 16
    if mixed:
        assert set(per_step) == {1}
    else:
        assert per_step.count(2) >= len(long_prompt) // 16 - 1
    for rid in list(engine.requests):
        engine.abort(rid)


def test_a_request_aborted_before_its_first_token_leaves_the_batch_clean(loaded):
    model, tok = loaded
    engine = Engine(model, tok, engine_config())
    engine.add("a", encode(tok, PROMPTS[0]), greedy(30, ignore_eos=True))
    engine.step()
    engine.step()
    engine.add("b", encode(tok, PROMPTS[1]), greedy(30, ignore_eos=True))
    engine.step()  # b prefilled, its last token joins next step
    engine.step()
    assert "b" in engine.requests
    engine.abort("b")
    got = run(engine)["a"]["tokens"]
    assert engine.runner.decoding == 0
    full = reference_tokens(model, tok, encode(tok, PROMPTS[0]), 30)
    assert got == full[len(full) - len(got):]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_5"])
def test_prompts_finishing_at_different_steps_beside_decoders_match_mlx_lm(request, arch):
    """A short and a long prompt prefilled together while a stream decodes: the short one
    joins the decode batch first (split out of the prompt batch), the long one goes on."""
    model, tok = request.getfixturevalue(LOADED[arch])
    engine = Engine(model, tok, engine_config(prefill_step_size=64, prefill_interleave=1.0))
    fix_budget(engine, 16)
    engine.add("d", encode(tok, PROMPTS[0]), greedy(80, ignore_eos=True))
    early: list[int] = []  # what "d" answered before the others came
    while not engine.runner.decoding:
        early += [t for ev in engine.step() if isinstance(ev, TokensGenerated)
                  for t in ev.token_ids]
    prompts = {"long": encode(tok, " ".join(PROMPTS) * 3), "short": encode(tok, PROMPTS[3])}
    for rid, p in prompts.items():
        engine.add(rid, p, greedy(16, ignore_eos=True))
    got = {rid: r["tokens"] for rid, r in run(engine).items()}
    for rid, p in prompts.items():
        assert got[rid] == reference_tokens(model, tok, p, 16), rid
    # mlx-lm's reference stops at the end-of-sequence token that "d" (ignore_eos) goes past.
    want = reference_tokens(model, tok, encode(tok, PROMPTS[0]), 80)
    assert (early + got["d"])[: len(want)] == want


# -- sliding-window layers (RotatingKVCache) between global ones: gemma3_text, gpt_oss, mistral


@pytest.fixture(scope="module")
def loaded_gemma3(tmp_path_factory: pytest.TempPathFactory):
    """A tiny gemma3_text: layers 0 and 2 attend over a window of 18 tokens (RotatingKVCache),
    1 and 3 over everything; four norms a layer, scaled embeddings, q/k norms."""
    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny-gemma3") / "m",
                                arch="gemma3_text", layers=4)
    return load(str(model_dir))


@pytest.fixture(scope="module")
def loaded_gpt_oss(tmp_path_factory: pytest.TempPathFactory):
    """A tiny gpt_oss: layers 0 and 2 attend over a window of 8 tokens, 1 and 3 over
    everything; a random sink per head, biased experts, and YaRN rope scaled as the released
    checkpoints' configs scale it (the architecture matrix runs its plain rope)."""
    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny-gpt-oss") / "m", arch="gpt_oss",
                                layers=4, context=32 * 4096)
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                              "beta_slow": 1.0, "original_max_position_embeddings": 4096,
                              "truncate": False}
    (model_dir / "config.json").write_text(json.dumps(config))
    model, tok = load(str(model_dir))
    assert isinstance(model.model.layers[0].self_attn.rope, YarnRoPE)
    return model, tok


@pytest.fixture(scope="module")
def loaded_mistral(tmp_path_factory: pytest.TempPathFactory):
    """A tiny mistral (mlx-lm's llama): layers 0 and 2 attend over a window of 8 tokens, 1 and
    3 over everything, as its config's ``layer_types`` name them."""
    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny-mistral") / "m", arch="mistral",
                                layers=4)
    model, tok = load(str(model_dir))
    assert [layer.use_sliding for layer in model.model.layers] == [True, False, True, False]
    return model, tok


WINDOWED = ["loaded_gemma3", "loaded_gpt_oss", "loaded_mistral"]


@pytest.mark.parametrize("name", WINDOWED)
def test_sliding_window_models_take_the_one_pass_step(request, name):
    model, _ = request.getfixturevalue(name)
    assert supports_mixed(model)
    assert Runner(model, engine_config()).mixed


@pytest.mark.parametrize("name", WINDOWED)
@pytest.mark.parametrize(("decoding", "prior", "chunk", "steps"), [
    ([4, 25], 10, 12, 0),  # a row inside the window and one past it; the chunk crosses it
    ([4, 25], 0, 30, 16),  # both rows decoded past the window; a chunk longer than it
    ([30], 40, 1, 3),  # a one-token chunk, written in place, wrapping round a full window
])
def test_a_windowed_mixed_forward_computes_what_two_calls_do_across_the_window(
        request, name, decoding, prior, chunk, steps):
    """Decode rows and a prefill chunk at positions on both sides of the sliding window: the
    logits, and every layer's cache (rotating ones as mlx-lm writes them: same order, same
    padding), are those of the model's own two calls (gpt_oss's with its sinks and YaRN)."""
    model, tok = request.getfixturevalue(name)
    window = model.args.sliding_window
    text = tok.encode(" ".join(PROMPTS) * 2)
    rows = [text[i * 7:i * 7 + n] for i, n in enumerate(decoding)]
    prompt, piece = text[:prior], text[prior:prior + chunk]
    nxt = mx.array([[t] for t in text[-len(decoding):]])

    def caches():
        d, p = batch_cache(model, rows), batch_cache(model, [prompt])
        for s in range(steps):  # past the window: the rotating caches wrap around
            model(mx.array([[text[s]]] * len(rows)), cache=d)
        return d, p

    want, got, (d_sep, p_sep), (d_mix, p_mix) = two_calls_and_one_pass(model, caches, nxt,
                                                                       piece)
    assert max(decoding) + steps > window or prior + chunk > window
    assert mx.allclose(got, want, atol=1e-4).item()
    assert mx.array_equal(got.argmax(-1), want.argmax(-1)).item()
    for a, b in zip(d_sep + p_sep, d_mix + p_mix, strict=True):
        assert type(a) is type(b)
        ka, va = a.keys_and_values()
        kb, vb = b.keys_and_values()
        assert ka.shape == kb.shape and mx.allclose(ka, kb, atol=1e-5).item()
        assert mx.allclose(va, vb, atol=1e-5).item()
        assert a.offset.tolist() == b.offset.tolist()
        assert a.left_padding.tolist() == b.left_padding.tolist()


@pytest.mark.parametrize("name", WINDOWED)
@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "separate-calls"])
def test_a_windowed_model_takes_one_forward_pass_a_step_while_a_prompt_is_prefilled(
        request, name, monkeypatch, mixed):
    """Two streams decode past the sliding window while a prompt of six windows is prefilled
    in chunks of 16 tokens (straddling the window's edges): a mixed step is one forward pass
    (mlx-lm's: two), every request gets mlx-lm's tokens alone, and the decode batch stays one
    group (mlx-lm's batch caches: in a RaggedKVCache, the rotating layers, whose sizes stop at
    the window, would group the rows unlike the global ones)."""
    model, tok = request.getfixturevalue(name)
    window = model.args.sliding_window
    passes = count_passes(monkeypatch, model)
    engine = Engine(model, tok, engine_config(prefill_step_size=16, prefill_interleave=1.0,
                                              mixed_step=mixed))
    assert engine.runner.mixed is mixed
    fix_budget(engine, 16)
    decoders = {f"d{i}": encode(tok, p) for i, p in enumerate(PROMPTS[:2])}
    for rid, p in decoders.items():
        engine.add(rid, p, greedy(48, ignore_eos=True))
    got: dict[str, list[int]] = {}

    def step() -> None:
        for ev in engine.step():
            if isinstance(ev, TokensGenerated):
                got.setdefault(ev.request_id, []).extend(ev.token_ids)

    while engine.runner.decoding < 2:
        step()
    long_prompt = encode(tok, " ".join(PROMPTS) * 2)
    assert len(long_prompt) > 6 * window
    engine.add("long", long_prompt, greedy(8, ignore_eos=True))
    per_step = []
    while engine.requests["long"].first_token_at is None:
        passes.clear()
        step()
        per_step.append(len(passes))
    assert len(per_step) >= len(long_prompt) // 16
    if mixed:
        assert set(per_step) == {1}
    else:
        assert per_step.count(2) >= len(long_prompt) // 16 - 1
    caches = engine.runner.decode_cache
    assert not any(isinstance(c, RaggedKVCache) for c in caches)
    while engine.requests:
        step()
    for rid, p in {**decoders, "long": long_prompt}.items():
        assert len(p) + len(got[rid]) > window
        want = reference_tokens(model, tok, p, len(got[rid]))  # ignore_eos: up to mlx-lm's EOS
        assert got[rid][: len(want)] == want, rid
