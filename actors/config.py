"""Server configuration: one typed struct, filled by the CLI or by a Python program."""

from __future__ import annotations

import msgspec


class ServeConfig(msgspec.Struct, kw_only=True):
    """Everything ``troupe serve`` can set (docs/configuration.md explains each field)."""

    # A model, or several (an engine pool: the first is loaded at start, the others on their
    # first request). None: the bundled default model.
    model: str | list[str] | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    # Continuous batching: most sequences decoding at once, and prompts prefilled together.
    max_batch_size: int = 32
    prefill_batch_size: int = 8
    prefill_step_size: int = 512
    # While sequences decode, a step's prefill takes at most about this many decode steps'
    # time (0: whole prefill_step_size chunks), so streams keep flowing past a long prompt.
    prefill_interleave: float = 1.2
    # An idle engine waits this many milliseconds after a request arrives before stepping,
    # so a burst of requests is prefilled in one step (0: step at once).
    arrival_window_ms: float = 20.0
    # While sequences decode, one model call a step: the prefill chunk and the last prompt
    # token of joining sequences ride in the decode step's forward pass (actors/mixed.py;
    # llama-shaped models). False: mlx-lm's separate calls.
    mixed_step: bool = True
    # Requests waiting for a batch slot beyond this get 429 with Retry-After.
    max_queue: int = 256
    default_max_tokens: int = 2048
    # Prefix cache: blocks of block_size tokens in RAM (up to cache_ram_max bytes) and on disk
    # under cache_dir (up to cache_disk_max bytes). block_size 0 turns the cache off.
    block_size: int = 64
    cache_dir: str | None = None  # None: $TROUPE_HOME/kv-cache
    cache_ram_max: int = 1 << 30
    cache_disk_max: int = 8 << 30
    max_body_bytes: int = 8 * 1024 * 1024
    api_key: str | None = None
    # Needed instead of api_key on the introspection routes (/actors..., /metrics); None:
    # they take api_key like every other route.
    admin_api_key: str | None = None
    # Connections: seconds a connection may wait for a complete request head (idle between
    # requests, or a head arriving slowly), seconds a request body may take to arrive, the
    # most open at once (None: three quarters of the open-file limit), and the longest
    # request line or header field in bytes.
    idle_timeout: float = 30.0
    body_timeout: float = 60.0
    max_connections: int | None = None
    max_header_bytes: int = 8190
    allowed_origins: list[str] = []
    shutdown_grace: float = 30.0
    log_level: str = "info"
    # "native": faster CPU kernels with the same results (actors/cpu_kernels.py); "mlx":
    # MLX's own.
    cpu_kernels: str = "native"
    # Memory (docs/memory.md): bytes of MLX memory to stay under (None: 75% of the RAM
    # available at start, or 90% of Metal's recommended working set), how often the monitor
    # polls, and whether prompts are checked against the limit before and during prefill.
    memory_limit: int | None = None
    memory_poll_ms: int = 250
    prefill_guard: bool = True
    # Engine pool: bytes of weights the loaded models may take (None: no budget), models never
    # unloaded, and seconds after which an idle model is unloaded (None: never).
    models_memory: int | None = None
    pin: list[str] = []
    idle_ttl: float | None = None


def model_specs(config: ServeConfig) -> list[str | None]:
    """The models to serve, in order: ``[None]`` (the bundled default) when none is named."""
    if config.model is None:
        return [None]
    if isinstance(config.model, str):
        return [config.model]
    return list(config.model) or [None]
