"""The cache index actor: the prefix cache's disk catalogue (which blocks have files, LRU, sizes).

Spawn it with ``thread=CACHE_INDEX_THREAD``, before the SSD writer (actors stop in reverse start
order, so the writer can still index its last writes while it stops): the start-up scan and the
file deletions of disk eviction run on that thread, never on the event loop and never behind
the writer's pending writes. The policy is the synchronous ``DiskTable``; the actor is a shell
around it that answers the writer and the scheduler. The blocks in RAM are the engine's own
table (``actors/engine/prefix_cache.py``), which this actor knows nothing of.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, NamedTuple

from troupe.actors import block_store
from troupe.actors.cache_messages import (
    BlockPersisted,
    BlockWriteFailed,
    ForgetBlocks,
    FoundOnDisk,
    HeldOnDisk,
    LookupDisk,
    MakeRoom,
    OnDisk,
)
from troupe.actors.engine.lru import Lru
from troupe.runtime import Actor, ActorDead, ActorRef

log = logging.getLogger("actors.cache_index")

CACHE_INDEX_THREAD = "cache-index"


class BlockMeta(NamedTuple):
    parent: str | None
    n_tokens: int


class DiskTable:
    """Which blocks have files, in LRU order, within a byte quota.

    Plain synchronous code: no I/O, no actors. A lookup only uses the leading chain of a
    prompt, so a block is worth keeping only while its ancestors are kept. The order therefore
    keeps every block older than its ancestors: a new block goes right before its parent, a
    lookup touches its hits deepest first, and eviction, oldest first, takes leaves first. A
    block whose parent's file was dropped can never be read after it: it becomes the oldest,
    the next to go. When one chain outgrows the quota, its beginning stays.

    ``report()`` reads it from another thread: counts are plain ints or ``len``s.
    """

    def __init__(self, *, disk_max_bytes: int, evict_burst: int = 32, block_size: int = 0) -> None:
        if evict_burst < 1:
            raise ValueError(f"evict_burst must be at least 1, got {evict_burst}")
        self.disk_max_bytes = disk_max_bytes
        self.evict_burst = evict_burst
        # Tokens a block holds, for counting missed tokens of blocks the index has never seen;
        # 0 means "learn it from the blocks added".
        self.block_size = block_size
        self.meta: dict[str, BlockMeta] = {}
        self.children: dict[str, set[str]] = {}
        self.disk = Lru()
        self.hit_blocks = self.miss_blocks = self.hit_tokens = self.miss_tokens = 0
        self.evicted = 0

    @property
    def disk_bytes(self) -> int:
        return self.disk.nbytes

    # -- queries ------------------------------------------------------------------------------

    def lookup(self, hashes: list[str]) -> int:
        """How many leading blocks of ``hashes`` have files. Hits become the most recently
        used; hit and miss blocks and tokens are counted."""
        n = 0
        while n < len(hashes) and hashes[n] in self.disk:
            n += 1
        hits, missed = hashes[:n], hashes[n:]
        for h in reversed(hits):  # deepest first: the root ends up the most recently used
            self.disk.touch(h)
        self.hit_blocks += len(hits)
        self.hit_tokens += sum(self.meta[h].n_tokens for h in hits)
        self.miss_blocks += len(missed)
        self.miss_tokens += sum(
            self.meta[h].n_tokens if h in self.meta else self.block_size for h in missed
        )
        return n

    def on_disk(self, hashes: list[str]) -> list[str]:
        """Those of ``hashes`` that have files, in the order given."""
        return [h for h in hashes if h in self.disk]

    def has_room(self, nbytes: int) -> bool:
        """True if a file of ``nbytes`` fits the quota now."""
        return self.disk.nbytes + nbytes <= self.disk_max_bytes

    # -- changes ------------------------------------------------------------------------------

    def add(self, h: str, parent: str | None, n_tokens: int, nbytes: int) -> None:
        """The block's file (``nbytes`` long) is on disk now."""
        self._remember(h, parent, n_tokens)
        self._place(h, nbytes)

    def load(self, blocks: list[tuple[str, str | None, int, int]]) -> None:
        """The files found at start-up (hash, parent, n_tokens, bytes), least recently used
        first. All are known before any is placed, so that a file older than its parent is not
        taken for unreachable."""
        for h, parent, n_tokens, _ in blocks:
            self._remember(h, parent, n_tokens)
        for h, _, _, nbytes in blocks:
            self._place(h, nbytes)

    def victims(self, nbytes: int) -> list[str]:
        """Least recently used blocks whose files must go for ``nbytes`` more to fit the quota,
        at most ``evict_burst`` of them; none if ``nbytes`` alone exceeds the quota."""
        if nbytes > self.disk_max_bytes:
            return []
        excess = self.disk.nbytes + nbytes - self.disk_max_bytes
        victims: list[str] = []
        for h in self.disk:
            if excess <= 0 or len(victims) >= self.evict_burst:
                break
            victims.append(h)
            excess -= self.disk.size(h)
        return victims

    def drop(self, hashes: list[str], *, evicted: bool = False) -> int:
        """These blocks' files are gone; how many were known."""
        dropped = 0
        for h in hashes:
            if self.disk.pop(h) is None:
                continue
            dropped += 1
            self._forget(h)
        if evicted:
            self.evicted += dropped
        return dropped

    # -- internals ----------------------------------------------------------------------------

    def _place(self, h: str, nbytes: int) -> None:
        # Right before its parent; a root is the newest. A block whose parent has no file
        # cannot be read after it (the engine may hold the parent in RAM, but the index cannot
        # know): the oldest.
        parent = self.meta[h].parent
        self.disk.put(h, nbytes, before=parent,
                      oldest=parent is not None and parent not in self.meta)

    def _remember(self, h: str, parent: str | None, n_tokens: int) -> None:
        if h not in self.meta:
            self.meta[h] = BlockMeta(parent, n_tokens)
            if parent is not None:
                self.children.setdefault(parent, set()).add(h)
        if self.block_size == 0:
            self.block_size = n_tokens

    def _forget(self, h: str) -> None:
        """``h`` has no file: the files of its descendants can no longer be read after it, so
        they go next."""
        parent = self.meta.pop(h).parent
        siblings = self.children.get(parent) if parent is not None else None
        if siblings is not None:
            siblings.discard(h)
            if not siblings:
                del self.children[parent]  # type: ignore[arg-type]
        for child in self.children.get(h, ()):
            if child in self.disk:
                self.disk.put(child, self.disk.size(child), oldest=True)


