"""Codex CLI's requests as it sends them (benchmarks/agent_shapes.py ``Codex``): the
Responses API with ``store: false`` (the whole history every turn), instructions, a developer
message, the AGENTS.md and environment context, ``shell`` / ``update_plan`` functions, the
``apply_patch`` freeform tool with its Lark grammar, a hosted ``web_search``, encrypted
reasoning asked for and sent back, ``custom_tool_call`` / ``function_call`` items and their
outputs. Each turn is answered (the official ``openai`` client parses its stream) and reads
the previous turn's prompt from the prefix cache."""

from __future__ import annotations

import pytest
from agent_shapes import Codex, Script, reuse
from replay import play

TURNS = 4
E2E_TIMEOUT_S = 900


def _check(answers: list) -> None:
    for previous, current in zip(answers, answers[1:], strict=False):
        assert reuse(previous, current) >= 0.99, (previous, current)


async def test_codex_session_on_a_qwen3_template_keeps_its_cache(qwen3_url: str) -> None:
    session = Codex(Script(seed=3, result_chars=(300, 900)), resumed=2)
    _check(await play(qwen3_url, session, TURNS))


@pytest.mark.e2e
@pytest.mark.timeout(E2E_TIMEOUT_S)
async def test_codex_session_on_the_default_model_keeps_its_cache(capped_server: str) -> None:
    session = Codex(Script(seed=3, result_chars=(300, 900)), resumed=2)
    _check(await play(capped_server, session, 3))
