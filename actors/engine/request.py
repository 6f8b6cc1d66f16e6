"""One request's state on the MLX thread, and the sampler made for it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, greedy_sampler, make_sampler

from actors.engine.agent_output import OutputParser
from actors.engine.grammar import GrammarProcessor
from actors.engine.output import StopStringFilter
from actors.messages import SamplingParams

# mx.random.key takes an unsigned 64-bit seed; any integer a request sends wraps into it.
SEED_SPACE = 1 << 64


def make_request_sampler(sampling: SamplingParams) -> Callable[[mx.array], mx.array]:
    """The sampler for one request. Greedy requests share one function so the batch samples
    in one call; a seeded request carries its own PRNG key so its draws do not depend on the
    other requests in the batch.

    A ``top_k`` at or past the vocabulary keeps every token, as no ``top_k`` does. mlx-lm
    raises on it instead, inside a function compiled over MLX's global random state, which
    that leaves unusable: every later sampled request of the process failed. The vocabulary
    is known from the first logits, so the sampler is made then."""
    if sampling.temperature == 0:
        return greedy_sampler
    made: list[Callable[[mx.array], mx.array]] = []

    def sampler(logprobs: mx.array) -> mx.array:
        if not made:
            top_k = sampling.top_k if sampling.top_k < logprobs.shape[-1] else 0
            made.append(_sampler(sampling, top_k))
        return made[0](logprobs)

    return sampler


def _sampler(sampling: SamplingParams, top_k: int) -> Callable[[mx.array], mx.array]:
    if sampling.seed is None:
        return make_sampler(
            temp=sampling.temperature,
            top_p=sampling.top_p,
            min_p=sampling.min_p,
            top_k=top_k,
        )
    key = mx.random.key(sampling.seed % SEED_SPACE)
    inv_temp = 1.0 / sampling.temperature

    def seeded(logprobs: mx.array) -> mx.array:
        nonlocal key
        if 0.0 < sampling.top_p < 1.0:
            logprobs = apply_top_p(logprobs, sampling.top_p)
        if sampling.min_p > 0.0:
            logprobs = apply_min_p(logprobs, sampling.min_p)
        if top_k > 0:
            logprobs = apply_top_k(logprobs, top_k)
        key, sub = mx.random.split(key)
        return mx.random.categorical(logprobs * inv_temp, key=sub)

    return seeded


@dataclass
class Request:
    """One request's state on the MLX thread."""

    request_id: str
    uid: int
    prompt_len: int
    sampling: SamplingParams
    detokenizer: Any
    stops: StopStringFilter
    stop_ids: frozenset[int]
    added_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    generated: int = 0
    cached_tokens: int = 0
    # Prefix cache: the chain hashes of the prompt's full blocks, and how many leading blocks
    # are already stored (from cache, or cut at a boundary this request crossed); the root of
    # its chains (its namespace's: ``prefix.namespace_root``).
    hashes: list[str] = field(default_factory=list)
    stored: int = 0
    root: str = ""
    # Sliding-window models: per block not cut yet, the window layers' KV of its tokens, taken
    # in the step that completed it (``Engine._take_windows``; a sliding layer drops them
    # later), and how many leading blocks have theirs.
    windows: dict[int, list[Any]] = field(default_factory=dict)
    windows_upto: int = 0
    # Reads tool calls and reasoning out of a chat answer (None: the text is all content).
    parser: OutputParser | None = None
    reasoning_tokens: int = 0
    # The grammar's logits processor (None: unconstrained), which says when it cannot go on.
    grammar: GrammarProcessor | None = None