class CacheIndex(Actor):
    """The prefix cache's disk catalogue, rebuilt from ``cache_dir`` on start.

    Messages: ``BlockPersisted``, ``BlockWriteFailed``, ``ForgetBlocks`` and ``MakeRoom`` (ask
    -> how many of the files fit) from the SSD writer; ``LookupDisk`` and ``OnDisk`` from the
    scheduler, answered by message (``FoundOnDisk``, ``HeldOnDisk``) to the
    asker's ref they carry, or as an ``ask``. Over the disk quota it deletes files itself. It asks
    nothing of any actor, and only the scheduler (or a follower's disk clerk), which never
    waits on it, gets messages from it.
    """

    def __init__(
        self,
        *,
        cache_dir: str,
        fingerprint: str,
        disk_max_bytes: int,
        evict_burst: int = 32,
        block_size: int = 0,
    ) -> None:
        self.cache_dir = Path(cache_dir)
        self.fingerprint = fingerprint
        self.table = DiskTable(disk_max_bytes=disk_max_bytes, evict_burst=evict_burst,
                               block_size=block_size)
        self.skipped: dict[str, int] = dict.fromkeys(block_store.SKIP_REASONS, 0)
        self.write_failures = 0
        self.forgotten = 0
        self.room_asks = 0  # MakeRoom asked of it
        # Lookups whose asker (``reply_to``) had stopped when the answer was ready.
        self.missing_reply_targets = 0

    async def on_start(self) -> None:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        scan = block_store.scan_cache_dir(self.cache_dir, self.fingerprint)
        self.table.load([(b.block_hash, b.parent_hash, b.n_tokens, b.nbytes)
                         for b in scan.blocks])
        self.skipped = scan.skipped
        if any(scan.skipped.values()):
            log.warning(
                "cache %s: skipped %s at start-up (%d files deleted)",
                self.cache_dir, scan.skipped, scan.deleted,
            )
        log.info(
            "cache %s: %d blocks (%d bytes) on disk", self.cache_dir,
            len(self.table.disk), self.table.disk_bytes,
        )

    async def handle(
        self,
        msg: LookupDisk | OnDisk | BlockPersisted | BlockWriteFailed | ForgetBlocks | MakeRoom,
    ) -> Any:
        match msg:
            case LookupDisk(hashes=hashes, reply_to=reply_to):
                found = self.table.lookup(hashes)
                if reply_to is not None:
                    await self._answer(reply_to, FoundOnDisk(
                        request_id=msg.request_id, epoch=msg.epoch, blocks=found))
                return found
            case OnDisk(hashes=hashes, reply_to=reply_to):
                held = self.table.on_disk(hashes)
                if reply_to is not None:
                    await self._answer(reply_to, HeldOnDisk(hashes=held))
                return held
            case BlockPersisted(block_hash=h, parent_hash=parent, n_tokens=n, nbytes=nbytes):
                self.table.add(h, parent, n, nbytes)
            case BlockWriteFailed(block_hash=h, error=error):
                self.write_failures += 1
                log.debug("block %s was not written: %s", h, error)
            case ForgetBlocks(hashes=hashes):
                self.forgotten += self.table.drop(hashes)
            case MakeRoom(sizes=sizes):
                self.room_asks += 1
                return self._make_room_for(sizes)
            case _:
                raise TypeError(f"cache index cannot handle {type(msg).__name__}")
        return None

    def report(self) -> dict[str, Any]:
        """Blocks and bytes on disk against the quota, disk lookups, evictions, failed writes,
        start-up skips."""
        t = self.table
        looked_up = t.hit_tokens + t.miss_tokens
        return {
            "blocks": len(t.disk),
            "disk_bytes": t.disk_bytes,
            "disk_max_bytes": t.disk_max_bytes,
            "hit_blocks": t.hit_blocks,
            "miss_blocks": t.miss_blocks,
            "hit_tokens": t.hit_tokens,
            "miss_tokens": t.miss_tokens,
            "hit_rate": t.hit_tokens / looked_up if looked_up else 0.0,
            "evicted": t.evicted,
            "write_failures": self.write_failures,
            "forgotten": self.forgotten,
            "room_asks": self.room_asks,
            "missing_reply_targets": self.missing_reply_targets,
            "skipped": dict(self.skipped),
        }

    def _make_room(self, nbytes: int) -> bool:
        """Delete least recently used files (one bounded burst) until ``nbytes`` fits."""
        victims = self.table.victims(nbytes)
        for h in victims:
            try:
                os.unlink(block_store.block_path(self.cache_dir, h))
            except FileNotFoundError:
                pass
            except OSError as exc:
                # Forgotten anyway: retrying the same file on every call would block eviction.
                log.error("cache: could not delete block %s: %s", h, exc)
        self.table.drop(victims, evicted=True)
        return self.table.has_room(nbytes)

    async def _answer(self, asker: ActorRef, msg: FoundOnDisk | HeldOnDisk) -> None:
        """Tell the actor that asked; one that has stopped needs no answer (counted)."""
        try:
            await asker.tell(msg)
        except ActorDead:
            self.missing_reply_targets += 1
            log.warning("cache index: %r stopped before the answer to its lookup", asker.name)

    def _make_room_for(self, sizes: list[int]) -> int:
        """Make room (one bounded burst) for the files of ``sizes``, or for as many leading ones
        as the quota can hold; how many of them fit now."""
        total, fits = 0, []
        for size in sizes:
            total += size
            if total > self.table.disk_max_bytes:
                break
            fits.append(total)
        if not fits:
            return 0
        self._make_room(fits[-1])
        free = self.table.disk_max_bytes - self.table.disk_bytes
        return sum(1 for t in fits if t <= free)
