"""Model directories as users download them serve with no flag (issue 31, part 4).

An mlx-community directory splits its weights into shards with an index
(model-00001-of-00002.safetensors, model.safetensors.index.json), keeps its chat template in
chat_template.jinja beside the tokenizer, and carries the maker's sampling in
generation_config.json: each directory here is a tiny model reshaped that way, served through
troupe's own path (resolve, pool, scheduler, admission) and compared with the tiny model it was
made from. A multimodal checkpoint (a ``text_config`` beside a ``vision_config``, a vision tower
among its weights) serves as its text model.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import http_stack
import openai
import pytest
from http_stack import real_client, real_stack
from tiny_model import CHATML, make_tiny_model

from troupe.actors.config import ServeConfig
from troupe.actors.engine.memory_estimate import model_memory_of
from troupe.actors.engine.prefix import model_fingerprint
from troupe.actors.messages import (
    DEFAULTABLE,
    AdmitChat,
    AdmitCompletion,
    SamplingDefaults,
    SamplingParams,
)
from troupe.actors.models.generation_config import sampling_defaults
from troupe.actors.models.store import resolve_model
from troupe.actors.prompts import with_model_defaults

scripted, client = http_stack.scripted, http_stack.client

PREAMBLE = "You are tiny.\n"
# The directory's own template: ChatML after a fixed line, so its prompts are known exactly.
PREAMBLE_TEMPLATE = "{{- '" + PREAMBLE.replace("\n", "\\n") + "' -}}" + CHATML
# The maker's sampling: greedy by default, so a silent request's answer is the greedy one.
GENERATION = {"temperature": 0.0, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
              "do_sample": True, "eos_token_id": 2, "max_new_tokens": 5}
PROMPTS = ["The quick brown fox", "def add(a, b):"]


def mlx_community_layout(base: Path, out: Path, *, template: str,
                         generation: dict[str, Any]) -> Path:
    """``base`` (a tiny model directory) laid out as mlx-community publishes a model: its
    weights in two shards with an index, ``template`` only in chat_template.jinja, and
    ``generation`` as its generation_config.json."""
    import mlx.core as mx

    shutil.copytree(base, out)
    weights = mx.load(str(out / "model.safetensors"))
    (out / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, keys in shards.items():
        mx.save_safetensors(str(out / shard), {k: weights[k] for k in keys},
                            metadata={"format": "mlx"})
    index = {"metadata": {"total_size": sum(w.nbytes for w in weights.values())},
             "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (out / "chat_template.jinja").write_text(template)
    (out / "generation_config.json").write_text(json.dumps(generation))
    return out


def multimodal_layout(base: Path, out: Path, model_type: str) -> Path:
    """``base``'s text model as the language model of a multimodal checkpoint of
    ``model_type`` (as mlx-vlm converts one): a ``vision_config``, and a vision tower and
    projector among the weights, under the names that model's mlx-lm ``sanitize`` drops."""
    import mlx.core as mx

    shutil.copytree(base, out)
    text = json.loads((out / "config.json").read_text())
    weights = mx.load(str(out / "model.safetensors"))
    config: dict[str, Any] = {"model_type": model_type, "vision_config": {"hidden_size": 8},
                              "architectures": ["ForConditionalGeneration"]}
    if model_type == "qwen2_5_vl":
        # Its text settings at the top level, its tower under "visual".
        config |= {k: v for k, v in text.items() if k != "model_type"}
        weights["visual.blocks.0.attn.qkv.weight"] = mx.ones((8, 8))
    else:
        config |= {"text_config": text, "vocab_size": text["vocab_size"]}
        weights = {f"language_model.{k}": v for k, v in weights.items()}
        weights["vision_tower.vision_model.embeddings.patch_embedding.weight"] = mx.ones(
            (8, 3, 2, 2))
        weights["multi_modal_projector.linear_1.weight"] = mx.ones((8, 8))
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def community_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return mlx_community_layout(tiny_model_dir, tmp_path_factory.mktemp("community") / "tiny",
                                template=PREAMBLE_TEMPLATE, generation=GENERATION)


