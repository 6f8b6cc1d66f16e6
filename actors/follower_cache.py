"""A follower rank's prefix cache (actors/distributed/follower.py): its shard of every block, in
RAM and under its own rank's directory, and the blocks it has promised rank 0.

Rank 0 decides every hit. Before it adds a request whose prompt begins with blocks it holds, it
asks each follower how many of those blocks that follower can supply (``FollowerCache.probe``).
The follower looks them up in its engine's RAM table, has its disk read the next ones from its
own directory, and answers. What it answered is reserved for the request: held here, so that
neither eviction nor a spill can take it, until the request's ``Add`` claims it (``claim``) or
rank 0 releases it. A follower that cannot produce what it promised raises ``SupplyError``: its
KV would differ from rank 0's.

The disk is rank 0's disk tier, run on every rank (actors/follower_disk.py: the cache index
and SSD writer actors); here it is only what ``Disk`` names. The follower's step never waits
for it: new blocks are queued within a bound, and wait for a later step past it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from troupe.actors.cache_messages import BlockData
from troupe.actors.engine.kv_blocks import (
    PERSIST_BYTES_PER_STEP,
    KVBlock,
    from_numpy,
    to_numpy,
)

log = logging.getLogger("actors.follower_cache")

# How long a stopping follower goes on writing what is queued.
FLUSH_DEADLINE_S = 5.0

# Called with a request id, the number of leading blocks this rank can supply, and after j of
# them the tokens of a partial hit it can supply (``Reservation.partial_tokens``).
Answer = Callable[[str, int, list[int]], None]


class SupplyError(Exception):
    """This rank cannot produce the cached blocks rank 0 took for a request."""


class Disk(Protocol):
    """This rank's blocks on disk, as the follower's cache uses them (``FollowerDisk``)."""

    def read(self, hashes: list[str], done: Callable[[list[BlockData]], None]) -> None:
        """Read the leading blocks of ``hashes`` that have files; ``done`` gets them (on
        another thread)."""

    def has_room(self, wait_s: float = 0.0) -> bool:
        """Whether the write queue takes one more block, waiting up to ``wait_s``."""

    def write(self, block: BlockData, request_id: str = "") -> bool:
        """Queue a block for its file; False when the queue is full."""

    def stats(self) -> dict[str, int]:
        """Counters for the follower's ``Status``."""


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
    (``follower_disk.FollowerDisk``; None: RAM only)."""

    def __init__(self, engine: Any, answer: Answer, disk: Disk | None = None) -> None:
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
                block = from_numpy(data, self.engine.kinds, self.engine.state_sizes,
                                   self.engine.layout)
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
            if not disk.has_room(wait) or not disk.write(to_numpy(block, self.engine.layout),
                                                         request_id):
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
