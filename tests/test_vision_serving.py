"""Images over HTTP (issue 34): the three APIs with the official clients, served in-process by
a tiny random-weight Gemma 3 vision-language checkpoint (tests/tiny_vlm.py), and OpenAI's
chat by a tiny Qwen2.5-VL, Qwen3-VL and Qwen3.5 (M-RoPE). Each answer is checked against
mlx-vlm's own generation of the same prompt and image; the same image sent again is a
prefix-cache hit with the same answer; a text-only model refuses images."""

from __future__ import annotations

import base64
import io
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import mlx_lm
import ollama
import openai
import pytest
from http_stack import RealStack, real_client_with_room, real_stack
from test_vision import QUESTION, chat, picture, reference
from tiny_vlm import (
    make_tiny_gemma3_vlm,
    make_tiny_mistral3,
    make_tiny_qwen2_5_vl,
    make_tiny_qwen3_5,
    make_tiny_qwen3_vl,
)

from troupe.actors.config import ServeConfig
from troupe.actors.engine.memory_estimate import tower_transient
from troupe.actors.engine.vision import VisionTower
from troupe.actors.engine.vision_prompt import image_token, load_processor, with_images
from troupe.actors.tool_prompt import with_tools_in_prompt

MB = 1 << 20

mlx_vlm = pytest.importorskip("mlx_vlm")  # the vision extra; `make setup` installs it


def loaded(model_dir: Path) -> tuple:
    """A checkpoint as tests/test_vision.py's helpers take it, mlx-vlm's own model beside."""
    model, tok = mlx_lm.load(str(model_dir))
    reference_model, _ = mlx_vlm.load(str(model_dir))
    return (model_dir, model, tok, VisionTower(model_dir, model), load_processor(model_dir),
            reference_model)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return loaded(make_tiny_gemma3_vlm(tmp_path_factory.mktemp("gemma3-vlm") / "gemma3-vlm"))


@pytest.fixture(scope="module", params=["mistral3", "qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def family_vlm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    make = {"mistral3": make_tiny_mistral3, "qwen2_5_vl": make_tiny_qwen2_5_vl,
            "qwen3_vl": make_tiny_qwen3_vl, "qwen3_5": make_tiny_qwen3_5}[request.param]
    return loaded(make(tmp_path_factory.mktemp(request.param) / request.param))


@pytest.fixture
async def stack(vlm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                ) -> AsyncIterator[RealStack]:
    monkeypatch.setenv("TROUPE_HOME", str(tmp_path))
    async with real_stack(vlm[0]) as s:
        yield s


def png(seed: int) -> str:
    out = io.BytesIO()
    picture(seed).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


def expected(vlm: Any, seed: int, max_tokens: int = 8) -> str:
    """mlx-vlm's greedy answer to QUESTION about picture ``seed``, up to its end token."""
    tok = vlm[2]
    tokens = reference(vlm, [picture(seed)], max_tokens=max_tokens)
    eos = set(tok.eos_token_ids)
    cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    # The answer as the server's output parser sends it: leading whitespace dropped.
    return tok.decode(tokens[:cut]).lstrip()


def image_start(vlm: Any) -> int:
    """Where the image's tokens start in QUESTION's prompt."""
    model_dir, _, tok, _, processor, _ = vlm
    text = tok.apply_chat_template(chat(1), tokenize=False, add_generation_prompt=True)
    ids, _ = with_images(processor, image_token(model_dir), text, [picture(0)])
    return next(i for i, t in enumerate(ids) if t < 0)


def openai_chat(seed: int) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png(seed)}"}},
        {"type": "text", "text": QUESTION}]}]


async def test_openai_chat_reads_the_image_as_mlx_vlm_does(stack: RealStack, vlm: Any) -> None:
    oai = openai.AsyncOpenAI(base_url=f"{stack.server.url}/v1", api_key="x", max_retries=0)
    try:
        answers = []
        for seed in (0, 1):
            got = await oai.chat.completions.create(model=stack.model, max_tokens=8,
                                                    temperature=0, messages=openai_chat(seed))
            answers.append(got.choices[0].message.content)
        chunks = await oai.chat.completions.create(model=stack.model, max_tokens=8,
                                                   temperature=0, messages=openai_chat(0),
                                                   stream=True)
        streamed = "".join([c.choices[0].delta.content or "" async for c in chunks
                            if c.choices])
    finally:
        await oai.close()
    assert answers == [expected(vlm, 0), expected(vlm, 1)]
    assert answers[0] != answers[1]
    assert streamed == answers[0]


