"""Finished sequences' caches kept whole ("hot"), so that a repeated prompt starts without a copy.

A prefix-cache hit rebuilds its cache from blocks (``kv_blocks.build_cache``): a concatenate
of every block per layer into a fresh buffer, ~94 MB for 2,000 tokens of the default model,
30-50 ms of CPU on the hit's first step (MLX's CPU concatenate runs at a third of a plain
copy's speed). A finished request's cache is already one contiguous buffer per layer (the
engine extracts it from the batch to cut its blocks), so the last few of them are kept here
as they are. A prompt that such a cache holds whole (its computed prefix, ``start`` tokens,
decided by the blocks and the partial hit exactly as without this store, and the rest of it
fitting in the buffer: a repeated or regenerated prompt) takes that entry out of the store:
its buffers become the request's, trimmed to ``start`` tokens, and the prompt's last tokens
are written into them in place (MLX donates a buffer that only one array holds).

Only such prompts: a conversation's next turn would outgrow the buffer at once (a copy, the
one saved), and measured 10-20% slower on the CPU when it started from a hot cache given
room to grow; it rebuilds from blocks as before. The KV of an entry is in RAM twice, in its
blocks and here: this store holds at most a few entries (``HOT_ENTRIES``), within the prefix
cache's RAM budget, and gives way first when blocks need room or memory is short. Plain KV
models only (every layer a ``KVCache``): a recurrent layer's state exists only at the end of
the sequence.

Entries are kept by namespace (the root of their chain, ``prefix.namespace_root``): a prompt
takes only an entry of its own namespace, and a new entry replaces only its own namespace's.

Runs on the MLX thread only; ``len``, ``nbytes`` and ``stats()`` are plain ints, safe to read
from another thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import KVCache

# Most entries the store holds: each is a whole sequence's KV, in RAM besides its blocks.
HOT_ENTRIES = 4


@dataclass
class HotEntry:
    """A finished sequence's cache: the tokens in it, and per layer its ``KVCache``; ``root``:
    its namespace's chain root."""

    tokens: tuple[int, ...]
    cache: list[Any]
    nbytes: int
    root: str = ""


def _plain(cache: list[Any]) -> bool:
    """Every layer a plain ``KVCache`` holding some tokens."""
    return bool(cache) and all(type(c) is KVCache and c.keys is not None and c.offset > 0
                               for c in cache)


class HotCaches:
    """At most ``max_entries`` finished caches, newest last. The byte budget is the prefix
    cache's (``PrefixCache``): it evicts from here before it evicts a block."""

    def __init__(self, max_entries: int = HOT_ENTRIES) -> None:
        self.max_entries = max_entries
        self._entries: list[HotEntry] = []
        self.nbytes = 0
        self.hits = 0  # entries taken by a request
        self.hit_tokens = 0  # prompt tokens those requests took from them
        self.kept = 0  # entries stored
        self.dropped = 0  # entries dropped (replaced, evicted, or for memory)

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[HotEntry]:
        """The entries, oldest first (a copy)."""
        return list(self._entries)

    def put(self, tokens: Sequence[int], cache: list[Any], room: int, root: str = "") -> bool:
        """Keep a finished sequence's ``cache`` (as extracted from the batch: per layer a
        ``KVCache`` holding exactly ``tokens``; kept as it is, no copy), of the namespace whose
        chains start at ``root``, if it fits in ``room`` bytes (what the blocks leave of the
        budget), the older entries making way oldest first. An older entry of the same
        namespace whose tokens are the beginning of (or all of) ``tokens`` is dropped in any
        case: this one serves every prompt that one does. False if not kept (not a plain KV
        cache, or too large)."""
        if self.max_entries <= 0 or not _plain(cache):
            return False
        nbytes = sum(c.keys.nbytes + c.values.nbytes for c in cache)
        tokens = tuple(tokens)
        for e in [e for e in self._entries if e.root == root
                  and len(e.tokens) <= len(tokens) and tokens[: len(e.tokens)] == e.tokens]:
            self._drop(e)
        if nbytes > room:
            return False
        while self._entries and (len(self._entries) >= self.max_entries
                                 or self.nbytes + nbytes > room):
            self._drop(self._entries[0])
        self._entries.append(HotEntry(tokens, cache, nbytes, root))
        self.nbytes += nbytes
        self.kept += 1
        return True

    def take(self, prompt: Sequence[int], start: int, root: str = "") -> list[Any] | None:
        """The cache of an entry of the namespace whose chains start at ``root`` that holds
        the prompt's first ``start`` tokens and room for the whole prompt in its buffers, out
        of the store (the request owns it now, and writes the prompt's last tokens in place),
        trimmed to ``start`` tokens. None when no entry serves."""
        if start <= 0:
            return None
        head = tuple(prompt[:start])
        for e in reversed(self._entries):  # newest first
            # Only where the prompt uses at least half of the entry: a prompt sharing a
            # system prompt with it should not use up a conversation's entry to save a copy
            # of a few hundred tokens.
            if (e.root == root and start <= len(e.tokens) <= 2 * start
                    and e.tokens[:start] == head
                    and all(c.keys.shape[2] >= len(prompt) for c in e.cache)):
                self._entries.remove(e)
                self.nbytes -= e.nbytes
                self.hits += 1
                self.hit_tokens += start
                for c in e.cache:
                    c.offset = start  # positions past it are written over
                return e.cache
        return None

    def evict(self, need: int) -> int:
        """Drop the oldest entries until ``need`` bytes are freed or none is left; the bytes
        freed."""
        freed = 0
        while self._entries and freed < need:
            e = self._entries[0]
            freed += e.nbytes
            self._drop(e)
        return freed

    def clear(self) -> int:
        """Drop every entry (memory is short, or the batch was reset); how many there were."""
        n = len(self._entries)
        while self._entries:
            self._drop(self._entries[0])
        return n

    def stats(self) -> dict[str, Any]:
        return {
            "hot_entries": len(self._entries),
            "hot_bytes": self.nbytes,
            "hot_hits": self.hits,
            "hot_hit_tokens": self.hit_tokens,
            "hot_kept": self.kept,
            "hot_dropped": self.dropped,
        }

    def _drop(self, e: HotEntry) -> None:
        self._entries.remove(e)
        self.nbytes -= e.nbytes
        self.dropped += 1
