"""/v1/embeddings and /v1/rerank served in-process over HTTP by tiny random-weight models
(issue 33): the official openai client's embeddings.create, the request shapes, and the
refusals in the API's shape."""

from __future__ import annotations

import asyncio
import base64
import gc
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest
from embed_models import QUERY_PROMPT, make_embedding_model, make_reranker_model
from http_stack import RealStack, real_client, real_client_with_room, real_stack
from mlx_lm import load

from troupe.actors.config import ServeConfig
from troupe.actors.engine.embed import (
    Embedder,
    EmbedJob,
    answer_token,
    read_embed_spec,
    rerank_tokens,
)
from troupe.actors.engine.schedule import STEP_BUDGET_FLOOR
from troupe.actors.messages import AbortRequest, AdmissionError, AdmitEmbed

MB = 1 << 20

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog",
         "def add(a, b): return a + b"]


@pytest.fixture(scope="module")
def embedding_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_embedding_model(tmp_path_factory.mktemp("emb") / "tiny-qwen3-embedding",
                                context=256)


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_reranker_model(tmp_path_factory.mktemp("rerank"))


@pytest.fixture
async def embed_stack(embedding_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                      ) -> AsyncIterator[RealStack]:
    monkeypatch.setenv("TROUPE_HOME", str(tmp_path))
    async with real_stack(embedding_dir) as stack:
        yield stack


def _alone(model_dir: Path, texts: list[str]) -> list[list[float]]:
    """Each text's vector, embedded alone by the engine's embedder outside any server."""
    model, tok = load(str(model_dir))
    embedder = Embedder(model, read_embed_spec(model_dir))
    out: list[Any] = []
    for text in texts:
        embedder.add(EmbedJob("one", "embed", [tok.encode(text)], lambda r, e: out.extend(r)))
        while embedder.has_work:
            embedder.step(512)
    return out


async def test_the_official_openai_client_embeds(embed_stack: RealStack,
                                                 embedding_dir: Path) -> None:
    oai = openai.AsyncOpenAI(base_url=f"{embed_stack.server.url}/v1", api_key="x",
                             max_retries=0)
    try:
        got = await oai.embeddings.create(model=embed_stack.model, input=TEXTS)
        one = await oai.embeddings.create(model=embed_stack.model, input=TEXTS[1])
        b64 = await oai.embeddings.create(model=embed_stack.model, input=TEXTS,
                                          encoding_format="base64")
        short = await oai.embeddings.create(model=embed_stack.model, input=TEXTS,
                                            dimensions=16)
    finally:
        await oai.close()
    vectors = [d.embedding for d in got.data]
    assert [d.index for d in got.data] == [0, 1, 2] and len(vectors[0]) == 64
    assert not np.allclose(vectors[0], vectors[1], atol=1e-3)
    np.testing.assert_allclose(vectors, _alone(embedding_dir, TEXTS), atol=1e-5)
    np.testing.assert_allclose(one.data[0].embedding, vectors[1], atol=1e-5)
    # Silent on the format, the client asks for base64 and decodes it itself; asked for
    # base64, it hands the strings over as they came.
    decoded = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in b64.data]
    np.testing.assert_allclose(decoded, vectors, atol=0)
    for v, s in zip(vectors, short.data, strict=True):
        head = np.array(v[:16])
        np.testing.assert_allclose(s.embedding, head / np.linalg.norm(head), atol=1e-6)
    assert got.usage.prompt_tokens == got.usage.total_tokens > 0


