"""The prefix cache's RAM tier: the one table of the blocks held in RAM, on the MLX thread.

The engine owns it and the scheduler actor calls it directly: a lookup is a plain call. The
cache index actor keeps only the disk catalogue (``actors/cache_index.py``); the scheduler asks
it about the blocks this table does not hold.
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Sequence
from typing import Any

from troupe.actors.engine.hot_cache import HOT_ENTRIES, HotCaches
from troupe.actors.engine.kv_blocks import KVBlock, common_prefix
from troupe.actors.engine.lru import Lru

# Most blocks one store or one spill frees: a bounded burst, the rest goes on the next call.
EVICT_BURST = 32


class PrefixCache:
    """The KV blocks in RAM by hash (tails included), within ``max_bytes``.

    A lookup only uses the leading chain of a prompt, so a block is worth keeping only while
    its ancestors are kept. The LRU order therefore keeps every block older than its
    ancestors: a new block goes right before its parent, a lookup touches its hits deepest
    first, and eviction, oldest first, takes leaves first. A block whose parent is not here
    cannot be reached from RAM: it becomes the oldest, the next to go. When one chain outgrows
    the budget, its beginning stays.

    Each parent's children are kept too, so that after the longest chain of whole blocks a
    prompt can take the longest shared run of tokens from any block that follows the same
    parent (a partial hit). The blocks that start a chain are the children of its root
    (``KVBlock.root``): a prompt's partial hit at its start never reads another namespace's.

    Besides the blocks, the last few finished sequences' caches are kept whole (``hot``,
    ``actors/engine/hot_cache.py``) within the same budget: they give way first when a block
    needs room, and all go when memory is short (``spill``, ``drop_hot``).

    Only the MLX thread calls it. ``len``, ``nbytes`` and ``stats()`` may be read from another
    thread (the scheduler's report): they are plain ints kept as blocks come and go, never a
    walk over the blocks.
    """

    def __init__(self, max_bytes: int, *, block_size: int = 0,
                 evict_burst: int = EVICT_BURST, hot_entries: int = HOT_ENTRIES) -> None:
        if evict_burst < 1:
            raise ValueError(f"evict_burst must be at least 1, got {evict_burst}")
        self.max_bytes = max_bytes
        # Tokens of a whole block: what a lookup counts as missed for each block not here.
        self.block_size = block_size
        self.evict_burst = evict_burst
        self._blocks: dict[str, KVBlock] = {}
        # By what they follow: a parent block's hash, or a chain's root (``_follows``).
        self._children: dict[str, dict[str, KVBlock]] = {}
        self._lru = Lru()
        self.hit_tokens = self.miss_tokens = 0
        self.evicted = self.spilled = 0
        self.hot = HotCaches(hot_entries)

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, h: object) -> bool:
        return h in self._blocks

    def __iter__(self) -> Iterator[str]:
        """Hashes, least recently used first. Do not change the cache while iterating."""
        return iter(self._lru)

    def __getitem__(self, h: str) -> KVBlock:
        return self._blocks[h]

    def get(self, h: str) -> KVBlock | None:
        return self._blocks.get(h)

    def values(self) -> Iterator[KVBlock]:
        return iter(self._blocks.values())

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

    # -- lookups ------------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[str]) -> list[KVBlock]:
        """The blocks of the longest leading chain of ``hashes`` held here. They become the
        most recently used (the first block last); hit and missed tokens are counted."""
        hits: list[KVBlock] = []
        for h in hashes:
            block = self._blocks.get(h)
            if block is None:
                break
            hits.append(block)
        for block in reversed(hits):
            self._lru.touch(block.block_hash)
        self.hit_tokens += sum(b.n_tokens for b in hits)
        self.miss_tokens += (len(hashes) - len(hits)) * self.block_size
        return hits

    def best_partial(
        self, parent: str | None, tokens: Sequence[int], root: str = ""
    ) -> tuple[KVBlock | None, int]:
        """The block after ``parent`` (None: at the start of the chain from ``root``) sharing
        the longest run of ``tokens`` (and its length; (None, 0) when none shares a first
        token). Ties go to the newest block. The block found is used: it becomes recently
        used, still older than its parent."""
        best, best_n = None, 0
        if not tokens:
            return best, best_n
        for block in self._children.get(root if parent is None else parent, {}).values():
            if not block.tokens or block.tokens[0] != tokens[0]:
                continue
            n = common_prefix(block.tokens, tokens)
            if n >= best_n:
                best, best_n = block, n
        if best is not None and (parent is None or parent in self._blocks):
            # Newer than it was, so still newer than the blocks below it.
            self._place(best.block_hash, parent, self._lru.size(best.block_hash))
        return best, best_n

    # -- storing and freeing ------------------------------------------------------------------

    def store(self, block: KVBlock) -> bool:
        """Hold ``block``, then evict least recently used blocks, at most a burst, while over
        the budget. False if it was held already (it stays as it was). A block larger than the
        whole budget is not held (and counted as evicted). A block queued for the disk may be
        evicted: whoever queued it holds its own reference."""
        h = block.block_hash
        if h in self._blocks:
            return False
        if block.nbytes > self.max_bytes:
            self.evicted += 1  # evicting the others for it would leave it over budget alone
            return True
        self._blocks[h] = block
        self._children.setdefault(_follows(block), {})[h] = block
        self._place(h, block.parent_hash, block.nbytes)
        self._below(h)
        excess = self._lru.nbytes + self.hot.nbytes - self.max_bytes
        if excess > 0 and len(self.hot):
            excess -= self.hot.evict(excess)  # the hot caches make room first
        victims: list[str] = []
        for v in self._lru:
            if excess <= 0 or len(victims) >= self.evict_burst:
                break
            victims.append(v)
            excess -= self._lru.size(v)
        for v in victims:
            self._remove(v)
        self.evicted += len(victims)
        return True

    def spill_victims(self, on_disk: Container[str], *, unpersisted: bool = False) -> list[str]:
        """Blocks to free under memory pressure, least recently used first, at most a burst:
        those in ``on_disk`` (only their RAM copy goes), then with ``unpersisted`` the others
        (tails included), which are lost to the cache."""
        victims = [h for h in self._lru if h in on_disk][: self.evict_burst]
        if unpersisted and len(victims) < self.evict_burst:
            victims += [h for h in self._lru if h not in on_disk][
                : self.evict_burst - len(victims)]
        return victims

    def spill(self, hashes: Sequence[str]) -> int:
        """Free these blocks (memory pressure), and every hot cache first; how many blocks
        were here."""
        self.hot.clear()
        spilled = sum(self._remove(h) for h in hashes)
        self.spilled += spilled
        return spilled

    def stats(self) -> dict[str, Any]:
        """The RAM tier for a report: blocks, bytes against the budget, lookups, evictions."""
        looked_up = self.hit_tokens + self.miss_tokens
        return {
            "ram_blocks": len(self._blocks),
            "ram_block_bytes": self._lru.nbytes,
            "ram_max_bytes": self.max_bytes,
            "ram_hit_tokens": self.hit_tokens,
            "ram_miss_tokens": self.miss_tokens,
            "ram_hit_rate": self.hit_tokens / looked_up if looked_up else 0.0,
            "ram_evicted": self.evicted,
            "ram_spilled": self.spilled,
            **self.hot.stats(),
        }

    # -- the hot caches -------------------------------------------------------------------------

    def keep_hot(self, tokens: Sequence[int], cache: list[Any], root: str = "") -> bool:
        """Keep a finished sequence's whole cache (of the chain from ``root``) in what the
        blocks leave of the budget; False if it did not fit."""
        return self.hot.put(tokens, cache, self.max_bytes - self._lru.nbytes, root)

    def take_hot(self, prompt: Sequence[int], start: int, root: str = "") -> list[Any] | None:
        """A hot cache of the chain from ``root`` holding the prompt's first ``start`` tokens
        and room for all of it, no longer held here (``HotCaches.take``); None if none
        serves."""
        return self.hot.take(prompt, start, root)

    def drop_hot(self) -> int:
        """Drop every hot cache (memory is short, or the batch was reset); how many."""
        return self.hot.clear()

    # -- internals ----------------------------------------------------------------------------

    def _place(self, h: str, parent: str | None, nbytes: int) -> None:
        # Right before its parent if the parent is here; a root is the newest; a block whose
        # parent is gone cannot be reached, so it is the oldest.
        self._lru.put(h, nbytes, before=parent,
                      oldest=parent is not None and parent not in self._blocks)

    def _below(self, h: str, *, to_front: bool = False) -> None:
        """Place the blocks held below ``h`` each right before its parent, or with
        ``to_front`` at the front, each older than its parent. Usually there are none: blocks
        are stored parents first and evicted leaves first."""
        stack = list(self._children.get(h, ()))
        while stack:  # parents first: each one's descendants then go in front of it
            x = stack.pop()
            self._lru.put(x, self._lru.size(x), before=None if to_front else
                          self._blocks[x].parent_hash, oldest=to_front)
            stack.extend(self._children.get(x, ()))

    def _remove(self, h: str) -> bool:
        block = self._blocks.pop(h, None)
        if block is None:
            return False
        self._lru.pop(h)
        follows = _follows(block)
        siblings = self._children.get(follows)
        if siblings is not None:
            siblings.pop(h, None)
            if not siblings:
                del self._children[follows]
        # What it held up can no longer be reached from RAM: it goes next.
        self._below(h, to_front=True)
        return True


def _follows(block: KVBlock) -> str:
    """What a block follows: its parent's hash, or for the first block of a chain (and a tail
    shorter than a block) the chain's root."""
    return block.root if block.parent_hash is None else block.parent_hash
