"""The prefix cache of a sharded model, without ``mlx.launch``: a follower's reservations and
disk (actors/follower_cache.py, actors/follower_disk.py), rank 0's probe over the channel
(actors/distributed/leader.py), and the memory of the other ranks counted by the gate and the
monitor.

The follower's engine is a stand-in with the real RAM table and real block hashes; its blocks
hold small MLX arrays.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import pytest
from test_distributed import SECRET, Grammars, _following, _pair, _plan, free_port

from troupe.actors import block_store
from troupe.actors.distributed.follower import connect, follow
from troupe.actors.distributed.leader import Followers
from troupe.actors.distributed.protocol import Supply, combine
from troupe.actors.engine.config import EngineConfig
from troupe.actors.engine.kv_blocks import KV, KVBlock, layout, to_numpy
from troupe.actors.engine.prefix import block_hashes, namespace_root, usable_blocks
from troupe.actors.engine.prefix_cache import PrefixCache
from troupe.actors.follower_cache import FollowerCache, SupplyError
from troupe.actors.follower_disk import FollowerDisk
from troupe.actors.messages import SamplingParams

B = 4  # tokens per block
PROMPT = list(range(100, 115))  # 15 tokens: 3 usable blocks, then 3 tokens
LAYOUT = layout([KV, KV], [0, 0])
SAMPLING = SamplingParams(max_tokens=2, temperature=0.0)


class Engine:
    """The parts of ``Engine`` a follower's cache uses. ``add`` records what it was given and
    starts the request from the cached blocks plus ``partial_max`` tokens."""

    def __init__(self, ram_max: int = 1 << 20) -> None:
        self.block_size = B
        self.fingerprint = "fp"
        self.blocks = PrefixCache(ram_max, block_size=B)
        self.caching, self.hybrid = True, False
        self.kinds, self.state_sizes = [KV, KV], [0, 0]
        self.layout = LAYOUT
        self.new_blocks: list[tuple[str, KVBlock]] = []
        self.added: list[tuple[str, list[KVBlock], int | None]] = []
        self.last_digest = 0

    def chain_root(self, namespace: str = "") -> str:
        return namespace_root(self.fingerprint, namespace)

    def prompt_hashes(self, prompt: list[int], namespace: str = "") -> list[str]:
        return block_hashes(self.chain_root(namespace), prompt, B)[: usable_blocks(len(prompt), B)]

    def take_new_blocks(self) -> list[tuple[str, KVBlock]]:
        out, self.new_blocks = self.new_blocks, []
        return out

    def add(self, request_id: str, prompt: list[int], sampling: SamplingParams,
            cached: list[KVBlock] = (), *, partial_max: int | None = None, output: Any = None,
            constraint: Any = None, namespace: str = "") -> SimpleNamespace:
        self.added.append((request_id, list(cached), partial_max))
        return SimpleNamespace(cached_tokens=len(cached) * B + (partial_max or 0))

    def step(self, plan: Any) -> None:
        self.last_digest += 1

    def abort(self, request_id: str) -> None:
        pass

    def reset(self, reason: str) -> None:
        pass


def block(prompt: list[int], i: int, fill: float | None = None) -> KVBlock:
    """Block ``i`` of ``prompt``, its arrays filled with ``fill`` (default: i)."""
    hashes = block_hashes("fp", prompt, B)
    value = float(i if fill is None else fill)
    layers = [(mx.full((1, 1, B, 2), value), mx.full((1, 1, B, 2), -value)) for _ in range(2)]
    mx.eval(layers)  # a follower thread may snapshot it: MLX streams are per thread
    return KVBlock(block_hash=hashes[i], parent_hash=hashes[i - 1] if i else None,
                   n_tokens=B, layers=layers, tokens=tuple(prompt[i * B:(i + 1) * B]),
                   root="fp")  # the shared namespace's root: the fingerprint


def answers() -> tuple[list[tuple[str, int, list[int]]], Any]:
    got: list[tuple[str, int, list[int]]] = []
    return got, lambda rid, blocks, partials: got.append((rid, blocks, partials))


def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# -- a follower's reservations -------------------------------------------------------------------


def test_a_follower_offers_the_leading_blocks_it_holds_and_eviction_cannot_take_them():
    engine = Engine()
    for i in (0, 1, 2):
        engine.blocks.store(block(PROMPT, i))
    got, answer = answers()
    cache = FollowerCache(engine, answer)
    cache.probe("r", PROMPT, 3)
    assert got[0][:2] == ("r", 3)
    held = [engine.blocks[h] for h in engine.prompt_hashes(PROMPT)]
    engine.blocks.spill(list(engine.blocks))  # memory pressure before the Add comes
    assert len(engine.blocks) == 0
    cached, partial = cache.claim("r", PROMPT, 3, 3 * B)
    assert cached == held and partial == 0
    assert cache.reserved == {} and cache.hit_tokens == 3 * B


def test_a_follower_offers_no_more_than_rank_0_offered_and_stops_at_its_first_missing_block():
    engine = Engine()
    for i in (0, 2):
        engine.blocks.store(block(PROMPT, i))
    got, answer = answers()
    cache = FollowerCache(engine, answer)
    cache.probe("a", PROMPT, 3)
    engine.blocks.store(block(PROMPT, 1))
    cache.probe("b", PROMPT, 2)
    assert [(rid, n) for rid, n, _ in got] == [("a", 1), ("b", 2)]


def test_taking_more_than_a_follower_promised_is_a_supply_error():
    engine = Engine()
    engine.blocks.store(block(PROMPT, 0))
    cache = FollowerCache(engine, answers()[1])
    cache.probe("r", PROMPT, 3)
    with pytest.raises(SupplyError, match="promised 1 blocks"):
        cache.claim("r", PROMPT, 2, 2 * B)
    with pytest.raises(SupplyError, match="promised nothing"):
        cache.claim("never-probed", PROMPT, 1, B)
    assert cache.claim("cold", PROMPT, 0, 0) == ([], 0)  # no cache taken: nothing to supply


def test_a_partial_hit_is_offered_after_each_block_and_taken_exactly_as_rank_0_took_it():
    engine = Engine()
    engine.blocks.store(block(PROMPT, 0))
    # Another prompt's block after the same first block: it shares 3 of the next 4 tokens.
    other = PROMPT[:B] + PROMPT[B:B + 3] + [999]
    hashes = block_hashes("fp", other, B)
    sibling = KVBlock(block_hash=hashes[1], parent_hash=hashes[0], n_tokens=B,
                      layers=block(PROMPT, 1).layers, tokens=tuple(other[B:2 * B]))
    engine.blocks.store(sibling)
    got, answer = answers()
    cache = FollowerCache(engine, answer)
    cache.probe("r", PROMPT, 3)
    # One block; before it, the block itself as a partial hit; after it 3 tokens of one.
    assert got == [("r", 1, [B, 3])]
    engine.blocks.spill([sibling.block_hash])
    cached, partial = cache.claim("r", PROMPT, 1, B + 2)
    assert len(cached) == 1 and partial == 2
    assert sibling.block_hash in engine.blocks  # back in RAM for the engine's partial hit
    cache.probe("s", PROMPT, 3)
    with pytest.raises(SupplyError, match="partial hit of 4 tokens"):
        cache.claim("s", PROMPT, 1, B + 4)


def test_a_released_reservation_is_gone():
    engine = Engine()
    engine.blocks.store(block(PROMPT, 0))
    cache = FollowerCache(engine, answers()[1])
    cache.probe("r", PROMPT, 1)
    cache.release("r")
    assert cache.reserved == {}


def test_rank_0_takes_the_fewest_blocks_any_rank_offers_and_the_shortest_partial_after_them():
    a = Supply(request_id="r", blocks=3, partials=[4, 4, 2, 1])
    b = Supply(request_id="r", blocks=2, partials=[4, 3, 0])
    assert combine([a, b]) == (2, [4, 3, 0])
    assert combine([a]) == (3, [4, 4, 2, 1])
    assert combine([]) == (0, [])


# -- a follower's disk -------------------------------------------------------------------------


def written(disk: FollowerDisk, n: int) -> None:
    """Wait until the SSD writer has written ``n`` blocks (the step loop never waits for it)."""
    wait_for(lambda: disk.stats()["disk_written"] >= n)


def test_blocks_only_on_a_followers_disk_are_read_supplied_and_promoted_after_a_restart(tmp_path):
    disk = FollowerDisk(tmp_path, "fp", 1 << 30)
    engine = Engine()
    cache = FollowerCache(engine, answers()[1], disk)
    engine.new_blocks = [("first", block(PROMPT, i)) for i in range(3)]
    cache.after_step()
    assert not cache.unsaved
    written(disk, 3)
    disk.close()

    disk = FollowerDisk(tmp_path, "fp", 1 << 30)  # the group restarted: RAM is empty
    assert disk.stats()["disk_blocks"] == 3  # the index found the files
    engine = Engine()
    got, answer = answers()
    cache = FollowerCache(engine, answer, disk)
    cache.probe("r", PROMPT, 3)
    wait_for(lambda: got)  # answered by the disk clerk, once the blocks are read
    assert got[0][:2] == ("r", 3)
    cached, _ = cache.claim("r", PROMPT, 3, 3 * B)
    for i, b in enumerate(cached):
        assert b.tokens == tuple(PROMPT[i * B:(i + 1) * B])
        assert mx.array_equal(b.layers[1][0], block(PROMPT, i).layers[1][0]).item()
        assert b.block_hash in engine.blocks  # promoted to RAM
    assert disk.stats()["disk_read_blocks"] == 3
    disk.close()


def test_a_followers_blocks_go_through_the_cache_index_and_the_ssd_writer(tmp_path):
    """One disk tier on every rank: a follower's files are kept by the same actors as rank
    0's, the catalogue by the cache index and the files by the SSD writer."""
    from troupe.actors.cache_index import CacheIndex
    from troupe.actors.ssd_writer import SsdWriter

    disk = FollowerDisk(tmp_path, "fp", 1 << 30)
    kinds = {s.name: s.actor_class for s in disk.system.snapshot()}
    assert kinds["cache_index"] == f"{CacheIndex.__module__}.{CacheIndex.__qualname__}"
    assert kinds["ssd_writer"] == f"{SsdWriter.__module__}.{SsdWriter.__qualname__}"
    assert disk.write(to_numpy(block(PROMPT, 0), LAYOUT))
    written(disk, 1)
    reports = {s.name: s.report for s in disk.system.snapshot()}
    assert reports["ssd_writer"]["persisted"] == 1 and reports["cache_index"]["blocks"] == 1
    disk.close()