def _serve(model_dir: Path, tmp_path: Path) -> ServeConfig:
    """Settings serving ``model_dir`` beside another server in the same test (each server
    takes its cache directory's lock)."""
    return ServeConfig(model=str(model_dir), cache_dir=str(tmp_path / model_dir.name))


async def _greedy_completions(client: Any, model: str, **fields: Any) -> list[str]:
    """Each of PROMPTS' answers on /v1/completions."""
    answers = []
    for prompt in PROMPTS:
        resp = await client.post("/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": 8, **fields})
        data = await resp.json()
        assert resp.status == 200, data
        answers.append(data["choices"][0]["text"])
    return answers


# --- sharded weights and chat_template.jinja -------------------------------------------------


def test_every_shard_counts_in_the_model_fingerprint(community_dir: Path,
                                                     tmp_path: Path) -> None:
    resolved = resolve_model(str(community_dir))
    assert (resolved.source, resolved.path) == ("directory", community_dir.resolve())
    changed = shutil.copytree(community_dir, tmp_path / "changed")
    with open(changed / "model-00002-of-00002.safetensors", "ab") as f:
        f.write(b"\0" * 8)
    assert model_fingerprint(changed) != model_fingerprint(community_dir)


def test_memory_estimate_counts_only_the_weight_files_mlx_lm_loads(community_dir: Path,
                                                                   tmp_path: Path) -> None:
    cloned = shutil.copytree(community_dir, tmp_path / "cloned")
    # A repo cloned whole: the same weights again in the file Mistral's own tools read.
    shutil.copy(cloned / "model-00001-of-00002.safetensors", cloned / "consolidated.safetensors")
    memory = model_memory_of(cloned)
    assert memory == model_memory_of(community_dir)
    assert memory.weights_bytes == sum(f.stat().st_size for f in community_dir.glob("model-*"))


async def test_mlx_community_directory_answers_as_the_model_it_was_made_from(
    aiohttp_client: Any, tiny_model_dir: Path, community_dir: Path, tmp_path: Path
) -> None:
    base, _, base_handles = await real_client(aiohttp_client, _serve(tiny_model_dir, tmp_path))
    expected = await _greedy_completions(base, base_handles.models[0].id, temperature=0)
    assert expected[0] != expected[1]  # the prompts tell the answers apart
    community, _, handles = await real_client(aiohttp_client,
                                              ServeConfig(model=str(community_dir)))
    # Silent on temperature: its generation_config's 0 makes it greedy too.
    assert await _greedy_completions(community, handles.models[0].id) == expected


async def test_chat_template_jinja_is_the_template_chats_are_rendered_with(
    aiohttp_client: Any, community_dir: Path
) -> None:
    from mlx_lm.utils import load_tokenizer

    client, _, handles = await real_client(aiohttp_client, ServeConfig(model=str(community_dir)))
    resp = await client.post("/v1/chat/completions", json={
        "model": handles.models[0].id, "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 1})
    data = await resp.json()
    assert resp.status == 200, data
    rendered = PREAMBLE + "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    tokenizer = load_tokenizer(community_dir)
    assert data["usage"]["prompt_tokens"] == len(
        tokenizer.encode(rendered, add_special_tokens=False))


# --- generation_config.json: the request's defaults ----------------------------------------


def test_generation_config_sampling_keys_become_the_model_defaults(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05,
         "repetition_penalty": 1.05, "do_sample": True, "eos_token_id": [1, 2]}))
    assert sampling_defaults(tmp_path) == SamplingDefaults(
        temperature=0.7, top_p=0.8, top_k=20, min_p=0.05, repetition_penalty=1.05)


