"""The cache index, the disk catalogue: its policy (``DiskTable``, no event loop) and the actor
around it on a real ActorSystem. Block files are made with ``actors.block_store``."""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from troupe.actors import block_store
from troupe.actors.cache_index import CACHE_INDEX_THREAD, CacheIndex, DiskTable
from troupe.actors.cache_messages import (
    BlockData,
    BlockPersisted,
    BlockWriteFailed,
    ForgetBlocks,
    FoundOnDisk,
    HeldOnDisk,
    LookupDisk,
    MakeRoom,
    OnDisk,
)
from troupe.runtime import Actor, ActorRef, ActorSystem

FP = "test-model@0123abcd"
KB = 1024


def hashes(n: int) -> list[str]:
    return [secrets.token_hex(16) for _ in range(n)]


def table(**kwargs: Any) -> DiskTable:
    return DiskTable(**{"disk_max_bytes": 1 << 30, **kwargs})


def add_chain(t: DiskTable, chain: list[str], *, nbytes: int = KB) -> None:
    for parent, h in zip([None, *chain], chain, strict=False):
        t.add(h, parent, 16, nbytes)


def save(t: DiskTable, h: str, parent: str | None, nbytes: int = KB) -> bool:
    """What the writer and the index do for one block: make room, then write if it fits."""
    t.drop(t.victims(nbytes), evicted=True)
    if not t.has_room(nbytes):
        return False
    t.add(h, parent, 16, nbytes)
    return True


# -- the policy -------------------------------------------------------------------------------


def test_lookup_counts_the_longest_leading_chain_on_disk() -> None:
    t = table()
    a, b, c, d = hashes(4)
    add_chain(t, [a, b, c])
    assert t.lookup([a, b, c, d]) == 3
    assert t.lookup([d, a]) == 0  # only a leading chain is usable
    assert t.on_disk([d, c, a]) == [c, a]


def test_lookup_counts_hit_and_missed_blocks_and_tokens() -> None:
    t = table()
    a, b, unknown = hashes(3)
    add_chain(t, [a, b])
    t.lookup([a, b, unknown])
    t.lookup([unknown])
    assert (t.hit_blocks, t.miss_blocks) == (2, 2)
    assert (t.hit_tokens, t.miss_tokens) == (32, 32)


def test_a_chain_that_outgrows_the_quota_keeps_its_beginning() -> None:
    t = table(disk_max_bytes=3 * KB)
    chain = hashes(6)
    for parent, h in zip([None, *chain], chain, strict=False):
        save(t, h, parent)
    assert t.disk.nbytes <= 3 * KB
    # Leaves went first: the first blocks are still a usable prefix.
    assert t.lookup(chain) == 2


def test_lookup_hits_become_most_recently_used() -> None:
    t = table(disk_max_bytes=4 * KB)
    first, second = hashes(2), hashes(2)
    add_chain(t, first)
    add_chain(t, second)
    t.lookup(first)
    assert set(t.victims(2 * KB)) == set(second)


def test_a_block_whose_parent_is_gone_is_evicted_first() -> None:
    t = table(disk_max_bytes=4 * KB)
    a, b = hashes(2)
    add_chain(t, [a, b])
    other = hashes(2)
    add_chain(t, other)
    t.lookup([a, b])
    t.drop([a])  # b can never be read after it
    assert t.victims(2 * KB) == [b]


def test_files_found_at_start_keep_their_lru_order_even_a_child_older_than_its_parent() -> None:
    t = table(disk_max_bytes=3 * KB)
    root, child, parent = hashes(3)
    # Oldest file first: an unrelated root, then a child whose parent's file is newer.
    t.load([(root, None, 16, KB), (child, parent, 16, KB), (parent, None, 16, KB)])
    assert t.victims(KB) == [root]
    assert t.victims(2 * KB) == [root, child]


def test_disk_eviction_is_bounded_per_call_and_later_calls_converge() -> None:
    t = table(disk_max_bytes=4 * KB, evict_burst=3)
    chain = hashes(10)
    add_chain(t, chain)
    victims = t.victims(0)
    assert len(victims) == 3
    t.drop(victims, evicted=True)
    t.drop(t.victims(0), evicted=True)
    assert t.disk.nbytes == 4 * KB and t.victims(0) == []
    assert t.lookup(chain) == 4
    assert t.evicted == 6


