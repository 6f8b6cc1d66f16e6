"""One request's state on the MLX thread, and the sampler made for it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, greedy_sampler, make_sampler

from troupe.actors.engine.agent_output import OutputParser
from troupe.actors.engine.grammar import GrammarProcessor
from troupe.actors.engine.output import StopStringFilter
from troupe.actors.messages import SamplingParams

# mx.random.key takes an unsigned 64-bit seed; any integer a request sends wraps into it.
SEED_SPACE = 1 << 64


def make_request_sampler(sampling: SamplingParams) -> Callable[[mx.array], mx.array]:
    """The sampler for one request. Greedy requests share one function so the batch samples
    in one call; a seeded request carries its own PRNG key so its draws do not depend on the
    other requests in the batch. A sampling request's sampler also verifies drafts
    (``RowSampler.verify``)."""
    if sampling.temperature == 0:
        return greedy_sampler
    return RowSampler(sampling)


class RowSampler:
    """One sampling request's draws: temperature, top_p, min_p and top_k as mlx-lm's
    ``make_sampler`` applies them (with its own PRNG key when the request is seeded).

    A ``top_k`` at or past the vocabulary keeps every token, as no ``top_k`` does. mlx-lm
    raises on it instead, inside a function compiled over MLX's global random state, which
    that leaves unusable: every later sampled request of the process failed. The vocabulary
    is known from the first logits, so the top_k is settled then."""

    def __init__(self, sampling: SamplingParams) -> None:
        self.sampling = sampling
        self.inv_temp = 1.0 / sampling.temperature
        self.key = None if sampling.seed is None else mx.random.key(sampling.seed % SEED_SPACE)
        self._plain: Callable[[mx.array], mx.array] | None = None
        self._top_k: int | None = None

    def _settle(self, vocab: int) -> int:
        if self._top_k is None:
            self._top_k = self.sampling.top_k if self.sampling.top_k < vocab else 0
            if self.key is None:
                s = self.sampling
                self._plain = make_sampler(temp=s.temperature, top_p=s.top_p, min_p=s.min_p,
                                           top_k=self._top_k)
        return self._top_k

    def _scaled(self, logprobs: mx.array) -> mx.array:
        """The logits the draw is made from: filtered, then divided by the temperature."""
        s, top_k = self.sampling, self._settle(logprobs.shape[-1])
        if 0.0 < s.top_p < 1.0:
            logprobs = apply_top_p(logprobs, s.top_p)
        if s.min_p > 0.0:
            logprobs = apply_min_p(logprobs, s.min_p)
        if top_k > 0:
            logprobs = apply_top_k(logprobs, top_k)
        return logprobs * self.inv_temp

    def _subkey(self) -> mx.array | None:
        if self.key is None:
            return None
        self.key, sub = mx.random.split(self.key)
        return sub

    def __call__(self, logprobs: mx.array) -> mx.array:
        self._settle(logprobs.shape[-1])
        if self._plain is not None:
            return self._plain(logprobs)
        return mx.random.categorical(self._scaled(logprobs), key=self._subkey())

    def draw(self, logprobs: mx.array) -> tuple[int, mx.array]:
        """A token drawn from another model's log-probabilities (a draft model's) as this
        request draws from its own, and the distribution it was drawn from."""
        scaled = self._scaled(logprobs)
        return (mx.random.categorical(scaled, key=self._subkey()).item(),
                mx.softmax(scaled, axis=-1, precise=True))

    def verify(self, logprobs: mx.array, draft: list[int],
               proposed: mx.array | None = None) -> list[int]:
        """The tokens this request takes from a draft: ``logprobs`` [len(draft) + 1, vocab]
        are the model's at the row's input and after each draft token; ``proposed``
        [len(draft), vocab'] the distributions the draft tokens were drawn from (``draw``;
        None: each proposed for sure, as a lookup draft is). Speculative sampling: draft token
        j is kept with probability min(1, p(x) / q(x)) under the row's distribution p at j;
        the first one not kept is replaced by a draw from the residual max(0, p - q) (p
        without the token, for a sure proposal); all kept, one more is drawn after them. The
        tokens are then distributed exactly as drawing one a step would give."""
        scaled = self._scaled(logprobs)
        n = len(draft)
        kept = n
        q = None
        if n:
            probs = mx.softmax(scaled[:n], axis=-1, precise=True)
            at = (mx.arange(n), mx.array(draft))
            chance = probs[at]
            if proposed is not None:
                width = probs.shape[-1]
                q = proposed[:, :width]
                if q.shape[-1] < width:  # a draft head narrower than ours proposes none there
                    q = mx.pad(q, [(0, 0), (0, width - q.shape[-1])])
                chance = mx.minimum(chance / q[at], 1.0)
            u = mx.random.uniform(shape=(n,), key=self._subkey())
            mx.eval(chance, u)
            kept = next((j for j, (p, x) in enumerate(zip(chance.tolist(), u.tolist(),
                                                          strict=True)) if x >= p), n)
        row = scaled[kept]
        if kept < n and q is not None:  # the residual of the draft's distribution
            row = mx.log(mx.maximum(probs[kept] - q[kept], 0.0))
        elif kept < n:  # the distribution without the refused token
            row = mx.where(mx.arange(row.shape[-1]) == draft[kept],
                           mx.array(-float("inf"), row.dtype), row)
        token = mx.random.categorical(row, key=self._subkey())
        return [*draft[:kept], token.item()]


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
