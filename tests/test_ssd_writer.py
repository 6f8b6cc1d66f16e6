"""The SSD writer with a real cache index and a fake scheduler, on a real ActorSystem.

Blocks are random numpy arrays (float16, float32, and bfloat16 as uint16 bit patterns); no
MLX is involved. Slow and failing disks are simulated by patching ``os.fsync``, which every
block write calls on the writer's thread between writing the temp file and renaming it.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import secrets
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors import safe_open

from troupe.actors import block_store
from troupe.actors.cache_index import CACHE_INDEX_THREAD, CacheIndex
from troupe.actors.cache_messages import (
    FORMAT_VERSION,
    BlockData,
    BlocksRead,
    CancelWrites,
    FlushWrites,
    LookupDisk,
    MakeRoom,
    ReadBlocks,
    WriteBlock,
)
from troupe.actors.ssd_writer import SSD_THREAD, SsdWriter
from troupe.runtime import Actor, ActorRef, ActorSystem

FP = "test-model@0123abcd"
_real_fsync = os.fsync


# -- harness ----------------------------------------------------------------------------------


def make_block(
    parent: BlockData | None = None, *, n_tokens: int = 4, head_dim: int = 16,
    rng: np.random.Generator | None = None,
) -> BlockData:
    """A block with a float16, a float32 and two bfloat16 (uint16 bit pattern) tensors."""
    rng = rng or np.random.default_rng()
    shape = (1, 2, n_tokens, head_dim)
    tensors = {
        "0.keys": rng.standard_normal(shape).astype(np.float16),
        "0.values": rng.standard_normal(shape).astype(np.float32),
        # Every 16-bit pattern, NaNs and infinities included, must survive.
        "1.keys": rng.integers(0, 1 << 16, size=shape, dtype=np.uint16),
        "1.state.0": rng.integers(0, 1 << 16, size=(1, 8), dtype=np.uint16),
    }
    dtypes = {"0.keys": "float16", "0.values": "float32", "1.keys": "bfloat16",
              "1.state.0": "bfloat16"}
    return BlockData(
        block_hash=secrets.token_hex(16),
        parent_hash=None if parent is None else parent.block_hash,
        n_tokens=n_tokens, tensors=tensors, dtypes=dtypes,
    )


def make_chain(n: int, **kwargs: Any) -> list[BlockData]:
    blocks: list[BlockData] = []
    for _ in range(n):
        blocks.append(make_block(blocks[-1] if blocks else None, **kwargs))
    return blocks


class FakeScheduler(Actor):
    """Records what the cache actors send the scheduler (BlocksRead)."""

    def __init__(self, inbox: list[Any]) -> None:
        self.inbox = inbox

    async def handle(self, msg: Any) -> None:
        self.inbox.append(msg)


@dataclass
class Cache:
    system: ActorSystem
    scheduler: ActorRef  # the fake scheduler: reads are answered to it, into inbox
    index: ActorRef
    writer: ActorRef
    inbox: list[Any]
    cache_dir: Path

    async def write(self, blocks: list[BlockData], request_id: str = "r1", epoch: int = 0) -> None:
        for block in blocks:
            await self.writer.tell(WriteBlock(block=block, request_id=request_id, epoch=epoch))

    async def flush(self) -> int:
        written = await self.writer.ask(FlushWrites(deadline_s=10.0), timeout=15.0)
        # What the writer told the index is handled before this ask (a mailbox is in order):
        # its report counts every file written.
        await self.index.ask(LookupDisk(hashes=[]), timeout=5.0)
        return written

    async def lookup(self, blocks: list[BlockData]) -> list[str]:
        """"disk" for each leading block the index finds on disk (it knows only the disk)."""
        n = await self.index.ask(LookupDisk(hashes=[b.block_hash for b in blocks]), timeout=5.0)
        return ["disk"] * n

    def report(self, name: str) -> dict[str, Any]:
        (snap,) = [s for s in self.system.snapshot() if s.name == name]
        return snap.report

    def path(self, block: BlockData) -> Path:
        return block_store.block_path(self.cache_dir, block.block_hash)

    def files(self) -> list[Path]:
        return sorted(self.cache_dir.rglob("*.safetensors"))

    def temps(self) -> list[Path]:
        return sorted(self.cache_dir.rglob("*.tmp"))

    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.files())


@asynccontextmanager
async def running_cache(
    cache_dir: Path, *, disk_max_bytes: int = 1 << 30, evict_burst: int = 32,
    **writer_kwargs: Any,
) -> AsyncIterator[Cache]:
    """Scheduler (fake), index and writer, spawned in the server's order."""
    inbox: list[Any] = []
    async with ActorSystem() as system:
        scheduler = await system.spawn(FakeScheduler, name="scheduler", inbox=inbox)
        index = await system.spawn(
            CacheIndex, name="cache_index", thread=CACHE_INDEX_THREAD,
            cache_dir=str(cache_dir), fingerprint=FP, disk_max_bytes=disk_max_bytes,
            evict_burst=evict_burst,
        )
        writer = await system.spawn(
            SsdWriter, name="ssd_writer", thread=SSD_THREAD, cache_dir=str(cache_dir),
            fingerprint=FP, disk_max_bytes=disk_max_bytes, index=index, **writer_kwargs,
        )
        yield Cache(system, scheduler, index, writer, inbox, cache_dir)


