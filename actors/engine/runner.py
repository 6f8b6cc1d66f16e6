"""The runner: troupe's batch on the MLX thread, stepped under the schedule's plans.

It owns the sequences (``batch.Sequence``) waiting, prefilling and decoding, their batched
caches (``batch.Rows``), and the step: one forward pass of the decode rows and the prefill
chunk together for the architectures ``forward.supports_mixed`` names, the model's own call
for every other, and the sampling of each row's logits with the request's sampler and logits
processors (mlx-lm's public ``sample_utils``). What is waiting, prefilling and decoding is
handed to ``schedule`` as plain numbers.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Container, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    TokenBuffer,
    make_prompt_cache,
)
from mlx_lm.sample_utils import greedy_sampler
from mlx_lm.utils import maybe_set_recommended_wired_limit

from troupe.actors.engine.batch import (
    PROMPT_CACHE_STEP,
    Rows,
    Sequence,
    Status,
    merge_caches,
    roll_right_padding,
    split_last,
)
from troupe.actors.engine.config import EngineConfig, speculation
from troupe.actors.engine.draft_model import DraftModel
from troupe.actors.engine.forward import forward, supports_mixed
from troupe.actors.engine.memory_estimate import Member
from troupe.actors.engine.ragged_cache import RaggedKVCache
from troupe.actors.engine.schedule import (
    Pending,
    SchedulerOutput,
    StepState,
    max_decoding,
    name_tokens,
)
from troupe.actors.engine.speculate import MAX_DRAFT, Drafter
from troupe.actors.engine.vision import VisionTower, split_image_token
from troupe.actors.mlx_lm_private import in_temporal_order, patch_models

# Every this many decode steps MLX's allocator cache is given back (as mlx-lm's generator).
CLEAR_CACHE_STEPS = 512
# Most decoding rows a step verifies drafts for: every row then runs as many positions as the
# longest draft, which a batch of many rows pays in compute for little gain.
SPECULATE_ROWS = 4


class Prefilled(NamedTuple):
    """A prefilling sequence's progress in a step: prompt tokens run of its uncached prompt,
    whether its chunk ended a segment (a place its blocks are cut), and its prompt."""

    uid: int
    progress: tuple[int, int]
    end_of_segment: bool
    end_of_prompt: bool


class Sampled(NamedTuple):
    """A token a step sampled for a sequence. A sequence that finished (``finish_reason``
    "length" or "stop") left the batch with its cache and the tokens in it."""

    uid: int
    token: int
    logprobs: mx.array
    finish_reason: str | None
    prompt_cache: list[Any] | None
    all_tokens: list[int] | None


class ModelOutput(NamedTuple):
    """What one step did: the prefilling sequences' progress, the tokens sampled, the prompt
    tokens it ran through the model, how many sequences decoded, its wall time in seconds,
    and the drafted tokens it verified."""

    prompt_responses: list[Prefilled]
    responses: list[Sampled]
    prefilled: int
    decoding: int
    wall: float
    drafted: int = 0


class _Chunk(NamedTuple):
    """A prefill chunk as one forward pass takes it: the rows' tokens, right padded to the
    longest, each row's padding, and the flattened rows that end a prompt."""

    tokens: mx.array
    padding: list[int]
    ends: list[int]


class Batch:
    """The sequences of one batch: waiting (in the order they start), prefilling rows and
    decoding rows. Row caches are ragged (``RaggedKVCache``) for a one-pass model."""

    def __init__(self, ragged: bool) -> None:
        self.waiting: deque[Sequence] = deque()
        self.prefill = Rows()
        self.decode = Rows(decode=True, ragged=ragged)
        self.next_uid = 0
        self.decode_steps = 0


