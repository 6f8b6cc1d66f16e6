"""The SSD writer actor: persists prefix-cache blocks (numpy only) and reads them back.

Spawn it with ``thread=SSD_THREAD``: every read, write and fsync runs on that thread, never on
the event loop. It imports numpy and safetensors, never MLX (a test checks this): the scheduler
turns ``mx.array``s into numpy on its own thread before sending them here.

The write queue is the mailbox plus a short internal queue. A ``WriteBlock`` is taken into the
internal queue at once and written later, one block per ``WriteNext`` the writer sends itself
(as the scheduler does with ``Step``), so a ``CancelWrites``, ``ReadBlocks`` or ``FlushWrites``
waits for at most one block write, and a cancelled block still queued is dropped without
touching the disk. When the internal queue is full, taking one more block first writes the
oldest: the mailbox then fills, and the scheduler's timed ``tell`` drops blocks (backpressure).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any

from troupe.actors import block_store
from troupe.actors.cache_messages import (
    BlockData,
    BlockPersisted,
    BlocksRead,
    BlockWriteFailed,
    CancelWrites,
    FlushWrites,
    ForgetBlocks,
    MakeRoom,
    ReadBlocks,
    WriteBlock,
)
from troupe.runtime import Actor, ActorDead, ActorRef, AskTimeout, MailboxFull, Message

log = logging.getLogger("actors.ssd_writer")

SSD_THREAD = "ssd"
# Requests whose writes (or cancellation) are remembered for CancelWrites; older ones are
# forgotten first. An abort arrives while its request runs, long before this many others.
_REMEMBERED_REQUESTS = 1024

DROP_REASONS = ("no_room", "no_space", "no_index", "deadline")
# Bytes a queued block's file may outgrow the estimate of its size by (a header names its
# hashes and token count: a few bytes apart from one block to the next).
ROOM_SLACK = 256


class WriteNext(Message, frozen=True, kw_only=True):
    """The writer's note to itself: write the oldest queued block."""


