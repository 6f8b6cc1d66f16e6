"""The prefix cache for sliding-window models (actors/engine/kv_blocks.py): a sliding layer
keeps only its last ``window`` tokens, so a block holds what the layer still held of its
tokens when it was cut, and a hit ends where the blocks hold every window before it.

Tiny random-weight models made with mlx-lm's own classes (tests/tiny_model.py): gemma3_text
(a window of 18 tokens beside global layers), mistral as llama with a sliding layer and gpt_oss
(attention sinks), both with windows of 8. Every answer is checked against mlx-lm's own
generation of the prompt alone, at prompts shorter than, as long as and several times longer
than the window, with blocks smaller and larger than it, hits ending inside the first window
and past it, and through files as after a restart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_helpers import engine_config, greedy, ram_hit, run
from mlx_lm import load
from mlx_lm.generate import stream_generate
from tiny_model import make_tiny_model

from troupe.actors import block_store
from troupe.actors.cache_messages import BlockData
from troupe.actors.engine.core import Engine
from troupe.actors.engine.kv_blocks import WINDOW, KVBlock, covered, from_numpy, to_numpy
from troupe.actors.engine.prefix import model_fingerprint, usable_blocks

# (architecture, layers, its window)
MODELS = [("gemma3_text", 4, 18), ("mistral", 2, 8), ("gpt_oss", 2, 8)]
TEXT = ("The quick brown fox jumps over the lazy dog. What is the capital of France? "
        "The capital of France is Paris, and numbers like 12345 follow it. ") * 4


@pytest.fixture(scope="module", params=MODELS, ids=[m[0] for m in MODELS])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    arch, layers, window = request.param
    model_dir = make_tiny_model(tmp_path_factory.mktemp(arch) / arch, arch=arch, layers=layers)
    model, tok = load(str(model_dir))
    return model_dir, model, tok, window


def engine(tiny: Any, block: int, **settings: Any) -> Engine:
    model_dir, model, tok, _ = tiny
    return Engine(model, tok, engine_config(block_size=block, **settings),
                  fingerprint=model_fingerprint(model_dir))


def serve(e: Engine, rid: str, prompt: list[int], cached: list[KVBlock] = (),
          max_tokens: int = 10) -> tuple[list[int], int]:
    e.add(rid, prompt, greedy(max_tokens, ignore_eos=True), cached=cached)
    res = run(e)[rid]
    return res["tokens"], res["finish"].usage.cached_tokens


def reference(tiny: Any, prompt: list[int], max_tokens: int = 10) -> list[int]:
    """mlx-lm's own greedy tokens for the prompt alone, EOS included (as ``serve`` runs)."""
    _, model, tok, _ = tiny
    return [r.token for r in stream_generate(model, tok, prompt, max_tokens=max_tokens)]


def tokens(tiny: Any, n: int, offset: int = 0) -> list[int]:
    ids = tiny[2].encode(TEXT)
    assert len(ids) >= n + offset
    return ids[offset : offset + n]


def test_the_models_answer_by_their_context(tiny: Any) -> None:
    """Two prompts give two answers: an equal answer from a hit says something."""
    assert reference(tiny, tokens(tiny, 30)) != reference(tiny, tokens(tiny, 30, offset=7))


@pytest.mark.parametrize("block", [4, 16])
@pytest.mark.parametrize("length", ["under", "window", "several"])
def test_a_repeated_prompt_is_served_from_ram_with_the_tokens_of_no_cache(
        tiny: Any, block: int, length: str) -> None:
    window = tiny[3]
    n = {"under": window - 2, "window": window, "several": 5 * window + 3}[length]
    prompt = tokens(tiny, n)
    want = reference(tiny, prompt)
    e = engine(tiny, block)
    assert e.caching and WINDOW in e.kinds
    cold, cold_cached = serve(e, "cold", prompt)
    assert cold == want and cold_cached == 0
    hit = ram_hit(e, prompt)
    warm, warm_cached = serve(e, "warm", prompt, hit)
    assert warm == want
    # The whole prompt was prefilled in one chunk: every window was held at the cut.
    assert len(hit) == usable_blocks(n, block)
    assert warm_cached >= len(hit) * block


