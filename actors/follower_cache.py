"""A follower rank's prefix cache (actors/distributed/follower.py): its shard of every block, in
RAM and under its own rank's directory, and the blocks it has promised rank 0.

Rank 0 decides every hit. Before it adds a request whose prompt begins with blocks it holds, it
asks each follower how many of those blocks that follower can supply (``FollowerCache.probe``).
The follower looks them up in its engine's RAM table, has its disk read the next ones from its
own directory, and answers. What it answered is reserved for the request: held here, so that
neither eviction nor a spill can take it, until the request's ``Add`` claims it (``claim``) or
rank 0 releases it. A follower that cannot produce what it promised raises ``SupplyError``: its
KV would differ from rank 0's.

The disk tier is rank 0's, run on every rank: ``FollowerDisk`` keeps this rank's files with the
same cache index and SSD writer actors, in a small actor system beside the step loop (the step
loop is a plain loop: it blocks in the model's collectives with the other ranks, and takes rank
0's messages from its socket). The follower's step never waits for the disk: new blocks are
queued within a bound, and wait for a later step past it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.cache_index import CACHE_INDEX_THREAD, CacheIndex
from actors.cache_lock import CacheDirLock
from actors.cache_messages import (
    BlockData,
    BlocksRead,
    FoundOnDisk,
    LookupDisk,
    ReadBlocks,
    WriteBlock,
)
from actors.engine.kv_blocks import KVBlock, from_numpy, to_numpy
from actors.ssd_writer import SSD_THREAD, SsdWriter
from runtime import Actor, ActorDead, ActorSystem, MailboxFull, Message

log = logging.getLogger("actors.follower_cache")

# Blocks waiting in the SSD writer's queue; past this new ones wait (the step never waits).
MAX_PENDING = 64
# A follower snapshots at most about this many bytes of new blocks between two steps, as rank 0
# does (``scheduler.PERSIST_BYTES_PER_STEP``): the ranks step together, so a long snapshot on
# one stalls them all.
PERSIST_BYTES_PER_STEP = 8 << 20
# How long a stopping follower goes on writing what is queued.
FLUSH_DEADLINE_S = 5.0
# The follower's disk actors, as rank 0 names its own.
INDEX, WRITER, CLERK = "cache_index", "ssd_writer", "disk_clerk"

# Called with a request id, the number of leading blocks this rank can supply, and after j of
# them the tokens of a partial hit it can supply (``Reservation.partial_tokens``).
Answer = Callable[[str, int, list[int]], None]


class SupplyError(Exception):
    """This rank cannot produce the cached blocks rank 0 took for a request."""


# -- the disk ----------------------------------------------------------------------------------


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

    def __init__(self, *, index: str, writer: str) -> None:
        self.index_name, self.writer_name = index, writer
        self._reads: dict[str, ReadChain] = {}
        self._next = 0

    async def handle(self, msg: ReadChain | FoundOnDisk | BlocksRead) -> None:
        match msg:
            case ReadChain():
                self._next += 1
                token = str(self._next)
                self._reads[token] = msg
                self._send(token, self.index_name,
                           LookupDisk(hashes=msg.hashes, request_id=token, reply_to=self.name))
            case FoundOnDisk(request_id=token, blocks=n):
                read = self._reads.get(token)
                if read is not None and n:
                    self._send(token, self.writer_name, ReadBlocks(
                        request_id=token, hashes=read.hashes[:n], reply_to=self.name))
                elif read is not None:
                    self._done(token, [])
            case BlocksRead(request_id=token, blocks=blocks):
                self._done(token, blocks)

    def _send(self, token: str, name: str, msg: Message) -> None:
        ref = self.system.find(name)
        try:
            if ref is None:
                raise ActorDead(f"no actor {name!r}")
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
            fingerprint=fingerprint, disk_max_bytes=disk_max_bytes, index=INDEX,
            flush_deadline_s=FLUSH_DEADLINE_S)
        self.clerk = await self.system.spawn(DiskClerk, name=CLERK, thread=CLERK,
                                             index=INDEX, writer=WRITER)

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


# -- RAM, reservations, and what goes to the disk ------------------------------------------------


@dataclass
class Reservation:
    """What this rank promised rank 0 for one request: the prompt's leading blocks found in
    RAM, then those read from disk; and after j of the RAM ones (j from 0), a block sharing the
    prompt's next tokens and how many it shares (a partial hit), or None."""

    ram: list[KVBlock]
    partials: list[tuple[KVBlock, int] | None]
    disk: list[BlockData] = field(default_factory=list)

    @property
    def blocks(self) -> int:
        return len(self.ram) + len(self.disk)

    def partial_tokens(self) -> list[int]:
        return [p[1] if p is not None else 0 for p in self.partials]