# -- the actor --------------------------------------------------------------------------------


@asynccontextmanager
async def running_index(
    cache_dir: Path, **kwargs: Any,
) -> AsyncIterator[tuple[ActorSystem, ActorRef]]:
    async with ActorSystem() as system:
        index = await system.spawn(
            CacheIndex, name="cache_index", thread=CACHE_INDEX_THREAD, cache_dir=str(cache_dir),
            fingerprint=FP, **{"disk_max_bytes": 1 << 30, **kwargs},
        )
        yield system, index


def report(system: ActorSystem) -> dict[str, Any]:
    (snap,) = [s for s in system.snapshot() if s.name == "cache_index"]
    return snap.report


async def lookup(index: ActorRef, chain: list[str]) -> int:
    return await index.ask(LookupDisk(hashes=chain), timeout=5.0)


async def persisted(index: ActorRef, chain: list[str]) -> None:
    for parent, h in zip([None, *chain], chain, strict=False):
        await index.tell(BlockPersisted(block_hash=h, parent_hash=parent, n_tokens=16,
                                        nbytes=KB))


async def test_the_index_answers_what_is_on_disk_and_counts_its_lookups(tmp_path: Path) -> None:
    async with running_index(tmp_path) as (system, index):
        chain, unknown = hashes(3), hashes(1)
        await persisted(index, chain)
        await index.tell(BlockWriteFailed(block_hash=unknown[0], error="injected"))
        assert await lookup(index, chain + unknown) == 3
        assert await index.ask(OnDisk(hashes=[unknown[0], chain[2], chain[0]]),
                               timeout=5.0) == [chain[2], chain[0]]
        r = report(system)
        assert (r["blocks"], r["disk_bytes"], r["write_failures"]) == (3, 3 * KB, 1)
        assert (r["hit_tokens"], r["miss_tokens"], r["hit_rate"]) == (48, 16, 0.75)


class Asker(Actor):
    """Keeps the answers it is told."""

    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers

    async def handle(self, msg: Any) -> None:
        self.answers.append(msg)


async def test_the_index_answers_a_lookup_by_message_to_the_asker_s_ref(
        tmp_path: Path) -> None:
    """The scheduler never waits on the index: it gives its ref, and the answer comes to it
    as a message carrying the request it is for."""
    answers: list[Any] = []
    async with running_index(tmp_path) as (system, index):
        asker = await system.spawn(Asker, name="asker", answers=answers)
        chain, unknown = hashes(3), hashes(1)
        await persisted(index, chain)
        await index.tell(LookupDisk(hashes=chain[:2] + unknown, request_id="r", epoch=7,
                                    reply_to=asker))
        await index.tell(OnDisk(hashes=[unknown[0], chain[1]], reply_to=asker))
        await index.ask(OnDisk(hashes=[]), timeout=5.0)  # both handled before this
        await asker.ask(OnDisk(hashes=[]), timeout=5.0)  # and both answers delivered
        assert answers[:2] == [FoundOnDisk(request_id="r", epoch=7, blocks=2),
                               HeldOnDisk(hashes=[chain[1]])]


