"""The serving path end to end on a tiny random model: HTTP -> admission -> scheduler -> HTTP.

Greedy output through the API must equal mlx-lm's own greedy generation, token for token, for
one request and for eight in flight at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import aiohttp
import anthropic
import pytest
from mlx_lm import load
from reference import PROMPTS, detokenize, reference_tokens

import troupe.actors.admission as admission_module
from troupe.actors.config import ServeConfig
from troupe.actors.serving import start_serving
from troupe.api.app import create_app
from troupe.runtime import ActorSystem


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path):
    model, tok = load(str(tiny_model_dir))
    return tok, lambda prompt, max_tokens: reference_tokens(model, tok, prompt, max_tokens)


async def serve(aiohttp_client, model_dir: Path | list[str], **overrides):
    model = model_dir if isinstance(model_dir, list) else str(model_dir)
    config = ServeConfig.of(model=model, **overrides)
    system = ActorSystem()
    await system.__aenter__()
    handles = await start_serving(system, config)
    app = create_app(system=system, admission=handles.admission, config=config)

    async def close_system(_app) -> None:
        await system.__aexit__(None, None, None)

    app.on_cleanup.append(close_system)
    client = await aiohttp_client(app)
    return client, system, handles


def completion_body(model: str, prompt, max_tokens: int, **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": 1, **extra}


async def test_greedy_completion_over_http_equals_mlx_lm(aiohttp_client, tiny_model_dir,
                                                        reference):
    tok, greedy = reference
    client, _, handles = await serve(aiohttp_client, tiny_model_dir)
    model = handles.models[0].id
    prompt = tok.encode(PROMPTS[0])
    resp = await client.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": PROMPTS[0]}],
        "max_tokens": 20, "temperature": 0, "logprobs": True,
    })
    data = await resp.json()
    assert resp.status == 200, data
    chat_prompt = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}],
                                          add_generation_prompt=True)
    expected = greedy(chat_prompt, 20)
    got_text = data["choices"][0]["message"]["content"]
    assert got_text == detokenize(tok, expected)
    assert data["usage"]["prompt_tokens"] == len(chat_prompt)
    assert data["usage"]["completion_tokens"] == len(expected) + (len(expected) < 20)

    resp = await client.post("/v1/completions", json=completion_body(model, prompt, 20))
    data = await resp.json()
    assert resp.status == 200, data
    assert data["choices"][0]["text"] == detokenize(tok, greedy(prompt, 20))


async def test_eight_concurrent_requests_each_equal_mlx_lm(aiohttp_client, tiny_model_dir,
                                                          reference):
    tok, greedy = reference
    client, _, handles = await serve(aiohttp_client, tiny_model_dir, prefill_step_size=16)
    model = handles.models[0].id
    prompts = [tok.encode(p) for p in PROMPTS]

    async def one(i: int, prompt: list[int]) -> str:
        resp = await client.post("/v1/completions",
                                 json=completion_body(model, prompt, 12 + 2 * i))
        data = await resp.json()
        assert resp.status == 200, data
        return data["choices"][0]["text"]

    texts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    for i, (prompt, text) in enumerate(zip(prompts, texts, strict=True)):
        assert text == detokenize(tok, greedy(prompt, 12 + 2 * i)), i


async def test_streamed_deltas_add_up_to_the_whole_text(aiohttp_client, tiny_model_dir,
                                                       reference):
    tok, greedy = reference
    client, _, handles = await serve(aiohttp_client, tiny_model_dir)
    model = handles.models[0].id
    body = {"model": model, "messages": [{"role": "user", "content": PROMPTS[4]}],
            "max_tokens": 24, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200
    chunks = await _sse(resp)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    chat_prompt = tok.apply_chat_template(body["messages"], add_generation_prompt=True)
    assert text == detokenize(tok, greedy(chat_prompt, 24))
    assert chunks[-1]["usage"]["prompt_tokens"] == len(chat_prompt)


async def test_client_disconnect_frees_the_request_and_server_keeps_serving(
    aiohttp_client, tiny_model_dir
):
    client, system, handles = await serve(aiohttp_client, tiny_model_dir)
    model = handles.models[0].id
    scheduler = handles.schedulers[model]
    url = str(client.make_url("/v1/completions"))
    async with aiohttp.ClientSession() as session:
        resp = await session.post(url, json={"model": model, "prompt": "The quick brown fox",
                                             "max_tokens": 1000, "stream": True,
                                             "ignore_eos": True})
        assert resp.status == 200
        await resp.content.readline()
        resp.close()  # the client goes away mid-stream
    for _ in range(200):
        report = _report(system, scheduler.name)
        if report["running"] == 0 and report["waiting"] == 0:
            break
        await asyncio.sleep(0.02)
    assert report["running"] == 0 and report["waiting"] == 0
    assert report["generated_tokens"] < 1000
    resp = await client.post("/v1/completions", json=completion_body(model, "Paris", 4))
    assert resp.status == 200


async def test_full_scheduler_queue_answers_429_with_retry_after(aiohttp_client,
                                                                tiny_model_dir):
    client, _, handles = await serve(aiohttp_client, tiny_model_dir, max_batch_size=1,
                                     prefill_batch_size=1, max_queue=1)
    model = handles.models[0].id

    async def one() -> aiohttp.ClientResponse:
        resp = await client.post("/v1/completions", json={
            "model": model, "prompt": "The quick brown fox", "max_tokens": 40,
            "ignore_eos": True})
        await resp.read()
        return resp

    results = await asyncio.wait_for(asyncio.gather(*(one() for _ in range(8))), 120)
    statuses = sorted(r.status for r in results)
    assert 200 in statuses and 429 in statuses, statuses
    refused = next(r for r in results if r.status == 429)
    assert float(refused.headers["Retry-After"]) >= 1  # the queue's estimate: see test_retry_after
    assert (await refused.json())["error"]["type"] == "rate_limit_error"


# --- the model names agents send -------------------------------------------------------------


def chat_body(model: str, text: str = "Paris", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}],
            "temperature": 0, **extra}


async def test_any_model_name_is_served_by_the_one_model_which_the_answer_names(
    aiohttp_client, tiny_model_dir
):
    client, _, handles = await serve(aiohttp_client, tiny_model_dir)
    model = handles.models[0].id
    user = [{"role": "user", "content": "Paris"}]
    cases = [
        ("/v1/chat/completions", chat_body("claude-sonnet-4-5-20250929", max_tokens=3)),
        ("/v1/completions", completion_body("/etc/passwd", "Paris", 3)),
        ("/v1/messages", {"model": "claude-opus-4-1", "max_tokens": 3, "messages": user}),
        ("/v1/responses", {"model": "gpt-5-codex", "input": "Paris", "max_output_tokens": 3}),
    ]
    for path, body in cases:
        resp = await client.post(path, json=body)
        data = await resp.json()
        assert resp.status == 200, (path, data)
        assert data["model"] == model, path
    counts = []
    for name in ("claude-haiku-4-5-20251001", model):
        resp = await client.post("/v1/messages/count_tokens", json={"model": name,
                                                                    "messages": user})
        assert resp.status == 200, await resp.text()
        counts.append((await resp.json())["input_tokens"])
    assert counts[0] == counts[1] > 0


async def test_an_unknown_names_first_use_is_logged_once(aiohttp_client, tiny_model_dir, caplog):
    caplog.set_level(logging.INFO, logger="actors.admission")
    client, _, handles = await serve(aiohttp_client, tiny_model_dir)
    model = handles.models[0].id
    for name in ("gpt-5-codex", "gpt-5-codex", model, "claude-haiku-4-5"):
        resp = await client.post("/v1/chat/completions", json=chat_body(name, max_tokens=2))
        assert resp.status == 200, await resp.text()
    lines = [r.getMessage() for r in caplog.records if r.name == "actors.admission"
             and "is served by" in r.getMessage()]
    assert lines == [f"model name 'gpt-5-codex' is served by {model}, the one model served",
                     f"model name 'claude-haiku-4-5' is served by {model}, the one model served"]


async def test_the_names_logged_are_bounded(aiohttp_client, tiny_model_dir, caplog, monkeypatch):
    monkeypatch.setattr(admission_module, "LOGGED_NAMES", 2)
    caplog.set_level(logging.INFO, logger="actors.admission")
    client, system, _ = await serve(aiohttp_client, tiny_model_dir)
    for name in ("a", "b", "c", "a", "d"):
        resp = await client.post("/v1/messages/count_tokens", json={
            "model": name, "messages": [{"role": "user", "content": "Paris"}]})
        assert resp.status == 200
    lines = [r.getMessage() for r in caplog.records if "is served by" in r.getMessage()]
    assert len(lines) == 2 and lines[1].endswith("further new names are not logged")
    assert system.find("admission")._cell.instance.logged_names == {"a", "b"}


# Two models in the pool: exact names first, then the patterns in the order given.
ALIASES = {"claude-haiku-special": "tiny-short", "gpt-5-codex": "tiny-llama",
           "claude-*haiku*": "tiny-llama", "claude-*": "tiny-short"}


async def test_aliases_route_names_between_two_models(aiohttp_client, tiny_model_dir,
                                                      tiny_short_dir):
    client, _, handles = await serve(aiohttp_client, [str(tiny_model_dir), str(tiny_short_dir)],
                                     aliases=ALIASES)
    assert [card.id for card in handles.models] == ["tiny-llama", "tiny-short"]
    expected = {"tiny-short": "tiny-short", "gpt-5-codex": "tiny-llama",
                "claude-haiku-special": "tiny-short",  # an exact name before any pattern
                "claude-haiku-4-5-20251001": "tiny-llama",  # the first pattern that matches
                "claude-sonnet-4-5-20250929": "tiny-short"}
    for name, model in expected.items():
        resp = await client.post("/v1/chat/completions", json=chat_body(name, max_tokens=2))
        data = await resp.json()
        assert resp.status == 200, (name, data)
        assert data["model"] == model, name

    for path, body in (("/v1/chat/completions", chat_body("gpt-4o", max_tokens=2)),
                       ("/v1/messages/count_tokens", {"model": "gpt-4o", "messages": [
                           {"role": "user", "content": "Paris"}]})):
        resp = await client.post(path, json=body)
        data = await resp.json()
        assert resp.status == 404, data
        message = data["error"]["message"]
        assert "'gpt-4o'" in message and "tiny-llama, tiny-short" in message
        assert "claude-*haiku* -> tiny-llama" in message


async def test_models_lists_the_alias_names_but_not_the_patterns(aiohttp_client, tiny_model_dir,
                                                                 tiny_short_dir):
    client, _, _ = await serve(aiohttp_client, [str(tiny_model_dir), str(tiny_short_dir)],
                               aliases=ALIASES)
    data = (await (await client.get("/v1/models")).json())["data"]
    assert [(m["id"], m["root"]) for m in data] == [
        ("tiny-llama", "tiny-llama"), ("tiny-short", "tiny-short"),
        ("claude-haiku-special", "tiny-short"), ("gpt-5-codex", "tiny-llama")]


async def test_one_model_is_described_under_every_name_it_answers_to(aiohttp_client,
                                                                       tiny_model_dir,
                                                                       tiny_short_dir):
    client, _, _ = await serve(aiohttp_client, [str(tiny_model_dir), str(tiny_short_dir)],
                               aliases=ALIASES)
    for name, root in [("tiny-short", "tiny-short"), ("gpt-5-codex", "tiny-llama"),
                       ("claude-haiku-special", "tiny-short"), ("claude-3-haiku-x", "tiny-llama")]:
        resp = await client.get(f"/v1/models/{name}")
        model = await resp.json()
        assert resp.status == 200, model
        assert (model["id"], model["root"], model["max_model_len"]) == (
            name, root, 64 if root == "tiny-short" else 2048)
    resp = await client.get("/v1/models/gpt-4o")
    assert resp.status == 404
    assert (await resp.json())["error"]["code"] == "model_not_found"


async def test_anthropics_client_lists_and_retrieves_the_models(aiohttp_client, tiny_model_dir):
    """Its SDK sends anthropic-version: the answers come in Anthropic's shape, and with one
    model served any name an agent uses is that model."""
    client, _, handles = await serve(aiohttp_client, tiny_model_dir)
    async with anthropic.AsyncAnthropic(base_url=str(client.make_url("")).rstrip("/"),
                                        api_key="unused", max_retries=0) as claude:
        page = await claude.models.list()
        found = await claude.models.retrieve("claude-sonnet-4-6")
    [model] = page.data
    assert (model.id, model.type, model.max_input_tokens) == (handles.models[0].id, "model",
                                                              2048)
    assert (page.first_id, page.last_id, page.has_more) == (model.id, model.id, False)
    assert (found.id, found.display_name) == ("claude-sonnet-4-6", "claude-sonnet-4-6")


async def test_an_alias_to_a_model_not_served_fails_at_start(tiny_model_dir):
    config = ServeConfig(model=str(tiny_model_dir), aliases={"claude-*": "tiny-missing"})
    async with ActorSystem() as system:
        with pytest.raises(ValueError, match="--alias claude-\\*=tiny-missing: no model "
                                             "'tiny-missing' is served \\(served: tiny-llama\\)"):
            await start_serving(system, config)


# --- max_tokens beyond the context ------------------------------------------------------------


async def test_max_tokens_over_the_room_left_is_cut_to_it(aiohttp_client, tiny_short_dir):
    # A 64-token context: every answer below runs to the room its prompt leaves.
    client, _, handles = await serve(aiohttp_client, tiny_short_dir)
    model = handles.models[0].id
    cases = [
        ("/v1/chat/completions", chat_body(model, max_tokens=32000, ignore_eos=True)),
        ("/v1/chat/completions", chat_body(model, max_completion_tokens=64, ignore_eos=True)),
        ("/v1/chat/completions", chat_body(model, ignore_eos=True)),  # --default-max-tokens
        ("/v1/completions", completion_body(model, "The quick brown fox", 32000,
                                            ignore_eos=True)),
        ("/v1/completions", completion_body(model, list(range(10, 73)), 32000,
                                            ignore_eos=True)),  # 63 tokens: room for one
    ]
    for path, body in cases:
        resp = await client.post(path, json=body)
        data = await resp.json()
        assert resp.status == 200, (path, data)
        usage = data["usage"]
        assert usage["completion_tokens"] == 64 - usage["prompt_tokens"] > 0, (path, usage)
        assert data["choices"][0]["finish_reason"] == "length"


async def test_max_tokens_over_the_servers_limit_is_cut_to_it(aiohttp_client, tiny_model_dir):
    client, _, handles = await serve(aiohttp_client, tiny_model_dir, max_tokens_limit=7)
    model = handles.models[0].id
    for path, body in [
        ("/v1/chat/completions", chat_body(model, max_tokens=32000, ignore_eos=True)),
        ("/v1/chat/completions", chat_body(model, ignore_eos=True)),  # --default-max-tokens
        ("/v1/completions", completion_body(model, "The quick brown fox", 7, ignore_eos=True)),
    ]:
        resp = await client.post(path, json=body)
        data = await resp.json()
        assert resp.status == 200, (path, data)
        assert data["usage"]["completion_tokens"] == 7, (path, data["usage"])
        assert data["choices"][0]["finish_reason"] == "length"
    # Below the limit, a request's own max_tokens stands.
    resp = await client.post("/v1/completions", json=completion_body(
        model, "The quick brown fox", 3, ignore_eos=True))
    assert (await resp.json())["usage"]["completion_tokens"] == 3


async def test_a_prompt_that_alone_fills_the_context_is_still_refused(aiohttp_client,
                                                                      tiny_short_dir):
    client, _, handles = await serve(aiohttp_client, tiny_short_dir)
    model = handles.models[0].id
    cases = [
        ("/v1/completions", completion_body(model, list(range(10, 74)), 1), "prompt"),
        ("/v1/chat/completions", chat_body(model, "Paris " * 80, max_tokens=1), "messages"),
        ("/v1/completions", completion_body(model, "Paris " * 80, 1), "prompt"),
    ]
    for path, body, param in cases:
        resp = await client.post(path, json=body)
        data = await resp.json()
        assert resp.status == 400, (path, data)
        assert (data["error"]["code"], data["error"]["param"]) == ("context_length_exceeded",
                                                                   param)
        assert "context is 64 tokens" in data["error"]["message"]


async def test_scheduler_runs_on_the_mlx_thread(aiohttp_client, tiny_model_dir):
    _, system, handles = await serve(aiohttp_client, tiny_model_dir)
    snaps = {s.name: s for s in system.snapshot()}
    assert snaps["scheduler"].thread == "mlx"
    assert snaps["admission"].thread == "admission"


def _report(system: ActorSystem, name: str) -> dict:
    return next(s for s in system.snapshot() if s.name == name).report


async def _sse(resp: aiohttp.ClientResponse) -> list[dict]:
    chunks = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: "):]
        if payload == "[DONE]":
            break
        chunks.append(json.loads(payload))
    return chunks