class Runner:
    """The batch on the MLX thread: sequences join (``insert``), leave (``remove``), and
    step (``execute``) under a plan."""

    # With mixed steps, a prompt's first token is sampled from the chunk that runs its last
    # prompt token (False: that token waits for a decode step, one step later; for
    # benchmarks/bench_first_token.py's comparison).
    first_token_in_chunk = True

    def __init__(self, model: Any, config: EngineConfig, stream: Any = None,
                 vision: VisionTower | None = None, draft: DraftModel | None = None) -> None:
        patch_models()  # mlx-lm's batching bugs troupe fixes (actors/mlx_lm_private.py)
        self.model = model
        self.config = config
        self.stream = stream or generation_stream
        # A vision-language model's tower: its images' tokens run through the model's own
        # call (the one-pass step reads token ids only).
        self.vision = vision
        self.mixed = config.mixed_step and supports_mixed(model) and vision is None
        mode = speculation(config)
        self.speculative = mode != "off"
        # The draft model (``--draft-model``; the scheduler loads it for a chat model only);
        # None: rows draft by prompt lookup.
        self.draft = draft if mode == "draft" else None
        self.drafts = 0  # rows' drafts verified
        self.drafted = 0  # their tokens
        self.accepted = 0  # of them, kept
        # Hybrid models: rows whose recurrent state went back after a rejected draft.
        self.restored = 0
        self._old_wired_limit = maybe_set_recommended_wired_limit()
        self.batch = Batch(self.mixed)

    # -- who is in the batch ---------------------------------------------------------------

    def insert(self, segments: list[list[int]], *, max_tokens: int, cache: Any,
               done: list[int], sampler: Any, processors: list[Any],
               stop_ids: frozenset[int], speculative: bool = True,
               images: dict[int, Any] | None = None) -> int:
        """Queue one sequence: its prompt still to run, in ``segments`` (split where blocks
        must be cut), after ``done`` tokens already in ``cache``; ``speculative``: whether
        it may take drafts; ``images``: the images whose tokens its prompt holds, by key
        (``messages.ImageInput``). Returns its uid."""
        uid = self._insert(self.batch, segments, max_tokens=max_tokens, cache=cache,
                           done=done, sampler=sampler, processors=processors,
                           stop_ids=stop_ids, speculative=speculative)
        if images:
            seq = self.batch.waiting[-1]
            seq.images = dict(images)
            if self.vision is not None and self.vision.mrope is not None:
                prompt = [*done, *(t for s in segments for t in s)]
                seq.placement = self.vision.mrope.place(prompt, images)
        return uid

    def _insert(self, batch: Batch, segments: list[list[int]], *, max_tokens: int, cache: Any,
                done: list[int], sampler: Callable[[mx.array], mx.array],
                processors: list[Any], stop_ids: frozenset[int],
                speculative: bool = True) -> int:
        segments = split_last(segments)
        seq = Sequence(uid=batch.next_uid, segments=segments,
                       total=sum(len(s) for s in segments), tokens=list(done),
                       cache=cache if cache is not None else make_prompt_cache(self.model),
                       sampler=sampler, processors=tuple(processors), stop_ids=stop_ids,
                       max_tokens=max_tokens, speculative=speculative)
        batch.next_uid += 1
        batch.waiting.append(seq)
        return seq.uid

    def remove(self, uid: int) -> None:
        batch = self.batch
        if any(s.uid == uid for s in batch.waiting):
            # A new queue, swapped in whole: ``waiting`` is read from other threads.
            batch.waiting = deque(s for s in batch.waiting if s.uid != uid)
            return
        for rows in (batch.prefill, batch.decode):
            i = rows.index(uid)
            if i is not None:
                rows.filter([j for j in range(len(rows)) if j != i])
                return

    def holds(self, uid: int) -> bool:
        batch = self.batch
        return (any(s.uid == uid for s in batch.waiting) or batch.prefill.index(uid) is not None
                or batch.decode.index(uid) is not None)

    def extract_cache(self, uid: int, layers: Container[int] | None = None
                      ) -> tuple[list[Any], list[int]]:
        """The sequence's cache, per layer (only ``layers`` when given, None for the others),
        and the tokens in it."""
        batch = self.batch
        for rows in (batch.decode, batch.prefill):
            i = rows.index(uid)
            if i is not None:
                return rows.extract(i, layers), rows.seqs[i].tokens
        seq = next(s for s in batch.waiting if s.uid == uid)
        return seq.cache, seq.tokens

    def cache_lengths(self) -> dict[int, int]:
        """Tokens in the cache of each sequence in the batch (prefilling or decoding)."""
        return {s.uid: len(s.tokens) for rows in (self.batch.prefill, self.batch.decode)
                for s in rows.seqs}

    @property
    def waiting(self) -> int:
        return len(self.batch.waiting)

    @property
    def prefilling(self) -> int:
        return len(self.batch.prefill)

    @property
    def decoding(self) -> int:
        return len(self.batch.decode)

    @property
    def decode_uids(self) -> tuple[int, ...]:
        """The decoding sequences, in row order."""
        return tuple(self.batch.decode.uids)

    @property
    def decode_cache(self) -> list[Any]:
        """The decode rows' caches, one per layer."""
        return self.batch.decode.cache

    @property
    def cache_nbytes(self) -> int:
        """Bytes of every sequence's cache: waiting, prefilling and decoding."""
        batch = self.batch
        return (sum(c.nbytes for s in batch.waiting for c in s.cache)
                + batch.prefill.nbytes + batch.decode.nbytes)

    @property
    def decode_len(self) -> int:
        """The longest context among the decoding sequences."""
        return max((len(s.tokens) for s in self.batch.decode.seqs), default=0)

    def prefill_rows(self) -> list[tuple[int, list[list[int]], int, int]]:
        """Each prefilling sequence: (uid, its prompt segments still to run, its whole
        uncached prompt, tokens already in its cache)."""
        return [(s.uid, s.segments, s.total, len(s.tokens)) for s in self.batch.prefill.seqs]

    def waiting_rows(self, n: int) -> list[tuple[int, list[list[int]], int]]:
        """The first ``n`` waiting sequences: (uid, prompt segments, tokens already cached)."""
        return [(s.uid, s.segments, len(s.tokens)) for s in list(self.batch.waiting)[:n]]

    def waiting_lengths(self) -> list[tuple[int, int]]:
        """Every waiting sequence, in the order it would start: (uid, prompt tokens to run)."""
        return [(s.uid, s.remaining) for s in self.batch.waiting]

    def order_waiting(self, uids: list[int]) -> None:
        """Reorder the waiting sequences (``uids``: all of theirs): a step starts them from
        the front of the queue, in arrival order unless told otherwise here."""
        batch = self.batch
        if [s.uid for s in batch.waiting] != uids:
            by_uid = {s.uid: s for s in batch.waiting}
            # A new queue, swapped in whole: ``waiting`` is read from other threads.
            batch.waiting = deque(by_uid[uid] for uid in uids)

    def prefilled_tokens(self) -> dict[int, int]:
        """Tokens each prefilling sequence holds; safe to call from another thread (the
        container is copied with ``list()``, which does not yield the GIL)."""
        return {s.uid: len(s.tokens) for s in list(self.batch.prefill.seqs)}

    # -- the step --------------------------------------------------------------------------

    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        """One step under ``plan``: the waiting sequences it names in ``start`` start
        prefilling, and each sequence runs the tokens ``plan.tokens`` gives it."""
        decoding, drafted = len(self.batch.decode), self.drafted
        began = time.perf_counter()
        with mx.stream(self.stream):
            prompt_responses, responses, prefilled = self._step(self.batch, plan)
        return ModelOutput(prompt_responses, responses, prefilled, decoding,
                           time.perf_counter() - began, self.drafted - drafted)

    def whole_chunks(self) -> SchedulerOutput:
        """A plan without the engine's policy: waiting sequences start while prefill slots
        are free and each prefilling one runs a whole chunk (for a batch stepped without an
        engine: the warm-up, tests, the benchmarks' ceiling)."""
        return self._whole_chunks(self.batch)

    def _whole_chunks(self, batch: Batch) -> SchedulerOutput:
        cfg = self.config

        def pending(s: Sequence) -> Pending:
            member = Member(in_cache=len(s.tokens), remaining=s.remaining, chunk=0)
            return Pending(s.uid, member, s.total, tuple(len(g) for g in s.segments))

        prefilling = [pending(s) for s in batch.prefill.seqs]
        waiting = [pending(s) for s in list(batch.waiting)[:cfg.prefill_batch_size]]
        state = StepState(config=cfg, mixed=self.mixed, decoding=len(batch.decode),
                          decode_len=0, prefilling=prefilling, waiting=waiting, decode_s=None,
                          token_s=None, decode_uids=tuple(batch.decode.uids),
                          first_token_in_chunk=self.first_token_in_chunk)
        admit = cfg.prefill_batch_size - len(prefilling)
        start, tokens = name_tokens(state, prefilling, waiting, admit, cfg.prefill_step_size)
        return SchedulerOutput(fail=[], reject=None, admit=admit, budget=None,
                               chunk=cfg.prefill_step_size, held=False, start=start,
                               tokens=tokens)

    def _step(self, batch: Batch, plan: SchedulerOutput
              ) -> tuple[list[Prefilled], list[Sampled], int]:
        """The step: sequences start, those down to their last prompt token join the decode
        rows (that token is their first input), each prefilling row takes its next chunk,
        and the model runs: decode rows and chunk in one pass (mixed), else the decode step
        and then the chunk in a call of its own. Returns the prompt progress, the tokens
        sampled and the prompt tokens run."""
        pre, dec = batch.prefill, batch.decode
        if len(dec) >= max_decoding(self.config):
            return [], self._decode(batch, None, plan.draft)[0], 0
        self._admit(batch, plan.start)
        progress = self._join_decode(batch)
        prompts, ends = self._next_chunks(pre, plan.tokens, progress)
        prefilled = sum(len(p) for p in prompts)
        if not self.mixed:
            responses = self._decode(batch, None, plan.draft)[0] if len(dec) else []
            self._prefill(pre, prompts, plan.chunk)
            self._draft_keeps_pace(batch)
            return progress, responses, prefilled
        ride = self._ride(pre, prompts, ends) if prompts else None
        responses: list[Sampled] = []
        ended = None
        try:
            if len(dec):
                responses, ended = self._decode(batch, ride, plan.draft)
            elif ride is not None:
                _, ended = forward(self.model, None, None, ride.tokens, pre.cache, ride.ends)
                mx.eval([c.state for c in pre.cache], [] if ended is None else ended)
                mx.clear_cache()
        finally:
            if ride is not None and max(ride.padding) > 0:
                for c in pre.cache:
                    roll_right_padding(c, ride.padding)
        if ends:
            responses += self._first_tokens(batch, ends, ended)
        self._draft_keeps_pace(batch)
        return progress, responses, prefilled

    def _admit(self, batch: Batch, start: list[int]) -> None:
        """The waiting sequences ``start`` (uids, in order) join the prefill rows, their
        caches merged."""
        pre = batch.prefill
        if start:
            by_uid = {s.uid: s for s in batch.waiting}
            rows = Rows()
            rows.seqs = [by_uid.pop(uid) for uid in start]
            # A new queue, swapped in whole: ``waiting`` is read from other threads.
            batch.waiting = deque(s for s in batch.waiting if s.uid in by_uid)
            rows.cache = merge_caches([s.cache for s in rows.seqs])
            for s in rows.seqs:
                s.cache, s.status = None, Status.PREFILLING
            pre.extend(rows)
        for c in pre.cache:
            if type(c) is BatchKVCache:
                small = c.keys is None or c.keys.shape[2] < BatchKVCache.step
                c.step = PROMPT_CACHE_STEP if small else BatchKVCache.step

    def _join_decode(self, batch: Batch) -> list[Prefilled]:
        """Prefilling sequences down to their last prompt token join the decode rows without
        a model call of their own: that token is their input in the step's decode rows."""
        pre = batch.prefill
        done = [i for i, s in enumerate(pre.seqs)
                if len(s.segments) == 1 and len(s.segments[0]) == 1]
        if not done:
            return []
        part = pre.take(done)
        for s in part.seqs:
            s.next_input = s.segments.pop()[0]
            s.status = Status.DECODING
        batch.decode.extend(part)
        return [Prefilled(s.uid, (s.total, s.total), True, True) for s in part.seqs]

    def _next_chunks(self, pre: Rows, tokens: dict[int, int], progress: list[Prefilled]
                     ) -> tuple[list[list[int]], list[int]]:
        """Each prefilling row's next chunk: ``tokens[uid]`` of its first segment, and past
        that segment's end the prompt's last token (``schedule.chunk_of``), and the rows whose
        chunk ends their prompt. Progress is appended to ``progress``."""
        prompts: list[list[int]] = []
        ends: list[int] = []
        for i, s in enumerate(pre.seqs):
            segments = s.segments
            n = tokens[s.uid]
            k = min(len(segments[0]), n)
            prompt = segments[0][:k]
            segments[0] = segments[0][k:]
            end_of_segment = end_of_prompt = False
            if not segments[0]:
                segments.pop(0)
                end_of_segment = True
                if n > k:  # the chunk takes the last prompt token, a segment of its own
                    prompt = prompt + segments.pop()
                    end_of_prompt = True
                    ends.append(i)
            s.done += len(prompt)
            prompts.append(prompt)
            progress.append(Prefilled(s.uid, (s.done, s.total), end_of_segment, end_of_prompt))
        return prompts, ends

    def _ride(self, pre: Rows, prompts: list[list[int]], ends: list[int]) -> _Chunk:
        """The chunk as the step's forward pass takes it (rows right padded to the longest);
        the rows' tokens are in their caches from this step on."""
        # A plain batch cache's padding is rolled by ``roll_right_padding``; other kinds
        # (rotating) keep what they need for their own ``finalize``.
        tokens, lengths, padding = _take_chunk(pre, prompts, prepare_plain=False)
        longest = tokens.shape[1]
        # Rows of the flattened chunk: each ending prompt's last token.
        return _Chunk(tokens, padding, [i * longest + lengths[i] - 1 for i in ends])

    def _prefill(self, pre: Rows, prompts: list[list[int]], step: int) -> None:
        """The chunk in a model call of its own, as mlx-lm's ``PromptProcessingBatch.prompt``
        runs it (right padded, in pieces of at most ``step`` tokens)."""
        if not prompts:
            return
        images = self._image_embeddings(pre.seqs, prompts)
        placed = self._chunk_placement(pre.seqs, prompts)
        tokens, _, padding = _take_chunk(pre, prompts, prepare_plain=True)
        embeds, adds = images(tokens) if images is not None else (None, [])
        done = 0
        while tokens.shape[1] > 0:
            fed = (self.vision.deepstack.fed([a[:, done:done + step] for a in adds]) if adds
                   else nullcontext())
            with placed(done, done + step), fed:
                if embeds is None:
                    self.model(tokens[:, :step], cache=pre.cache)
                else:
                    self.model(tokens[:, :step], cache=pre.cache,
                               input_embeddings=embeds[:, :step])
                    embeds = embeds[:, step:]
            mx.eval([c.state for c in pre.cache])
            mx.clear_cache()
            tokens = tokens[:, step:]
            done += step
        if max(padding) > 0:
            for c in pre.cache:
                c.finalize()
            mx.eval([c.state for c in pre.cache])
            mx.clear_cache()

    def _chunk_placement(self, seqs: list[Sequence], prompts: list[list[int]]
                         ) -> Callable[[int, int], AbstractContextManager[None]]:
        """For a chunk about to run (``prompts``: the rows' tokens, not yet in their caches),
        the M-RoPE placement of its columns ``a`` .. ``b`` as a context its model call runs
        in: rows without images at their indices, rows whose chunk is text shifted by their
        delta, rows whose chunk holds image tokens at their three positions."""
        if not any(s.placement is not None for s in seqs):
            return lambda a, b: nullcontext()
        mrope = self.vision.mrope
        longest = max(len(p) for p in prompts)
        shift = [0] * len(seqs)
        spatial = [False] * len(seqs)
        positions = np.zeros((3, len(seqs), longest), dtype=np.int64)
        for i, (s, prompt) in enumerate(zip(seqs, prompts, strict=True)):
            if s.placement is None:
                continue
            start = len(s.tokens)
            if any(t < 0 for t in prompt):
                spatial[i] = True
                positions[:, i, :len(prompt)] = s.placement.chunk(start, len(prompt))
            else:
                shift[i] = s.placement.shift(start)
        if not any(spatial):
            return lambda a, b: mrope.placed(shift)
        return lambda a, b: mrope.placed(shift, positions[:, :, a:b], spatial)

    def _row_shifts(self, seqs: list[Sequence]) -> AbstractContextManager[None]:
        """Decode rows' placement: each past its prompt, so at its index + its delta."""
        if not any(s.placement is not None for s in seqs):
            return nullcontext()
        return self.vision.mrope.placed([s.placement.delta if s.placement else 0
                                         for s in seqs])

    def _image_embeddings(self, seqs: list[Sequence], prompts: list[list[int]]
                          ) -> Callable[[mx.array], tuple[mx.array, list[mx.array]]] | None:
        """For a chunk that holds image tokens (negative ids), a function from the chunk's
        model inputs (right padded) to their embeddings, each image token's replaced by its
        image's features (the tower runs for an image when its first tokens do), and what
        each deepstack layer adds ([rows, tokens, hidden], zero at text; none without
        deepstack); else None."""
        places: list[tuple[int, int, int, int]] = []
        for i, prompt in enumerate(prompts):
            places += [(i, col, *split_image_token(t)) for col, t in enumerate(prompt) if t < 0]
        if not places:
            return None
        if self.vision is None:
            raise ValueError("a prompt holds image tokens but the model reads no images")
        rows = []
        for i, _, key, j in places:
            s = seqs[i]
            features = s.images[key]
            if not isinstance(features, mx.array):
                features = s.images[key] = self.vision.features(features)
            rows.append(features[j])
        at_row = mx.array([p[0] for p in places])
        at_col = mx.array([p[1] for p in places])
        features = mx.stack(rows)
        embed = self.vision.embed

        def embeddings(tokens: mx.array) -> tuple[mx.array, list[mx.array]]:
            h = embed(tokens)
            h[at_row, at_col] = features[:, 0].astype(h.dtype)
            adds = []
            for level in range(1, features.shape[1]):
                add = mx.zeros_like(h)
                add[at_row, at_col] = features[:, level].astype(h.dtype)
                adds.append(add)
            return h, adds

        return embeddings

    def _decode(self, batch: Batch, ride: _Chunk | None, draft: bool
                ) -> tuple[list[Sampled], mx.array | None]:
        """The decode rows' step (the chunk ``ride`` in the same pass), its tokens sampled;
        finished rows leave; ``draft``: whether rows may verify drafts (the plan's). Also
        returns the logits of the chunk's rows that end a prompt (None: none do)."""
        dec = batch.decode
        drafts = self._drafts(dec) if self.speculative and draft else None
        if drafts is None and any(s.carried for s in dec.seqs):
            drafts = [[] for _ in dec.seqs]  # what rows carry runs in a pass of several tokens
        if drafts is not None:
            return self._decode_drafts(batch, ride, drafts)
        inputs = mx.array([s.next_input for s in dec.seqs], dtype=mx.uint32)
        ended = None
        if self.mixed:
            chunk = (ride.tokens, batch.prefill.cache, ride.ends) if ride else (None, None, ())
            logits, ended = forward(self.model, inputs[:, None], dec.cache, *chunk)
        else:
            with self._row_shifts(dec.seqs):
                logits = self.model(inputs[:, None], cache=dec.cache)
        tokens, logprobs = self._sample(dec.seqs, inputs, logits[:, -1, :])
        for s, t in zip(dec.seqs, inputs.tolist(), strict=True):
            s.tokens.append(t)
        responses = _finish(dec, tokens, logprobs)
        batch.decode_steps += 1
        if batch.decode_steps % CLEAR_CACHE_STEPS == 0:
            mx.clear_cache()
        return responses, ended

    def _drafts(self, dec: Rows) -> list[list[int]] | None:
        """Each decoding row's draft this step (``speculate.Drafter``, or with a draft model
        ``draft_model.ModelDrafter``: rows without logits
        processors draft; the others, and a row carrying more than a draft's tokens, take no
        draft), or None when no row drafts or the step cannot verify drafts: more rows than
        ``SPECULATE_ROWS``, or a cache that cannot take back a rejected draft's positions
        (anything but batched plain KV, sliding windows and recurrent state)."""
        seqs = dec.seqs
        if not seqs or len(seqs) > SPECULATE_ROWS or not _rewindable(dec.cache):
            return None
        drafts = []
        for s in seqs:
            # A row that carries many tokens runs them without a draft (its carried tokens
            # never grow past two drafts).
            if not _verifies(s) or len(s.carried) > MAX_DRAFT:
                drafts.append([])
                continue
            if s.drafter is None:
                s.drafter = self._drafter(s)
            s.drafter.sync(s.tokens, s.carried)
            # The last token it may still sample is never drafted: it is sampled.
            drafts.append(s.drafter.draft(s.next_input, s.max_tokens - s.generated - 1))
        return drafts if any(drafts) else None

    def _draft_keeps_pace(self, batch: Batch) -> None:
        """With a draft model, the prefilling rows that will draft (a batch small enough to
        verify drafts in) run their new prompt tokens through it too, so that they draft from
        their first decode step instead of catching up then."""
        pre = batch.prefill
        if (self.draft is None or not self.speculative or not pre.seqs
                or len(pre.seqs) + len(batch.decode) > SPECULATE_ROWS):
            return
        for s in pre.seqs:
            if not _verifies(s) or s.images:
                continue
            if s.drafter is None:
                s.drafter = self._drafter(s)
            s.drafter.sync(s.tokens)
            s.drafter.keep_pace()

    def _drafter(self, s: Sequence) -> Any:
        """A row's drafter: the draft model's (a sampling row's drawn under its sampler), or
        prompt lookup (without a draft model, and for a row with images, whose tokens are no
        text the draft model reads)."""
        if self.draft is not None and not s.images:
            return self.draft.drafter(None if s.sampler is greedy_sampler else s.sampler)
        return Drafter()

    def _decode_drafts(self, batch: Batch, ride: _Chunk | None, drafts: list[list[int]]
                       ) -> tuple[list[Sampled], mx.array | None]:
        """The decode step with drafts: each row runs what it carries (``Sequence.carried``),
        its next input and then its draft (padded to the longest row), all in one forward
        pass. A greedy row keeps its draft while it agrees with its own next token at each
        position (what one token a step gives), a sampling row as its sampler's ``verify``
        decides (speculative sampling: the tokens distributed as one a step gives), and each
        answers the tokens kept and one more; rows with logits processors sample their first
        position's logits as a plain decode step does. The positions past what a row keeps
        leave its cache before anything reads it (``_rewind``).

        A hybrid model's recurrent layers cannot take positions back: they hold one state a
        row, after the last token run. A row that kept less than it ran gets back its state
        from before the pass (``_restore``) and drops all the pass's positions from its
        attention layers; the tokens it kept it carries into its next step, which runs them
        again before its next input, in the same pass as everything else (no pass of their
        own)."""
        dec = batch.decode
        seqs = dec.seqs
        at = [len(s.carried) for s in seqs]  # where each row's next input is
        runs = [[*s.carried, s.next_input, *d] for s, d in zip(seqs, drafts, strict=True)]
        lengths = [len(r) for r in runs]
        width = max(lengths)
        rows = [r + [r[-1]] * (width - len(r)) for r in runs]
        inputs = mx.array(rows, dtype=mx.uint32)
        recurrent = [c for c in dec.cache if isinstance(c, ArraysCache)]
        for c in dec.cache:
            # A window that wrapped while the rows decoded a token a step: in order before a
            # pass of several positions, or its mask and its update disagree
            # (actors/mlx_lm_private.py).
            if type(c) is BatchRotatingKVCache and c.rotated:
                in_temporal_order(c)
        # The recurrent states before the pass: the layers assign new arrays, never change
        # these, so keeping the references keeps the states (no copy).
        before = [list(c.cache) for c in recurrent]
        ended = None
        with _masked(recurrent, lengths, width):
            if self.mixed:
                chunk = ((ride.tokens, batch.prefill.cache, ride.ends) if ride
                         else (None, None, ()))
                logits, ended = forward(self.model, inputs, dec.cache, *chunk)
            else:
                with self._row_shifts(seqs):
                    logits = self.model(inputs, cache=dec.cache)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        best = mx.argmax(logprobs, axis=-1)
        others = [i for i, s in enumerate(seqs) if not _verifies(s)]
        sampled: dict[int, tuple[int, mx.array]] = {}
        if others:
            rows_at = (mx.array(others), mx.array([at[i] for i in others]))
            picked, processed = self._sample([seqs[i] for i in others], inputs[rows_at],
                                             logits[rows_at])
            sampled = {i: (t, processed[e]) for e, (i, t) in enumerate(zip(others, picked,
                                                                         strict=True))}
        mx.eval(best, logprobs)
        best = best.tolist()
        emitted: list[list[int]] = []
        for i, (s, d) in enumerate(zip(seqs, drafts, strict=True)):
            if i in sampled:
                tokens = [sampled[i][0]]
            else:
                a = at[i]
                if s.sampler is greedy_sampler:
                    agree = 0
                    while agree < len(d) and d[agree] == best[i][a + agree]:
                        agree += 1
                    tokens = best[i][a:a + agree + 1]
                else:
                    tokens = s.sampler.verify(logprobs[i, a:a + len(d) + 1], d,
                                              s.drafter.proposed)
                    agree = len(tokens) - 1
                if d:
                    s.drafter.verified(len(d), agree)
                    self.drafts += 1
                    self.drafted += len(d)
                    self.accepted += agree
            # Cut at the first token that ends it (a stop token, its token limit).
            for n, t in enumerate(tokens, 1):
                if t in s.stop_ids or s.generated + n >= s.max_tokens:
                    tokens = tokens[:n]
                    break
            emitted.append(tokens)
        # The positions whose state each row keeps: what it carried, its input and the draft
        # tokens it kept.
        kept = [a + len(t) for a, t in zip(at, emitted, strict=True)]
        lost = [i for i in range(len(seqs)) if recurrent and kept[i] < lengths[i]]
        if lost:
            _restore(recurrent, before, lost, len(seqs))
            self.restored += len(lost)
        _rewind([c for c in dec.cache if not isinstance(c, ArraysCache)],
                [width if i in lost else width - n for i, n in enumerate(kept)])
        for i, (s, row, n) in enumerate(zip(seqs, rows, kept, strict=True)):
            if i in lost:
                s.carried = row[:n]
            else:
                s.tokens.extend(row[:n])
                s.carried = []
        out = _finish_tokens(dec, emitted, lambda i, j: sampled[i][1] if i in sampled
                             else logprobs[i, at[i] + j])
        batch.decode_steps += 1
        if batch.decode_steps % CLEAR_CACHE_STEPS == 0:
            mx.clear_cache()
        return out, ended

    def _first_tokens(self, batch: Batch, rows: list[int], logits: mx.array) -> list[Sampled]:
        """The first tokens of the prefill ``rows`` whose prompts ended in this step's chunk,
        sampled from ``logits`` (the chunk's, at their last tokens) as a decode step samples;
        the sequences that go on join the decode rows, their first token their next input."""
        part = batch.prefill.take(rows)
        # The last prompt token is the input these logits answer, as a decode step's is.
        inputs = mx.array([s.tokens.pop() for s in part.seqs], dtype=mx.uint32)
        tokens, logprobs = self._sample(part.seqs, inputs, logits)
        for s, t in zip(part.seqs, inputs.tolist(), strict=True):
            s.tokens.append(t)
            s.status = Status.DECODING
        responses = _finish(part, tokens, logprobs)
        batch.decode.extend(part)
        return responses

    def _sample(self, seqs: list[Sequence], inputs: mx.array, logits: mx.array
                ) -> tuple[list[int], mx.array]:
        """Each row's token from its logits ([rows, vocab]): the row's logits processors (over
        the tokens so far and ``inputs``, the tokens these logits answer), then its sampler on
        the log-probabilities, in one call when every row shares the sampler (greedy)."""
        contexts = []
        if any(s.processors for s in seqs):
            rows = []
            for e, s in enumerate(seqs):
                row = logits[e:e + 1]
                if s.processors:
                    if s.context is None:
                        # An image's tokens are no vocabulary ids a penalty could see.
                        s.context = TokenBuffer([t for t in s.tokens if t >= 0])
                    context = s.context.update_and_fetch(inputs[e:e + 1])
                    contexts.append(context)
                    for processor in s.processors:
                        row = processor(context, row)
                rows.append(row)
            logits = mx.concatenate(rows, axis=0)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        samplers = [s.sampler for s in seqs]
        if all(f is samplers[0] for f in samplers):
            sampled = samplers[0](logprobs)
        else:
            sampled = mx.concatenate([f(logprobs[e:e + 1]) for e, f in enumerate(samplers)],
                                     axis=0)
        mx.eval(sampled, logprobs, contexts)
        return sampled.tolist(), logprobs

    def reset(self) -> None:
        """A fresh batch: the old one's state is not trustworthy after a failed step."""
        self.batch = Batch(self.mixed)

    def warm_up(self, ids: list[int]) -> None:
        """A few tokens through a throwaway batch of the same settings (two prompts prefilled
        together, a third joining while they decode), so that MLX builds its run-time
        compiled kernels now; this runner's batch is unchanged."""
        batch = Batch(self.mixed)

        def add(prompt: list[int], n: int) -> None:
            self._insert(batch, [prompt], max_tokens=n, cache=None, done=[],
                         sampler=greedy_sampler, processors=[], stop_ids=frozenset())

        add(ids[:5], 4)
        add(ids[:9], 4)
        with mx.stream(self.stream):
            for step in range(16):
                if step == 1:
                    add(ids[2:12], 3)
                progress, responses, _ = self._step(batch, self._whole_chunks(batch))
                if step > 1 and not (progress or responses or len(batch.decode)
                                     or batch.waiting):
                    break

    def close(self) -> None:
        if self._old_wired_limit is not None:
            mx.synchronize(self.stream)
            mx.set_wired_limit(self._old_wired_limit)
            self._old_wired_limit = None


