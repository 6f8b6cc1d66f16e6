"""Wiring: spawn the serving actors into an ``ActorSystem`` (the CLI and embedding programs)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from troupe.actors.admission import ADMISSION_THREAD, Admission
from troupe.actors.config import ServeConfig, model_specs
from troupe.actors.engine import cpu_kernels
from troupe.actors.memory_monitor import MONITOR_NAME
from troupe.actors.messages import ListModels, ModelCard
from troupe.actors.mlx_lm_private import check_mlx_lm
from troupe.actors.models.store import troupe_home
from troupe.actors.pool import POOL_NAME, EnginePool, engine_names
from troupe.actors.scheduler import MLX_THREAD
from troupe.runtime import ActorRef, ActorSystem, Restart


@dataclass(frozen=True)
class ServingHandles:
    """Refs to the serving actors, for the HTTP layer and for programs that embed the server.

    ``models`` lists every configured model; ``schedulers`` those loaded at start (the
    first model): the others load on their first request (``pool``)."""

    admission: ActorRef
    schedulers: dict[str, ActorRef]
    models: list[ModelCard]
    pool: ActorRef | None = None
    monitor: ActorRef | None = None


def cache_dir(config: ServeConfig) -> Path:
    return Path(config.cache_dir) if config.cache_dir else troupe_home() / "kv-cache"


async def start_serving(system: ActorSystem, config: ServeConfig) -> ServingHandles:
    """Load the first model on the MLX thread and start the serving actors; returns when ready.

    Start order: the engine pool (which resolves every model, starts the memory monitor and
    loads the first model, with its cache index and SSD writer), then admission; actors stop
    in reverse, the pool stopping what it started before it lets the cache directory go.
    """
    check_mlx_lm()  # troupe reaches a few private mlx-lm names: tested versions only
    # Before any model runs: MLX reads PATH and TMPDIR when it first fuses a kernel.
    cpu_kernels.enable(config.cpu_kernels, troupe_home())
    cache = None
    if config.engine.block_size > 0:
        directory = cache_dir(config)
        directory.mkdir(parents=True, exist_ok=True)
        cache = {"cache_dir": str(directory), "disk_max_bytes": config.cache_disk_max}
    pool = await system.spawn(
        EnginePool,
        name=POOL_NAME,
        thread=MLX_THREAD,
        restart=Restart.PERMANENT,
        mailbox_size=256,
        specs=model_specs(config),
        engine=config.engine,
        monitor={"limit": config.memory_limit, "poll_s": config.memory_poll_ms / 1000,
                 "guard": config.prefill_guard},
        cache=cache,
        models_memory=config.models_memory,
        pin=config.pin,
        idle_ttl=config.idle_ttl,
        scheduler_mailbox=max(1024, config.engine.max_queue * 2),
    )
    cards: list[ModelCard] = await pool.ask(ListModels(), timeout=30.0)
    names = [engine_names(i, card.id) for i, card in enumerate(cards)]
    monitor = system.get(MONITOR_NAME)  # the pool's, started before any model loaded
    loaded = {card.id: system.find(n.scheduler) for card, n in zip(cards, names, strict=True)}
    admission = await system.spawn(
        Admission,
        name="admission",
        thread=ADMISSION_THREAD,
        restart=Restart.PERMANENT,
        mailbox_size=1024,
        models=[(card, loaded[card.id]) for card in cards],
        pool=pool,
        prefill_step_size=config.engine.prefill_step_size,
        block_size=config.engine.block_size,
        distributed=config.engine.distributed,
        aliases=config.aliases,
        max_tokens_limit=config.max_tokens_limit,
        template_timeout=config.template_timeout,
        max_image_pixels=config.max_image_pixels,
        # The group start_rank joined: its guard counts one rank's share, as the gate does.
        ranks=mx.distributed.init().size() if config.engine.distributed else 1,
    )
    return ServingHandles(
        admission=admission,
        schedulers={model: ref for model, ref in loaded.items() if ref is not None},
        models=cards,
        pool=pool,
        monitor=monitor,
    )
