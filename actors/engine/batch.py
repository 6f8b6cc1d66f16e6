"""Troupe's own batch: each request's ``Sequence``, and ``Rows``, a set of sequences whose
caches are batched (one per layer) with mlx-lm's public cache classes.

The runner keeps two sets of rows: the sequences reading their prompt (prefilling) and those
generating (decoding). A step may move rows from the first to the second (``Rows.take`` then
``Rows.extend``); a finished or aborted sequence leaves its rows (``Rows.filter``).
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, TokenBuffer, dynamic_roll

from troupe.actors.engine.mrope import Placement
from troupe.actors.engine.ragged_cache import RaggedKVCache
from troupe.actors.engine.speculate import DraftLength


class Status(enum.Enum):
    """Where a sequence stands."""

    WAITING = "waiting"  # queued, its cache its own (a prefix hit, or empty)
    PREFILLING = "prefilling"  # a row of the prefill rows, reading its prompt in chunks
    DECODING = "decoding"  # a row of the decode rows, a token a step
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request as the batch sees it: its prompt still to run, the tokens in its cache, how
    it samples and when it stops."""

    uid: int  # arrival order, the same on every rank of a sharded model
    # The prompt still to run, split where prefix blocks are cut; the last prompt token is a
    # segment of its own (it runs with the chunk before it, or as the first decode input).
    segments: list[list[int]]
    total: int  # uncached prompt tokens when it was added
    tokens: list[int]  # the tokens in its cache
    cache: list[Any] | None  # its own per-layer cache while waiting; None once in rows
    sampler: Callable[[mx.array], mx.array]
    processors: tuple[Any, ...]
    stop_ids: frozenset[int]
    max_tokens: int
    done: int = 0  # prompt tokens of ``total`` run so far
    generated: int = 0  # tokens sampled
    next_input: int | None = None  # the token its next decode step runs
    # A hybrid model's row after a rejected draft: the tokens it answered (and its input
    # before them) whose recurrent state its cache lost with the draft's. Its next step runs
    # them again, before its next input; ``tokens`` holds them only then.
    carried: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    # The tokens its logits processors see (made when it first samples, if it has any).
    context: TokenBuffer | None = field(default=None, repr=False)
    # Its drafter (speculative decoding: n-gram lookup, or a draft model's cache of it; made
    # when it first decodes with drafts on).
    drafter: DraftLength | None = field(default=None, repr=False)
    speculative: bool = True  # False: the request turned drafts off
    # Its images by key (``vision.image_key``): as admission sent them (``ImageInput``) until
    # their tokens first run, then their tokens' embeddings.
    images: dict[int, Any] = field(default_factory=dict, repr=False)
    # Its prompt's M-RoPE positions (``mrope``; None: its tokens sit at their indices).
    placement: Placement | None = field(default=None, repr=False)

    @property
    def remaining(self) -> int:
        """Prompt tokens still to run."""
        return sum(len(s) for s in self.segments)


def split_last(segments: list[list[int]]) -> list[list[int]]:
    """The prompt's segments with its last token made a segment of its own (the empty ones
    dropped): that token runs in the chunk before it (``schedule.chunk_of``) or as the first
    input of a decode step."""
    out = [s for s in segments if s]
    if not out:
        raise ValueError("a sequence needs at least one prompt token to run")
    if len(out[-1]) != 1:
        out[-1:] = [out[-1][:-1], out[-1][-1:]]
    return out


def merge_caches(caches: list[list[Any]]) -> list[Any]:
    """Per-sequence caches (each a list of layers) as one batch cache per layer, by each
    layer's own ``merge``. One sequence whose layers are all filled ``KVCache``s keeps its
    arrays (``as_batch``): a merge would copy them into a buffer of exactly their length,
    which the next token then outgrows into a third copy (~90 MB each for a 2,000-token prefix
    of the default model)."""
    if len(caches) == 1 and all(type(c) is KVCache and c.keys is not None for c in caches[0]):
        return [as_batch(c) for c in caches[0]]
    return [type(layer[0]).merge(list(layer)) for layer in zip(*caches, strict=True)]


def as_batch(cache: KVCache) -> BatchKVCache:
    """A one-row ``BatchKVCache`` on a ``KVCache``'s own buffers (no padding, no copy)."""
    out = BatchKVCache([0])
    # ``state``: keys, values, each row's offset, its left padding, the positions in use.
    out.state = (cache.keys, cache.values, mx.array([cache.offset]), out.left_padding,
                 cache.offset)
    return out


