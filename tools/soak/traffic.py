"""What the soak's clients send: the request mix (``Traffic.spec``), the greedy probes that
drive the prefix cache, the held-back prompts whose answers must never change, and the mixes
the phases draw from.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

from troupe.tools.soak.corpus import (
    CHAT,
    MESSAGES,
    Shape,
)

_WORDS = (
    "river valley stone mountain village harbour lantern orchard meadow bridge tower market "
    "winter summer autumn spring keeper ship storm candle letter garden forest island road "
    "miller baker weaver sailor teacher bell clock window door roof field wheat barley salt "
    "copper silver quiet bright slow early late old new distant narrow wide green grey"
).split()
_QUESTIONS = (
    "Summarise the text in one sentence.", "Which place is named first?",
    "What is the mood of the text?", "Name one object in the text.",
    "Give the text a short title.", "Which season does the text describe?",
)
_SHORT = (
    "What is the capital of Italy?", "Name a fruit that is red.", "How many legs has a cat?",
    "Say hello in French.", "What colour is the sky?", "Name a large ocean.",
    "What is two plus three?", "Name a musical instrument.",
)
FAMILIES = 6  # long documents whose prompts share a prefix


def document(key: str, words: int) -> str:
    """A deterministic text of about ``words`` words (~1.3 tokens each), different per key."""
    rng = random.Random(key)
    sentences, count = [], 0
    while count < words:
        n = rng.randint(8, 14)
        sentence = " ".join(rng.choice(_WORDS) for _ in range(n))
        sentences.append(sentence[0].upper() + sentence[1:] + ".")
        count += n
    return f"Document {key}. " + " ".join(sentences)


WEATHER_TOOL = {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]},
}
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24},
                   "country": {"type": "string", "maxLength": 24}},
    "required": ["city", "country"], "additionalProperties": False,
}


@dataclass(frozen=True, slots=True)
class Spec:
    """One request to make: its kind (for the report), route, JSON body and client fault."""

    kind: str
    path: str
    body: dict[str, Any]
    # None, "cut" (close the stream mid-answer), "slow_read", "slow_body" (the body sent in
    # pieces, within the body timeout), "stall_body" (half a body, then nothing: 408).
    fault: str | None = None
    cut_after: int = 0  # content events read before a "cut"

    @property
    def shape(self) -> Shape:
        return "anthropic" if self.path.startswith(MESSAGES) else "openai"

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


class Traffic:
    """Makes the requests of the mix: ``spec(kind, rng)`` for one of ``KINDS``."""

    KINDS = ("chat", "messages", "prefix", "tools", "json", "unique", "idle")

    def __init__(self, model: str) -> None:
        self.model = model
        self.families = [document(f"family-{i}", 110) for i in range(FAMILIES)]
        self._unique = 0

    def _messages(self, text: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": text}]

    def _body(self, anthropic: bool, text: str, max_tokens: int, rng: random.Random,
              stream: bool, **fields: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": self._messages(text),
                                "max_tokens": max_tokens,
                                "temperature": rng.choice((0.0, 0.7)), **fields}
        if stream:
            body["stream"] = True
            if not anthropic:
                body["stream_options"] = {"include_usage": True}
        return body

    def unique_text(self) -> str:
        """A long prompt no other request shares: its blocks are new, so they are written."""
        self._unique += 1
        return document(f"unique-{self._unique}-{time.monotonic_ns()}", 100)

    def spec(self, kind: str, rng: random.Random) -> Spec:
        """One request of ``kind``, with its route, streaming and client fault drawn."""
        anthropic = rng.random() < 0.4
        path = MESSAGES if anthropic else CHAT
        if kind == "idle":
            return Spec("idle", path, {})
        if kind in ("tools", "json"):
            return Spec(kind, path, self._agent_body(kind, anthropic, rng))
        stream = rng.random() < (0.3 if kind in ("prefix", "unique") else 0.5)
        if kind == "prefix":
            text = f"{rng.choice(self.families)}\n\n{rng.choice(_QUESTIONS)}"
            max_tokens = 6
        elif kind == "unique":
            text, max_tokens = f"{self.unique_text()}\n\n{rng.choice(_QUESTIONS)}", 4
        else:
            text = f"Question {rng.randrange(10**6)}: {rng.choice(_SHORT)}"
            max_tokens = 8
        fault, cut_after = None, 0
        if stream:
            roll = rng.random()
            if roll < 0.2:  # about a fifth of the streams are cut mid-answer
                fault, cut_after, max_tokens = "cut", rng.randint(1, 3), 32
            elif roll < 0.3:
                fault = "slow_read"
        else:
            roll = rng.random()
            if roll < 0.06:
                fault = "slow_body"
            elif roll < 0.08:
                fault = "stall_body"
        body = self._body(anthropic, text, max_tokens, rng, stream)
        return Spec(kind, path, body, fault, cut_after)

    def _agent_body(self, kind: str, anthropic: bool, rng: random.Random) -> dict[str, Any]:
        text = "What is the weather in Paris?" if kind == "tools" else \
            f"Name a city and its country ({rng.randrange(1000)})."
        body = self._body(anthropic, text, 32, rng, stream=False)
        required = rng.random() < 0.6
        if kind == "tools" and anthropic:
            body["tools"] = [{"name": WEATHER_TOOL["name"],
                              "description": WEATHER_TOOL["description"],
                              "input_schema": WEATHER_TOOL["parameters"]}]
            body["tool_choice"] = {"type": "any" if required else "auto"}
        elif kind == "tools":
            body["tools"] = [{"type": "function", "function": WEATHER_TOOL}]
            body["tool_choice"] = "required" if required else "auto"
        elif anthropic:
            body["output_config"] = {"format": {"type": "json_schema", "schema": CITY_SCHEMA}}
        else:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "city", "schema": CITY_SCHEMA, "strict": True}}
        return body

    def probe(self, family: int | None = None) -> Spec:
        """A greedy two-token request that drives the prefix cache: a unique long prompt
        (new blocks for the SSD writer) or, with ``family``, a traffic family's prompt (its
        blocks read back from RAM or disk)."""
        text = self.unique_text() if family is None else self.families[family % FAMILIES]
        return Spec("probe", CHAT, {"model": self.model, "max_tokens": 2, "temperature": 0,
                                    "messages": self._messages(f"{text}\n\n{_QUESTIONS[0]}")})

    def held_back(self) -> list[Spec]:
        """The greedy probes, never part of the traffic's mix: a short chat, a long prompt
        of their own (its blocks go to RAM and disk, and come back from disk after a
        restart) and, on Anthropic's route, a long prompt sharing a traffic family's prefix."""
        def body(text: str) -> dict[str, Any]:
            return {"model": self.model, "messages": self._messages(text), "max_tokens": 6,
                    "temperature": 0}
        return [
            Spec("held_back", CHAT, body("What is the capital of France?")),
            Spec("held_back", CHAT, body(f"{document('held-back', 150)}\n\n{_QUESTIONS[0]}")),
            Spec("held_back", MESSAGES, body(f"{self.families[0]}\n\nList three words from it.")),
        ]


LOAD_MIX = {"chat": 3, "messages": 2, "prefix": 3, "tools": 1, "json": 1, "unique": 0.5,
            "idle": 0.3}
# New prompt blocks, so that the SSD writer is busy when the server is killed.
WRITE_MIX = {"unique": 3, "prefix": 1, "chat": 1, "messages": 1}