async def test_the_same_image_again_is_a_cache_hit_with_the_same_answer(stack: RealStack,
                                                                         vlm: Any) -> None:
    oai = openai.AsyncOpenAI(base_url=f"{stack.server.url}/v1", api_key="x", max_retries=0)
    try:
        first = await oai.chat.completions.create(model=stack.model, max_tokens=8,
                                                  temperature=0, messages=openai_chat(2))
        again = await oai.chat.completions.create(model=stack.model, max_tokens=8,
                                                  temperature=0, messages=openai_chat(2))
        other = await oai.chat.completions.create(model=stack.model, max_tokens=8,
                                                  temperature=0, messages=openai_chat(3))
    finally:
        await oai.close()
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert again.choices[0].message.content == first.choices[0].message.content
    # Every whole block is a hit (the image's tokens are the prompt's first 32).
    assert 32 <= cached and cached >= first.usage.prompt_tokens // 2
    # Another image shares only what comes before it (the turn's opening tokens).
    assert (other.usage.prompt_tokens_details.cached_tokens or 0) <= image_start(vlm)
    assert other.choices[0].message.content == expected(vlm, 3)


async def test_anthropic_messages_read_the_image(stack: RealStack, vlm: Any) -> None:
    client = anthropic.AsyncAnthropic(base_url=stack.server.url, api_key="x", max_retries=0)
    try:
        got = await client.messages.create(
            model=stack.model, max_tokens=8, extra_body={"temperature": 0},
            messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": png(1)}},
                {"type": "text", "text": QUESTION}]}])
    finally:
        await client.close()
    assert "".join(b.text for b in got.content if b.type == "text") == expected(vlm, 1)


async def test_responses_input_image_reads_the_image(stack: RealStack, vlm: Any) -> None:
    async with httpx.AsyncClient(base_url=stack.server.url, timeout=60) as http:
        resp = await http.post("/v1/responses", json={
            "model": stack.model, "max_output_tokens": 8, "temperature": 0,
            "input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": f"data:image/png;base64,{png(0)}"},
                {"type": "input_text", "text": QUESTION}]}]})
    assert resp.status_code == 200, resp.text
    text = "".join(part["text"] for item in resp.json()["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")
    assert text == expected(vlm, 0)


async def test_an_undecodable_image_is_a_400_and_the_server_keeps_serving(
        stack: RealStack, vlm: Any) -> None:
    async with httpx.AsyncClient(base_url=stack.server.url, timeout=60) as http:
        resp = await http.post("/v1/chat/completions", json={
            "model": stack.model, "max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {
                    "url": "data:image/png;base64," + base64.b64encode(b"not a png").decode()}},
                {"type": "text", "text": "hi"}]}]})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "messages[0].content[0].image_url"
        ok = await http.post("/v1/chat/completions", json={
            "model": stack.model, "max_tokens": 8, "temperature": 0,
            "messages": openai_chat(0)})
    assert ok.status_code == 200
    assert ok.json()["choices"][0]["message"]["content"] == expected(vlm, 0)


