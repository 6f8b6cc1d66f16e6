"""The prefix cache against a plain model: random sequences of store, lookup, read, evict,
spill, restart and corruption (Hypothesis's ``RuleBasedStateMachine``).

What must hold, whatever the order: a hit returns exactly what was stored (bit for bit);
the RAM and disk quotas are never exceeded; nothing evicted, deleted or corrupt is served.

Three layers, each driven without a model:

- ``PrefixCache`` (actors/engine/prefix_cache.py), the engine's RAM blocks: the LRU within a
  byte budget, lookups and partial hits, spills. Pure code against a dict, many steps.
- ``DiskTable`` (actors/cache_index.py), the disk catalogue's policy: which blocks have files,
  within a byte quota. Pure code against a set, many steps.
- The cache index and SSD writer actors on a real ``ActorSystem``, with a ``PrefixCache`` and a
  fake scheduler in the scheduler's place and a real directory: blocks written and read back
  through ``actors.block_store``'s files, files corrupted, truncated and deleted underfoot, the
  whole stack restarted on the directory. The model here is what the directory holds, judged
  by ``block_store``'s own public functions: a file is intact when ``decode_block`` reads back
  the block stored.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import tempfile
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from troupe.actors import block_store
from troupe.actors.cache_index import CACHE_INDEX_THREAD, CacheIndex, DiskTable
from troupe.actors.cache_messages import (
    BlockData,
    BlocksRead,
    FlushWrites,
    LookupDisk,
    OnDisk,
    ReadBlocks,
    WriteBlock,
)
from troupe.actors.engine.kv_blocks import KVBlock
from troupe.actors.engine.prefix_cache import PrefixCache
from troupe.actors.ssd_writer import SSD_THREAD, SsdWriter
from troupe.runtime import Actor, ActorSystem, Message

FP = "prop-model@0123abcd"
TIMEOUT_S = 10.0

# The blocks every machine plays with: a forest of prefix chains (hash -> parent). Hashes are
# valid file names; two chains share "r0a", so eviction of one can cut the other's prefix.
UNIVERSE: dict[str, str | None] = {
    "r0": None, "r0a": "r0", "r0ab": "r0a", "r0abc": "r0ab", "r0ax": "r0a", "r0axy": "r0ax",
    "r1": None, "r1a": "r1", "r1ab": "r1a",
    "r2": None,
}
HASHES = list(UNIVERSE)


def chain(h: str) -> list[str]:
    """The chain of hashes from its root down to ``h``, as a prompt would look it up."""
    out = [h]
    while (parent := UNIVERSE[out[-1]]) is not None:
        out.append(parent)
    return out[::-1]


nodes = st.sampled_from(HASHES)
# A chain, sometimes followed by a block the cache has never seen.
lookups = st.tuples(nodes, st.booleans()).map(
    lambda t: chain(t[0]) + (["never-stored"] if t[1] else []))


# Bytes per block (a fixed size per hash, as a real block has), and budgets a few blocks wide.
SIZES = {h: 1000 * (1 + i % 3) for i, h in enumerate(HASHES)}
SIZES["r2"] = 12_000  # larger than either budget: never kept
RAM_MAX, DISK_MAX = 6_000, 9_000
# A burst wider than the universe: every eviction finishes in one call, so the budgets hold
# after every step (bounded bursts are pinned in test_prefix_cache.py and test_cache_index.py).
BURST = 64


# --- PrefixCache: the engine's RAM blocks -----------------------------------------------------


def ram_block(h: str, tokens: tuple[int, ...] = ()) -> KVBlock:
    # One layer of SIZES[h] bytes (numpy stands in for MLX: only ``nbytes`` is read).
    return KVBlock(block_hash=h, parent_hash=UNIVERSE[h], n_tokens=16,
                   layers=[(np.zeros(SIZES[h], np.uint8),)], tokens=tokens or None)


class PrefixCacheMachine(RuleBasedStateMachine):
    """``PrefixCache`` against a dict of the blocks it holds: a hit is the very block stored;
    evictions happen only over the budget, leaves first; spills free blocks on disk first;
    partial hits are the longest shared run of tokens after the same parent, ties to the
    newest."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = PrefixCache(RAM_MAX, block_size=16, evict_burst=BURST)
        self.model: dict[str, KVBlock] = {}  # insertion order: newest last

    @rule(h=nodes, tokens=st.lists(st.integers(0, 2), max_size=4))
    def store(self, h: str, tokens: list[int]) -> None:
        """The engine cuts a block (or promotes one read from disk); over the budget the least
        recently used go, and only then."""
        block = ram_block(h, tuple(tokens))
        held = dict(self.model)
        assert self.cache.store(block) == (h not in held)
        if h not in held and SIZES[h] <= RAM_MAX:
            held[h] = block
        evicted = set(held) - set(self.cache)
        assert set(self.cache) <= set(held)
        if evicted:
            assert sum(SIZES[x] for x in held) > RAM_MAX
        # Leaves went first: no block kept lost its parent to this eviction.
        assert not [x for x in self.cache if UNIVERSE[x] in evicted]
        self.model = {x: b for x, b in held.items() if x not in evicted}

    @rule(hashes=lookups)
    def lookup(self, hashes: list[str]) -> None:
        """The longest leading chain held, the very blocks stored: nothing evicted shows."""
        expected = []
        for h in hashes:
            if h not in self.model:
                break
            expected.append(self.model[h])
        got = self.cache.lookup(hashes)
        assert len(got) == len(expected) and all(
            g is e for g, e in zip(got, expected, strict=True))

    @rule(on_disk=st.sets(nodes), unpersisted=st.booleans())
    def spill(self, on_disk: set[str], unpersisted: bool) -> None:
        """Memory pressure: RAM copies of blocks on disk go first; the others only when
        ``unpersisted``."""
        victims = self.cache.spill_victims(on_disk, unpersisted=unpersisted)
        assert set(victims) <= set(self.model) and len(victims) <= BURST
        assert len(set(victims)) == len(victims)
        persisted = [v in on_disk for v in victims]
        assert persisted == sorted(persisted, reverse=True)  # the persisted ones first
        if not unpersisted:
            assert all(persisted)
            assert set(victims) == set(self.model) & on_disk
        else:
            assert set(victims) == set(self.model)
        assert self.cache.spill(victims) == len(victims)
        for v in victims:
            del self.model[v]

    @rule(parent=st.sampled_from([None, *HASHES]), tokens=st.lists(st.integers(0, 2),
                                                                     max_size=4))
    def best_partial(self, parent: str | None, tokens: list[int]) -> None:
        best, n = self.cache.best_partial(parent, tokens)
        candidates = [
            b for b in self.model.values()
            if b.parent_hash == parent and tokens and b.tokens and b.tokens[0] == tokens[0]
        ]
        if not candidates:
            assert (best, n) == (None, 0)
            return

        def shared(b: KVBlock) -> int:
            return next((i for i, (x, y) in enumerate(zip(b.tokens or (), tokens,
                                                          strict=False)) if x != y),
                        min(len(b.tokens or ()), len(tokens)))

        longest = max(shared(b) for b in candidates)
        newest = [b for b in candidates if shared(b) == longest][-1]
        assert (best, n) == (newest, longest)

    @invariant()
    def the_cache_is_the_model(self) -> None:
        cache = self.cache
        assert len(cache) == len(self.model) and set(cache) == set(self.model)
        assert all(cache[h] is b for h, b in self.model.items())
        assert cache.nbytes == sum(SIZES[h] for h in self.model) <= RAM_MAX
        stats = cache.stats()
        assert (stats["ram_blocks"], stats["ram_block_bytes"]) == (len(cache), cache.nbytes)

    @invariant()
    def every_block_is_older_than_its_parent(self) -> None:
        """What makes eviction take leaves first: a block is worth nothing without its
        ancestors."""
        order = {h: i for i, h in enumerate(self.cache)}
        for h, i in order.items():
            parent = UNIVERSE[h]
            if parent in order:
                assert i < order[parent], (h, list(self.cache))


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, derandomize=True, database=None,
    deadline=None, suppress_health_check=[HealthCheck.too_slow],
)


