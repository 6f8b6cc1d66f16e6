"""Code completion between a prefix and a suffix (fill in the middle): the model's own tokens
found in its vocabulary (actors/prompts.py ``fim_tokens_of``), the prompt built around them
(``prepare_fim``), through OpenAI's ``suffix`` and Ollama's ``suffix``, on the real stack.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from http_stack import real_stack
from tiny_model import make_tiny_model

from troupe.actors.prompts import FimTokens, fim_tokens_of

PREFIX = "def capital(country):\n    return "
SUFFIX = "\n\nprint(capital('France'))\n"


class Vocab:
    def __init__(self, names: list[str]) -> None:
        self.vocab = {name: 100 + i for i, name in enumerate(names)}

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


@pytest.mark.parametrize(("names", "want"), [
    (["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"], FimTokens(100, 101, 102, "psm")),
    (["a", "<fim_prefix>", "<fim_suffix>", "<fim_middle>"], FimTokens(101, 102, 103, "psm")),
    (["<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"], FimTokens(100, 101, 102, "psm")),
    (["[SUFFIX]", "[PREFIX]"], FimTokens(101, 100, None, "spm")),
    # A style is whole or not at all.
    (["<|fim_prefix|>", "<|fim_suffix|>"], None),
    ([], None),
])
def test_the_fim_tokens_are_found_by_their_names(names: list[str], want: Any) -> None:
    assert fim_tokens_of(Vocab(names)) == want


@pytest.fixture(scope="module")
def fim_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-fim") / "tiny-fim", fim=True)


async def _complete(http: httpx.AsyncClient, model: str, **body: Any) -> dict[str, Any]:
    resp = await http.post("/v1/completions", json={"model": model, "max_tokens": 12,
                                                    "temperature": 0, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


async def test_a_suffix_completes_the_middle_as_the_fim_prompt_written_out_does(
        fim_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TROUPE_HOME", str(tmp_path))
    async with real_stack(fim_model_dir) as stack, \
            httpx.AsyncClient(base_url=stack.server.url, timeout=120) as http:
        got = await _complete(http, stack.model, prompt=PREFIX, suffix=SUFFIX)
        # The same prompt with the model's tokens written out (an added token is one token
        # wherever it stands, so the text encodes to the same ids).
        written = await _complete(
            http, stack.model, prompt=f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>")
        assert got["choices"][0]["text"] == written["choices"][0]["text"]
        assert got["usage"]["prompt_tokens"] == written["usage"]["prompt_tokens"]
        # The suffix is read: another suffix, another prompt (and here another answer).
        other = await _complete(http, stack.model, prompt=PREFIX, suffix="\n# done\n")
        assert other["usage"]["prompt_tokens"] != got["usage"]["prompt_tokens"]
        assert other["choices"][0]["text"] != got["choices"][0]["text"]
        # Ollama's generate with a suffix: the same completion.
        ollama = await http.post("/api/generate", json={
            "model": stack.model, "prompt": PREFIX, "suffix": SUFFIX, "stream": False,
            "options": {"temperature": 0, "num_predict": 12}})
        assert ollama.status_code == 200, ollama.text
        assert ollama.json()["response"] == got["choices"][0]["text"]
        # Token ids and a suffix do not go together.
        ids = await http.post("/v1/completions", json={"model": stack.model, "prompt": [1, 2],
                                                       "suffix": SUFFIX, "max_tokens": 2})
        assert ids.status_code == 400 and ids.json()["error"]["param"] == "suffix"


async def test_a_large_file_around_the_gap_completes_the_same_on_the_large_prompt_path(
        fim_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the admission's large-prompt size, the prompt is built by the same code, on the
    large prompts' turn."""
    from troupe.actors import admission

    monkeypatch.setenv("TROUPE_HOME", str(tmp_path))
    answers = []
    for large in (10**9, 8):
        monkeypatch.setattr(admission, "LARGE_PROMPT_CHARS", large)
        async with real_stack(fim_model_dir) as stack, \
                httpx.AsyncClient(base_url=stack.server.url, timeout=120) as http:
            answers.append(await _complete(http, stack.model, prompt=PREFIX, suffix=SUFFIX))
    assert answers[0]["choices"] == answers[1]["choices"]
    assert answers[0]["usage"] == answers[1]["usage"]


async def test_a_model_without_fim_tokens_refuses_a_suffix(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TROUPE_HOME", str(tmp_path))
    async with real_stack(tiny_model_dir) as stack, \
            httpx.AsyncClient(base_url=stack.server.url, timeout=120) as http:
        resp = await http.post("/v1/completions", json={
            "model": stack.model, "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 4})
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert error["param"] == "suffix" and "fill-in-the-middle" in error["message"]
        ollama = await http.post("/api/generate", json={
            "model": stack.model, "prompt": PREFIX, "suffix": SUFFIX, "stream": False})
        assert ollama.status_code == 400 and "fill-in-the-middle" in ollama.json()["error"]
        # An empty suffix is a plain completion.
        plain = await _complete(http, stack.model, prompt=PREFIX, suffix="")
        assert plain["choices"][0]["text"]
