"""Operations: /actors, /metrics, the API key on every route, CORS flags, the access log, the
graceful shutdown of the embedding API, and ``troupe actors`` against a real server.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import http_stack
import pytest
from aiohttp.test_utils import TestClient
from http_stack import (
    MODEL,
    Scripted,
    parse_data_sse,
    parse_named_sse,
    real_stack,
)
from prometheus_client.parser import text_string_to_metric_families

from troupe.api.cli import build_parser, serve_config
from troupe.api.shutdown import INFLIGHT
from troupe.runtime import Actor, Message

ROOT = Path(__file__).resolve().parents[1]


class Gadget(Actor):
    """An actor of the embedding program's own, with a report of mixed values."""

    async def handle(self, msg: Message) -> None:
        return None

    def report(self) -> dict[str, Any]:
        return {"level": 3, "flag": True, "nested": {"hits": 2, "name": "x"}, "where": Path("/x")}


class FakeScheduler(Actor):
    """Reports what a scheduler reports."""

    async def handle(self, msg: Message) -> None:
        return None

    def report(self) -> dict[str, Any]:
        return {"model": MODEL, "running": 3, "waiting": 4, "batch_size": 2}


# The scripted stack's fixtures, bound here by name so that pytest finds them.
scripted, client = http_stack.scripted, http_stack.client


