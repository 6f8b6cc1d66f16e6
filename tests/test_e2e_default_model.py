"""End to end: `troupe serve` on the bundled default model, driven by the official openai client.

The server is conftest's session-wide ``server`` fixture, shared with the other e2e modules.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_default_model_is_listed(model: str) -> None:
    assert model == "SmolLM2-135M-Instruct"


def test_start_up_log_names_the_blas(model: str, server_log: Path) -> None:
    from troupe.actors.models.blas import find_openblas

    line = next(ln for ln in server_log.read_text().splitlines() if "serving" in ln)
    assert "BLAS: " in line
    if find_openblas() is not None:
        assert "BLAS: OpenBLAS" in line


def test_chat_answers_the_capital_of_france(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(model=model, messages=QUESTION, temperature=0,
                                       max_tokens=32)
    assert r.choices[0].message.content.startswith(ANSWER)
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0


def test_streamed_chat_gives_the_same_answer(client: openai.OpenAI, model: str) -> None:
    stream = client.chat.completions.create(model=model, messages=QUESTION, temperature=0,
                                            max_tokens=32, stream=True,
                                            stream_options={"include_usage": True})
    parts, usage = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts).startswith(ANSWER)
    assert usage is not None and usage.completion_tokens > 0


def test_completion_continues_a_prompt(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(model=model, prompt="The capital of France is", temperature=0,
                                  max_tokens=8)
    assert "Paris" in r.choices[0].text


def test_stop_string_cuts_the_answer(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(model=model, messages=QUESTION, temperature=0,
                                       max_tokens=32, stop=[" is"])
    assert r.choices[0].message.content == "The capital of France"
    assert r.choices[0].finish_reason == "stop"


def test_disconnect_mid_stream_leaves_server_serving(server: str, client: openai.OpenAI,
                                                     model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        next(resp.iter_lines())
    # The server dropped the abandoned request: a new one is answered promptly and correctly.
    r = client.chat.completions.create(model=model, messages=QUESTION, temperature=0,
                                       max_tokens=32)
    assert r.choices[0].message.content.startswith(ANSWER)