async def test_each_family_reads_images_as_mlx_vlm_does_and_from_the_cache(
        family_vlm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TROUPE_HOME", str(tmp_path))
    async with real_stack(family_vlm[0]) as s:
        oai = openai.AsyncOpenAI(base_url=f"{s.server.url}/v1", api_key="x", max_retries=0)
        olla = ollama.AsyncClient(host=s.server.url)
        try:
            got = [await oai.chat.completions.create(model=s.model, max_tokens=8, temperature=0,
                                                     messages=openai_chat(seed))
                   for seed in (0, 1, 0)]
            # Ollama's client: the image as its base64, the same answer; the model says it
            # reads images.
            through_ollama = await olla.chat(model=s.model, options={
                "temperature": 0, "num_predict": 8}, messages=[
                    {"role": "user", "content": QUESTION, "images": [png(1)]}])
            capabilities = (await olla.show(s.model)).capabilities
        finally:
            await oai.close()
    assert through_ollama.message.content == expected(family_vlm, 1)
    assert capabilities is not None and "vision" in capabilities
    answers = [g.choices[0].message.content for g in got]
    assert answers[:2] == [expected(family_vlm, 0), expected(family_vlm, 1)]
    assert answers[0] != answers[1]
    # The same image again: a hit past the image (the Qwen models' M-RoPE positions come with
    # the prefix).
    assert answers[2] == answers[0]
    assert got[2].usage.prompt_tokens_details.cached_tokens > image_start(family_vlm)


async def test_a_text_only_model_refuses_images_with_a_400(tiny_model_dir: Path,
                                                           tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    monkeypatch.setenv("TROUPE_HOME", str(tmp_path))
    async with real_stack(tiny_model_dir) as s, \
            httpx.AsyncClient(base_url=s.server.url, timeout=60) as http:
        resp = await http.post("/v1/chat/completions", json={
            "model": s.model, "max_tokens": 4, "messages": openai_chat(0)})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert "does not read images" in error["message"] and "text-only" in error["message"]
        assert error["param"] == "messages[0].content[0].image_url"
        ok = await http.post("/v1/chat/completions", json={
            "model": s.model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200


def test_the_tower_transient_of_gemma3s_siglip_counts_its_attention() -> None:
    # Gemma 3's tower: 896 pixels a side in patches of 14 (4,096), 16 heads, 27 layers.
    siglip = {"hidden_size": 1152, "intermediate_size": 4304, "num_attention_heads": 16,
              "patch_size": 14, "image_size": 896}
    need = tower_transient(siglip, (3, 896, 896), 4)
    assert need >= 16 * 4096 * 4096 * 4  # one layer's scores, at least once
    assert tower_transient(siglip, (3, 448, 448), 4) < need / 4  # a quarter of the patches


async def test_an_image_whose_tower_would_pass_the_memory_limit_is_a_413(
        aiohttp_client: Any, tmp_path: Path) -> None:
    # Patches of 2 pixels on a 256-pixel image: 16,384 patches, about 1 GB of tower
    # attention scores; the limit leaves 200 MB above what is in use.
    model_dir = make_tiny_gemma3_vlm(tmp_path / "big-tower", image_size=256, patch=2)
    config = ServeConfig.of(model=str(model_dir), cache_dir=str(tmp_path / "cache"))
    client, handles = await real_client_with_room(aiohttp_client, config, 200 * MB)
    refused = await client.post("/v1/chat/completions", json={
        "model": handles.models[0].id, "max_tokens": 4, "messages": openai_chat(0)})
    error = (await refused.json())["error"]
    assert refused.status == 413 and error["code"] == "memory_limit_exceeded", error
    served = await client.post("/v1/chat/completions", json={
        "model": handles.models[0].id, "max_tokens": 4,
        "messages": [{"role": "user", "content": QUESTION}]})
    assert served.status == 200


def test_tool_results_with_images_keep_them_in_place_when_tools_are_written_in() -> None:
    image = {"type": "image", "image": {"data": "x", "media_type": None, "param": "p"}}
    messages = [
        {"role": "user", "content": "look at the screen"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "shot", "arguments": "{}"}},
            {"id": "2", "type": "function", "function": {"name": "shot", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "one"},
                                                          image]},
        {"role": "tool", "tool_call_id": "2", "content": "two"}]
    tools = [{"type": "function", "function": {"name": "shot", "parameters": {}}}]
    out = with_tools_in_prompt(messages, tools)
    turn = out[-1]
    assert turn["role"] == "user" and isinstance(turn["content"], list)
    assert turn["content"].count(image) == 1
    text = "".join(p.get("text", "[image]") for p in turn["content"])
    assert text == ("<tool_response>\none[image]\n</tool_response>\n"
                    "<tool_response>\ntwo\n</tool_response>")


async def test_an_image_in_a_tool_result_is_read(stack: RealStack) -> None:
    """Agents send screenshots back as tool results: with tools written into the prompt (the
    tiny model's template has no tool format), each image still reaches the model: two
    screenshots answer differently (compared as the answers' bytes: a random model's tokens
    are often parts of characters)."""
    oai = openai.AsyncOpenAI(base_url=f"{stack.server.url}/v1", api_key="x", max_retries=0)
    tools = [{"type": "function", "function": {"name": "screenshot", "parameters": {
        "type": "object", "properties": {}}}}]
    answers, usage = [], []
    try:
        for seed in (0, 1):
            got = await oai.chat.completions.create(
                model=stack.model, max_tokens=8, temperature=0, tools=tools, logprobs=True,
                messages=[
                    {"role": "user", "content": "What is on my screen?"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "t1", "type": "function",
                         "function": {"name": "screenshot", "arguments": "{}"}}]},
                    {"role": "tool", "tool_call_id": "t1", "content": [
                        {"type": "image_url",
                         "image_url": {"url": f"data:image/png;base64,{png(seed)}"}}]}])
            answers.append([t.bytes for t in got.choices[0].logprobs.content])
            usage.append(got.usage.prompt_tokens)
    finally:
        await oai.close()
    assert answers[0] != answers[1]
    assert usage[0] == usage[1] > 16  # the image's 16 tokens are in the prompt
