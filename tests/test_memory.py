"""Memory safety on the real stack with tiny models: the prefill guard (413 before any header),
the per-chunk gate, the monitor's limits reaching every engine, and the engine pool."""

from __future__ import annotations

import asyncio
import gc
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import mlx.core as mx
import pytest
from http_stack import real_client
from mlx_lm.utils import load_tokenizer
from tiny_model import make_tiny_model

from troupe.actors import scheduler as scheduler_module
from troupe.actors.config import ServeConfig
from troupe.actors.engine.memory_estimate import model_memory_of, prompt_need
from troupe.actors.memory_messages import SetMemoryLimit
from troupe.actors.messages import DescribeEngine, ListModels
from troupe.actors.serving import ServingHandles
from troupe.runtime import ActorSystem

MB = 1_000_000
SENTENCE = "The quick brown fox jumps over the lazy dog. "


async def serve(aiohttp_client: Any, model: str | list[str], **overrides: Any):
    config = ServeConfig.of(model=model, **{"block_size": 0, "memory_poll_ms": 50, **overrides})
    return await real_client(aiohttp_client, config)


async def serve_under_limit(aiohttp_client: Any, model_dir: Path, headroom: int,
                            **overrides: Any):
    """Serve on a clean memory baseline; the limit is ``headroom`` bytes above its usage."""
    gc.collect()
    mx.clear_cache()
    client, system, handles = await serve(aiohttp_client, str(model_dir), **overrides)
    limit = report(system, "memory_monitor")["usage_bytes"] + headroom
    await set_limit(handles, limit)
    return client, system, handles, limit


def report(system: ActorSystem, name: str) -> dict:
    return next(s for s in system.snapshot() if s.name == name).report


def prompt_of(tok: Any, n_tokens: int) -> list[int]:
    """About ``n_tokens`` token ids of real text."""
    ids = tok.encode(SENTENCE * (n_tokens // 8 + 1))
    return ids[:n_tokens]


async def set_limit(handles: ServingHandles, limit: int) -> None:
    # An ask: when it returns the monitor has published, so admission (its mailbox is FIFO)
    # sees the limit before any request sent after this.
    assert handles.monitor is not None
    await handles.monitor.ask(SetMemoryLimit(limit=limit), timeout=5.0)


async def read_sse(resp: aiohttp.ClientResponse) -> list[str]:
    return [line.decode().strip() for line in [raw async for raw in resp.content]
            if line.strip()]


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def second_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-b") / "tiny-llama-b", seed=1)


# --- the prefill guard -----------------------------------------------------------------------


async def test_long_prompt_gets_413_before_any_header_and_a_short_one_is_served(
    aiohttp_client, tiny_model_dir, tok
):
    # One 2000-token chunk: ~80 MB of attention scores on the tiny model, a short prompt ~1 MB.
    client, system, handles, limit = await serve_under_limit(
        aiohttp_client, tiny_model_dir, 30 * MB, prefill_step_size=2048)
    model = handles.models[0].id
    before = report(system, "scheduler")["prefill_tokens"]
    long_prompt = prompt_of(tok, 2000)
    long_text = tok.decode(long_prompt)

    cases = [
        ("/v1/completions", {"model": model, "prompt": long_prompt, "max_tokens": 8}),
        ("/v1/completions", {"model": model, "prompt": long_prompt, "max_tokens": 8,
                             "stream": True}),
        ("/v1/chat/completions", {"model": model, "max_tokens": 8, "stream": True,
                                  "messages": [{"role": "user", "content": long_text}]}),
    ]
    for path, body in cases:
        started = time.perf_counter()
        resp = await client.post(path, json=body)
        elapsed = time.perf_counter() - started
        data = await resp.json()
        assert resp.status == 413, (path, data)
        assert resp.content_type == "application/json"  # an error body, not an event stream
        error = data["error"]
        assert error["code"] == "memory_limit_exceeded"
        assert f"{limit / MB:.0f} MB" in error["message"] and "needs about" in error["message"]
        assert elapsed < 1.0, elapsed

    resp = await client.post("/v1/messages", json={
        "model": model, "max_tokens": 8, "stream": True,
        "messages": [{"role": "user", "content": long_text}]})
    data = await resp.json()
    assert resp.status == 413, data
    assert data["type"] == "error" and data["error"]["type"] == "request_too_large"
    assert f"{limit / MB:.0f} MB" in data["error"]["message"]

    # No prefill started for any of them.
    assert report(system, "scheduler")["prefill_tokens"] == before
    assert report(system, "admission")["refused"]["too_large"] == 4

    resp = await client.post("/v1/completions", json={
        "model": model, "prompt": prompt_of(tok, 40), "max_tokens": 8})
    assert resp.status == 200, await resp.text()
    assert report(system, "scheduler")["prefill_tokens"] > before


async def test_no_prefill_guard_admits_what_the_guard_refuses(aiohttp_client, tiny_model_dir,
                                                              tok):
    client, system, handles = await serve(aiohttp_client, str(tiny_model_dir),
                                          prefill_step_size=2048, prefill_guard=False)
    usage = report(system, "memory_monitor")["usage_bytes"]
    # Low enough to refuse the prompt, high enough to stay clear of hard pressure.
    await set_limit(handles, usage * 2 + 30 * MB)
    resp = await client.post("/v1/completions", json={
        "model": handles.models[0].id, "prompt": prompt_of(tok, 2000), "max_tokens": 4})
    assert resp.status == 200, await resp.text()


async def test_flood_of_long_prompts_stays_under_the_limit_and_every_request_ends_cleanly(
    aiohttp_client, tiny_model_dir, tok
):
    # Room for two 1.5k-token prompts (one needs ~19 MB at its last chunk with MLX's attention,
    # ~40 MB with troupe's CPU kernels); eight at once would need four times the room.
    one = prompt_need(model_memory_of(tiny_model_dir), prompt_tokens=1550, step=512)
    client, system, handles, limit = await serve_under_limit(
        aiohttp_client, tiny_model_dir, int(2.1 * one), prefill_step_size=512)
    model = handles.models[0].id

    async def one(i: int) -> tuple[int, Any]:
        body = {"model": model, "prompt": prompt_of(tok, 1400 + 10 * i), "max_tokens": 8,
                "stream": i % 2 == 0}
        resp = await client.post("/v1/completions", json=body)
        if resp.status != 200:
            return resp.status, await resp.json()
        if body["stream"]:
            lines = await read_sse(resp)
            assert lines[-1] == "data: [DONE]", lines[-3:]
            events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
            return (500 if any("error" in e for e in events) else 200), events
        return 200, await resp.json()

    results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(16))), 120)
    statuses = [status for status, _ in results]
    assert statuses.count(200) >= 8, statuses  # the gate queues them; it does not drop them
    for status, body in results:
        assert status in (200, 413, 429, 503), (status, body)
        if status != 200:
            assert body["error"]["message"]
    await asyncio.sleep(0.15)  # the monitor's next poll reads the last peak
    monitor = report(system, "memory_monitor")
    margin = 0.1 * limit
    assert monitor["peak_max_bytes"] <= limit + margin, (monitor, limit)
    sched = report(system, "scheduler")
    assert sched["running"] == 0 and sched["waiting"] == 0