def test_a_followers_disk_keeps_its_quota_oldest_first(tmp_path):
    size = len(block_store.encode_block(to_numpy(block(PROMPT, 0), LAYOUT), "fp"))
    disk = FollowerDisk(tmp_path, "fp", 2 * size + size // 2)
    other = [7] * 15  # a second chain, written later
    for i, b in enumerate([block(PROMPT, 0), block(PROMPT, 1), block(other, 0)]):
        assert disk.write(to_numpy(b, LAYOUT))
        written(disk, i + 1)
    assert disk.stats()["disk_blocks"] == 2
    disk.close()
    assert block_store.block_path(tmp_path, block(other, 0).block_hash).exists()
    assert not block_store.block_path(tmp_path, block(PROMPT, 1).block_hash).exists()  # leaf
    assert len(list(tmp_path.rglob("*.safetensors"))) == 2
    disk = FollowerDisk(tmp_path, "fp", 2 * size + size // 2)  # restarted: the same two
    assert disk.stats()["disk_blocks"] == 2
    disk.close()


def test_a_full_write_queue_refuses_blocks_and_the_follower_keeps_them(tmp_path):
    """The step never waits for the disk: a block the writer's queue has no room for is
    refused at once, stays with the follower, and goes to the disk at a later step."""
    disk = FollowerDisk(tmp_path, "fp", 1 << 30, max_pending=1)
    engine = Engine()
    cache = FollowerCache(engine, answers()[1], disk)
    engine.new_blocks = [("r", block(PROMPT, i)) for i in range(3)]
    results = [disk.write(to_numpy(block([1000 + i] * 15, 0), LAYOUT)) for i in range(64)]
    assert False in results  # a queue of one, written to faster than a disk writes
    cache.after_step()  # whatever finds no room now waits in RAM, not dropped
    while cache.unsaved:
        cache.persist()
        time.sleep(0.01)
    written(disk, results.count(True) + 3)
    assert disk.stats()["disk_dropped"] == 0
    disk.close()


def test_a_corrupt_block_on_a_followers_disk_ends_the_read_and_is_forgotten(tmp_path):
    disk = FollowerDisk(tmp_path, "fp", 1 << 30)
    for i in range(3):
        assert disk.write(to_numpy(block(PROMPT, i), LAYOUT))
    written(disk, 3)
    disk.close()
    hashes = block_hashes("fp", PROMPT, B)[:3]
    path = block_store.block_path(tmp_path, hashes[1])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # a tensor byte changed on disk: the checksum catches it
    path.write_bytes(bytes(data))
    disk = FollowerDisk(tmp_path, "fp", 1 << 30)
    got: list[list] = []
    disk.read(hashes, got.append)
    wait_for(lambda: got)
    assert [b.block_hash for b in got[0]] == hashes[:1]
    wait_for(lambda: disk.stats()["disk_blocks"] == 2)  # the index forgot it
    assert not path.exists()
    disk.close()


# -- rank 0 and a follower over the channel ------------------------------------------------------


def _supplies(followers: Followers) -> list[tuple[str, int, list[int]]]:
    got, answer = answers()
    followers.on_supply = answer
    return got


def test_rank_0_learns_what_the_follower_can_supply_and_the_follower_starts_from_exactly_that():
    followers, sock = _pair(free_port())
    got = _supplies(followers)
    engine = Engine()
    for i in (0, 1):
        engine.blocks.store(block(PROMPT, i))
    t, out = _following(engine, sock)
    followers.probe("r", PROMPT, 3)
    wait_for(lambda: got)
    assert got[0][:2] == ("r", 2)
    followers.add("r", PROMPT, SAMPLING, None, None, blocks=2, cached_tokens=2 * B)
    followers.add("cold", PROMPT, SAMPLING, None, None)
    followers.plan(_plan(), step=0, digest=0)
    wait_for(lambda: followers.report()[0]["step"] == 1)
    followers.close()
    t.join(10)
    assert out["exit"] == 0
    (rid, cached, partial), (cold, none, no_partial) = engine.added
    assert rid == "r" and [b.block_hash for b in cached] == engine.prompt_hashes(PROMPT)[:2]
    assert partial == 0
    # A request rank 0 took no cache for takes none on the follower either: no partial hit.
    assert (cold, none, no_partial) == ("cold", [], 0)
    report = followers.report()[0]
    assert report["hit_tokens"] == 2 * B and report["ram_blocks"] == 2


def test_a_follower_supplies_a_requests_blocks_from_its_own_cache_namespace_only():
    """Rank 0 names a request's cache namespace in its probe and its ``Add``: the follower
    looks the prompt's blocks up (and starts it) within that namespace alone."""
    followers, sock = _pair(free_port())
    got = _supplies(followers)
    engine = Engine()
    named = block_hashes(namespace_root("fp", "key-a"), PROMPT, B)
    for i in (0, 1):
        blk = block(PROMPT, i)
        blk.block_hash, blk.parent_hash = named[i], named[i - 1] if i else None
        blk.root = namespace_root("fp", "key-a")
        engine.blocks.store(blk)
    t, out = _following(engine, sock)
    followers.probe("shared", PROMPT, 2)
    followers.probe("other", PROMPT, 2, "key-b")
    followers.probe("mine", PROMPT, 2, "key-a")
    wait_for(lambda: len(got) == 3)
    assert sorted(got) == [("mine", 2, [4, 4, 0]), ("other", 0, [0]), ("shared", 0, [0])]
    followers.add("mine", PROMPT, SAMPLING, None, None, blocks=2, cached_tokens=2 * B,
                  namespace="key-a")
    followers.plan(_plan(), step=0, digest=0)
    wait_for(lambda: followers.report()[0]["step"] == 1)
    followers.close()
    t.join(10)
    assert out["exit"] == 0
    (rid, cached, _), = engine.added
    assert rid == "mine" and [b.block_hash for b in cached] == named[:2]


def test_a_follower_asked_for_blocks_it_never_promised_exits_and_rank_0_says_which_rank():
    followers, sock = _pair(free_port())
    t, out = _following(Engine(), sock)
    followers.add("r", PROMPT, SAMPLING, None, None, blocks=1, cached_tokens=B)
    t.join(10)
    assert out["exit"] == 1
    sock.close()
    wait_for(lambda: followers.dead is not None)
    assert "rank 1" in followers.dead
    followers.close()


def test_a_probe_nobody_answers_gives_no_cached_blocks_after_the_timeout():
    port = free_port()
    followers = Followers(size=2, port=port, secret=SECRET, host="127.0.0.1")
    got = _supplies(followers)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault(
        "sock", connect(1, port, "fp", SECRET, host="127.0.0.1", timeout=10)))
    t.start()
    followers.accept("fp", seed=1, config=EngineConfig(), timeout=10)
    t.join()
    began = time.monotonic()
    followers.probe("r", PROMPT, 3, timeout=0.3)  # the follower never reads it
    wait_for(lambda: got)
    assert got == [("r", 0, [])]
    assert 0.25 < time.monotonic() - began < 5
    assert followers.probe_timeouts == 1
    followers.close()
    result["sock"][0].close()


def test_a_lost_follower_answers_every_probe_in_flight_with_nothing():
    followers, sock = _pair(free_port())
    got = _supplies(followers)
    followers.probe("r", PROMPT, 3, timeout=30)
    sock.close()
    wait_for(lambda: got)
    assert got == [("r", 0, [])] and followers.dead is not None
    followers.close()


def test_a_released_request_frees_what_the_follower_reserved():
    followers, sock = _pair(free_port())
    got = _supplies(followers)
    engine = Engine()
    engine.blocks.store(block(PROMPT, 0))
    t, out = _following(engine, sock)
    followers.probe("r", PROMPT, 1)
    wait_for(lambda: got)
    followers.plan(_plan(), step=0, digest=0)
    wait_for(lambda: followers.report()[0]["step"] == 1)
    assert followers.report()[0]["reserved"] == 1
    followers.release("r")
    followers.plan(_plan(), step=1, digest=1)
    wait_for(lambda: followers.report()[0]["step"] == 2)
    assert followers.report()[0]["reserved"] == 0
    followers.close()
    t.join(10)


def test_blocks_a_follower_cuts_go_to_its_own_disk_and_a_spill_frees_its_ram(tmp_path):
    followers, sock = _pair(free_port())
    engine = Engine()
    disk = FollowerDisk(tmp_path, "fp", 1 << 30)
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault(
        "exit", follow(engine, sock, 1, Grammars(), disk)))
    engine.new_blocks = [("r", block(PROMPT, i)) for i in range(3)]
    for i in range(3):
        engine.blocks.store(block(PROMPT, i))
    t.start()
    followers.plan(_plan(), step=0, digest=0)
    wait_for(lambda: followers.report()[0]["step"] == 1)
    followers.spill(engine.prompt_hashes(PROMPT)[:2])
    followers.close()
    t.join(10)
    written(disk, 3)
    disk.close()
    assert out["exit"] == 0
    assert len(engine.blocks) == 1


