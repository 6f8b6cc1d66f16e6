"""Engine level: long prompts that arrive together are prefilled one after the other, in
arrival order except that a prompt with half the tokens of the one ahead goes first
(actors/engine/schedule.py, ``start_order`` and ``startable``), on the tiny random model; short
ones still together; the tokens are those of each prompt alone."""

from __future__ import annotations

from typing import Any

from engine_helpers import encode, engine_config, greedy, run
from reference import PROMPTS

from troupe.actors.engine.core import Engine
from troupe.actors.engine.schedule import LONG_PROMPT, SchedulerOutput
from troupe.actors.messages import TokensGenerated

SENTENCE = "The quick brown fox jumps over the lazy dog. "
QUESTION = "What is the capital of France? The capital of France is Paris. "


def long_prompts(tok: Any) -> dict[str, list[int]]:
    """Three long prompts, in arrival order, none in order of length; each fits a step of
    1,024 tokens. "middle" and "short" have at most half the tokens of "long", and "short" more
    than half of "middle"'s."""
    text, other = encode(tok, SENTENCE * 120), encode(tok, QUESTION * 80)
    prompts = {"long": text[:900], "middle": text[7:387], "short": other[:300]}
    assert all(LONG_PROMPT < len(p) <= 1024 for p in prompts.values())
    n = {k: len(p) for k, p in prompts.items()}
    assert 2 * n["middle"] <= n["long"] and 2 * n["short"] > n["middle"] > n["short"]
    return prompts


def first_token_steps(engine: Engine, prompts: dict[str, list[int]]
                      ) -> tuple[dict[str, int], list[int]]:
    """Add ``prompts`` together and step until each has its first token. Returns the step of
    each one's first token, and the prompt tokens each step prefilled."""
    for rid, p in prompts.items():
        engine.add(rid, p, greedy(8, ignore_eos=True))
    first: dict[str, int] = {}
    prefilled: list[int] = []
    for step in range(20):
        before = engine.prefill_tokens
        for ev in engine.step():
            if isinstance(ev, TokensGenerated):
                first.setdefault(ev.request_id, step)
        prefilled.append(engine.prefill_tokens - before)
        if len(first) == len(prompts):
            break
    return first, prefilled


def test_long_prompts_added_together_get_first_tokens_one_after_another_shortest_first(
        loaded):
    model, tok = loaded
    engine = Engine(model, tok, engine_config(prefill_step_size=1024))
    assert engine.runner.mixed  # the step that prefills a prompt samples its first token
    prompts = long_prompts(tok)
    first, prefilled = first_token_steps(engine, prompts)
    # The first of the much shorter ones, then the other (not much shorter than it).
    assert first == {"middle": 0, "short": 1, "long": 2}
    # Each step prefilled one prompt: the same work as all three in one step, in turns.
    assert prefilled == [len(prompts[r]) for r in ("middle", "short", "long")]


def test_short_prompts_added_together_are_still_prefilled_in_one_step(loaded):
    model, tok = loaded
    engine = Engine(model, tok, engine_config(prefill_step_size=512))
    chats = {f"c{i}": encode(tok, p) for i, p in enumerate(PROMPTS)}
    first, prefilled = first_token_steps(engine, chats)
    assert first == dict.fromkeys(chats, 0)
    assert prefilled == [sum(len(p) for p in chats.values())]


def test_greedy_tokens_are_those_of_each_prompt_added_alone(loaded):
    model, tok = loaded
    prompts = long_prompts(tok)
    alone = {}
    for rid, p in prompts.items():
        engine = Engine(model, tok, engine_config(prefill_step_size=512))
        engine.add(rid, p, greedy(16))
        alone[rid] = run(engine)[rid]["tokens"]
    engine = Engine(model, tok, engine_config(prefill_step_size=512))
    for rid, p in prompts.items():
        engine.add(rid, p, greedy(16))
    together = {rid: r["tokens"] for rid, r in run(engine).items()}
    assert together == alone


class _Plans:
    """Rank 0's channel to its followers (``Engine.mirror``), keeping the plans."""

    def __init__(self) -> None:
        self.plans: list[SchedulerOutput] = []

    def plan(self, plan: SchedulerOutput, step: int, digest: int) -> None:
        self.plans.append(plan)

    def reset(self, reason: str) -> None:
        raise AssertionError(reason)


def test_a_follower_running_rank_0s_plans_starts_the_same_sequences(loaded):
    """A sharded model's follower runs rank 0's plan, which names the waiting sequences that
    start: each engine orders its own queue, and they agree."""
    model, tok = loaded
    prompts = {**long_prompts(tok), "chat": encode(tok, PROMPTS[0])}
    leader = Engine(model, tok, engine_config(prefill_step_size=128))
    follower = Engine(model, tok, engine_config(prefill_step_size=128))
    leader.mirror = plans = _Plans()
    for engine in (leader, follower):
        for rid, p in prompts.items():
            engine.add(rid, p, greedy(6, ignore_eos=True))
    while leader.has_work:
        leader.step()
        follower.step(plan=plans.plans[-1])
        assert follower.last_digest == leader.last_digest, len(plans.plans)
        assert follower.progress() == leader.progress()
    assert not follower.has_work
