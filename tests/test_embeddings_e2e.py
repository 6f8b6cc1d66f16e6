"""`troupe serve --task embed` on the bundled default model (issue 33), over HTTP with the
official openai client: 64 inputs in one request, and 8 requests at once, each input's vector
its own whatever it was batched with."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import openai
import pytest
from http_stack import serve_default_model

pytestmark = pytest.mark.e2e

TEXTS = [f"note {i}: " + ("the quick brown fox jumps over the lazy dog" if i % 2 else
                          "def add(a, b): return a + b") for i in range(64)]


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("embed-server") / "server.log"
    with serve_default_model(log, "--task", "embed") as base:
        yield base


async def test_the_default_model_embeds_64_inputs_and_8_requests_at_once(
    embed_server: str,
) -> None:
    oai = openai.AsyncOpenAI(base_url=f"{embed_server}/v1", api_key="x", max_retries=0)
    try:
        models = await oai.models.list()
        model = models.data[0].id
        many = await oai.embeddings.create(model=model, input=TEXTS)
        alone = [(await oai.embeddings.create(model=model, input=t)).data[0].embedding
                 for t in TEXTS[:4]]
        apart = await asyncio.gather(*(oai.embeddings.create(model=model, input=TEXTS[i::8])
                                       for i in range(8)))
        with pytest.raises(openai.BadRequestError, match="--task generate"):
            await oai.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    finally:
        await oai.close()
    vectors = np.array([d.embedding for d in many.data])
    assert vectors.shape[0] == 64 and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-4)
    assert not np.allclose(vectors[0], vectors[1], atol=1e-3)
    np.testing.assert_allclose(vectors[:4], alone, atol=1e-4)
    for i, resp in enumerate(apart):
        np.testing.assert_allclose([d.embedding for d in resp.data], vectors[i::8], atol=1e-4)
    assert many.usage.prompt_tokens > 64
