"""Embed mlx-troupe in a program: the serving actors, the HTTP server, and an actor of your own.

The program starts the serving actors in-process, serves HTTP on 127.0.0.1, and spawns a
``Watcher`` next to them. On a ``Watch`` message the watcher asks the scheduler for its model
card (``DescribeEngine``) and runs a request on it (``AddRequest`` via ``stream()``),
consuming the events: it talks to the scheduler by message, as admission does. The watcher
then shows in ``GET /actors`` with its report, like the serving actors.

    .venv/bin/python examples/embed_server.py --model <model> [--port 0]

See docs/embedding.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from typing import Any

import aiohttp
import msgspec
from mlx_lm.utils import load_tokenizer

from troupe.actors.config import ServeConfig
from troupe.actors.messages import (
    AddRequest,
    DescribeEngine,
    ModelCard,
    RequestFinished,
    SamplingParams,
    TokensGenerated,
)
from troupe.actors.serving import start_serving
from troupe.api.server import serve_http
from troupe.runtime import Actor, ActorRef, ActorSystem, Message


class Watch(Message):
    """Run ``prompt`` on the scheduler for ``max_tokens`` tokens and report what came back."""

    prompt: str
    max_tokens: int


class Watched(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    text: str


class Watcher(Actor):
    """Talks to the scheduler by message; pinned to its own thread, as tokenizing blocks."""

    def __init__(self, *, scheduler: ActorRef) -> None:
        self.scheduler = scheduler
        self.tokenizers: dict[str, Any] = {}
        self.requests = 0
        self.generated = 0

    async def handle(self, msg: Watch) -> Watched:
        card: ModelCard = await self.scheduler.ask(DescribeEngine(), timeout=30.0)
        if card.path not in self.tokenizers:
            self.tokenizers[card.path] = load_tokenizer(card.path)
        prompt = self.tokenizers[card.path].encode(msg.prompt)
        self.requests += 1
        request = AddRequest(
            request_id=f"watch-{self.requests}",
            prompt_tokens=prompt,
            sampling=SamplingParams(max_tokens=msg.max_tokens, temperature=0.0, ignore_eos=True),
        )
        texts: list[str] = []
        async with await self.scheduler.stream(request) as events:
            async for event in events:
                match event:
                    case TokensGenerated(text=text, token_ids=token_ids):
                        texts.append(text)
                        self.generated += len(token_ids)
                    case RequestFinished(finish_reason=reason, usage=usage):
                        return Watched(
                            model=card.id,
                            prompt_tokens=usage.prompt_tokens,
                            completion_tokens=usage.completion_tokens,
                            finish_reason=reason,
                            text="".join(texts),
                        )
        raise RuntimeError("the scheduler ended the request without finishing it")

    def report(self) -> dict[str, Any]:
        return {"requests": self.requests, "generated_tokens": self.generated}


async def get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as response:
        response.raise_for_status()
        return await response.json()


async def main(model: str | None, port: int) -> None:
    config = ServeConfig(model=model, host="127.0.0.1", port=port)
    async with ActorSystem() as system:
        handles = await start_serving(system, config)
        async with serve_http(system, config, handles) as server:
            model_id = handles.models[0].id
            print(f"serving {model_id} on {server.url}")
            watcher = await system.spawn(
                Watcher, name="watcher", thread="watcher", scheduler=handles.schedulers[model_id]
            )
            watched = await watcher.ask(Watch(prompt="The quick brown fox", max_tokens=8),
                                        timeout=120.0)
            print(f"watcher: {watched.completion_tokens} tokens from {watched.model} "
                  f"({watched.finish_reason}) after a {watched.prompt_tokens}-token prompt")
            async with aiohttp.ClientSession() as session:
                actors = await get_json(session, f"{server.url}/actors")
                print("GET /actors:", ", ".join(actor["name"] for actor in actors))
                mine = await get_json(session, f"{server.url}/actors/watcher")
                print("GET /actors/watcher:", mine["state"], json.dumps(mine["report"]))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the bundled model")
    parser.add_argument("--port", type=int, default=0, help="default: 0, a free port")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    asyncio.run(main(args.model, args.port))
