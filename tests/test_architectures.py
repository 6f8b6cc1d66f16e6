"""Every architecture people run, at the engine level: a tiny random-weight model of each, made
with mlx-lm's own model classes (tests/tiny_model.py), served greedily and checked against
mlx-lm's own generation of each prompt alone (tests/reference.py).

Per architecture: one request; four joining a running batch at different steps; a long prompt
prefilled in chunks beside a decoding stream; a repeated prompt served from the RAM prefix cache;
blocks written to disk serving a restarted engine. The generation tests also check which step
serves it: one forward pass a step (actors/engine/forward.py) or mlx-lm's own model call.
An architecture whose caches cannot be cut into blocks (a cache kind actors/engine/kv_blocks.py
does not know) runs without a prefix cache: for it the cache tests check that caching is off
and that repeats are still right.

The 2026 families and gpt_oss also run quantized by mlx-lm's own code (4-bit in groups of 32
and 64, one 8-bit, one mixed-precision), checked against mlx-lm on the same quantized weights.
Every variant first shows that its greedy answer follows the context, not just the last token:
random weights otherwise tend to echo it, and equal outputs would prove little.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import engine_config, greedy, ram_hit, run, run_arriving
from mlx_lm import load
from reference import PROMPTS, reference_tokens
from tiny_model import make_tiny_model

from troupe.actors import block_store
from troupe.actors.engine.core import Engine
from troupe.actors.engine.kv_blocks import KVBlock, from_numpy, to_numpy
from troupe.actors.engine.prefix import model_fingerprint, usable_blocks
from troupe.actors.messages import TokensGenerated

BLOCK = 16
# Crosses several blocks and every sliding window (8 or 18 tokens) many times over.
LONG = ("The quick brown fox jumps over the lazy dog. " * 6
        + "What is the capital of France? The capital of France is Paris. " * 2)
CHUNK = 16  # prefill_step_size of the long-prompt test
# Two prompts that end alike and differ before: a model whose greedy answer followed only its
# last token (a random model's residual stream echoing it) would answer both the same.
SAME_END = ("The quick brown fox jumps over the lazy dog. What is the capital of France?",
            "Numbers like 12345 and 67890 are split into digits. What is the capital of France?")


@dataclass(frozen=True)
class Arch:
    name: str  # mlx-lm model_type
    layers: int
    # Whether the engine keeps a prefix cache for it (False: a layer's cache cannot be cut).
    caching: bool
    # Whether the engine serves it with one forward pass a step (mixed steps: decode rows and
    # the prefill chunk together), not mlx-lm's own model call.
    mixed: bool
    why: str  # what the architecture adds to the matrix
    # Quantized by mlx-lm to this many bits in groups of group_size (0: float32 weights); with
    # high_bits, mixed precision: some layers at high_bits (tests/tiny_model.py).
    bits: int = 0
    group_size: int = 64
    high_bits: int = 0

    @property
    def id(self) -> str:
        if not self.bits:
            return self.name
        mixed = f"-mixed{self.high_bits}" if self.high_bits else ""
        return f"{self.name}-{self.bits}bit-g{self.group_size}{mixed}"


ARCHS = [
    Arch("llama", 2, True, True, "the reference shape"),
    Arch("qwen2", 2, True, True, "q/k/v biases"),
    Arch("qwen3", 2, True, True, "q/k norms"),
    Arch("gemma3_text", 4, True, True, "sliding-window and global layers, four norms a layer"),
    Arch("mistral", 2, True, True, "a sliding window (as llama with layer_types)"),
    Arch("phi3", 2, True, False, "fused qkv and gate/up projections"),
    Arch("qwen3_moe", 2, True, True, "a mixture of experts"),
    Arch("gpt_oss", 2, True, True, "attention sinks, sliding window, experts"),
    Arch("lfm2", 4, True, False, "hybrid: convolution and attention layers"),
    Arch("qwen3_next", 4, True, False, "hybrid: gated delta-net and attention layers, experts"),
    Arch("qwen3_5", 4, True, True, "hybrid: gated delta-net and attention layers, dense"),
    Arch("qwen3_5_moe", 4, True, True, "hybrid as qwen3_5, routed and shared experts"),
    Arch("gemma4_text", 4, True, False,
         "sliding and global layers of two head sizes, per-layer inputs, a shared KV layer"),
    Arch("deepseek_v3", 2, True, False, "multi-head latent attention (MLA), experts"),
    Arch("glm4_moe", 2, True, True, "partial rotary, q/k norms, a dense layer then experts"),
    Arch("nemotron_h", 4, True, False, "hybrid: Mamba-2, attention, MLP and expert layers"),
    Arch("minimax", 2, True, False, "sigmoid-routed experts, q/k norms across heads"),
    Arch("kimi_linear", 4, True, False, "hybrid: Kimi delta attention and MLA layers, experts"),
]
# As users download them: the 2026 families and gpt_oss 4-bit in groups of 32 and of 64,
# qwen3_5 8-bit, glm4_moe mixed (v_proj, down_proj, embedding and head 8-bit, the rest 4-bit).
QUANTIZED = ["qwen3_5", "qwen3_5_moe", "gemma4_text", "gpt_oss", "deepseek_v3", "glm4_moe",
             "nemotron_h", "minimax", "kimi_linear"]
_BY_NAME = {a.name: a for a in ARCHS}
ARCHS += [replace(_BY_NAME[n], bits=4, group_size=g) for n in QUANTIZED for g in (32, 64)]
ARCHS += [replace(_BY_NAME["qwen3_5"], bits=8),
          replace(_BY_NAME["glm4_moe"], bits=4, high_bits=8)]


@dataclass
class Tiny:
    arch: Arch
    model_dir: Path
    model: Any
    tok: Any
    _refs: dict[tuple[tuple[int, ...], int], list[int]] = field(default_factory=dict)

    def reference(self, prompt: list[int], max_tokens: int) -> list[int]:
        """mlx-lm's greedy tokens for the prompt alone (computed once)."""
        key = (tuple(prompt), max_tokens)
        if key not in self._refs:
            self._refs[key] = reference_tokens(self.model, self.tok, prompt, max_tokens)
        return self._refs[key]

    def engine(self, **settings: Any) -> Engine:
        return Engine(self.model, self.tok, engine_config(**settings))

    def caching_engine(self, model: Any = None, tok: Any = None) -> Engine:
        return Engine(model or self.model, tok or self.tok,
                      engine_config(block_size=BLOCK, prefill_step_size=24),
                      fingerprint=model_fingerprint(self.model_dir))


