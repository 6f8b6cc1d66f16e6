"""The prefix cache through the whole serving stack: RAM hits, disk hits, across a restart."""

from __future__ import annotations

import asyncio
from collections import deque
from pathlib import Path

import pytest

from troupe.actors.config import ServeConfig
from troupe.actors.prompts import without_billing_header
from troupe.actors.serving import start_serving
from troupe.api.app import create_app
from troupe.runtime import ActorSystem

BLOCK = 16
LONG = ("The quick brown fox jumps over the lazy dog. " * 8
        + "What is the capital of France? The capital of France is Paris. " * 3)


async def serve(aiohttp_client, model_dir: Path, cache_dir: Path, **overrides):
    config = ServeConfig.of(model=str(model_dir), block_size=BLOCK, cache_dir=str(cache_dir),
                            **overrides)
    system = ActorSystem()
    await system.__aenter__()
    handles = await start_serving(system, config)
    app = create_app(system=system, admission=handles.admission, config=config)
    client = await aiohttp_client(app)
    return client, system, handles.models[0].id


async def complete(client, model: str, prompt: str) -> tuple[str, dict]:
    resp = await client.post("/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
        "ignore_eos": True})
    data = await resp.json()
    assert resp.status == 200, data
    return data["choices"][0]["text"], data["usage"]


def report(system: ActorSystem, name: str) -> dict:
    return next(s for s in system.snapshot() if s.name == name).report


async def wait_persisted(system: ActorSystem, at_least: int) -> None:
    for _ in range(300):
        if report(system, "ssd_writer")["persisted"] >= at_least:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"blocks not persisted: {report(system, 'ssd_writer')}")


async def test_second_request_hits_ram_with_identical_output(aiohttp_client, tiny_model_dir,
                                                             tmp_path):
    client, system, model = await serve(aiohttp_client, tiny_model_dir, tmp_path / "c")
    cold_text, cold = await complete(client, model, LONG)
    warm_text, warm = await complete(client, model, LONG)
    assert cold["prompt_tokens_details"]["cached_tokens"] == 0
    cached = warm["prompt_tokens_details"]["cached_tokens"]
    # Whole blocks, then the first answer's RAM tail up to the last prompt token.
    assert cached == cold["prompt_tokens"] - 1
    assert warm_text == cold_text
    sched = report(system, "scheduler")
    assert sched["hit_tokens"] == cached
    assert sched["partial_hit_tokens"] == cached % BLOCK
    await system.__aexit__(None, None, None)


