"""The runner: runs the batch's model steps under the schedule's plans.

It owns the generator, ``MixedBatchGenerator`` (actors/engine/batch.py): mlx-lm's
``BatchGenerator`` with one forward pass a step for the architectures
``forward.supports_mixed`` names, and the model's own call for every other. It is the one
place the engine reaches into the generator's batch: what is waiting, prefilling and
decoding, handed to ``schedule`` as plain numbers.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, NamedTuple

from mlx_lm.generate import StopSequences

from actors.engine.batch import MixedBatchGenerator
from actors.engine.config import EngineConfig


class StepOutput(NamedTuple):
    """What one step did: the generator's prompt and token responses, the prompt tokens it
    ran through the model, how many sequences decoded, and its wall time in seconds."""

    prompt_responses: list[Any]
    responses: list[Any]
    prefilled: int
    decoding: int
    wall: float


class Runner:
    """The batch on the MLX thread: sequences join (``insert``), leave (``remove``), and
    step (``run``) under a plan."""

    def __init__(self, model: Any, config: EngineConfig, stream: Any = None) -> None:
        self.model = model
        self.config = config
        self._kwargs = dict(
            completion_batch_size=config.max_batch_size,
            prefill_batch_size=config.prefill_batch_size,
            prefill_step_size=config.prefill_step_size,
            stream=stream,
            mixed=config.mixed_step,
        )
        self.gen = MixedBatchGenerator(model, **self._kwargs)

    @property
    def mixed(self) -> bool:
        """Whether a step is one forward pass (the architecture is one ``forward`` knows)."""
        return self.gen.mixed

    # -- who is in the batch ---------------------------------------------------------------

    def insert(self, segments: list[list[int]], *, max_tokens: int, cache: Any,
               done: list[int], sampler: Any, processors: list[Any],
               stop_ids: frozenset[int]) -> int:
        """Queue one sequence: its prompt still to run, in ``segments`` (split where blocks
        must be cut), after ``done`` tokens already in ``cache``. Returns its uid."""
        (uid,) = self.gen.insert_segments(
            [segments], max_tokens=[max_tokens], caches=[cache], all_tokens=[done],
            samplers=[sampler], logits_processors=[processors],
            stop_sequences=[StopSequences([(t,) for t in stop_ids] or None)])
        return uid

    def remove(self, uid: int) -> None:
        self.gen.remove([uid])

    def holds(self, uid: int) -> bool:
        return bool(self.gen._find_uids([uid]))

    def extract_cache(self, uid: int) -> tuple[list[Any], list[int]]:
        """The sequence's cache, per layer, and the tokens in it."""
        return self.gen.extract_cache([uid])[uid]

    @property
    def waiting(self) -> int:
        return len(self.gen._unprocessed_sequences)

    @property
    def prefilling(self) -> int:
        return len(self.gen._prompt_batch)

    @property
    def decoding(self) -> int:
        return len(self.gen._generation_batch)

    @property
    def decode_len(self) -> int:
        """The longest context among the decoding sequences."""
        return max((len(t) for t in self.gen._generation_batch.tokens), default=0)

    def prefill_rows(self) -> list[tuple[int, list[list[int]], int, int]]:
        """Each prefilling sequence: (uid, its prompt segments still to run, its whole
        uncached prompt, tokens already in its cache)."""
        batch = self.gen._prompt_batch
        return [(uid, seq[0], seq[2], len(tokens)) for uid, seq, tokens in
                zip(batch.uids, self.gen._currently_processing, batch.tokens, strict=True)]

    def waiting_rows(self, n: int) -> list[tuple[int, list[list[int]], int]]:
        """The first ``n`` waiting sequences: (uid, prompt segments, tokens already cached)."""
        # An unprocessed sequence: (uid, segments, max_tokens, cache, cached tokens, ...).
        return [(seq[0], seq[1], len(seq[4])) for seq in
                list(self.gen._unprocessed_sequences)[:n]]

    def waiting_lengths(self) -> list[tuple[int, int]]:
        """Every waiting sequence, in the order it would start: (uid, prompt tokens to run)."""
        return [(seq[0], sum(len(s) for s in seq[1])) for seq in self.gen._unprocessed_sequences]

    def order_waiting(self, uids: list[int]) -> None:
        """Reorder the waiting sequences (``uids``: all of theirs): the generator starts
        them from the front of its queue, in arrival order unless told otherwise here."""
        queue = self.gen._unprocessed_sequences
        if [seq[0] for seq in queue] != uids:
            by_uid = {seq[0]: seq for seq in queue}
            # A new queue, swapped in whole: ``waiting`` is read from other threads.
            self.gen._unprocessed_sequences = deque(by_uid[uid] for uid in uids)

    def prefilled_tokens(self) -> dict[int, int]:
        """Tokens each prefilling sequence holds; safe to call from another thread (the
        containers are copied with ``list()``, which does not yield the GIL)."""
        batch = self.gen._prompt_batch
        uids, held = list(batch.uids), list(batch.tokens)
        return {uid: len(tokens) for uid, tokens in zip(uids, held, strict=False)}

    # -- the step --------------------------------------------------------------------------

    def run(self, plan: Any) -> StepOutput:
        """One step under ``plan`` (``schedule.StepPlan``): at most ``admit`` waiting
        sequences start prefilling (the first of the queue, as ``order_waiting`` left it),
        each prefilling sequence runs ``chunk`` prompt tokens."""
        gen = self.gen
        counted = gen._counters.prompt_tokens
        decoding = len(gen._generation_batch)
        # BatchGenerator takes min(prefill_batch_size - prefilling, ...) new sequences.
        gen.prefill_batch_size = len(gen._prompt_batch) + plan.admit
        self._set_chunk(plan.chunk)
        began = time.perf_counter()
        try:
            prompt_responses, responses = gen.next()
        finally:
            gen.prefill_batch_size = self.config.prefill_batch_size
            self._set_chunk(self.config.prefill_step_size)
        return StepOutput(prompt_responses, responses, gen._counters.prompt_tokens - counted,
                          decoding, time.perf_counter() - began)

    def _set_chunk(self, n: int) -> None:
        self.gen.prefill_step_size = n
        self.gen._prompt_batch.prefill_step_size = n

    def reset(self) -> None:
        """A fresh batch: the old one's state is not trustworthy after a failed step."""
        self.gen = MixedBatchGenerator(self.model, **self._kwargs)

    def warm_up(self, ids: list[int]) -> None:
        """A few tokens through a throwaway generator of the same settings (two prompts
        prefilled together, a third joining while they decode), so that MLX builds its
        run-time compiled kernels now; this runner's batch is unchanged."""
        gen = MixedBatchGenerator(self.model, **self._kwargs)
        try:
            gen.insert([ids[:5], ids[:9]], max_tokens=[4, 4])
            for step in range(16):
                if step == 1:
                    gen.insert([ids[2:12]], max_tokens=[3])
                prompt_responses, responses = gen.next()
                if step > 1 and not (prompt_responses or responses or len(gen._generation_batch)
                                     or gen._unprocessed_sequences):
                    break
        finally:
            gen.close()

    def close(self) -> None:
        self.gen.close()