@pytest.mark.parametrize("block", [4, 16])
def test_the_next_turn_of_a_conversation_starts_from_the_last_answer(
        tiny: Any, block: int) -> None:
    """An agent's next request resends the last prompt and its answer: the hit reaches the
    answer's last whole block, whatever the prefill's chunks (the window layers' KV of each
    block is taken in the step that completes it, before the layer drops it)."""
    window = tiny[3]
    first = tokens(tiny, 4 * window + 5)
    for chunk in (512, window // 2):
        e = engine(tiny, block, prefill_step_size=chunk)
        answer, _ = serve(e, f"t1-{chunk}", first)
        second = first + answer + tokens(tiny, 9, offset=3)
        hit = ram_hit(e, second)
        got, cached = serve(e, f"t2-{chunk}", second, hit)
        assert got == reference(tiny, second)
        # The first request's cache held its prompt and all but its last answer token.
        assert cached >= (len(first) + len(answer) - 1) // block * block


def test_a_prompt_sharing_the_beginning_of_a_long_one_is_served_from_its_blocks(
        tiny: Any) -> None:
    """Two conversations with one system prompt: the second shares only the first's beginning,
    blocks the sliding layers had long dropped when the first prompt ended."""
    window = tiny[3]
    system = tokens(tiny, 3 * window)
    e = engine(tiny, 4)
    serve(e, "one", system + tokens(tiny, 5 * window, offset=40))
    early = e.blocks[e.prompt_hashes(system)[-1]]
    assert covered([e.blocks[h] for h in e.prompt_hashes(system)], e.kinds, e.windows)
    other = system + tokens(tiny, 6, offset=60)
    got, cached = serve(e, "two", other, ram_hit(e, other))
    assert got == reference(tiny, other)
    assert cached >= len(system) // 4 * 4 and early.tokens is not None


def test_blocks_through_files_serve_a_restarted_engine(tiny: Any, tmp_path: Path) -> None:
    """Blocks go through the SSD writer's files (block_store) with the layers they hold and
    come back as the scheduler reads them, into a fresh engine on a freshly loaded model."""
    model_dir, _, _, window = tiny
    fingerprint = model_fingerprint(model_dir)
    prompt = tokens(tiny, 3 * window + 1)
    want = reference(tiny, prompt)
    first = engine(tiny, 4)
    assert serve(first, "cold", prompt)[0] == want
    for _, blk in first.take_new_blocks():
        if not blk.tail:
            data = to_numpy(blk, first.layout)
            assert block_store.decode_block(block_store.encode_block(data, fingerprint),
                                            fingerprint, blk.block_hash).layout == first.layout
            block_store.write_atomic(block_store.block_path(tmp_path, blk.block_hash),
                                     block_store.encode_block(data, fingerprint),
                                     block_store.fingerprint_tag(fingerprint))
    model, tok = load(str(model_dir))
    restarted = Engine(model, tok, engine_config(block_size=4), fingerprint=fingerprint)
    hit = []
    for h in restarted.prompt_hashes(prompt):
        data = block_store.decode_block(block_store.block_path(tmp_path, h).read_bytes(),
                                        fingerprint, h)
        hit.append(from_numpy(data, restarted.kinds, restarted.state_sizes, restarted.layout))
    got, cached = serve(restarted, "warm", prompt, hit)
    assert got == want and cached == usable_blocks(len(prompt), 4) * 4


def test_a_block_of_another_layout_is_never_read_as_this_one(tiny: Any) -> None:
    e = engine(tiny, 4)
    serve(e, "a", tokens(tiny, 20))
    blk = e.blocks[e.prompt_hashes(tokens(tiny, 20))[0]]
    data = to_numpy(blk, e.layout)
    other = e.layout.replace(f"{WINDOW}{tiny[3]}", f"{WINDOW}{tiny[3] * 2}")
    for layout in (other, ""):  # another window; a block from before layouts were written
        stale = BlockData(block_hash=data.block_hash, parent_hash=data.parent_hash,
                          n_tokens=data.n_tokens, tensors=data.tensors, dtypes=data.dtypes,
                          layout=layout)
        with pytest.raises(ValueError, match="layers"):
            from_numpy(stale, e.kinds, e.state_sizes, e.layout)


async def test_a_sliding_window_model_is_served_from_ram_and_from_disk_after_a_restart(
        aiohttp_client: Any, tmp_path: Path) -> None:
    """Through the serving stack (scheduler, SSD writer, cache index, files): gemma3_text's
    repeated prompt hits RAM, and after a restart its blocks come back from disk, with the
    answer unchanged."""
    from test_prefix_serving import complete, report, serve, wait_persisted

    model_dir = make_tiny_model(tmp_path / "gemma3", arch="gemma3_text", layers=4)
    cache_dir = tmp_path / "c"
    prompt = ("The quick brown fox jumps over the lazy dog. " * 8
              + "What is the capital of France? The capital of France is Paris. " * 3)
    client, system, model = await serve(aiohttp_client, model_dir, cache_dir)
    cold_text, cold = await complete(client, model, prompt)
    warm_text, warm = await complete(client, model, prompt)
    assert cold["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["prompt_tokens_details"]["cached_tokens"] == cold["prompt_tokens"] - 1
    assert warm_text == cold_text
    total = cold["prompt_tokens"] + cold["completion_tokens"]
    await wait_persisted(system, total // 16)
    await system.__aexit__(None, None, None)

    client, system, model = await serve(aiohttp_client, model_dir, cache_dir)
    disk_text, disk = await complete(client, model, prompt)
    assert disk["prompt_tokens_details"]["cached_tokens"] == (
        (cold["prompt_tokens"] - 1) // 16 * 16)
    assert disk_text == cold_text
    assert report(system, "scheduler")["disk_loads"] == 1
    await system.__aexit__(None, None, None)
