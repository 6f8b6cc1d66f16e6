"""The step policy (actors/engine/schedule.py) as a pure function: numbers in, a plan out.

No model and no MLX: each rule is checked on hand-made states, and the module must load
without MLX at all.
"""

from __future__ import annotations

import math
import subprocess
import sys

from troupe.actors.engine import schedule as schedule_module
from troupe.actors.engine.config import EngineConfig
from troupe.actors.engine.memory_estimate import ADMIT_HEADROOM, Member, ModelMemory, plan_step
from troupe.actors.engine.schedule import (
    LONG_PROMPT,
    MIN_PREFILL_CHUNK,
    SHORT_PROMPT,
    STARVED_STEPS,
    STEP_BUDGET_FLOOR,
    Memory,
    Pending,
    StepState,
    Waiting,
    embed_budget,
    schedule,
    start_order,
    step_budget,
)

# The interleave rules alone (the step budget has tests of its own below).
CONFIG = EngineConfig(prefill_step_size=512, prefill_batch_size=4, prefill_interleave=1.0,
                      max_batch_size=8, step_budget_ms=0.0)
TINY = ModelMemory(kv_layers=2, kv_heads=2, head_dim=16, q_heads=4, hidden=64,
                   intermediate=128, dtype_bytes=4, weights_bytes=300_000)


def seq(uid: int, remaining: int, *, whole: int | None = None, in_cache: int = 0,
        waited: int = 0) -> Pending:
    chunk = min(remaining, CONFIG.prefill_step_size)
    member = Member(in_cache=in_cache, remaining=remaining, chunk=chunk)
    # The prompt's segments as the batch holds them: its last token is one of its own.
    segments = (remaining - 1, 1) if remaining > 1 else (1,)
    return Pending(uid, member, remaining if whole is None else whole, segments, waited)


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
    double = EngineConfig(prefill_step_size=512, prefill_interleave=2.0, step_budget_ms=0.0)
    assert schedule(state(config=double, decoding=3, prefilling=[seq(1, 2000)],
                          decode_s=0.1, token_s=0.001)).budget == 200


def test_as_many_sequences_waiting_for_a_first_token_as_streams_get_whole_chunks():
    timings = dict(decode_s=0.1, token_s=0.001)  # a budget of 100 tokens
    # Answers decoding while as many agents' turns wait, or more: the turns go at full speed.
    for decoding in (1, 2):
        plan = schedule(state(**timings, decoding=decoding, prefilling=[seq(1, 600)],
                              waiting=[seq(2, 500)]))
        assert (plan.budget, plan.chunk) == (None, 512)
    assert schedule(state(**timings, decoding=1, prefilling=[seq(1, 2000)])).budget is None
    # More streams than prompts: the streams keep their share.
    plan = schedule(state(**timings, decoding=3, prefilling=[seq(1, 600)],
                          waiting=[seq(2, 500)]))
    assert (plan.budget, plan.chunk) == (100, 100)  # the second waits its turn
    assert schedule(state(**timings, decoding=8, prefilling=[seq(1, 2000)])).budget == 100


def test_drafts_are_verified_unless_first_tokens_go_first():
    """Decoding rows verify drafts except while as many sequences wait for their first token
    as there are streams, or more: the step's time then goes to the prompts."""
    timings = dict(decode_s=0.1, token_s=0.001)
    assert schedule(state(**timings, decoding=3)).draft
    # Fewer prompts than streams: the streams keep their share, drafts included.
    assert schedule(state(**timings, decoding=3, prefilling=[seq(1, 600)],
                          waiting=[seq(2, 500)])).draft
    for decoding in (1, 2):
        assert not schedule(state(**timings, decoding=decoding, prefilling=[seq(1, 600)],
                                  waiting=[seq(2, 500)])).draft
    # A full batch only decodes: nothing can start, so its rows draft (finishing sooner is
    # what frees a place).
    full = [seq(i, 100) for i in range(1, 5)]
    assert schedule(state(**timings, decoding=CONFIG.max_batch_size, waiting=full)).draft
    assert not schedule(state(**timings, decoding=CONFIG.max_batch_size - 1,
                              waiting=[*full, *full])).draft
    # The memory gate holds the one prompt back: the step runs no prompt token, so its
    # row drafts (the decision follows the step's plan, not the queues before the gate).
    held = schedule(state(**timings, decoding=1, decode_len=100, waiting=[seq(5, 100_000)],
                          memory=Memory(TINY, 0, 1_000_000)))
    assert held.admit == 0 and held.start == [] and held.draft