async def test_an_answer_to_an_asker_that_stopped_is_counted_logged_and_reaches_no_other(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An asker gone before its answer is not a silent skip, and the answer goes to that
    asker only: never to a later actor that took its name (a reloaded model's scheduler)."""
    later: list[Any] = []
    async with running_index(tmp_path) as (system, index):
        chain = hashes(2)
        await persisted(index, chain)
        gone = await system.spawn(Asker, name="asker", answers=[])
        await system.stop(gone)
        await system.spawn(Asker, name="asker", answers=later)
        with caplog.at_level(logging.WARNING, logger="actors.cache_index"):
            await index.tell(LookupDisk(hashes=chain, request_id="r", reply_to=gone))
            await index.tell(OnDisk(hashes=chain, reply_to=gone))
            await index.ask(OnDisk(hashes=[]), timeout=5.0)  # both handled before this
        assert report(system)["missing_reply_targets"] == 2
        assert sum("'asker' stopped" in r.getMessage() for r in caplog.records) == 2
        await system.get("asker").ask(OnDisk(hashes=[]), timeout=5.0)
        assert later == [OnDisk(hashes=[])]  # only what was sent to it


async def test_forget_blocks_drops_disk_entries(tmp_path: Path) -> None:
    async with running_index(tmp_path) as (system, index):
        a, b = hashes(2)
        await persisted(index, [a, b])
        await index.tell(ForgetBlocks(hashes=[b, secrets.token_hex(16)]))
        assert await lookup(index, [a, b]) == 1
        r = report(system)
        assert (r["forgotten"], r["blocks"], r["disk_bytes"]) == (1, 1, KB)


# -- on disk ----------------------------------------------------------------------------------


def make_block(block_hash: str, parent: str | None = None) -> BlockData:
    rng = np.random.default_rng()
    return BlockData(
        block_hash=block_hash, parent_hash=parent, n_tokens=16,
        tensors={"0.keys": rng.integers(0, 1 << 16, (1, 2, 16, 8), dtype=np.uint16)},
        dtypes={"0.keys": "bfloat16"},
    )


def put_file(cache_dir: Path, block: BlockData, *, name: str | None = None,
             fingerprint: str = FP) -> Path:
    path = block_store.block_path(cache_dir, name or block.block_hash)
    block_store.write_atomic(path, block_store.encode_block(block, fingerprint),
                             block_store.fingerprint_tag(fingerprint))
    return path


async def test_restart_rebuilds_the_index_from_the_directory_and_skips_bad_files_by_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    chain = hashes(3)
    good = [put_file(tmp_path, make_block(h, p)) for p, h in zip([None, *chain], chain,
                                                                 strict=False)]
    ours = block_store.fingerprint_tag(FP)

    def path(suffix: str = block_store.FILE_SUFFIX, prefix: str = "") -> Path:
        h = secrets.token_hex(16)
        p = tmp_path / h[:2] / f"{prefix}{h}{suffix}"
        p.parent.mkdir(exist_ok=True)
        return p

    partial = path(f".{ours}.123-0.tmp", prefix=".")
    partial.write_bytes(b"half a block")
    other_partial = path(".0ther0ther00.123-0.tmp", prefix=".")
    other_partial.write_bytes(b"another model's write in progress")
    garbage = path()
    garbage.write_bytes(b"\xff" * 64)
    truncated = put_file(tmp_path, make_block(secrets.token_hex(16)))
    truncated.write_bytes(truncated.read_bytes()[:-5])
    misnamed = put_file(tmp_path, make_block(secrets.token_hex(16)), name=secrets.token_hex(16))
    unreadable = path()
    unreadable.mkdir()
    foreign = put_file(tmp_path, make_block(secrets.token_hex(16)), fingerprint="other-model")
    with monkeypatch.context() as m:
        m.setattr(block_store, "FORMAT_VERSION", 999)
        old_version = put_file(tmp_path, make_block(secrets.token_hex(16)))

    async with running_index(tmp_path) as (system, index):
        r = report(system)
        assert r["skipped"] == {"partial": 1, "corrupt": 4, "foreign": 2, "version": 1}
        assert r["blocks"] == 3
        assert r["disk_bytes"] == sum(p.stat().st_size for p in good)
        assert await lookup(index, chain) == 3
    # Ours and broken: deleted. Another model's, another version's: left alone.
    assert not any(p.exists() for p in (partial, garbage, truncated, misnamed))
    assert all(p.exists() for p in (other_partial, foreign, old_version, *good))


async def test_make_room_deletes_the_oldest_files_at_most_a_burst_per_call(
    tmp_path: Path,
) -> None:
    roots = hashes(5)
    paths = [put_file(tmp_path, make_block(h)) for h in roots]
    size = paths[0].stat().st_size
    now = time.time()
    for age, p in enumerate(reversed(paths)):  # the first written is the oldest
        os.utime(p, (now - 100 * age, now - 100 * age))

    async with running_index(tmp_path, disk_max_bytes=5 * size, evict_burst=2) as (
        system, index,
    ):
        assert not await index.ask(MakeRoom(sizes=[4 * size]), timeout=5.0)
        assert [p.exists() for p in paths] == [False, False, True, True, True]
        assert await index.ask(MakeRoom(sizes=[4 * size]), timeout=5.0)
        assert [p.exists() for p in paths] == [False, False, False, False, True]
        assert not await index.ask(MakeRoom(sizes=[6 * size]), timeout=5.0)  # never fits
        assert paths[4].exists()
        r = report(system)
        assert (r["evicted"], r["disk_bytes"]) == (4, size)
