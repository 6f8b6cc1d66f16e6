"""The scheduler's disk tier alone (actors/disk_tier.py): a real engine's RAM table, the real
cache index and SSD writer, and a recording actor in the scheduler's place; the requests it
starts are recorded instead of run.

What the scheduler's tests reach only through a model's steps is driven here one message at a
time: answers that come too late, spills that overlap, blocks of an aborted request.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from engine_helpers import engine_config
from test_prefix_serving import BLOCK, LONG
from test_ssd_writer import Cache, make_chain, running_cache

from troupe.actors import disk_tier
from troupe.actors.cache_messages import BlockData, FoundOnDisk, HeldOnDisk, LookupDisk
from troupe.actors.disk_tier import DiskTier
from troupe.actors.engine.core import Engine
from troupe.actors.engine.kv_blocks import KVBlock
from troupe.actors.engine.prefix import model_fingerprint
from troupe.actors.messages import AddRequest, SamplingParams
from troupe.runtime import Message, Reply
from troupe.runtime.reply import open_reply


class Ping(Message):
    """A barrier: the recording scheduler has handled everything sent to it before."""


@pytest.fixture
def engine(loaded, tiny_model_dir: Path) -> Engine:
    model, tok = loaded
    return Engine(model, tok, engine_config(block_size=BLOCK),
                  fingerprint=model_fingerprint(tiny_model_dir))


def tier_of(engine: Engine, cache: Cache, *, index: bool = True
            ) -> tuple[DiskTier, list[tuple[str, int]]]:
    """A disk tier on ``cache``'s actors (``index``: False for none), and the requests it
    starts: (request id, cached blocks), each started."""
    started: list[tuple[str, int]] = []

    def start(msg: AddRequest, reply: Reply, cached: list[KVBlock],
              partial_max: int | None) -> bool:
        started.append((msg.request_id, len(cached)))
        return True

    tier = DiskTier(engine, scheduler=cache.system.get("scheduler"),
                    index=cache.index if index else None, writer=cache.writer, start=start)
    return tier, started


def request(rid: str, prompt: list[int]) -> AddRequest:
    return AddRequest(request_id=rid, prompt_tokens=prompt,
                      sampling=SamplingParams(max_tokens=4, temperature=0.0))


def in_ram(data: BlockData) -> KVBlock:
    """A block of that name as the engine holds it."""
    layer = (mx.zeros((1, 2, 4, 16)), mx.zeros((1, 2, 4, 16)))
    return KVBlock(block_hash=data.block_hash, parent_hash=data.parent_hash,
                   n_tokens=data.n_tokens, layers=[layer])


async def told(cache: Cache, kind: type) -> list:
    """What the index and the writer have answered the scheduler by now, of ``kind``, taken
    from its inbox (each tells only the scheduler, and mailboxes are in order)."""
    await cache.writer.ask(LookupDisk(hashes=[]), timeout=5.0)
    await cache.index.ask(LookupDisk(hashes=[]), timeout=5.0)
    await cache.system.get("scheduler").ask(Ping(), timeout=5.0)
    found = [m for m in cache.inbox if isinstance(m, kind)]
    cache.inbox.clear()
    return found


async def test_an_answer_to_an_aborted_requests_lookup_does_not_start_the_one_that_took_its_id(
        engine: Engine, tmp_path: Path):
    async with running_cache(tmp_path) as cache:
        tier, started = tier_of(engine, cache)
        prompt = engine.tokenizer.encode(LONG)
        first, _ = open_reply()
        tier.begin(request("r", prompt), first)  # nothing in RAM: the index is asked
        assert tier.waiting == 1
        late = await told(cache, FoundOnDisk)
        assert late and all(m.request_id == "r" for m in late)
        assert tier.abort("r")[1] is first
        tier.begin(request("r", prompt), open_reply()[0])
        for msg in late:  # the aborted request's answer (and its deadline's, if it came)
            tier.found(msg)
        assert started == [] and tier.waiting == 1
        for msg in await told(cache, FoundOnDisk):  # its own
            tier.found(msg)
        assert started == [("r", 0)] and tier.waiting == 0


async def test_a_spill_asked_while_one_waits_for_the_index_joins_it_and_hard_pressure_wins(
        engine: Engine, tmp_path: Path):
    async with running_cache(tmp_path) as cache:
        tier, _ = tier_of(engine, cache)
        on_disk, only_ram, later = make_chain(3)
        await cache.write([on_disk])
        await cache.flush()
        engine.blocks.store(in_ram(on_disk))
        engine.blocks.store(in_ram(only_ram))
        tier.spill(unpersisted=False)  # soft pressure: the index is asked what is on disk
        tier.spill(unpersisted=True)  # hard, before the answer: no second question
        (answer,) = await told(cache, HeldOnDisk)
        assert answer.hashes == [on_disk.block_hash]
        assert len(engine.blocks) == 2  # nothing is freed before the answer
        tier.held(answer.hashes)
        assert len(engine.blocks) == 0  # hard pressure: the block on no disk went too
        # An answer no spill waits for frees nothing.
        engine.blocks.store(in_ram(later))
        tier.held([later.block_hash])
        assert list(engine.blocks) == [later.block_hash]


async def test_an_aborted_requests_blocks_still_waiting_for_the_disk_are_never_written(
        engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(disk_tier, "PERSIST_BYTES_PER_STEP", 1)  # one block a step
    async with running_cache(tmp_path) as cache:
        tier, started = tier_of(engine, cache, index=False)
        prompt = engine.tokenizer.encode("Once upon a time")
        for rid in ("aborted", "kept"):
            tier.begin(request(rid, prompt), open_reply()[0])
        assert started == [("aborted", 0), ("kept", 0)]  # no block to look up: at once
        written, waiting, kept = make_chain(3)
        await tier.persist_step([("aborted", in_ram(written)), ("aborted", in_ram(waiting)),
                                 ("kept", in_ram(kept))])
        assert tier.unsaved
        tier.cancel_writes("aborted")  # the block written goes, the one waiting never leaves
        await tier.persist_step([])
        assert not tier.unsaved
        await cache.flush()
        assert cache.files() == [cache.path(kept)]
        assert tier.report()["blocks_enqueued"] == 2
