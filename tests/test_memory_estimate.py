"""Unit tests of the memory arithmetic (no model, no MLX): shapes, estimates, gate, pressure."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from troupe.actors.engine.memory_estimate import (
    HARD,
    KV_STEP,
    NATIVE_SCORE_FACTOR,
    OK,
    SCORE_FACTOR,
    SOFT,
    Member,
    ModelMemory,
    admission_estimate,
    default_memory_limit,
    embed_need,
    embed_step_need,
    idle_floor,
    model_memory,
    model_memory_of,
    parameter_count,
    plan_step,
    prefill_transient,
    pressure_level,
    prompt_need,
    score_factor,
    step_need,
    too_large,
)

LLAMA = {
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "hidden_size": 576, "intermediate_size": 1536, "head_dim": 64,
}
MB = 1e6


def test_kv_per_token_counts_kv_heads_not_query_heads_under_gqa():
    m = model_memory(LLAMA, dtype_bytes=4)
    # 2 (keys and values) x 30 layers x 3 KV heads x 64 x 4 bytes: the default model's KV.
    assert m.kv_per_token == 2 * 30 * 3 * 64 * 4 == 46080
    assert m.q_heads == 9
    mha = model_memory({**LLAMA, "num_key_value_heads": 9}, dtype_bytes=4)
    assert mha.kv_per_token == 3 * m.kv_per_token


def test_fields_nested_under_text_config_are_read():
    config = {"model_type": "llava", "vision_config": {"num_hidden_layers": 99},
              "text_config": {**LLAMA, "torch_dtype": "bfloat16"}}
    m = model_memory(config)
    assert (m.kv_layers, m.kv_heads, m.head_dim, m.q_heads) == (30, 3, 64, 9)
    assert m.dtype_bytes == 2


def test_head_dim_defaults_to_hidden_over_heads_and_kv_heads_to_heads():
    m = model_memory({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64})
    assert (m.head_dim, m.kv_heads) == (16, 4)


@pytest.mark.parametrize(("torch_dtype", "expected"),
                         [("float32", 4), ("float16", 2), ("bfloat16", 2), (None, 2)])
def test_kv_dtype_comes_from_the_config_when_the_weights_do_not_say(torch_dtype, expected):
    config = {**LLAMA, "torch_dtype": torch_dtype} if torch_dtype else LLAMA
    assert model_memory(config).dtype_bytes == expected
    assert model_memory(config, dtype_bytes=4).dtype_bytes == 4  # the weights win


def test_hybrid_models_count_only_their_attention_layers():
    lfm2 = {**LLAMA, "num_hidden_layers": 16, "full_attn_idxs": [2, 5, 8, 10, 12, 14]}
    assert model_memory(lfm2).kv_layers == 6
    typed = {**LLAMA, "num_hidden_layers": 4, "layer_types": [
        "linear_attention", "full_attention", "linear_attention", "full_attention"]}
    assert model_memory(typed).kv_layers == 2
    interval = {**LLAMA, "num_hidden_layers": 48, "full_attention_interval": 4}
    assert model_memory(interval).kv_layers == 12


def test_weights_dtype_is_read_from_safetensors_headers_quantized_included(tmp_path: Path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**LLAMA, "torch_dtype": "float32"}))
    # A quantized layer: uint32 packed weights, float16 scales and biases.
    save_file({"w": np.zeros((64, 8), np.uint32), "scales": np.zeros((64, 2), np.float16),
               "biases": np.zeros((64, 2), np.float16)}, str(d / "model.safetensors"))
    m = model_memory_of(d)
    assert m.dtype_bytes == 2  # the scales' dtype, not the config's float32
    assert m.weights_bytes == (d / "model.safetensors").stat().st_size


def test_transient_matches_what_mlx_measured_on_the_default_model():
    # MLX's peak counter on CPU (float32 SmolLM2-135M, one sequence, 512-token chunks):
    # chunk over 512, 1536 and 2560 tokens of context took 33.4, 53.6 and 74.6 MB beyond the KV.
    m = model_memory(LLAMA, dtype_bytes=4)
    for context, measured in ((512, 33.4), (1536, 53.6), (2560, 74.6)):
        estimate = prefill_transient(m, chunk=512, context=context, factor=SCORE_FACTOR) / MB
        assert measured <= estimate <= 1.25 * measured, (context, estimate)
    # Four sequences at once: measured 129.5 MB for a 512-token chunk over 512 tokens.
    four = prefill_transient(m, chunk=512, context=512, batch=4, factor=SCORE_FACTOR) / MB
    assert 129.5 <= four <= 1.25 * 129.5


def test_transient_with_troupes_cpu_attention_matches_what_mlx_measured():
    # The same measurement with actors/engine/cpu_kernels.py's attention: 47.5, 103.1 and 161.4 MB,
    # and 182.6 MB for four sequences.
    m = model_memory(LLAMA, dtype_bytes=4)
    for context, batch, measured in ((512, 1, 47.5), (1536, 1, 103.1), (2560, 1, 161.4),
                                     (512, 4, 182.6)):
        estimate = prefill_transient(m, chunk=512, context=context, batch=batch,
                                     factor=NATIVE_SCORE_FACTOR) / MB
        assert measured <= estimate <= 1.25 * measured, (context, batch, estimate)


def test_the_factor_follows_the_attention_in_use():
    from troupe.actors.engine import cpu_kernels

    was = cpu_kernels.enabled()
    try:
        cpu_kernels.disable()
        assert score_factor() == SCORE_FACTOR
        cpu_kernels.enable("native")
        assert score_factor() == NATIVE_SCORE_FACTOR
    finally:
        if not was:
            cpu_kernels.disable()


def test_prompt_need_grows_with_the_prompt_and_the_chunk_not_with_anything_else():
    m = model_memory(LLAMA, dtype_bytes=4)
    short = prompt_need(m, prompt_tokens=100, step=512)
    long = prompt_need(m, prompt_tokens=4000, step=512)
    assert long > 10 * short
    assert prompt_need(m, prompt_tokens=4000, step=256) < long  # smaller chunks, less transient
    # KV is allocated 256 slots at a time.
    assert prompt_need(m, prompt_tokens=1, step=512) >= KV_STEP * m.kv_per_token


def test_cached_tokens_save_the_transient_but_not_the_kv():
    m = model_memory(LLAMA, dtype_bytes=4)
    full = prompt_need(m, prompt_tokens=3000, step=512)
    cached = prompt_need(m, prompt_tokens=3000, step=512, cached_tokens=2900)
    assert cached < full
    # The engine copies cached blocks into the request's cache: their KV still counts.
    assert cached > 3000 * m.kv_per_token


def test_the_prefix_cache_adds_a_copy_of_the_prompts_blocks():
    m = model_memory(LLAMA, dtype_bytes=4)
    plain = prompt_need(m, prompt_tokens=2049, step=512)
    caching = prompt_need(m, prompt_tokens=2049, step=512, block_size=256)
    assert caching - plain >= 2048 * m.kv_per_token


def test_admission_estimate_adds_the_high_water_and_weights_of_a_model_not_loaded():
    m = model_memory(LLAMA, dtype_bytes=4, weights_bytes=500_000_000)
    need = prompt_need(m, prompt_tokens=1000, step=512)
    assert admission_estimate(m, high_water=7, prompt_tokens=1000, step=512) == 7 + need
    assert admission_estimate(m, high_water=7, prompt_tokens=1000, step=512,
                              loaded=False) == 7 + need + 500_000_000


def test_an_embedding_steps_need_counts_its_rows_cache_and_chunk():
    m = model_memory(LLAMA, dtype_bytes=2)
    bare = embed_step_need(m, rows=4, tokens=100, context=100)
    assert bare == prefill_transient(m, chunk=100, context=100, batch=4)
    # A cache of 612 tokens a row (a 512-token shared prefix copied into each of 4 rows).
    cached = embed_step_need(m, rows=4, tokens=100, context=612, kv=612)
    assert cached - prefill_transient(m, chunk=100, context=612, batch=4) \
        == 4 * 768 * m.kv_per_token


def test_an_embedding_jobs_need_is_its_worst_step():
    m = model_memory(LLAMA, dtype_bytes=2)
    # An input over the step: its last chunk over its whole cache.
    assert embed_need(m, longest=3000, step=512) == embed_step_need(
        m, rows=1, tokens=512, context=3000, kv=3000)
    # Short inputs: as many as the step holds, padded to the longest, no cache.
    assert embed_need(m, longest=100, step=512) == embed_step_need(
        m, rows=5, tokens=100, context=100)
    # A rerank query shared by its documents: each row a copy of it, the step counting the
    # documents' own tokens only.
    assert embed_need(m, longest=400, step=512, shared=300) == embed_step_need(
        m, rows=5, tokens=100, context=400, kv=400)
    assert embed_need(m, longest=400, step=512, shared=300) > embed_need(m, longest=400,
                                                                         step=512)
    # An encoder runs an input whole, however long.
    assert embed_need(m, longest=2000, step=512, whole=True) == embed_step_need(
        m, rows=1, tokens=2000, context=2000)


def test_pressure_levels_against_the_limit():
    assert pressure_level(0, 1000) == OK
    assert pressure_level(849, 1000) == OK
    assert pressure_level(850, 1000) == SOFT
    assert pressure_level(949, 1000) == SOFT
    assert pressure_level(950, 1000) == HARD
    assert pressure_level(5000, 1000) == HARD
    assert pressure_level(0, 0) == HARD  # no memory at all


def test_pressure_leaves_a_level_only_well_below_its_threshold():
    assert pressure_level(940, 1000, previous=HARD) == HARD
    assert pressure_level(919, 1000, previous=HARD) == SOFT
    assert pressure_level(830, 1000, previous=SOFT) == SOFT
    assert pressure_level(819, 1000, previous=SOFT) == OK
    assert pressure_level(830, 1000, previous=OK) == OK


def test_default_limit_is_a_fraction_of_available_ram_or_of_the_metal_working_set():
    gib = 1 << 30
    assert default_memory_limit(total=24 * gib, available=20 * gib) == int(0.75 * 20 * gib)
    assert default_memory_limit(total=24 * gib) == int(0.75 * 24 * gib)
    assert default_memory_limit(total=64 * gib, available=60 * gib,
                                working_set=48 * gib) == int(0.9 * 48 * gib)


# --- the gate -------------------------------------------------------------------------------

TINY = ModelMemory(kv_layers=2, kv_heads=2, head_dim=16, q_heads=4, hidden=64,
                   intermediate=128, dtype_bytes=4, weights_bytes=300_000)


def long(in_cache: int = 0, remaining: int = 1500, chunk: int = 512) -> Member:
    return Member(in_cache=in_cache, remaining=remaining, chunk=chunk)


def test_gate_fails_the_youngest_prefilling_sequence_that_no_longer_fits():
    prefilling = [long(512, 988), long(0, 1500)]
    one = step_need(TINY, decoding=0, decode_len=0, members=prefilling[:1])
    both = step_need(TINY, decoding=0, decode_len=0, members=prefilling)
    plan = plan_step(TINY, usage=0, limit=(one + both) // 2, decoding=0, decode_len=0,
                     prefilling=prefilling, waiting=[], step=512)
    assert plan.fail == [1]
    plan = plan_step(TINY, usage=0, limit=one - 1, decoding=0, decode_len=0,
                     prefilling=prefilling, waiting=[], step=512)
    assert plan.fail == [1, 0]
    plan = plan_step(TINY, usage=0, limit=both, decoding=0, decode_len=0,
                     prefilling=prefilling, waiting=[], step=512)
    assert plan.fail == []


def test_gate_admits_waiting_sequences_in_order_while_their_whole_prefill_fits():
    waiting = [long(), long(), long()]
    need_one = plan_step(TINY, usage=0, limit=10**12, decoding=0, decode_len=0, prefilling=[],
                         waiting=waiting[:1], step=512).reserve_need
    plan = plan_step(TINY, usage=0, limit=int(need_one * 1.5), decoding=0, decode_len=0,
                     prefilling=[], waiting=waiting, step=512)
    assert (plan.admit, plan.reject_waiting) == (1, False)
    assert plan.reserve_need <= int(need_one * 1.5)
    plan = plan_step(TINY, usage=0, limit=10**12, decoding=0, decode_len=0, prefilling=[],
                     waiting=waiting, step=512)
    assert plan.admit == 3


def test_gate_holds_a_waiting_sequence_while_others_run_and_rejects_it_when_idle():
    waiting = [long()]
    need = plan_step(TINY, usage=0, limit=10**12, decoding=0, decode_len=0, prefilling=[],
                     waiting=waiting, step=512).reserve_need
    busy = plan_step(TINY, usage=0, limit=need - 1, decoding=3, decode_len=100, prefilling=[],
                     waiting=waiting, step=512)
    assert (busy.admit, busy.reject_waiting) == (0, False)  # the decoders will free memory
    idle = plan_step(TINY, usage=0, limit=need - 1, decoding=0, decode_len=0, prefilling=[],
                     waiting=waiting, step=512)
    assert (idle.admit, idle.reject_waiting) == (0, True)  # waiting would never help


def test_joining_a_long_sequence_pads_every_decoding_sequence_to_its_length():
    # The generation batch's cache is rectangular: 8 decoders of 100 tokens and a newcomer
    # of 1500 make 9 x 1536 slots, not 8 x 256 + 1536.
    joining = [Member(in_cache=1499, remaining=1, chunk=1)]
    need = step_need(TINY, decoding=8, decode_len=100, members=joining)
    assert need >= (9 * 1536 - 8 * 256 - 1536) * TINY.kv_per_token


def test_memory_and_pool_flags_fill_serve_config():
    from troupe.api.cli import build_parser, serve_config

    config = serve_config(build_parser().parse_args([
        "serve", "--model", "a", "--model", "b", "--memory-limit", "800MB",
        "--memory-poll", "100", "--no-prefill-guard", "--models-memory", "2GiB",
        "--pin", "a", "--pin", "b", "--idle-ttl", "60",
    ]))
    assert config.model == ["a", "b"]
    assert (config.memory_limit, config.memory_poll_ms, config.prefill_guard) == (
        800_000_000, 100, False)
    assert (config.models_memory, config.pin, config.idle_ttl) == (2 << 30, ["a", "b"], 60.0)
    one = serve_config(build_parser().parse_args(["serve", "--model", "a"]))
    assert one.model == "a"  # one --model is the one-model server it always was
    default = serve_config(build_parser().parse_args(["serve"]))
    assert (default.model, default.memory_limit, default.prefill_guard) == (None, None, True)


def test_the_idle_floor_is_at_least_the_weights_and_counts_them_again_until_loaded():
    m = model_memory(LLAMA, dtype_bytes=4, weights_bytes=500)
    assert idle_floor(m, 800) == 800
    assert idle_floor(m, 100) == 500  # the floor was read before the weights were
    assert idle_floor(m, 800, loaded=False) == 1300


def test_a_prompt_is_too_large_only_when_it_cannot_fit_beside_the_idle_floor():
    assert not too_large(600, limit=1000, idle=400)
    assert too_large(601, limit=1000, idle=400)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_model_counts_the_parameters_of_its_float_weights(
        tmp_path: Path, bits: int) -> None:
    """Packed words count 32 / bits parameters each, scales and biases none: the same count
    as the float model's, which is the sum of its tensors' elements."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from tiny_model import make_tiny_model

    plain = make_tiny_model(tmp_path / "plain", hidden=128)
    model, _ = load(str(plain))
    elements = sum(v.size for _, v in tree_flatten(model.parameters()))
    quantized = make_tiny_model(tmp_path / f"q{bits}", hidden=128, bits=bits)
    packed = load(str(quantized))[0]
    assert any(v.dtype == mx.uint32 for _, v in tree_flatten(packed.parameters()))
    assert parameter_count(plain) == elements
    assert parameter_count(quantized) == elements
    assert parameter_count(tmp_path) is None  # no weights at all
