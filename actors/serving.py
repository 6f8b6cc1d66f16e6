"""Wiring: spawn the serving actors into an ``ActorSystem`` (the CLI and embedding programs)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from actors.admission import ADMISSION_THREAD, Admission
from actors.cache_index import CacheIndex
from actors.config import ServeConfig
from actors.messages import DescribeEngine, ModelCard
from actors.model_store import troupe_home
from actors.scheduler import MLX_THREAD, Scheduler
from actors.ssd_writer import SsdWriter
from runtime import ActorRef, ActorSystem, Restart

# The cache index describes the scheduler's RAM blocks: when one restarts, both must.
KV_GROUP = "kv"


@dataclass(frozen=True)
class ServingHandles:
    """Refs to the serving actors, for the HTTP layer and for programs that embed the server."""

    admission: ActorRef
    schedulers: dict[str, ActorRef]
    models: list[ModelCard]


def cache_dir(config: ServeConfig) -> Path:
    return Path(config.cache_dir) if config.cache_dir else troupe_home() / "kv-cache"


async def start_serving(system: ActorSystem, config: ServeConfig) -> ServingHandles:
    """Load the model on the MLX thread and start the serving actors; returns when ready."""
    scheduler = await system.spawn(
        Scheduler,
        name="scheduler",
        thread=MLX_THREAD,
        restart=Restart.PERMANENT,
        group=KV_GROUP,
        mailbox_size=max(1024, config.max_queue * 2),
        model=config.model,
        max_batch_size=config.max_batch_size,
        prefill_batch_size=config.prefill_batch_size,
        prefill_step_size=config.prefill_step_size,
        max_queue=config.max_queue,
        block_size=config.block_size,
    )
    card: ModelCard = await scheduler.ask(DescribeEngine(), timeout=30.0)
    if config.block_size > 0:
        directory = cache_dir(config)
        directory.mkdir(parents=True, exist_ok=True)
        await system.spawn(
            CacheIndex,
            name="cache_index",
            thread="cache-index",
            restart=Restart.PERMANENT,
            group=KV_GROUP,
            mailbox_size=4096,
            cache_dir=str(directory),
            fingerprint=card.fingerprint,
            ram_max_bytes=config.cache_ram_max,
            disk_max_bytes=config.cache_disk_max,
            scheduler="scheduler",
            block_size=config.block_size,
        )
        # The writer's mailbox is the bounded write queue the scheduler waits on (~250 ms).
        await system.spawn(
            SsdWriter,
            name="ssd_writer",
            thread="ssd",
            restart=Restart.PERMANENT,
            mailbox_size=64,
            cache_dir=str(directory),
            fingerprint=card.fingerprint,
            disk_max_bytes=config.cache_disk_max,
            index="cache_index",
        )
    admission = await system.spawn(
        Admission,
        name="admission",
        thread=ADMISSION_THREAD,
        restart=Restart.PERMANENT,
        mailbox_size=1024,
        models=[(card, scheduler)],
    )
    return ServingHandles(admission=admission, schedulers={card.id: scheduler}, models=[card])