# -- rank 0's scheduler -----------------------------------------------------------------------


class OneFollower:
    """Rank 0's channel as the scheduler sees it, to one follower that can supply at most
    ``blocks`` blocks and ``partials`` after them; it records what it is told."""

    def __init__(self, blocks: int, partials: list[int]) -> None:
        self.blocks, self.partials = blocks, partials
        self.dead: str | None = None
        self.on_supply: Any = None
        self.probe_timeouts = 0
        self.told: list[tuple] = []
        self.active_bytes = self.peak_bytes = 0  # what it last reported of its memory

    def probe(self, request_id: str, prompt: list[int], blocks: int,
              namespace: str = "") -> None:
        self.told.append(("probe", request_id, blocks))
        threading.Thread(target=self.on_supply, args=(
            request_id, min(blocks, self.blocks), self.partials)).start()

    def add(self, request_id: str, prompt: list[int], sampling: SamplingParams, output: Any,
            grammar: Any, blocks: int = 0, cached_tokens: int = 0,
            namespace: str = "") -> None:
        self.told.append(("add", blocks, cached_tokens))

    def release(self, request_id: str) -> None:
        self.told.append(("release", request_id))

    def plan(self, *args: Any) -> None:
        pass

    def usage(self) -> int:
        return self.active_bytes

    def take_peak(self) -> int:
        peak, self.peak_bytes = self.peak_bytes, 0
        return peak

    def report(self) -> list:
        return []

    def close(self) -> None:
        pass