def test_the_budget_waits_for_measurements_and_is_off_with_interleave_zero():
    decoding = dict(decoding=3, prefilling=[seq(1, 2000)])
    assert schedule(state(**decoding, decode_s=None, token_s=0.001)).budget is None
    assert schedule(state(**decoding, decode_s=0.1, token_s=None)).budget is None
    off = EngineConfig(prefill_step_size=512, prefill_interleave=0.0, step_budget_ms=0.0)
    plan = schedule(state(config=off, **decoding, decode_s=0.1, token_s=0.001))
    assert (plan.budget, plan.chunk) == (None, 512)


def test_the_budget_never_falls_below_the_floor_nor_passes_the_chunk_size():
    slow = dict(decoding=2, prefilling=[seq(1, 2000)], decode_s=0.01, token_s=0.01)
    assert schedule(state(**slow)).budget == MIN_PREFILL_CHUNK
    assert schedule(state(**slow, mixed=False)).budget == MIN_PREFILL_CHUNK
    fast = dict(decoding=2, prefilling=[seq(1, 2000)], decode_s=10.0, token_s=0.001)
    assert schedule(state(**fast)).budget == CONFIG.prefill_step_size


def test_the_budget_is_shared_by_the_sequences_prefilling_and_those_joining():
    # Three streams, more than the prompts: a budget of 200 tokens.
    timings = dict(decoding=3, decode_s=0.2, token_s=0.001)
    plan = schedule(state(**timings, prefilling=[seq(1, 5000)], waiting=[seq(2, 2000)]))
    assert (plan.budget, plan.chunk) == (200, 100)
    # No batch slot left: the waiting one does not join, so it takes no share.
    full = EngineConfig(prefill_step_size=512, prefill_interleave=1.0, max_batch_size=3,
                        step_budget_ms=0.0)
    plan = schedule(state(config=full, **timings, prefilling=[seq(1, 5000)],
                          waiting=[seq(2, 2000)]))
    assert plan.chunk == 200
    # Nor does one that waits its turn (a long prompt with little more to go prefills).
    plan = schedule(state(**timings, prefilling=[seq(1, 5000)], waiting=[seq(2, 4000)]))
    assert (plan.admit, plan.chunk) == (0, 200)


def test_a_short_prompt_is_never_split_but_the_end_of_a_long_one_is_not_short():
    timings = dict(decoding=3, decode_s=0.1, token_s=0.001)  # a budget of 100 tokens
    chat = seq(2, 150)  # within SHORT_PROMPT budgets
    assert chat.whole <= SHORT_PROMPT * 100
    plan = schedule(state(**timings, prefilling=[seq(1, 5000)], waiting=[chat]))
    assert plan.chunk == 150
    tail = seq(3, 150, whole=5000, in_cache=4850)
    assert schedule(state(**timings, prefilling=[seq(1, 5000), tail])).chunk == 50


# The step budget beside the default interleave rules, 64-token blocks.
BUDGET = EngineConfig(prefill_step_size=512, prefill_batch_size=4, max_batch_size=8,
                      block_size=64, step_budget_ms=200.0)


