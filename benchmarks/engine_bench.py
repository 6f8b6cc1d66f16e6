"""troupe's ``Engine`` as benchmarks drive it in process: the harness's chat prompts, an engine
with ``troupe serve``'s defaults, and the time to each prompt's first token."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import SERVING_PROMPT, chat_tokens, tag  # noqa: E402


def prompts(tok: Any, n: int, key: str) -> list[list[int]]:
    return [chat_tokens(tok, [{"role": "user",
                               "content": SERVING_PROMPT.format(key=tag(f"{key}-{i}"))}])
            for i in range(n)]


def served_engine(model: Any, tok: Any, sampling: Any, draft: Any = None,
                  speculative: str | None = None) -> Any:
    """troupe's ``Engine`` with ``troupe serve``'s defaults, its chat template already cached
    by one request (as a server that has answered before); ``draft``: a draft model
    (``draft_model.DraftModel``) drafting for it, as ``--draft-model`` gives; ``speculative``:
    ``--speculative`` (``"off"`` to compare with a commit that has no drafting)."""
    import mlx.core as mx
    import msgspec

    from troupe.actors.config import ServeConfig
    from troupe.actors.engine.core import Engine

    cfg = ServeConfig().engine
    if draft is not None:
        cfg = msgspec.structs.replace(cfg, draft_model="draft")
    if speculative is not None:
        cfg = msgspec.structs.replace(cfg, speculative=speculative)
    engine = Engine(model, tok, cfg, stream=mx.default_stream(mx.cpu), draft=draft)
    engine.add("warm-up", prompts(tok, 1, f"warm-{time.time()}")[0], sampling)
    while engine.has_work:
        engine.step()
    return engine


def first_tokens(engine: Any, batch: list[list[int]], sampling: Any) -> tuple[list[float], int]:
    """Add ``batch`` at once and step: the seconds from adding to each prompt's first token
    (sorted), and the steps until the last of them; the requests then run to their end."""
    from troupe.actors.messages import TokensGenerated

    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    for i, ids in enumerate(batch):
        engine.add(f"r{i}", ids, sampling)
        sent[f"r{i}"] = time.perf_counter()
    steps = 0
    while len(first) < len(batch):
        events = engine.step()
        steps += 1
        now = time.perf_counter()
        for ev in events:
            if isinstance(ev, TokensGenerated) and ev.request_id not in first:
                first[ev.request_id] = now - sent[ev.request_id]
    while engine.has_work:
        engine.step()
    return sorted(first.values()), steps