def _take_chunk(pre: Rows, prompts: list[list[int]], *, prepare_plain: bool
                ) -> tuple[mx.array, list[int], list[int]]:
    """The rows' chunks as one array, right padded to the longest, the rows' tokens counted
    as in their caches, and the caches told the padding (``prepare``): every kind, or
    (``prepare_plain`` False) all but plain batch caches. Returns the tokens, each row's
    length and its padding."""
    for s, new in zip(pre.seqs, prompts, strict=True):
        s.tokens += new
    lengths = [len(p) for p in prompts]
    longest = max(lengths)
    padding = [longest - n for n in lengths]
    # An image token (a negative id) runs as the vocabulary's 0; its embedding is replaced.
    prompts = [[max(t, 0) for t in p] for p in prompts]
    if max(padding) == 0:
        return mx.array(prompts), lengths, padding
    for c in pre.cache:
        if prepare_plain or type(c) is not BatchKVCache:
            c.prepare(lengths=lengths, right_padding=padding)
    return _right_pad(prompts, longest), lengths, padding


def _right_pad(prompts: list[list[int]], longest: int) -> mx.array:
    return mx.array([p + [0] * (longest - len(p)) for p in prompts])


def _verifies(s: Sequence) -> bool:
    """Whether a row's draft can be verified: greedy, or a sampler that verifies drafts, and
    no logits processors (penalties and grammars see one token at a time), and the request
    did not turn drafts off. A seeded request
    takes no drafts: its draws then depend on its seed alone, not on whether the batch was
    small enough to verify drafts in."""
    return s.speculative and not s.processors and (s.sampler is greedy_sampler
                                 or getattr(s.sampler, "key", True) is None)