def test_the_step_budget_sizes_the_chunk_so_the_step_fits_it():
    # One chat answering beside a long prompt (whole chunks by first_tokens_first alone):
    # 200 ms less a 40 ms decode step at 1 ms a prompt token is 160 tokens, two blocks.
    timings = dict(decoding=1, prefilling=[seq(1, 6000)], decode_s=0.04, token_s=0.001)
    plan = schedule(state(config=BUDGET, **timings))
    assert (plan.budget, plan.chunk) == (128, 128)
    assert plan.chunk * 0.001 + 0.04 <= 0.2
    unblocked = EngineConfig(prefill_step_size=512, block_size=0, step_budget_ms=200.0)
    assert schedule(state(config=unblocked, **timings)).chunk == 160
    # Streams outnumbering the prompts: the interleave's budget is tighter, and it holds.
    plan = schedule(state(config=BUDGET, **{**timings, "decoding": 4}))
    assert plan.budget == int(BUDGET.prefill_interleave * 0.04 / 0.001)


def test_the_step_budget_never_falls_below_its_floor_nor_passes_the_chunk_size():
    slow = dict(decoding=1, prefilling=[seq(1, 6000)], decode_s=0.04)
    for token_s in (0.01, 1.0):  # 16 tokens fit the budget; none does
        assert schedule(state(config=BUDGET, **slow, token_s=token_s)).chunk == \
            STEP_BUDGET_FLOOR
    over = schedule(state(config=BUDGET, **{**slow, "decode_s": 0.5}, token_s=0.001))
    assert over.chunk == STEP_BUDGET_FLOOR  # the decode step alone is over budget
    fast = schedule(state(config=BUDGET, **slow, token_s=1e-6))
    assert (fast.budget, fast.chunk) == (512, 512)


def test_a_lone_prefill_keeps_whole_chunks_and_a_short_prompt_joining_it_gets_the_budget():
    timings = dict(decode_s=0.04, token_s=0.001)
    alone = schedule(state(config=BUDGET, **timings, prefilling=[seq(1, 6000)]))
    assert (alone.budget, alone.chunk) == (None, 512)
    # A chat message arrives: it joins this step, which runs the whole 200 ms (no decoding)
    # shared between the two, the message whole (never split).
    plan = schedule(state(config=BUDGET, **timings, prefilling=[seq(1, 6000)],
                          waiting=[seq(2, 40)]))
    assert (plan.admit, plan.budget, plan.chunk) == (3, 192, 96)
    # Nobody waits on a step of long prompts only, or of short ones only: whole chunks.
    for prefilling, waiting in (([seq(1, 6000)], [seq(2, 2000)]),
                                ([seq(1, 200)], [seq(2, 40), seq(3, 250)])):
        plan = schedule(state(config=BUDGET, **timings, prefilling=prefilling,
                              waiting=waiting))
        assert (plan.budget, plan.chunk) == (None, 512)


def test_the_step_budget_waits_for_a_prompt_tokens_time_and_is_off_at_zero():
    decoding = dict(decoding=1, prefilling=[seq(1, 6000)])
    assert schedule(state(config=BUDGET, **decoding, decode_s=0.04, token_s=None)).budget \
        is None
    # No decode step measured yet (no step without prefill so far): it counts as free.
    assert schedule(state(config=BUDGET, **decoding, decode_s=None, token_s=0.001)).budget \
        == 192
    off = EngineConfig(prefill_step_size=512, block_size=64, step_budget_ms=0.0)
    plan = schedule(state(config=off, **decoding, decode_s=0.04, token_s=0.001))
    assert (plan.budget, plan.chunk) == (None, 512)


def test_an_embedding_step_gets_what_the_step_budget_gives_a_chunk_streams_wait_on():
    # The streams that wait on an embedding step are other models': their steps take the
    # place of a chat chunk's decode step.
    for others_s in (0.0, 0.04, 0.15, 0.3):
        for token_s in (1e-6, 1e-4, 0.001, 0.0037, 0.01, 1.0):
            chat = step_budget(state(config=BUDGET, decoding=1, decode_s=others_s,
                                     token_s=token_s), [seq(1, 6000)])
            assert embed_budget(BUDGET, token_s, others_step_s=others_s) == chat
    assert embed_budget(BUDGET, 0.001, others_step_s=0.0) == 192  # 200 ms at 1 ms, blocks
    assert embed_budget(BUDGET, 1e-6, others_step_s=0.0) == 512  # never past the chunk
    assert embed_budget(BUDGET, 1.0, others_step_s=0.0) == STEP_BUDGET_FLOOR


