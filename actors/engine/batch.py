"""mlx-lm's ``BatchGenerator`` with fewer model calls a step (``MixedBatchGenerator``): a
sequence that finished its prompt joins the decode step, and with a model that
``forward.supports_mixed`` the prefill chunk rides in the same forward pass."""

from __future__ import annotations

import copy
import time
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch
from mlx_lm.models.cache import BatchKVCache, KVCache, dynamic_roll

from actors.engine.forward import forward, mixed_forward, supports_mixed
from actors.engine.ragged_cache import RaggedKVCache
from actors.mlx_lm_private import right_pad_prompts


def chunk_of(segments: list[list[int]], step: int, mixed: bool) -> tuple[int, bool]:
    """The prompt tokens a sequence's next prefill chunk runs (the first ``step`` of its first
    segment), and whether that chunk also takes the prompt's last token: with mixed steps, a
    chunk that ends its segment with only that token left, and room to spare, runs it too, so
    the step samples the prompt's first token from the chunk (mlx-lm leaves the last token for
    a decode step: one more step before the first token). The memory gate counts the same."""
    k = min(len(segments[0]), step)
    takes_last = (mixed and k == len(segments[0]) and len(segments) == 2
                  and len(segments[1]) == 1 and k < step)
    return k + takes_last, takes_last


