"""The per-step memory gate of embedding and rerank work (decoder and encoder models alike):
the chat batch's gate lives in ``schedule()``; an embedding step, which holds no decode slot,
is counted here, by ``embed_step_need``, the rule admission's 413 counts a job's worst step by.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from troupe.actors.engine.memory_estimate import ModelMemory, embed_step_need, idle_floor, too_large
from troupe.actors.messages import AdmissionError


class StepShape(NamedTuple):
    """What an embedding step runs, as the memory gate counts it (``embed_step_need``):
    ``rows`` inputs of ``tokens`` new tokens each (padded) over ``context`` tokens, adding
    ``kv`` tokens of cache a row (0: none, or room its cache already holds)."""

    rows: int
    tokens: int
    context: int
    kv: int = 0


def _in_use() -> int:
    return mx.get_active_memory() + mx.get_cache_memory()


def gate_step(memory: ModelMemory | None, shape: StepShape, limit: int | None,
              floor: int = 0) -> AdmissionError | None:
    """The per-step memory gate of embedding work: None when the step (``embed_step_need``,
    the rule admission's 413 counts a job's worst step by) fits under ``limit`` with what MLX
    holds now, its allocator's cache given back first if that is what it takes; else the
    error the step's jobs fail with: too large when it could never fit (``floor``: the memory
    in use at idle), unavailable while other work holds the memory."""
    if limit is None or memory is None:
        return None
    need = embed_step_need(memory, rows=shape.rows, tokens=shape.tokens,
                           context=shape.context, kv=shape.kv)
    if _in_use() + need <= limit:
        return None
    if mx.get_cache_memory():
        mx.clear_cache()
        if _in_use() + need <= limit:
            return None
    mb = 1e6
    message = (f"out of memory for this step of {shape.rows} input(s) of {shape.tokens} tokens: "
               f"it needs about {need / mb:.0f} MB more; {_in_use() / mb:.0f} MB of the "
               f"{limit / mb:.0f} MB memory limit are in use")
    if too_large(need, limit=limit, idle=idle_floor(memory, floor)):
        return AdmissionError("too_large", message, code="memory_limit_exceeded")
    return AdmissionError("unavailable", f"{message}; retry shortly", code="memory_busy")
