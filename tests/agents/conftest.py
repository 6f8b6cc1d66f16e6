"""The replay suite's servers: ``troupe`` in this process on the tiny qwen3 (its template
renders tools and reasoning as the Qwen3 family's does), reached over a real port by the
official clients; the default model's server is the session-wide ``server`` fixture."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import http_stack
import pytest

from troupe.actors.config import ServeConfig
from troupe.actors.serving import start_serving
from troupe.api.app import create_app
from troupe.runtime import ActorSystem

# The longest answer of the default model's server (its --max-tokens-limit).
ANSWER_LIMIT = 160


@pytest.fixture
async def qwen3_url(aiohttp_client, tiny_qwen3_dir: Path, tmp_path: Path) -> AsyncIterator[str]:
    """The base URL of a server of the tiny qwen3, with its prefix cache in RAM and on disk."""
    config = ServeConfig(model=str(tiny_qwen3_dir), cache_dir=str(tmp_path / "cache"))
    async with ActorSystem() as system:
        handles = await start_serving(system, config)
        app = create_app(system=system, admission=handles.admission, config=config)
        client = await aiohttp_client(app)
        yield str(client.make_url("")).rstrip("/")


@pytest.fixture(scope="session")
def capped_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`troupe serve` on the default model with ``--max-tokens-limit``: the agents ask for up
    to 32,000 tokens, and the 135M model sampled at their temperatures may write thousands
    (measured: 4,953 tokens to one Claude Code turn) before it stops."""
    log = tmp_path_factory.mktemp("agents-e2e") / "server.log"
    with http_stack.serve_default_model(log, "--max-tokens-limit", str(ANSWER_LIMIT)) as base:
        yield base
