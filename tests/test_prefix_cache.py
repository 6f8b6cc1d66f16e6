"""The prefix cache's RAM tier (``PrefixCache``), the engine's one table of RAM blocks: its
LRU policy (parent order, leaves first), the byte budget, partial hits, counters, and a byte
count a report can read from another thread. No model: numpy arrays stand in for MLX ones
(only ``nbytes`` is read)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from troupe.actors.engine.kv_blocks import KVBlock
from troupe.actors.engine.prefix import block_hashes, namespace_root
from troupe.actors.engine.prefix_cache import PrefixCache

KB = 1024


def block(h: str, parent: str | None = None, nbytes: int = KB,
          tokens: tuple[int, ...] = (), tail: bool = False, root: str = "") -> KVBlock:
    return KVBlock(block_hash=h, parent_hash=parent, n_tokens=16,
                   layers=[(np.zeros(nbytes, np.uint8),)], tokens=tokens or None, tail=tail,
                   root=root)


def chain(cache: PrefixCache, names: str, nbytes: int = KB) -> list[str]:
    """Store blocks named by the letters of ``names``, each the child of the one before."""
    hashes = list(names)
    for parent, h in zip([None, *hashes], hashes, strict=False):
        cache.store(block(h, parent, nbytes))
    return hashes


def test_lookup_returns_the_leading_chain_held_and_counts_hit_and_missed_tokens() -> None:
    cache = PrefixCache(1 << 30, block_size=16)
    chain(cache, "abc")
    assert [b.block_hash for b in cache.lookup(["a", "b", "c", "d"])] == ["a", "b", "c"]
    assert cache.lookup(["d", "a"]) == []  # only a leading chain is usable
    assert (cache.hit_tokens, cache.miss_tokens) == (48, 48)
    stats = cache.stats()
    assert (stats["ram_hit_tokens"], stats["ram_miss_tokens"], stats["ram_hit_rate"]) == (
        48, 48, 0.5)
    assert (stats["ram_blocks"], stats["ram_block_bytes"], stats["ram_max_bytes"]) == (
        3, 3 * KB, 1 << 30)


def test_a_block_already_held_is_kept_as_it_is() -> None:
    cache = PrefixCache(1 << 30)
    first = block("a")
    assert cache.store(first)
    assert not cache.store(block("a", nbytes=2 * KB))
    assert cache["a"] is first and cache.nbytes == KB


def test_a_chain_that_outgrows_the_budget_keeps_its_beginning() -> None:
    cache = PrefixCache(3 * KB)
    hashes = chain(cache, "abcdef")
    assert cache.nbytes <= 3 * KB
    # Leaves went first: the first blocks are still a usable prefix.
    assert [b.block_hash for b in cache.lookup(hashes)] == ["a", "b", "c"]
    assert cache.evicted == 3


def test_lookup_hits_become_most_recently_used() -> None:
    cache = PrefixCache(4 * KB)
    chain(cache, "ab")
    chain(cache, "xy")
    cache.lookup(["a", "b"])
    chain(cache, "pq")  # two over the budget: the least recently used chain goes, leaf first
    assert set(cache) == {"a", "b", "p", "q"}
    assert list(cache)[:2] == ["b", "a"]  # then this one, its leaf first


def test_a_block_whose_parent_is_gone_is_evicted_first() -> None:
    cache = PrefixCache(4 * KB)
    chain(cache, "ab")
    chain(cache, "xy")
    cache.lookup(["a", "b"])
    cache.spill(["a"])  # b can no longer be reached from RAM
    assert list(cache)[0] == "b"
    cache.store(block("c", "b"))  # its parent is here but unreachable: c goes before it
    cache.store(block("z", None, 2 * KB))
    assert set(cache) == {"x", "y", "z"}


def test_eviction_is_bounded_per_store_and_later_stores_converge() -> None:
    cache = PrefixCache(1 << 30, evict_burst=3)
    hashes = chain(cache, "abcdefghij")
    cache.max_bytes = 4 * KB
    cache.store(block("k", "j"))  # 7 over: at most 3 go
    assert len(cache) == 8 and cache.evicted == 3
    cache.store(block("r"))
    cache.store(block("s"))
    assert cache.nbytes == 4 * KB
    assert [b.block_hash for b in cache.lookup(hashes)] == ["a", "b"]


def test_a_block_larger_than_the_budget_is_not_kept() -> None:
    cache = PrefixCache(2 * KB)
    chain(cache, "a")
    assert cache.store(block("big", None, 3 * KB))
    assert "big" not in cache and "a" in cache and cache.nbytes == KB


def test_spill_frees_blocks_on_disk_first_and_the_others_only_when_unpersisted() -> None:
    cache = PrefixCache(1 << 30, evict_burst=3)
    chain(cache, "abcd")
    cache.store(block("tail-x", "d", tail=True))
    on_disk = {"a", "b", "c"}
    # Least recently used first: the leaves (the tail, d) are the oldest.
    assert cache.spill_victims(on_disk) == ["c", "b", "a"]
    assert cache.spill_victims({"b"}) == ["b"]
    assert cache.spill_victims({"b"}, unpersisted=True) == ["b", "tail-x", "d"]
    assert cache.spill(["b", "missing"]) == 1
    assert cache.spilled == 1 and "b" not in cache and cache.nbytes == 4 * KB
    assert cache.stats()["ram_spilled"] == 1


def test_partial_hits_take_the_longest_shared_run_after_the_same_parent() -> None:
    cache = PrefixCache(1 << 30)
    a, b = block("a", None, tokens=(1, 2, 3, 4)), block("b", None, tokens=(1, 2, 9, 9))
    c = block("c", "a", tokens=(5, 6))
    for blk in (a, b, c):
        cache.store(blk)
    assert cache.best_partial(None, [1, 2, 3, 7]) == (a, 3)
    assert cache.best_partial(None, [1, 2, 9]) == (b, 3)
    assert cache.best_partial(None, [8]) == (None, 0)
    assert cache.best_partial("a", [5, 0]) == (c, 1)
    assert cache.best_partial(None, []) == (None, 0)
    cache.spill(["a"])
    assert cache.best_partial(None, [1, 2, 3, 7]) == (b, 2)
    assert cache.best_partial("a", [5, 0]) == (c, 1)  # the children of a gone block remain
    cache.spill(["b", "c"])
    assert cache.best_partial(None, [1, 2]) == (None, 0)
    assert cache.best_partial("a", [5]) == (None, 0)
    assert len(cache) == 0 and cache.nbytes == 0


def test_namespaces_name_the_same_tokens_apart_and_the_shared_one_keeps_the_old_names() -> None:
    tokens = list(range(40))
    shared = block_hashes(namespace_root("fp"), tokens, 16)
    assert shared == block_hashes("fp", tokens, 16)  # blocks on disk before namespaces
    a = block_hashes(namespace_root("fp", "a"), tokens, 16)
    b = block_hashes(namespace_root("fp", "b"), tokens, 16)
    assert len({*shared, *a, *b}) == 6  # no block name in common, from the first block on
    assert namespace_root("fp", "a") != namespace_root("other-model", "a")


def test_a_partial_hit_at_a_prompts_start_reads_only_blocks_of_its_own_root() -> None:
    """The first blocks of a chain (and tails shorter than a block) follow the chain's root,
    a namespace's: a prompt's partial hit at its start never shares a token with another
    namespace's prompts (the side channel ``cached_tokens`` would open)."""
    cache = PrefixCache(1 << 30)
    mine = block("m", None, tokens=(1, 2, 3, 4), root="ra")
    tail = block("t", None, tokens=(1, 2, 3), tail=True, root="rb")
    for blk in (mine, tail):
        cache.store(blk)
    assert cache.best_partial(None, [1, 2, 3, 4], "ra") == (mine, 4)
    assert cache.best_partial(None, [1, 2, 3, 4], "rb") == (tail, 3)
    assert cache.best_partial(None, [1, 2, 3, 4], "rc") == (None, 0)
    assert cache.best_partial(None, [1, 2, 3, 4]) == (None, 0)  # the shared namespace's
    cache.spill(["m"])
    assert cache.best_partial(None, [1, 2, 3, 4], "ra") == (None, 0)
    assert cache.best_partial(None, [1, 2, 3, 4], "rb") == (tail, 3)


