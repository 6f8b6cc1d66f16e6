"""The chat template a request is rendered with is the model's, and its render is bounded
(issue 36, part 1).

``chat_template_kwargs`` once went straight into ``apply_chat_template``: a client could send
its own template (``{{ 7*7 }}`` made the prompt "49"), and a template's render had no bound
in time or size (four renders of nested loops held every admission worker, and a render in
flight at SIGTERM kept the process alive). The model here has a template whose own variables
make it slow (``spin``: three nested loops) or long (``blowup``), so that the bounds are met
through a path a client really has: the variables of the model's template.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from http_stack import real_client, serve_logged
from tiny_model import CHATML

import troupe.actors.admission as admission_module
from troupe.actors.config import ServeConfig
from troupe.actors.prompts import RENDER_CHARS_PER_TOKEN
from troupe.actors.serving import start_serving
from troupe.runtime import ActorSystem

ROOT = Path(__file__).resolve().parents[1]
CHAT = "/v1/chat/completions"
# The loops run spin**3 times (spin is at most 100,000 in Jinja's sandbox): at 100,000, a
# render never ends by itself.
SPIN = 100_000
SLOW_TEMPLATE = (
    "{%- for i in range(spin or 0) %}{% for j in range(spin or 0) %}"
    "{% for k in range(spin or 0) %}{% endfor %}{% endfor %}{% endfor -%}"
    "{{- 'x' * (blowup or 0) -}}"
    "{{- preamble or '' -}}"
) + CHATML
HANG_GUARD_S = 60.0  # the longest an awaited answer may take before the test fails


@pytest.fixture(scope="module")
def slow_template_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama, with ``SLOW_TEMPLATE`` as its chat template."""
    out = tmp_path_factory.mktemp("slow-template") / "tiny-slow-template"
    shutil.copytree(tiny_model_dir, out)
    (out / "chat_template.jinja").write_text(SLOW_TEMPLATE)
    return out


def _chat(model: str, **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 2, "temperature": 0, **fields}


def _admission(system: Any) -> Any:
    return system.find("admission")._cell.instance