class FollowerCache:
    """A follower's prefix cache, on its MLX thread (the engine's RAM table is that thread's).

    ``engine``: the follower's ``Engine``. ``answer``: sends a probe's answer to rank 0; called
    from this thread or, after a disk read, the disk clerk's. ``disk``: this rank's files
    (``FollowerDisk``; None: RAM only)."""

    def __init__(self, engine: Any, answer: Answer, disk: FollowerDisk | None = None) -> None:
        self.engine = engine
        self.answer = answer
        self.disk = disk
        self.reserved: dict[str, Reservation] = {}
        self._unsaved: deque[tuple[str, KVBlock]] = deque()
        self.hit_tokens = 0  # prompt tokens this rank served from cache (agreed hits)

    @property
    def unsaved(self) -> bool:
        """New blocks wait for a snapshot."""
        return bool(self._unsaved)

    def can_persist(self) -> bool:
        """New blocks wait, and the SSD writer's queue has room for one."""
        return bool(self._unsaved) and self.disk is not None and self.disk.has_room()

    def probe(self, request_id: str, prompt: list[int], offered: int,
              namespace: str = "") -> None:
        """How many of the prompt's first ``offered`` blocks (in its cache namespace) this rank
        can supply: reserve them, and answer now, or once the disk has read those RAM
        does not hold."""
        engine = self.engine
        hashes = engine.prompt_hashes(prompt, namespace)[:offered]
        ram = engine.blocks.lookup(hashes)
        root = engine.chain_root(namespace)
        res = Reservation(ram, [self._partial(prompt, ram, j, root)
                                for j in range(len(ram) + 1)])
        self.reserved[request_id] = res
        rest = hashes[len(ram):]
        if rest and self.disk is not None:
            def read(blocks: list[BlockData]) -> None:
                res.disk = blocks
                self.answer(request_id, res.blocks, res.partial_tokens())

            self.disk.read(rest, read)
            return
        self.answer(request_id, res.blocks, res.partial_tokens())

    def claim(self, request_id: str, prompt: list[int], blocks: int,
              cached_tokens: int, namespace: str = "") -> tuple[list[KVBlock], int]:
        """The cached blocks rank 0 took for a request (``blocks`` whole ones and
        ``cached_tokens`` in all, in cache namespace ``namespace``), for ``Engine.add``: the
        blocks, and the tokens of the partial hit after them. Blocks read from disk join the
        RAM table. Raises ``SupplyError`` when this rank cannot produce them."""
        res = self.reserved.pop(request_id, None)
        if cached_tokens == 0:
            return [], 0
        size = self.engine.block_size
        partial = cached_tokens - blocks * size
        if res is None or blocks > res.blocks or partial < 0:
            raise SupplyError(
                f"rank 0 took {blocks} cached blocks and {cached_tokens} cached tokens for "
                f"{request_id}; this rank promised "
                f"{'nothing' if res is None else f'{res.blocks} blocks'}")
        cached = res.ram[:blocks]
        for data in res.disk[: blocks - len(cached)]:
            try:
                block = from_numpy(data, self.engine.kinds, self.engine.state_sizes)
            except Exception as exc:
                raise SupplyError(f"block {data.block_hash} read from disk for {request_id} "
                                  f"is unusable: {exc}") from exc
            # Its tokens are the prompt's at its place in the chain: partial hits compare them.
            block.tokens = tuple(prompt[len(cached) * size : (len(cached) + 1) * size])
            block.root = self.engine.chain_root(namespace)
            cached.append(block)
            self.engine.blocks.store(block)  # promoted, as rank 0 promotes what it reads
        if partial:
            entry = res.partials[blocks] if blocks < len(res.partials) else None
            if entry is None or entry[1] < partial:
                raise SupplyError(f"rank 0 took a partial hit of {partial} tokens for "
                                  f"{request_id}; this rank promised "
                                  f"{0 if entry is None else entry[1]}")
            # Back in the table if it was evicted since: the engine's partial hit finds it.
            self.engine.blocks.store(entry[0])
        self.hit_tokens += cached_tokens
        return cached, partial

    def release(self, request_id: str) -> None:
        """Rank 0 will not add the request: what was reserved for it goes."""
        self.reserved.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        """The request was aborted: its blocks not snapshotted yet are not written."""
        self._unsaved = deque(u for u in self._unsaved if u[0] != request_id)

    def spill(self, hashes: list[str]) -> None:
        """Rank 0 freed these RAM blocks under memory pressure: this rank frees its shard."""
        self.engine.blocks.spill(hashes)

    def after_step(self) -> None:
        """Take the blocks the engine cut, and send a bounded batch of them to the disk."""
        for request_id, block in self.engine.take_new_blocks():
            if self.disk is not None and not block.tail:  # tails live in RAM only
                self._unsaved.append((request_id, block))
        self.persist()

    def persist(self, everything: bool = False) -> None:
        """Snapshot new blocks to numpy for the SSD writer, while its queue has room: about
        PERSIST_BYTES_PER_STEP of them (at least one). Blocks that find no room wait for a
        later call; the step never waits for the disk. ``everything``: all of them, waiting
        up to FLUSH_DEADLINE_S in all for room (stopping)."""
        disk = self.disk
        if disk is None:
            return
        deadline = time.monotonic() + FLUSH_DEADLINE_S
        size = 0
        while self._unsaved and (everything or size == 0 or size + self._unsaved[0][1].nbytes
                                 <= PERSIST_BYTES_PER_STEP):
            wait = max(0.0, deadline - time.monotonic()) if everything else 0.0
            request_id, block = self._unsaved[0]
            if not disk.has_room(wait) or not disk.write(to_numpy(block), request_id):
                break  # it waits for room, snapshotted again then
            self._unsaved.popleft()
            size += block.nbytes

    def stats(self) -> dict[str, int]:
        """Blocks in RAM, reserved, served from cache, and this rank's disk."""
        ram = self.engine.blocks.stats()
        disk = self.disk.stats() if self.disk is not None else {}
        return {"ram_blocks": ram["ram_blocks"], "ram_block_bytes": ram["ram_block_bytes"],
                "reserved": len(self.reserved), "hit_tokens": self.hit_tokens,
                "disk_blocks": disk.get("disk_blocks", 0),
                "disk_read_blocks": disk.get("disk_read_blocks", 0),
                "disk_written": disk.get("disk_written", 0),
                "disk_dropped": disk.get("disk_dropped", 0)}

    def _partial(self, prompt: list[int], ram: list[KVBlock], j: int,
                 root: str) -> tuple[KVBlock, int] | None:
        """After the prompt's first j blocks (of the chain from ``root``), the RAM block
        sharing most of its next tokens, as ``Engine.add`` looks for one (plain KV models; one
        prompt token left to run)."""
        engine = self.engine
        if not engine.caching or engine.hybrid:
            return None
        start = j * engine.block_size
        room = min(engine.block_size, len(prompt) - 1 - start)
        if room <= 0:
            return None
        parent = ram[j - 1].block_hash if j else None
        block, n = engine.blocks.best_partial(parent, prompt[start : start + room], root)
        return (block, n) if block is not None and n > 0 else None
