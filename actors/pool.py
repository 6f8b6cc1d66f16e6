"""The engine pool: several models, each loaded on demand as its own scheduler actor.

Every model named with ``--model`` is resolved at start (downloaded or converted, so that
``/v1/models`` lists it and admission has its tokenizer), but only the first is loaded; the
others load on their first request. All schedulers share the one ``mlx`` thread, which
serialises every model's steps: simple, safe with MLX's per-thread streams, and on a small
machine no slower, since each step already uses every core. The pool runs on that thread too
(converting a GGUF makes MLX arrays, and freeing a model's memory is MLX work).

Unloading: ``--models-memory`` bounds the weights of the loaded models; loading one more
unloads the least recently used idle ones first. ``--pin`` models are never unloaded,
``--idle-ttl`` unloads models idle that long, and under hard memory pressure the monitor asks
the pool to unload every idle model. A model with requests in flight is never unloaded: the
scheduler itself decides (``Retire``), in its mailbox's order, so a request that reached it
first is served first.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import msgspec

from troupe.actors.cache_index import CACHE_INDEX_THREAD, CacheIndex
from troupe.actors.cache_lock import CacheDirLock
from troupe.actors.engine.config import EngineConfig, speculation
from troupe.actors.engine.embed import model_task
from troupe.actors.engine.encoder import check_encoder, is_encoder
from troupe.actors.engine.memory_estimate import ModelMemory, served_memory
from troupe.actors.engine.prefix import model_fingerprint
from troupe.actors.memory_messages import (
    CheckIdle,
    DescribeLoad,
    EngineLoad,
    LoadModel,
    Retire,
    UnloadIdle,
)
from troupe.actors.memory_monitor import MEMORY_THREAD, MONITOR_NAME, MemoryMonitor
from troupe.actors.messages import AdmissionError, ListModels, ModelCard
from troupe.actors.models.generation_config import sampling_defaults
from troupe.actors.models.store import resolve_model
from troupe.actors.scheduler import MLX_THREAD, Scheduler, ThreadLoad, context_length
from troupe.actors.ssd_writer import SsdWriter
from troupe.runtime import Actor, ActorDead, ActorRef, AskTimeout, MailboxFull, Restart

log = logging.getLogger("actors.pool")

POOL_NAME = "engine_pool"
# After an unload with no other engine serving, wait at most this long for memory to settle.
SETTLE_TIMEOUT_S = 2.0
SETTLE_POLL_S = 0.02
ASK_TIMEOUT_S = 30.0
RETRY_AFTER_S = 2.0


@dataclass(frozen=True)
class EngineNames:
    """The actor names of one model's engine."""

    scheduler: str
    cache_index: str
    ssd_writer: str


def engine_names(position: int, model_id: str) -> EngineNames:
    """The first model keeps the plain names ("scheduler", "cache_index", "ssd_writer"), which
    one-model setups, docs and dashboards use; the others are named after their model."""
    if position == 0:
        return EngineNames("scheduler", "cache_index", "ssd_writer")
    key = model_id.replace("/", "--")  # names appear in URLs (GET /actors/<name>)
    return EngineNames(f"scheduler:{key}", f"cache_index:{key}", f"ssd_writer:{key}")


@dataclass
class EngineSlot:
    """One configured model: its card, names, memory shape, and its scheduler when loaded."""

    card: ModelCard
    names: EngineNames
    memory: ModelMemory
    pinned: bool
    ref: ActorRef | None = None
    # The model's cache index and SSD writer, once started (kept across unloads).
    index: ActorRef | None = None
    writer: ActorRef | None = None
    loaded_at: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def loaded(self) -> bool:
        return self.ref is not None and self.ref.alive


