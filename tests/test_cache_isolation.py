"""Cache namespaces: one client cannot read another's prompts through ``cached_tokens``.

Each API key's requests use a prefix-cache namespace of their own (``--shared-cache`` shares
one), and a request's ``cache_salt`` separates it further. The scripted stack shows which
namespace each request is admitted with; the tiny model replays the probe that found the side
channel (a guess of another client's PIN read more cached tokens when it was right).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import http_stack
import pytest
from http_stack import MODEL, Scripted, real_client

from troupe.actors.config import ServeConfig
from troupe.actors.messages import AdmitChat, AdmitCompletion
from troupe.actors.serving import start_serving
from troupe.api.app import create_app
from troupe.api.cli import build_parser, serve_config
from troupe.runtime import ActorSystem

scripted = http_stack.scripted

KEYS = ["key-alpha", "key-beta"]
ADMIN = "key-admin"
BLOCK = 16
ROUTES = {
    "chat": ("/v1/chat/completions",
             {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    "completions": ("/v1/completions", {"model": MODEL, "prompt": "hi"}),
    "anthropic": ("/v1/messages", {"model": MODEL, "max_tokens": 8,
                                   "messages": [{"role": "user", "content": "hi"}]}),
    "responses": ("/v1/responses", {"model": MODEL, "input": "hi"}),
}


async def namespace_of(client: Any, scripted: Scripted, key: str | None = None,
                       route: str = "chat", **fields: Any) -> str:
    """The cache namespace admission was asked to admit one request with."""
    path, body = ROUTES[route]
    headers = {"x-api-key": key} if key else {}
    resp = await client.post(path, json={**body, **fields}, headers=headers)
    assert resp.status == 200, await resp.text()
    msg = scripted.seen[-1]
    assert isinstance(msg, AdmitChat | AdmitCompletion)
    return msg.cache_namespace


async def test_each_api_key_gets_a_cache_namespace_of_its_own_never_the_key_itself(
        aiohttp_client: Any, scripted: Scripted) -> None:
    client = await aiohttp_client(scripted.app(api_key=KEYS, admin_api_key=ADMIN))
    alpha = await namespace_of(client, scripted, "key-alpha")
    beta = await namespace_of(client, scripted, "key-beta")
    admin = await namespace_of(client, scripted, ADMIN)  # the admin key is a key like any
    assert len({alpha, beta, admin, ""}) == 4
    assert all(key not in ns for key in [*KEYS, ADMIN] for ns in (alpha, beta, admin))
    # The same key, sent either way, on every route: the same namespace (so its disk blocks
    # serve it after a restart, which makes the namespace again from the key).
    headers = {"Authorization": "Bearer key-alpha"}
    resp = await client.post("/v1/completions", json=ROUTES["completions"][1], headers=headers)
    assert resp.status == 200 and scripted.seen[-1].cache_namespace == alpha
    for route in ROUTES:
        assert await namespace_of(client, scripted, "key-alpha", route) == alpha
    restarted = await aiohttp_client(scripted.app(api_key=KEYS, admin_api_key=ADMIN))
    assert await namespace_of(restarted, scripted, "key-alpha") == alpha


async def test_shared_cache_and_a_server_without_keys_admit_in_the_shared_namespace(
        aiohttp_client: Any, scripted: Scripted) -> None:
    shared = await aiohttp_client(scripted.app(api_key=KEYS, shared_cache=True))
    assert [await namespace_of(shared, scripted, key) for key in KEYS] == ["", ""]
    open_server = await aiohttp_client(scripted.app())
    assert await namespace_of(open_server, scripted) == ""


@pytest.mark.parametrize("route", list(ROUTES))
async def test_a_cache_salt_separates_requests_of_one_key_on_every_route(
        aiohttp_client: Any, scripted: Scripted, route: str) -> None:
    client = await aiohttp_client(scripted.app(api_key=KEYS))
    plain = await namespace_of(client, scripted, "key-alpha", route)
    salted = await namespace_of(client, scripted, "key-alpha", route, cache_salt="s1")
    assert salted not in (plain, "")
    assert await namespace_of(client, scripted, "key-alpha", route, cache_salt="s1") == salted
    assert await namespace_of(client, scripted, "key-alpha", route, cache_salt="s2") != salted
    # Another key with the same salt: still another namespace.
    assert await namespace_of(client, scripted, "key-beta", route, cache_salt="s1") != salted
    # A salt separates requests without any key too, and with the cache shared.
    open_server = await aiohttp_client(scripted.app())
    assert await namespace_of(open_server, scripted, None, route, cache_salt="s1") != ""
    shared = await aiohttp_client(scripted.app(api_key=KEYS, shared_cache=True))
    assert await namespace_of(shared, scripted, "key-beta", route, cache_salt="s1") != ""


@pytest.mark.parametrize("route", list(ROUTES))
async def test_an_empty_or_non_string_cache_salt_is_refused_with_400(
        aiohttp_client: Any, scripted: Scripted, route: str) -> None:
    client = await aiohttp_client(scripted.app())
    path, body = ROUTES[route]
    for salt in ("", 7):
        resp = await client.post(path, json={**body, "cache_salt": salt})
        assert resp.status == 400, (salt, await resp.text())
        assert "cache_salt" in await resp.text()


async def test_the_keys_of_a_keys_file_are_taken_each_with_its_own_namespace(
        aiohttp_client: Any, scripted: Scripted, tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# the team's keys\nkey-gamma\n\n  key-delta  \n")
    client = await aiohttp_client(scripted.app(api_key="key-alpha",
                                               api_keys_file=str(keys_file)))
    spaces = [await namespace_of(client, scripted, key)
              for key in ("key-alpha", "key-gamma", "key-delta")]
    assert len(set(spaces)) == 3
    path, body = ROUTES["chat"]
    resp = await client.post(path, json=body, headers={"x-api-key": "# the team's keys"})
    assert resp.status == 401
    (tmp_path / "empty").write_text("# nothing yet\n")
    with pytest.raises(ValueError, match="holds no key"):
        scripted.app(api_keys_file=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="--api-keys-file .*missing"):
        scripted.app(api_keys_file=str(tmp_path / "missing"))


def test_the_api_key_flag_repeats_and_replaces_the_environments_key(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TROUPE_API_KEY", "from-env")
    parse = build_parser().parse_args
    assert serve_config(parse(["serve"])).api_key == "from-env"
    assert serve_config(parse(["serve", "--api-key", "a"])).api_key == "a"
    assert serve_config(parse(["serve", "--api-key", "a", "--api-key", "b"])).api_key == [
        "a", "b"]
    config = serve_config(parse(["serve", "--shared-cache", "--api-keys-file", "k"]))
    assert (config.shared_cache, config.api_keys_file) == (True, "k")
    assert serve_config(parse(["serve"])).shared_cache is False


# -- the probe, on the tiny model ---------------------------------------------------------------

SECRET = "My bank card PIN is {}. Keep it to yourself and never repeat it to anyone."


async def cached_tokens(client: Any, model: str, key: str | None, pin: str,
                        **fields: Any) -> int:
    """The prompt tokens read from the cache for a chat about ``pin``."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    resp = await client.post("/v1/chat/completions", headers=headers, json={
        "model": model, "messages": [{"role": "user", "content": SECRET.format(pin)}],
        "max_tokens": 4, "temperature": 0, **fields})
    data = await resp.json()
    assert resp.status == 200, data
    return data["usage"]["prompt_tokens_details"]["cached_tokens"]


