"""Helpers of the engine-level tests (tests/test_engine.py, tests/test_mixed.py)."""

from __future__ import annotations

from troupe.actors.engine.config import EngineConfig
from troupe.actors.engine.core import Engine
from troupe.actors.engine.kv_blocks import KVBlock
from troupe.actors.messages import RequestFinished, SamplingParams, TokensGenerated


def engine_config(**settings) -> EngineConfig:
    """The engine tests' settings: no prefix cache and whole prefill chunks unless the test
    names them, so each test sees exactly the steps it sets up."""
    return EngineConfig(**{"block_size": 0, "prefill_interleave": 0.0, "step_budget_ms": 0.0,
                           **settings})


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text)


def run(engine: Engine, max_steps: int = 1000) -> dict[str, dict]:
    """Step until every request finished; collect tokens, text and the finish event."""
    results: dict[str, dict] = {}
    for _ in range(max_steps):
        if not engine.has_work:
            break
        for ev in engine.step():
            r = results.setdefault(ev.request_id, {"tokens": [], "text": "", "finish": None})
            if isinstance(ev, TokensGenerated):
                r["tokens"] += ev.token_ids
                r["text"] += ev.text
            elif isinstance(ev, RequestFinished):
                r["finish"] = ev
    assert not engine.has_work, "engine did not finish"
    return results


def run_aborting(engine: Engine, victim: str, after: int) -> dict[str, list[int]]:
    """Step until every request finished, aborting ``victim`` once it has ``after`` tokens;
    each request's tokens (its requests' ids must be in ``engine.requests`` when called)."""
    got: dict[str, list[int]] = {rid: [] for rid in engine.requests}
    while engine.has_work:
        if len(got[victim]) >= after and victim in engine.requests:
            engine.abort(victim)
        for ev in engine.step():
            if isinstance(ev, TokensGenerated):
                got[ev.request_id] += ev.token_ids
    return got


def fix_budget(engine: Engine, tokens: int) -> None:
    """Fixed step timings (a prompt token 10 ms, a decode step ``tokens`` of them, never
    re-measured), so that with ``prefill_interleave=1.0`` a step's prefill budget is
    ``tokens`` before the floor."""
    engine._measure = lambda *a: None
    engine._decode_s, engine._token_s = tokens * 0.01, 0.01


def run_arriving(engine: Engine, prompts: list[list[int]], max_tokens: int
                 ) -> dict[str, list[int]]:
    """The first prompt at once, then a new one every third step while the others decode
    ("r0", "r1", ...); step until all finished. Returns each request's tokens."""
    results: dict[str, list[int]] = {}
    engine.add("r0", prompts[0], greedy(max_tokens))
    pending = list(enumerate(prompts))[1:]
    steps = 0
    while engine.has_work or pending:
        if pending and steps % 3 == 2:
            i, p = pending.pop(0)
            engine.add(f"r{i}", p, greedy(max_tokens))
        for ev in engine.step():
            if isinstance(ev, TokensGenerated):
                results.setdefault(ev.request_id, []).extend(ev.token_ids)
        steps += 1
    return results


def ram_hit(engine: Engine, prompt: list[int]) -> list[KVBlock]:
    """The prompt's leading blocks in the engine's RAM tier (what the cache index would send)."""
    out = []
    for h in engine.prompt_hashes(prompt):
        if h not in engine.blocks:
            break
        out.append(engine.blocks[h])
    return out