def test_an_embedding_step_leaves_the_other_models_steps_their_share_of_the_step_budget():
    # Streams of a chat model beside it wait for their own step and the embedding step in
    # turn: 200 ms between two of their tokens, as beside a chat prompt's chunk.
    assert embed_budget(BUDGET, 0.001, others_step_s=0.0) == 192
    assert embed_budget(BUDGET, 0.001, others_step_s=0.072) == 128
    assert embed_budget(BUDGET, 0.001, others_step_s=0.15) == 50
    assert embed_budget(BUDGET, 0.001, others_step_s=0.4) == STEP_BUDGET_FLOOR


def test_an_embedding_step_runs_whole_chunks_unless_others_wait_and_the_floor_until_timed():
    # Nobody waits: whole chunks, as a lone chat prefill (step_budget gives it no bound).
    assert step_budget(state(config=BUDGET, token_s=0.001), [seq(1, 6000)]) is None
    assert embed_budget(BUDGET, 0.001, others_step_s=None) == 512
    assert embed_budget(BUDGET, None, others_step_s=0.1) == STEP_BUDGET_FLOOR
    off = EngineConfig(prefill_step_size=512, block_size=64, step_budget_ms=0.0)
    assert embed_budget(off, None, others_step_s=0.1) == 512
    assert embed_budget(off, 1.0, others_step_s=0.1) == 512


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


# -- who starts: long prompts one after the other, shortest first ----------------------------


def starting(**kw) -> int:
    """How many of the waiting sequences the plan for ``state(**kw)`` starts (``admit`` is
    a cap: the free slots, when all may start)."""
    return min(schedule(state(**kw)).admit, len(kw.get("waiting", [])))


def order(*waiting: tuple[int, int] | tuple[int, int, int]) -> list[int]:
    """``start_order`` of (uid, remaining[, waited]) rows."""
    return start_order([Waiting(*w) if len(w) == 3 else Waiting(*w, 0) for w in waiting],
                       CONFIG)


def test_long_prompts_arriving_together_start_one_at_a_time_shortest_first():
    # Four agent turns of 300-600 new tokens, in arrival order (uids) 1..4.
    lengths = {1: 600, 2: 300, 3: 500, 4: 400}
    assert min(lengths.values()) > LONG_PROMPT
    # In arrival order, except that one with half the tokens of the turn ahead goes first.
    assert order(*lengths.items()) == [2, 1, 3, 4]
    waiting = [seq(uid, lengths[uid]) for uid in (2, 1, 3, 4)]
    assert starting(waiting=waiting) == 1
    # The first is still prefilling (the end of it): the next waits for it ...
    plan = schedule(state(prefilling=[seq(2, 100, whole=300, in_cache=200)],
                          waiting=waiting[1:]))
    assert plan.admit == 0 and not plan.held
    # ... and starts once it decodes (down to its last token it counts as done).
    assert starting(decoding=1, waiting=waiting[1:]) == 1
    assert starting(prefilling=[seq(2, 1, whole=300, in_cache=299)], waiting=waiting[1:]) == 1
    # While sequences decode, under a budget, the same.
    assert starting(decoding=3, decode_s=0.15, token_s=0.001, waiting=waiting) == 1


def test_short_prompts_start_together_in_arrival_order_as_before():
    chats = [seq(uid, 100) for uid in range(1, 9)]
    assert starting(waiting=chats) == CONFIG.prefill_batch_size
    # Ahead of long ones waiting (in arrival order, not by length), and beside a long prompt
    # prefilling, which a long one waits for.
    assert order((1, 900), (2, 120), (3, 40), (4, 300)) == [2, 3, 4, 1]
    assert starting(prefilling=[seq(9, 2000)],
                    waiting=[seq(2, 120), seq(3, 40), seq(4, 1500)]) == 2
    # With no long one prefilling, the first long one starts with them; the next waits.
    assert starting(waiting=[seq(2, 120), seq(3, 40), seq(4, 300), seq(1, 900)]) == 3


