"""Claude Code's requests as it sends them (benchmarks/agent_shapes.py ``ClaudeCode``): its
model names, its billing line with a new hash every turn, max_tokens 32000 with a thinking
budget of 31999, draft-07 tool schemas, tool results as block lists with ``is_error``, and
the fields it sends that this server has no use for. Each turn is answered (the official
``anthropic`` client parses its stream) and, after the first, reads the previous turn's
prompt from the prefix cache."""

from __future__ import annotations

import anthropic
import pytest
from agent_shapes import ClaudeCode, Script, reuse
from replay import play, turn

TURNS = 4
E2E_TIMEOUT_S = 900


async def _session(url: str, system_chars: int, turns: int, thinking: str = "enabled"
                   ) -> tuple[ClaudeCode, list]:
    session = ClaudeCode(Script(seed=1, result_chars=(300, 900)), system_chars=system_chars,
                         resumed=2, thinking=thinking)
    # At start: the quota probe and the context meter, on names no server here serves.
    probe = await turn(url, session, session.quota_probe())
    assert probe.finish in ("max_tokens", "end_turn")
    async with anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0) as client:
        counted = await client.messages.count_tokens(**session.count_tokens().body)
    assert counted.input_tokens > 0
    return session, await play(url, session, turns)


def _check(answers: list) -> None:
    for previous, current in zip(answers, answers[1:], strict=False):
        assert reuse(previous, current) >= 0.99, (previous, current)
    assert answers[0].cached_tokens < answers[0].prompt_tokens


# 2.1.37's thinking budget; 2.1.69's adaptive thinking, context_management and effort.
@pytest.mark.parametrize("thinking", ["enabled", "adaptive"])
async def test_claude_code_session_on_a_qwen3_template_keeps_its_cache(qwen3_url: str,
                                                                       thinking: str) -> None:
    session, answers = await _session(qwen3_url, system_chars=2000, turns=TURNS,
                                      thinking=thinking)
    _check(answers)
    # The conversation grew turn after turn, with each answer kept as Claude Code keeps it.
    assert [a.prompt_tokens for a in answers] == sorted(a.prompt_tokens for a in answers)
    assert len(session.messages) == 2 * (TURNS + 2) + 1


@pytest.mark.e2e
@pytest.mark.timeout(E2E_TIMEOUT_S)
async def test_claude_code_session_on_the_default_model_keeps_its_cache(
    capped_server: str,
) -> None:
    # Shorter than on the tiny model: the 135M model's first prefill of the 15 tools and the
    # instructions takes most of this test's time on two cores.
    _, answers = await _session(capped_server, system_chars=1000, turns=3)
    _check(answers)
