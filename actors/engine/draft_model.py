"""Drafts from a smaller model of the same vocabulary (``--draft-model``), per decoding row.

Where an answer does not repeat what it was shown, prompt lookup (``speculate.Drafter``) finds
nothing to draft; a small model of the same family (Qwen3-0.6B for Qwen3-32B, Llama-3.2-1B for
Llama-3.3-70B) guesses the next tokens of most text well. Each decoding row that drafts has a
``ModelDrafter``: the draft model's own cache of that row's tokens, which follows the row
whatever happens to it (a prefix-cache hit, a rejected draft, tokens a hybrid row carries) by
keeping the longest prefix it shares with the row's tokens and running the rest. A new row
starts from a copy of the cache of the latest rows' (``DraftModel.KEEP``) that shares the
longest prefix with it: an agent's next turn repeats the conversation so far, which the draft
model then does not run again.

A greedy row's draft is the draft model's greedy continuation, and the row keeps what its own
argmax agrees with. A sampling row's draft is drawn from the draft model under the row's own
temperature and filters, and the step keeps each token with probability min(1, p/q) and draws
the first refused one from the residual (speculative sampling, ``RowSampler.verify``). So the
answers are what decoding without drafts gives (greedy) or are distributed as it is
(sampling), whatever the draft model says. Everything here runs on the scheduler's MLX thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from troupe.actors.engine.speculate import DraftLength


class DraftModelError(ValueError):
    """A draft model that cannot draft for the served model (told at start)."""


def vocabulary(tokenizer: Any) -> dict[str, int]:
    """A tokenizer's vocabulary, token to id, added tokens included."""
    return dict(tokenizer.get_vocab())


def check_draft_model(name: str, model: Any, tokenizer: Any, main_name: str,
                      main_tokenizer: Any) -> None:
    """Refuse a draft model whose tokens are not the served model's (the same ids for the
    same strings, every one) or whose cache cannot take back a rejected draft's positions
    (sliding-window or recurrent layers)."""
    ours, theirs = vocabulary(main_tokenizer), vocabulary(tokenizer)
    if ours != theirs:
        differ = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda kv: kv[1])
        example = ", ".join(f"{t!r}: {i}" for t, i in differ[:3])
        raise DraftModelError(
            f"draft model {name} does not share {main_name}'s vocabulary ({len(theirs)} "
            f"tokens against {len(ours)}; e.g. {example}): a draft model must use the same "
            "tokenizer")
    if not can_trim_prompt_cache(make_prompt_cache(model)):
        raise DraftModelError(
            f"draft model {name} keeps a cache that cannot take back positions (sliding-window "
            "or recurrent layers): a draft model needs plain attention layers")


class DraftModel:
    """A loaded draft model: makes each drafting row's ``ModelDrafter``.

    ``vocab``: tokens of the served model's vocabulary (a draft is cut at an id past it: a
    padded head's extra rows are no tokens). ``catch_up``: the most of a row's tokens its
    draft cache takes in one step (its prompt, the first time), so that a long prompt's catch
    up spreads over steps as a prefill's chunks do; the row drafts once caught up."""

    # The latest rows' drafters whose caches a new row may start from: a finished row's
    # cache is held until newer rows push it out or the engine idles (``forget``).
    KEEP = 4

    def __init__(self, model: Any, *, vocab: int, catch_up: int) -> None:
        self.model = model
        self.vocab = vocab
        self.catch_up = max(1, catch_up)
        self.passes = 0  # the draft model's forward passes
        self.reused = 0  # tokens new rows took from an earlier row's cache
        self._recent: deque[ModelDrafter] = deque(maxlen=self.KEEP)

    def drafter(self, sampler: Any = None) -> ModelDrafter:
        """A row's drafter; ``sampler``: a sampling row's (``RowSampler``), whose draws the
        draft model's make (None: a greedy row, drafted greedily)."""
        drafter = ModelDrafter(self, sampler)
        self._recent.append(drafter)
        return drafter

    def forget(self) -> None:
        """Let go of the finished rows' caches (an idle engine gives its memory back); the
        rows still decoding hold their own."""
        self._recent.clear()

    def start(self, drafter: ModelDrafter, context: list[int]) -> None:
        """A new row's drafter takes a copy of the cache of the latest row's that shares the
        longest prefix with ``context`` (the part past it is trimmed when the row drafts)."""
        best, shared = None, 0
        for other in self._recent:
            if other is drafter or not other.fed:
                continue
            n = _shared(other.fed, context)
            if n > shared:
                best, shared = other, n
        if best is None:
            return
        # Slices are new arrays: the other row's later writes into its buffers do not reach
        # the copy.
        drafter.cache = make_prompt_cache(self.model)
        for mine, theirs in zip(drafter.cache, best.cache, strict=True):
            mine.state = tree_map(lambda x: x[...] if isinstance(x, mx.array) else x,
                                  theirs.state)
        drafter.fed = list(best.fed)

    def run(self, tokens: list[int], cache: list[Any]) -> mx.array:
        """``tokens`` through the draft model after what ``cache`` holds; the logits of the
        last."""
        self.passes += 1
        return self.model(mx.array([tokens], dtype=mx.uint32), cache=cache)[0, -1]


