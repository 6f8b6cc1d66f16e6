"""Encoder models (BERT family) for /v1/embeddings and /v1/rerank through mlx-vlm (issue 33):
tiny random-weight encoders made with mlx-vlm's own classes, their vectors and cross-encoder
scores against a direct forward of the same model, batched against alone, the task and context
read from their configs, and the routes over HTTP."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import mlx.core as mx
import numpy as np
import openai
import pytest
from embed_models import run_job, write_dense
from encoder_models import make_encoder
from http_stack import real_client_with_room, real_stack
from tiny_model import make_tiny_model

from troupe.actors.config import ServeConfig
from troupe.actors.engine.embed import EmbedJob, detect_task
from troupe.actors.engine.encoder import (
    EncoderEmbedder,
    EncoderUnavailable,
    check_encoder,
    load_encoder,
    pair_tokens,
    read_config,
)
from troupe.actors.engine.memory_estimate import embed_step_need, model_memory
from troupe.actors.scheduler import context_length

ROOT = Path(__file__).resolve().parent.parent
MB = 1 << 20
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a", "numbers add up"]
QUERY = "what does the fox do?"
DOCS = ["the fox is quick", "numbers add up", "hello there", "a lazy dog sleeps",
        "the quick brown fox jumps over the dog"]


def _direct_vector(model: Any, ids: list[int], pooling: str) -> np.ndarray:
    """One input alone through the mlx-vlm model (no mask, no padding), pooled and
    L2-normalised in numpy."""
    h = np.array(model(mx.array([ids])).last_hidden_state[0].astype(mx.float32))
    v = h[0] if pooling == "cls" else h.mean(axis=0)
    return v / np.linalg.norm(v)


def _direct_score(model: Any, tokenizer: Any, query: str, doc: str) -> float:
    """A pair alone through the mlx-vlm classifier, with the token types its tokenizer gives:
    the sigmoid of its one logit."""
    enc = tokenizer.backend_tokenizer.encode(query, doc)
    logit = model(mx.array([enc.ids]), token_type_ids=mx.array([enc.type_ids])).logits
    return float(mx.sigmoid(logit.astype(mx.float32))[0, 0])


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("encoders")
    return {
        "bert-mean": make_encoder(root / "tiny-bert-mean", "bert", pooling="mean"),
        "bert-cls": make_encoder(root / "tiny-bert-cls", "bert", pooling="cls"),
        "roberta-mean": make_encoder(root / "tiny-roberta", "roberta", pooling="mean"),
        "modernbert-mean": make_encoder(root / "tiny-modernbert", "modernbert", pooling=None),
        "xlm-roberta-rerank": make_encoder(root / "tiny-xlmr-reranker", "xlm-roberta",
                                           reranker=True),
        "bert-rerank": make_encoder(root / "tiny-bert-cross", "bert", reranker=True),
    }


@pytest.mark.parametrize("name", ["bert-mean", "bert-cls", "roberta-mean", "modernbert-mean"])
def test_encoder_vectors_equal_a_direct_forward_pooled_and_normalised(
        dirs: dict[str, Path], name: str) -> None:
    model, tok, config = load_encoder(dirs[name], "embed")
    inputs = [tok.encode(t) for t in TEXTS]
    got = run_job(EncoderEmbedder(model, tok, config), "embed", inputs)
    refs = [_direct_vector(model, ids, name.rsplit("-", 1)[1]) for ids in inputs]
    assert not np.allclose(refs[0], refs[1], atol=1e-3)  # two texts, two vectors
    for vec, ref in zip(got, refs, strict=True):
        np.testing.assert_allclose(vec, ref, atol=1e-5)


@pytest.mark.parametrize("name", ["bert-mean", "roberta-mean", "modernbert-mean"])
def test_batched_encoder_inputs_equal_each_input_alone(dirs: dict[str, Path], name: str
                                                       ) -> None:
    model, tok, config = load_encoder(dirs[name], "embed")
    inputs = [tok.encode(t) for t in TEXTS]
    assert len({len(ids) for ids in inputs}) > 1  # the batch pads its shorter inputs
    embedder = EncoderEmbedder(model, tok, config)
    together = run_job(embedder, "embed", inputs)
    assert embedder.tokens_run == sum(len(ids) for ids in inputs)
    alone = [run_job(EncoderEmbedder(model, tok, config), "embed", [ids])[0] for ids in inputs]
    np.testing.assert_allclose(together, alone, atol=1e-5)


def test_a_small_budget_splits_a_job_into_steps_of_the_same_vectors(dirs: dict[str, Path]
                                                                     ) -> None:
    model, tok, config = load_encoder(dirs["bert-mean"], "embed")
    inputs = [tok.encode(t) for t in TEXTS]
    embedder, got = EncoderEmbedder(model, tok, config), {}
    embedder.add(EmbedJob("job", "embed", inputs, lambda r, e: got.update(r=r)))
    steps = 0
    while embedder.has_work:
        embedder.step(max(len(ids) for ids in inputs))
        steps += 1
    assert steps > 1
    np.testing.assert_allclose(got["r"], run_job(EncoderEmbedder(model, tok, config), "embed",
                                              inputs), atol=1e-5)


def test_an_aborted_encoder_job_leaves_the_queue_unanswered(dirs: dict[str, Path]) -> None:
    model, tok, config = load_encoder(dirs["bert-mean"], "embed")
    embedder, answers = EncoderEmbedder(model, tok, config), []
    inputs = [tok.encode(t) for t in TEXTS]
    embedder.add(EmbedJob("gone", "embed", inputs, lambda r, e: answers.append("gone")))
    embedder.add(EmbedJob("kept", "embed", inputs[:1], lambda r, e: answers.append(r)))
    embedder.abort("gone")
    while embedder.has_work:
        embedder.step(512)
    assert len(answers) == 1 and answers[0] != "gone" and embedder.inputs_done == 1


def test_the_memory_gate_fails_an_encoder_step_counting_its_whole_attention(
    dirs: dict[str, Path]
) -> None:
    model, tok, config = load_encoder(dirs["bert-mean"], "embed")
    memory = model_memory(config)
    long, short = tok.encode(" ".join(TEXTS * 3)), tok.encode("a")
    embedder, got = EncoderEmbedder(model, tok, config, memory=memory), {}
    embedder.add(EmbedJob("long", "embed", [long], lambda r, e: got.update(long=e)))
    embedder.add(EmbedJob("short", "embed", [short], lambda r, e: got.update(short=r)))
    mx.clear_cache()
    # Room for the short input's step, not for the long one's attention over all of it.
    limit = mx.get_active_memory() + embed_step_need(memory, rows=1, tokens=len(short),
                                                     context=len(short)) + 4096
    assert embed_step_need(memory, rows=1, tokens=len(long), context=len(long)) > 4096
    while embedder.has_work:  # a budget of the long input alone: two steps
        embedder.step(len(long), limit=limit)
    assert got["long"].code in ("memory_busy", "memory_limit_exceeded")
    assert len(got["short"]) == 1


@pytest.mark.parametrize("name", ["xlm-roberta-rerank", "bert-rerank"])
def test_cross_encoder_scores_are_the_sigmoid_of_the_classifier_logit(
        dirs: dict[str, Path], name: str) -> None:
    model, tok, config = load_encoder(dirs[name], "rerank")
    inputs = [pair_tokens(tok, QUERY, doc, None) for doc in DOCS]
    got = run_job(EncoderEmbedder(model, tok, config), "rerank", inputs)
    refs = [_direct_score(model, tok, QUERY, doc) for doc in DOCS]
    assert len({round(r, 6) for r in refs}) == len(DOCS)  # the scores tell documents apart
    np.testing.assert_allclose(got, refs, atol=1e-5)


def test_bert_pairs_tell_the_document_by_token_type(dirs: dict[str, Path]) -> None:
    model, tok, config = load_encoder(dirs["bert-rerank"], "rerank")
    ids = pair_tokens(tok, QUERY, DOCS[0], None)
    typed = run_job(EncoderEmbedder(model, tok, config), "rerank", [ids])[0]
    untyped = float(mx.sigmoid(model(mx.array([ids])).logits.astype(mx.float32))[0, 0])
    assert abs(typed - untyped) > 1e-6  # the types change the score: they are passed


def test_the_task_and_context_come_from_the_encoders_config(dirs: dict[str, Path],
                                                            tmp_path: Path) -> None:
    assert detect_task(dirs["bert-mean"]) == "embed"
    assert detect_task(dirs["modernbert-mean"]) == "embed"  # no sentence-transformers files
    assert detect_task(dirs["xlm-roberta-rerank"]) == "rerank"
    assert detect_task(dirs["bert-rerank"]) == "rerank"
    # RoBERTa's positions start after the padding index: 64 positions take 62 tokens.
    assert context_length(read_config(dirs["xlm-roberta-rerank"])) == 62
    assert context_length(read_config(dirs["roberta-mean"])) == 62
    assert context_length(read_config(dirs["bert-mean"])) == 64


def test_an_encoder_refuses_a_task_it_cannot_do_and_an_unserved_family(
        dirs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(EncoderUnavailable, match="--task embed"):
        check_encoder(dirs["bert-mean"], "generate")
    with pytest.raises(EncoderUnavailable, match="cross-encoder reranker"):
        check_encoder(dirs["bert-rerank"], "embed")
    nomic = tmp_path / "nomic-embed"
    nomic.mkdir()
    (nomic / "config.json").write_text('{"model_type": "nomic_bert"}')
    assert detect_task(nomic) == "embed"
    with pytest.raises(EncoderUnavailable, match="encoder families served are"):
        check_encoder(nomic, "embed")


def test_serving_an_encoder_without_mlx_vlm_fails_at_start_naming_the_extra(
        dirs: dict[str, Path], tmp_path: Path) -> None:
    # The encoder is the second model (loaded on its first request): the server refuses to
    # start all the same. The import fails as it would without the extra (``--blas
    # bundled``: no re-exec, which would drop it).
    chat = make_tiny_model(tmp_path / "tiny-chat")
    args = ["serve", "--model", str(chat), "--model", str(dirs["bert-mean"]), "--port", "0",
            "--blas", "bundled"]
    code = ("import sys; sys.modules['mlx_vlm'] = None\n"
            f"from api.cli import main\nsys.exit(main({args!r}))")
    env = {**os.environ, "TROUPE_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1
    assert "pip install 'mlx-troupe[vision]'" in done.stderr, done.stderr[-2000:]


async def test_an_encoders_dense_module_applies_after_pooling_over_http(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TROUPE_HOME", str(tmp_path))
    model_dir = make_encoder(tmp_path / "tiny-bert-dense", "bert", pooling="mean")
    weight, bias = write_dense(model_dir, 32, 16, "torch.nn.modules.activation.Tanh")
    model, tok, _ = load_encoder(model_dir, "embed")
    async with real_stack(model_dir) as stack:
        oai = openai.AsyncOpenAI(base_url=f"{stack.server.url}/v1", api_key="x", max_retries=0)
        try:
            got = await oai.embeddings.create(model=stack.model, input=TEXTS)
        finally:
            await oai.close()
    for data, text in zip(got.data, TEXTS, strict=True):
        h = np.array(model(mx.array([tok.encode(text)])).last_hidden_state[0]
                     .astype(mx.float32)).mean(axis=0)
        ref = np.tanh(weight @ h + bias)
        np.testing.assert_allclose(data.embedding, ref / np.linalg.norm(ref), atol=1e-5)
    assert len(got.data[0].embedding) == 16


async def test_the_openai_client_embeds_with_an_encoder_over_http(
        dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TROUPE_HOME", str(tmp_path))
    model, tok, _ = load_encoder(dirs["bert-cls"], "embed")
    long_text = " ".join(["the quick brown fox"] * 20)  # over the 64 positions
    async with real_stack(dirs["bert-cls"]) as stack:
        oai = openai.AsyncOpenAI(base_url=f"{stack.server.url}/v1", api_key="x", max_retries=0)
        try:
            got = await oai.embeddings.create(model=stack.model, input=TEXTS)
            cut = await oai.embeddings.create(model=stack.model, input=long_text,
                                              extra_body={"truncate": True})
            with pytest.raises(openai.BadRequestError, match="context"):
                await oai.embeddings.create(model=stack.model, input=long_text)
        finally:
            await oai.close()
    refs = [_direct_vector(model, tok.encode(t), "cls") for t in TEXTS]
    np.testing.assert_allclose([d.embedding for d in got.data], refs, atol=1e-5)
    ids = tok.encode(long_text, truncation=True, max_length=64)
    assert len(ids) == 64 and ids[-1] == tok.sep_token_id  # cut, its closing token kept
    np.testing.assert_allclose(cut.data[0].embedding, _direct_vector(model, ids, "cls"),
                               atol=1e-5)
    assert got.usage.prompt_tokens == sum(len(tok.encode(t)) for t in TEXTS)


async def test_concurrent_encoder_requests_each_get_their_inputs_vectors(
        dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TROUPE_HOME", str(tmp_path))
    model, tok, _ = load_encoder(dirs["roberta-mean"], "embed")
    texts = [f"{TEXTS[i % 4]} {' dog' * (i % 5)}" for i in range(16)]
    async with real_stack(dirs["roberta-mean"]) as stack:
        oai = openai.AsyncOpenAI(base_url=f"{stack.server.url}/v1", api_key="x", max_retries=0)
        try:
            answers = await asyncio.gather(*(
                oai.embeddings.create(model=stack.model, input=texts[i::4]) for i in range(4)))
        finally:
            await oai.close()
    for i, answer in enumerate(answers):
        refs = [_direct_vector(model, tok.encode(t), "mean") for t in texts[i::4]]
        np.testing.assert_allclose([d.embedding for d in answer.data], refs, atol=1e-5)


async def test_the_memory_guard_counts_an_encoder_inputs_whole_attention(
        aiohttp_client: Any, dirs: dict[str, Path], tmp_path: Path) -> None:
    # 2000 tokens in one pass: ~64 MB of attention scores on the tiny encoder; a 256-token
    # chunk's would be ~8 MB, under the 30 MB of room left.
    model_dir = make_encoder(tmp_path / "tiny-bert-long", "bert", positions=4096)
    gc.collect()
    mx.clear_cache()
    config = ServeConfig.of(model=str(model_dir), cache_dir=str(tmp_path / "cache"),
                            prefill_step_size=256)
    client, handles = await real_client_with_room(aiohttp_client, config, 30 * MB)
    refused = await client.post("/v1/embeddings", json={"input": [[5, 6, 7] * 666 + [3]]})
    error = (await refused.json())["error"]
    assert refused.status == 413 and error["code"] == "memory_limit_exceeded"
    served = await client.post("/v1/embeddings", json={"input": [[2, 5, 6, 3]]})
    assert served.status == 200


async def test_rerank_over_http_orders_documents_by_the_cross_encoders_scores(
        dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TROUPE_HOME", str(tmp_path))
    model, tok, _ = load_encoder(dirs["xlm-roberta-rerank"], "rerank")
    async with real_stack(dirs["xlm-roberta-rerank"]) as stack, aiohttp.ClientSession() as http:
        async with http.post(f"{stack.server.url}/v1/rerank", json={
                "query": QUERY, "documents": DOCS, "top_n": 3}) as resp:
            assert resp.status == 200
            body = await resp.json()
        async with http.post(f"{stack.server.url}/v1/embeddings", json={"input": "a"}) as resp:
            refused = resp.status, await resp.json()
    refs = [_direct_score(model, tok, QUERY, doc) for doc in DOCS]
    best = sorted(range(len(DOCS)), key=lambda i: refs[i], reverse=True)[:3]
    assert [r["index"] for r in body["results"]] == best
    np.testing.assert_allclose([r["relevance_score"] for r in body["results"]],
                               [refs[i] for i in best], atol=1e-5)
    assert all(r["document"]["text"] == DOCS[r["index"]] for r in body["results"])
    assert refused[0] == 400 and "/v1/rerank" in refused[1]["error"]["message"]
