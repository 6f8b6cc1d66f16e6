"""The prefix cache's disk tier as the scheduler sees it: the cached blocks a new request
waits for, the new blocks it writes, and the RAM blocks it spills.

The engine holds the RAM tier (``Engine.blocks``, blocks as MLX arrays, within its byte
budget) and cuts new blocks as requests cross block boundaries. ``DiskTier.begin`` looks a
prompt's leading blocks up there with a plain call; only when RAM stops short of the prompt's
usable blocks does it ask the cache index how many of the next ones are on disk, and has the
SSD writer read them: both answers arrive as messages to the scheduler (``FoundOnDisk``,
``BlocksRead``), which hands them here, and the request waits for them while the batch steps
on; nothing on the step path waits on an ``ask``. Every new block goes to the writer as a
numpy snapshot, and under memory pressure (``SpillRam``) RAM blocks are freed, those the index
says (``HeldOnDisk``) are on disk first.

On rank 0 of a sharded model every rank holds its own shard of each block, and a hit must be a
hit on every rank: before a request with cached blocks starts, the other ranks are asked how
many of them they can supply (``Followers.probe``; the request waits, the batch does not), and
it takes as many as every rank can (actors/distributed/).

It is a part of the scheduler actor, not an actor: the scheduler calls it on the MLX thread,
and it starts a request by calling back into the scheduler, which owns the engine's batch and
the requests' replies.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from troupe.actors.cache_messages import (
    BlocksRead,
    CancelWrites,
    FoundOnDisk,
    LookupDisk,
    OnDisk,
    ReadBlocks,
    WriteBlock,
)
from troupe.actors.distributed.leader import Followers
from troupe.actors.engine.core import Engine
from troupe.actors.engine.kv_blocks import (
    PERSIST_BYTES_PER_STEP,
    KVBlock,
    from_numpy,
    to_numpy,
)
from troupe.actors.messages import AddRequest
from troupe.runtime import ActorDead, ActorRef, MailboxFull, Message, Reply

log = logging.getLogger("actors.disk_tier")

# How long one step may wait for room in the SSD writer's queue before dropping blocks.
WRITE_WAIT_S = 0.25
# The longest a request (or a spill) waits for the cache index to say what is on disk.
LOOKUP_TIMEOUT_S = 1.0
# How long the next step waits for the index's answers to lookups just asked: it answers from
# its own thread within a millisecond or so, and a request whose answer comes after the step
# has begun starts a whole step later (at 32 clients on a CPU, a third of a second a request).
LOOKUP_GRACE_S = 0.005

# The scheduler's: add a request to the batch from these cached blocks and a partial hit of at
# most this many tokens after them (None: any); False when it did not start (its client is
# gone, or the engine refused it, and its reply was answered).
StartRequest = Callable[[AddRequest, Reply, list[KVBlock], int | None], bool]


class PrefixSupplied(Message, frozen=True, kw_only=True):
    """The other ranks of a sharded model can supply the first ``blocks`` cached blocks of a
    request's prompt, and after j of them ``partials[j]`` tokens of a partial hit
    (``distributed.combine``)."""

    request_id: str
    blocks: int
    partials: list[int]


@dataclass
class _Loading:
    """A request waiting for its cached blocks: for the cache index to say which of them are on
    disk (``rest``: the hashes asked about, until the answer), for those to come back from
    disk (``reading``), and on a sharded model for the other ranks to say how many they can
    supply (``probing``)."""

    msg: AddRequest
    reply: Reply
    cached: list[KVBlock]  # this rank's: from RAM, then those read from disk
    epoch: int = 0  # the request's (``DiskTier._epochs``): a lookup's answer names it
    rest: list[str] | None = None
    asked: float = 0.0  # when the index was asked (``rest``), monotonic seconds
    reading: bool = False
    probing: bool = False
    supplied: tuple[int, list[int]] = (0, [])


class DiskTier:
    """The scheduler's side of the prefix cache's disk tier, for ``engine``.

    ``scheduler``: the scheduler's own ref (the index and the writer answer it by its name,
    and a lookup's deadline is a message to it). ``index`` and ``writer``: the cache index
    and SSD writer, None when the prefix cache has no disk tier (block_size 0, or a test of
    RAM alone): every use below checks that once. ``start``: the scheduler's, called when a
    request's cached blocks are ready. ``followers``: the other ranks of a sharded model, set
    by the scheduler when it leads them.
    """

    def __init__(self, engine: Engine, *, scheduler: ActorRef, index: ActorRef | None,
                 writer: ActorRef | None, start: StartRequest) -> None:
        self.engine = engine
        self.scheduler = scheduler
        self.index = index
        self.writer = writer
        self.start = start
        self.followers: Followers | None = None
        self._loading: dict[str, _Loading] = {}
        # Each request's epoch, from its arrival until it leaves the engine: its lookup's
        # answer and its writes name it, so that a request that reuses an id is not mistaken
        # for the one before.
        self._epochs: dict[str, int] = {}
        self._epoch = 0
        # New blocks not yet snapshotted for the disk: (request id, its epoch, block).
        self._unsaved: deque[tuple[str, int, KVBlock]] = deque()
        # A spill waiting for the index to say which RAM blocks are on disk: when it was asked
        # (None: none is), and whether it may drop blocks that are not.
        self._spill_asked: float | None = None
        self._spill_unpersisted = False
        # Requests the other ranks were asked about and not yet told to add or release.
        self._probed: set[str] = set()
        self.probes = 0
        self.write_wait_s = 0.0  # time steps spent waiting for room in the writer's queue
        self.counters = {"blocks_enqueued": 0, "blocks_dropped": 0, "disk_loads": 0}

    # -- requests waiting for their blocks ------------------------------------------------------

    @property
    def waiting(self) -> int:
        """Requests waiting for their cached blocks (not yet in the engine)."""
        return len(self._loading)

    @property
    def looking_up(self) -> bool:
        """Some request waits for the index's answer to its lookup."""
        return any(loading.rest is not None for loading in self._loading.values())

    def lookup_grace(self, now: float) -> float:
        """Seconds the next step may wait for the index to answer the lookups in flight
        (``LOOKUP_GRACE_S`` from the latest asked); 0 when none is."""
        asked = [loading.asked for loading in self._loading.values() if loading.rest is not None]
        return max(0.0, max(asked) + LOOKUP_GRACE_S - now) if asked else 0.0

    def begin(self, msg: AddRequest, reply: Reply) -> None:
        """A new request: start it from the blocks RAM holds, or, when RAM stops short of the
        prompt's usable blocks, once the index, the disk and the other ranks have answered."""
        self._epoch += 1
        self._epochs[msg.request_id] = self._epoch
        engine = self.engine
        hashes = engine.prompt_hashes(msg.prompt_tokens, msg.cache_namespace)
        ram = engine.blocks.lookup(hashes)
        if msg.request_id in self._loading:
            # Its id is taken by a request still loading: it waits for no blocks of its own.
            self._start(msg, reply, ram if self.followers is None else [])
            return
        loading = _Loading(msg, reply, ram, epoch=self._epoch)
        rest = hashes[len(ram):]
        if rest and self._look_up(loading, rest):
            self._loading[msg.request_id] = loading
            return  # the index's answer (FoundOnDisk) goes on from here
        self._fetch(loading, [])

    def found(self, msg: FoundOnDisk) -> None:
        """The index's answer to a request's lookup (or its deadline's, with no blocks)."""
        loading = self._loading.get(msg.request_id)
        if loading is None or loading.rest is None or loading.epoch != msg.epoch:
            return  # answered already (or its deadline passed), or aborted
        rest, loading.rest = loading.rest, None
        self._fetch(loading, rest[:msg.blocks])

    def loaded(self, msg: BlocksRead) -> None:
        """The SSD writer read a request's blocks: promoted to RAM, they join its hit."""
        loading = self._loading.get(msg.request_id)
        if loading is None or not loading.reading:
            return  # aborted while reading
        loading.reading = False
        engine, cached = self.engine, loading.cached
        size = engine.block_size
        prompt = loading.msg.prompt_tokens
        root = engine.chain_root(loading.msg.cache_namespace)
        for data in msg.blocks:
            try:
                block = from_numpy(data, engine.kinds, engine.state_sizes, engine.layout)
            except Exception:
                log.exception("block %s read from disk is unusable", data.block_hash)
                break
            # Its tokens are the prompt's at its place in the chain: partial hits compare them
            # (a chain's first block, with those of its namespace only).
            block.tokens = tuple(prompt[len(cached) * size : (len(cached) + 1) * size])
            block.root = root
            cached.append(block)
            # Promoted to RAM: the next request with this prefix skips the disk.
            engine.blocks.store(block)
        self._ready(loading)

    def supplied(self, msg: PrefixSupplied) -> None:
        """The other ranks' answer to a request's probe."""
        loading = self._loading.get(msg.request_id)
        if loading is None or not loading.probing:
            return  # aborted meanwhile
        loading.probing = False
        loading.supplied = (msg.blocks, msg.partials)
        self._ready(loading)

    def abort(self, request_id: str) -> tuple[AddRequest, Reply] | None:
        """Stop waiting for a request's blocks; the request and its reply, for the scheduler
        to answer, or None when it was not waiting."""
        loading = self._loading.pop(request_id, None)
        if loading is None:
            return None
        self._release(request_id)
        return loading.msg, loading.reply

    def drop_gone(self) -> None:
        """Waiting requests whose clients went away wait no longer."""
        for rid in [rid for rid, ld in self._loading.items() if ld.reply.consumer_gone]:
            self._loading.pop(rid).reply.close()
            self._release(rid)

    def replies(self) -> list[tuple[str, Reply]]:
        """The waiting requests' replies, by request id (a copy: safe from another thread)."""
        return [(rid, ld.reply) for rid, ld in list(self._loading.items())]

    def close(self) -> None:
        """The scheduler is stopping: close every waiting request's reply."""
        for loading in self._loading.values():
            loading.reply.close()
        self._loading.clear()

    def finished(self, request_id: str) -> None:
        """A request has left the engine: its epoch ends."""
        self._epochs.pop(request_id, None)

    def _look_up(self, loading: _Loading, rest: list[str]) -> bool:
        """Ask the cache index how many of ``rest`` (the prompt's blocks after those in RAM)
        are on disk; its answer comes back as ``FoundOnDisk``, and the request waits for it
        (the batch does not) at most LOOKUP_TIMEOUT_S. False when there is no index to ask: RAM
        alone serves. A prompt whose usable blocks are all in RAM asks the index nothing."""
        index = self.index
        if index is None:
            return False
        rid, epoch = loading.msg.request_id, loading.epoch
        try:
            index.try_tell(LookupDisk(hashes=rest, request_id=rid, epoch=epoch,
                                      reply_to=self.scheduler))
        except (MailboxFull, ActorDead):
            return False  # the index is busy or gone: RAM alone serves
        loading.rest, loading.asked = rest, time.monotonic()
        asyncio.get_running_loop().call_later(
            LOOKUP_TIMEOUT_S, self._remind_lookup, FoundOnDisk(request_id=rid, epoch=epoch,
                                                               blocks=0))
        return True

    def _remind_lookup(self, nothing: FoundOnDisk) -> None:
        """The lookup's deadline: if the index has not answered by now, the request goes on
        with RAM alone (an answer after this finds it no longer waiting)."""
        try:
            self.scheduler.try_tell(nothing)
        except MailboxFull:
            asyncio.get_running_loop().call_later(0.05, self._remind_lookup, nothing)
        except ActorDead:
            pass  # stopping

    def _fetch(self, loading: _Loading, disk: list[str]) -> None:
        """Have the SSD writer read the prompt's ``disk`` blocks and, on a sharded model, ask
        the other ranks what they can supply; start the request now if neither is needed."""
        msg, reply, ram = loading.msg, loading.reply, loading.cached
        writer = self.writer
        if disk and writer is not None:
            try:
                writer.try_tell(ReadBlocks(request_id=msg.request_id, hashes=disk,
                                           reply_to=self.scheduler))
                loading.reading = True
                self.counters["disk_loads"] += 1
            except (MailboxFull, ActorDead):
                disk = []  # the disk is busy: prefill what RAM does not hold
        loading.probing = self._probe(msg, len(ram) + len(disk))
        if loading.reading or loading.probing:
            self._loading[msg.request_id] = loading
            return
        self._loading.pop(msg.request_id, None)
        self._start(msg, reply, ram)

    def _probe(self, msg: AddRequest, offered: int) -> bool:
        """On a sharded model, ask the other ranks how many of the prompt's ``offered`` first
        blocks they can supply, unless this rank has nothing to take: no block, and no partial
        hit at the prompt's start. True when they were asked."""
        engine, prompt = self.engine, msg.prompt_tokens
        if self.followers is None or not engine.caching:
            return False
        if not offered:
            room = min(engine.block_size, len(prompt) - 1)
            root = engine.chain_root(msg.cache_namespace)
            if engine.hybrid or room <= 0 or not engine.blocks.best_partial(
                    None, prompt[:room], root)[1]:
                return False
        self.followers.probe(msg.request_id, prompt, offered, msg.cache_namespace)
        self._probed.add(msg.request_id)
        self.probes += 1
        return True

    def _ready(self, loading: _Loading) -> None:
        """Start a loading request once its blocks are read and the other ranks answered: with
        as many blocks, and as long a partial hit after them, as every rank can supply."""
        if loading.reading or loading.probing:
            return
        del self._loading[loading.msg.request_id]
        cached, partial_max = loading.cached, None
        if self.followers is not None:
            blocks, partials = loading.supplied
            cached = cached[:blocks]
            partial_max = partials[len(cached)] if len(cached) < len(partials) else 0
        self._start(loading.msg, loading.reply, cached, partial_max)

    def _start(self, msg: AddRequest, reply: Reply, cached: list[KVBlock],
               partial_max: int | None = None) -> None:
        if self.start(msg, reply, cached, partial_max):
            self._probed.discard(msg.request_id)  # the other ranks were told to add it
        else:
            self._release(msg.request_id)

    def _release(self, request_id: str) -> None:
        """The other ranks drop what they reserved for a request that will not be added."""
        if self.followers is not None and request_id in self._probed:
            self._probed.discard(request_id)
            self.followers.release(request_id)

    # -- new blocks to the disk, RAM blocks spilled ---------------------------------------------

    @property
    def unsaved(self) -> bool:
        """New blocks wait to be snapshotted for the disk (a step is due even with nothing
        to run)."""
        return bool(self._unsaved)

    async def persist_step(self, new: list[tuple[str, KVBlock]]) -> None:
        """A step's share of the new blocks to the disk: ``new`` (the engine's, by request id)
        join those waiting, and about PERSIST_BYTES_PER_STEP of them are snapshotted."""
        if new:
            self._unsaved.extend((rid, self._epochs.get(rid, 0), blk) for rid, blk in new)
        if self._unsaved:
            await self._persist(self._take_unsaved())

    async def flush(self) -> None:
        """Every waiting new block to the disk (the scheduler is stopping; the disk keeps
        them)."""
        if self._unsaved:
            await self._persist(self._take_unsaved(everything=True))

    def cancel_writes(self, request_id: str) -> None:
        """An aborted request's blocks are not written (those of its epoch only)."""
        writer = self.writer
        epoch = self._epochs.get(request_id)
        if epoch is not None and self._unsaved:
            self._unsaved = deque(u for u in self._unsaved if (u[0], u[1]) != (request_id, epoch))
        if writer is not None and epoch is not None:
            try:
                writer.try_tell(CancelWrites(request_id=request_id, epoch=epoch))
            except (MailboxFull, ActorDead):
                log.warning("could not cancel the disk writes of %s", request_id)

    def _take_unsaved(self, everything: bool = False) -> list[tuple[str, int, KVBlock]]:
        """The new blocks to snapshot this step: about PERSIST_BYTES_PER_STEP (at least one),
        so that neither the streams nor the next request wait for a long prompt's blocks;
        while any are left the scheduler queues a step even with nothing to run.
        ``everything``: all of them (shutting down)."""
        if everything:
            out = list(self._unsaved)
            self._unsaved.clear()
            return out
        out, size = [], 0
        while self._unsaved and (not out or size + self._unsaved[0][2].nbytes
                                 <= PERSIST_BYTES_PER_STEP):
            out.append(self._unsaved.popleft())
            size += out[-1][2].nbytes
        return out

    async def _persist(self, new: list[tuple[str, int, KVBlock]]) -> None:
        """Snapshot new blocks to numpy here, on the MLX thread, and queue them for disk.

        A full queue gets at most WRITE_WAIT_S of this step; blocks that still find no room
        are dropped and counted: the disk tier is an optimisation, the batch is not."""
        writer = self.writer
        if writer is None:
            return
        began = time.monotonic()
        deadline = began + WRITE_WAIT_S
        for request_id, epoch, block in new:
            if block.tail:
                continue  # tails live in RAM only
            msg = WriteBlock(block=to_numpy(block, self.engine.layout), request_id=request_id,
                             epoch=epoch)
            try:
                writer.try_tell(msg)
            except MailboxFull:
                remaining = deadline - time.monotonic()
                try:
                    if remaining <= 0:
                        raise TimeoutError
                    await asyncio.wait_for(writer.tell(msg), remaining)
                except (TimeoutError, ActorDead):
                    self.counters["blocks_dropped"] += 1
                    continue
            except ActorDead:
                self.counters["blocks_dropped"] += 1
                continue
            self.counters["blocks_enqueued"] += 1
        self.write_wait_s += max(0.0, min(time.monotonic(), deadline) - began)

    def spill(self, unpersisted: bool) -> None:
        """Memory is short: free a burst of the least recently used RAM blocks that are on
        disk, and with ``unpersisted`` (hard pressure) the others too. Which are on disk the
        index says by message (``HeldOnDisk``: ``held``); the spill happens then. One question
        at a time: a spill asked for meanwhile joins it (hard pressure wins)."""
        blocks = self.engine.blocks
        candidates = [h for h in blocks if not blocks[h].tail]  # tails are never written
        self._spill_unpersisted = self._spill_unpersisted or unpersisted
        now = time.monotonic()
        if self._spill_asked is not None and now - self._spill_asked < LOOKUP_TIMEOUT_S:
            return  # the index's answer to the question in flight does this one's spill
        index = self.index
        if candidates and index is not None:
            try:
                index.try_tell(OnDisk(hashes=candidates, reply_to=self.scheduler))
                self._spill_asked = now
                return
            except (MailboxFull, ActorDead):
                pass
        self._spill_asked = None
        if candidates and not self._spill_unpersisted:
            return  # which are on disk is unknown: dropping one could lose it
        self._spill_on([])

    def held(self, on_disk: list[str]) -> None:
        """The index's answer to a spill's question (``HeldOnDisk``): spill now, unless no
        spill is waiting for it."""
        if self._spill_asked is not None:
            self._spill_asked = None
            self._spill_on(on_disk)

    def _spill_on(self, on_disk: list[str]) -> None:
        """Spill, knowing which RAM blocks are on disk (``on_disk``)."""
        blocks, unpersisted = self.engine.blocks, self._spill_unpersisted
        self._spill_unpersisted = False
        victims = blocks.spill_victims(set(on_disk), unpersisted=unpersisted)
        blocks.spill(victims)
        if self.followers is not None:
            self.followers.spill(victims)  # each rank holds its shard of the same blocks

    def report(self) -> dict[str, Any]:
        """The disk tier's figures for the scheduler's report."""
        return {"write_wait_s": round(self.write_wait_s, 3), **self.counters}