class SsdWriter(Actor):
    """Writes blocks atomically under ``cache_dir``, within the quota the index keeps.

    Messages: ``WriteBlock``, ``CancelWrites``, ``ReadBlocks`` (answered with ``BlocksRead``
    told to its ``reply_to``), ``FlushWrites`` (ask -> blocks written). Talks to the cache
    index whose ref it is spawned with (``index``): ``MakeRoom`` once for a write and the
    blocks queued behind it (not once per block), then ``BlockPersisted`` or
    ``BlockWriteFailed``; ``ForgetBlocks`` for files it removed or found unusable.

    ``disk_max_bytes`` is the quota the index enforces; the writer only reports it. Up to
    ``max_pending`` blocks wait in the internal queue. On stop, what is queued is written
    until ``flush_deadline_s`` after the stop began; the rest is dropped, counted and never
    indexed.
    """

    def __init__(
        self,
        *,
        cache_dir: str,
        fingerprint: str,
        disk_max_bytes: int,
        index: ActorRef,
        max_pending: int = 16,
        flush_deadline_s: float = 5.0,
        index_timeout_s: float = 5.0,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        self.cache_dir = Path(cache_dir)
        self.fingerprint = fingerprint
        self.disk_max_bytes = disk_max_bytes
        self.index = index
        self.max_pending = max_pending
        self.flush_deadline_s = flush_deadline_s
        self.index_timeout_s = index_timeout_s
        self._tag = block_store.fingerprint_tag(fingerprint)
        self._pending: deque[WriteBlock] = deque()
        self._next_queued = False
        # Set once the mailbox is found closed (the actor is stopping): writes after it drop.
        self._deadline: float | None = None
        # (request_id, epoch) -> hashes whose files that request's writes put on disk.
        self._written: OrderedDict[tuple[str, int], list[str]] = OrderedDict()
        self._cancelled: OrderedDict[tuple[str, int], None] = OrderedDict()
        # After a failed write, free space is checked before each try, until one succeeds.
        self._check_space = False
        # Bytes the index made room for (``MakeRoom``) that no write has taken yet: a block
        # that fits in them is written without asking again.
        self._room = 0
        self.enqueued = self.persisted = self.deduped = self.failed = self.cancelled = 0
        self.bytes_written = 0
        self.dropped: dict[str, int] = dict.fromkeys(DROP_REASONS, 0)
        self.read_blocks = self.read_missing = self.read_corrupt = 0
        # Corrupt files found by a read and deleted; of them, whole files whose tensor data
        # failed its checksum (bytes changed on disk).
        self.blocks_corrupt = self.checksum_failures = 0
        self.disk_free_bytes: int | None = None

    async def on_start(self) -> None:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self._refresh_disk_free()

    async def handle(
        self, msg: WriteBlock | WriteNext | CancelWrites | ReadBlocks | FlushWrites
    ) -> Any:
        result = None
        match msg:
            case WriteBlock():
                await self._accept(msg)
            case WriteNext():
                self._next_queued = False
                if self._pending:
                    await self._write(self._pending.popleft())
            case CancelWrites(request_id=rid, epoch=epoch):
                await self._cancel((rid, epoch))
            case ReadBlocks(request_id=rid, hashes=hashes, reply_to=reply_to):
                await self._read(rid, hashes, reply_to)
            case FlushWrites(deadline_s=deadline_s):
                result = await self._flush(time.monotonic() + deadline_s)
        self._schedule_next()
        return result

    async def on_stop(self, error: BaseException | None) -> None:
        deadline = self._deadline
        if deadline is None:
            deadline = time.monotonic() + self.flush_deadline_s
        before = self.dropped["deadline"]
        await self._flush(deadline)
        if self.dropped["deadline"] > before:
            log.warning(
                "ssd writer: %d block writes not done within %.1fs of stopping were dropped "
                "(not indexed)", self.dropped["deadline"] - before, self.flush_deadline_s,
            )

    def report(self) -> dict[str, Any]:
        """Write and read counters, the internal queue's depth, the disk's free space."""
        return {
            "enqueued": self.enqueued,
            "persisted": self.persisted,
            "deduped": self.deduped,
            "dropped": sum(self.dropped.values()),
            "dropped_by_reason": dict(self.dropped),
            "failed": self.failed,
            "cancelled": self.cancelled,
            "bytes_written": self.bytes_written,
            "pending": len(self._pending),
            "read_blocks": self.read_blocks,
            "read_missing": self.read_missing,
            "read_corrupt": self.read_corrupt,
            "blocks_corrupt": self.blocks_corrupt,
            "checksum_failures": self.checksum_failures,
            "disk_max_bytes": self.disk_max_bytes,
            "disk_free_bytes": self.disk_free_bytes,
        }

    # -- writing ------------------------------------------------------------------------------

    async def _accept(self, msg: WriteBlock) -> None:
        self.enqueued += 1
        if (msg.request_id, msg.epoch) in self._cancelled:
            self.cancelled += 1
            return
        if self._deadline is not None and time.monotonic() >= self._deadline:
            self.dropped["deadline"] += 1
            return
        if len(self._pending) >= self.max_pending:
            await self._write(self._pending.popleft())
        self._pending.append(msg)

    def _schedule_next(self) -> None:
        """Queue a ``WriteNext`` behind what is in the mailbox, if blocks wait for one."""
        if not self._pending or self._next_queued:
            return
        try:
            self.ref.try_tell(WriteNext())
        except MailboxFull:
            return  # the mailbox is not empty: the next message handled tries again
        except ActorDead:
            # The mailbox is closed: we are stopping. The drain and on_stop share one deadline.
            if self._deadline is None:
                self._deadline = time.monotonic() + self.flush_deadline_s
            return
        self._next_queued = True

    async def _flush(self, deadline: float) -> int:
        """Write what is queued until ``deadline``; drop (and count) the rest."""
        done = self.persisted + self.deduped
        while self._pending:
            if time.monotonic() >= deadline:
                self.dropped["deadline"] += len(self._pending)
                self._pending.clear()
                break
            await self._write(self._pending.popleft())
        return self.persisted + self.deduped - done

    async def _write(self, msg: WriteBlock) -> None:
        """Persist one block: make room with the index, write atomically, tell the index."""
        block = msg.block
        if self._deadline is not None and time.monotonic() >= self._deadline:
            self.dropped["deadline"] += 1
            return
        if not block_store.valid_hash(block.block_hash):
            await self._failed(block, ValueError(f"unusable block hash {block.block_hash!r}"))
            return
        final = block_store.block_path(self.cache_dir, block.block_hash)
        existing = self._existing(final)
        if existing is not None:
            self.deduped += 1
            self._remember(msg, block.block_hash)
            await self._tell_index(BlockPersisted(
                block_hash=block.block_hash, parent_hash=block.parent_hash,
                n_tokens=block.n_tokens, nbytes=existing.nbytes,
            ))
            return
        try:
            data = block_store.encode_block(block, self.fingerprint)
        except ValueError as exc:
            await self._failed(block, exc)
            return
        if self._check_space and not self._space_for(len(data)):
            self.dropped["no_space"] += 1
            return
        if self._room >= len(data):
            self._room -= len(data)  # made for it with the blocks before it
        else:
            room = await self._make_room(self._batch_sizes(block, len(data)))
            if room is None:
                self.dropped["no_index"] += 1
                return
            if room < len(data):
                self._room = 0
                self.dropped["no_room"] += 1
                return
            self._room = room - len(data)
        try:
            block_store.write_atomic(final, data, self._tag)
        except OSError as exc:
            await self._failed(block, exc)
            return
        self._check_space = False
        self.persisted += 1
        self.bytes_written += len(data)
        self._remember(msg, block.block_hash)
        await self._tell_index(BlockPersisted(
            block_hash=block.block_hash, parent_hash=block.parent_hash,
            n_tokens=block.n_tokens, nbytes=len(data),
        ))

    def _existing(self, final: Path) -> block_store.BlockInfo | None:
        """The valid file of this block already there (another request wrote the same prefix),
        or None: missing, or unusable and to be written over."""
        try:
            return block_store.read_block_info(final, self.fingerprint)
        except (OSError, block_store.BlockFileError):
            return None

    async def _failed(self, block: BlockData, exc: Exception) -> None:
        """A write that failed: counted, logged, the disk re-measured, the index told."""
        self.failed += 1
        log.error("ssd writer: block %s not written: %s", block.block_hash, exc)
        self._refresh_disk_free()
        if isinstance(exc, OSError):
            self._check_space = True
        await self._tell_index(BlockWriteFailed(block_hash=block.block_hash, error=str(exc)))

    def _space_for(self, nbytes: int) -> bool:
        """After a failure: is there room on the file system again?"""
        self._refresh_disk_free()
        return self.disk_free_bytes is None or self.disk_free_bytes >= nbytes

    def _refresh_disk_free(self) -> None:
        try:
            self.disk_free_bytes = shutil.disk_usage(self.cache_dir).free
        except OSError:
            self.disk_free_bytes = None

    def _remember(self, msg: WriteBlock, block_hash: str) -> None:
        key = (msg.request_id, msg.epoch)
        self._written.setdefault(key, []).append(block_hash)
        self._written.move_to_end(key)
        while len(self._written) > _REMEMBERED_REQUESTS:
            self._written.popitem(last=False)

    # -- cancelling ---------------------------------------------------------------------------

    async def _cancel(self, key: tuple[str, int]) -> None:
        """Drop the request's queued writes, refuse its later ones, remove what it wrote."""
        self._cancelled[key] = None
        self._cancelled.move_to_end(key)
        while len(self._cancelled) > _REMEMBERED_REQUESTS:
            self._cancelled.popitem(last=False)
        kept = deque(m for m in self._pending if (m.request_id, m.epoch) != key)
        self.cancelled += len(self._pending) - len(kept)
        self._pending = kept
        written = self._written.pop(key, [])
        # A block another live request also wrote (the same prefix) stays.
        shared = {h for hashes in self._written.values() for h in hashes}
        removed = [h for h in dict.fromkeys(written) if h not in shared]
        for h in removed:
            try:
                os.unlink(block_store.block_path(self.cache_dir, h))
            except FileNotFoundError:
                pass  # evicted meanwhile
            except OSError as exc:
                log.error("ssd writer: could not remove cancelled block %s: %s", h, exc)
        self.cancelled += len(removed)
        if removed:
            await self._tell_index(ForgetBlocks(hashes=removed))

    # -- reading ------------------------------------------------------------------------------

    async def _read(self, request_id: str, hashes: list[str], reply_to: ActorRef) -> None:
        """Read the chain's blocks up to the first one missing or unusable; answer, then tell
        the index to forget the one that failed.

        Every block's tensor data is checked against its checksum here, on this thread
        (``block_store.decode_block``): a corrupt block is deleted, counted, logged once and
        never sent, so the scheduler prefills its tokens again."""
        blocks: list[BlockData] = []
        forget: list[str] = []
        block_store.prefetch(block_store.block_path(self.cache_dir, h) for h in hashes
                             if block_store.valid_hash(h))
        for h in hashes:
            if not block_store.valid_hash(h):
                self.read_missing += 1  # no such file can exist
                break
            path = block_store.block_path(self.cache_dir, h)
            try:
                data = path.read_bytes()
                block = block_store.decode_block(data, self.fingerprint, h)
            except FileNotFoundError:
                self.read_missing += 1
                forget.append(h)
                break
            except block_store.BlockFileError as exc:
                self.read_corrupt += 1
                if exc.reason == "corrupt":
                    # Deleted, so that it is reported once: the next request recomputes the
                    # block and writes it again.
                    block_store.unlink_quietly(path)
                    self.blocks_corrupt += 1
                    self.checksum_failures += exc.checksum
                    log.warning("ssd writer: block %s is corrupt (%s): deleted, its tokens "
                                "are prefilled again", h, exc)
                else:
                    log.warning("ssd writer: block %s unusable (%s)", h, exc)
                forget.append(h)
                break
            except (OSError, ValueError) as exc:
                log.error("ssd writer: reading block %s failed: %s", h, exc)
                break
            # The file's mtime is the LRU order a restart rebuilds from.
            try:
                os.utime(path)
            except OSError:
                pass
            self.read_blocks += 1
            blocks.append(block)
        try:
            await reply_to.tell(BlocksRead(request_id=request_id, blocks=blocks))
        except ActorDead:
            log.warning("ssd writer: %r stopped before its blocks were read", reply_to.name)
        if forget:
            await self._tell_index(ForgetBlocks(hashes=forget))

    # -- the index ----------------------------------------------------------------------------

    def _batch_sizes(self, block: BlockData, nbytes: int) -> list[int]:
        """The file sizes to make room for: this block's (``nbytes``), then an estimate of
        each queued block's, as this one's header over its tensors (the same layers and
        dtypes) plus ROOM_SLACK bytes."""
        overhead = nbytes - block.nbytes + ROOM_SLACK
        return [nbytes] + [m.block.nbytes + overhead for m in self._pending]

    async def _make_room(self, sizes: list[int]) -> int | None:
        """Ask the index, once, to make room under the quota for files of ``sizes`` (this
        block, then those queued behind it); the bytes of the leading ones that fit, or None
        if it cannot answer."""
        try:
            fit = await self.index.ask(MakeRoom(sizes=sizes), timeout=self.index_timeout_s)
            return sum(sizes[:fit])
        except (AskTimeout, ActorDead) as exc:
            log.warning("ssd writer: cache index did not make room (%r); block not written", exc)
            return None

    async def _tell_index(self, msg: Message) -> None:
        try:
            await self.index.tell(msg)
        except ActorDead:
            log.warning("ssd writer: cache index %r has stopped; %s not sent",
                        self.index.name, type(msg).__name__)
