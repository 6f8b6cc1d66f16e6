"""Messages of the paged prefix cache: scheduler -> cache index <-> SSD writer.

KV data crosses actors only as numpy arrays (``BlockData.tensors``): the scheduler snapshots
its ``mx.array``s to numpy on its own thread, and turns numpy back into MLX there. bfloat16
tensors travel as their uint16 bit pattern with ``dtypes[name] == "bfloat16"``. This module
imports neither MLX nor anything that does.
"""

from __future__ import annotations

from typing import Any

import msgspec

from troupe.runtime import ActorRef, Message

# Bumped whenever the on-disk block layout changes; files of another version are skipped.
# 2: a checksum of the tensor data in the metadata (version 1 files cannot be verified).
FORMAT_VERSION = 2


class BlockData(msgspec.Struct, frozen=True, kw_only=True):
    """One block's cache state: per-layer tensors as numpy arrays plus their original dtypes.

    Tensor names: ``"{layer}.keys"``/``"{layer}.values"`` for KV layers (shape
    [1, kv_heads, n_tokens, head_dim]) and for sliding-window layers (the block's last tokens
    the layer held, fewer than ``n_tokens`` or none at all); ``"{layer}.state.{j}"`` for
    recurrent-state layers (the state at the END of this block). ``dtypes`` maps each name to
    the MLX dtype name ("float16", "bfloat16", "float32", ...).
    """

    block_hash: str
    parent_hash: str | None
    n_tokens: int
    tensors: dict[str, Any]  # name -> numpy.ndarray
    dtypes: dict[str, str]
    # What each layer holds (``kv_blocks.layout``); "" in blocks written before it was kept.
    layout: str = ""

    @property
    def nbytes(self) -> int:
        return sum(int(t.nbytes) for t in self.tensors.values())


# --- scheduler -> SSD writer -----------------------------------------------------------------


class WriteBlock(Message, frozen=True, kw_only=True):
    """Persist one block. ``request_id``/``epoch`` let ``CancelWrites`` drop it precisely."""

    block: BlockData
    request_id: str
    epoch: int


class CancelWrites(Message, frozen=True, kw_only=True):
    """The request was aborted: drop its queued writes and leave no file or index entry.

    Only writes with this request id AND this epoch are dropped, so a later request that
    reuses the id (a new epoch) is never discarded.
    """

    request_id: str
    epoch: int


class ReadBlocks(Message, frozen=True, kw_only=True):
    """Read blocks from disk; the writer tells ``BlocksRead`` to ``reply_to``, the asker's ref
    (messages between actors stay in the process: a ref is never encoded)."""

    request_id: str
    hashes: list[str]
    reply_to: ActorRef


class BlocksRead(Message, frozen=True, kw_only=True):
    """Blocks read back from disk, in the order asked. A block that could not be read (gone,
    corrupt) ends the list early: only a contiguous chain is usable."""

    request_id: str
    blocks: list[BlockData]


class FlushWrites(Message, frozen=True, kw_only=True):
    """Write what is queued within ``deadline_s``; answered (ask) with the count written."""

    deadline_s: float = 5.0


# --- SSD writer -> cache index -------------------------------------------------------------


class BlockPersisted(Message, frozen=True, kw_only=True):
    block_hash: str
    parent_hash: str | None
    n_tokens: int
    nbytes: int  # bytes of the file on disk


class BlockWriteFailed(Message, frozen=True, kw_only=True):
    block_hash: str
    error: str


class ForgetBlocks(Message, frozen=True, kw_only=True):
    """Writer -> index: these blocks' files are gone (a cancelled request's, or found missing or
    corrupt on read): drop their entries."""

    hashes: list[str]


class MakeRoom(Message, frozen=True, kw_only=True):
    """Writer -> index (ask): free disk space under the quota for files of these ``sizes``, in
    the order they will be written (a batch: the writer asks once for the blocks it holds, not
    once per block), deleting least recently used files (a bounded burst per call). Answered
    with how many of the leading sizes fit now."""

    sizes: list[int]


# --- scheduler -> cache index ----------------------------------------------------------------


class LookupDisk(Message, frozen=True, kw_only=True):
    """How many leading blocks of this chain have files? The hits become the most recently used
    on disk. With ``reply_to`` (the asker's ref) the answer is told to it as ``FoundOnDisk``
    (the scheduler, which never waits on the index inside a step: ``request_id`` and ``epoch``
    name the request waiting for it); without, it is the answer to an ``ask`` (an int). The
    scheduler asks only for what follows the blocks it holds in RAM."""

    hashes: list[str]
    request_id: str = ""
    epoch: int = 0
    reply_to: ActorRef | None = None


class OnDisk(Message, frozen=True, kw_only=True):
    """Which of these blocks have files? Their hashes, in the order asked: the RAM blocks a
    spill may drop without losing them. With ``reply_to`` (the asker's ref) told to it as
    ``HeldOnDisk``; without, the answer to an ``ask``."""

    hashes: list[str]
    reply_to: ActorRef | None = None


# --- cache index -> scheduler ----------------------------------------------------------------


class FoundOnDisk(Message, frozen=True, kw_only=True):
    """The answer to a ``LookupDisk`` with ``reply_to``: the first ``blocks`` of the hashes
    asked about have files."""

    request_id: str
    epoch: int
    blocks: int


class HeldOnDisk(Message, frozen=True, kw_only=True):
    """The answer to an ``OnDisk`` with ``reply_to``: those of the hashes asked about that have
    files."""

    hashes: list[str]


# --- memory monitor -> scheduler -------------------------------------------------------------


class SpillRam(Message, frozen=True, kw_only=True):
    """Memory is short: free RAM blocks of the prefix cache (one bounded burst).

    Blocks already on disk lose only their RAM copy; with ``unpersisted`` (hard pressure)
    blocks not on disk are dropped too, and lost to the cache."""

    unpersisted: bool = False