def _rewindable(cache: list[Any]) -> bool:
    """Whether every layer is batched plain KV (``BatchKVCache``, or ``RaggedKVCache``
    groups of them) or a batched sliding window (``BatchRotatingKVCache``), whose positions
    written past what a row keeps can be taken back (``_rewind``), or recurrent state
    (``ArraysCache``: hybrid models), which ``_restore`` takes back to its state before the
    step."""
    return all(type(g) in (BatchKVCache, BatchRotatingKVCache) or isinstance(g, ArraysCache)
               for c in cache for g in (c.groups if isinstance(c, RaggedKVCache) else [c]))


@contextmanager
def _masked(recurrent: list[ArraysCache], lengths: list[int], width: int) -> Iterator[None]:
    """A pass of ``width`` positions in which each row's recurrent state takes only its
    first ``lengths[row]`` (the rest are padding): the layers' own masks for right-padded
    rows (``ArraysCache.prepare``), set only when some row is padded."""
    ragged = recurrent and min(lengths) < width
    if ragged:
        for c in recurrent:
            c.prepare(lengths=lengths)
    try:
        yield
    finally:
        if ragged:
            for c in recurrent:
                c.finalize()


def _restore(recurrent: list[ArraysCache], before: list[list[Any]], rows: list[int],
             n: int) -> None:
    """Give the recurrent layers' ``rows`` (of ``n``) back their states ``before`` the step:
    the layers take those arrays whole when every row goes back, else a select of the rows."""
    if len(rows) == n:
        for c, states in zip(recurrent, before, strict=True):
            for j, state in enumerate(states):
                c[j] = state
        return
    back = mx.array([i in rows for i in range(n)])
    for c, states in zip(recurrent, before, strict=True):
        for j, (old, new) in enumerate(zip(states, c.cache, strict=True)):
            c[j] = mx.where(back.reshape(-1, *[1] * (new.ndim - 1)), old, new)