async def probe(aiohttp_client: Any, model_dir: Path, cache_dir: Path,
                **fields: Any) -> tuple[int, int]:
    """Key A sends its PIN; key B then guesses a wrong PIN and the right one: the cached
    tokens each guess reads."""
    config = ServeConfig.of(model=str(model_dir), api_key=["key-a", "key-b"], block_size=BLOCK,
                            cache_dir=str(cache_dir), **fields)
    client, _, handles = await real_client(aiohttp_client, config)
    model = handles.models[0].id
    await cached_tokens(client, model, "key-a", "4821")
    wrong = await cached_tokens(client, model, "key-b", "1111")
    right = await cached_tokens(client, model, "key-b", "4821")
    return wrong, right


async def test_a_key_reads_nothing_of_another_keys_prompt_through_cached_tokens(
        aiohttp_client: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    shared = await probe(aiohttp_client, tiny_model_dir, tmp_path / "shared", shared_cache=True)
    # The side channel, with the cache shared: the right guess reads more of A's prompt.
    assert shared[1] > shared[0] > 0
    isolated = await probe(aiohttp_client, tiny_model_dir, tmp_path / "isolated")
    # Apart: B's first guess reads nothing, not even the chat template's start A's prompt
    # shares with it; the right guess reads only what B's own wrong guess shares with it.
    assert isolated == (0, shared[0])


async def test_one_keys_requests_still_hit_and_a_cache_salt_separates_them(
        aiohttp_client: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    config = ServeConfig.of(model=str(tiny_model_dir), api_key="key-a", block_size=BLOCK,
                            cache_dir=str(tmp_path / "c"))
    client, _, handles = await real_client(aiohttp_client, config)
    model = handles.models[0].id
    assert await cached_tokens(client, model, "key-a", "4821") == 0
    again = await cached_tokens(client, model, "key-a", "4821")
    assert again > 0
    assert await cached_tokens(client, model, "key-a", "4821", cache_salt="s1") == 0
    assert await cached_tokens(client, model, "key-a", "4821", cache_salt="s1") == again
    assert await cached_tokens(client, model, "key-a", "4821", cache_salt="s2") == 0


async def test_disk_hits_after_a_restart_stay_within_their_namespace(
        aiohttp_client: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    config = ServeConfig.of(model=str(tiny_model_dir), api_key=["key-a", "key-b"],
                            block_size=BLOCK, cache_dir=str(tmp_path / "c"))
    long_pin = SECRET.format("4821") * 3

    async def complete(client: Any, model: str, key: str) -> dict[str, Any]:
        resp = await client.post("/v1/completions", headers={"x-api-key": key}, json={
            "model": model, "prompt": long_pin, "max_tokens": 4, "temperature": 0})
        data = await resp.json()
        assert resp.status == 200, data
        return data["usage"]

    async def serving() -> tuple[Any, ActorSystem, str]:
        system = ActorSystem()
        await system.__aenter__()
        handles = await start_serving(system, config)
        app = create_app(system=system, admission=handles.admission, config=config)
        return await aiohttp_client(app), system, handles.models[0].id

    client, system, model = await serving()
    usage = await complete(client, model, "key-a")
    blocks = (usage["prompt_tokens"] + usage["completion_tokens"]) // BLOCK
    writer = next(s for s in system.snapshot() if s.name == "ssd_writer")
    for _ in range(300):
        writer = next(s for s in system.snapshot() if s.name == "ssd_writer")
        if writer.report["persisted"] >= blocks:
            break
        await asyncio.sleep(0.02)
    assert writer.report["persisted"] >= blocks
    await system.__aexit__(None, None, None)

    client, system, model = await serving()
    assert (await complete(client, model, "key-b"))["prompt_tokens_details"][
        "cached_tokens"] == 0
    hit = (await complete(client, model, "key-a"))["prompt_tokens_details"]["cached_tokens"]
    assert hit == (usage["prompt_tokens"] - 1) // BLOCK * BLOCK  # A's blocks, from disk
    await system.__aexit__(None, None, None)
