"""What the actors' reports say, for the dashboard: the cache of each engine, the memory, the
models, which mailboxes are backed up. Pure functions of the actor system's snapshots."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from troupe.runtime import ActorSnapshot

# A mailbox at least this full counts as backed up (it stands out on the page).
BACKED_UP = 0.5


def _key(name: str) -> str:
    """Which engine an actor belongs to: '' for the plain names, the model's key otherwise."""
    return name.partition(":")[2]


def is_scheduler(report: dict[str, Any]) -> bool:
    # Known by what they report, not their class: api/ never imports the actors. An unloaded
    # scheduler reports only its model and ``loaded: False``.
    return isinstance(report.get("model"), str) and isinstance(report.get("loaded"), bool) \
        and ("steps" in report or report["loaded"] is False)


def _is_cache_index(report: dict[str, Any]) -> bool:
    return "disk_max_bytes" in report and "skipped" in report


def _is_ssd_writer(report: dict[str, Any]) -> bool:
    return "persisted" in report and "pending" in report


def _is_memory_monitor(report: dict[str, Any]) -> bool:
    return "limit_bytes" in report and "usage_bytes" in report and "pressure" in report


def _is_pool(report: dict[str, Any]) -> bool:
    return isinstance(report.get("pinned"), list) and isinstance(report.get("models"), list)


def reports(snaps: Iterable[ActorSnapshot], kind: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(s.name, s.report) for s in snaps if s.report and kind(s.report)]


def scheduler_progress(snaps: list[ActorSnapshot]) -> dict[str, dict[str, Any]]:
    """Per-request progress, where a scheduler reports it (``report()["requests"]``: a list
    of ``{"id", "stage", "prefilled_tokens", ...}``); empty otherwise."""
    progress: dict[str, dict[str, Any]] = {}
    for _, report in reports(snaps, is_scheduler):
        for item in report.get("requests") or []:
            if isinstance(item, dict) and isinstance(item.get("id"), str):
                progress[item["id"]] = item
    return progress


def cache_view(snaps: list[ActorSnapshot]) -> list[dict[str, Any]]:
    """The prefix cache of each engine: blocks and bytes against quotas, hits, disk writes.

    The RAM tier and the hits are the scheduler's (nothing while its model is unloaded), the
    disk the cache index's, the writes the SSD writer's."""
    writers = {_key(name): (name, r) for name, r in reports(snaps, _is_ssd_writer)}
    depth = {s.name: s.mailbox_depth for s in snaps}
    schedulers = {_key(name): r for name, r in reports(snaps, is_scheduler)}
    engines = []
    for name, index in reports(snaps, _is_cache_index):
        key = _key(name)
        writer_name, writer = writers.get(key, (None, {}))
        scheduler = schedulers.get(key, {})
        # Prompt tokens served from the cache (RAM, disk, partial hits), and prefilled.
        hit, miss = scheduler.get("hit_tokens", 0), scheduler.get("miss_tokens", 0)
        engines.append({
            "name": name,
            "model": scheduler.get("model") or key or None,
            "ram_blocks": scheduler.get("ram_blocks", 0),
            "disk_blocks": index.get("blocks", 0),
            "ram_bytes": scheduler.get("ram_block_bytes", 0),
            "ram_max_bytes": scheduler.get("ram_max_bytes", 0),
            "disk_bytes": index.get("disk_bytes", 0),
            "disk_max_bytes": index.get("disk_max_bytes", 0),
            "hit_rate": hit / (hit + miss) if hit + miss else 0.0,
            "hit_tokens": hit,
            "miss_tokens": miss,
            # Queued: in the writer's own queue and still in its mailbox. Dropped: by the
            # writer, and by the scheduler when the writer's mailbox was full.
            "writes_queued": writer.get("pending", 0) + depth.get(writer_name or "", 0),
            "writes_dropped": writer.get("dropped", 0) + scheduler.get("blocks_dropped", 0),
            "persisted": writer.get("persisted", 0),
        })
    return engines


def memory_view(snaps: list[ActorSnapshot]) -> dict[str, Any] | None:
    """The memory monitor's reading: usage against the limit, and the pressure level."""
    monitors = reports(snaps, _is_memory_monitor)
    if not monitors:
        return None
    report = monitors[0][1]
    return {
        "usage_bytes": report.get("usage_bytes", 0),
        "limit_bytes": report.get("limit_bytes", 0),
        "high_water_bytes": report.get("high_water_bytes", 0),
        "rss_bytes": report.get("rss_bytes"),
        "pressure": report.get("pressure", "ok"),
        "limit_source": report.get("limit_source"),
    }


def models_view(snaps: list[ActorSnapshot]) -> dict[str, Any]:
    """The models in the pool: loaded or not, busy or idle, pinned, and their memory."""
    pools = reports(snaps, _is_pool)
    schedulers = {r.get("model"): r for _, r in reports(snaps, is_scheduler)}
    pool = pools[0][1] if pools else {}
    ids = list(pool.get("models") or schedulers)
    loaded = set(pool.get("loaded") or [m for m, r in schedulers.items() if r.get("loaded")])
    pinned = set(pool.get("pinned") or [])
    weights = pool.get("loaded_weights_bytes")
    # Per model where the pool says (``per_model``); with one model loaded, it is all of it.
    per_model = pool.get("per_model") if isinstance(pool.get("per_model"), dict) else {}
    rows = []
    for model in ids:
        scheduler = schedulers.get(model, {})
        busy = scheduler.get("running", 0) + scheduler.get("waiting", 0)
        memory = (per_model.get(model) or {}).get("weights_bytes")
        if memory is None and model in loaded and len(loaded) == 1:
            memory = weights
        rows.append({
            "id": model,
            "loaded": model in loaded,
            "state": ("retiring" if scheduler.get("retired") else "busy" if busy else "idle")
            if model in loaded else "not loaded",
            "running": scheduler.get("running", 0),
            "waiting": scheduler.get("waiting", 0),
            "pinned": model in pinned,
            "weights_bytes": memory,
            "tokens_per_s": scheduler.get("tokens_per_s", 0.0),
        })
    return {
        "models": rows,
        "loaded_weights_bytes": weights,
        "budget_bytes": pool.get("models_memory_bytes") or None,
    }


def backed_up(snap: ActorSnapshot) -> bool:
    """A mailbox at least half full, or senders waiting for room."""
    return snap.waiting_senders > 0 or snap.mailbox_depth >= BACKED_UP * snap.mailbox_capacity


def actor_signature(snaps: list[ActorSnapshot]) -> tuple[tuple[str, str, int, bool], ...]:
    """What of the actors is worth a snapshot at once when it changes."""
    return tuple((s.name, s.state, s.restarts, backed_up(s)) for s in snaps)