class _Forward:
    """The model as a decode step of ``JoiningGenerationBatch`` calls it: ``mixed_forward``,
    which reads ragged caches, with the prompt batch's next chunk riding along when one is
    set (``ride``), as ``PromptProcessingBatch.prompt`` would have run it in a call of its own
    (same bookkeeping, same right padding). The chunk rows that end a prompt leave their
    logits in ``ended`` (``ride``'s ``ends``), from which the step samples their first token."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.batch: PromptProcessingBatch | None = None
        self.tokens: mx.array | None = None
        self.padding: list[int] = []
        self.ends: list[int] = []
        self.ended: mx.array | None = None

    def ride(self, batch: PromptProcessingBatch, prompts: list[list[int]],
             ends: list[int] = ()) -> None:
        """Set the chunk: ``prompts[i]`` for the batch's row i; ``ends``: the rows whose
        chunk holds the last token of their prompt."""
        for held, new in zip(batch.tokens, prompts, strict=True):
            held += new
        lengths = [len(p) for p in prompts]
        longest = max(lengths)
        self.padding = [longest - n for n in lengths]
        if max(self.padding) > 0:
            self.tokens = right_pad_prompts(prompts, max_length=longest)
            for c in batch.prompt_cache:
                c.prepare(lengths=lengths, right_padding=self.padding)
        else:
            self.tokens = mx.array(prompts)
        # Rows of the flattened chunk: each ending prompt's last token (right padded).
        self.ends = [i * longest + lengths[i] - 1 for i in ends]
        self.batch = batch

    def __call__(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        if self.batch is None:
            return mixed_forward(self.model, inputs, cache)
        logits, self.ended = forward(self.model, inputs, cache, self.tokens,
                                     self.batch.prompt_cache, self.ends)
        return logits

    def prefill(self) -> None:
        """The chunk alone (nothing decodes): into the prompt cache, built now, and the
        allocator's cache of the chunk's activations given back, as mlx-lm's
        ``PromptProcessingBatch.prompt`` does."""
        _, self.ended = forward(self.model, None, None, self.tokens, self.batch.prompt_cache,
                                self.ends)
        mx.eval([c.state for c in self.batch.prompt_cache],
                [] if self.ended is None else self.ended)
        mx.clear_cache()

    def land(self) -> mx.array | None:
        """After the step: the chunk is in the prompt cache (right padding rolled away).
        Returns the logits of the rows that ended a prompt (None: none did)."""
        if self.batch is not None and max(self.padding) > 0:
            for c in self.batch.prompt_cache:
                _finalize(c)
        ended = self.ended
        self.batch, self.tokens, self.padding, self.ends, self.ended = None, None, [], [], None
        return ended


class _Given:
    """A model call that returns logits already computed (a prompt's first token, sampled
    from the prefill chunk that ran its last token)."""

    def __init__(self, logits: mx.array) -> None:
        self.logits = logits

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        return self.logits[:, None, :]


def _finalize(cache: Any) -> None:
    """``BatchKVCache.finalize`` (each row's right padding rolled to its left), rolling only
    the positions in use: mlx-lm's rolls the whole buffer, room to grow included (a gather,
    ~2x the time here for eight short prompts in buffers of 256)."""
    pad = getattr(cache, "_right_padding", None)
    if type(cache) is not BatchKVCache or pad is None or cache.keys is None:
        cache.finalize()
        return
    n = cache._idx
    rolled = []
    for x in (cache.keys, cache.values):
        r = dynamic_roll(x[..., :n, :], pad[:, None], axis=2)
        rolled.append(mx.concatenate([r, x[..., n:, :]], axis=2) if x.shape[2] > n else r)
    cache.keys, cache.values = rolled
    cache.offset = cache.offset - pad
    cache.left_padding += pad
    cache._right_padding = None


class JoiningGenerationBatch(GenerationBatch):
    """mlx-lm's ``GenerationBatch`` with two changes.

    - A sequence that finished its prompt joins without a model call of its own: its last
      prompt token is the input of its first step in the batch, as any sequence's previous
      token is (mlx-lm runs that token in a separate call as the sequence joins).
    - A step answers the tokens it sampled, not the ones it was given. mlx-lm's step reads
      the previous step's tokens after queueing the next forward pass, so that the two
      overlap; on the CPU, ``mx.async_eval`` of a model's graph returns only when all but
      the last few of its operations have run (measured here: 70-98 ms of a 90-120 ms decode
      step of the default model), so each token reached the client a whole step late, and a
      step carrying a prefill chunk (a second of prompt tokens) held back the first token of
      every sequence that joined the step before. Here the step waits for its own tokens.
    """

    def __init__(self, *args: Any, joining: bool = False, **kwargs: Any) -> None:
        self._deferred = joining
        super().__init__(*args, **kwargs)
        self._deferred = False
        if joining:
            # Never read (a joining sequence's inputs are prompt tokens, not answers); made
            # here, on the thread that steps: an array belongs to the thread whose stream
            # made it.
            self._next_logprobs = [mx.zeros((1,))] * len(self.uids)

    def _step(self) -> Any:
        if self._deferred:
            return None  # the constructor's step: the batch's next step runs it instead
        super()._step()  # the forward pass of the tokens answered last step
        mx.eval(self._next_tokens, self._next_logprobs)
        return self._next_tokens.tolist(), self._next_logprobs

    def extend(self, batch: GenerationBatch) -> None:
        # Decoding caches grow by mlx-lm's room again (a prompt's grew by less: growing by 64
        # positions, every stream copied its cache four times as often).
        for c in batch.prompt_cache:
            if type(c) is BatchKVCache and "step" in vars(c):
                del c.step
        # Mixed steps (``mixed_forward`` reads them) keep the decode batch's caches ragged,
        # unless a layer's is a rotating (sliding-window) one: each RaggedKVCache groups rows
        # by its own layer's sizes, and a rotating cache's stop at its window, so the layers
        # would group the rows differently. Those batches stay one group (mlx-lm's caches).
        if batch.prompt_cache and isinstance(self.model, _Forward) and all(
                type(c) is BatchKVCache for c in batch.prompt_cache):
            if not self.prompt_cache:
                self.prompt_cache = [RaggedKVCache() for _ in batch.prompt_cache]
            else:
                self.prompt_cache = [RaggedKVCache.wrap(c) for c in self.prompt_cache]
        super().extend(batch)


def _as_batch(cache: KVCache) -> BatchKVCache:
    """A one-row ``BatchKVCache`` on a ``KVCache``'s own buffers (no padding, no copy)."""
    out = BatchKVCache([0])
    out.keys, out.values = cache.keys, cache.values
    out.offset = mx.array([cache.offset])
    out._idx = cache.offset
    return out


# Room a prompt's cache grows by while it is shorter than mlx-lm's step (256 positions, the
# room it grows by after that, and once the sequence decodes: growing by 64 past it, a long
# prompt prefilled in budgeted chunks of ~60 tokens copied its whole cache every step). A
# chunk writes into a buffer grown to fit it, and the right padding of a batch of chunks is
# then rolled over it (``_finalize``): for eight chat prompts of ~50 tokens, 64 positions of
# room instead of 256 took these copies from ~100 to ~45 ms of a ~1 s prefill step (default
# model).
PROMPT_CACHE_STEP = 64


