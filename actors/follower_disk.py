"""A follower rank's disk (actors/distributed/follower.py): this rank's shard of the prefix
cache's blocks under its own directory, kept by the same two actors rank 0 keeps its own with,
the cache index (what is on disk, its order, the quota) and the SSD writer (the files).

They run in a small actor system of their own beside the follower's step loop (the step loop is
a plain loop: it blocks in the model's collectives with the other ranks and takes rank 0's
messages from its socket, so it is not an actor). The step loop only hands them work and never
waits for the disk. The wiring (``api/cli.py``) passes ``FollowerDisk`` to the distributed
package, which imports no actor.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from troupe.actors.cache_index import CACHE_INDEX_THREAD, CacheIndex
from troupe.actors.cache_lock import CacheDirLock
from troupe.actors.cache_messages import (
    BlockData,
    BlocksRead,
    FoundOnDisk,
    LookupDisk,
    ReadBlocks,
    WriteBlock,
)
from troupe.actors.follower_cache import FLUSH_DEADLINE_S
from troupe.actors.ssd_writer import SSD_THREAD, SsdWriter
from troupe.runtime import Actor, ActorDead, ActorRef, ActorSystem, MailboxFull, Message

log = logging.getLogger("actors.follower_disk")

# Blocks waiting in the SSD writer's queue; past this new ones wait (the step never waits).
MAX_PENDING = 64
# The follower's disk actors, as rank 0 names its own.
INDEX, WRITER, CLERK = "cache_index", "ssd_writer", "disk_clerk"


class ReadChain(Message, frozen=True, kw_only=True):
    """The follower's step loop to its disk clerk: read the leading blocks of ``hashes`` that
    have files and give them to ``done`` (on the clerk's thread)."""

    hashes: list[str]
    done: Any  # Callable[[list[BlockData]], None]


class DiskClerk(Actor):
    """Runs a follower's disk reads as rank 0's scheduler does: asks the cache index which of
    a chain's blocks are on disk (``LookupDisk``, answered ``FoundOnDisk``), has the SSD writer
    read them (``ReadBlocks``, answered ``BlocksRead``), and hands them over. It waits on no
    ``ask``: every answer is a message."""

    def __init__(self, *, index: ActorRef, writer: ActorRef) -> None:
        self.index, self.writer = index, writer
        self._reads: dict[str, ReadChain] = {}
        self._next = 0

    async def handle(self, msg: ReadChain | FoundOnDisk | BlocksRead) -> None:
        match msg:
            case ReadChain():
                self._next += 1
                token = str(self._next)
                self._reads[token] = msg
                self._send(token, self.index,
                           LookupDisk(hashes=msg.hashes, request_id=token, reply_to=self.ref))
            case FoundOnDisk(request_id=token, blocks=n):
                read = self._reads.get(token)
                if read is not None and n:
                    self._send(token, self.writer, ReadBlocks(
                        request_id=token, hashes=read.hashes[:n], reply_to=self.ref))
                elif read is not None:
                    self._done(token, [])
            case BlocksRead(request_id=token, blocks=blocks):
                self._done(token, blocks)

    def _send(self, token: str, ref: ActorRef, msg: Message) -> None:
        try:
            ref.try_tell(msg)
        except (MailboxFull, ActorDead):
            self._done(token, [])  # the disk is busy or gone: nothing from it this time

    def _done(self, token: str, blocks: list[BlockData]) -> None:
        read = self._reads.pop(token, None)
        if read is None:
            return
        try:
            read.done(blocks)
        except Exception:  # later reads still need this actor
            log.exception("answering a read failed")


class FollowerDisk:
    """This rank's blocks on disk under ``cache_dir``, within ``disk_max_bytes``: kept by the
    same two actors rank 0 keeps its own with, the cache index (``CacheIndex``: what is on
    disk, its order, the quota) and the SSD writer (``SsdWriter``: the files), beside a
    ``DiskClerk`` for reads.

    They run in a small actor system of their own, its event loop on a thread beside the
    follower's step loop, each actor on its own thread as on rank 0. The step loop only hands
    them work (``try_tell``: it never waits for the disk); a block the writer has no room for
    waits for a later step (``write``). The index rebuilds its catalogue from the files at
    start, so a restarted group finds what it wrote. It holds the directory's lock
    (``cache_lock``) until ``close``: raises ``CacheDirBusy`` when another process holds it."""

    def __init__(self, cache_dir: str | Path, fingerprint: str, disk_max_bytes: int, *,
                 max_pending: int = MAX_PENDING, block_size: int = 0) -> None:
        self.cache_dir = Path(cache_dir)
        self._lock = CacheDirLock.acquire(self.cache_dir)
        self.max_pending = max_pending
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="follower-disk",
                                        daemon=True)
        self._thread.start()
        self.system = ActorSystem()
        try:
            self._on_loop(self._start(fingerprint, disk_max_bytes, block_size))
        except BaseException:
            self.close()
            raise

    async def _start(self, fingerprint: str, disk_max_bytes: int, block_size: int) -> None:
        await self.system.__aenter__()
        self.index = await self.system.spawn(
            CacheIndex, name=INDEX, thread=CACHE_INDEX_THREAD, mailbox_size=4096,
            cache_dir=str(self.cache_dir), fingerprint=fingerprint,
            disk_max_bytes=disk_max_bytes, block_size=block_size)
        # The writer's mailbox is the bounded write queue: a full one refuses the block.
        self.writer = await self.system.spawn(
            SsdWriter, name=WRITER, thread=SSD_THREAD, mailbox_size=self.max_pending,
            max_pending=self.max_pending, cache_dir=str(self.cache_dir),
            fingerprint=fingerprint, disk_max_bytes=disk_max_bytes, index=self.index,
            flush_deadline_s=FLUSH_DEADLINE_S)
        self.clerk = await self.system.spawn(DiskClerk, name=CLERK, thread=CLERK,
                                             index=self.index, writer=self.writer)

    def _on_loop(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def read(self, hashes: list[str], done: Callable[[list[BlockData]], None]) -> None:
        """Read the leading blocks of ``hashes`` that have files, up to the first that cannot
        be read; ``done`` gets them, on the clerk's thread (at once, with none, when the disk
        is too busy to take the read)."""
        try:
            self.clerk.try_tell(ReadChain(hashes=hashes, done=done))
        except (MailboxFull, ActorDead):
            done([])

    def has_room(self, wait_s: float = 0.0) -> bool:
        """Whether the writer's queue takes one more block, waiting up to ``wait_s`` for room."""
        deadline = time.monotonic() + wait_s
        while True:
            if self._queued() < self.max_pending:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def write(self, block: BlockData, request_id: str = "") -> bool:
        """Queue a block for its file; False when the queue is full (the caller keeps it)."""
        try:
            self.writer.try_tell(WriteBlock(block=block, request_id=request_id, epoch=0))
        except (MailboxFull, ActorDead):
            return False
        return True

    def close(self) -> None:
        """Stop the actors (the writer writes what is queued for up to FLUSH_DEADLINE_S and
        drops the rest), the loop and its thread; release the directory's lock."""
        if self._loop.is_running():
            try:
                self._on_loop(self.system.__aexit__(None, None, None), FLUSH_DEADLINE_S + 10.0)
            except Exception:
                log.exception("stopping the follower's disk actors failed")
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)
            if not self._thread.is_alive():
                self._loop.close()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def stats(self) -> dict[str, int]:
        """The index's and the writer's counters, as this rank reports them to rank 0."""
        reports = {s.name: s.report or {} for s in self.system.snapshot()}
        index, writer = reports.get(INDEX, {}), reports.get(WRITER, {})
        return {"disk_blocks": index.get("blocks", 0), "disk_bytes": index.get("disk_bytes", 0),
                "disk_written": writer.get("persisted", 0),
                "disk_dropped": writer.get("dropped", 0),
                "disk_failed": writer.get("failed", 0),
                "disk_read_blocks": writer.get("read_blocks", 0)}

    def _queued(self) -> int:
        return next((s.mailbox_depth for s in self.system.snapshot() if s.name == WRITER), 0)

