"""Admission: a prompt that cannot fit is refused without being tokenized, and one request's
tokenizing never holds another's admission (issue 18).

Order and blocking only: the tokenizer is wrapped so that the test sees every text it encodes
and can hold large ones on an Event; nothing here reads a clock.
"""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path
from typing import Any

import pytest
from http_stack import real_client
from mlx_lm.utils import load_tokenizer
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import troupe.actors.admission as admission_module
from troupe.actors.admission import Admission
from troupe.actors.config import ServeConfig
from troupe.actors.prompts import prompt_bound

SENTENCE = "The quick brown fox jumps over the lazy dog. "
GATE_S = 60.0  # how long a held encode waits for the test at the most (a hang guard only)


class WatchedTokenizer:
    """The model's tokenizer, with every text ``encode`` gets recorded; an encode of more than
    ``hold_over`` characters waits for ``gate`` (it runs on an admission worker thread)."""

    def __init__(self, inner: Any, hold_over: int | None = None) -> None:
        self._inner = inner
        self.hold_over = hold_over
        self.gate = threading.Event()
        self.lock = threading.Lock()
        self.encoded: list[int] = []  # the length of each text encoded
        self.held = 0  # encodes waiting at the gate now

    def encode(self, text: str, **kw: Any) -> list[int]:
        with self.lock:
            self.encoded.append(len(text))
        if self.hold_over is not None and len(text) > self.hold_over:
            with self.lock:
                self.held += 1
            try:
                assert self.gate.wait(GATE_S), "the test never opened the gate"
            finally:
                with self.lock:
                    self.held -= 1
        return self._inner.encode(text, **kw)

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _admission(system: Any) -> Admission:
    cell = system.find("admission")._cell
    return cell.instance


def _watch(system: Any, hold_over: int | None = None) -> WatchedTokenizer:
    """Wrap the (only) model's tokenizer in the running admission actor."""
    entry = next(iter(_admission(system).models.values()))
    watched = WatchedTokenizer(entry.tokenizer, hold_over)
    entry.tokenizer = watched
    return watched


async def _until(predicate: Any, what: str) -> None:
    for _ in range(3000):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


def _chat(model: str, text: str, max_tokens: int = 4) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": 0}


async def test_a_prompt_that_cannot_fit_is_refused_without_being_tokenized(
    aiohttp_client: Any, tiny_model_dir: Path
) -> None:
    client, system, handles = await real_client(aiohttp_client,
                                                ServeConfig(model=str(tiny_model_dir)))
    model = handles.models[0].id
    watched = _watch(system)
    huge = SENTENCE * 100_000  # 4.5 MB: far past the tiny model's 2048 tokens

    resp = await client.post("/v1/chat/completions", json=_chat(model, huge))
    data = await resp.json()
    assert resp.status == 400, data
    assert data["error"]["code"] == "context_length_exceeded"
    assert data["error"]["param"] == "messages"
    assert "at least" in data["error"]["message"]

    resp = await client.post("/v1/completions", json={"model": model, "prompt": huge,
                                                      "max_tokens": 4})
    data = await resp.json()
    assert resp.status == 400, data
    assert (data["error"]["code"], data["error"]["param"]) == ("context_length_exceeded",
                                                               "prompt")
    # Neither was tokenized: nothing near their size went through encode.
    assert all(n < 10_000 for n in watched.encoded), watched.encoded

    # What may fit is still tokenized and served; the count of refusals is the same as before.
    resp = await client.post("/v1/chat/completions", json=_chat(model, SENTENCE))
    assert resp.status == 200, await resp.text()
    assert watched.encoded and max(watched.encoded) > len(SENTENCE)
    assert _admission(system).refused == {"invalid": 2}