# --- the per-chunk gate ----------------------------------------------------------------------


async def test_request_past_admission_that_breaches_the_chunk_gate_fails_alone(
    aiohttp_client, tiny_model_dir, tok
):
    # Chunks of 8 tokens: a 1800-token prompt prefills over ~200 steps, time to tighten the
    # limit while it does. Whole chunks (no interleave budget): both prompts prefill at once.
    client, system, handles = await serve(aiohttp_client, str(tiny_model_dir),
                                          prefill_step_size=8, prefill_interleave=0.0)
    model = handles.models[0].id
    url = str(client.make_url("/v1/completions"))
    async with aiohttp.ClientSession() as session:
        decoder = await session.post(url, json={
            "model": model, "prompt": "The quick brown fox", "max_tokens": 400,
            "ignore_eos": True, "stream": True, "temperature": 0})
        assert decoder.status == 200
        await decoder.content.readline()  # it is decoding
        streamed = await session.post(url, json={
            "model": model, "prompt": prompt_of(tok, 1800), "max_tokens": 4, "stream": True})
        assert streamed.status == 200  # admitted: the limit was generous
        whole = asyncio.create_task(session.post(url, json={
            "model": model, "prompt": prompt_of(tok, 1700), "max_tokens": 4}))
        deadline = time.monotonic() + 10
        while report(system, "scheduler")["running"] < 3:  # the decoder and both prompts
            assert time.monotonic() < deadline, report(system, "scheduler")
            await asyncio.sleep(0.005)
        # Tighter than any chunk can fit: the prefilling requests must go, not the decoder.
        await set_limit(handles, report(system, "memory_monitor")["usage_bytes"] + 100_000)

        lines = await asyncio.wait_for(read_sse(streamed), 30)
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][len("data: "):])["error"]
        assert "out of memory for this prompt's prefill" in error["message"]
        resp = await asyncio.wait_for(whole, 30)
        data = await resp.json()
        assert resp.status in (413, 503), data
        assert "out of memory" in data["error"]["message"]

        decoded = await asyncio.wait_for(read_sse(decoder), 60)
        assert decoded[-1] == "data: [DONE]"
        chunks = [json.loads(line[len("data: "):]) for line in decoded[:-1]]
        assert not any("error" in c for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert report(system, "scheduler")["gate_failures"] == 2


# --- the monitor reaches every engine, and the engine pool -------------------------------------


async def test_limits_reach_an_engine_loaded_after_the_monitor_started_within_one_poll(
    aiohttp_client, tiny_model_dir, second_model_dir
):
    client, system, handles = await serve(
        aiohttp_client, [str(tiny_model_dir), str(second_model_dir)], memory_poll_ms=100)
    second = handles.models[1].id
    assert report(system, "scheduler")["memory_limit_bytes"] > 0
    assert system.find(f"scheduler:{second}") is None  # not loaded yet
    resp = await client.post("/v1/completions", json={"model": second, "prompt": "Paris",
                                                      "max_tokens": 2})
    assert resp.status == 200
    name = f"scheduler:{second}"
    limit = report(system, "memory_monitor")["limit_bytes"]
    assert report(system, name)["memory_limit_bytes"] == limit  # from its very first step

    # A new limit: the monitor finds the late engine among the running actors by itself.
    await handles.monitor.tell(SetMemoryLimit(limit=limit + 12345))
    deadline = time.monotonic() + 0.1 + 0.1  # one poll, plus slack for the hop
    while report(system, name)["memory_limit_bytes"] != limit + 12345:
        assert time.monotonic() < deadline, report(system, name)
        await asyncio.sleep(0.01)
    # And every poll after that keeps reaching it.
    published = report(system, "memory_monitor")["published"]
    await asyncio.sleep(0.35)
    assert report(system, "memory_monitor")["published"] >= published + 2 * 3


async def test_a_restarted_engine_pool_keeps_its_memory_monitor_for_the_engines_it_loads(
    aiohttp_client, tiny_model_dir, second_model_dir
):
    # The pool starts the monitor before any engine, and gives each engine its ref at spawn.
    client, system, handles = await serve(
        aiohttp_client, [str(tiny_model_dir), str(second_model_dir)])
    await handles.pool.tell(SetMemoryLimit(limit=1))  # not the pool's: it fails, and restarts
    cards = await handles.pool.ask(ListModels(), timeout=30.0)  # the new pool answers
    assert [s.restarts for s in system.snapshot() if s.name == "engine_pool"] == [1]
    assert system.find("engine_pool")._cell.instance.monitor is handles.monitor
    assert handles.monitor.alive
    second = cards[1].id
    resp = await client.post("/v1/completions", json={"model": second, "prompt": "Paris",
                                                      "max_tokens": 2})
    assert resp.status == 200
    limit = report(system, "memory_monitor")["limit_bytes"]
    assert report(system, f"scheduler:{second}")["memory_limit_bytes"] == limit


async def test_two_models_swap_under_a_budget_that_fits_one(
    aiohttp_client, tiny_model_dir, second_model_dir
):
    from troupe.actors.engine.memory_estimate import model_memory_of

    one = model_memory_of(tiny_model_dir).weights_bytes
    client, system, handles = await serve(
        aiohttp_client, [str(tiny_model_dir), str(second_model_dir)],
        models_memory=int(one * 1.5))
    first, second = (card.id for card in handles.models)
    models = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [first, second]  # loaded or not

    for model in (second, first, second, first):
        resp = await client.post("/v1/completions", json={"model": model, "prompt": "Paris",
                                                          "max_tokens": 3})
        assert resp.status == 200, await resp.text()
        assert report(system, "engine_pool")["loaded"] == [model]
    pool = report(system, "engine_pool")
    assert pool["loads"] == 5 and pool["unloads"] == 4, pool

    # A request in flight is never unloaded under it: the other model must wait (503).
    url = str(client.make_url("/v1/completions"))
    async with aiohttp.ClientSession() as session:
        running = await session.post(url, json={
            "model": first, "prompt": "The quick brown fox", "max_tokens": 200,
            "ignore_eos": True, "stream": True})
        assert running.status == 200
        await running.content.readline()
        resp = await client.post("/v1/completions", json={"model": second, "prompt": "Paris",
                                                          "max_tokens": 3})
        data = await resp.json()
        assert resp.status == 503 and data["error"]["code"] == "models_busy", data
        assert int(resp.headers["Retry-After"]) >= 1
        lines = await read_sse(running)
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2][len("data: "):])
        assert last["choices"][0]["finish_reason"] == "length"
    resp = await client.post("/v1/completions", json={"model": second, "prompt": "Paris",
                                                      "max_tokens": 3})
    assert resp.status == 200


