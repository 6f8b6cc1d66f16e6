"""The engine's settings: one typed struct with one default each, passed whole from the serve
configuration through the engine pool and the scheduler to the engine."""

from __future__ import annotations

import msgspec


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How one model's engine batches, schedules and caches (docs/configuration.md)."""

    # Continuous batching: most sequences decoding at once, and prompts prefilled together.
    max_batch_size: int = 32
    prefill_batch_size: int = 8
    prefill_step_size: int = 512
    # While sequences decode, a step's prefill takes at most about this many decode steps'
    # time (0: whole prefill_step_size chunks), so streams keep flowing past a long prompt.
    prefill_interleave: float = 1.2
    # While others wait on a step (sequences decoding, a short prompt beside a long one),
    # its prefill chunk is sized so the step takes about this many milliseconds (0: no bound):
    # 200 ms keeps streams at 5 tokens/s or more and a new prompt's first token within a
    # step or two, while a 30B model's chunk on Apple silicon (a few hundred ms for 512
    # tokens) shrinks by about half.
    step_budget_ms: float = 200.0
    # An idle engine waits this many milliseconds after a request arrives before stepping,
    # so a burst of requests is prefilled in one step (0: step at once).
    arrival_window_ms: float = 20.0
    # While sequences decode, one model call a step: the prefill chunk and the last prompt
    # token of joining sequences ride in the decode step's forward pass
    # (actors/engine/forward.py; the architectures it names). False: mlx-lm's separate calls.
    mixed_step: bool = True
    # Requests waiting for a batch slot beyond this get 429 with Retry-After.
    max_queue: int = 256
    # Prefix-cache block size in tokens; 0 turns the prefix cache off.
    block_size: int = 64
    # Bytes of prefix-cache blocks the engine keeps in RAM; past it the least recently used go.
    cache_ram_max: int = 1 << 30
    # The model sharded over the ranks of `mlx.launch` (actors/distributed.py): "tensor" or
    # "pipeline" (None: one process), and the TCP port on rank 0's host where the other ranks
    # take each step's plan.
    distributed: str | None = None
    distributed_port: int = 32400


DEFAULTS = EngineConfig()