async def test_rank_0_starts_a_request_from_no_more_cache_than_every_rank_supplies(
        aiohttp_client, tiny_model_dir: Path, tmp_path: Path):
    from test_prefix_serving import LONG, complete, serve

    client, system, model = await serve(aiohttp_client, tiny_model_dir, tmp_path / "c")
    cold_text, _ = await complete(client, model, LONG)
    scheduler = system.find("scheduler")._cell.instance
    follower = OneFollower(blocks=1, partials=[16, 5])  # one block, then 5 tokens of another
    scheduler._attach(follower)
    warm_text, warm = await complete(client, model, LONG)
    await system.__aexit__(None, None, None)
    (probe, _, offered), add = follower.told
    assert probe == "probe" and offered > 1  # rank 0 holds more than the follower
    assert add == ("add", 1, 16 + 5)
    assert warm["prompt_tokens_details"]["cached_tokens"] == 16 + 5
    assert warm_text == cold_text


# -- the other ranks' memory ---------------------------------------------------------------------


def test_rank_0_counts_the_fullest_followers_memory_while_it_leads():
    followers, sock = _pair(free_port())
    t, _ = _following(Engine(), sock)
    followers.plan(_plan(), step=0, digest=0)
    wait_for(lambda: followers.report()[0]["step"] == 1)
    reported = followers.report()[0]
    assert followers.usage() == reported["active_bytes"] > 0
    assert followers.take_peak() == reported["peak_bytes"] > 0
    assert followers.take_peak() == 0  # the peak was taken by the call before
    followers.close()
    t.join(10)