async def test_loading_a_model_does_not_disturb_a_request_in_flight_on_another(
    aiohttp_client, tiny_model_dir, second_model_dir, tok
):
    client, system, handles = await serve(
        aiohttp_client, [str(tiny_model_dir), str(second_model_dir)])
    first, second = (card.id for card in handles.models)
    body = {"model": first, "prompt": "The quick brown fox", "max_tokens": 120,
            "ignore_eos": True, "temperature": 0}
    alone = await (await client.post("/v1/completions", json=body)).json()

    url = str(client.make_url("/v1/completions"))
    async with aiohttp.ClientSession() as session:
        running = await session.post(url, json={**body, "stream": True})
        assert running.status == 200
        first_line = (await running.content.readline()).decode().strip()
        resp = await client.post("/v1/completions", json={"model": second, "prompt": "Paris",
                                                          "max_tokens": 3})
        assert resp.status == 200  # loaded while the first model decodes
        lines = [first_line, *await read_sse(running)]
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == alone["choices"][0]["text"]  # the same tokens as with nothing beside it
    assert report(system, "engine_pool")["loaded"] == [first, second]


async def test_idle_models_are_unloaded_after_the_idle_ttl_unless_pinned(
    aiohttp_client, tiny_model_dir, second_model_dir
):
    client, system, handles = await serve(
        aiohttp_client, [str(tiny_model_dir), str(second_model_dir)], idle_ttl=0.3,
        pin=[str(tiny_model_dir)])
    first, second = (card.id for card in handles.models)
    resp = await client.post("/v1/completions", json={"model": second, "prompt": "Paris",
                                                      "max_tokens": 2})
    assert resp.status == 200
    pool = report(system, "engine_pool")
    assert pool["loaded"] == [first, second]
    per_model = pool["per_model"]
    assert [per_model[m]["pinned"] for m in (first, second)] == [True, False]
    assert all(per_model[m]["loaded"] and per_model[m]["weights_bytes"] > 0
               for m in (first, second))
    assert sum(per_model[m]["weights_bytes"] for m in per_model) == pool["loaded_weights_bytes"]
    deadline = time.monotonic() + 5
    while report(system, "engine_pool")["loaded"] != [first]:
        assert time.monotonic() < deadline, report(system, "engine_pool")
        await asyncio.sleep(0.05)
    assert report(system, "engine_pool")["pinned"] == [first]


