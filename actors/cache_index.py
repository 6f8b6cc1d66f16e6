"""The cache index actor: the paged prefix cache's metadata (where each block lives, LRU, sizes).

Spawn it with ``thread=CACHE_INDEX_THREAD``, before the SSD writer (actors stop in reverse start
order, so the writer can still index its last writes while it stops): the start-up scan and the
file deletions of disk eviction run on that thread, never on the event loop and never behind
the writer's pending writes. The policy is the synchronous ``BlockTable``; the actor is a shell
around it that talks to the scheduler and the writer.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from actors import block_store
from actors.cache_messages import (
    BlockPersisted,
    BlocksStored,
    BlockWriteFailed,
    DropRamBlocks,
    ForgetBlocks,
    LookupPrefix,
    MakeRoom,
    PrefixHit,
    RamBlocksDropped,
    SpillRam,
)
from runtime import Actor, ActorDead, MailboxFull

log = logging.getLogger("actors.cache_index")

CACHE_INDEX_THREAD = "cache-index"


class BlockMeta(NamedTuple):
    parent: str | None
    n_tokens: int


class Lru:
    """The blocks of one tier with their sizes, least recently used first.

    A doubly linked list over a dict (as in ``functools.lru_cache``) rather than an
    ``OrderedDict``, which can only move a key to an end: a new block must go right before its
    parent, in O(1) however deep the chain. ``len`` and ``nbytes`` may be read from any thread.
    """

    __slots__ = ("_nodes", "_root", "nbytes")

    _PREV, _NEXT, _KEY, _SIZE = 0, 1, 2, 3

    def __init__(self) -> None:
        root: list[Any] = []
        root[:] = [root, root, None, 0]
        self._root = root
        self._nodes: dict[str, list[Any]] = {}
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, h: object) -> bool:
        return h in self._nodes

    def __iter__(self) -> Iterator[str]:
        """Oldest first. Do not change the list while iterating."""
        node = self._root[self._NEXT]
        while node is not self._root:
            yield node[self._KEY]
            node = node[self._NEXT]

    def size(self, h: str) -> int:
        return self._nodes[h][self._SIZE]

    def put(self, h: str, size: int, *, before: str | None = None, oldest: bool = False) -> None:
        """Add or move ``h``: newest by default, right before block ``before`` if that is
        here, or oldest."""
        node = self._nodes.get(h)
        if node is None:
            node = self._nodes[h] = [None, None, h, size]
            self.nbytes += size
        else:
            self._unlink(node)
            self.nbytes += size - node[self._SIZE]
            node[self._SIZE] = size
        if before is not None and before in self._nodes and before != h:
            anchor = self._nodes[before]
        elif oldest:
            anchor = self._root[self._NEXT]
        else:
            anchor = self._root
        prev = anchor[self._PREV]
        node[self._PREV], node[self._NEXT] = prev, anchor
        prev[self._NEXT] = anchor[self._PREV] = node

    def touch(self, h: str) -> None:
        """Make ``h`` the most recently used."""
        self.put(h, self._nodes[h][self._SIZE])

    def pop(self, h: str) -> int | None:
        """Remove ``h``; its size, or None if it was not here."""
        node = self._nodes.pop(h, None)
        if node is None:
            return None
        self._unlink(node)
        self.nbytes -= node[self._SIZE]
        return node[self._SIZE]

    def _unlink(self, node: list[Any]) -> None:
        prev, nxt = node[self._PREV], node[self._NEXT]
        prev[self._NEXT], nxt[self._PREV] = nxt, prev


class BlockTable:
    """Which blocks are in RAM and on disk, in LRU order per tier, within two byte budgets.

    Plain synchronous code: no I/O, no actors. A lookup only uses the leading chain of a
    prompt, so a block is worth keeping only while its ancestors are kept. Each tier's order
    therefore keeps every block older than its ancestors: a new block goes right before its
    parent, a lookup touches its hits deepest first, and eviction, oldest first, takes leaves
    first. A block whose parent is in neither tier can never be hit again: it becomes the
    oldest, the next to go. When one chain outgrows a budget, its beginning stays.

    ``report()`` reads it from another thread: counts are plain ints or ``len``s.
    """

    def __init__(
        self, *, ram_max_bytes: int, disk_max_bytes: int, evict_burst: int = 32,
        block_size: int = 0,
    ) -> None:
        if evict_burst < 1:
            raise ValueError(f"evict_burst must be at least 1, got {evict_burst}")
        self.ram_max_bytes = ram_max_bytes
        self.disk_max_bytes = disk_max_bytes
        self.evict_burst = evict_burst
        # Tokens a block holds, for counting missed tokens of blocks the index has never seen;
        # 0 means "learn it from the blocks stored".
        self.block_size = block_size
        self.meta: dict[str, BlockMeta] = {}
        self.children: dict[str, set[str]] = {}
        self.ram = Lru()
        self.disk = Lru()
        self.both = 0
        self.hit_blocks = self.miss_blocks = self.hit_tokens = self.miss_tokens = 0
        self.evicted_ram = self.evicted_disk = 0

    @property
    def ram_bytes(self) -> int:
        return self.ram.nbytes

    @property
    def disk_bytes(self) -> int:
        return self.disk.nbytes

    # -- queries ------------------------------------------------------------------------------

    def lookup(self, hashes: list[str]) -> list[str]:
        """The tier ("ram" or "disk") of each block of the longest leading chain present.

        A block in both tiers counts as "ram". Hits become the most recently used; hit and
        miss blocks and tokens are counted.
        """
        tiers: list[str] = []
        for h in hashes:
            if h in self.ram:
                tiers.append("ram")
            elif h in self.disk:
                tiers.append("disk")
            else:
                break
        hits = hashes[: len(tiers)]
        for h in reversed(hits):  # deepest first: the root ends up the most recently used
            for lru in (self.ram, self.disk):
                if h in lru:
                    lru.touch(h)
        missed = hashes[len(tiers):]
        self.hit_blocks += len(hits)
        self.hit_tokens += sum(self.meta[h].n_tokens for h in hits)
        self.miss_blocks += len(missed)
        self.miss_tokens += sum(
            self.meta[h].n_tokens if h in self.meta else self.block_size for h in missed
        )
        return tiers

    def ram_only(self) -> list[str]:
        """RAM blocks not yet on disk, least recently used first (what a spill would write)."""
        return [h for h in self.ram if h not in self.disk]

    def has_room(self, nbytes: int) -> bool:
        """True if a file of ``nbytes`` fits the disk quota now."""
        return self.disk.nbytes + nbytes <= self.disk_max_bytes

    # -- RAM tier -----------------------------------------------------------------------------

    def store_ram(self, blocks: list[tuple[str, str | None, int, int]]) -> None:
        """The scheduler holds these blocks (hash, parent, n_tokens, bytes) in RAM now."""
        for h, parent, n_tokens, nbytes in blocks:
            self._add(self.ram, self.disk, h, parent, n_tokens, nbytes)

    def ram_victims(self) -> list[str]:
        """Least recently used RAM blocks to drop to get back under the RAM budget, at most
        ``evict_burst`` of them (the rest waits for the next store)."""
        return self._victims(self.ram, self.ram.nbytes - self.ram_max_bytes)

    def spill_victims(self, *, unpersisted: bool = False) -> list[str]:
        """RAM blocks to free under memory pressure, least recently used first, at most
        ``evict_burst``: those also on disk (only their RAM copy goes), then with
        ``unpersisted`` those not on disk yet."""
        victims = [h for h in self.ram if h in self.disk][: self.evict_burst]
        if unpersisted and len(victims) < self.evict_burst:
            victims += [h for h in self.ram if h not in self.disk][
                : self.evict_burst - len(victims)]
        return victims

    def drop_ram(self, hashes: list[str], *, evicted: bool = False) -> None:
        """These blocks are no longer in RAM; blocks on neither tier are forgotten."""
        dropped = self._drop(self.ram, self.disk, hashes)
        if evicted:
            self.evicted_ram += dropped

    # -- disk tier ----------------------------------------------------------------------------

    def add_disk(self, h: str, parent: str | None, n_tokens: int, nbytes: int) -> None:
        """The block's file (``nbytes`` long) is on disk now."""
        self._add(self.disk, self.ram, h, parent, n_tokens, nbytes)

    def load_disk(self, blocks: list[tuple[str, str | None, int, int]]) -> None:
        """The files found at start-up (hash, parent, n_tokens, bytes), least recently used
        first. All are known before any is placed, so that a file older than its parent is not
        taken for unreachable."""
        for h, parent, n_tokens, _ in blocks:
            self._remember(h, parent, n_tokens)
        for h, parent, n_tokens, nbytes in blocks:
            self.add_disk(h, parent, n_tokens, nbytes)

    def disk_victims(self, nbytes: int) -> list[str]:
        """Least recently used disk blocks whose files must go for ``nbytes`` more to fit the
        quota, at most ``evict_burst`` of them; none if ``nbytes`` alone exceeds the quota."""
        if nbytes > self.disk_max_bytes:
            return []
        return self._victims(self.disk, self.disk.nbytes + nbytes - self.disk_max_bytes)

    def drop_disk(self, hashes: list[str], *, evicted: bool = False) -> None:
        """These blocks' files are gone; blocks on neither tier are forgotten."""
        dropped = self._drop(self.disk, self.ram, hashes)
        if evicted:
            self.evicted_disk += dropped

    # -- internals ----------------------------------------------------------------------------

    def _add(
        self, lru: Lru, other: Lru, h: str, parent: str | None, n_tokens: int, nbytes: int
    ) -> None:
        self._remember(h, parent, n_tokens)
        if h not in lru and h in other:
            self.both += 1
        parent = self.meta[h].parent
        # Unreachable (parent in neither tier): oldest. Else right before its parent if the
        # parent is in this tier, else (a root, or a parent in the other tier) the newest.
        lru.put(h, nbytes, before=parent, oldest=parent is not None and parent not in self.meta)

    def _remember(self, h: str, parent: str | None, n_tokens: int) -> None:
        if h not in self.meta:
            self.meta[h] = BlockMeta(parent, n_tokens)
            if parent is not None:
                self.children.setdefault(parent, set()).add(h)
        if self.block_size == 0:
            self.block_size = n_tokens

    def _victims(self, lru: Lru, excess: int) -> list[str]:
        victims: list[str] = []
        for h in lru:
            if excess <= 0 or len(victims) >= self.evict_burst:
                break
            victims.append(h)
            excess -= lru.size(h)
        return victims

    def _drop(self, lru: Lru, other: Lru, hashes: list[str]) -> int:
        dropped = 0
        for h in hashes:
            if lru.pop(h) is None:
                continue
            dropped += 1
            if h in other:
                self.both -= 1
            else:
                self._forget(h)
        return dropped

    def _forget(self, h: str) -> None:
        """``h`` is in neither tier: its descendants can no longer be hit, so they go next."""
        parent = self.meta.pop(h).parent
        siblings = self.children.get(parent) if parent is not None else None
        if siblings is not None:
            siblings.discard(h)
            if not siblings:
                del self.children[parent]  # type: ignore[arg-type]
        for child in self.children.get(h, ()):
            for lru in (self.ram, self.disk):
                if child in lru:
                    lru.put(child, lru.size(child), oldest=True)