def test_a_partial_hit_keeps_its_block_recently_used_and_older_than_its_parent() -> None:
    cache = PrefixCache(1 << 30)
    cache.store(block("a", None, tokens=(1, 2)))
    cache.store(block("b", None, tokens=(7, 8)))
    cache.store(block("t", "b", tokens=(3,), tail=True))
    assert list(cache) == ["a", "t", "b"]
    assert cache.best_partial(None, [1, 5])[0] is cache["a"]  # a root: the newest
    assert list(cache) == ["t", "b", "a"]
    cache.store(block("c"))
    cache.lookup(["b"])
    assert list(cache) == ["t", "a", "c", "b"]
    assert cache.best_partial("b", [3])[0] is cache["t"]
    assert list(cache) == ["a", "c", "t", "b"]  # right before its parent


def test_the_byte_count_read_from_another_thread_stays_within_the_budget() -> None:
    """The scheduler's report reads ``len``, ``nbytes`` and ``stats()`` on another thread
    while the MLX thread stores and frees blocks: never an error, never past the budget by
    more than the block being stored."""
    cache = PrefixCache(8 * KB, evict_burst=64)
    seen: list[int] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def read() -> None:
        try:
            while not done.is_set():
                stats = cache.stats()
                seen.append(stats["ram_block_bytes"])
                len(cache)
        except BaseException as exc:  # noqa: BLE001 - whatever it is, the test reports it
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(3000):
            parent = f"{i - 1}" if i % 7 else None
            cache.store(block(f"{i}", parent, nbytes=KB * (1 + i % 3)))
            if i % 11 == 0:
                cache.spill(list(cache)[:2])
    finally:
        done.set()
        reader.join()
    assert not errors
    assert seen and max(seen) <= 8 * KB + 3 * KB
    assert cache.nbytes == sum(b.nbytes for b in cache.values()) <= 8 * KB


def test_evict_burst_must_be_positive() -> None:
    with pytest.raises(ValueError):
        PrefixCache(KB, evict_burst=0)