def roll_right_padding(cache: Any, padding: list[int]) -> None:
    """A chunk's right padding rolled to the left of each row (``BatchKVCache.finalize`` for a
    cache prepared with ``padding``), rolling only the positions in use: mlx-lm's rolls the
    whole buffer, room to grow included (a gather, ~2x the time here for eight short prompts
    in buffers of 256). Other cache kinds were prepared for it and finalize themselves."""
    if type(cache) is not BatchKVCache or cache.keys is None:
        cache.finalize()
        return
    n = cache.size()
    pad = mx.array(padding)
    rolled = []
    for x in (cache.keys, cache.values):
        r = dynamic_roll(x[..., :n, :], pad[:, None], axis=2)
        rolled.append(mx.concatenate([r, x[..., n:, :]], axis=2) if x.shape[2] > n else r)
    cache.state = (*rolled, cache.offset - pad, cache.left_padding + pad, n)


# Room a prompt's cache grows by while it is shorter than mlx-lm's step (256 positions, the
# room it grows by after that, and once the sequence decodes: growing by 64 past it, a long
# prompt prefilled in budgeted chunks of ~60 tokens copied its whole cache every step). A
# chunk writes into a buffer grown to fit it, and the right padding of a batch of chunks is
# then rolled over it (``roll_right_padding``): for eight chat prompts of ~50 tokens, 64
# positions of room instead of 256 took these copies from ~100 to ~45 ms of a ~1 s prefill
# step (default model).
PROMPT_CACHE_STEP = 64


class Rows:
    """Sequences whose caches are batched, row i of every layer's cache being ``seqs[i]``'s.

    ``decode``: the rows generate (their caches grow by mlx-lm's room, not a prompt's).
    ``ragged`` (the decode rows of a one-pass model, ``forward.mixed_forward`` reads them):
    the rows' plain KV layers are kept as ``RaggedKVCache`` groups, unless a layer is another kind
    (a rotating, sliding-window one): each ``RaggedKVCache`` groups rows by its own layer's
    sizes, and a rotating cache's stop at its window, so the layers would group the rows
    differently. Those rows stay one group (mlx-lm's batch caches)."""

    def __init__(self, *, decode: bool = False, ragged: bool = False) -> None:
        self.seqs: list[Sequence] = []
        self.cache: list[Any] = []
        self.decode = decode
        self.ragged = ragged

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def uids(self) -> list[int]:
        return [s.uid for s in self.seqs]

    def index(self, uid: int) -> int | None:
        return next((i for i, s in enumerate(self.seqs) if s.uid == uid), None)

    def extend(self, other: Rows) -> None:
        """Append ``other``'s rows (their caches joined layer by layer)."""
        if not other.seqs:
            return
        cache = other.cache
        if self.decode:
            # Decoding caches grow by mlx-lm's room again (a prompt's grew by less: growing by
            # 64 positions, every stream copied its cache four times as often).
            for c in cache:
                if type(c) is BatchKVCache:
                    vars(c).pop("step", None)
        if self.ragged and cache and all(type(c) is BatchKVCache for c in cache):
            if not self.cache:
                self.cache = [RaggedKVCache() for _ in cache]
            else:
                self.cache = [RaggedKVCache.wrap(c) for c in self.cache]
        if not self.cache:
            self.cache = cache
        elif cache:
            for mine, theirs in zip(self.cache, cache, strict=True):
                mine.extend(theirs)
        self.seqs.extend(other.seqs)

    def filter(self, keep: list[int]) -> None:
        """Keep the rows ``keep`` (sorted indices)."""
        self.seqs = [self.seqs[i] for i in keep]
        if not keep:
            self.cache = []
        elif self.cache:
            for c in self.cache:
                c.filter(keep)

    def take(self, indices: list[int]) -> Rows:
        """Rows ``indices`` (sorted) moved out into rows of their own, without copying the
        rest's cache: taken whole when they are all the rows, else filtered out of shallow
        copies of the layer caches (``filter`` replaces their arrays, not changes them)."""
        part = Rows(decode=self.decode, ragged=self.ragged)
        if len(indices) == len(self.seqs):
            part.seqs, part.cache = self.seqs, self.cache
            self.seqs, self.cache = [], []
            return part
        part.seqs = list(self.seqs)
        part.cache = [copy.copy(c) for c in self.cache]
        part.filter(indices)
        self.filter([i for i in range(len(self.seqs)) if i not in set(indices)])
        return part

    def extract(self, i: int, layers: Container[int] | None = None) -> list[Any]:
        """Row ``i``'s cache, per layer (only ``layers`` when given, None for the others), as
        one sequence's own."""
        return [c.extract(i) if layers is None or n in layers else None
                for n, c in enumerate(self.cache)]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache)