async def eventually(condition: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def gated_fsync(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Make the next block write stop just before its rename until ``release`` is set.

    Returns (entered, release). Later writes go through at once.
    """
    entered, release = threading.Event(), threading.Event()

    def fsync(fd: int) -> None:
        if not entered.is_set():
            entered.set()
            assert release.wait(10.0)
        _real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return entered, release


def assert_same_block(got: BlockData, want: BlockData) -> None:
    assert (got.block_hash, got.parent_hash, got.n_tokens) == (
        want.block_hash, want.parent_hash, want.n_tokens)
    assert got.dtypes == want.dtypes
    assert got.tensors.keys() == want.tensors.keys()
    for name, array in want.tensors.items():
        back = got.tensors[name]
        assert back.dtype == array.dtype and back.shape == array.shape, name
        # Bit patterns, not values: NaN payloads and signed zeros must survive too.
        assert back.tobytes() == array.tobytes(), name


# -- atomic writes ----------------------------------------------------------------------------


async def test_block_file_gets_its_final_name_only_once_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered, release = gated_fsync(monkeypatch)
    async with running_cache(tmp_path) as cache:
        (block,) = make_chain(1)
        await cache.write([block])
        try:
            assert await asyncio.to_thread(entered.wait, 5.0)
            # Mid-write: the bytes are in a temp file in the same directory, no final name yet.
            (temp,) = cache.temps()
            assert temp.parent == cache.path(block).parent
            assert cache.files() == []
        finally:
            release.set()
        await cache.flush()
        assert cache.files() == [cache.path(block)]
        assert cache.temps() == []


async def test_injected_write_error_is_counted_logged_removes_temp_and_next_write_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "injected I/O error")

    async with running_cache(tmp_path) as cache:
        bad, good = make_chain(2)
        monkeypatch.setattr(os, "fsync", broken_fsync)
        with caplog.at_level(logging.ERROR, logger="actors.ssd_writer"):
            await cache.write([bad])
            assert await cache.flush() == 0
        assert cache.files() == [] and cache.temps() == []
        assert any(r.levelno == logging.ERROR and bad.block_hash in r.getMessage()
                   for r in caplog.records)
        assert cache.report("ssd_writer")["failed"] == 1
        assert await cache.lookup([bad]) == []
        assert cache.report("cache_index")["write_failures"] == 1

        monkeypatch.setattr(os, "fsync", _real_fsync)
        await cache.write([good])
        assert await cache.flush() == 1
        assert await cache.lookup([good]) == ["disk"]
        assert cache.report("ssd_writer")["persisted"] == 1
        assert [s.state for s in cache.system.snapshot()] == ["running"] * 3


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Any:
    """A really full-able 1 MiB tmpfs, mounted for the test (needs root)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {mounted.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def fill(path: Path) -> None:
    """Write zeros to ``path`` until the file system is full."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


async def test_full_filesystem_write_fails_cleanly_and_a_freed_disk_takes_the_next_write(
    tiny_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with running_cache(tiny_fs / "cache") as cache:
        first, second = make_chain(2, n_tokens=64, head_dim=64)  # ~80 KB files
        junk = tiny_fs / "junk"
        fill(junk)
        with caplog.at_level(logging.ERROR, logger="actors.ssd_writer"):
            await cache.write([first])
            assert await cache.flush() == 0
        assert any(r.levelno == logging.ERROR and "No space" in r.getMessage()
                   for r in caplog.records)
        report = cache.report("ssd_writer")
        assert report["failed"] == 1
        assert report["disk_free_bytes"] is not None and report["disk_free_bytes"] < 80_000
        assert cache.files() == [] and cache.temps() == []
        # The server keeps serving: both actors answer.
        assert await cache.lookup([first]) == []
        assert cache.report("cache_index")["write_failures"] == 1

        junk.unlink()
        await cache.write([second])
        assert await cache.flush() == 1
        assert await cache.lookup([second]) == ["disk"]


# -- the format -------------------------------------------------------------------------------


async def test_round_trip_is_bit_exact_with_dtypes_and_bfloat16_bit_patterns(
    tmp_path: Path,
) -> None:
    async with running_cache(tmp_path) as cache:
        blocks = make_chain(3)
        await cache.write(blocks)
        assert await cache.flush() == 3
        await cache.writer.tell(ReadBlocks(request_id="q", hashes=[b.block_hash for b in blocks],
                                           reply_to=cache.scheduler))
        await eventually(lambda: len(cache.inbox) == 1)
        (read,) = cache.inbox
        assert isinstance(read, BlocksRead) and read.request_id == "q"
        assert len(read.blocks) == 3
        for got, want in zip(read.blocks, blocks, strict=True):
            assert_same_block(got, want)
        # Stored as uint16, never widened, and described by the metadata.
        with safe_open(str(cache.path(blocks[1])), "np") as f:
            meta = f.metadata()
            assert f.get_tensor("1.keys").dtype == np.uint16
        assert meta["format_version"] == str(FORMAT_VERSION)
        assert meta["fingerprint"] == FP
        assert meta["block_hash"] == blocks[1].block_hash
        assert meta["parent_hash"] == blocks[0].block_hash
        assert meta["n_tokens"] == "4"
        assert "bfloat16" in meta["dtypes"]


async def test_blocks_written_before_a_restart_are_found_and_read_after_it(tmp_path: Path) -> None:
    blocks = make_chain(3)
    async with running_cache(tmp_path) as cache:
        await cache.write(blocks)
        await cache.flush()
    async with running_cache(tmp_path) as cache:
        assert await cache.lookup(blocks) == ["disk"] * 3
        await cache.writer.tell(ReadBlocks(request_id="q", hashes=[b.block_hash for b in blocks],
                                           reply_to=cache.scheduler))
        await eventually(lambda: len(cache.inbox) == 1)
        for got, want in zip(cache.inbox[0].blocks, blocks, strict=True):
            assert_same_block(got, want)


async def test_bfloat16_tensor_not_given_as_its_bits_is_refused_not_widened(
    tmp_path: Path,
) -> None:
    async with running_cache(tmp_path) as cache:
        block = make_block()
        tensors = dict(block.tensors, **{"1.keys": np.zeros((1, 2, 4, 16), np.float32)})
        wrong = BlockData(block_hash=block.block_hash, parent_hash=None, n_tokens=4,
                          tensors=tensors, dtypes=block.dtypes)
        await cache.write([wrong])
        assert await cache.flush() == 0
        assert cache.files() == []
        assert cache.report("ssd_writer")["failed"] == 1


async def test_read_stops_at_the_first_missing_or_corrupt_block_which_is_deleted_and_forgotten(
    tmp_path: Path,
) -> None:
    async with running_cache(tmp_path) as cache:
        blocks = make_chain(3)
        await cache.write(blocks)
        await cache.flush()
        path = cache.path(blocks[1])
        path.write_bytes(path.read_bytes()[:-7])  # truncated: corrupt
        await cache.writer.tell(ReadBlocks(request_id="q", hashes=[b.block_hash for b in blocks],
                                           reply_to=cache.scheduler))
        await eventually(lambda: len(cache.inbox) == 1)
        assert [b.block_hash for b in cache.inbox[0].blocks] == [blocks[0].block_hash]
        assert not path.exists()
        assert await cache.lookup(blocks) == ["disk"]

        cache.path(blocks[0]).unlink()  # missing: forgotten too
        await cache.writer.tell(ReadBlocks(request_id="q2", hashes=[blocks[0].block_hash],
                                           reply_to=cache.scheduler))
        await eventually(lambda: len(cache.inbox) == 2)
        assert cache.inbox[1].blocks == []
        assert await cache.lookup(blocks) == []
        report = cache.report("ssd_writer")
        assert (report["read_corrupt"], report["read_missing"]) == (1, 1)


# -- the quota --------------------------------------------------------------------------------


async def test_quota_holds_within_one_block_eviction_is_bounded_per_save_and_saves_converge(
    tmp_path: Path,
) -> None:
    size = len(block_store.encode_block(make_block(), FP))
    quota = 8 * size + size // 2
    async with running_cache(tmp_path, disk_max_bytes=quota, evict_burst=2) as cache:
        for block in make_chain(30):
            await cache.write([block])
            await cache.flush()
            assert cache.disk_bytes() <= quota + size
        assert len(cache.files()) == 8
        assert cache.report("cache_index")["disk_bytes"] == cache.disk_bytes()

        # A block ~6.7 times as large needs seven files gone: two per save, then it fits.
        big = make_block(n_tokens=40)
        counts: list[int] = []
        for _ in range(6):
            before = cache.report("cache_index")["evicted"]
            await cache.write([big])
            await cache.flush()
            counts.append(cache.report("cache_index")["evicted"] - before)
            assert cache.disk_bytes() <= quota + len(block_store.encode_block(big, FP))
            if cache.path(big).exists():
                break
        assert cache.path(big).exists(), counts
        assert counts == [2, 2, 2, 1]
        assert cache.report("ssd_writer")["dropped_by_reason"]["no_room"] == 3
        assert await cache.lookup([big]) == ["disk"]


async def test_eviction_deletes_files_promptly_while_the_writer_is_stuck_on_a_slow_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with running_cache(tmp_path) as cache:
        old = make_chain(3)
        await cache.write(old)
        await cache.flush()
        entered, release = gated_fsync(monkeypatch)
        await cache.write(make_chain(4))  # the first blocks the writer; the rest queue
        try:
            assert await asyncio.to_thread(entered.wait, 5.0)
            started = time.monotonic()
            # Room for a file as large as the whole quota: every file on disk must go, now.
            assert await cache.index.ask(MakeRoom(sizes=[1 << 30]), timeout=2.0)
            assert time.monotonic() - started < 0.5
            assert not any(cache.path(b).exists() for b in old)
        finally:
            release.set()
        await cache.flush()
        assert len(cache.files()) == 4


# -- cancelling -------------------------------------------------------------------------------


async def test_request_aborted_while_its_blocks_are_written_leaves_no_orphan_file_or_stale_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with running_cache(tmp_path) as cache:
        aborted = make_chain(4)
        entered, release = gated_fsync(monkeypatch)
        await cache.write(aborted[:3], "r1", epoch=1)
        try:
            assert await asyncio.to_thread(entered.wait, 5.0)  # the first block is being written
            await cache.writer.tell(CancelWrites(request_id="r1", epoch=1))
            # The id comes back for a new request (new epoch), and a late write of the old one.
            reused = make_block()
            await cache.write([reused], "r1", epoch=2)
            await cache.write(aborted[3:], "r1", epoch=1)
        finally:
            release.set()
        assert await cache.flush() == 1

        assert cache.files() == [cache.path(reused)]
        assert cache.temps() == []
        for block in aborted:
            assert await cache.lookup([block]) == []
        assert await cache.lookup([reused]) == ["disk"]
        assert cache.report("ssd_writer")["cancelled"] == 4


async def test_cancel_keeps_a_block_another_request_also_wrote(tmp_path: Path) -> None:
    async with running_cache(tmp_path) as cache:
        shared, own = make_chain(2)
        await cache.write([shared], "a")
        await cache.write([shared, own], "b")
        await cache.flush()
        await cache.writer.tell(CancelWrites(request_id="b", epoch=0))
        await cache.flush()
        assert cache.files() == [cache.path(shared)]
        assert await cache.lookup([shared, own]) == ["disk"]


# -- flushing and stopping --------------------------------------------------------------------


def slow_fsync(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    def fsync(fd: int) -> None:
        time.sleep(seconds)
        _real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)


async def test_flush_answers_blocks_written_and_drops_what_misses_its_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with running_cache(tmp_path) as cache:
        blocks = make_chain(8)
        slow_fsync(monkeypatch, 0.05)
        await cache.write(blocks)
        written = await cache.writer.ask(FlushWrites(deadline_s=0.12), timeout=5.0)
        assert 1 <= written < 8
        report = cache.report("ssd_writer")
        assert report["pending"] == 0
        assert report["persisted"] + report["dropped_by_reason"]["deadline"] == 8
        assert await cache.lookup(blocks) == ["disk"] * report["persisted"]


async def test_stop_flushes_within_its_deadline_and_unwritten_blocks_are_not_indexed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    async with running_cache(tmp_path, flush_deadline_s=0.3, max_pending=4) as cache:
        blocks = make_chain(20)
        slow_fsync(monkeypatch, 0.05)
        await cache.write(blocks)  # 4 pending, the rest in the mailbox
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="actors.ssd_writer"):
            await cache.system.stop(cache.writer)
        assert time.monotonic() - started < 0.3 + 0.5
        written = [b for b in blocks if cache.path(b).exists()]
        assert 1 <= len(written) < 20
        assert await cache.lookup(blocks) == ["disk"] * len(written)
        assert cache.files() == sorted(cache.path(b) for b in written)
        assert cache.temps() == []
        assert any("dropped" in r.getMessage() for r in caplog.records)


# -- introspection ----------------------------------------------------------------------------


async def test_counters_show_in_the_system_snapshot(tmp_path: Path) -> None:
    async with running_cache(tmp_path) as cache:
        blocks = make_chain(3)
        await cache.write(blocks)
        await cache.flush()
        await cache.lookup(blocks[:2] + make_chain(1))
        writer = cache.report("ssd_writer")
        assert {k: writer[k] for k in ("enqueued", "persisted", "dropped", "failed",
                                       "cancelled", "pending")} == {
            "enqueued": 3, "persisted": 3, "dropped": 0, "failed": 0, "cancelled": 0,
            "pending": 0}
        assert writer["bytes_written"] == cache.disk_bytes()
        index = cache.report("cache_index")
        assert index["blocks"] == 3
        assert index["disk_bytes"] == cache.disk_bytes()
        assert (index["hit_tokens"], index["miss_tokens"]) == (8, 4)
        assert index["hit_rate"] == pytest.approx(8 / 12)


async def test_a_batch_of_writes_asks_the_index_for_room_once(tmp_path: Path) -> None:
    """Blocks queued together get their room in one ``MakeRoom``: the writer asks for the
    block it writes and those behind it, and writes the rest within that room."""
    async with ActorSystem() as system:
        index = await system.spawn(CacheIndex, name="cache_index", thread=CACHE_INDEX_THREAD,
                                   cache_dir=str(tmp_path), fingerprint=FP,
                                   disk_max_bytes=1 << 30)
        # On the test's own loop: the eight blocks are all queued before it takes the first.
        writer = await system.spawn(SsdWriter, name="ssd_writer", cache_dir=str(tmp_path),
                                    fingerprint=FP, disk_max_bytes=1 << 30, index=index)
        chain = make_chain(8)
        for block in chain:
            writer.try_tell(WriteBlock(block=block, request_id="r", epoch=0))
        assert await writer.ask(FlushWrites(deadline_s=10.0), timeout=15.0) == 8
        assert await index.ask(LookupDisk(hashes=[b.block_hash for b in chain]),
                               timeout=5.0) == 8
        (snap,) = [s for s in system.snapshot() if s.name == "cache_index"]
        assert snap.report["room_asks"] == 1