def chat(content: str = "hello", **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


# --- introspection -------------------------------------------------------------------------


async def test_actors_lists_every_actor_including_ones_the_program_spawned(
    client: TestClient, scripted: Scripted
) -> None:
    await scripted.system.spawn(Gadget, name="gadget")
    resp = await client.get("/actors")
    assert resp.status == 200
    actors = await resp.json()
    assert [a["name"] for a in actors] == ["admission", "gadget"]
    gadget = actors[1]
    assert gadget["actor_class"].endswith("Gadget") and gadget["state"] == "running"
    # Values JSON cannot hold are shown as text rather than failing the whole listing.
    assert gadget["report"] == {"level": 3, "flag": True, "nested": {"hits": 2, "name": "x"},
                                "where": repr(Path("/x"))}
    assert {"mailbox_depth", "mailbox_capacity", "messages_handled", "restarts",
            "last_error", "thread"} <= set(gadget)


async def test_actor_by_name_shows_its_report_and_unknown_name_is_404(
    client: TestClient,
) -> None:
    await client.post("/v1/chat/completions", json=chat(model="nope"))
    resp = await client.get("/actors/admission")
    assert resp.status == 200
    admission = await resp.json()
    assert admission["name"] == "admission"
    assert admission["report"]["refused"] == {"unknown_model": 1}
    resp = await client.get("/actors/nobody")
    assert resp.status == 404
    error = (await resp.json())["error"]
    assert (error["param"], error["code"]) == ("name", "actor_not_found")


# --- metrics -------------------------------------------------------------------------------


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a Prometheus text exposition, keyed by name and labels."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(found: dict[Any, float], name: str, **labels: str) -> float | None:
    return found.get((name, frozenset(labels.items())))


async def scrape(client: TestClient) -> dict[Any, float]:
    resp = await client.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain")
    return samples(await resp.text())


async def test_metrics_count_requests_tokens_and_latencies(client: TestClient) -> None:
    assert (await client.post("/v1/chat/completions", json=chat())).status == 200
    resp = await client.post("/v1/chat/completions", json=chat(stream=True))
    await resp.read()
    assert (await client.get("/nowhere")).status == 404
    assert (await client.post("/v1/messages", json={**chat(), "max_tokens": 5})).status == 200
    found = await scrape(client)
    route = "/v1/chat/completions"
    assert value(found, "troupe_http_requests_total", route=route, method="POST",
                 status="200") == 2
    assert value(found, "troupe_http_requests_total", route="unmatched", method="GET",
                 status="404") == 1
    # Each request of the scripted engine: 5 prompt tokens (2 cached), 4 generated; two of
    # the three on the chat route.
    assert value(found, "troupe_prompt_tokens_total", model=MODEL, route=route) == 10
    assert value(found, "troupe_cached_prompt_tokens_total", model=MODEL, route=route) == 4
    assert value(found, "troupe_prefix_cache_read_share", route=route) == 0.4
    # Each route counts its own requests' tokens.
    assert value(found, "troupe_prompt_tokens_total", model=MODEL, route="/v1/messages") == 5
    assert value(found, "troupe_prefix_cache_read_share", route="/v1/messages") == 0.4
    assert value(found, "troupe_generated_tokens_total", model=MODEL) == 12
    # One first token per request; three deltas make two gaps per request.
    assert value(found, "troupe_time_to_first_token_seconds_count", model=MODEL) == 3
    assert value(found, "troupe_inter_token_latency_seconds_count", model=MODEL) == 6


async def test_metrics_read_actor_snapshots_at_scrape_time(
    client: TestClient, scripted: Scripted
) -> None:
    await client.post("/v1/chat/completions", json=chat(model="nope"))
    await scripted.system.spawn(Gadget, name="gadget")
    await scripted.system.spawn(FakeScheduler, name="scheduler-x")
    found = await scrape(client)
    assert value(found, "troupe_queue_depth", actor="scheduler-x") == 4
    assert value(found, "troupe_batch_size", actor="scheduler-x") == 2
    assert value(found, "troupe_running_requests", actor="scheduler-x") == 3
    assert value(found, "troupe_queue_depth", actor="gadget") is None
    assert value(found, "troupe_admission_refusals_total", actor="admission", status="404") == 1
    assert value(found, "troupe_admission_admitted_total", actor="admission") == 1
    report = "troupe_actor_report"
    assert value(found, report, actor="gadget", key="level") == 3
    assert value(found, report, actor="gadget", key="flag") == 1
    assert value(found, report, actor="gadget", key="nested.hits") == 2
    assert value(found, report, actor="gadget", key="nested.name") is None
    assert value(found, report, actor="scheduler-x", key="waiting") == 4
    assert value(found, "troupe_actor_mailbox_capacity", actor="gadget") == 64
    assert value(found, "troupe_actor_mailbox_depth", actor="gadget") == 0
    assert value(found, "troupe_actor_running", actor="gadget") == 1
    assert value(found, "troupe_actor_messages_handled_total", actor="admission") == 1
    assert value(found, "troupe_actor_restarts_total", actor="admission") == 0


async def test_each_app_has_its_own_metrics_registry(
    aiohttp_client: Any, scripted: Scripted
) -> None:
    one, two = [
        await aiohttp_client(scripted.app())
        for _ in range(2)
    ]
    assert (await one.post("/v1/chat/completions", json=chat())).status == 200
    key = {"route": "/v1/chat/completions", "method": "POST", "status": "200"}
    assert value(await scrape(one), "troupe_http_requests_total", **key) == 1
    assert value(await scrape(two), "troupe_http_requests_total", **key) is None


# --- API key and CORS ----------------------------------------------------------------------

GUARDED = [
    ("GET", "/actors", None, "openai"),
    ("GET", "/actors/admission", None, "openai"),
    ("GET", "/metrics", None, "openai"),
    ("GET", "/v1/models", None, "openai"),
    ("POST", "/v1/chat/completions", chat(), "openai"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hello"}, "openai"),
    ("POST", "/v1/messages", {**chat(), "max_tokens": 5}, "anthropic"),
    ("POST", "/v1/messages/count_tokens", chat(), "anthropic"),
    ("GET", "/no/such/route", None, "openai"),
]


@pytest.mark.parametrize(("method", "path", "payload", "shape"), GUARDED)
async def test_api_key_guards_every_route_but_health(
    aiohttp_client: Any, scripted: Scripted, method: str, path: str, payload: Any, shape: str
) -> None:
    app = scripted.app(api_key="sekret")
    client = await aiohttp_client(app)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
        resp = await client.request(method, path, json=payload, headers=headers)
        assert resp.status == 401, (path, headers)
        data = await resp.json()
        if shape == "anthropic":
            assert data["error"]["type"] == "authentication_error" and data["type"] == "error"
        else:
            assert (data["error"]["type"], data["error"]["code"]) == ("authentication_error",
                                                                      "invalid_api_key")
    for headers in ({"Authorization": "Bearer sekret"}, {"x-api-key": "sekret"}):
        resp = await client.request(method, path, json=payload, headers=headers)
        assert resp.status != 401, (path, headers)
    assert (await client.get("/health")).status == 200


def test_allowed_origins_flag_takes_comma_lists_and_keeps_the_singular_alias() -> None:
    args = build_parser().parse_args([
        "serve", "--allowed-origins", "http://a.local, http://b.local",
        "--allowed-origin", "http://c.local",
    ])
    assert args.allowed_origins == ["http://a.local", "http://b.local", "http://c.local"]
    assert build_parser().parse_args(["serve"]).allowed_origins == []


def test_alias_flag_collects_names_and_patterns_in_order() -> None:
    args = build_parser().parse_args([
        "serve", "--alias", "gpt-5-codex=qwen", "--alias", "claude-*haiku*=small",
        "--alias", "claude-*=qwen",
    ])
    aliases = serve_config(args).aliases
    assert list(aliases.items()) == [("gpt-5-codex", "qwen"), ("claude-*haiku*", "small"),
                                     ("claude-*", "qwen")]
    assert serve_config(build_parser().parse_args(["serve"])).aliases == {}


@pytest.mark.parametrize("value", ["claude", "=qwen", "claude=", "a=b --alias a=c"])
def test_a_bad_alias_flag_is_a_usage_error(value: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", *f"--alias {value}".split()])
    assert exited.value.code == 2
    assert "--alias" in capsys.readouterr().err


def test_step_budget_flag_reaches_the_engine_and_zero_turns_it_off() -> None:
    engine = serve_config(build_parser().parse_args(["serve", "--step-budget-ms", "150"])).engine
    assert engine.step_budget_ms == 150.0
    off = serve_config(build_parser().parse_args(["serve", "--step-budget-ms", "0"]))
    assert off.engine.step_budget_ms == 0.0
    assert serve_config(build_parser().parse_args(["serve"])).engine.step_budget_ms > 0


@pytest.mark.parametrize("value", ["-1", "abc", "nan", "inf"])
def test_a_bad_step_budget_is_a_usage_error(value: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "--step-budget-ms", value])
    assert exited.value.code == 2
    assert "--step-budget-ms" in capsys.readouterr().err


def test_api_key_flag_defaults_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TROUPE_API_KEY", "from-env")
    monkeypatch.delenv("TROUPE_ADMIN_API_KEY", raising=False)
    assert build_parser().parse_args(["serve"]).api_key == "from-env"
    assert build_parser().parse_args(["actors"]).api_key == "from-env"
    # The introspection commands prefer the admin key: with one set, /actors wants it.
    monkeypatch.setenv("TROUPE_ADMIN_API_KEY", "admin-env")
    assert build_parser().parse_args(["serve"]).api_key == "from-env"
    for command in ("actors", "top"):
        assert build_parser().parse_args([command]).api_key == "admin-env"


async def test_cors_answers_each_listed_origin(aiohttp_client: Any, scripted: Scripted) -> None:
    origins = build_parser().parse_args(
        ["serve", "--allowed-origins", "http://a.local,http://b.local"]
    ).allowed_origins
    client = await aiohttp_client(scripted.app(allowed_origins=origins))
    for origin in ("http://a.local", "http://b.local"):
        resp = await client.get("/v1/models", headers={"Origin": origin})
        assert resp.headers["Access-Control-Allow-Origin"] == origin
    resp = await client.get("/v1/models", headers={"Origin": "http://evil.local"})
    assert "Access-Control-Allow-Origin" not in resp.headers


# --- access log ----------------------------------------------------------------------------


def parse_line(line: str) -> dict[str, str]:
    return dict(pair.split("=", 1) for pair in line.split(" "))


async def test_access_log_writes_one_key_value_line_per_request(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="api.access")
    body = await (await client.post("/v1/chat/completions", json=chat())).json()
    await (await client.post("/v1/completions", json={
        "model": MODEL, "prompt": "length", "stream": True})).read()
    await client.get("/nowhere")
    for _ in range(100):  # a stream's line is written as its handler returns
        lines = [r.getMessage() for r in caplog.records if r.name == "api.access"]
        if len(lines) == 3:
            break
        await asyncio.sleep(0.01)
    assert len(lines) == 3, lines
    first = parse_line(lines[0])
    assert {k: first[k] for k in ("request_id", "method", "route", "model", "status",
                                  "prompt_tokens", "completion_tokens", "cached_tokens",
                                  "finish_reason")} == {
        "request_id": body["id"], "method": "POST", "route": "/v1/chat/completions",
        "model": MODEL, "status": "200", "prompt_tokens": "5", "completion_tokens": "4",
        "cached_tokens": "2", "finish_reason": "stop",
    }
    assert float(first["ttft_ms"]) >= 0 and float(first["total_ms"]) >= float(first["ttft_ms"])
    streamed = parse_line(lines[1])
    assert streamed["request_id"].startswith("cmpl-")
    assert (streamed["status"], streamed["finish_reason"]) == ("200", "length")
    missing = parse_line(lines[2])
    assert (missing["status"], missing["route"], missing["model"]) == ("404", "unmatched", "-")


# --- graceful shutdown ---------------------------------------------------------------------


async def test_requests_in_flight_finish_within_the_grace_period(scripted: Scripted) -> None:
    async with asyncio.timeout(30):  # a broken shutdown fails here rather than hangs
        server = await scripted.start(shutdown_grace=10)
        async with aiohttp.ClientSession() as session:
            streamed = await session.post(f"{server.url}/v1/chat/completions",
                                          json=chat("slow", stream=True))
            whole = asyncio.ensure_future(
                session.post(f"{server.url}/v1/chat/completions", json=chat("slow"))
            )
            await streamed.content.readuntil(b"\n\n")
            while len(server.app[INFLIGHT]) < 2:
                await asyncio.sleep(0.01)
            started = time.monotonic()
            closing = asyncio.ensure_future(server.close())
            chunks = parse_data_sse((await streamed.read()).decode())
            assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
            answer = await whole
            assert answer.status == 200
            assert (await answer.json())["choices"][0]["message"]["content"] == "Hello world"
            await closing
        assert time.monotonic() - started < 5  # it waited for the requests, not the whole grace


async def test_shutdown_ends_unfinished_requests_cleanly_and_refuses_new_connections(
    scripted: Scripted,
) -> None:
    async with asyncio.timeout(30):  # a broken shutdown fails here rather than hangs
        server = await scripted.start(shutdown_grace=0.5)
        host, port = server.runner.addresses[0][:2]
        url = server.url
        async with aiohttp.ClientSession() as session:
            openai_stream = await session.post(f"{url}/v1/chat/completions",
                                               json=chat("endless", stream=True))
            anthropic_stream = await session.post(f"{url}/v1/messages",
                                                  json={**chat("endless"), "max_tokens": 9,
                                                        "stream": True})
            whole = asyncio.ensure_future(
                session.post(f"{url}/v1/chat/completions", json=chat("endless"))
            )
            await openai_stream.content.readuntil(b"\n\n")
            await anthropic_stream.content.readuntil(b"\n\n")
            while len(server.app[INFLIGHT]) < 3:
                await asyncio.sleep(0.01)
            closing = asyncio.ensure_future(server.close())
            await asyncio.sleep(0.1)
            with pytest.raises(OSError):
                await asyncio.open_connection(host, port)
            assert not closing.done()  # still within the grace period
            chunks = parse_data_sse((await openai_stream.read()).decode())
            error = chunks[-1]["error"]
            assert (error["message"], error["type"]) == ("The server is shutting down.",
                                                         "server_error")
            # The first event (message_start) was read already.
            events = parse_named_sse((await anthropic_stream.read()).decode())
            assert events[-1][0] == "error"
            assert events[-1][1]["error"]["type"] == "overloaded_error"
            answer = await whole
            assert answer.status == 503
            assert (await answer.json())["error"]["message"] == "The server is shutting down."
            await closing


async def test_requests_arriving_after_shutdown_began_are_refused(client: TestClient) -> None:
    client.app[INFLIGHT].draining = True
    resp = await client.post("/v1/chat/completions", json=chat())
    assert resp.status == 503
    assert (await resp.json())["error"]["message"] == "The server is shutting down."
    assert (await client.get("/health")).status == 503


# --- troupe actors -------------------------------------------------------------------------


async def troupe(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "troupe.api.cli", *args, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_troupe_actors_prints_a_real_servers_actors_with_its_api_key(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TROUPE_HOME", str(tmp_path))
    monkeypatch.delenv("TROUPE_API_KEY", raising=False)
    async with real_stack(tiny_model_dir, api_key="sekret") as stack:
        url = stack.server.url
        for args, env in ((["--api-key", "sekret"], None), ([], {"TROUPE_API_KEY": "sekret"})):
            code, out, err = await troupe("actors", "--url", url, *args, env=env)
            assert code == 0, err
            lines = out.splitlines()
            assert lines[0].split() == ["NAME", "CLASS", "STATE", "THREAD", "MAILBOX",
                                        "HANDLED", "RESTARTS", "LAST", "ERROR"]
            rows = {line.split()[0]: line.split() for line in lines[1:]}
            assert rows["scheduler"][1:4] == ["actors.scheduler.Scheduler", "running", "mlx"]
            assert rows["admission"][2] == "running"
        code, out, err = await troupe("actors", "--url", url)
        assert code == 1 and out == ""
        assert "API key" in err