async def test_a_short_request_is_answered_while_large_prompts_are_tokenizing(
    aiohttp_client: Any, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prompts over 200 characters count as large (read when admission is made).
    monkeypatch.setattr(admission_module, "LARGE_PROMPT_CHARS", 200)
    client, system, handles = await real_client(aiohttp_client,
                                                ServeConfig(model=str(tiny_model_dir)))
    model = handles.models[0].id
    actor = _admission(system)
    workers = actor.workers
    watched = _watch(system, hold_over=200)
    done: list[str] = []

    async def ask(name: str, text: str) -> int:
        resp = await client.post("/v1/chat/completions", json=_chat(model, text))
        await resp.read()
        done.append(name)
        return resp.status

    large = SENTENCE * 8  # 360 characters: large here, and it fits the context
    bigs = [asyncio.ensure_future(ask(f"large-{i}", f"{i} {large}")) for i in range(workers)]
    # Every worker but one holds a large prompt at the gate; the last large one waits its turn.
    await _until(lambda: watched.held == workers - 1, "large prompts tokenizing")
    await _until(lambda: actor.report()["admitting"] == workers, "all large ones admitting")

    # A 4-token request goes through (templated, tokenized, admitted, answered) meanwhile.
    assert await ask("short", "Hi") == 200
    assert done == ["short"]
    assert not any(task.done() for task in bigs)
    assert watched.held == workers - 1  # no more large ones than their share of the workers

    watched.gate.set()
    assert await asyncio.gather(*bigs) == [200] * workers
    assert done[0] == "short" and len(done) == workers + 1
    assert actor.report()["admitting"] == 0


async def test_count_tokens_and_admission_agree_with_the_template(
    aiohttp_client: Any, tiny_model_dir: Path
) -> None:
    """Templating then encoding (as admission now does) gives apply_chat_template's tokens."""
    client, system, handles = await real_client(aiohttp_client,
                                                ServeConfig(model=str(tiny_model_dir)))
    model = handles.models[0].id
    tok = load_tokenizer(tiny_model_dir)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": SENTENCE * 3}]
    expected = list(tok.apply_chat_template(messages, add_generation_prompt=True))
    resp = await client.post("/v1/chat/completions", json={
        "model": model, "messages": messages, "max_tokens": 2, "temperature": 0})
    data = await resp.json()
    assert resp.status == 200, data
    assert data["usage"]["prompt_tokens"] == len(expected)
    resp = await client.post("/v1/messages/count_tokens", json={
        "model": model, "system": "Be brief.",
        "messages": [{"role": "user", "content": SENTENCE * 3}]})
    data = await resp.json()
    assert resp.status == 200, data
    assert data["input_tokens"] == len(list(tok.apply_chat_template(messages)))


# --- the floor itself -------------------------------------------------------------------------


def _texts() -> list[str]:
    rng = random.Random(18)
    alphabet = "ab c\n\t  é한😀<>|_" + "".join(chr(c) for c in range(0x300, 0x310))
    texts = ["", " " * 5000, "\n" * 3000, "<|im_start|>" * 50, SENTENCE * 40,
             "😀" * 500, "e\u0301" * 400, "a" * 4000]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3000)))
              for _ in range(40)]
    return texts


@pytest.mark.parametrize("which", ["tiny", "nfc"])
def test_the_floor_never_exceeds_the_real_token_count(tiny_model_dir: Path, which: str) -> None:
    tok = load_tokenizer(tiny_model_dir)
    if which == "nfc":
        # The same tokenizer with a normalizer that shortens text (it composes e + accent).
        tok._tokenizer.backend_tokenizer.normalizer = normalizers.NFC()
    bound = prompt_bound(tok)
    assert bound is not None and bound.chars >= len("<|endoftext|>")
    for text in _texts():
        n = len(tok.encode(text, add_special_tokens=False))
        assert bound.fewest_tokens(text) <= n, (text[:40], bound.fewest_tokens(text), n)


def _fast(pre: Any = None, normalizer: Any = None, model: Any = None) -> PreTrainedTokenizerFast:
    tok = Tokenizer(model or models.BPE(vocab={"a": 0, "b": 1, "ab": 2, "<unk>": 3},
                                        merges=[("a", "b")], unk_token="<unk>"))
    tok.pre_tokenizer = pre
    tok.normalizer = normalizer
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_no_floor_for_a_tokenizer_that_can_drop_or_fold_text() -> None:
    assert prompt_bound(_fast(pre_tokenizers.ByteLevel())) is not None
    # Whitespace dropped by the pre-tokenizer or stripped piecewise by the normalizer.
    assert prompt_bound(_fast(pre_tokenizers.WhitespaceSplit())) is None
    assert prompt_bound(_fast(normalizer=normalizers.Strip())) is None
    # A run of unknown characters folded into one <unk>.
    fused = models.BPE(vocab={"a": 0, "<unk>": 1}, merges=[], unk_token="<unk>", fuse_unk=True)
    assert prompt_bound(_fast(model=fused)) is None
    assert prompt_bound(_fast(model=models.WordLevel({"a": 0, "<unk>": 1}, "<unk>"))) is None