async def test_disk_hit_after_restart_gives_identical_output(aiohttp_client, tiny_model_dir,
                                                             tmp_path):
    cache_dir = tmp_path / "c"
    client, system, model = await serve(aiohttp_client, tiny_model_dir, cache_dir)
    cold_text, cold = await complete(client, model, LONG)
    total = cold["prompt_tokens"] + cold["completion_tokens"]
    await wait_persisted(system, total // BLOCK)
    await system.__aexit__(None, None, None)
    # Whole blocks only reach the disk; the tail (the rest of prompt and answer) does not.
    assert len(list(cache_dir.rglob("*.safetensors"))) == total // BLOCK

    client, system, model = await serve(aiohttp_client, tiny_model_dir, cache_dir)
    warm_text, warm = await complete(client, model, LONG)
    # After a restart the whole blocks come back from disk; the RAM tail is gone.
    assert warm["prompt_tokens_details"]["cached_tokens"] == (
        (cold["prompt_tokens"] - 1) // BLOCK * BLOCK)
    assert warm_text == cold_text
    assert report(system, "scheduler")["disk_loads"] == 1
    await system.__aexit__(None, None, None)


def chain_files(cache_dir: Path) -> list[Path]:
    """The block files of one chain on disk, first block first (by their parent hashes)."""
    from safetensors import safe_open

    by_parent = {}
    for path in cache_dir.rglob("*.safetensors"):
        with safe_open(str(path), "np") as f:
            by_parent[f.metadata()["parent_hash"]] = path
    chain, parent = [], ""
    while parent in by_parent:
        chain.append(by_parent.pop(parent))
        parent = chain[-1].name.removesuffix(".safetensors")
    assert not by_parent, "the files are not one chain"
    return chain


async def test_a_block_corrupted_on_disk_between_runs_is_dropped_and_the_answer_is_unchanged(
    aiohttp_client, tiny_model_dir, tmp_path
):
    # 4 KB of 0xFF (NaN) in one block's tensors, size and header intact: served, it turned a
    # cached prefix's answer into 16 <|endoftext|> after every restart.
    from test_block_integrity import overwrite_data

    from troupe.actors import block_store
    from troupe.actors.engine.prefix import model_fingerprint

    cache_dir = tmp_path / "c"
    client, system, model = await serve(aiohttp_client, tiny_model_dir, cache_dir)
    cold_text, cold = await complete(client, model, LONG)
    total = cold["prompt_tokens"] + cold["completion_tokens"]
    await wait_persisted(system, total // BLOCK)
    await system.__aexit__(None, None, None)
    chain = chain_files(cache_dir)
    assert len(chain) == total // BLOCK >= 4
    bad = chain[2]
    size = bad.stat().st_size
    overwrite_data(bad)
    assert bad.stat().st_size == size

    client, system, model = await serve(aiohttp_client, tiny_model_dir, cache_dir)
    assert report(system, "cache_index")["blocks"] == len(chain)  # headers look fine
    warm_text, warm = await complete(client, model, LONG)
    assert warm_text == cold_text
    # The two blocks before it came from disk; the rest of the prompt was prefilled again.
    assert warm["prompt_tokens_details"]["cached_tokens"] == 2 * BLOCK
    writer = report(system, "ssd_writer")
    assert (writer["blocks_corrupt"], writer["checksum_failures"]) == (1, 1), writer
    for _ in range(300):  # the writer tells the index after answering the read
        if report(system, "cache_index")["forgotten"] == 1:
            break
        await asyncio.sleep(0.02)
    assert report(system, "cache_index")["forgotten"] == 1
    # The block is recomputed and written again, and this time it verifies.
    await wait_persisted(system, 1)
    block_store.decode_block(bad.read_bytes(), model_fingerprint(tiny_model_dir), bad.stem)
    await system.__aexit__(None, None, None)


async def test_ram_eviction_spills_to_disk_while_only_the_mlx_thread_touches_mlx(
    aiohttp_client, tiny_model_dir, tmp_path
):
    # A RAM budget of about one block: every new block evicts older ones from RAM. Blocks come
    # back from disk as numpy and only the scheduler's thread turns them into MLX arrays; a
    # writer or index that evaluated MLX arrays would fail with "There is no Stream".
    client, system, model = await serve(aiohttp_client, tiny_model_dir, tmp_path / "c",
                                        cache_ram_max=20_000)
    cold_text, cold = await complete(client, model, LONG)
    await wait_persisted(system, cold["prompt_tokens"] // BLOCK)
    sched = report(system, "scheduler")
    assert sched["ram_evicted"] > 0 and sched["ram_block_bytes"] <= 20_000, sched
    warm_text, warm = await complete(client, model, LONG)
    assert warm["prompt_tokens_details"]["cached_tokens"] > 0
    assert warm_text == cold_text
    assert report(system, "scheduler")["disk_loads"] == 1  # what RAM let go came from disk
    writer = report(system, "ssd_writer")
    assert writer["failed"] == 0
    for snap in system.snapshot():
        assert snap.last_error is None, snap
    await system.__aexit__(None, None, None)


async def test_a_stuck_writer_costs_the_scheduler_at_most_a_bounded_wait(tiny_model_dir,
                                                                        tmp_path):
    # A writer that never finishes a write, with a one-message queue: the scheduler waits at
    # most ~250 ms per step for room, then drops the block and counts it; requests go on.
    from troupe.actors.cache_messages import WriteBlock
    from troupe.actors.disk_tier import WRITE_WAIT_S
    from troupe.actors.engine.config import EngineConfig
    from troupe.actors.messages import AddRequest, DescribeEngine, RequestFinished, SamplingParams
    from troupe.actors.scheduler import MLX_THREAD, Scheduler
    from troupe.runtime import Actor

    release = asyncio.Event()

    class StuckWriter(Actor):
        async def handle(self, msg):
            assert isinstance(msg, WriteBlock)
            await release.wait()

    async with ActorSystem() as system:
        try:
            writer = await system.spawn(StuckWriter, name="ssd_writer", mailbox_size=1)
            scheduler = await system.spawn(Scheduler, name="scheduler", thread=MLX_THREAD,
                                           model=str(tiny_model_dir), writer=writer,
                                           config=EngineConfig(
                                               block_size=BLOCK, prefill_interleave=0.0,
                                               arrival_window_ms=0.0))
            await scheduler.ask(DescribeEngine())
            from mlx_lm.utils import load_tokenizer

            prompt = load_tokenizer(tiny_model_dir).encode(LONG)  # ~10 blocks
            events = await scheduler.stream(AddRequest(
                request_id="r", prompt_tokens=prompt,
                sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))
            finished = [ev async for ev in events if isinstance(ev, RequestFinished)]
            assert finished[0].finish_reason == "length"
            rep = report(system, "scheduler")
            assert rep["blocks_dropped"] > 0, rep
            assert rep["blocks_enqueued"] <= 2, rep
            # The wait is per step, never per block: 10 blocks x 250 ms would be 2.5 s. (Steps with
            # new blocks: the one that crossed the last boundary, and the request's end.)
            assert rep["write_wait_s"] <= 2 * WRITE_WAIT_S + 0.1, rep
        finally:
            release.set()  # a failed assertion must not leave the writer stuck


def test_while_streams_decode_new_blocks_go_to_disk_a_few_megabytes_a_step():
    """A long prompt's ~90 MB of new blocks is not snapshotted in the step that cut them:
    each step takes about PERSIST_BYTES_PER_STEP (at least one block); at shutdown, all."""
    import mlx.core as mx

    from troupe.actors.disk_tier import DiskTier
    from troupe.actors.engine.kv_blocks import PERSIST_BYTES_PER_STEP, KVBlock

    layer = (mx.zeros((1, 3, 64, 64)), mx.zeros((1, 3, 64, 64)))  # 98 KB a layer
    block = KVBlock(block_hash="h", parent_hash=None, n_tokens=64, layers=[layer] * 30)
    per_step = PERSIST_BYTES_PER_STEP // block.nbytes
    assert per_step >= 1
    tier = DiskTier.__new__(DiskTier)
    tier._unsaved = deque(("r", 1, block) for _ in range(3 * per_step + 1))
    assert len(tier._take_unsaved()) == per_step
    assert len(tier._take_unsaved()) == per_step
    assert len(tier._take_unsaved(everything=True)) == per_step + 1
    assert not tier.unsaved
    big = KVBlock(block_hash="b", parent_hash=None, n_tokens=64,
                  layers=[(mx.zeros((1, 3, 4096, 64)),) * 2] * 30)
    tier._unsaved = deque([("r", 1, big), ("r", 1, block)])
    assert big.nbytes > PERSIST_BYTES_PER_STEP
    assert len(tier._take_unsaved()) == 1  # never stuck behind a big block


async def test_a_prompt_whose_blocks_are_all_in_ram_asks_the_cache_index_nothing(
        tiny_model_dir):
    """The RAM tier is the engine's own table: a lookup there is a plain call, and the index
    (the disk catalogue) is asked only for what RAM does not hold."""
    from troupe.actors.cache_messages import FoundOnDisk, LookupDisk
    from troupe.actors.engine.config import EngineConfig
    from troupe.actors.messages import AddRequest, DescribeEngine, RequestFinished, SamplingParams
    from troupe.actors.scheduler import MLX_THREAD, Scheduler
    from troupe.runtime import Actor

    asked: list = []

    class EmptyDisk(Actor):
        """An index with nothing on disk that records what it is sent."""

        async def handle(self, msg):
            asked.append(msg)
            if isinstance(msg, LookupDisk):
                await msg.reply_to.tell(FoundOnDisk(
                    request_id=msg.request_id, epoch=msg.epoch, blocks=0))

    async with ActorSystem() as system:
        index = await system.spawn(EmptyDisk, name="cache_index")
        scheduler = await system.spawn(Scheduler, name="scheduler", thread=MLX_THREAD,
                                       model=str(tiny_model_dir), index=index,
                                       config=EngineConfig(
                                           block_size=BLOCK, arrival_window_ms=0.0))
        await scheduler.ask(DescribeEngine())
        from mlx_lm.utils import load_tokenizer

        prompt = load_tokenizer(tiny_model_dir).encode(LONG)

        async def run(rid: str) -> RequestFinished:
            events = await scheduler.stream(AddRequest(
                request_id=rid, prompt_tokens=prompt,
                sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))
            return [ev async for ev in events if isinstance(ev, RequestFinished)][0]

        cold = await run("cold")
        assert cold.usage.cached_tokens == 0
        (lookup,) = asked  # nothing in RAM: the index is asked for the disk part
        assert isinstance(lookup, LookupDisk) and len(lookup.hashes) >= 3
        asked.clear()
        warm = await run("warm")
        assert warm.usage.cached_tokens == len(prompt) - 1
        assert asked == []
        rep = report(system, "scheduler")
        assert rep["ram_hit_tokens"] == len(lookup.hashes) * BLOCK, rep


def claude_code_turn(model: str, cch: str) -> dict:
    """A /v1/messages body shaped as Claude Code sends it: the billing block first in
    ``system``, with a ``cch`` (and version suffix) new on every request."""
    return {
        "model": model, "max_tokens": 8, "temperature": 0,
        "system": [
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.37.{cch[:3]}; "
                                     f"cc_entrypoint=cli; cch={cch};"},
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
            {"type": "text", "text": LONG, "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    }


async def test_claude_codes_billing_line_does_not_defeat_the_cache(aiohttp_client,
                                                                   tiny_model_dir, tmp_path):
    client, system, model = await serve(aiohttp_client, tiny_model_dir, tmp_path / "c")
    answers = []
    for cch in ("1a2b3", "9f8e7"):
        resp = await client.post("/v1/messages", json=claude_code_turn(model, cch))
        answers.append(await resp.json())
        assert resp.status == 200, answers[-1]
    first, second = (a["usage"] for a in answers)
    assert first["cache_read_input_tokens"] == 0
    # Everything but the last prompt token is read back, though cch changed.
    prompt = first["input_tokens"]
    assert second["cache_read_input_tokens"] == prompt - 1
    assert answers[0]["content"] == answers[1]["content"]
    # The same conversation with no billing block at all is the same prompt.
    body = claude_code_turn(model, "00000")
    body["system"] = body["system"][1:]
    count = await client.post("/v1/messages/count_tokens", json=body)
    with_line = await client.post("/v1/messages/count_tokens",
                                  json=claude_code_turn(model, "77777"))
    assert (await count.json()) == (await with_line.json())
    await system.__aexit__(None, None, None)


BILLING = "x-anthropic-billing-header: cc_version=2.1.37.3a1; cc_entrypoint=cli; cch=1a2b3;"


@pytest.mark.parametrize(("content", "kept"), [
    (f"{BILLING}\nYou are Claude Code.", "You are Claude Code."),
    (f"You are Claude Code.\n{BILLING}", "You are Claude Code."),
    (f"A\n  {BILLING}\nB", "A\nB"),
    (BILLING, None),  # the message held only the line: dropped, as if the block were absent
    ("no billing line here", "no billing line here"),
])
def test_billing_line_leaves_system_messages_only_that_line(content, kept):
    messages = [{"role": "system", "content": content}, {"role": "user", "content": BILLING}]
    out = without_billing_header(messages)
    assert out[:-1] == ([{"role": "system", "content": kept}] if kept is not None else [])
    # Only system and developer messages carry it: a user's text is theirs, kept as sent.
    assert out[-1] == {"role": "user", "content": BILLING}
    assert messages[0]["content"] == content  # the caller's messages are not changed


def test_billing_line_in_a_developer_message_is_removed_too():
    out = without_billing_header([{"role": "developer", "content": f"{BILLING}\nRules."}])
    assert out == [{"role": "developer", "content": "Rules."}]


async def beside_a_stream(system: ActorSystem, index_class: type, model_dir: Path):
    """A scheduler of the tiny model (blocks of BLOCK tokens, no arrival window) whose cache
    index is ``index_class``, with one request decoding for a long while: (its ref, the
    scheduler itself, the tokenizer, the decoding request's events)."""
    from mlx_lm.utils import load_tokenizer

    from troupe.actors.engine.config import EngineConfig
    from troupe.actors.messages import AddRequest, DescribeEngine, RequestStarted, SamplingParams
    from troupe.actors.scheduler import MLX_THREAD, Scheduler

    index = await system.spawn(index_class, name="cache_index")
    scheduler = await system.spawn(Scheduler, name="scheduler", thread=MLX_THREAD,
                                   model=str(model_dir), index=index,
                                   config=EngineConfig(block_size=BLOCK, arrival_window_ms=0.0))
    await scheduler.ask(DescribeEngine())
    tok = load_tokenizer(model_dir)
    first = await scheduler.stream(AddRequest(
        request_id="decoding", prompt_tokens=tok.encode("Once upon a time"),
        sampling=SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)))
    assert isinstance(await anext(first), RequestStarted)
    return scheduler, system.find("scheduler")._cell.instance, tok, first


async def test_a_disk_lookup_does_not_hold_the_step(tiny_model_dir):
    """A request waiting for the cache index to say what is on disk waits on its own: another
    request goes on decoding, step after step, while the lookup is unanswered (the scheduler
    asks by message and gets the answer as a message, never awaiting the index in a step)."""
    from troupe.actors.cache_messages import FoundOnDisk, LookupDisk
    from troupe.actors.messages import (
        AbortRequest,
        AddRequest,
        RequestFinished,
        RequestStarted,
        SamplingParams,
    )
    from troupe.runtime import Actor

    asked, release = asyncio.Event(), asyncio.Event()

    class SlowDisk(Actor):
        """An index with nothing on disk; while ``hold`` is set it answers a lookup only once
        ``release`` is set."""

        hold = False

        async def handle(self, msg):
            if not isinstance(msg, LookupDisk):
                return None
            if SlowDisk.hold:
                asked.set()
                await release.wait()
            if msg.reply_to is not None:
                await msg.reply_to.tell(FoundOnDisk(
                    request_id=msg.request_id, epoch=msg.epoch, blocks=0))
            return 0

    async with ActorSystem() as system:
        scheduler, sched, tok, first = await beside_a_stream(system, SlowDisk, tiny_model_dir)
        SlowDisk.hold = True
        second = await scheduler.stream(AddRequest(
            request_id="looking", prompt_tokens=tok.encode(LONG),
            sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))
        await asyncio.wait_for(asked.wait(), 30)
        steps = sched.engine.steps
        for _ in range(3000):  # a guard against a hang, not a timing: the steps go on
            if sched.engine.steps >= steps + 3:
                break
            await asyncio.sleep(0.01)
        assert sched.engine.steps >= steps + 3
        # Still waiting for the index, alone.
        assert [rid for rid, _ in sched.disk.replies()] == ["looking"]
        release.set()
        assert isinstance(await anext(second), RequestStarted)
        done = [ev async for ev in second if isinstance(ev, RequestFinished)]
        assert done[0].usage.completion_tokens == 4
        await scheduler.tell(AbortRequest(request_id="decoding"))
        ended = [ev async for ev in first if isinstance(ev, RequestFinished)]
        assert ended[0].finish_reason == "abort"


async def test_a_lookup_the_index_never_answers_starts_the_request_from_ram_alone(
        tiny_model_dir):
    """The index is gone quiet: the request waits for its answer at most LOOKUP_TIMEOUT_S, then
    runs from what RAM holds."""
    from mlx_lm.utils import load_tokenizer

    from troupe.actors.engine.config import EngineConfig
    from troupe.actors.messages import AddRequest, DescribeEngine, RequestFinished, SamplingParams
    from troupe.actors.scheduler import MLX_THREAD, Scheduler
    from troupe.runtime import Actor

    class SilentDisk(Actor):
        """An index that takes every message and answers none."""

        async def handle(self, msg):
            return None

    async with ActorSystem() as system:
        index = await system.spawn(SilentDisk, name="cache_index")
        scheduler = await system.spawn(Scheduler, name="scheduler", thread=MLX_THREAD,
                                       model=str(tiny_model_dir), index=index,
                                       config=EngineConfig(
                                           block_size=BLOCK, arrival_window_ms=0.0))
        await scheduler.ask(DescribeEngine())
        events = await scheduler.stream(AddRequest(
            request_id="r", prompt_tokens=load_tokenizer(tiny_model_dir).encode(LONG),
            sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))

        async def finished() -> RequestFinished:
            return [ev async for ev in events if isinstance(ev, RequestFinished)][0]

        done = await asyncio.wait_for(finished(), 60)  # a guard against a hang, not a timing
        assert done.error is None and done.usage.completion_tokens == 4
        assert done.usage.cached_tokens == 0


async def test_a_restarted_pool_that_finds_a_writer_without_its_index_starts_both_again(
        tiny_model_dir, tmp_path):
    """The SSD writer holds the ref of the index it was spawned with: a restarted pool that
    must start a new index starts a new writer with it, so written blocks reach an index."""
    from test_ssd_writer import make_block

    from troupe.actors.cache_messages import FlushWrites, LookupDisk, WriteBlock
    from troupe.actors.config import model_specs
    from troupe.actors.pool import POOL_NAME, EnginePool
    from troupe.actors.scheduler import MLX_THREAD

    config = ServeConfig.of(model=str(tiny_model_dir), block_size=BLOCK,
                            cache_dir=str(tmp_path / "kv"))
    async with ActorSystem() as system:
        handles = await start_serving(system, config)
        cache = {"cache_dir": str(tmp_path / "kv"), "disk_max_bytes": config.cache_disk_max}
        old_writer = system.get("ssd_writer")
        await system.kill(system.get("cache_index"))  # gone for good, as past its restarts
        await system.stop(system.get("scheduler"))
        await system.stop(handles.pool)
        # The next pool adopts the live writer alone and loads the model (preload).
        await system.spawn(EnginePool, name=POOL_NAME, thread=MLX_THREAD, specs=model_specs(config),
                           engine=config.engine, cache=cache)
        assert not old_writer.alive
        writer, index = system.get("ssd_writer"), system.get("cache_index")
        block = make_block()
        await writer.tell(WriteBlock(block=block, request_id="r", epoch=0))
        assert await writer.ask(FlushWrites(deadline_s=10.0), timeout=15.0) == 1
        assert await index.ask(LookupDisk(hashes=[block.block_hash]), timeout=5.0) == 1


async def test_a_request_asking_the_index_starts_in_the_next_step_beside_a_decoding_stream(
        tiny_model_dir, monkeypatch):
    """A new request whose prompt has a block not in RAM asks the index, which answers by
    message: the next step waits for that answer (``LOOKUP_GRACE_S``, ended at once by the
    answer), so the request starts before it rather than a whole step after the answer."""
    import time

    from troupe.actors import disk_tier
    from troupe.actors.cache_messages import FoundOnDisk, LookupDisk
    from troupe.actors.messages import (
        AbortRequest,
        AddRequest,
        RequestFinished,
        SamplingParams,
    )
    from troupe.runtime import Actor

    # Long enough that a busy test machine's index thread always answers within it: the
    # test is of the order of steps; the answer ending the wait is checked below.
    monkeypatch.setattr(disk_tier, "LOOKUP_GRACE_S", 30.0)

    class EmptyDisk(Actor):
        """An index with nothing on disk, answering at once."""

        async def handle(self, msg):
            if isinstance(msg, LookupDisk) and msg.reply_to is not None:
                await msg.reply_to.tell(FoundOnDisk(
                    request_id=msg.request_id, epoch=msg.epoch, blocks=0))
            return 0

    async with ActorSystem() as system:
        scheduler, sched, tok, first = await beside_a_stream(system, EmptyDisk, tiny_model_dir)
        seen: dict[str, tuple[int, float]] = {}
        begin, start = sched.disk.begin, sched.disk.start

        def recording_begin(msg, reply):
            seen["asked"] = (sched.engine.steps, time.monotonic())
            begin(msg, reply)

        def recording_start(msg, reply, cached, partial):
            if msg.request_id == "looking":
                seen["started"] = (sched.engine.steps, time.monotonic())
            return start(msg, reply, cached, partial)

        sched.disk.begin, sched.disk.start = recording_begin, recording_start
        second = await scheduler.stream(AddRequest(
            request_id="looking", prompt_tokens=tok.encode(LONG),
            sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))
        done = [ev async for ev in second if isinstance(ev, RequestFinished)]
        assert done[0].error is None and done[0].usage.completion_tokens == 4
        (asked_step, asked_at), (started_step, started_at) = seen["asked"], seen["started"]
        assert started_step == asked_step  # no step ran between the question and the start
        assert started_at - asked_at < 20.0  # the answer ended the wait, not the grace
        await scheduler.tell(AbortRequest(request_id="decoding"))
        [ev async for ev in first]
