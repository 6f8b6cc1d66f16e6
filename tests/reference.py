"""What the engine is checked against: mlx-lm's own single-sequence greedy generation."""

from __future__ import annotations

from mlx_lm.generate import stream_generate

PROMPTS = [
    "What is the capital of France?",
    "The quick brown fox",
    "Numbers like 12345",
    "def add(a, b):",
    "Unicode: café 東京",
    "jumps over the lazy dog. The quick brown fox jumps over the lazy dog again and again",
    "Paris",
    "emoji 🙂 and more and more",
]


def reference_tokens(model, tok, prompt: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's greedy tokens for one prompt alone, cut at EOS like the engine."""
    out = []
    for r in stream_generate(model, tok, prompt, max_tokens=max_tokens):
        if r.token in tok.eos_token_ids:
            break
        out.append(r.token)
    return out


def detokenize(tok, tokens: list[int]) -> str:
    """Text as mlx-lm's streaming detokenizer gives it (it trims a leading space)."""
    d = tok.detokenizer
    for t in tokens:
        d.add_token(t)
    d.finalize()
    return d.text
