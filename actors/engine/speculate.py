"""Prompt-lookup (n-gram) drafts for speculative decoding, per decoding sequence.

An agent's answer repeats much of what it was shown: a file echoed back with an edit, a patch
quoting its context, JSON restating a schema. For each decoding sequence the drafter finds the
last few tokens earlier in its prompt and answer (the longest of ``NGRAM_SIZES`` first, the
latest occurrence) and proposes the tokens that followed them; the step verifies them in the
same forward pass as its decode token (``Runner._decode``), and a greedy row keeps the longest
prefix its own argmax agrees with, so the output is what decoding without drafts gives.

No model, no MLX: an index per sequence from each n-gram to where it last ended, grown by the
tokens each step appends (a dict update per token and size).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# The n-gram lengths looked up, longest first: a match of 3 tokens predicts better than one of
# 2, and one token alone predicts too little to be worth a verification.
NGRAM_SIZES = (4, 3, 2)
# Most tokens one row drafts a step, and where its draft length starts: the step verifies
# every position of the longest row's draft for every row.
MAX_DRAFT = 6
# Most steps a sequence drafts nothing after drafts it kept nothing of.
MAX_PAUSE = 32


class DraftLength:
    """How much a sequence drafts, adapted to how much of its last drafts was accepted: the
    part every kind of drafter shares (prompt lookup here, a draft model in
    ``draft_model``)."""

    # The distributions the last draft's tokens were drawn from, one row each (a draft
    # model's, for a sampling row: ``RowSampler.verify``); None: each proposed for sure.
    proposed: Any = None

    def __init__(self) -> None:
        # Draft length, adapted to how much of the last drafts was accepted.
        self.length = MAX_DRAFT
        self.drafted = 0
        self.accepted = 0
        # After drafts of which nothing was kept, the next few steps draft nothing (twice as
        # many after each such draft, up to ``MAX_PAUSE``): where the text does not repeat
        # (prose), a draft is a position the step computes for nothing.
        self._misses = 0
        self._pause = 0

    def allowance(self, most: int) -> int:
        """How many tokens to draft this step, ``most`` at the most: none while paused (a
        step of the pause passes), else up to the adapted length."""
        if self._pause > 0:
            self._pause -= 1
            return 0
        return max(0, min(most, self.length))

    def verified(self, drafted: int, accepted: int) -> None:
        """How many of a draft's tokens the step accepted: a row whose drafts keep failing
        drafts less (down to one token) and, after drafts of which nothing was kept, not at
        all for 2, 4, ... up to ``MAX_PAUSE`` steps; one whose drafts are taken whole drafts
        more."""
        self.drafted += drafted
        self.accepted += accepted
        if accepted == 0:
            self._misses += 1
            self._pause = min(2 ** self._misses, MAX_PAUSE)
        else:
            self._misses = 0
        if accepted == drafted:
            self.length = min(MAX_DRAFT, self.length + 1)
        else:
            self.length = max(1, accepted + 1)


class Drafter(DraftLength):
    """One sequence's n-gram index over the tokens it holds (prompt, answer so far)."""

    def __init__(self) -> None:
        super().__init__()
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in NGRAM_SIZES}
        self._tokens: list[int] = []

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens (the sequence's next ones): each n-gram that now has a follower is
        indexed at the position after it."""
        own = self._tokens
        for t in tokens:
            own.append(t)
            end = len(own) - 1  # the n-grams ending here are followed by ``t``
            for n in NGRAM_SIZES:
                if end >= n:
                    self._index[n][tuple(own[end - n:end])] = end

    def sync(self, tokens: Sequence[int], more: Sequence[int] = ()) -> None:
        """Catch up with the sequence's tokens, ``tokens`` then ``more`` (a prefix of which
        it has seen), without joining the two."""
        seen = len(self._tokens)
        if len(tokens) > seen:
            self.extend(tokens[seen:])
            seen = len(self._tokens)
        past = seen - len(tokens)  # of ``more``, those seen
        if len(more) > past:
            self.extend(more[past:])

    def draft(self, last: int, most: int) -> list[int]:
        """Up to ``min(most, self.length)`` tokens expected after the indexed tokens and then
        ``last`` (the row's next input): what followed the latest earlier occurrence of the
        longest n-gram ending in ``last``."""
        most = self.allowance(most)
        if most <= 0:
            return []
        own = self._tokens
        for n in NGRAM_SIZES:
            if len(own) < n - 1:
                continue
            key = (*own[len(own) - n + 1:], last) if n > 1 else (last,)
            at = self._index[n].get(key)
            if at is not None:
                draft = own[at:at + most]
                # An image's tokens (negative ids: actors/engine/vision.py) are never drafted.
                cut = next((i for i, t in enumerate(draft) if t < 0), len(draft))
                return draft[:cut]
        return []
