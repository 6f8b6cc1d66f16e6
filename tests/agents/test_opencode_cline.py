"""OpenCode's and Cline's requests as they send them (benchmarks/agent_shapes.py): chat
completions streamed with ``stream_options``, the model named as the user's provider config
names it; OpenCode with two system messages, 2020-12 tool schemas and max_tokens 32000;
Cline with its XML tool use in the text and text-part user turns. Each turn is answered (the
official ``openai`` client parses its stream) and reads the previous turn's prompt from the
prefix cache."""

from __future__ import annotations

import pytest
from agent_shapes import Cline, OpenCode, Script, reuse
from replay import play

TURNS = 4
E2E_TIMEOUT_S = 900
AGENTS = {"opencode": OpenCode, "cline": Cline}


def _check(answers: list) -> None:
    for previous, current in zip(answers, answers[1:], strict=False):
        assert reuse(previous, current) >= 0.99, (previous, current)


@pytest.mark.parametrize("agent", sorted(AGENTS))
async def test_session_on_a_qwen3_template_keeps_its_cache(qwen3_url: str, agent: str) -> None:
    session = AGENTS[agent](Script(seed=2, result_chars=(300, 900)), system_chars=2000,
                            resumed=2)
    _check(await play(qwen3_url, session, TURNS))


@pytest.mark.e2e
@pytest.mark.timeout(E2E_TIMEOUT_S)
@pytest.mark.parametrize("agent", sorted(AGENTS))
async def test_session_on_the_default_model_keeps_its_cache(capped_server: str,
                                                            agent: str) -> None:
    session = AGENTS[agent](Script(seed=2, result_chars=(300, 900)), system_chars=1000,
                            resumed=2)
    _check(await play(capped_server, session, 3))
