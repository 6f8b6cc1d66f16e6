"""Engine level: the per-chunk memory gate on tiny models (plain KV and hybrid)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from engine_helpers import engine_config
from mlx_lm import load

from troupe.actors.engine import schedule
from troupe.actors.engine.core import Engine
from troupe.actors.engine.memory_estimate import model_memory, model_memory_of, prompt_need
from troupe.actors.messages import RequestFinished, SamplingParams, TokensGenerated
from troupe.actors.scheduler import weights_profile

SENTENCE = "The quick brown fox jumps over the lazy dog. "


def make_engine(model_dir: Path, fingerprint: str = "", **settings) -> Engine:
    model, tok, config = load(str(model_dir), return_config=True)
    weights, dtype_bytes = weights_profile(model)
    memory = model_memory(config, dtype_bytes=dtype_bytes, weights_bytes=weights)
    return Engine(model, tok, engine_config(**settings), fingerprint=fingerprint, memory=memory)


def run(engine: Engine, prompts: dict[str, list[int]], limit: int | None,
        max_tokens: int = 6) -> tuple[dict[str, list[int]], dict[str, RequestFinished], int]:
    """Every request to its end; (tokens, finish events, most sequences prefilling at once)."""
    for rid, prompt in prompts.items():
        engine.add(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                               ignore_eos=True))
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    finished: dict[str, RequestFinished] = {}
    most = 0
    for _ in range(10_000):
        if not engine.has_work:
            break
        for ev in engine.step(limit=limit):
            if isinstance(ev, TokensGenerated):
                tokens[ev.request_id] += ev.token_ids
            elif isinstance(ev, RequestFinished):
                finished[ev.request_id] = ev
        most = max(most, engine.runner.prefilling)
    assert not engine.has_work
    return tokens, finished, most


@pytest.mark.parametrize("which", ["tiny_model_dir", "tiny_hybrid_dir"])
def test_gate_with_room_to_spare_changes_no_token(which, request):
    model_dir = request.getfixturevalue(which)
    engine = make_engine(model_dir, prefill_step_size=64, block_size=16,
                         fingerprint="f")
    tok = engine.tokenizer
    prompts = {f"r{i}": tok.encode(SENTENCE * (3 + 4 * i)) for i in range(4)}
    free, _, _ = run(engine, prompts, limit=None)
    engine = make_engine(model_dir, prefill_step_size=64, block_size=16, fingerprint="f")
    gated, finished, _ = run(engine, prompts, limit=1 << 40)
    assert gated == free
    assert all(f.finish_reason == "length" for f in finished.values())


def test_tight_limit_prefills_one_prompt_at_a_time_and_all_complete(tiny_model_dir,
                                                                   monkeypatch):
    # Long prompts are prefilled one after the other anyway (schedule.startable); here every
    # prompt counts as short, so that only the gate can hold them to one at a time.
    monkeypatch.setattr(schedule, "LONG_PROMPT", 1 << 30)
    engine = make_engine(tiny_model_dir, prefill_step_size=512)
    tok = engine.tokenizer
    prompts = {f"r{i}": tok.encode(SENTENCE * 160)[: 1400 + 10 * i] for i in range(6)}
    mx.clear_cache()
    usage = mx.get_active_memory()
    # Room for one 1.4k-token prompt, not two (~18 MB each with MLX's attention, ~40 MB with
    # troupe's CPU kernels: the estimate of the attention in use).
    one = prompt_need(model_memory_of(tiny_model_dir), prompt_tokens=1450, step=512)
    limit = usage + int(1.4 * one)
    mx.reset_peak_memory()
    _, finished, most = run(engine, prompts, limit=limit)
    assert most == 1
    assert all(f.finish_reason == "length" for f in finished.values()), finished
    assert mx.get_peak_memory() <= limit
    free_engine = make_engine(tiny_model_dir, prefill_step_size=512)
    _, _, most_free = run(free_engine, prompts, limit=None)
    assert most_free > 1  # without the gate they prefill together


def test_a_prompt_that_cannot_fit_an_idle_engine_fails_with_413_and_frees_its_slot(
    tiny_model_dir,
):
    engine = make_engine(tiny_model_dir, prefill_step_size=512)
    tok = engine.tokenizer
    mx.clear_cache()
    limit = mx.get_active_memory() + 5_000_000
    prompts = {"long": tok.encode(SENTENCE * 160)[:1500], "short": tok.encode("Paris")}
    tokens, finished, _ = run(engine, prompts, limit=limit)
    assert finished["long"].finish_reason == "error"
    assert finished["long"].error_kind == "too_large"
    assert "out of memory" in finished["long"].error
    assert finished["short"].finish_reason == "length" and len(tokens["short"]) == 6
    assert engine.gate_failures == 1