def test_the_ram_blocks_keep_their_budget_and_serve_exactly_what_was_stored() -> None:
    PrefixCacheMachine.TestCase().runTest()


# --- DiskTable: the disk catalogue's policy ---------------------------------------------------


class DiskTableMachine(RuleBasedStateMachine):
    """``DiskTable`` driven as the index drives it, against the set of blocks on disk."""

    def __init__(self) -> None:
        super().__init__()
        self.table = self._table()
        self.disk: set[str] = set()

    @staticmethod
    def _table() -> DiskTable:
        return DiskTable(disk_max_bytes=DISK_MAX, evict_burst=BURST)

    @staticmethod
    def _entry(h: str) -> tuple[str, str | None, int, int]:
        return (h, UNIVERSE[h], 16, SIZES[h])

    @rule(h=nodes)
    def save(self, h: str) -> None:
        """The writer persists one block: a file already there is kept (deduplicated), else
        the index makes room (``MakeRoom``) and the file is written if it fits."""
        if h in self.disk:
            self.table.add(*self._entry(h))
            return
        victims = self.table.victims(SIZES[h])
        assert set(victims) <= self.disk
        self.table.drop(victims, evicted=True)
        self.disk -= set(victims)
        if self.table.has_room(SIZES[h]):
            self.table.add(*self._entry(h))
            self.disk.add(h)
        else:
            # Only a block larger than the whole quota never fits.
            assert SIZES[h] > DISK_MAX

    @rule(hashes=lookups)
    def lookup(self, hashes: list[str]) -> None:
        """A hit is the longest leading chain on disk: nothing dropped shows."""
        expected = 0
        while expected < len(hashes) and hashes[expected] in self.disk:
            expected += 1
        assert self.table.lookup(hashes) == expected

    @rule(hashes=st.lists(nodes, max_size=5))
    def on_disk(self, hashes: list[str]) -> None:
        assert self.table.on_disk(hashes) == [h for h in hashes if h in self.disk]

    @rule(data=st.data())
    def forget(self, data: st.DataObject) -> None:
        """``ForgetBlocks``: the writer found these files gone or corrupt."""
        forgotten = data.draw(st.lists(nodes, max_size=3))
        self.table.drop(forgotten)
        self.disk -= set(forgotten)

    @rule()
    def restart(self) -> None:
        """A new index rebuilt from the files found at start."""
        self.table = self._table()
        self.table.load([self._entry(h) for h in sorted(self.disk)])

    @invariant()
    def the_table_is_the_model(self) -> None:
        t = self.table
        assert set(t.disk) == self.disk
        assert t.disk.nbytes == sum(SIZES[h] for h in self.disk) <= DISK_MAX
        # Metadata is kept exactly for the blocks on disk, children included.
        assert set(t.meta) == self.disk
        for parent, children in t.children.items():
            assert children and all(t.meta[c].parent == parent for c in children)


DiskTableMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, derandomize=True, database=None,
    deadline=None, suppress_health_check=[HealthCheck.too_slow],
)


def test_the_disk_table_keeps_its_quota_and_serves_only_what_it_holds() -> None:
    DiskTableMachine.TestCase().runTest()


# --- the index and the writer, on disk ---------------------------------------------------------


def make_block(h: str) -> BlockData:
    """The block stored for ``h``: the same bytes every run, sizes differing by block."""
    i = HASHES.index(h)
    rng = np.random.default_rng(i)
    n = 4 if i % 2 else 8
    shape = (1, 2, n, 8)
    return BlockData(
        block_hash=h, parent_hash=UNIVERSE[h], n_tokens=n,
        tensors={"0.keys": rng.standard_normal(shape).astype(np.float16),
                 "1.keys": rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)},
        dtypes={"0.keys": "float16", "1.keys": "bfloat16"},
    )


BLOCKS = {h: make_block(h) for h in HASHES}
FILE_SIZES = {h: len(block_store.encode_block(b, FP)) for h, b in BLOCKS.items()}
# About four files: every few writes evict. RAM: two to four blocks of the engine's bytes.
STACK_DISK_MAX = 4 * max(FILE_SIZES.values())
STACK_RAM_MAX = 2 * max(b.nbytes for b in BLOCKS.values())


