"""Server configuration: one typed struct, filled by the CLI or by a Python program."""

from __future__ import annotations

import msgspec


class ServeConfig(msgspec.Struct, kw_only=True):
    """Everything ``troupe serve`` can set (docs/configuration.md explains each field)."""

    model: str | None = None  # None: the bundled default model
    host: str = "127.0.0.1"
    port: int = 8000
    # Continuous batching: most sequences decoding at once, and prompts prefilled together.
    max_batch_size: int = 32
    prefill_batch_size: int = 8
    prefill_step_size: int = 512
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
    allowed_origins: list[str] = []
    shutdown_grace: float = 30.0
    log_level: str = "info"