# --- pressure ---------------------------------------------------------------------------------


async def test_hard_pressure_pauses_new_work_with_503_and_retry_after(aiohttp_client,
                                                                      tiny_model_dir):
    client, system, handles = await serve(aiohttp_client, str(tiny_model_dir))
    model = handles.models[0].id
    usage = report(system, "memory_monitor")["usage_bytes"]
    # Usage at 120% of the limit: hard pressure (from 95%) even if usage moves by a few
    # percent before the monitor reads it again as the limit is set. At 97% of the last poll's
    # ~1 MB, a move of 20 KB (MLX memory of earlier work freed meanwhile) read as soft: this
    # assertion failed once in a run beside other tests, never alone.
    await set_limit(handles, int(usage / 1.2))
    monitor = report(system, "memory_monitor")
    # The engine pool it was given at spawn was told to unload idle models (it keeps the last).
    assert monitor["pressure"] == "hard" and monitor["unloads_asked"] >= 1
    resp = await client.post("/v1/completions", json={"model": model, "prompt": "Paris",
                                                      "max_tokens": 2})
    data = await resp.json()
    assert resp.status == 503 and data["error"]["code"] == "memory_pressure", data
    assert int(resp.headers["Retry-After"]) >= 1
    await set_limit(handles, usage + 100 * MB)
    resp = await client.post("/v1/completions", json={"model": model, "prompt": "Paris",
                                                      "max_tokens": 2})
    assert resp.status == 200


# Held in MLX memory by the soft-pressure test, so that its usage is not the tiny model's alone.
BALLAST_BYTES = 128 * MB