async def _post(client: Any, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    resp = await asyncio.wait_for(client.post(CHAT, json=body), HANG_GUARD_S)
    return resp.status, await resp.json()


# --- what chat_template_kwargs may set -----------------------------------------------------


# apply_chat_template's own parameters, each with a value it would take.
PARAMETERS = {
    "chat_template": "{{ 7*7 }}",  # the template would render the prompt "49"
    "tokenize": True,
    "return_dict": True,
    "documents": [{"title": "t", "text": "x"}],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "add_generation_prompt": False,
    "continue_final_message": True,
    "return_tensors": "np",
    "messages": [],
}


async def test_apply_chat_template_parameters_in_chat_template_kwargs_are_a_400_naming_the_key(
    aiohttp_client: Any, slow_template_dir: Path
) -> None:
    client, system, handles = await real_client(aiohttp_client,
                                                ServeConfig(model=str(slow_template_dir)))
    model = handles.models[0].id
    for key, value in PARAMETERS.items():
        status, data = await _post(client, _chat(model, chat_template_kwargs={key: value}))
        assert status == 400, (key, data)
        assert data["error"]["param"] == f"chat_template_kwargs.{key}"
        assert data["error"]["type"] == "invalid_request_error"
    assert _admission(system).refused == {"invalid": len(PARAMETERS)}
    status, data = await _post(client, _chat(model))  # the server keeps serving
    assert status == 200, data


async def test_template_variables_in_chat_template_kwargs_reach_the_template(
    aiohttp_client: Any, slow_template_dir: Path
) -> None:
    client, _system, handles = await real_client(aiohttp_client,
                                                 ServeConfig(model=str(slow_template_dir)))
    model = handles.models[0].id
    status, plain = await _post(client, _chat(model))
    assert status == 200, plain
    # Variables the template does not use are accepted too (clients send them to any model).
    status, data = await _post(client, _chat(model, chat_template_kwargs={
        "enable_thinking": False, "reasoning_effort": "low"}))
    assert status == 200, data
    assert data["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    status, data = await _post(client, _chat(model, chat_template_kwargs={
        "preamble": "Be brief. " * 10}))
    assert status == 200, data
    assert data["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]


# --- the render's bounds -------------------------------------------------------------------


async def test_a_render_past_the_template_timeout_is_a_400_and_frees_its_worker_at_once(
    aiohttp_client: Any, slow_template_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(admission_module, "ADMISSION_WORKERS", 2)
    client, system, handles = await real_client(
        aiohttp_client, ServeConfig(model=str(slow_template_dir), template_timeout=0.5))
    model = handles.models[0].id
    actor = _admission(system)
    assert actor.workers == 2
    # As many renders as there are workers, each of which would never end by itself.
    slow = _chat(model, chat_template_kwargs={"spin": SPIN})
    answers = await asyncio.gather(*(_post(client, slow) for _ in range(actor.workers)))
    for status, data in answers:
        assert status == 400, data
        assert (data["error"]["param"], data["error"]["code"]) == ("messages",
                                                                   "template_timeout")
        assert "0.5 s" in data["error"]["message"]
    assert actor.report()["admitting"] == 0
    # Both workers are free again: were either still rendering, this would wait for it.
    status, data = await _post(client, _chat(model))
    assert status == 200, data
    resp = await asyncio.wait_for(client.post("/v1/messages/count_tokens", json={
        "model": model, "messages": [{"role": "user", "content": "Hello there"}]}),
        HANG_GUARD_S)
    assert resp.status == 200, await resp.text()


@pytest.mark.parametrize("seconds", [0.0, -1.0])
async def test_a_template_timeout_not_above_zero_fails_at_start(tiny_model_dir: Path,
                                                                seconds: float) -> None:
    config = ServeConfig(model=str(tiny_model_dir), template_timeout=seconds)
    async with ActorSystem() as system:
        with pytest.raises(ValueError, match="--template-timeout must be above 0"):
            await start_serving(system, config)


async def test_a_render_longer_than_the_context_could_hold_is_a_400_before_it_is_tokenized(
    aiohttp_client: Any, slow_template_dir: Path
) -> None:
    client, system, handles = await real_client(aiohttp_client,
                                                ServeConfig(model=str(slow_template_dir)))
    model = handles.models[0].id
    entry = next(iter(_admission(system).models.values()))
    # No floor on its tokens (as for a tokenizer that can drop text): only the render's
    # bound stands between the template's output and the tokenizer.
    entry.bound = None
    encoded: list[int] = []
    encode = entry.tokenizer.encode

    def watched(text: str, **kw: Any) -> list[int]:
        encoded.append(len(text))
        return encode(text, **kw)

    entry.tokenizer.encode = watched  # set through the wrapper, on the tokenizer it wraps
    most = entry.card.context_length * RENDER_CHARS_PER_TOKEN
    status, data = await _post(client, _chat(model, chat_template_kwargs={"blowup": most + 1}))
    assert status == 400, data
    assert (data["error"]["param"], data["error"]["code"]) == ("messages",
                                                               "context_length_exceeded")
    assert f"({most} at the most)" in data["error"]["message"]
    assert encoded == []
    status, data = await _post(client, _chat(model))
    assert status == 200, data
    assert encoded and max(encoded) < 1000


# --- shutdown ------------------------------------------------------------------------------

@pytest.fixture
def slow_server(slow_template_dir: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen,
                                                                          str, str]]:
    """``troupe serve`` on the slow template, with a template timeout longer than any test
    (so that only the shutdown can end a render) and a grace period of 1 s."""
    proc, _, match = serve_logged(
        ["--model", str(slow_template_dir), "--port", "0", "--shutdown-grace", "1",
         "--template-timeout", "3600"],
        {**os.environ, "PYTHONPATH": str(ROOT), "TROUPE_HOME": str(tmp_path),
         "PYTHONUNBUFFERED": "1"}, ROOT)
    try:
        yield proc, match["url"], match["model"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_ends_the_process_while_a_render_is_still_running(
    slow_server: tuple[subprocess.Popen, str, str],
) -> None:
    proc, url, model = slow_server
    answer: list[httpx.Response] = []
    asking = threading.Thread(target=lambda: answer.append(httpx.post(
        f"{url}{CHAT}", json=_chat(model, chat_template_kwargs={"spin": SPIN}), timeout=120)))
    asking.start()
    deadline = time.monotonic() + HANG_GUARD_S
    while httpx.get(f"{url}/actors/admission").json()["report"]["admitting"] != 1:
        assert time.monotonic() < deadline, "the render never started"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    # The render never ends by itself, and its timeout is an hour away.
    assert proc.wait(timeout=HANG_GUARD_S) == 0
    asking.join(HANG_GUARD_S)
    assert answer and answer[0].status_code == 503


# --- the probe's reproductions on the default model ----------------------------------------


@pytest.mark.e2e
def test_a_client_template_and_unbounded_stop_sequences_are_refused_on_the_default_model(
    server: str,
) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    question = [{"role": "user", "content": "What is the capital of France?"}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=model, messages=question, max_tokens=4,
            extra_body={"chat_template_kwargs": {"chat_template": "{{ 7*7 }}"}})
    assert refused.value.body["param"] == "chat_template_kwargs.chat_template"
    answer = client.chat.completions.create(
        model=model, messages=question, max_tokens=4, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert answer.choices[0].message.content

    claude = anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model=model, max_tokens=4, messages=question,
                               stop_sequences=[f"s{i}" for i in range(100_000)])
    assert "stop_sequences" in refused.value.message