class MixedBatchGenerator(BatchGenerator):
    """mlx-lm's ``BatchGenerator`` with fewer model calls a step, answering in the step.

    mlx-lm's step makes up to three calls: the decode step, the last prompt token of each
    sequence that finished its prompt, and the next prefill chunk. Here a sequence that
    finished its prompt joins before the step instead of after it: its last prompt token is a
    row of the decode step, and the step answers its first token (``JoiningGenerationBatch``:
    mlx-lm's would answer it one step later). With ``mixed`` (and a model ``mixed_forward``
    handles), the prefill chunk rides in the same forward pass as well, and the decode
    batch's cache is ragged: one call a step while anything decodes. Without, the prefill
    chunk is mlx-lm's call of its own after the decode step (hybrid models: their recurrent
    layers are not in ``mixed_forward``).
    """

    # With mixed steps, a prompt's first token is sampled from the chunk that runs its last
    # prompt token (False: that token waits for a decode step, as in mlx-lm; for
    # benchmarks/bench_first_token.py's comparison).
    first_token_in_chunk = True

    def __init__(self, model: Any, *, mixed: bool | None = None, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.mixed = supports_mixed(model) if mixed is None else (mixed and supports_mixed(model))
        # The decode step's model: mixed_forward (ridden by the prefill chunk) or the model.
        self._step_model = _Forward(model) if self.mixed else model
        self._generation_batch = JoiningGenerationBatch.empty(self._step_model, self.sampler)

    def _next(self) -> tuple[list[Any], list[Any]]:
        gen, batch = self._generation_batch, self._prompt_batch
        counters = self._counters
        if len(gen) >= self.completion_batch_size:
            return [], self._decode(gen)
        prompt_responses: list[Any] = []
        n = min(self.prefill_batch_size - len(batch),
                self.completion_batch_size - len(gen),
                len(self._unprocessed_sequences))
        if n > 0:
            batch.extend(self._make_batch(n))
        for c in batch.prompt_cache:
            if type(c) is BatchKVCache:
                small = c.keys is None or c.keys.shape[2] < BatchKVCache.step
                c.step = PROMPT_CACHE_STEP if small else BatchKVCache.step
        # Sequences down to their last prompt token join the generation batch now.
        done = [i for i, seq in enumerate(self._currently_processing)
                if len(seq[0]) == 1 and len(seq[0][0]) == 1]
        if done:
            last = [self._currently_processing[i][0][0][0] for i in done]
            progress = [(self._currently_processing[i][2],) * 2 for i in done]
            self._currently_processing = [seq for i, seq in enumerate(self._currently_processing)
                                          if i not in set(done)]
            part = self._split(done)
            batch = self._prompt_batch
            joined = JoiningGenerationBatch(
                self._step_model, part.uids, mx.array(last, dtype=mx.uint32), part.prompt_cache,
                part.tokens, part.samplers, part.fallback_sampler, part.logits_processors,
                part.stop_sequences, part.max_tokens, joining=True)
            for uid, p in zip(joined.uids, progress, strict=True):
                prompt_responses.append(PromptProcessingBatch.Response(uid, p, True, True))
            gen.extend(joined)
        # The next chunk of each prompt still being read (as mlx-lm's step takes it). With
        # mixed steps, a chunk that reaches the prompt's last token takes it too: the step
        # samples that prompt's first token from the chunk's logits (mlx-lm leaves the last
        # token for a decode step: one more step before the first token).
        prompts: list[list[int]] = []
        ends: list[int] = []
        for i, seq in enumerate(self._currently_processing):
            response = PromptProcessingBatch.Response(batch.uids[i], 0, False, False)
            segments = seq[0]
            _, takes_last = chunk_of(segments, self.prefill_step_size,
                                     self.mixed and self.first_token_in_chunk)
            k = min(len(segments[0]), self.prefill_step_size)
            prompts.append(segments[0][:k])
            segments[0] = segments[0][k:]
            if not segments[0]:
                segments.pop(0)
                response.end_of_segment = True
                if takes_last:
                    prompts[-1] = prompts[-1] + segments.pop()
                    response.end_of_prompt = True
                    ends.append(i)
            seq[1] += len(prompts[-1])
            response.progress = (seq[1], seq[2])
            prompt_responses.append(response)
        counters.prompt_tokens += sum(len(p) for p in prompts)
        if not self.mixed:
            # The decode step (joining rows included), then the chunk in a call of its own.
            responses = self._decode(gen) if len(gen) else []
            tic = time.perf_counter()
            batch.prompt(prompts)
            counters.prompt_time += time.perf_counter() - tic
            return prompt_responses, responses
        responses = []
        if prompts:
            self._step_model.ride(batch, prompts, ends)
        try:
            if len(gen):
                responses = self._decode(gen)
            elif prompts:
                tic = time.perf_counter()
                self._step_model.prefill()
                counters.prompt_time += time.perf_counter() - tic
        finally:
            ended = self._step_model.land()
        if ends:
            responses += self._first_tokens(ends, ended)
        return prompt_responses, responses

    def _first_tokens(self, rows: list[int], logits: mx.array) -> list[Any]:
        """The first tokens of the prompt batch's ``rows``, whose prompts ended in this step's
        chunk, sampled from ``logits`` (the chunk's, at their last tokens) as a decode step
        samples: the same samplers, logits processors, stop sequences and token limits. The
        sequences that go on join the decode batch, whose next step runs their first token."""
        ending = set(rows)
        self._currently_processing = [seq for i, seq in enumerate(self._currently_processing)
                                      if i not in ending]
        part = self._split(rows)
        # The batch's tokens are those in the cache; the step adds the last prompt token
        # (its input) itself, as it adds every step's input.
        last = [held[-1] for held in part.tokens]
        tokens = [held[:-1] for held in part.tokens]
        first = JoiningGenerationBatch(
            _Given(logits), part.uids, mx.array(last, dtype=mx.uint32), part.prompt_cache,
            tokens, part.samplers, part.fallback_sampler, part.logits_processors,
            part.stop_sequences, part.max_tokens, joining=True)
        counters = self._counters
        responses = first.next()
        counters.generation_tokens += len(responses)
        first.model = self._step_model
        if len(first):
            self._generation_batch.extend(first)
        return responses

    def _make_batch(self, n: int) -> PromptProcessingBatch:
        """mlx-lm's, except that one sequence starting from a cached prefix keeps its cache's
        arrays: ``BatchKVCache.merge`` would copy them into a new buffer of exactly their
        length, which the next token then outgrows into a third copy (~90 MB each for a
        2,000-token prefix of the default model)."""
        first = self._unprocessed_sequences[0][3] if n == 1 else None
        batch = super()._make_batch(n)
        if first and all(type(c) is KVCache and c.keys is not None for c in first):
            batch.prompt_cache = [_as_batch(c) for c in first]  # the merge was never run
        return batch

    def _split(self, indices: list[int]) -> PromptProcessingBatch:
        """``PromptProcessingBatch.split`` without its deep copy of the whole batch's cache
        (a 2,000-token prompt's is ~90 MB on the default model): the finished rows are taken
        whole when they are the whole batch, else filtered out of shallow copies of the
        layer caches (``filter`` replaces their arrays instead of changing them)."""
        batch = self._prompt_batch
        if len(indices) == len(batch):
            self._prompt_batch = PromptProcessingBatch.empty(
                self.model, self.sampler, prefill_step_size=self.prefill_step_size)
            return batch
        part = copy.copy(batch)
        for name in ("uids", "tokens", "samplers", "logits_processors", "max_tokens",
                     "stop_sequences"):
            setattr(part, name, list(getattr(batch, name)))
        part.prompt_cache = [copy.copy(c) for c in batch.prompt_cache]
        part.filter(sorted(indices))
        batch.filter(sorted(set(range(len(batch))) - set(indices)))
        return part

    def _decode(self, gen: GenerationBatch) -> list[Any]:
        counters = self._counters
        tic = time.perf_counter()
        responses = gen.next()
        counters.decode_time += time.perf_counter() - tic
        counters.generation_tokens += len(responses)
        counters.generation_steps += 1
        if counters.generation_steps % 512 == 0:
            mx.clear_cache()
        return responses