async def test_soft_pressure_spills_ram_blocks_already_on_disk(aiohttp_client, tiny_model_dir,
                                                               tok, tmp_path):
    # The limit is set from the last poll's usage, and the next poll must land in the soft band
    # (+-5.6% of it). The tiny model alone uses under 1 MB: the scheduler's work after the
    # answer adds 10-15% (hard pressure), and a last poll that fell inside the prefill read
    # 4.3 MB, so the next one was "ok": no spill, and the wait below timed out. A 128 MB
    # ballast makes those moves at most 3% of usage.
    gc.collect()
    mx.clear_cache()  # earlier tests' garbage, freed meanwhile, would move usage too
    ballast = mx.zeros((BALLAST_BYTES // 4,), dtype=mx.float32)
    mx.eval(ballast)
    client, system, handles = await serve(aiohttp_client, str(tiny_model_dir), block_size=16,
                                          cache_dir=str(tmp_path / "kv"))
    model = handles.models[0].id
    resp = await client.post("/v1/completions", json={"model": model, "prompt": prompt_of(tok, 200),
                                                      "max_tokens": 2})
    assert resp.status == 200
    deadline = time.monotonic() + 10
    while report(system, "cache_index")["blocks"] < 12:  # written to disk
        assert time.monotonic() < deadline, report(system, "cache_index")
        await asyncio.sleep(0.02)
    ram_blocks = report(system, "scheduler")["ram_blocks"]
    assert ram_blocks == 13  # the 12 blocks, and the tail: RAM only
    usage = report(system, "memory_monitor")["usage_bytes"]
    assert usage >= BALLAST_BYTES
    await set_limit(handles, int(usage / 0.9))  # soft: between 85% and 95%
    # The poll of the new limit saw soft pressure: the spill below is the soft one.
    assert report(system, "memory_monitor")["pressure"] == "soft", report(system,
                                                                          "memory_monitor")
    while report(system, "scheduler")["ram_blocks"] > ram_blocks - 12:  # the RAM is freed
        assert time.monotonic() < deadline, report(system, "scheduler")
        await asyncio.sleep(0.02)
    assert report(system, "scheduler")["ram_spilled"] >= 12
    assert report(system, "cache_index")["blocks"] >= 12  # still on disk
    # What was spilled comes back from disk: the same prompt hits the cache.
    await set_limit(handles, usage + 100 * MB)
    resp = await client.post("/v1/completions", json={"model": model, "prompt": prompt_of(tok, 200),
                                                      "max_tokens": 2})
    assert resp.status == 200
    assert (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"] >= 12 * 16
    del ballast


# --- memory given back when idle ------------------------------------------------------------


async def test_an_idle_engine_gives_back_mlxs_buffer_cache_after_a_burst_of_long_prompts(
    aiohttp_client, tiny_model_dir, tok, monkeypatch
):
    """A burst's freed buffers stay in MLX's buffer cache (and the C heap) for reuse; once the
    engine has been idle for IDLE_RELEASE_S they go back to the system, once."""
    monkeypatch.setattr(scheduler_module, "IDLE_RELEASE_S", 0.2)
    client, system, handles = await serve(aiohttp_client, str(tiny_model_dir))
    model = handles.models[0].id

    async def complete(n_tokens: int) -> None:
        resp = await client.post("/v1/completions", json={
            "model": model, "prompt": prompt_of(tok, n_tokens), "max_tokens": 4})
        assert resp.status == 200, await resp.text()

    await asyncio.gather(*(complete(900 + 100 * i) for i in range(6)))
    for _ in range(200):
        if report(system, "scheduler")["memory_releases"]:
            break
        await asyncio.sleep(0.05)
    assert report(system, "scheduler")["memory_releases"] == 1
    assert mx.get_cache_memory() == 0
    await asyncio.sleep(0.5)  # idle on: nothing more to give back, nothing done
    assert report(system, "scheduler")["memory_releases"] == 1


async def test_no_memory_is_released_while_a_request_runs(
    aiohttp_client, tiny_model_dir, tok, monkeypatch
):
    monkeypatch.setattr(scheduler_module, "IDLE_RELEASE_S", 0.0)
    client, system, handles = await serve(aiohttp_client, str(tiny_model_dir))
    scheduler = handles.schedulers[handles.models[0].id]
    resp = await client.post("/v1/completions", json={
        "model": handles.models[0].id, "prompt": prompt_of(tok, 40), "max_tokens": 1500,
        "ignore_eos": True, "stream": True})
    assert resp.status == 200
    await resp.content.readline()  # the first tokens: it runs, 1,500 tokens to go
    await scheduler.tell(scheduler_module.ReleaseMemory())
    await scheduler.ask(DescribeEngine(), timeout=5.0)  # handled after the reminder
    assert report(system, "scheduler")["memory_releases"] == 0
    resp.close()


def test_trim_heap_asks_glibc_on_linux() -> None:
    import sys

    from troupe.actors.memory_monitor import trim_heap

    assert trim_heap() is sys.platform.startswith("linux")
