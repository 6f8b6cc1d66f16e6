"""The text stage in its two placements: inside ``Engine.update`` (the engine used directly)
and beside the engine (the scheduler's ``TextWorker``), where a request its text ended is taken
out of the batch only when the notice reaches the engine, steps later. The clients' events are
the same either way, and the answer's blocks are kept."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import deque

import msgspec
import pytest
from engine_helpers import encode, engine_config, greedy
from mlx_lm import load
from reference import PROMPTS, detokenize, reference_tokens
from test_serving import serve as serve_stack
from test_text_stage import CharDetokenizer

from troupe.actors.engine.core import Engine
from troupe.actors.engine.grammar import Grammars
from troupe.actors.engine.prefix import block_hashes, model_fingerprint
from troupe.actors.engine.text import EndRequest, TextOutput, TextStage, TokensSampled
from troupe.actors.messages import (
    OutputFormat,
    OutputSpec,
    RequestFinished,
    SamplingParams,
)
from troupe.actors.scheduler import MLX_THREAD
from troupe.actors.text_worker import TextWorker
from troupe.runtime.reply import open_reply

BLOCK = 16
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def comparable(events: list) -> list:
    """Events without what differs between two runs: a finish's timing, a call's random id."""
    out = []
    for e in events:
        if isinstance(e, RequestFinished):
            e = msgspec.structs.replace(e, ttft_s=None)
        elif e.tool_calls:
            e = msgspec.structs.replace(e, tool_calls=[
                msgspec.structs.replace(c, id="") for c in e.tool_calls])
        out.append(e)
    return out


def by_request(events: list) -> dict[str, list]:
    out: dict[str, list] = {}
    for e in events:
        out.setdefault(e.request_id, []).append(e)
    return {rid: comparable(evs) for rid, evs in out.items()}


def run_inline(engine: Engine, requests: list[tuple]) -> dict[str, list]:
    for rid, prompt, sampling, kw in requests:
        engine.add(rid, prompt, sampling, **kw)
    events = []
    while engine.has_work:
        events += engine.step()
    return by_request(events)


def run_beside(engine: Engine, requests: list[tuple], lag: int) -> tuple[dict[str, list], int]:
    """As the scheduler runs the text beside the engine, with each step's notices reaching
    the engine ``lag`` steps later (the worker's pace is the thread's: any lag can happen).
    Returns the events and the tokens the engine made for requests already ended."""
    assert engine.text is None
    stage = TextStage()
    for rid, prompt, sampling, kw in requests:
        req = engine.add(rid, prompt, sampling, **kw)
        stage.open(engine.text_output(req, kw.get("output")))
    late: deque[list[EndRequest]] = deque()
    ended: set[str] = set()
    events, dropped = [], 0
    while engine.has_work:
        while len(late) > lag:
            for notice in late.popleft():
                engine.end(notice)
        raw = engine.step()
        dropped += sum(len(e.token_ids) for e in raw
                       if isinstance(e, TokensSampled) and e.request_id in ended)
        made, notices = stage.feed(raw)
        ended.update(n.request_id for n in notices)
        events += made
        late.append(notices)
    return by_request(events), dropped


@pytest.fixture(scope="module")
def batch(loaded):
    """Four requests in one batch: one ended by a stop string taken from its own answer, one
    with logprobs, one with a stop string it never meets, one plain."""
    model, tok = loaded
    prompts = [encode(tok, p) for p in PROMPTS[:4]]
    full = detokenize(tok, reference_tokens(model, tok, prompts[0], 24))
    stop = full[8:11]
    assert full.find(stop) < len(full) - 3, "the stop string must end the answer early"
    return [
        ("stop", prompts[0], greedy(24, stop=[stop], ignore_eos=True), {}),
        ("logprobs", prompts[1], greedy(10, logprobs=True, top_logprobs=3), {}),
        ("unmet", prompts[2], greedy(12, stop=["\u2603\u2603"]), {}),
        ("plain", prompts[3], greedy(14), {}),
    ]


@pytest.mark.parametrize("lag", [0, 1, 3])
def test_the_clients_events_beside_the_engine_equal_those_inline(loaded, batch, lag):
    model, tok = loaded
    inline = run_inline(Engine(model, tok, engine_config()), batch)
    assert inline["stop"] != inline["plain"]  # the requests' answers differ
    assert inline["stop"][-1].finish_reason == "stop"
    assert inline["logprobs"][0].logprobs
    engine = Engine(model, tok, engine_config(), inline_text=False)
    beside, dropped = run_beside(engine, batch, lag)
    assert beside == inline
    # With a lag the engine made tokens for the stopped request after its text ended: none
    # was shown or counted, in the answers' usage nor in the engine's statistics.
    assert (dropped > 0) == (lag > 0)
    assert engine.generated_tokens == sum(evs[-1].usage.completion_tokens
                                          for evs in beside.values())


@pytest.mark.parametrize("lag", [0, 2])
def test_a_repeated_call_ends_the_request_beside_the_engine_as_inline(loaded, lag):
    model, tok = loaded
    grammar = f"start: c \"\\n\" c \"\\n\" c\nc: {json.dumps(CALL)}"
    constraint = Grammars(tok, vocab_size=model.args.vocab_size).for_format(
        OutputFormat(type="lark", pattern=grammar))
    requests = [
        ("call", encode(tok, PROMPTS[0]), greedy(200), {
            "constraint": constraint,
            "output": OutputSpec(tool_format="json_tools", tools=[WEATHER])}),
        ("other", encode(tok, PROMPTS[1]), greedy(30, ignore_eos=True), {}),
    ]
    inline = run_inline(Engine(model, tok, engine_config()), requests)
    assert inline["call"][-1].finish_reason == "tool_calls"
    engine = Engine(model, tok, engine_config(), inline_text=False)
    beside, _ = run_beside(engine, requests, lag)
    assert beside == inline
    assert not engine.has_work and engine.runner.decoding == 0


@pytest.mark.parametrize("lag", [0, 2])
def test_a_stop_string_beside_the_engine_keeps_the_answers_blocks(tiny_model_dir, lag):
    """The request ends when its notice reaches the engine, which keeps the blocks its answer
    completed, as an end in the batch does (not as an abort, which keeps none of them)."""
    model, tok = load(str(tiny_model_dir))
    prompt = encode(tok, PROMPTS[5])
    answer = reference_tokens(model, tok, prompt, 60)
    # A stop string met after the answer's first whole block.
    n_before = 2 * BLOCK - len(prompt) % BLOCK + 2
    assert len(answer) > n_before + 4
    before = detokenize(tok, answer[:n_before])
    full = detokenize(tok, answer)
    stop = full[len(before):len(before) + 3]
    assert full.find(stop) == len(before), "the stop string must first appear there"
    engine = Engine(model, tok, engine_config(block_size=BLOCK),
                    fingerprint=model_fingerprint(tiny_model_dir), inline_text=False)
    events, _ = run_beside(engine, [("a", prompt, greedy(60, stop=[stop], ignore_eos=True),
                                     {})], lag)
    assert events["a"][-1].stop_sequence == stop
    kept = block_hashes(engine.chain_root(), prompt + answer[:n_before], BLOCK)
    prompt_blocks = len(prompt) // BLOCK
    assert len(kept) > prompt_blocks, "the answer must complete a block of its own"
    assert all(h in engine.blocks for h in kept)


def test_the_worker_records_a_notice_before_it_sends_the_final_event():
    """The scheduler takes a client gone after the final event for one that left mid-answer
    unless the notice is there first: at the moment the final event is sent, it is."""
    worker = TextWorker("text-test")
    worker.start()
    reply, stream = open_reply()
    seen: list[list[EndRequest]] = []

    class Watched:
        """The reply, noting the worker's notices as each final event is sent."""

        def send(self, item):
            if isinstance(item, RequestFinished):
                seen.append(worker.take_notices())
            return reply.send(item)

        def close(self):
            reply.close()

    class Chars:
        detokenizer = property(lambda self: CharDetokenizer())
        decode = staticmethod(lambda ids: "".join(map(chr, ids)))

    worker.open(TextOutput.of(Chars(), "a", 3, SamplingParams(max_tokens=9, stop=["!"]), None,
                              prompt_tokens=1), Watched())
    worker.feed([TokensSampled(request_id="a", token_ids=[ord(c) for c in "hi!"])])
    worker.stop()
    assert seen == [[EndRequest("a", 3, "stop string", 3)]]

    async def read():
        return [item async for item in stream]

    items = asyncio.run(read())
    assert isinstance(items[-1], RequestFinished) and items[-1].stop_sequence == "!"