@pytest.fixture(scope="module", params=ARCHS, ids=[a.id for a in ARCHS])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    arch: Arch = request.param
    model_dir = make_tiny_model(tmp_path_factory.mktemp(arch.id) / arch.name,
                                arch=arch.name, layers=arch.layers, bits=arch.bits,
                                group_size=arch.group_size, high_bits=arch.high_bits)
    model, tok = load(str(model_dir))
    return Tiny(arch, model_dir, model, tok)


def serve(engine: Engine, rid: str, prompt: list[int], max_tokens: int,
          cached: list[KVBlock] | None = None) -> tuple[list[int], int]:
    """Run one request to its end: its tokens and the prompt tokens it took from cache."""
    engine.add(rid, prompt, greedy(max_tokens), cached=cached or ())
    res = run(engine)[rid]
    return res["tokens"], res["finish"].usage.cached_tokens


# -- generation ------------------------------------------------------------------------------


def test_quantized_weights_load_as_the_config_records_them(tiny: Tiny) -> None:
    """mlx-lm's loader rebuilt quantized layers at the variant's bits and group size (mixed:
    the v_proj and down_proj layers at the high bits), so the checks below run on them."""
    quantized = {name: m for name, m in tiny.model.named_modules() if hasattr(m, "scales")}
    assert bool(quantized) is bool(tiny.arch.bits)
    if not tiny.arch.bits:
        return
    assert (tiny.arch.bits, tiny.arch.group_size) in {(m.bits, m.group_size)
                                                      for m in quantized.values()}
    if tiny.arch.high_bits:
        high = [m.bits for n, m in quantized.items() if "v_proj" in n or "down_proj" in n]
        assert high and set(high) == {tiny.arch.high_bits}
        assert tiny.arch.bits in {m.bits for m in quantized.values()}


def test_greedy_output_depends_on_the_context_before_the_last_tokens(tiny: Tiny) -> None:
    """Else the equalities below could hold for an engine that lost the context."""
    a, b = (tiny.tok.encode(t) for t in SAME_END)
    assert a[-6:] == b[-6:] and a != b
    assert tiny.reference(a, 8) != tiny.reference(b, 8)


def test_one_request_gives_mlx_lm_greedy_tokens(tiny: Tiny) -> None:
    prompt = tiny.tok.encode(PROMPTS[0])
    engine = tiny.engine()
    assert engine.runner.mixed is tiny.arch.mixed
    tokens, _ = serve(engine, "a", prompt, 24)
    assert tokens == tiny.reference(prompt, 24)
    assert len(tokens) > 1, "the model must generate something to compare"


@pytest.mark.parametrize("mixed", [True, False], ids=["served", "separate-calls"])
def test_four_requests_joining_mid_way_each_give_their_tokens_alone(tiny: Tiny,
                                                                    mixed: bool) -> None:
    """Different lengths (some past the sliding windows), joining every third step while the
    others decode, with small prefill chunks. ``separate-calls``: mlx-lm's decode step and
    prefill call apart, for architectures the one-pass step also covers."""
    texts = [PROMPTS[0], PROMPTS[5], PROMPTS[6], " ".join(PROMPTS[1:5])]
    prompts = [tiny.tok.encode(t) for t in texts]
    assert len({len(p) for p in prompts}) == 4
    engine = tiny.engine(prefill_step_size=4, mixed_step=mixed)
    assert engine.runner.mixed is (mixed and tiny.arch.mixed)
    results = run_arriving(engine, prompts, 16)
    for i, p in enumerate(prompts):
        assert results[f"r{i}"] == tiny.reference(p, 16), f"r{i} ({len(p)} prompt tokens)"


