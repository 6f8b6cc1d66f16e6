"""The cache index: its policy (``BlockTable``, no event loop) and the actor around it, with a
fake scheduler on a real ActorSystem. Block files are made with ``actors.block_store``."""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from actors import block_store
from actors.cache_index import CACHE_INDEX_THREAD, BlockTable, CacheIndex
from actors.cache_messages import (
    BlockData,
    BlockPersisted,
    BlocksStored,
    DropRamBlocks,
    ForgetBlocks,
    LookupPrefix,
    MakeRoom,
    RamBlocksDropped,
)
from runtime import Actor, ActorRef, ActorSystem, Message

FP = "test-model@0123abcd"
KB = 1024


def hashes(n: int) -> list[str]:
    return [secrets.token_hex(16) for _ in range(n)]


def table(**kwargs: Any) -> BlockTable:
    return BlockTable(**{"ram_max_bytes": 1 << 30, "disk_max_bytes": 1 << 30, **kwargs})


def add_chain(t: BlockTable, chain: list[str], *, tier: str, nbytes: int = KB) -> None:
    for parent, h in zip([None, *chain], chain, strict=False):
        if tier == "ram":
            t.store_ram([(h, parent, 16, nbytes)])
        else:
            t.add_disk(h, parent, 16, nbytes)


def save(t: BlockTable, h: str, parent: str | None, nbytes: int = KB) -> bool:
    """What the writer and the index do for one block: make room, then write if it fits."""
    t.drop_disk(t.disk_victims(nbytes), evicted=True)
    if not t.has_room(nbytes):
        return False
    t.add_disk(h, parent, 16, nbytes)
    return True


# -- the policy -------------------------------------------------------------------------------


def test_lookup_returns_the_longest_leading_chain_and_a_block_in_both_tiers_counts_as_ram() -> None:
    t = table()
    a, b, c, d = hashes(4)
    t.store_ram([(a, None, 16, KB), (b, a, 16, KB)])
    t.add_disk(b, a, 16, KB)
    t.add_disk(c, b, 16, KB)
    assert t.lookup([a, b, c, d]) == ["ram", "ram", "disk"]
    assert t.lookup([d, a]) == []  # only a leading chain is usable
    assert t.both == 1 and t.ram_only() == [a]


def test_lookup_counts_hit_and_missed_blocks_and_tokens() -> None:
    t = table()
    a, b, unknown = hashes(3)
    add_chain(t, [a, b], tier="disk")
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
    assert t.lookup(chain) == ["disk", "disk"]


def test_lookup_hits_become_most_recently_used() -> None:
    t = table(disk_max_bytes=4 * KB)
    first, second = hashes(2), hashes(2)
    add_chain(t, first, tier="disk")
    add_chain(t, second, tier="disk")
    t.lookup(first)
    assert set(t.disk_victims(2 * KB)) == set(second)


def test_a_block_whose_parent_is_gone_is_evicted_first() -> None:
    t = table(disk_max_bytes=4 * KB)
    a, b = hashes(2)
    add_chain(t, [a, b], tier="disk")
    other = hashes(2)
    add_chain(t, other, tier="disk")
    t.lookup([a, b])
    t.drop_disk([a])  # b can never be hit again
    assert t.disk_victims(2 * KB) == [b]


def test_files_found_at_start_keep_their_lru_order_even_a_child_older_than_its_parent() -> None:
    t = table(disk_max_bytes=3 * KB)
    root, child, parent = hashes(3)
    # Oldest file first: an unrelated root, then a child whose parent's file is newer.
    t.load_disk([(root, None, 16, KB), (child, parent, 16, KB), (parent, None, 16, KB)])
    assert t.disk_victims(KB) == [root]
    assert t.disk_victims(2 * KB) == [root, child]


def test_ram_eviction_is_bounded_per_store_and_later_stores_converge() -> None:
    t = table(ram_max_bytes=4 * KB, evict_burst=3)
    chain = hashes(10)
    add_chain(t, chain, tier="ram")
    victims = t.ram_victims()
    assert len(victims) == 3
    t.drop_ram(victims, evicted=True)
    t.drop_ram(t.ram_victims(), evicted=True)
    assert t.ram.nbytes == 4 * KB and t.ram_victims() == []
    assert t.lookup(chain) == ["ram"] * 4
    assert t.evicted_ram == 6


def test_ram_only_lists_the_blocks_a_spill_would_write() -> None:
    t = table()
    a, b, c = hashes(3)
    add_chain(t, [a, b, c], tier="ram")
    t.add_disk(b, a, 16, KB)
    assert t.ram_only() == [c, a]  # least recently used first: the leaf is older


# -- the actor --------------------------------------------------------------------------------


class FakeScheduler(Actor):
    """Records what the index tells the scheduler; with ``gate`` it blocks on each message."""

    def __init__(self, inbox: list[Any], gate: asyncio.Event | None = None) -> None:
        self.inbox = inbox
        self.gate = gate

    async def handle(self, msg: Any) -> None:
        if self.gate is not None:
            await self.gate.wait()
        self.inbox.append(msg)


class Ping(Message):
    pass