async def test_the_memory_monitor_sees_the_fullest_rank():
    from troupe.actors.memory_messages import RanksMemory
    from troupe.actors.memory_monitor import MemoryMonitor

    limit = 8 << 30
    monitor = MemoryMonitor(limit=limit)
    monitor.system = SimpleNamespace(find=lambda name: None)
    await monitor.handle(RanksMemory(active_bytes=limit, peak_bytes=limit + 1))
    monitor._poll()
    assert monitor.latest.usage == limit and monitor.latest.high_water == limit + 1
    assert monitor.latest.pressure != "ok"
    assert monitor.reading["followers_active_bytes"] == limit
    assert monitor.ranks_peak == 0  # a peak counts in one poll's reading, as rank 0's does


async def test_rank_0s_scheduler_tells_the_monitor_the_other_ranks_memory(
        aiohttp_client, tiny_model_dir: Path, tmp_path: Path):
    from test_prefix_serving import LONG, complete, serve

    client, system, model = await serve(aiohttp_client, tiny_model_dir, tmp_path / "c")
    follower = OneFollower(blocks=0, partials=[])
    follower.active_bytes, follower.peak_bytes = 123 << 20, 456 << 20
    system.find("scheduler")._cell.instance._attach(follower)
    await complete(client, model, LONG)
    monitor = system.find("memory_monitor")._cell.instance
    await system.__aexit__(None, None, None)
    assert monitor.ranks_active == 123 << 20
    assert monitor.peak_max >= 456 << 20 or monitor.ranks_peak == 456 << 20
    assert follower.peak_bytes == 0  # taken once, by the scheduler