def _rewind(cache: list[Any], drop: list[int]) -> None:
    """Take back each row's last ``drop[row]`` positions from every layer: the positions all
    rows of a group drop are trimmed (no copy); the rest become left padding of their rows
    (``roll_right_padding``, a copy of the group's positions in use).

    A sliding window's cache (``BatchRotatingKVCache``) is never trimmed: a pass of several
    positions wrote them after the window's last ``max_size - 1`` positions, in order, so a
    row's dropped positions are what a chunk's right padding is to it, rolled to the left of
    the row by the cache's own ``prepare``/``finalize`` (its window stays whole)."""
    if not any(drop):
        return
    for c in cache:
        if type(c) is BatchRotatingKVCache:
            c.prepare(lengths=[-n for n in drop], right_padding=drop)
            c.finalize()
            continue
        spans = c.spans() if isinstance(c, RaggedKVCache) else [(0, len(drop), c)]
        for first, end, g in spans:
            part = drop[first:end]
            common = min(part)
            if common:
                g.trim(common)
            if any(n > common for n in part):
                roll_right_padding(g, [n - common for n in part])


def _finish(rows: Rows, tokens: list[int], logprobs: mx.array) -> list[Sampled]:
    """One sampled token per row (``logprobs``: [rows, vocab]), as ``_finish_tokens``."""
    return _finish_tokens(rows, [[t] for t in tokens], lambda i, _: logprobs[i])


def _finish_tokens(rows: Rows, tokens: list[list[int]],
                   logprobs: Callable[[int, int], mx.array]) -> list[Sampled]:
    """Each row's tokens this step (``logprobs(row, j)``: those of its j-th) as answers; a row
    whose last token reached its token limit ("length") or is a stop token ("stop") leaves
    ``rows`` with its cache; the others' next input is their last token."""
    keep, out = [], []
    for i, (s, row) in enumerate(zip(rows.seqs, tokens, strict=True)):
        for j, token in enumerate(row):
            s.generated += 1
            finish = None
            if j == len(row) - 1:
                finish = "length" if s.generated >= s.max_tokens else None
                if token in s.stop_ids:
                    finish = "stop"
            if finish is None:
                out.append(Sampled(s.uid, token, logprobs(i, j), None, None, None))
            else:
                s.status = Status.FINISHED
                out.append(Sampled(s.uid, token, logprobs(i, j), finish, rows.extract(i),
                                   s.tokens))
        if out[-1].finish_reason is None:
            keep.append(i)
            s.next_input = row[-1]
    if len(keep) < len(rows):
        rows.filter(keep)
    return out