class ModelDrafter(DraftLength):
    """One row's drafts from the draft model, and the draft model's cache of the row."""

    def __init__(self, draft: DraftModel, sampler: Any = None) -> None:
        super().__init__()
        self._draft = draft
        self._sampler = sampler
        self.cache = make_prompt_cache(draft.model)
        self.fed: list[int] = []  # the tokens in ``cache``
        self._tokens: Sequence[int] = ()
        self._more: Sequence[int] = ()

    def sync(self, tokens: Sequence[int], more: Sequence[int] = ()) -> None:
        """The row's tokens now: those in its cache, then those it carries."""
        self._tokens, self._more = tokens, more

    def draft(self, last: int, most: int) -> list[int]:
        """Up to ``most`` tokens (fewer as drafts fail: ``DraftLength``) the draft model
        expects after the row's tokens and ``last`` (its next input); none while the draft
        cache is still catching up with a long prompt (``DraftModel.catch_up`` tokens a
        step)."""
        most = self.allowance(most)
        if most <= 0:
            return []
        context = [*self._tokens, *self._more, last]
        todo = self._catch_up(context)
        if todo is None:
            return []
        draft = self._draft
        logits = draft.run(todo, self.cache)
        self.fed += todo
        out: list[int] = []
        proposed = []
        while True:
            if self._sampler is None:
                t = int(mx.argmax(logits).item())
            else:
                t, q = self._sampler.draw(logits - mx.logsumexp(logits, keepdims=True))
                proposed.append(q)
            if t >= draft.vocab:
                proposed = proposed[:len(out)]
                break
            out.append(t)
            if len(out) == most:
                break
            logits = draft.run([t], self.cache)
            self.fed.append(t)
        self.proposed = mx.stack(proposed) if proposed and out else None
        return out

    def keep_pace(self) -> None:
        """While the row prefills: run what the draft cache lacks of the row's tokens (at
        most ``DraftModel.catch_up`` a step), so that the row drafts from its first decode
        step."""
        todo = self._catch_up([*self._tokens, *self._more], last=False)
        if todo:
            self._feed(todo)

    def _catch_up(self, context: list[int], last: bool = True) -> list[int] | None:
        """Follow ``context`` (``_follow``; ``last``: keeping its last token to run, whose
        logits a draft starts from); when more than ``catch_up`` tokens are left to run, run
        that many and return None (not caught up), else return what is left."""
        if not context:
            return None
        draft = self._draft
        fresh = not self.fed
        if fresh:
            draft.start(self, context)
        todo = self._follow(context, last)
        if fresh:
            draft.reused += len(self.fed)
        if len(todo) <= draft.catch_up:
            return todo
        self._feed(todo[:draft.catch_up])
        return None

    def _feed(self, tokens: list[int]) -> None:
        """Run ``tokens`` into the draft cache, evaluated (no logits wanted)."""
        self._draft.run(tokens, self.cache)
        mx.eval([c.state for c in self.cache])
        self.fed += tokens

    def _follow(self, context: list[int], last: bool = True) -> list[int]:
        """Trim the draft cache to the longest prefix it shares with ``context`` (``last``:
        keeping at least the last token to run, whose logits the draft starts from); the
        tokens of ``context`` it does not hold."""
        fed = self.fed
        common = min(_shared(fed, context), len(context) - last)
        if len(fed) > common:
            trim_prompt_cache(self.cache, len(fed) - common)
            del fed[common:]
        return context[common:]


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