class CacheIndex(Actor):
    """The prefix cache's metadata, rebuilt from ``cache_dir`` on start.

    Messages: ``LookupPrefix`` (ask -> ``PrefixHit``), ``BlocksStored``, ``RamBlocksDropped``
    (from the scheduler); ``BlockPersisted``, ``BlockWriteFailed``, ``ForgetBlocks`` and
    ``MakeRoom`` (ask -> bool) from the SSD writer; ``SpillRam`` from the memory monitor.
    Over the RAM budget (or under memory pressure) it tells the actor named ``scheduler`` to
    ``DropRamBlocks``; over the disk quota it deletes files itself.
    """

    def __init__(
        self,
        *,
        cache_dir: str,
        fingerprint: str,
        ram_max_bytes: int,
        disk_max_bytes: int,
        scheduler: str = "scheduler",
        evict_burst: int = 32,
        block_size: int = 0,
    ) -> None:
        self.cache_dir = Path(cache_dir)
        self.fingerprint = fingerprint
        self.scheduler_name = scheduler
        self.table = BlockTable(
            ram_max_bytes=ram_max_bytes, disk_max_bytes=disk_max_bytes,
            evict_burst=evict_burst, block_size=block_size,
        )
        self.skipped: dict[str, int] = dict.fromkeys(block_store.SKIP_REASONS, 0)
        self.write_failures = 0
        self.forgotten = 0
        self.ram_evictions_deferred = 0
        self.spilled = 0

    async def on_start(self) -> None:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        scan = block_store.scan_cache_dir(self.cache_dir, self.fingerprint)
        self.table.load_disk([(b.block_hash, b.parent_hash, b.n_tokens, b.nbytes)
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
        msg: LookupPrefix | BlocksStored | RamBlocksDropped | BlockPersisted | BlockWriteFailed
        | ForgetBlocks | MakeRoom | SpillRam,
    ) -> Any:
        match msg:
            case LookupPrefix(hashes=hashes):
                return PrefixHit(tiers=self.table.lookup(hashes))
            case BlocksStored(blocks=blocks):
                self.table.store_ram(blocks)
                self._evict_ram()
            case RamBlocksDropped(hashes=hashes):
                self.table.drop_ram(hashes)
            case BlockPersisted(block_hash=h, parent_hash=parent, n_tokens=n, nbytes=nbytes):
                self.table.add_disk(h, parent, n, nbytes)
            case BlockWriteFailed(block_hash=h, error=error):
                self.write_failures += 1
                log.debug("block %s was not written: %s", h, error)
            case ForgetBlocks(hashes=hashes):
                self.forgotten += sum(h in self.table.disk for h in hashes)
                self.table.drop_disk(hashes)
            case MakeRoom(nbytes=nbytes):
                return self._make_room(nbytes)
            case SpillRam(unpersisted=unpersisted):
                self.spilled += self._drop_from_scheduler(
                    self.table.spill_victims(unpersisted=unpersisted))
        return None

    def report(self) -> dict[str, Any]:
        """Blocks and bytes per tier, hits and misses, evictions, start-up skips."""
        t = self.table
        looked_up = t.hit_tokens + t.miss_tokens
        return {
            "blocks": {"ram": len(t.ram), "disk": len(t.disk), "both": t.both},
            "ram_only_blocks": len(t.ram) - t.both,
            "ram_bytes": t.ram_bytes,
            "ram_max_bytes": t.ram_max_bytes,
            "disk_bytes": t.disk_bytes,
            "disk_max_bytes": t.disk_max_bytes,
            "hit_blocks": t.hit_blocks,
            "miss_blocks": t.miss_blocks,
            "hit_tokens": t.hit_tokens,
            "miss_tokens": t.miss_tokens,
            "hit_rate": t.hit_tokens / looked_up if looked_up else 0.0,
            "evicted": {"ram": t.evicted_ram, "disk": t.evicted_disk},
            "ram_evictions_deferred": self.ram_evictions_deferred,
            "spilled": self.spilled,
            "write_failures": self.write_failures,
            "forgotten": self.forgotten,
            "skipped": dict(self.skipped),
        }

    def _make_room(self, nbytes: int) -> bool:
        """Delete least recently used files (one bounded burst) until ``nbytes`` fits."""
        victims = self.table.disk_victims(nbytes)
        for h in victims:
            try:
                os.unlink(block_store.block_path(self.cache_dir, h))
            except FileNotFoundError:
                pass
            except OSError as exc:
                # Forgotten anyway: retrying the same file on every call would block eviction.
                log.error("cache: could not delete block %s: %s", h, exc)
        self.table.drop_disk(victims, evicted=True)
        return self.table.has_room(nbytes)

    def _evict_ram(self) -> None:
        """Over the RAM budget: tell the scheduler to drop a burst of LRU blocks."""
        self._drop_from_scheduler(self.table.ram_victims())

    def _drop_from_scheduler(self, victims: list[str]) -> int:
        """Tell the scheduler to drop these RAM blocks and forget them; how many went."""
        if not victims:
            return 0
        ref = self.system.find(self.scheduler_name)
        if ref is not None and ref.alive:
            try:
                # Never wait for room: the scheduler may be waiting for our answer to a lookup.
                ref.try_tell(DropRamBlocks(hashes=victims))
            except MailboxFull:
                # Still held by the scheduler: keep them indexed, evict on a later call.
                self.ram_evictions_deferred += 1
                return 0
            except ActorDead:
                pass  # its RAM blocks went with it
        self.table.drop_ram(victims, evicted=True)
        return len(victims)