def test_a_long_prompt_starts_beside_one_with_twice_its_tokens_left():
    # A 300-token turn need not wait for the 20,000 tokens of another's prompt; the next
    # turn waits for it (it has less than twice the next one's tokens left).
    huge = seq(1, 20_000)
    assert starting(prefilling=[huge], waiting=[seq(2, 300), seq(3, 400)]) == 1
    assert starting(prefilling=[seq(1, 599)], waiting=[seq(2, 300)]) == 0
    assert starting(prefilling=[seq(1, 600)], waiting=[seq(2, 300)]) == 1


def test_a_much_shorter_prompt_goes_first_and_one_about_as_long_keeps_its_place():
    # A 675-token turn that came first is not passed by later turns of 530-660 tokens ...
    assert order((1, 675), (2, 530), (3, 660), (4, 600)) == [1, 2, 3, 4]
    # ... but is by a 300-token one, and a 2,000-token one waits for all of them.
    assert order((1, 2000), (2, 675), (3, 530), (4, 300)) == [4, 2, 3, 1]
    # No edges between sizes: 533 tokens wait for none of 480 or 300 tokens (size classes
    # put both first, and such turns waited 80-106 s at 8 sessions), only for half or less.
    assert order((1, 533), (2, 480), (3, 300)) == [1, 2, 3]
    assert order((1, 533), (2, 480), (3, 266)) == [3, 1, 2]
    # Halving again: each goes before the one it has half the tokens of.
    assert order((1, 2000), (2, 900), (3, 400), (4, 1100)) == [3, 2, 1, 4]


def test_a_starved_sequence_goes_first_and_starts_whatever_its_length():
    starving = STARVED_STEPS * CONFIG.prefill_step_size
    assert order((1, 5000, starving), (2, 300), (3, 100), (4, 6000, starving + 1)) == [
        1, 4, 3, 2]
    prefilling = [seq(9, 3000)]
    assert starting(prefilling=prefilling, waiting=[seq(1, 5000, waited=starving - 1)]) == 0
    assert starting(prefilling=prefilling,
                    waiting=[seq(1, 5000, waited=starving), seq(3, 100)]) == 2


def simulate(steps: int) -> int | None:
    """A 5,000-token prompt arrives with a 300-token one, and another 300-token one arrives
    every step after: each shorter one would start before it. Returns the step at which the
    long one starts (None: it never did), planning each step with ``start_order`` and
    ``schedule`` and running whole chunks."""
    prefilling: dict[int, list[int]] = {}  # uid -> [remaining, whole]
    waiting: dict[int, list[int]] = {1: [5000, 0]}  # uid -> [remaining, prefilled when it came]
    prefilled = 0
    for step in range(steps):
        waiting[100 + step] = [300, prefilled]
        rows = [Waiting(uid, n, prefilled - since) for uid, (n, since) in waiting.items()]
        queue = [seq(uid, waiting[uid][0], waited=prefilled - waiting[uid][1])
                 for uid in start_order(rows, CONFIG)]
        pending = [seq(uid, n, whole=whole) for uid, (n, whole) in prefilling.items()]
        plan = schedule(state(prefilling=pending, waiting=queue[:CONFIG.prefill_batch_size]))
        for p in queue[:plan.admit]:
            if p.uid == 1:
                return step
            prefilling[p.uid] = [waiting.pop(p.uid)[0], p.whole]
        for uid, rest in list(prefilling.items()):
            ran = min(rest[0], plan.chunk)
            prefilled += ran
            rest[0] -= ran
            if not rest[0]:
                del prefilling[uid]
    return None


