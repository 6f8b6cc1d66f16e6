"""A follower rank's prefix cache (actors/distributed.py): its shard of every block, in RAM and
under its own rank's directory, and the blocks it has promised rank 0.

Rank 0 decides every hit. Before it adds a request whose prompt begins with blocks it holds, it
asks each follower how many of those blocks that follower can supply (``FollowerCache.probe``).
The follower looks them up in its engine's RAM table, has its disk thread read the next ones
from its own directory, and answers. What it answered is reserved for the request: held here,
so that neither eviction nor a spill can take it, until the request's ``Add`` claims it
(``claim``) or rank 0 releases it. A follower that cannot produce what it promised raises
``SupplyError``: its KV would differ from rank 0's.

The disk thread (``ShardDisk``) owns this rank's files and their catalogue (the same
``cache_index.DiskTable`` rank 0's index keeps) and uses ``block_store``'s functions; the
follower's step never waits for it: new blocks are queued within a bound and dropped, counted,
past it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors import block_store
from actors.cache_index import DiskTable
from actors.cache_lock import CacheDirLock
from actors.cache_messages import BlockData
from actors.engine.kv_blocks import KVBlock, from_numpy, to_numpy

log = logging.getLogger("actors.follower_cache")

# Blocks waiting for the disk thread; past this new ones are dropped (the step never waits).
MAX_PENDING = 64
# A follower snapshots at most about this many bytes of new blocks between two steps, as rank 0
# does (``scheduler.PERSIST_BYTES_PER_STEP``): the ranks step together, so a long snapshot on
# one stalls them all.
PERSIST_BYTES_PER_STEP = 8 << 20
# How long a stopping follower goes on writing what is queued.
FLUSH_DEADLINE_S = 5.0

# Called with a request id, the number of leading blocks this rank can supply, and after j of
# them the tokens of a partial hit it can supply (``Reservation.partial_tokens``).
Answer = Callable[[str, int, list[int]], None]


class SupplyError(Exception):
    """This rank cannot produce the cached blocks rank 0 took for a request."""


# -- the disk ----------------------------------------------------------------------------------


class ShardDisk:
    """This rank's blocks on disk under ``cache_dir``, within ``disk_max_bytes``.

    One thread does every scan, read, write and deletion; reads go before queued writes (a
    request waits for a read, nobody waits for a write). The catalogue is rebuilt from the
    files at start, so a restarted group finds what it wrote. It holds the directory's lock
    (``cache_lock``) until ``close``: raises ``CacheDirBusy`` when another process holds it."""

    def __init__(self, cache_dir: str | Path, fingerprint: str, disk_max_bytes: int, *,
                 max_pending: int = MAX_PENDING) -> None:
        self.cache_dir = Path(cache_dir)
        self._lock = CacheDirLock.acquire(self.cache_dir)
        self.fingerprint = fingerprint
        self.max_pending = max_pending
        self.table = DiskTable(disk_max_bytes=disk_max_bytes)
        self._tag = block_store.fingerprint_tag(fingerprint)
        self._reads: deque[tuple[list[str], Callable[[list[BlockData]], None]]] = deque()
        self._writes: deque[BlockData] = deque()
        self._cond = threading.Condition()
        self._deadline: float | None = None  # set by close(): writes after it are dropped
        self.written = self.dropped = self.failed = 0
        self.read_blocks = self.read_corrupt = 0
        self._thread = threading.Thread(target=self._run, name="follower-disk", daemon=True)
        self._thread.start()

    def read(self, hashes: list[str], done: Callable[[list[BlockData]], None]) -> None:
        """Read the leading blocks of ``hashes`` that have files, up to the first that cannot
        be read; ``done`` gets them, on the disk thread."""
        with self._cond:
            if self._deadline is None:
                self._reads.append((hashes, done))
                self._cond.notify()
                return
        done([])

    def has_room(self, wait_s: float = 0.0) -> bool:
        """Whether the write queue takes one more block, waiting up to ``wait_s`` for room."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._writes) < self.max_pending, wait_s)

    def write(self, block: BlockData) -> bool:
        """Queue a block for its file; False (and counted) when the queue is full."""
        with self._cond:
            if self._deadline is not None or len(self._writes) >= self.max_pending:
                self.dropped += 1
                return False
            self._writes.append(block)
            self._cond.notify_all()
            return True

    def close(self, deadline_s: float = FLUSH_DEADLINE_S) -> None:
        """Write what is queued for up to ``deadline_s``, drop the rest, stop the thread."""
        with self._cond:
            if self._deadline is None:
                self._deadline = time.monotonic() + deadline_s
            self._cond.notify()
        self._thread.join(deadline_s + 5.0)
        self._lock.release()

    def stats(self) -> dict[str, int]:
        return {"disk_blocks": len(self.table.disk), "disk_bytes": self.table.disk_bytes,
                "disk_written": self.written, "disk_dropped": self.dropped,
                "disk_failed": self.failed, "disk_read_blocks": self.read_blocks}

    def _run(self) -> None:
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            scan = block_store.scan_cache_dir(self.cache_dir, self.fingerprint)
            self.table.load([(b.block_hash, b.parent_hash, b.n_tokens, b.nbytes)
                             for b in scan.blocks])
            log.info("cache %s: %d blocks (%d bytes) on disk", self.cache_dir,
                     len(self.table.disk), self.table.disk_bytes)
        except OSError as exc:  # an unusable directory: writes fail and are counted
            log.error("cache %s: cannot scan: %s", self.cache_dir, exc)
        while True:
            with self._cond:
                while not (self._reads or self._writes or self._deadline is not None):
                    self._cond.wait()
                op: tuple[list[str], Callable[[list[BlockData]], None]] | BlockData
                if self._reads:
                    op = self._reads.popleft()
                elif self._writes and (self._deadline is None
                                       or time.monotonic() < self._deadline):
                    op = self._writes.popleft()
                    self._cond.notify_all()  # room for one more
                else:  # closing: past the deadline, or nothing left to write
                    self.dropped += len(self._writes)
                    self._writes.clear()
                    return
            if isinstance(op, BlockData):
                try:
                    self._write(op)
                except Exception:
                    self.failed += 1
                    log.exception("block %s not written", op.block_hash)
                continue
            hashes, done = op
            blocks: list[BlockData] = []
            try:
                blocks = self._read(hashes)
            except Exception:
                log.exception("reading blocks failed")
            try:
                done(blocks)
            except Exception:  # the thread goes on: later reads and writes still need it
                log.exception("answering a read failed")

    def _read(self, hashes: list[str]) -> list[BlockData]:
        blocks: list[BlockData] = []
        for h in hashes[: self.table.lookup(hashes)]:
            path = block_store.block_path(self.cache_dir, h)
            try:
                blocks.append(block_store.decode_block(path.read_bytes(), self.fingerprint, h))
            except FileNotFoundError:
                self.table.drop([h])
                break
            except block_store.BlockFileError as exc:
                self.read_corrupt += 1
                if exc.reason == "corrupt":
                    block_store.unlink_quietly(path)
                log.warning("block %s unusable (%s): its tokens are prefilled again", h, exc)
                self.table.drop([h])
                break
            except (OSError, ValueError) as exc:
                log.error("reading block %s failed: %s", h, exc)
                break
            try:
                os.utime(path)  # the file's mtime is the LRU order a restart rebuilds from
            except OSError:
                pass
            self.read_blocks += 1
        return blocks

    def _write(self, block: BlockData) -> None:
        h = block.block_hash
        if not block_store.valid_hash(h):
            raise ValueError(f"unusable block hash {h!r}")
        if h in self.table.disk:
            return  # another request wrote the same prefix
        data = block_store.encode_block(block, self.fingerprint)
        victims = self.table.victims(len(data))
        for v in victims:
            block_store.unlink_quietly(block_store.block_path(self.cache_dir, v))
        self.table.drop(victims, evicted=True)
        if not self.table.has_room(len(data)):
            self.dropped += 1
            return
        try:
            block_store.write_atomic(block_store.block_path(self.cache_dir, h), data, self._tag)
        except OSError as exc:
            self.failed += 1
            log.error("block %s not written: %s", h, exc)
            return
        self.written += 1
        self.table.add(h, block.parent_hash, block.n_tokens, len(data))


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
    from this thread or, after a disk read, the disk thread. ``disk``: this rank's files (None:
    RAM only)."""

    def __init__(self, engine: Any, answer: Answer, disk: ShardDisk | None = None) -> None:
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
        """New blocks wait, and the disk thread has room for one."""
        return bool(self._unsaved) and self.disk is not None and self.disk.has_room()

    def probe(self, request_id: str, prompt: list[int], offered: int,
              namespace: str = "") -> None:
        """How many of the prompt's first ``offered`` blocks (in its cache namespace) this rank
        can supply: reserve them, and answer now, or once the disk thread has read those RAM
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
        """Snapshot new blocks to numpy for the disk thread, while its queue has room: about
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
            if not disk.has_room(wait):
                break
            _, block = self._unsaved.popleft()
            size += block.nbytes
            disk.write(to_numpy(block))

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
