"""Server configuration: one typed struct, filled by the CLI or by a Python program."""

from __future__ import annotations

import msgspec

from actors.engine.config import DEFAULTS as ENGINE
from actors.engine.config import EngineConfig

# Seconds a chat template may take to render one request's conversation (admission's bound).
TEMPLATE_TIMEOUT_S = 2.0


class ServeConfig(msgspec.Struct, kw_only=True):
    """Everything ``troupe serve`` can set (docs/configuration.md explains each field)."""

    # A model, or several (an engine pool: the first is loaded at start, the others on their
    # first request). None: the bundled default model.
    model: str | list[str] | None = None
    # Other names of served models: a name, or a glob pattern (``claude-*-haiku-*``), mapped to
    # a served model's id; patterns are tried in this order, after the names. With one model
    # served, every name is served by it anyway.
    aliases: dict[str, str] = {}
    host: str = "127.0.0.1"
    port: int = 8000
    # The engine's settings (actors/engine/config.py holds each one's default and meaning).
    max_batch_size: int = ENGINE.max_batch_size
    prefill_batch_size: int = ENGINE.prefill_batch_size
    prefill_step_size: int = ENGINE.prefill_step_size
    prefill_interleave: float = ENGINE.prefill_interleave
    step_budget_ms: float = ENGINE.step_budget_ms
    arrival_window_ms: float = ENGINE.arrival_window_ms
    mixed_step: bool = ENGINE.mixed_step
    max_queue: int = ENGINE.max_queue
    default_max_tokens: int = 2048
    # The most tokens any answer may have (None: the model's context is the only bound): a
    # request asking for more is served with that many.
    max_tokens_limit: int | None = None
    # Seconds the model's chat template may take to render a request's conversation; a
    # render still running then is cut, and the request refused (400).
    template_timeout: float = TEMPLATE_TIMEOUT_S
    # Responses API: how many responses are kept in memory for previous_response_id and
    # GET /v1/responses/{id}, the least recently used dropped first (0: none are kept).
    responses_store: int = 256
    # Prefix cache: blocks of block_size tokens in RAM (up to cache_ram_max bytes) and on disk
    # under cache_dir (up to cache_disk_max bytes). block_size 0 turns the cache off.
    block_size: int = ENGINE.block_size
    cache_dir: str | None = None  # None: $TROUPE_HOME/kv-cache
    cache_ram_max: int = ENGINE.cache_ram_max
    cache_disk_max: int = 8 << 30
    max_body_bytes: int = 8 * 1024 * 1024
    # The API keys every route but /health takes: one, or several, and those of a file (one a
    # line, ``#`` comments). Each key's requests have a prefix-cache namespace of their own
    # (another key's requests can neither hit nor probe their blocks) unless shared_cache.
    api_key: str | list[str] | None = None
    api_keys_file: str | None = None
    shared_cache: bool = False
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
    # "native": faster CPU kernels with the same results (actors/engine/cpu_kernels.py); "mlx":
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
    # One model sharded over several processes (actors/engine/config.py says how).
    distributed: str | None = ENGINE.distributed
    distributed_port: int = ENGINE.distributed_port


    def engine(self) -> EngineConfig:
        """The engine's part of this configuration, whole."""
        return EngineConfig(**{f: getattr(self, f) for f in EngineConfig.__struct_fields__})


def model_specs(config: ServeConfig) -> list[str | None]:
    """The models to serve, in order: ``[None]`` (the bundled default) when none is named."""
    if config.model is None:
        return [None]
    if isinstance(config.model, str):
        return [config.model]
    return list(config.model) or [None]


def api_keys(config: ServeConfig) -> list[str]:
    """The API keys the server takes (the admin key aside): ``api_key``, then the lines of
    ``api_keys_file`` (blank lines and ``#`` comments skipped), in order, each once. Raises
    ValueError when the file cannot be read or holds no key."""
    keys = [config.api_key] if isinstance(config.api_key, str) else list(config.api_key or [])
    if config.api_keys_file:
        path = config.api_keys_file
        try:
            with open(path, encoding="utf-8", errors="surrogateescape") as f:
                lines = [line.strip() for line in f]
        except OSError as exc:
            raise ValueError(f"--api-keys-file {path}: {exc.strerror or exc}") from None
        found = [line for line in lines if line and not line.startswith("#")]
        if not found:
            raise ValueError(f"--api-keys-file {path} holds no key (one a line, # comments)")
        keys += found
    return list(dict.fromkeys(key for key in keys if key))
