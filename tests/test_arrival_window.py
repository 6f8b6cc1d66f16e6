"""An idle scheduler waits ``arrival_window_ms`` after a request arrives, so a burst of
requests is prefilled in one step instead of one step per arrival."""

from __future__ import annotations

import asyncio
from pathlib import Path

from troupe.actors.config import ServeConfig
from troupe.actors.serving import start_serving
from troupe.api.app import create_app
from troupe.runtime import ActorSystem


async def steps_for(aiohttp_client, model_dir: Path, window_ms: float, prompts: list[str],
                    stagger_s: float) -> int:
    config = ServeConfig.of(model=str(model_dir), block_size=0, arrival_window_ms=window_ms)
    async with ActorSystem() as system:
        handles = await start_serving(system, config)
        client = await aiohttp_client(create_app(system=system, admission=handles.admission,
                                                 config=config))
        model = handles.models[0].id

        async def one(i: int, prompt: str) -> None:
            await asyncio.sleep(i * stagger_s)
            resp = await client.post("/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                "ignore_eos": True})
            assert resp.status == 200, await resp.text()

        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        sched = next(s for s in system.snapshot() if s.name.startswith("scheduler"))
        await client.close()
        return sched.report["steps"]


async def test_a_burst_on_an_idle_server_is_prefilled_in_one_step(aiohttp_client,
                                                                   tiny_model_dir) -> None:
    prompts = ["one fish", "two fish, red fish", "blue fish", "a fish in a dish of fish"]
    alone = await steps_for(aiohttp_client, tiny_model_dir, 400, prompts[:1], 0)
    # Four arrivals 50 ms apart, all inside a 400 ms window: the steps of one request.
    together = await steps_for(aiohttp_client, tiny_model_dir, 400, prompts, 0.05)
    # Without the window each arrival starts at the next step: more steps.
    apart = await steps_for(aiohttp_client, tiny_model_dir, 0, prompts, 0.05)
    assert together == alone, (together, alone)
    assert apart > together, (apart, together)


async def test_the_window_stays_open_while_a_burst_is_still_arriving(aiohttp_client,
                                                                     tiny_model_dir) -> None:
    """A burst's requests pass admission one after another: the window waits for a quiet
    window after the last of them, not a fixed time after the first."""
    prompts = ["one fish", "two fish, red fish", "blue fish", "a fish in a dish of fish"]
    alone = await steps_for(aiohttp_client, tiny_model_dir, 200, prompts[:1], 0)
    # Arrivals 80 ms apart span 240 ms, more than one 200 ms window.
    together = await steps_for(aiohttp_client, tiny_model_dir, 200, prompts, 0.08)
    assert together == alone, (together, alone)


async def test_a_steady_trickle_does_not_hold_the_first_step_back(aiohttp_client,
                                                                  tiny_model_dir) -> None:
    """Requests arriving every 40 ms never leave a quiet 100 ms window; the first still
    starts within ARRIVAL_WINDOWS_MAX windows and answers before the trickle ends."""
    from troupe.actors.scheduler import ARRIVAL_WINDOWS_MAX

    trickle_s = 2 * ARRIVAL_WINDOWS_MAX * 0.1 + 1.0
    config = ServeConfig.of(model=str(tiny_model_dir), block_size=0, arrival_window_ms=100)
    async with ActorSystem() as system:
        handles = await start_serving(system, config)
        client = await aiohttp_client(create_app(system=system, admission=handles.admission,
                                                 config=config))
        model = handles.models[0].id
        first_answer: list[float] = []
        began = asyncio.get_running_loop().time()

        async def one(i: int) -> None:
            await asyncio.sleep(i * 0.04)
            resp = await client.post("/v1/completions", json={
                "model": model, "prompt": f"fish number {i}", "max_tokens": 2,
                "temperature": 0, "ignore_eos": True})
            assert resp.status == 200, await resp.text()
            if i == 0:
                first_answer.append(asyncio.get_running_loop().time() - began)

        await asyncio.gather(*(one(i) for i in range(int(trickle_s / 0.04))))
        await client.close()
    assert first_answer and first_answer[0] < trickle_s, (first_answer, trickle_s)