def test_a_long_prompt_behind_a_stream_of_shorter_ones_still_starts(monkeypatch):
    # It starts once the others prefilled STARVED_STEPS full steps' tokens (300 a step).
    bound = math.ceil(STARVED_STEPS * CONFIG.prefill_step_size / 300)
    assert simulate(100) == bound
    monkeypatch.setattr(schedule_module, "STARVED_STEPS", 10**9)
    assert simulate(100) is None  # without the guard it would starve


def test_the_memory_gate_still_decides_and_the_order_only_holds_back_more():
    roomy = Memory(TINY, 0, 10**12)
    longs = [seq(2, 300), seq(3, 400)]
    gate = plan_step(TINY, usage=0, limit=10**12, decoding=0, decode_len=0, prefilling=[],
                     waiting=[p.member for p in longs], step=512)
    assert gate.admit == 2
    assert schedule(state(waiting=longs, memory=roomy)).admit == 1
    # Room for one chat only: the gate holds the second back although chats start together.
    chats = [seq(2, 100), seq(3, 100)]
    one = plan_step(TINY, usage=0, limit=10**12, decoding=0, decode_len=0, prefilling=[],
                    waiting=[chats[0].member], step=512)
    tight = Memory(TINY, 0, int(one.reserve_need / (1 - ADMIT_HEADROOM)) + 2)
    assert plan_step(TINY, usage=0, limit=tight.limit, decoding=0, decode_len=0,
                     prefilling=[], waiting=[p.member for p in chats], step=512).admit == 1
    plan = schedule(state(waiting=chats, memory=tight))
    assert plan.admit == 1 and plan.held
    # Never more than the gate, whatever the lengths.
    for lengths in ([100, 100, 100], [300, 900], [50, 700, 20], [5000], [260, 257]):
        waiting = [seq(i, n) for i, n in enumerate(lengths)]
        for limit in (10**6, 3 * 10**6, 10**12):
            gated = plan_step(TINY, usage=0, limit=limit, decoding=0, decode_len=0,
                              prefilling=[], waiting=[p.member for p in waiting], step=512)
            plan = schedule(state(waiting=waiting, memory=Memory(TINY, 0, limit)))
            assert plan.admit <= gated.admit, (lengths, limit)


def test_the_schedule_loads_without_mlx():
    code = ("import sys, actors.engine.schedule; "
            "assert not [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')]")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- the plan names who starts and what each sequence runs -----------------------------------


def test_the_plan_names_who_starts_and_the_tokens_each_sequence_runs():
    """Decoding sequences run one token, a prefilling one its chunk, a starting one its first
    chunk (a short prompt's last token too: its first token comes from that chunk)."""
    plan = schedule(state(decoding=2, decode_uids=(7, 8), prefilling=[seq(1, 700)],
                          waiting=[seq(2, 40), seq(3, 30)]))
    assert (plan.budget, plan.chunk) == (None, 512)
    assert plan.start == [2, 3]
    assert plan.tokens == {7: 1, 8: 1, 1: 512, 2: 40, 3: 30}


def test_a_last_token_alone_runs_as_one_and_waits_outside_the_chunk_when_told():
    """A prompt down to its last token runs it (as a decode row); without first tokens from
    the chunk, a chunk leaves the prompt's last token for the next step."""
    plan = schedule(state(prefilling=[seq(4, 1)], waiting=[seq(5, 40)]))
    assert plan.tokens == {4: 1, 5: 40}
    plan = schedule(state(prefilling=[seq(4, 1)], waiting=[seq(5, 40)],
                          first_token_in_chunk=False))
    assert plan.tokens == {4: 1, 5: 39}


def test_with_the_batch_full_of_decoding_sequences_the_step_only_decodes():
    full = tuple(range(100, 100 + CONFIG.max_batch_size))
    plan = schedule(state(decoding=len(full), decode_uids=full, prefilling=[seq(1, 300)],
                          waiting=[seq(2, 40)]))
    assert plan.start == []
    assert plan.tokens == dict.fromkeys(full, 1)