def in_ram(data: BlockData) -> KVBlock:
    """A block as the engine holds it (numpy for MLX, as ``from_numpy`` would make it)."""
    return KVBlock(block_hash=data.block_hash, parent_hash=data.parent_hash,
                   n_tokens=data.n_tokens, layers=[tuple(data.tensors[k] for k in
                                                         sorted(data.tensors))])


class Ping(Message):
    pass


class FakeScheduler(Actor):
    """Keeps what the cache actors send the scheduler; answers ``Ping`` (a barrier)."""

    def __init__(self, inbox: list[Any]) -> None:
        self.inbox = inbox

    async def handle(self, msg: Any) -> None:
        if not isinstance(msg, Ping):
            self.inbox.append(msg)


def same_in_ram(got: KVBlock, want: BlockData) -> bool:
    """Bit for bit, a RAM block against the block stored."""
    arrays = [want.tensors[k] for k in sorted(want.tensors)]
    return (got.block_hash, got.parent_hash, got.n_tokens) == (
        want.block_hash, want.parent_hash, want.n_tokens) and len(got.layers) == 1 and all(
        g.dtype == w.dtype and g.tobytes() == w.tobytes()
        for g, w in zip(got.layers[0], arrays, strict=True))


def same_block(got: BlockData, want: BlockData) -> bool:
    """Bit for bit: NaN payloads and signed zeros too."""
    return (
        (got.block_hash, got.parent_hash, got.n_tokens, got.dtypes)
        == (want.block_hash, want.parent_hash, want.n_tokens, want.dtypes)
        and got.tensors.keys() == want.tensors.keys()
        and all(got.tensors[k].dtype == v.dtype and got.tensors[k].shape == v.shape
                and got.tensors[k].tobytes() == v.tobytes() for k, v in want.tensors.items())
    )


