"""Server configuration: one typed struct, filled by the CLI or by a Python program."""

from __future__ import annotations

import difflib
from typing import Annotated, Any, Literal

import msgspec

from troupe.actors.engine.config import (
    DEFAULTS,
    EngineConfig,
    Setting,
    setting,
    settings_of,
    speculation,
)
from troupe.actors.images import MAX_IMAGE_PIXELS

# Seconds a chat template may take to render one request's conversation (admission's bound).
TEMPLATE_TIMEOUT_S = 2.0


class ServeConfig(msgspec.Struct, kw_only=True):
    """Everything ``troupe serve`` can set: each field's description is its flag's help
    (docs/configuration.md lists them). The engine's settings are one field, ``engine``:
    ``ServeConfig(port=8080, engine=EngineConfig(max_batch_size=8))``, or flat, as the flags
    name them, with ``ServeConfig.of(port=8080, max_batch_size=8)``."""

    model: Annotated[str | list[str] | None, setting(
        "model directory, .gguf file or Hugging Face repo id; repeat it to serve several "
        "models, each loaded on its first request",
        none="the bundled model")] = None
    # Patterns are tried in the order given, after the exact names.
    aliases: Annotated[dict[str, str], setting(
        "serve requests naming NAME with MODEL, a served model's id (repeatable; NAME may be "
        "a glob pattern such as 'claude-*-haiku-*'); with one model served, every name is "
        "served by it", flag="--alias", metavar="NAME=MODEL")] = {}
    host: Annotated[str, setting("the address to listen on")] = "127.0.0.1"
    port: Annotated[int, setting("the port to listen on")] = 8000
    # The engine's settings (actors/engine/config.py holds each one's default and meaning).
    engine: EngineConfig = DEFAULTS
    default_max_tokens: Annotated[int, setting(
        "max_tokens when a request sends none", metavar="N")] = 2048
    max_tokens_limit: Annotated[int | None, setting(
        "the most tokens any answer may have: a request asking for more is served with N",
        metavar="N", none="no limit but the model's context")] = None
    template_timeout: Annotated[float, setting(
        "seconds the chat template may take to render a request; a longer render is cut and "
        "the request refused with 400", metavar="SECONDS")] = TEMPLATE_TIMEOUT_S
    responses_store: Annotated[int, setting(
        "Responses API: responses kept in memory for previous_response_id and "
        "GET /v1/responses/{id}, the least recently used dropped first; 0: none",
        metavar="N")] = 256
    cache_dir: Annotated[str | None, setting(
        "where prefix-cache blocks are kept on disk", metavar="DIR",
        none="$TROUPE_HOME/kv-cache")] = None
    cache_disk_max: Annotated[int, setting(
        "disk for prefix-cache blocks", unit="size")] = 8 << 30
    max_body_bytes: Annotated[int, setting(
        "largest request body accepted, in bytes", metavar="N")] = 8 * 1024 * 1024
    # docs/api.md's "Images" says where each API takes images and how they are checked.
    allow_image_urls: Annotated[bool, setting(
        "fetch the http(s) image URLs requests name (off: only images sent inline, as base64, "
        "are taken; a server that fetches what requests name can be made to reach hosts only "
        "it reaches, though private addresses are never fetched)")] = False
    max_image_bytes: Annotated[int, setting(
        "largest image file accepted, inline or fetched", unit="size")] = 10 << 20
    max_image_pixels: Annotated[int, setting(
        "largest image accepted, in pixels (width x height, read from its header before it "
        "is decoded)", metavar="N")] = MAX_IMAGE_PIXELS
    max_images_per_request: Annotated[int, setting(
        "most images one request may hold", metavar="N")] = 16
    # Each key's requests have a prefix-cache namespace of their own (another key's requests
    # can neither hit nor probe their blocks) unless shared_cache.
    api_key: Annotated[str | list[str] | None, setting(
        "require this key on every route but /health; repeat it for several clients, each "
        "with a prefix-cache namespace of its own", metavar="KEY", env="TROUPE_API_KEY",
        none="none")] = None
    api_keys_file: Annotated[str | None, setting(
        "take the keys in this file too, one a line (# comments)", metavar="PATH",
        none="none")] = None
    shared_cache: Annotated[bool, setting(
        "let every API key's requests share prefix-cache blocks (each key then can probe, "
        "through cached token counts, what the others' prompts begin with)")] = False
    admin_api_key: Annotated[str | None, setting(
        "require this key, and no other, on /actors and /metrics", metavar="KEY",
        env="TROUPE_ADMIN_API_KEY", none="they take --api-key")] = None
    idle_timeout: Annotated[float, setting(
        "close a connection that has not sent a complete request head this long after "
        "opening or after its last response", metavar="SECONDS")] = 30.0
    body_timeout: Annotated[float, setting(
        "a request body must arrive within this", metavar="SECONDS")] = 60.0
    max_connections: Annotated[int | None, setting(
        "connections open at once; more get 503", metavar="N",
        none="3/4 of the open-file limit")] = None
    max_header_bytes: Annotated[int, setting(
        "longest request line or header field, in bytes", metavar="N")] = 8190
    allowed_origins: Annotated[list[str], setting(
        "allow browser requests from these origins, comma-separated (repeatable; '*': any)",
        also=["--allowed-origin"], metavar="ORIGINS", split=True)] = []
    shutdown_grace: Annotated[float, setting(
        "seconds in-flight requests get on shutdown", metavar="SECONDS")] = 30.0
    log_level: Annotated[Literal["debug", "info", "warning", "error"], setting(
        "how much the server logs")] = "info"
    cpu_kernels: Annotated[Literal["native", "mlx"], setting(
        "native: MLX's kernels built for this CPU and a faster prefill attention, same "
        "results (actors/engine/cpu_kernels.py); mlx: MLX's own")] = "native"
    # docs/memory.md explains the limit, the monitor and the guard.
    memory_limit: Annotated[int | None, setting(
        "MLX memory to stay under, e.g. 6GB", unit="size",
        none="75% of the RAM available at start, or 90% of Metal's recommended working "
        "set")] = None
    memory_poll_ms: Annotated[int, setting(
        "how often memory is read, in ms", flag="--memory-poll", metavar="MS")] = 250
    prefill_guard: Annotated[bool, setting(
        "refuse (413) or stop prompts whose prefill would pass the memory limit")] = True
    models_memory: Annotated[int | None, setting(
        "weights the loaded models may take; loading one more unloads the least recently "
        "used idle one", unit="size", none="no budget")] = None
    pin: Annotated[list[str], setting(
        "never unload this model (repeatable)", metavar="MODEL")] = []
    idle_ttl: Annotated[float | None, setting(
        "unload a model idle this long", metavar="SECONDS", none="never")] = None

    @classmethod
    def of(cls, **settings: Any) -> ServeConfig:
        """A configuration from settings named flat, as the flags name them (the engine's
        among them: ``max_batch_size=8``). Raises TypeError naming a setting that is
        neither this struct's nor the engine's."""
        engine_names = set(EngineConfig.__struct_fields__)
        unknown = [name for name in settings
                   if name not in engine_names and name not in cls.__struct_fields__]
        if unknown:
            known = [*cls.__struct_fields__, *EngineConfig.__struct_fields__]
            hints = [f"{name!r}" + "".join(
                f" (did you mean {near!r}?)" for near in difflib.get_close_matches(name, known, 1))
                for name in unknown]
            raise TypeError(f"no such setting: {', '.join(hints)}")
        engine = {k: v for k, v in settings.items() if k in engine_names}
        serve = {k: v for k, v in settings.items() if k not in engine_names}
        base = serve.pop("engine", DEFAULTS)
        return cls(engine=msgspec.structs.replace(base, **engine), **serve)


def serve_settings() -> dict[str, Setting]:
    """Every setting ``troupe serve`` takes, by field name, in declaration order, the engine's
    in the place of ``ServeConfig.engine``."""
    found: dict[str, Setting] = {}
    serve = settings_of(ServeConfig)
    for name in ServeConfig.__struct_fields__:
        found.update(settings_of(EngineConfig) if name == "engine" else {name: serve[name]})
    return found


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


def check_drafting(config: ServeConfig) -> None:
    """Refuse flags that contradict each other on drafting (``speculation``), and a draft
    model with ``--distributed`` (the other ranks would need it too), with a ValueError
    naming them: before any model loads."""
    speculation(config.engine)
    if config.engine.distributed and config.engine.draft_model:
        raise ValueError("--draft-model is not served with --distributed (the other ranks "
                         "would need it too)")