@asynccontextmanager
async def running_index(
    cache_dir: Path, *, scheduler_mailbox: int = 64, gate: asyncio.Event | None = None,
    **kwargs: Any,
) -> AsyncIterator[tuple[ActorSystem, ActorRef, list[Any]]]:
    inbox: list[Any] = []
    async with ActorSystem() as system:
        await system.spawn(FakeScheduler, name="scheduler", mailbox_size=scheduler_mailbox,
                           inbox=inbox, gate=gate)
        index = await system.spawn(
            CacheIndex, name="cache_index", thread=CACHE_INDEX_THREAD, cache_dir=str(cache_dir),
            fingerprint=FP, **{"ram_max_bytes": 1 << 30, "disk_max_bytes": 1 << 30, **kwargs},
        )
        yield system, index, inbox


def report(system: ActorSystem) -> dict[str, Any]:
    (snap,) = [s for s in system.snapshot() if s.name == "cache_index"]
    return snap.report


async def lookup(index: ActorRef, chain: list[str]) -> list[str]:
    return (await index.ask(LookupPrefix(hashes=chain), timeout=5.0)).tiers


async def eventually(condition: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


async def test_over_the_ram_budget_the_scheduler_drops_lru_blocks_and_persisted_ones_stay_on_disk(
    tmp_path: Path,
) -> None:
    async with running_index(tmp_path, ram_max_bytes=3 * KB) as (system, index, inbox):
        old, new = hashes(2), hashes(3)
        await index.tell(BlockPersisted(block_hash=old[0], parent_hash=None, n_tokens=16,
                                        nbytes=KB))
        await index.tell(BlocksStored(blocks=[(old[0], None, 16, KB), (old[1], old[0], 16, KB)]))
        await index.tell(BlocksStored(blocks=[
            (h, p, 16, KB) for p, h in zip([None, *new], new, strict=False)]))
        assert await lookup(index, new) == ["ram"] * 3
        await eventually(lambda: len(inbox) == 1)
        (drop,) = inbox
        assert isinstance(drop, DropRamBlocks) and sorted(drop.hashes) == sorted(old)
        # The persisted block is still served, from disk; the RAM-only one is gone.
        assert await lookup(index, old) == ["disk"]
        r = report(system)
        assert r["blocks"] == {"ram": 3, "disk": 1, "both": 0}
        assert (r["ram_bytes"], r["evicted"]["ram"]) == (3 * KB, 2)


async def test_ram_eviction_never_waits_for_a_full_scheduler_and_is_deferred(
    tmp_path: Path,
) -> None:
    gate = asyncio.Event()
    async with running_index(tmp_path, ram_max_bytes=KB, scheduler_mailbox=1, gate=gate) as (
        system, index, inbox,
    ):
        scheduler = system.get("scheduler")
        await scheduler.tell(Ping())  # being handled: blocked on the gate
        await scheduler.tell(Ping())  # fills the mailbox
        chain = hashes(2)
        try:
            await index.tell(BlocksStored(blocks=[(chain[0], None, 16, KB),
                                                  (chain[1], chain[0], 16, KB)]))
            # The index answers at once, and keeps the blocks it could not have dropped.
            tiers = await index.ask(LookupPrefix(hashes=chain), timeout=1.0)
            assert tiers.tiers == ["ram", "ram"]
            assert report(system)["ram_evictions_deferred"] == 1
        finally:
            gate.set()
        await eventually(lambda: len(inbox) == 2)
        await index.tell(BlocksStored(blocks=[]))
        await eventually(lambda: len(inbox) == 3)
        assert inbox[2] == DropRamBlocks(hashes=[chain[1]])
        assert await lookup(index, chain) == ["ram"]


async def test_ram_blocks_dropped_by_the_scheduler_leave_the_index(tmp_path: Path) -> None:
    async with running_index(tmp_path) as (system, index, _):
        chain = hashes(2)
        await index.tell(BlocksStored(blocks=[(chain[0], None, 16, KB),
                                              (chain[1], chain[0], 16, KB)]))
        await index.tell(RamBlocksDropped(hashes=chain))
        assert await lookup(index, chain) == []
        assert report(system)["ram_bytes"] == 0


async def test_forget_blocks_drops_disk_entries_and_keeps_ram_ones(tmp_path: Path) -> None:
    async with running_index(tmp_path) as (system, index, _):
        a, b = hashes(2)
        await index.tell(BlocksStored(blocks=[(a, None, 16, KB)]))
        for h, p in ((a, None), (b, a)):
            await index.tell(BlockPersisted(block_hash=h, parent_hash=p, n_tokens=16, nbytes=KB))
        await index.tell(ForgetBlocks(hashes=[a, b]))
        assert await lookup(index, [a, b]) == ["ram"]
        assert report(system)["forgotten"] == 2


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

    async with running_index(tmp_path) as (system, index, _):
        r = report(system)
        assert r["skipped"] == {"partial": 1, "corrupt": 4, "foreign": 2, "version": 1}
        assert r["blocks"]["disk"] == 3
        assert r["disk_bytes"] == sum(p.stat().st_size for p in good)
        assert await lookup(index, chain) == ["disk"] * 3
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
        system, index, _,
    ):
        assert not await index.ask(MakeRoom(nbytes=4 * size), timeout=5.0)
        assert [p.exists() for p in paths] == [False, False, True, True, True]
        assert await index.ask(MakeRoom(nbytes=4 * size), timeout=5.0)
        assert [p.exists() for p in paths] == [False, False, False, False, True]
        assert not await index.ask(MakeRoom(nbytes=6 * size), timeout=5.0)  # never fits
        assert paths[4].exists()
        r = report(system)
        assert (r["evicted"]["disk"], r["disk_bytes"]) == (4, size)