class CacheStackMachine(RuleBasedStateMachine):
    """The cache index and the SSD writer on a real directory, with the engine's RAM blocks
    (a ``PrefixCache``) and a fake scheduler actor (it receives the blocks read) in the
    scheduler's place: lookups and spills go as the scheduler makes them."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="troupe-prop-cache-"))
        self.loop = asyncio.new_event_loop()
        self.inbox: list[Any] = []
        self.requests = itertools.count()
        # The files deleted behind the index's back (it may still list them until a read or a
        # restart tells it).
        self.deleted: set[str] = set()
        # Files changed behind its back (while they last): the next reads go for them.
        self.tampered: set[str] = set()
        self._start()

    # -- plumbing -------------------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, TIMEOUT_S))

    def _start(self) -> None:
        self.ram = PrefixCache(STACK_RAM_MAX, evict_burst=64)  # RAM starts empty
        self.system = ActorSystem()
        self._run(self._spawn())

    async def _spawn(self) -> None:
        await self.system.__aenter__()
        self.scheduler = await self.system.spawn(FakeScheduler, name="scheduler",
                                                 inbox=self.inbox)
        self.index = await self.system.spawn(
            CacheIndex, name="cache_index", thread=CACHE_INDEX_THREAD, cache_dir=str(self.dir),
            fingerprint=FP, disk_max_bytes=STACK_DISK_MAX, evict_burst=64,
        )
        self.writer = await self.system.spawn(
            SsdWriter, name="ssd_writer", thread=SSD_THREAD, cache_dir=str(self.dir),
            fingerprint=FP, disk_max_bytes=STACK_DISK_MAX, index=self.index,
        )

    async def _barrier(self) -> None:
        """Everything sent so far has been handled: writer, then index, then scheduler (each
        tells only the next, and mailboxes are FIFO)."""
        await self.writer.ask(FlushWrites(deadline_s=TIMEOUT_S), timeout=TIMEOUT_S)
        await self.index.ask(LookupDisk(hashes=[]), timeout=TIMEOUT_S)
        await self.scheduler.ask(Ping(), timeout=TIMEOUT_S)

    def _sync(self) -> list[Any]:
        """Wait for the barrier; what the scheduler was sent since the last call."""
        self._run(self._barrier())
        sent, self.inbox[:] = list(self.inbox), []
        return sent

    def _report(self) -> dict[str, Any]:
        (snap,) = [s for s in self.system.snapshot() if s.name == "cache_index"]
        assert snap.report is not None
        return snap.report

    def _path(self, h: str) -> Path:
        return block_store.block_path(self.dir, h)

    def _intact(self, h: str) -> bool:
        """The file holds exactly the block stored (``block_store`` is the judge)."""
        try:
            data = self._path(h).read_bytes()
            return same_block(block_store.decode_block(data, FP, h), BLOCKS[h])
        except (OSError, block_store.BlockFileError):
            return False

    def _files(self) -> dict[str, int]:
        return {p.name.removesuffix(block_store.FILE_SUFFIX): p.stat().st_size
                for p in self.dir.rglob(f"*{block_store.FILE_SUFFIX}")}

    # -- rules ----------------------------------------------------------------------------------

    @rule(h=nodes, where=st.sampled_from(["both", "both", "disk", "ram"]))
    def store(self, h: str, where: str) -> None:
        """The engine cuts a chain: it holds the blocks in RAM (over the budget the least
        recently used go) and the scheduler has them written (``WriteBlock``; the writer
        makes room with the index), as serving does, or only one of the two."""
        if where in ("both", "ram"):
            for b in chain(h):
                self.ram.store(in_ram(BLOCKS[b]))
        if where in ("both", "disk"):
            request = f"w{next(self.requests)}"
            for b in chain(h):
                self._run(self.writer.tell(WriteBlock(block=BLOCKS[b], request_id=request,
                                                      epoch=0)))
        self._sync()
        self.deleted -= set(self._files())  # written again: the index knows the file

    @rule(hashes=lookups)
    def lookup(self, hashes: list[str]) -> None:
        """As the scheduler looks a prompt up: the chain in RAM (the very blocks stored), then
        the index for the rest, each a file (or one deleted behind its back)."""
        ram = self.ram.lookup(hashes)
        assert all(same_in_ram(b, BLOCKS[b.block_hash]) for b in ram)
        rest = hashes[len(ram):]
        n = self._run(self.index.ask(LookupDisk(hashes=rest), timeout=TIMEOUT_S))
        files = self._files()
        for h in rest[:n]:
            assert h in files or h in self.deleted, (h, "listed, but no file")
        if len(ram) + n < len(hashes):
            # Each part is the longest it can be. (A RAM block after the disk part is not
            # served: the RAM part is a leading chain, then the disk.)
            stop = hashes[len(ram) + n]
            assert stop not in files, (stop, "on disk, but not served")
            assert n or stop not in self.ram, (stop, "in RAM, but not served")

    @rule(h=nodes)
    def read(self, h: str) -> None:
        """Read a chain back: exactly the blocks stored, up to the first file missing or not
        intact, which is deleted (if corrupt) and forgotten."""
        hashes = chain(h)
        intact = [self._intact(b) for b in hashes]
        served = intact.index(False) if False in intact else len(hashes)
        request = f"r{next(self.requests)}"
        self._run(self.writer.tell(ReadBlocks(request_id=request, hashes=hashes,
                                              reply_to=self.scheduler)))
        (answer,) = [m for m in self._sync() if isinstance(m, BlocksRead)]
        assert answer.request_id == request
        assert [b.block_hash for b in answer.blocks] == hashes[:served]
        assert all(same_block(b, BLOCKS[b.block_hash]) for b in answer.blocks)
        for b in answer.blocks:  # promoted to RAM, as the scheduler does
            self.ram.store(in_ram(b))
        if served < len(hashes):
            failed = hashes[served]
            # A corrupt file is deleted; a missing one stays missing; either is forgotten.
            assert not self._path(failed).exists()
            self.deleted.discard(failed)

    @rule(h=nodes)
    def read_tampered(self, h: str) -> None:
        """Read a chain whose file was changed underfoot: it must not be served. (Drawn from
        every hash, not from the files: what the directory holds may differ between two runs
        of the same steps, and a draw must not depend on it.)"""
        if h not in self.tampered or h not in self._files():
            return
        self.read(h)
        self.tampered.discard(h)

    @rule(unpersisted=st.booleans())
    def spill(self, unpersisted: bool) -> None:
        """Memory pressure, as the scheduler spills: it asks the index which RAM blocks are
        on disk (``OnDisk``); their RAM copies go first (and are still served from disk), the
        others only with ``unpersisted``."""
        files = self._files()
        candidates = list(self.ram)
        on_disk = self._run(self.index.ask(OnDisk(hashes=candidates), timeout=TIMEOUT_S))
        assert set(on_disk) <= set(files) | self.deleted, on_disk
        victims = self.ram.spill_victims(set(on_disk), unpersisted=unpersisted)
        self.ram.spill(victims)
        assert not set(victims) & set(self.ram)
        if not unpersisted:
            assert set(victims) <= set(files) | self.deleted, victims

    @rule(h=nodes, how=st.sampled_from(["overwrite", "truncate", "delete"]),
          where=st.floats(0, 1, exclude_max=True))
    def tamper(self, h: str, how: str, where: float) -> None:
        """A file changed behind the cache's back: tensor bytes overwritten (same size, the
        header intact: only the checksum can tell), truncated, or deleted. Every draw is of
        fixed bounds (``where``: a fraction of the file), never of what the directory holds,
        which may differ between two runs of the same steps."""
        if h not in self._files():
            return
        path = self._path(h)
        raw = bytearray(path.read_bytes())
        if how == "overwrite" and raw:
            # In the tensor data of a whole file; anywhere in one already cut short.
            start = 8 + int.from_bytes(raw[:8], "little")
            start = start if start < len(raw) else 0
            at = start + int(where * (len(raw) - start))
            raw[at] ^= 0xFF
            path.write_bytes(bytes(raw))
            self.tampered.add(h)
        elif how == "truncate" and raw:
            path.write_bytes(bytes(raw[: int(where * len(raw))]))
            self.tampered.add(h)
        elif how == "delete":
            path.unlink()
            self.deleted.add(h)

    @rule()
    def restart(self) -> None:
        """Stop the whole stack and start it again on the same directory: RAM is gone, and
        the index is what the scan finds (broken files deleted, unreadable ones skipped)."""
        self._run(self.system.stop())
        self.deleted = set()
        self._start()
        self.tampered &= set(self._files())  # the cut short are gone: the scan deleted them
        files = self._files()
        for h in files:
            block_store.read_block_info(self._path(h), FP)  # every header left reads
        report = self._report()
        assert report["blocks"] == len(files)
        assert report["disk_bytes"] == sum(files.values())

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def the_quotas_hold(self) -> None:
        report = self._report()
        assert self.ram.nbytes <= STACK_RAM_MAX
        assert report["disk_bytes"] <= STACK_DISK_MAX
        assert sum(self._files().values()) <= STACK_DISK_MAX

    @invariant()
    def the_directory_holds_only_whole_blocks_of_ours(self) -> None:
        assert not list(self.dir.rglob(f"*{block_store.TEMP_SUFFIX}"))
        assert set(self._files()) <= set(HASHES)

    def teardown(self) -> None:
        try:
            self._run(self.system.stop())
        finally:
            self.loop.close()
            shutil.rmtree(self.dir, ignore_errors=True)


CacheStackMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=40, derandomize=True, database=None,
    deadline=None, suppress_health_check=[HealthCheck.too_slow],
    # No shrinking: each try starts actors and threads, so shrinking a failure could run for
    # many minutes. A failure prints its whole sequence of steps, the same every run.
    phases=[Phase.explicit, Phase.generate],
)


@pytest.mark.timeout(240)
def test_the_cache_on_disk_serves_exactly_what_was_stored_within_its_quotas() -> None:
    CacheStackMachine.TestCase().runTest()


def test_the_universe_is_what_the_machines_assume() -> None:
    # Every hash can be a file name; the budgets hold a few blocks each.
    assert all(block_store.valid_hash(h) for h in HASHES)
    assert STACK_DISK_MAX // max(FILE_SIZES.values()) == 4
    # The longest chain does not fit the RAM budget alone: stores evict.
    assert sum(SIZES[h] for h in chain("r0abc")) > RAM_MAX
    assert sum(BLOCKS[h].nbytes for h in chain("r0abc")) > STACK_RAM_MAX