def test_a_long_prompt_prefilled_in_chunks_beside_a_decoding_stream_gives_mlx_lm_tokens(
        tiny: Tiny) -> None:
    """mlx-lm prefills the prompt in one call; the engine in chunks of CHUNK tokens, each in a
    step where another stream decodes."""
    short = tiny.tok.encode(PROMPTS[1])
    long_prompt = tiny.tok.encode(" ".join(PROMPTS) * 2)
    assert len(long_prompt) > 6 * CHUNK
    engine = tiny.engine(prefill_step_size=CHUNK)
    assert engine.runner.mixed is tiny.arch.mixed
    engine.add("short", short, greedy(64, ignore_eos=True))
    got: dict[str, list[int]] = {"short": [], "long": []}

    def step() -> None:
        for ev in engine.step():
            if isinstance(ev, TokensGenerated):
                got[ev.request_id] += ev.token_ids

    while not got["short"]:
        step()
    engine.add("long", long_prompt, greedy(12))
    chunks = []
    while not got["long"]:
        before = engine.prefill_tokens
        step()
        chunks.append(engine.prefill_tokens - before)
    assert len(chunks) >= len(long_prompt) // CHUNK
    assert max(chunks) <= CHUNK + 1  # a chunk may take the prompt's last token too
    while engine.has_work:
        step()
    assert got["long"] == tiny.reference(long_prompt, 12)
    want_short = reference_tokens(tiny.model, tiny.tok, short, 64)  # ignore_eos: no EOS cut
    assert got["short"][: len(want_short)] == want_short


# -- prefix cache ----------------------------------------------------------------------------


def test_the_prefix_cache_is_kept_exactly_when_every_layer_cache_can_be_cut(tiny: Tiny) -> None:
    engine = tiny.caching_engine()
    assert engine.caching is tiny.arch.caching, (
        f"{tiny.arch.name}: caching is {engine.caching}; update ARCHS if the engine now "
        "caches (or no longer caches) this architecture")


def test_a_repeated_prompt_is_served_from_ram_blocks_with_the_same_tokens(tiny: Tiny) -> None:
    engine = tiny.caching_engine()
    prompt = tiny.tok.encode(LONG)
    want = tiny.reference(prompt, 12)
    cold, cold_cached = serve(engine, "cold", prompt, 12)
    assert cold == want
    assert cold_cached == 0
    hit = ram_hit(engine, prompt)
    warm, warm_cached = serve(engine, "warm", prompt, 12, cached=hit)
    assert warm == want
    if not tiny.arch.caching:
        assert not hit and not engine.blocks and warm_cached == 0
        return
    assert len(hit) == usable_blocks(len(prompt), BLOCK)
    if engine.hybrid:  # recurrent state exists only at block ends: whole blocks only
        assert warm_cached == len(hit) * BLOCK
    elif any(engine.windows):
        # Whole blocks, then of the block after them (cut as the answer decoded) as much as
        # its sliding layers' KV reaches back: none when the window is smaller than a block.
        assert len(hit) * BLOCK <= warm_cached <= len(prompt) - 1
        assert (warm_cached == len(prompt) - 1) is (min(engine.windows[i] for i in
                                                        engine.window_layers) > BLOCK)
    else:  # whole blocks, then the first request's tail up to the last prompt token
        assert warm_cached == len(prompt) - 1


def test_blocks_written_to_disk_serve_a_restarted_engine_with_the_same_tokens(
        tiny: Tiny, tmp_path: Path) -> None:
    """The whole blocks go through the files the SSD writer writes (block_store) and come back
    as the scheduler reads them, into a fresh engine on a freshly loaded model."""
    fingerprint = model_fingerprint(tiny.model_dir)
    cache_dir = tmp_path / "cache"
    prompt = tiny.tok.encode(LONG)
    want = tiny.reference(prompt, 12)

    first = tiny.caching_engine()
    cold, _ = serve(first, "cold", prompt, 12)
    assert cold == want
    for _, blk in first.take_new_blocks():
        if not blk.tail:  # tails are RAM-only
            data = to_numpy(blk, first.layout)
            block_store.write_atomic(block_store.block_path(cache_dir, blk.block_hash),
                                     block_store.encode_block(data, fingerprint),
                                     block_store.fingerprint_tag(fingerprint))
    first.close()

    model, tok = load(str(tiny.model_dir))
    restarted = tiny.caching_engine(model, tok)
    on_disk = {b.block_hash for b in block_store.scan_cache_dir(cache_dir, fingerprint).blocks}
    hit = []
    for h in restarted.prompt_hashes(prompt):
        if h not in on_disk:
            break
        data = block_store.decode_block(
            block_store.block_path(cache_dir, h).read_bytes(), fingerprint, h)
        hit.append(from_numpy(data, restarted.kinds, restarted.state_sizes, restarted.layout))
    warm, warm_cached = serve(restarted, "warm", prompt, 12, cached=hit)
    assert warm == want
    if not tiny.arch.caching:
        assert not on_disk and warm_cached == 0
        return
    assert len(hit) == usable_blocks(len(prompt), BLOCK)
    assert warm_cached == len(hit) * BLOCK