# -- serving -----------------------------------------------------------------------------------


async def idle(scheduler) -> None:
    """Until the scheduler's engine has no request left (the notice taken at a step)."""
    for _ in range(500):
        if not scheduler.engine.requests:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"requests left in the engine: {list(scheduler.engine.requests)}")


async def test_serving_runs_the_text_off_the_mlx_thread_and_keeps_a_stopped_answers_blocks(
        aiohttp_client, tiny_model_dir):
    model, tok = load(str(tiny_model_dir))
    prompt = encode(tok, PROMPTS[5])
    answer = reference_tokens(model, tok, prompt, 60)
    n_before = 2 * BLOCK - len(prompt) % BLOCK + 2
    before, full = detokenize(tok, answer[:n_before]), detokenize(tok, answer)
    stop = full[len(before):len(before) + 3]
    assert full.find(stop) == len(before)

    client, system, handles = await serve_stack(aiohttp_client, tiny_model_dir,
                                                block_size=BLOCK, cache_ram_max=1 << 30)
    scheduler, name = system.find("scheduler")._cell.instance, handles.models[0].id
    assert scheduler.engine.text is None and scheduler.text is not None
    threads: set[str] = set()
    feed = scheduler.text.stage.feed

    def recorded(events):
        threads.add(threading.current_thread().name)
        return feed(events)

    scheduler.text.stage.feed = recorded
    resp = await client.post("/v1/completions", json={
        "model": name, "prompt": prompt, "max_tokens": 60, "temperature": 0,
        "ignore_eos": True, "stop": [stop]})
    data = await resp.json()
    assert resp.status == 200, data
    assert data["choices"][0]["text"] == before
    assert data["choices"][0]["finish_reason"] == "stop"
    assert threads == {scheduler.text._thread.name}
    assert MLX_THREAD not in threads
    # The client has read its answer and closed: the request ends by its notice, keeping the
    # blocks its answer completed (an abort for a gone client would keep none of them).
    await idle(scheduler)
    kept = block_hashes(scheduler.engine.chain_root(), prompt + answer[:n_before], BLOCK)
    assert len(kept) > len(prompt) // BLOCK
    assert all(h in scheduler.engine.blocks for h in kept)