def test_a_bad_generation_config_value_is_skipped_and_the_others_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 1.5, "top_k": "many", "repetition_penalty": None}))
    with caplog.at_level(logging.WARNING):
        defaults = sampling_defaults(tmp_path)
    assert defaults == SamplingDefaults(temperature=0.6)
    assert "top_p" in caplog.text and "top_k" in caplog.text


@pytest.mark.parametrize("content", [None, "{not json", "[0.7]"],
                         ids=["missing", "malformed", "not-an-object"])
def test_no_readable_generation_config_means_no_model_defaults(
    tmp_path: Path, content: str | None
) -> None:
    if content is not None:
        (tmp_path / "generation_config.json").write_text(content)
    assert sampling_defaults(tmp_path) == SamplingDefaults()


def test_model_defaults_fill_only_the_fields_a_request_left_unset() -> None:
    defaults = SamplingDefaults(temperature=0.7, top_p=0.8, repetition_penalty=1.05)
    sent = SamplingParams(max_tokens=9, temperature=0.2)
    unset = tuple(name for name in DEFAULTABLE if name != "temperature")
    filled = with_model_defaults(sent, unset, defaults)
    assert filled == SamplingParams(max_tokens=9, temperature=0.2, top_p=0.8,
                                    repetition_penalty=1.05)
    assert with_model_defaults(sent, (), defaults) == sent