class EnginePool(Actor):
    """Loads and unloads models. Messages: ``ListModels`` and ``LoadModel`` (ask),
    ``UnloadIdle``, and its own ``CheckIdle``.

    ``specs``: the models as given to ``--model`` (None: the bundled default). ``engine``:
    each model's engine settings. ``cache``: the prefix cache's disk settings (``cache_dir``,
    ``disk_max_bytes``), or None; the pool holds the directory's lock (``cache_lock``) while
    it runs, so that a second server on it refuses to start. ``monitor``: the memory
    monitor's settings (``MemoryMonitor``'s ``limit``, ``poll_s``, ``guard``), or None for
    none: the pool starts it before it loads a model, giving it the pool's ref and every
    scheduler the monitor's, so that no ref is looked up by name.
    """

    def __init__(
        self,
        *,
        specs: list[str | None],
        engine: EngineConfig,
        monitor: dict[str, Any] | None = None,
        cache: dict[str, Any] | None = None,
        models_memory: int | None = None,
        pin: list[str] | None = None,
        idle_ttl: float | None = None,
        scheduler_mailbox: int = 1024,
        preload: int = 1,
    ) -> None:
        self.specs = specs or [None]
        self.engine_config = engine
        self.monitor_settings = monitor
        self.monitor: ActorRef | None = None  # started with the pool (``_start_monitor``)
        self.cache = cache
        self.models_memory = models_memory
        self.pin = set(pin or [])
        self.idle_ttl = idle_ttl
        self.scheduler_mailbox = scheduler_mailbox
        self.preload = preload
        self.slots: dict[str, EngineSlot] = {}
        self._ticker: asyncio.Task[None] | None = None
        self.loads = 0
        self.unloads = 0
        self.refused = 0
        self.last_load_s = 0.0
        self.last_unload_s = 0.0
        self._lock: CacheDirLock | None = None
        # What each scheduler has in flight, shared by them all (they share the MLX thread).
        self.thread_load = ThreadLoad()

    async def on_start(self) -> None:
        if self.cache is not None:
            # Before any model is resolved or loaded: a second server stops at once.
            self._lock = CacheDirLock.acquire(self.cache["cache_dir"])
        try:
            await self._start()
        except BaseException:
            self._release_cache_dir()  # no on_stop follows a failed start
            raise

    async def _start(self) -> None:
        # The draft model (``--draft-model``) drafts for every chat model: resolved (and
        # fetched) once, now, so that a bad spec stops the server before any model loads.
        draft = (resolve_model(self.engine_config.draft_model)
                 if speculation(self.engine_config) == "draft" else None)
        for position, spec in enumerate(self.specs):
            resolved = resolve_model(spec)
            if resolved.name in self.slots:
                raise ValueError(f"model {resolved.name!r} is named twice")
            config = json.loads((resolved.path / "config.json").read_text())
            card = ModelCard(
                id=resolved.name,
                context_length=context_length(config),
                source=resolved.source,
                path=str(resolved.path),
                fingerprint=model_fingerprint(resolved.path),
                sampling_defaults=sampling_defaults(resolved.path),
                task=model_task(self.engine_config, resolved.path),
            )
            if draft is not None and card.task == "generate":
                card = msgspec.structs.replace(card, draft_path=str(draft.path))
            if is_encoder(resolved.path):  # one it cannot serve stops the server now
                check_encoder(resolved.path, card.task)
            names = engine_names(position, card.id)
            # A model is pinned by its id or by the spec it was given as.
            pinned = card.id in self.pin or (spec or "default") in self.pin
            slot = EngineSlot(card=card, names=names, pinned=pinned,
                              memory=served_memory(card.path, card.draft_path))
            # A restarted pool adopts the actors its predecessor spawned and left running:
            # the one lookup by name, of names this pool gave.
            slot.ref = _alive(self.system.find(names.scheduler))
            slot.index = _alive(self.system.find(names.cache_index))
            slot.writer = _alive(self.system.find(names.ssd_writer))
            self.slots[card.id] = slot
        known = {s.card.id for s in self.slots.values()} | {s or "default" for s in self.specs}
        unknown = self.pin - known
        if unknown:
            raise ValueError(f"--pin names models that are not served: {sorted(unknown)}")
        await self._start_monitor()
        for slot in list(self.slots.values())[: self.preload]:
            await self._load(slot)
        if self.idle_ttl:
            self._ticker = asyncio.get_running_loop().create_task(self._tick(self.idle_ttl))

    async def on_stop(self, error: BaseException | None) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        if error is None:
            await self._stop_started()
        self._release_cache_dir()

    async def _stop_started(self) -> None:
        """A clean stop: what the pool started stops first, the schedulers before the disk
        tier they write to, so nothing writes in the cache directory once its lock is let go.
        (Actors spawned in the pool's own ``on_start`` count as started before it, so the
        system's reverse start order would stop them after it.) A supervised restart keeps
        them: the next pool adopts them."""
        for group in ([s.ref for s in self.slots.values()], [s.writer for s in self.slots.values()],
                      [s.index for s in self.slots.values()], [self.monitor]):
            for ref in group:
                if ref is not None:
                    await self.system.stop(ref)

    def _release_cache_dir(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    async def _tick(self, ttl: float) -> None:
        while True:
            await asyncio.sleep(min(ttl / 2, 5.0))
            try:
                self.ref.try_tell(CheckIdle())
            except MailboxFull:
                continue  # the next tick checks
            except ActorDead:
                return

    async def handle(self, msg: ListModels | LoadModel | UnloadIdle | CheckIdle) -> Any:
        match msg:
            case ListModels():
                return [slot.card for slot in self.slots.values()]
            case LoadModel(model=model):
                slot = self.slots.get(model)
                if slot is None:
                    raise AdmissionError("unknown_model", f"model {model!r} is not served here",
                                         param="model", code="model_not_found")
                return await self._load(slot)
            case UnloadIdle():
                # The most recently used model stays: unloading the last one would only make
                # the next request pay for a load, into the same pressure.
                loaded = []
                for slot in self._loaded():
                    load = await self._load_of(slot)
                    loaded.append((load.idle_s if load else 0.0, slot))
                loaded.sort(key=lambda pair: pair[0], reverse=True)
                for _, slot in loaded[:-1]:
                    if not slot.pinned:
                        await self._unload(slot, "memory pressure")
            case CheckIdle():
                for slot in self._loaded():
                    load = await self._load_of(slot)
                    if not slot.pinned and load is not None and load.in_flight == 0 \
                            and load.idle_s >= (self.idle_ttl or float("inf")):
                        await self._unload(slot, f"idle for {load.idle_s:.0f}s")
            case _:
                raise TypeError(f"engine pool cannot handle {type(msg).__name__}")
        return None

    # -- loading -------------------------------------------------------------------------------

    def _loaded(self) -> list[EngineSlot]:
        return [slot for slot in self.slots.values() if slot.loaded]

    async def _load(self, slot: EngineSlot) -> ActorRef:
        if slot.loaded:
            assert slot.ref is not None
            return slot.ref
        await self._make_room(slot)
        started = time.perf_counter()
        names = slot.names
        if self.cache is not None and (slot.index is None or slot.writer is None):
            await self._start_cache(slot)
        slot.ref = await self.system.spawn(
            Scheduler,
            name=names.scheduler,
            thread=MLX_THREAD,
            restart=Restart.PERMANENT,
            mailbox_size=self.scheduler_mailbox,
            model=slot.card.path,
            model_id=slot.card.id,
            index=slot.index,
            writer=slot.writer,
            config=self.engine_config,
            memory_monitor=self.monitor,
            thread_load=self.thread_load,
            draft_model=slot.card.draft_path,
        )
        slot.loaded_at = time.monotonic()
        self.loads += 1
        self.last_load_s = time.perf_counter() - started
        return slot.ref

    async def _start_monitor(self) -> None:
        """The memory monitor, before any scheduler: each gets its ref at spawn, and it gets
        the pool's (it asks the pool to unload under hard pressure) and every scheduler's
        name (they come and go with their models: it finds them at each poll). A restarted
        pool adopts the monitor its predecessor started."""
        if self.monitor_settings is None:
            return
        self.monitor = _alive(self.system.find(MONITOR_NAME)) or await self.system.spawn(
            MemoryMonitor,
            name=MONITOR_NAME,
            thread=MEMORY_THREAD,
            restart=Restart.PERMANENT,
            mailbox_size=64,
            pool=self.ref,
            schedulers=[slot.names.scheduler for slot in self.slots.values()],
            **self.monitor_settings,
        )

    async def _start_cache(self, slot: EngineSlot) -> None:
        """The model's cache index and SSD writer: started with its first load and kept
        across unloads (the disk tier stays useful; they hold no MLX memory)."""
        cache = self.cache or {}
        names = slot.names
        if slot.index is None:
            if slot.writer is not None:
                # A writer adopted without its index tells the index it was spawned with: a
                # new index gets a new writer (the old one stops, dropping what it holds).
                await self.system.stop(slot.writer)
                slot.writer = None
            slot.index = await self.system.spawn(
                CacheIndex,
                name=names.cache_index,
                thread=CACHE_INDEX_THREAD,
                restart=Restart.PERMANENT,
                mailbox_size=4096,
                cache_dir=cache["cache_dir"],
                fingerprint=slot.card.fingerprint,
                disk_max_bytes=cache["disk_max_bytes"],
                block_size=self.engine_config.block_size,
            )
        if slot.writer is None:
            # The writer's mailbox is the bounded write queue the scheduler waits on (~250 ms).
            slot.writer = await self.system.spawn(
                SsdWriter,
                name=names.ssd_writer,
                thread="ssd",
                restart=Restart.PERMANENT,
                mailbox_size=64,
                cache_dir=cache["cache_dir"],
                fingerprint=slot.card.fingerprint,
                disk_max_bytes=cache["disk_max_bytes"],
                index=slot.index,
            )

    async def _make_room(self, slot: EngineSlot) -> None:
        """Unload idle models, least recently used first, until ``slot`` fits the budget."""
        budget = self.models_memory
        if budget is None:
            return
        need = slot.memory.weights_bytes

        def loaded_bytes() -> int:
            return sum(s.memory.weights_bytes for s in self._loaded())

        if loaded_bytes() + need <= budget:
            return
        candidates = []
        for other in self._loaded():
            load = await self._load_of(other)
            if not other.pinned and load is not None and load.in_flight == 0:
                candidates.append((-load.idle_s, other))
        for _, other in sorted(candidates, key=lambda c: c[0], reverse=True):
            await self._unload(other, f"making room for {slot.card.id}")
            if loaded_bytes() + need <= budget:
                return
        if not self._loaded():
            log.warning("%s (%d MB) alone exceeds --models-memory (%d MB); loading it anyway",
                        slot.card.id, need // 10**6, budget // 10**6)
            return
        self.refused += 1
        busy = ", ".join(s.card.id for s in self._loaded())
        raise AdmissionError(
            "unavailable",
            f"model {slot.card.id!r} cannot be loaded now: the models memory budget "
            f"({budget} bytes) is held by models in use or pinned ({busy}); retry shortly",
            code="models_busy", retry_after=RETRY_AFTER_S,
        )

    # -- unloading -----------------------------------------------------------------------------

    async def _load_of(self, slot: EngineSlot) -> EngineLoad | None:
        if slot.ref is None:
            return None
        try:
            return await slot.ref.ask(DescribeLoad(), timeout=ASK_TIMEOUT_S)
        except (ActorDead, AskTimeout):
            return None

    async def _unload(self, slot: EngineSlot, why: str) -> bool:
        """Stop the model's scheduler if it is idle; True if it was unloaded."""
        ref = slot.ref
        if ref is None or not ref.alive:
            return False
        try:
            retired = await ref.ask(Retire(), timeout=ASK_TIMEOUT_S)
        except (ActorDead, AskTimeout):
            retired = False
        if not retired:
            return False
        started = time.perf_counter()
        before = mx.get_active_memory()
        await self.system.stop(ref)
        slot.ref = None
        gc.collect()
        mx.clear_cache()
        if not await self._others_serving(slot):
            # Alone, the memory just freed can be watched going: wait until it has, so the
            # next load is measured against what is really free. With other engines serving
            # their steps move the counters too: the unload is accounted for at once.
            await _settle(before - slot.memory.weights_bytes)
        self.unloads += 1
        self.last_unload_s = time.perf_counter() - started
        log.info("unloaded %s (%s) in %.2fs", slot.card.id, why, self.last_unload_s)
        return True

    async def _others_serving(self, slot: EngineSlot) -> bool:
        for other in self._loaded():
            if other is slot:
                continue
            load = await self._load_of(other)
            if load is None or load.in_flight:
                return True
        return False

    def report(self) -> dict[str, Any]:
        return {
            "models": [slot.card.id for slot in self.slots.values()],
            "loaded": [slot.card.id for slot in self.slots.values() if slot.loaded],
            "pinned": sorted(slot.card.id for slot in self.slots.values() if slot.pinned),
            "loaded_weights_bytes": sum(s.memory.weights_bytes for s in self.slots.values()
                                        if s.loaded),
            "models_memory_bytes": self.models_memory or 0,
            "loads": self.loads,
            "unloads": self.unloads,
            "refused": self.refused,
            "last_load_s": round(self.last_load_s, 3),
            "last_unload_s": round(self.last_unload_s, 3),
            # Each model's own memory and state (the dashboard's models table).
            "per_model": {slot.card.id: {"loaded": slot.loaded, "pinned": slot.pinned,
                                         "weights_bytes": slot.memory.weights_bytes}
                          for slot in list(self.slots.values())},
        }


async def _settle(target: int) -> None:
    """Wait until MLX's active memory is at ``target`` or stops falling (or the timeout)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    last = mx.get_active_memory()
    while time.monotonic() < deadline and last > target:
        await asyncio.sleep(SETTLE_POLL_S)
        now = mx.get_active_memory()
        if now >= last:
            return
        last = now


def _alive(ref: ActorRef | None) -> ActorRef | None:
    return ref if ref is not None and ref.alive else None
