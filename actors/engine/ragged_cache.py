"""A decode batch's KV cache kept as groups of rows of similar length (``RaggedKVCache``),
so a long prompt joining short conversations neither pads nor copies them all."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache


class RaggedKVCache:
    """One layer's KV cache of a decode batch, kept as groups of rows of similar length.

    mlx-lm's ``BatchKVCache`` holds a batch as one left-padded array: when a 2,000-token
    prompt joins eight 200-token conversations, all nine rows are padded to 2,000 (a copy of
    the whole cache as it joins) and every decode step attends over 2,000 positions for each
    of them. Here a joining batch becomes a group of its own unless merging costs little
    padding; attention runs per group (``mixed_forward``) while the projections still take
    every row at once. Rows are the groups' rows in order, which ``batch.Rows``'s
    order-keeping ``extend`` (append) and ``filter`` (sorted indices) preserve.
    """

    def __init__(self, groups: list[Any] | None = None) -> None:
        self.groups: list[Any] = [g for g in (groups or []) if _rows(g)]

    @classmethod
    def wrap(cls, cache: Any) -> RaggedKVCache:
        return cache if isinstance(cache, RaggedKVCache) else cls([cache] if cache else [])

    def spans(self) -> list[tuple[int, int, Any]]:
        """(first row, end row, group cache) of each group, in row order."""
        out, at = [], 0
        for g in self.groups:
            n = _rows(g)
            out.append((at, at + n, g))
            at += n
        return out

    def extend(self, other: Any) -> None:
        for g in RaggedKVCache.wrap(other).groups:
            if self.groups and _merge_is_cheap(self.groups[-1], g):
                _merge_into(self.groups[-1], g)
            else:
                self.groups.append(g)
        self._bound_groups()

    def filter(self, keep: list[int]) -> None:
        kept = []
        for first, end, g in self.spans():
            local = [i - first for i in keep if first <= i < end]
            if not local:
                continue
            if len(local) < end - first:
                g.filter(local)
            if kept and _merge_is_cheap(kept[-1], g):
                _merge_into(kept[-1], g)  # e.g. the long row between them finished
            else:
                kept.append(g)
        self.groups = kept

    def _bound_groups(self) -> None:
        """At most MAX_GROUPS groups: merge the neighbours whose merge pads least."""
        while len(self.groups) > MAX_GROUPS:
            i = min(range(len(self.groups) - 1),
                    key=lambda j: _padding_cost(self.groups[j], self.groups[j + 1]))
            _merge_into(self.groups[i], self.groups.pop(i + 1))

    def extract(self, idx: int) -> Any:
        for first, end, g in self.spans():
            if first <= idx < end:
                return g.extract(idx - first)
        raise IndexError(idx)

    @property
    def state(self) -> list[Any]:
        return [g.state for g in self.groups]

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    def size(self) -> int:
        return max((g.size() for g in self.groups), default=0)

    def empty(self) -> bool:
        return all(g.empty() for g in self.groups)


# A decode batch keeps at most this many groups (each costs a few small ops per layer), and a
# joining group merges into the last one when padding it costs at most this many positions
# per row of attention beyond what the two groups hold.
MAX_GROUPS = 4
MERGE_SLACK = 128


def _rows(cache: Any) -> int:
    return 0 if cache is None else int(cache.offset.shape[0])


def _padding_cost(a: Any, b: Any) -> int:
    """Positions of attention per step that merging ``a`` and ``b`` adds (padding)."""
    na, nb = _rows(a), _rows(b)
    return (na + nb) * max(a.size(), b.size()) - na * a.size() - nb * b.size()


def _merge_is_cheap(a: Any, b: Any) -> bool:
    return _padding_cost(a, b) <= MERGE_SLACK * (_rows(a) + _rows(b))


def _merge_into(a: Any, b: Any) -> None:
    """``a.extend(b)`` for two ``BatchKVCache`` groups, as mlx-lm's (rows right-justified at
    the longer one's length, in a buffer as large as the larger of the two), writing only
    the positions in use into one new buffer. mlx-lm's pads each whole buffer and then
    concatenates the padded copies: the join of eight short prompts to eight decoding
    streams spent ~170 ms of its step there (default model, ~80 positions in buffers of 256)."""
    if type(a) is not BatchKVCache or type(b) is not BatchKVCache or a.keys is None \
            or b.keys is None:
        a.extend(b)
        return
    na, nb = _rows(a), _rows(b)
    ia, ib = a.size(), b.size()  # the positions in use (the buffers have room to grow)
    top = max(ia, ib)
    size = max(a.keys.shape[2], b.keys.shape[2])
    merged = []
    for xa, xb in ((a.keys, b.keys), (a.values, b.values)):
        out = mx.zeros((na + nb, *xa.shape[1:2], size, xa.shape[3]), xa.dtype)
        out[:na, :, top - ia:top, :] = xa[..., :ia, :]
        out[na:, :, top - ib:top, :] = xb[..., :ib, :]
        merged.append(out)
    # ``state`` is (keys, values, offset, left padding, positions in use).
    a.state = (*merged, mx.concatenate([a.offset, b.offset]),
               mx.concatenate([a.left_padding + (top - ia), b.left_padding + (top - ib)]), top)