async def test_token_ids_base64_and_query_prompt_over_plain_http(
    embed_stack: RealStack, embedding_dir: Path
) -> None:
    _, tok = load(str(embedding_dir))
    ids = [tok.encode(t) for t in TEXTS]
    async with httpx.AsyncClient(base_url=embed_stack.server.url) as http:
        as_text = (await http.post("/v1/embeddings", json={"input": TEXTS[:2]})).json()
        as_ids = (await http.post("/v1/embeddings", json={"input": ids[:2],
                                                          "encoding_format": "base64"})).json()
        single = (await http.post("/v1/embeddings", json={"input": ids[0]})).json()
        query = (await http.post("/v1/embeddings", json={"input": TEXTS[0],
                                                         "input_type": "query"})).json()
        listed = (await http.get("/v1/models")).json()["data"]
    assert [m.get("task") for m in listed] == ["embed"]
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4").tolist()
               for d in as_ids["data"]]
    np.testing.assert_allclose(decoded, [d["embedding"] for d in as_text["data"]], atol=0)
    assert single["data"][0]["embedding"] == as_text["data"][0]["embedding"]
    prompted = _alone(embedding_dir, [QUERY_PROMPT + TEXTS[0]])[0]
    np.testing.assert_allclose(query["data"][0]["embedding"], prompted, atol=1e-5)
    assert not np.allclose(prompted, as_text["data"][0]["embedding"], atol=1e-3)


async def test_an_input_over_the_context_is_a_400_naming_it_or_cut_with_truncate(
    embed_stack: RealStack, embedding_dir: Path
) -> None:
    _, tok = load(str(embedding_dir))
    long = tok.decode(list(range(300, 400)) * 4)
    assert len(tok.encode(long)) > 256
    async with httpx.AsyncClient(base_url=embed_stack.server.url) as http:
        refused = await http.post("/v1/embeddings", json={"input": ["hi", long]})
        cut = await http.post("/v1/embeddings", json={"input": ["hi", long], "truncate": True})
        over = await http.post("/v1/embeddings", json={"input": "hi", "dimensions": 65})
        empty = await http.post("/v1/embeddings", json={"input": []})
        chat = await http.post("/v1/chat/completions", json={
            "model": embed_stack.model, "messages": [{"role": "user", "content": "hi"}]})
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == "input[1]"
    assert error["code"] == "context_length_exceeded" and "truncate" in error["message"]
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] <= 256 + 2
    expected = _alone(embedding_dir, [tok.decode(tok.encode(long)[:256])])[0]
    assert len(cut.json()["data"][1]["embedding"]) == len(expected)
    assert over.status_code == 400 and over.json()["error"]["param"] == "dimensions"
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "input"
    assert chat.status_code == 400 and "/v1/embeddings" in chat.json()["error"]["message"]