# What each route sends of a silent request, and of one that sets every sampling field it has.
ROUTES = [
    pytest.param("/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "hi"}]},
                 {"temperature": 0.3, "top_p": 0.5, "top_k": 4, "min_p": 0.1,
                  "repetition_penalty": 1.2}, id="chat"),
    pytest.param("/v1/completions", {"prompt": "hi"},
                 {"temperature": 0.3, "top_p": 0.5, "top_k": 4, "min_p": 0.1,
                  "repetition_penalty": 1.2}, id="completions"),
    pytest.param("/v1/messages",
                 {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
                 {"temperature": 0.3, "top_p": 0.5, "top_k": 4}, id="anthropic"),
    pytest.param("/v1/responses", {"input": "hi"}, {"temperature": 0.3, "top_p": 0.5},
                 id="responses"),
]


@pytest.mark.parametrize(("path", "body", "sampling"), ROUTES)
async def test_each_route_leaves_what_the_request_did_not_set_to_the_model(
    client: Any, scripted: Any, path: str, body: dict[str, Any], sampling: dict[str, Any]
) -> None:
    for fields in ({}, sampling):
        resp = await client.post(path, json={"model": http_stack.MODEL, **body, **fields})
        assert resp.status == 200, await resp.text()
        msg = scripted.seen[-1]
        assert isinstance(msg, AdmitChat | AdmitCompletion)
        assert msg.unset == tuple(name for name in DEFAULTABLE if name not in fields)
        for name, value in fields.items():
            assert getattr(msg.sampling, name) == value


async def test_admission_gives_the_engine_the_model_defaults_where_the_request_is_silent(
    aiohttp_client: Any, community_dir: Path
) -> None:
    _, _, handles = await real_client(aiohttp_client, ServeConfig(model=str(community_dir)))
    model = handles.models[0].id
    chat = {"request_id": "c", "model": model, "messages": [{"role": "user", "content": "hi"}]}
    silent = AdmitChat(**chat, sampling=SamplingParams(max_tokens=2), unset=DEFAULTABLE)
    own = AdmitCompletion(request_id="t", model=model, prompt="hi",
                          sampling=SamplingParams(max_tokens=2, temperature=0.5, top_k=3),
                          unset=("top_p", "min_p", "repetition_penalty"))
    sampled = []
    for msg in (silent, own):
        ticket = await handles.admission.ask(msg)
        async for _event in ticket.events:
            pass
        sampled.append(ticket.admitted.sampling)
    assert sampled == [
        SamplingParams(max_tokens=2, temperature=0.0, top_p=0.9, top_k=20, min_p=0.05),
        SamplingParams(max_tokens=2, temperature=0.5, top_p=0.9, top_k=3, min_p=0.05),
    ]


async def test_a_request_temperature_wins_over_the_model_default(
    aiohttp_client: Any, community_dir: Path
) -> None:
    client, _, handles = await real_client(aiohttp_client, ServeConfig(model=str(community_dir)))
    model = handles.models[0].id
    greedy = await _greedy_completions(client, model)
    assert greedy == await _greedy_completions(client, model, seed=7)  # the default: greedy
    assert greedy != await _greedy_completions(client, model, seed=7, temperature=1.0)


async def test_models_list_and_responses_echo_show_the_model_defaults(
    aiohttp_client: Any, community_dir: Path
) -> None:
    client, _, handles = await real_client(aiohttp_client, ServeConfig(model=str(community_dir)))
    model = handles.models[0].id
    listed = (await (await client.get("/v1/models")).json())["data"][0]
    assert listed["sampling_defaults"] == {"temperature": 0.0, "top_p": 0.9, "top_k": 20,
                                           "min_p": 0.05}
    for fields, echoed in (({}, (0.0, 0.9)), ({"temperature": 0.4}, (0.4, 0.9))):
        resp = await client.post("/v1/responses", json={
            "model": model, "input": "hi", "max_output_tokens": 2, **fields})
        data = await resp.json()
        assert resp.status == 200, data
        assert (data["temperature"], data["top_p"]) == echoed


async def test_official_clients_silent_on_sampling_get_the_model_defaults(
    community_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TROUPE_HOME", str(tmp_path))
    messages = [{"role": "user", "content": "The quick brown fox"}]
    async with real_stack(community_dir) as stack:
        oai = openai.AsyncOpenAI(base_url=f"{stack.server.url}/v1", api_key="x", max_retries=0)
        ant = anthropic.AsyncAnthropic(base_url=stack.server.url, api_key="x", max_retries=0)
        try:
            greedy = await oai.chat.completions.create(
                model=stack.model, messages=messages, max_tokens=12, temperature=0)
            silent = await oai.chat.completions.create(
                model=stack.model, messages=messages, max_tokens=12)
            assert silent.choices[0].message.content == greedy.choices[0].message.content
            message = await ant.messages.create(model=stack.model, messages=messages,
                                                max_tokens=12)
            assert message.content[0].text == greedy.choices[0].message.content
            response = await oai.responses.create(model=stack.model, input="hi",
                                                  max_output_tokens=4)
            assert (response.temperature, response.top_p) == (0.0, 0.9)
        finally:
            await oai.close()
            await ant.close()


async def test_models_list_has_no_sampling_defaults_for_a_model_without_any(
    client: Any,
) -> None:
    listed = (await (await client.get("/v1/models")).json())["data"][0]
    assert "sampling_defaults" not in listed


# --- multimodal checkpoints: the text model serves -------------------------------------------


@pytest.fixture(scope="module", params=["gemma3", "mistral3", "qwen2_5_vl"])
def multimodal(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """(a text model, the multimodal checkpoint made around it)."""
    arch = {"gemma3": "gemma3_text", "mistral3": "llama", "qwen2_5_vl": "qwen2"}[request.param]
    root = tmp_path_factory.mktemp(request.param)
    text = make_tiny_model(root / "text", arch=arch)
    yield text, multimodal_layout(text, root / request.param, request.param)


async def test_multimodal_checkpoint_serves_its_text_model(
    aiohttp_client: Any, multimodal: tuple[Path, Path], tmp_path: Path
) -> None:
    text_dir, checkpoint = multimodal
    text, _, text_handles = await real_client(aiohttp_client, _serve(text_dir, tmp_path))
    expected = await _greedy_completions(text, text_handles.models[0].id, temperature=0)
    assert expected[0] != expected[1]
    served, _, handles = await real_client(aiohttp_client, ServeConfig(model=str(checkpoint)))
    card = handles.models[0]
    assert card.context_length == text_handles.models[0].context_length  # from text_config
    assert await _greedy_completions(served, card.id, temperature=0) == expected
