"""The step policy (actors/engine/schedule.py) as a pure function: numbers in, a plan out.

No model and no MLX: each rule is checked on hand-made states, and the module must load
without MLX at all.
"""

from __future__ import annotations

import subprocess
import sys

from actors.engine.config import EngineConfig
from actors.engine.memory_estimate import Member, ModelMemory, plan_step
from actors.engine.schedule import (
    MIN_MIXED_CHUNK,
    MIN_PREFILL_CHUNK,
    SHORT_PROMPT,
    Memory,
    Pending,
    StepState,
    schedule,
)

CONFIG = EngineConfig(prefill_step_size=512, prefill_batch_size=4, prefill_interleave=1.0,
                      max_batch_size=8)
TINY = ModelMemory(kv_layers=2, kv_heads=2, head_dim=16, q_heads=4, hidden=64,
                   intermediate=128, dtype_bytes=4, weights_bytes=300_000)


def seq(uid: int, remaining: int, *, whole: int | None = None, in_cache: int = 0) -> Pending:
    chunk = min(remaining, CONFIG.prefill_step_size)
    member = Member(in_cache=in_cache, remaining=remaining, chunk=chunk)
    return Pending(uid, member, remaining if whole is None else whole)


def state(**kw) -> StepState:
    base = dict(config=CONFIG, mixed=True, decoding=0, decode_len=0, prefilling=[], waiting=[],
                decode_s=None, token_s=None, memory=None)
    return StepState(**{**base, **kw})


def test_with_nothing_decoding_prefill_runs_whole_chunks():
    plan = schedule(state(waiting=[seq(1, 2000)], decode_s=0.1, token_s=0.001))
    assert (plan.budget, plan.chunk, plan.admit) == (None, 512, 4)
    assert (plan.fail, plan.reject, plan.held) == ([], None, False)


def test_while_decoding_the_prefill_is_held_to_the_interleave_times_a_decode_step():
    # A decode step of 100 ms and a prompt token of 1 ms: 100 tokens a step with interleave 1.
    plan = schedule(state(decoding=3, decode_len=50, prefilling=[seq(1, 2000)],
                          decode_s=0.1, token_s=0.001))
    assert (plan.budget, plan.chunk) == (100, 100)
    double = EngineConfig(prefill_step_size=512, prefill_interleave=2.0)
    assert schedule(state(config=double, decoding=3, prefilling=[seq(1, 2000)],
                          decode_s=0.1, token_s=0.001)).budget == 200


def test_the_budget_waits_for_measurements_and_is_off_with_interleave_zero():
    decoding = dict(decoding=3, prefilling=[seq(1, 2000)])
    assert schedule(state(**decoding, decode_s=None, token_s=0.001)).budget is None
    assert schedule(state(**decoding, decode_s=0.1, token_s=None)).budget is None
    off = EngineConfig(prefill_step_size=512, prefill_interleave=0.0)
    plan = schedule(state(config=off, **decoding, decode_s=0.1, token_s=0.001))
    assert (plan.budget, plan.chunk) == (None, 512)


def test_the_budget_never_falls_below_the_floor_nor_passes_the_chunk_size():
    slow = dict(decoding=2, prefilling=[seq(1, 2000)], decode_s=0.01, token_s=0.01)
    assert schedule(state(**slow)).budget == MIN_MIXED_CHUNK
    assert schedule(state(**slow, mixed=False)).budget == MIN_PREFILL_CHUNK
    fast = dict(decoding=2, prefilling=[seq(1, 2000)], decode_s=10.0, token_s=0.001)
    assert schedule(state(**fast)).budget == CONFIG.prefill_step_size


def test_the_budget_is_shared_by_the_sequences_prefilling_and_those_joining():
    timings = dict(decoding=2, decode_s=0.2, token_s=0.001)  # a budget of 200 tokens
    plan = schedule(state(**timings, prefilling=[seq(1, 5000)], waiting=[seq(2, 5000)]))
    assert (plan.budget, plan.chunk) == (200, 100)
    # No batch slot left: the waiting one does not join, so it takes no share.
    full = EngineConfig(prefill_step_size=512, prefill_interleave=1.0, max_batch_size=2)
    plan = schedule(state(config=full, **timings, prefilling=[seq(1, 5000)],
                          waiting=[seq(2, 5000)]))
    assert plan.chunk == 200


def test_a_short_prompt_is_never_split_but_the_end_of_a_long_one_is_not_short():
    timings = dict(decoding=2, decode_s=0.05, token_s=0.001)  # a budget of 50 tokens
    chat = seq(2, 150)  # within SHORT_PROMPT budgets
    assert chat.whole <= SHORT_PROMPT * 50
    plan = schedule(state(**timings, prefilling=[seq(1, 5000)], waiting=[chat]))
    assert plan.chunk == 150
    tail = seq(3, 150, whole=5000, in_cache=4850)
    assert schedule(state(**timings, prefilling=[seq(1, 5000), tail])).chunk == 25


def test_the_memory_gate_fails_and_admits_as_plan_step_says_by_uid():
    prefilling = [seq(7, 988, in_cache=512), seq(9, 1500)]
    members = [p.member for p in prefilling]
    free = plan_step(TINY, usage=0, limit=10**12, decoding=0, decode_len=0,
                     prefilling=members[:1], waiting=[], step=512)
    limit = free.step_need + 1
    plan = schedule(state(prefilling=prefilling, waiting=[seq(11, 100)],
                          memory=Memory(TINY, 0, limit)))
    assert plan.fail == [9]  # the youngest goes first
    assert plan.held and plan.admit == 0 and plan.reject is None


def test_a_waiting_sequence_that_cannot_fit_alone_is_rejected_only_when_idle():
    huge = seq(5, 100_000)
    tight = Memory(TINY, 0, 1_000_000)
    idle = schedule(state(waiting=[huge], memory=tight))
    assert (idle.reject, idle.admit, idle.held) == (5, 0, True)
    busy = schedule(state(decoding=3, decode_len=100, waiting=[huge], memory=tight))
    assert (busy.reject, busy.admit, busy.held) == (None, 0, True)


def test_without_a_gate_every_free_prefill_slot_may_fill():
    plan = schedule(state(prefilling=[seq(1, 100)], waiting=[seq(i, 10) for i in range(2, 9)]))
    assert plan.admit == CONFIG.prefill_batch_size - 1
    assert not plan.held


def test_the_schedule_loads_without_mlx():
    code = ("import sys, actors.engine.schedule; "
            "assert not [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')]")
    subprocess.run([sys.executable, "-c", code], check=True)