async def test_embeddings_on_a_chat_model_are_a_400_naming_the_flag(
    tiny_qwen3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TROUPE_HOME", str(tmp_path))
    async with real_stack(tiny_qwen3_dir) as stack, \
            httpx.AsyncClient(base_url=stack.server.url) as http:
        resp = await http.post("/v1/embeddings", json={"input": "hi"})
        rerank = await http.post("/v1/rerank", json={"query": "q", "documents": ["d"]})
        listed = (await http.get("/v1/models")).json()["data"]
    assert "task" not in listed[0]
    assert resp.status_code == 400 and "--task embed" in resp.json()["error"]["message"]
    assert rerank.status_code == 400 and "--task rerank" in rerank.json()["error"]["message"]


async def test_task_embed_serves_a_chat_model_as_an_embedder(
    tiny_qwen3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TROUPE_HOME", str(tmp_path))
    async with real_stack(tiny_qwen3_dir, task="embed") as stack, \
            httpx.AsyncClient(base_url=stack.server.url) as http:
        resp = await http.post("/v1/embeddings", json={"input": TEXTS})
    assert resp.status_code == 200
    np.testing.assert_allclose([d["embedding"] for d in resp.json()["data"]],
                               _alone(tiny_qwen3_dir, TEXTS), atol=1e-5)


async def test_rerank_sorts_documents_by_the_models_scores(
    reranker_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TROUPE_HOME", str(tmp_path))
    docs = ["the fox is quick", "numbers add up", "hello there", "a lazy dog sleeps"]
    async with real_stack(reranker_dir) as stack, \
            httpx.AsyncClient(base_url=stack.server.url) as http:
        full = (await http.post("/v1/rerank", json={
            "model": stack.model, "query": "what does the fox do?", "documents": docs})).json()
        top = await http.post("/v2/rerank", json={
            "query": "what does the fox do?", "top_n": 2, "return_documents": False,
            "documents": [{"text": d} for d in docs]})
        plain = await http.post("/rerank", json={"query": "what does the fox do?",
                                                 "documents": docs})
    scores = [r["relevance_score"] for r in full["results"]]
    assert scores == sorted(scores, reverse=True) and len(set(scores)) == len(docs)
    assert sorted(r["index"] for r in full["results"]) == [0, 1, 2, 3]
    assert all(r["document"]["text"] == docs[r["index"]] for r in full["results"])
    assert top.json()["results"] == [{k: v for k, v in r.items() if k != "document"}
                                     for r in full["results"][:2]]
    assert plain.json()["results"] == full["results"]


async def test_rerank_cuts_a_document_over_the_context_unless_truncate_is_false(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TROUPE_HOME", str(tmp_path))
    model_dir = make_reranker_model(tmp_path / "models", context=320)
    _, tok = load(str(model_dir))
    long = tok.decode(list(range(300, 400)) * 4)
    docs = ["the fox is quick", long]
    assert len(rerank_tokens(tok, "what does the fox do?", long)) > 320
    async with real_stack(model_dir) as stack, \
            httpx.AsyncClient(base_url=stack.server.url) as http:
        cut = await http.post("/v1/rerank", json={"query": "what does the fox do?",
                                                  "documents": docs})
        refused = await http.post("/v1/rerank", json={"query": "what does the fox do?",
                                                      "documents": docs, "truncate": False})
    assert cut.status_code == 200
    model, _ = load(str(model_dir))
    yes, no = answer_token(tok, "yes"), answer_token(tok, "no")
    alone = Embedder(model, read_embed_spec(model_dir), yes_id=yes, no_id=no)
    got: list[Any] = []
    alone.add(EmbedJob("one", "rerank", [rerank_tokens(tok, "what does the fox do?", long,
                                                       limit=320)], lambda r, e: got.extend(r)))
    while alone.has_work:
        alone.step(512)
    assert len({r["relevance_score"] for r in cut.json()["results"]}) == 2
    score = next(r["relevance_score"] for r in cut.json()["results"] if r["index"] == 1)
    assert score == pytest.approx(got[0], abs=1e-5)
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == "documents[1]"
    assert error["code"] == "context_length_exceeded"


async def test_concurrent_requests_and_64_inputs_get_each_inputs_own_vector(
    embed_stack: RealStack, embedding_dir: Path
) -> None:
    texts = [f"note {i}: " + TEXTS[i % 3] for i in range(64)]
    oai = openai.AsyncOpenAI(base_url=f"{embed_stack.server.url}/v1", api_key="x",
                             max_retries=0)
    try:
        many = await oai.embeddings.create(model=embed_stack.model, input=texts)
        apart = await asyncio.gather(*(
            oai.embeddings.create(model=embed_stack.model, input=texts[i::8])
            for i in range(8)))
    finally:
        await oai.close()
    alone = _alone(embedding_dir, texts)
    np.testing.assert_allclose([d.embedding for d in many.data], alone, atol=1e-5)
    for i, resp in enumerate(apart):
        np.testing.assert_allclose([d.embedding for d in resp.data], alone[i::8], atol=1e-5)


async def test_an_input_over_the_memory_limit_is_a_413_before_any_header(
    aiohttp_client: Any, tmp_path: Path
) -> None:
    # One 2000-token chunk: ~80 MB of attention scores on the tiny model (tests/test_memory.py).
    model_dir = make_embedding_model(tmp_path / "tiny-qwen3-embedding", context=4096)
    gc.collect()
    mx.clear_cache()
    config = ServeConfig.of(model=str(model_dir), cache_dir=str(tmp_path / "cache"),
                            prefill_step_size=2048)
    client, handles = await real_client_with_room(aiohttp_client, config, 30 * MB)
    _, tok = load(str(model_dir))
    long = (tok.encode(" ".join(TEXTS)) * 200)[:2000]
    refused = await client.post("/v1/embeddings", json={"input": [[1, 2, 3]] * 2 + [long]})
    error = (await refused.json())["error"]
    assert refused.status == 413 and error["code"] == "memory_limit_exceeded"
    served = await client.post("/v1/embeddings", json={"input": [[1, 2, 3]]})
    assert served.status == 200


async def test_one_pool_serves_chat_streams_beside_embedding_requests(
    aiohttp_client: Any, tiny_qwen3_dir: Path, embedding_dir: Path, tmp_path: Path
) -> None:
    config = ServeConfig.of(model=[str(tiny_qwen3_dir), str(embedding_dir)],
                            cache_dir=str(tmp_path / "cache"))
    client, system, handles = await real_client(aiohttp_client, config)
    chat_model, embed_model = (card.id for card in handles.models)
    prompts = [f"tell me about {w}" for w in ("foxes", "dogs", "cats", "owls")]

    async def chat(prompt: str) -> str:
        resp = await client.post("/v1/chat/completions", json={
            "model": chat_model, "max_tokens": 24, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": prompt}]})
        assert resp.status == 200
        chunks = [json.loads(line[6:]) for line in (await resp.text()).splitlines()
                  if line.startswith("data: {")]
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c["choices"])

    async def embed(i: int) -> list[list[float]]:
        resp = await client.post("/v1/embeddings", json={"model": embed_model,
                                                         "input": TEXTS[i % 3:]})
        assert resp.status == 200
        return [d["embedding"] for d in (await resp.json())["data"]]

    alone = [await chat(p) for p in prompts]
    results = await asyncio.gather(*(chat(p) for p in prompts), *(embed(i) for i in range(8)))
    assert len(set(alone)) > 1
    assert list(results[:4]) == alone  # greedy answers, unchanged by the embedding work
    vectors = _alone(embedding_dir, TEXTS)
    for i, got in enumerate(results[4:]):
        np.testing.assert_allclose(got, vectors[i % 3:], atol=1e-5)
    reports = {s.report.get("model"): s.report for s in system.snapshot()
               if s.report.get("model") in (chat_model, embed_model)}
    inputs = sum(len(TEXTS[i % 3:]) for i in range(8))
    assert reports[embed_model]["embedded_inputs"] == inputs
    assert reports[embed_model]["embed_jobs"] == 0 and "embedded_inputs" not in reports[chat_model]


async def test_embedding_steps_keep_to_the_step_budget_only_while_another_model_is_busy(
    aiohttp_client: Any, tiny_qwen3_dir: Path, embedding_dir: Path, tmp_path: Path
) -> None:
    config = ServeConfig.of(model=[str(tiny_qwen3_dir), str(embedding_dir)],
                            cache_dir=str(tmp_path / "cache"), step_budget_ms=0.01)
    client, system, handles = await real_client(aiohttp_client, config)
    chat_model, embed_model = (card.id for card in handles.models)

    def step_tokens() -> int:
        return next(s.report for s in system.snapshot()
                    if s.report.get("model") == embed_model)["embed_step_tokens"]

    async def embed() -> None:
        resp = await client.post("/v1/embeddings", json={"model": embed_model, "input": TEXTS})
        assert resp.status == 200

    await embed()
    assert step_tokens() == config.engine.prefill_step_size  # alone: whole chunks
    stream = await client.post("/v1/chat/completions", json={
        "model": chat_model, "max_tokens": 4000, "ignore_eos": True, "stream": True,
        "messages": [{"role": "user", "content": "tell me a long story"}]})
    assert stream.status == 200
    await stream.content.readline()  # the chat is decoding
    await embed()
    assert step_tokens() == STEP_BUDGET_FLOOR  # beside it: the step budget (its floor here)
    stream.close()


async def test_a_repeated_rerank_query_reads_its_prefix_from_the_prefix_cache(
    aiohttp_client: Any, reranker_dir: Path, tmp_path: Path
) -> None:
    config = ServeConfig.of(model=str(reranker_dir), cache_dir=str(tmp_path / "cache"))
    client, system, _ = await real_client(aiohttp_client, config)
    query = "which of these documents talk about foxes and dogs?"

    async def rerank(docs: list[str]) -> list[float]:
        resp = await client.post("/v1/rerank", json={"query": query, "documents": docs})
        assert resp.status == 200
        return [r["relevance_score"] for r in sorted((await resp.json())["results"],
                                                     key=lambda r: r["index"])]

    def report() -> dict[str, Any]:
        return next(s.report for s in system.snapshot() if "embed_cached_tokens" in s.report)

    await rerank(["the fox is quick", "numbers add up"])
    first = report()
    assert first["embed_cached_tokens"] == 0
    docs = ["a lazy dog sleeps", "hello there", "the fox and the dog"]
    again = await rerank(docs)
    second = report()
    cached = second["embed_cached_tokens"]
    assert cached >= 64  # at least one block of the format and query
    model, tok = load(str(reranker_dir))
    alone = Embedder(model, read_embed_spec(reranker_dir), yes_id=answer_token(tok, "yes"),
                     no_id=answer_token(tok, "no"))
    fresh: list[Any] = []
    alone.add(EmbedJob("x", "rerank", [rerank_tokens(tok, query, d) for d in docs],
                       lambda r, e: fresh.extend(r)))
    while alone.has_work:
        alone.step(512)
    np.testing.assert_allclose(again, fresh, atol=1e-5)
    assert second["embedded_tokens"] - first["embedded_tokens"] == alone.tokens_run - cached


async def test_admission_refuses_texts_and_token_ids_mixed(
    aiohttp_client: Any, embedding_dir: Path, tmp_path: Path
) -> None:
    config = ServeConfig.of(model=str(embedding_dir), cache_dir=str(tmp_path / "cache"))
    _, _, handles = await real_client(aiohttp_client, config)
    with pytest.raises(AdmissionError, match="all strings or all token id lists"):
        await handles.admission.ask(AdmitEmbed(request_id="r", model="", inputs=["a", [1, 2]]),
                                    timeout=30)
    answer = await handles.admission.ask(
        AdmitEmbed(request_id="r", model="", inputs=[[1, 2], [3, 4]]), timeout=30)
    assert len(answer.results) == 2


async def test_an_aborted_embedding_request_leaves_its_models_queue(
    aiohttp_client: Any, embedding_dir: Path, tmp_path: Path
) -> None:
    # Steps of 32 tokens: the 64 inputs of 200 tokens take hundreds of steps, and the abort
    # arrives between two of them.
    config = ServeConfig.of(model=str(embedding_dir), cache_dir=str(tmp_path / "cache"),
                            prefill_step_size=32)
    _, system, handles = await real_client(aiohttp_client, config)
    _, tok = load(str(embedding_dir))
    inputs = [(tok.encode(" ".join(TEXTS)) * 20)[i:i + 200] for i in range(64)]

    def report() -> dict[str, Any]:
        return next(s.report for s in system.snapshot() if "embed_jobs" in s.report)

    asked = asyncio.create_task(handles.admission.ask(
        AdmitEmbed(request_id="gone", model="", inputs=inputs), timeout=600))
    while report()["embedded_tokens"] == 0:
        await asyncio.sleep(0.01)
    handles.admission.try_tell(AbortRequest(request_id="gone"))
    with pytest.raises(AdmissionError, match="aborted"):
        await asked
    after = report()
    assert after["embed_jobs"] == 0 and after["embedded_inputs"] < 64