def test_the_engines_memory_gate_counts_the_fullest_rank(tiny_model_dir: Path):
    from mlx_lm import load

    from troupe.actors.engine.core import Engine as RealEngine
    from troupe.actors.engine.memory_estimate import model_memory
    from troupe.actors.messages import RequestFinished
    from troupe.actors.scheduler import weights_profile

    model, tok, config = load(str(tiny_model_dir), return_config=True)
    weights, dtype_bytes = weights_profile(model)
    memory = model_memory(config, dtype_bytes=dtype_bytes, weights_bytes=weights)
    limit = 2 * (mx.get_active_memory() + mx.get_cache_memory()) + (256 << 20)

    def first_event(mirror: Any) -> Any:
        engine = RealEngine(model, tok, memory=memory)
        engine.mirror = mirror
        engine.add("r", tok.encode("The quick brown fox"), SAMPLING)
        return engine.step(limit=limit)[0]

    class Ranks:
        def __init__(self, usage: int) -> None:
            self.bytes = usage

        def usage(self) -> int:
            return self.bytes

        def plan(self, *args: Any) -> None:
            pass

    assert not isinstance(first_event(Ranks(0)), RequestFinished)
    full = first_event(Ranks(limit))  # another rank holds all the memory
    assert isinstance(full, RequestFinished) and full.error_kind == "unavailable"
    assert f"{limit / 1e6:.0f} MB of the" in full.error

