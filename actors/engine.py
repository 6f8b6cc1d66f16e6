"""The batch engine: plain synchronous policy around mlx-lm's ``BatchGenerator``.

The scheduler actor owns one ``Engine`` on the MLX thread and calls ``add``, ``abort`` and
``step``; everything here runs on that thread. ``step`` returns plain events (``actors.messages``)
with no ``mx.array`` in them, ready to cross to the event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import StopSequences
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
    make_sampler,
)

from actors.agent_output import OutputParser, Parsed
from actors.grammar import thinking_budget_processor
from actors.kv_blocks import (
    ARRAYS,
    KVBlock,
    RamTier,
    build_cache,
    cut_blocks,
    cut_tail,
    head,
    layer_kinds,
)
from actors.memory_estimate import Member, ModelMemory, StepPlan, plan_step, prompt_need
from actors.messages import (
    OutputSpec,
    RequestFinished,
    SamplingParams,
    TokenLogprob,
    TokensGenerated,
    TopLogprob,
    Usage,
)
from actors.mixed import MixedBatchGenerator
from actors.prefix import block_hashes, chain_hash, usable_blocks

log = logging.getLogger("actors.engine")

# Interleaving prefill with decode: the fewest prompt tokens a prefilling sequence gets per
# step, and how fast the step-time estimates follow new measurements.
MIN_PREFILL_CHUNK = 32
# With the chunk in the decode step's forward pass (actors/mixed.py) a prefill token costs
# no call of its own, and a small chunk is no dearer per token than a large one.
MIN_MIXED_CHUNK = 8
EMA = 0.3
# A prompt whose whole rest is within this many step budgets is prefilled in one piece.
SHORT_PROMPT = 4

# Penalties look back over this many tokens (mlx-lm's default of 20 forgets too quickly for
# OpenAI's presence/frequency semantics, which cover the whole completion).
PENALTY_CONTEXT = 256


class RequestError(Exception):
    """A request that cannot run; ``status`` is the HTTP status the client should see."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def make_request_sampler(sampling: SamplingParams) -> Callable[[mx.array], mx.array]:
    """The sampler for one request. Greedy requests share one function so the batch samples
    in one call; a seeded request carries its own PRNG key so its draws do not depend on the
    other requests in the batch."""
    if sampling.temperature == 0:
        return greedy_sampler
    if sampling.seed is None:
        return make_sampler(
            temp=sampling.temperature,
            top_p=sampling.top_p,
            min_p=sampling.min_p,
            top_k=sampling.top_k,
        )
    key = mx.random.key(sampling.seed)
    inv_temp = 1.0 / sampling.temperature

    def seeded(logprobs: mx.array) -> mx.array:
        nonlocal key
        if 0.0 < sampling.top_p < 1.0:
            logprobs = apply_top_p(logprobs, sampling.top_p)
        if sampling.min_p > 0.0:
            logprobs = apply_min_p(logprobs, sampling.min_p)
        if sampling.top_k > 0:
            logprobs = apply_top_k(logprobs, sampling.top_k)
        key, sub = mx.random.split(key)
        return mx.random.categorical(logprobs * inv_temp, key=sub)

    return seeded


class StopStringFilter:
    """Holds back text that may be the start of a stop string, and cuts at the first match.

    Matching is on decoded text, not token ids: a stop string can be spelled by many token
    sequences, and it must never leak into the output.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        """Add decoded text; return (text safe to emit, whether a stop string matched).
        The stop string that matched first in the text is kept in ``matched``."""
        if not self.stops:
            return text, False
        buf = self.pending + text
        hits = [(i, s) for s, i in ((s, buf.find(s)) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            at, self.matched = min(hits)
            return buf[:at], True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        self.pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text


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
    # are already stored (from cache, or cut at a boundary this request crossed).
    hashes: list[str] = field(default_factory=list)
    stored: int = 0
    # Reads tool calls and reasoning out of a chat answer (None: the text is all content).
    parser: OutputParser | None = None
    reasoning_tokens: int = 0


Event = TokensGenerated | RequestFinished


def _ema(old: float | None, new: float) -> float:
    return new if old is None else EMA * new + (1 - EMA) * old


class Engine:
    """Continuous batching over one model: requests join between steps, leave on finish/abort."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_batch_size: int = 32,
        prefill_batch_size: int = 8,
        prefill_step_size: int = 512,
        stream: mx.Stream | None = None,
        block_size: int = 0,
        fingerprint: str = "",
        memory: ModelMemory | None = None,
        prefill_interleave: float = 0.0,
        mixed: bool = True,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        # The model's memory shape, for the per-chunk gate (None: no gate).
        self.memory = memory
        self.prefill_step_size = prefill_step_size
        # While sequences decode, a step's prefill may take about this many times a decode
        # step (0: whole prefill_step_size chunks regardless), so running streams keep flowing
        # while a long prompt is prefilled.
        self.prefill_interleave = prefill_interleave
        self._decode_s: float | None = None  # a decode step's time, smoothed
        self._token_s: float | None = None  # one prompt token's prefill time, smoothed
        self.last_prefill_budget: int | None = None
        self.gate_failures = 0
        self.eos_ids = frozenset(tokenizer.eos_token_ids)
        # Prefix cache (block_size 0 turns it off; so does a model whose caches cannot be cut).
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.kinds = layer_kinds(model) if block_size else None
        self.hybrid = bool(self.kinds) and ARRAYS in self.kinds
        self.state_sizes = (
            [len(c.cache) if k == ARRAYS else 0 for c, k in
             zip(make_prompt_cache(model), self.kinds, strict=True)]
            if self.kinds else []
        )
        self.blocks = RamTier()  # the RAM tier, owned by this thread
        self.new_blocks: list[tuple[str, KVBlock]] = []  # cut since the caller last took them
        # The last step's prompt responses whose blocks are still to cut (``cut_pending``).
        self._to_cut: list[Any] = []
        self._gen_kwargs = dict(
            completion_batch_size=max_batch_size,
            prefill_batch_size=prefill_batch_size,
            prefill_step_size=prefill_step_size,
            stream=stream,
            mixed=mixed,
        )
        self.gen = MixedBatchGenerator(model, **self._gen_kwargs)
        self.requests: dict[str, Request] = {}
        self._by_uid: dict[int, Request] = {}
        self.steps = 0
        self.generated_tokens = 0
        self.prefill_tokens = 0  # prompt tokens run through the model
        self.partial_hit_tokens = 0  # prompt tokens taken from part of a block

    # -- commands ----------------------------------------------------------------------

    @property
    def caching(self) -> bool:
        return bool(self.kinds)

    def prompt_hashes(self, prompt: list[int]) -> list[str]:
        """Hashes of the prompt's blocks that could be served from cache."""
        if not self.caching:
            return []
        hashes = block_hashes(self.fingerprint, prompt, self.block_size)
        return hashes[: usable_blocks(len(prompt), self.block_size)]

    def add(
        self,
        request_id: str,
        prompt: list[int],
        sampling: SamplingParams,
        cached: Sequence[KVBlock] = (),
        *,
        output: OutputSpec | None = None,
        constraint: Any = None,
    ) -> Request:
        """Queue a request; it joins the batch at the next step. Raises RequestError.

        ``cached``: leading blocks of the prompt already computed (a prefix-cache hit); only
        the rest of the prompt is prefilled. ``output``: how to read tool calls and reasoning
        out of the answer. ``constraint``: a compiled grammar (``actors.grammar.Constraint``)
        whose mask every sampled token obeys.
        """
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already running", 409)
        if not prompt:
            raise RequestError("the prompt is empty")
        if sampling.max_tokens <= 0:
            raise RequestError("max_tokens must be positive")
        stop_ids = frozenset(sampling.stop_token_ids) | (
            frozenset() if sampling.ignore_eos else self.eos_ids
        )
        processors = make_logits_processors(
            repetition_penalty=sampling.repetition_penalty,
            repetition_context_size=PENALTY_CONTEXT,
            presence_penalty=sampling.presence_penalty or None,
            presence_context_size=PENALTY_CONTEXT,
            frequency_penalty=sampling.frequency_penalty or None,
            frequency_context_size=PENALTY_CONTEXT,
        )
        if constraint is not None:
            processors.append(constraint.processor())
        if output is not None and output.think and output.thinking_budget is not None:
            start, end = output.think
            processors.append(thinking_budget_processor(
                output.thinking_budget, self._encode_tag(end),
                start_tokens=self._encode_tag(start), starts_inside=output.in_reasoning))
        hashes = self.prompt_hashes(prompt)
        n_cached = len(cached)
        start = n_cached * self.block_size
        prefix = list(cached)
        partial = self._partial_hit(prompt, start, cached[-1].block_hash if cached else None)
        if partial is not None:
            prefix.append(partial)
            start += partial.n_tokens
            self.partial_hit_tokens += partial.n_tokens
        (uid,) = self.gen.insert_segments(
            [self._segments(prompt, start, len(hashes))],
            max_tokens=[sampling.max_tokens],
            caches=[build_cache(self.model, self.kinds, prefix) if prefix else None],
            all_tokens=[prompt[:start]],
            samplers=[make_request_sampler(sampling)],
            logits_processors=[processors],
            stop_sequences=[StopSequences([(t,) for t in stop_ids] or None)],
        )
        req = Request(
            request_id=request_id,
            uid=uid,
            prompt_len=len(prompt),
            sampling=sampling,
            detokenizer=self.tokenizer.detokenizer,
            stops=StopStringFilter(sampling.stop),
            stop_ids=stop_ids,
            cached_tokens=start,
            hashes=hashes,
            stored=n_cached,
            parser=OutputParser(output) if output is not None else None,
        )
        self.requests[request_id] = req
        self._by_uid[uid] = req
        return req

    def _encode_tag(self, tag: str) -> list[int]:
        return list(self.tokenizer.encode(tag, add_special_tokens=False))

    def _partial_hit(self, prompt: list[int], start: int, parent: str | None) -> KVBlock | None:
        """After the whole blocks, the longest run of the prompt's next tokens that a block in
        RAM following the same parent shares (a full block of another prompt, or a tail), cut
        to that length: a shared chat template, a repeated prompt's last partial block and a
        new ending reuse every token they share, not only whole blocks. Plain KV models
        only (recurrent state exists only at a block's end), and one prompt token is always
        left to run through the model."""
        if not self.caching or self.hybrid:
            return None
        room = min(self.block_size, len(prompt) - 1 - start)
        if room <= 0:
            return None
        block, n = self.blocks.best_partial(parent, prompt[start : start + room])
        return head(block, n) if block is not None and n > 0 else None

    def _segments(self, prompt: list[int], start: int, n_blocks: int) -> list[list[int]]:
        """Split the uncached prompt where blocks must be cut during prefill: at every block
        boundary for hybrid models (recurrent state exists only at the position just reached).
        Plain KV models are not split: their KV is sliced into blocks once the prompt is
        prefilled (a split would cost a model step of its own, one more step to the first
        token)."""
        if not self.hybrid or n_blocks * self.block_size <= start:
            return [prompt[start:]]
        B = self.block_size
        segments, lo = [], start
        for cut in range(start + B, n_blocks * B + 1, B):
            segments.append(prompt[lo:cut])
            lo = cut
        segments.append(prompt[lo:])
        return segments

    def _cut(self, req: Request, cache: list[Any], tokens: list[int], hashes: list[str]) -> None:
        """Keep the blocks of ``cache`` (holding ``tokens``) that are not stored yet."""
        last = min(len(tokens) // self.block_size, len(hashes))
        first = last - 1 if self.hybrid else req.stored
        if last <= req.stored or first < 0:
            return
        for blk in cut_blocks(cache, self.kinds, first, last, self.block_size, hashes, tokens):
            self._keep(req, blk)
        req.stored = last

    def _keep(self, req: Request, blk: KVBlock) -> None:
        if blk.block_hash not in self.blocks:
            self.blocks[blk.block_hash] = blk
            self.new_blocks.append((req.request_id, blk))

    def take_new_blocks(self) -> list[tuple[str, KVBlock]]:
        """The blocks cut since the last call, the last step's prefill included."""
        self.cut_pending()
        blocks, self.new_blocks = self.new_blocks, []
        return blocks

    def cut_pending(self) -> None:
        """Cut the blocks the last step's prefill completed.

        ``step`` leaves this for after its tokens are answered: slicing a burst's prompts
        into blocks costs tens of milliseconds (and first builds the decode batch's joined
        cache), which the prompts' first tokens need not wait for. Nothing moves the
        batch's caches until the next step, which cuts first if nobody has
        (``take_new_blocks`` and ``abort`` do too)."""
        pending, self._to_cut = self._to_cut, []
        if pending:
            self._cut_at_boundaries(pending)

    def abort(self, request_id: str) -> RequestFinished | None:
        """Remove a request wherever it is (queued, prefilling, decoding) and free its KV."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.cut_pending()  # its blocks, and its neighbours', before the batch changes
        self.gen.remove([req.uid])
        return self._finish(req, "abort")

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    @property
    def waiting(self) -> int:
        """Requests not yet in a batch."""
        return len(self.gen._unprocessed_sequences)

    # -- the step ------------------------------------------------------------------------

    def step(self, limit: int | None = None, floor: int = 0) -> list[Event]:
        """Run one step of the batch (a decode step plus at most one prefill chunk).

        ``limit``: bytes of MLX memory the step must stay under (the per-chunk gate; None:
        no gate). Prefilling requests that no longer fit fail alone, and waiting ones join
        the prefill only while the whole prefill fits. ``floor``: memory in use at idle, to
        tell a request that can never fit (413) from one that came at a bad time (503)."""
        self.cut_pending()
        if not self.requests:
            return []
        events: list[Event] = []
        admit: int | None = None
        if limit is not None and self.memory is not None:
            admit = self._gate(limit, max(floor, self.memory.weights_bytes), events)
            if not self.requests:
                return events
        gen = self.gen
        configured = gen.prefill_batch_size
        prefilling = len(gen._prompt_batch)
        if admit is not None:
            # BatchGenerator takes min(prefill_batch_size - prefilling, ...) new sequences.
            gen.prefill_batch_size = prefilling + admit
        budget = self._prefill_budget()
        self.last_prefill_budget = budget
        if budget is not None:
            self._set_chunk(self._chunk_for(budget))
        counted = gen._counters.prompt_tokens
        decoding = len(gen._generation_batch)
        began = time.perf_counter()
        try:
            prompt_responses, responses = gen.next()
        except Exception as exc:  # the model step failed: no request in it can go on
            log.exception("batch step failed; failing %d requests", len(self.requests))
            return events + self._fail_all(f"engine step failed: {exc}")
        finally:
            gen.prefill_batch_size = configured
            if budget is not None:
                self._set_chunk(self.prefill_step_size)
        prefilled = gen._counters.prompt_tokens - counted
        self.prefill_tokens += prefilled
        wall = time.perf_counter() - began
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %d: %.0f ms, %d decoding, %d prompt tokens, budget %s, "
                      "decode step %.0f ms, prompt token %.1f ms", self.steps, wall * 1e3,
                      decoding, prefilled, budget, (self._decode_s or 0) * 1e3,
                      (self._token_s or 0) * 1e3)
        self._measure(prefilled, decoding, wall)
        self.steps += 1
        # The blocks this step's prefill completed are cut after its tokens are answered
        # (``cut_pending``).
        if self.caching:
            self._to_cut = [r for r in prompt_responses if r.end_of_segment]
        for resp in responses:
            req = self._by_uid.get(resp.uid)
            if req is None:
                continue
            try:
                events.extend(self._on_token(req, resp))
            except Exception as exc:  # one request's post-processing failed: only it fails
                log.exception("request %s failed", req.request_id)
                self.gen.remove([req.uid])
                events.append(self._finish(req, "error", error=str(exc), status=500))
        return events

    def _prefill_budget(self) -> int | None:
        """Prompt tokens this step may prefill (None: no limit beyond the chunk size).

        While sequences decode, the step's prefill is held to ``prefill_interleave`` times a
        decode step, from the measured time of a decode step and of one prompt token (which
        grows with the context, so it is re-measured every step): a 2,000-token prompt then
        arrives without stalling the streams. With nothing decoding, prefill runs flat out."""
        if (self.prefill_interleave <= 0 or not len(self.gen._generation_batch)
                or self._decode_s is None or self._token_s is None):
            return None
        tokens = int(self.prefill_interleave * self._decode_s / self._token_s)
        return max(self._min_chunk, min(tokens, self.prefill_step_size))

    def _chunk_for(self, budget: int) -> int:
        """The chunk each prefilling sequence gets this step under ``budget`` tokens: the
        budget shared out, except that a short prompt (all of it to prefill within
        SHORT_PROMPT budgets) is never split: a chat message stalls the streams once, briefly,
        and gets its first token without waiting for the long prompt beside it. (The end of
        a long prompt is not short.)"""
        gen = self.gen
        joining = max(0, min(gen.prefill_batch_size - len(gen._prompt_batch),
                             gen.completion_batch_size - len(gen._generation_batch),
                             len(gen._unprocessed_sequences)))
        # (rest to prefill, whole uncached prompt) of each sequence prefilling this step
        work = [(sum(map(len, seq[0])), seq[2]) for seq in gen._currently_processing]
        work += [(n, n) for n in (sum(map(len, seq[1])) for seq in
                                  list(gen._unprocessed_sequences)[:joining])]
        short = max((rest for rest, whole in work if whole <= SHORT_PROMPT * budget), default=0)
        chunk = max(budget // max(1, len(work)), short, self._min_chunk)
        return min(chunk, self.prefill_step_size)

    @property
    def _min_chunk(self) -> int:
        floor = MIN_MIXED_CHUNK if self.gen.mixed else MIN_PREFILL_CHUNK
        return min(floor, self.prefill_step_size)

    def _set_chunk(self, n: int) -> None:
        self.gen.prefill_step_size = n
        self.gen._prompt_batch.prefill_step_size = n

    def _measure(self, tokens: int, decoding: int, wall: float) -> None:
        """Learn a decode step's time from steps without prefill, and a prompt token's from
        the rest of the steps' time. Whole steps are timed: MLX evaluates lazily, so the
        work cannot be told apart inside a step."""
        if not tokens:
            if decoding:
                self._decode_s = _ema(self._decode_s, wall)
            return
        if decoding and self._decode_s is None:
            return  # no decode-only step seen yet: cannot split this one
        spent = wall - (self._decode_s if decoding else 0.0)
        self._token_s = _ema(self._token_s, max(spent, 0.0) / tokens)

    def _cut_at_boundaries(self, prompt_responses: list[Any]) -> None:
        """Cut the blocks a prefill completed: for hybrid models when a segment ends at a
        block boundary, for plain KV models once the whole prompt is in the cache."""
        for r in prompt_responses:
            req = self._by_uid.get(r.uid)
            # Hybrid: segment ends inside the prompt; plain KV: the end of the prompt.
            if req is None or not r.end_of_segment or r.end_of_prompt == self.hybrid:
                continue
            reached = req.prompt_len if r.end_of_prompt else req.cached_tokens + r.progress[0]
            if self._block_tokens_at(req, reached) == 0:
                continue  # no new block here: spare the copy of the cache
            if r.uid not in self.gen._find_uids([r.uid]):
                continue  # it finished in this step: its blocks were cut as it finished
            try:
                cache, tokens = self.gen.extract_cache([r.uid])[r.uid]
                self._cut(req, cache, tokens, req.hashes)
            except Exception:  # caching is an optimisation: never fail the request for it
                log.exception("could not cut prefix blocks of %s", req.request_id)

    def _block_tokens_at(self, req: Request, n_tokens: int) -> int:
        """Tokens of the new blocks ``_cut`` keeps when the prompt reaches ``n_tokens``."""
        last = min(n_tokens // self.block_size, len(req.hashes))
        first = last - 1 if self.hybrid else req.stored
        if last <= req.stored or first < 0:
            return 0
        return (last - first) * self.block_size

    def _cut_finished(self, req: Request, cache: list[Any], tokens: list[int]) -> None:
        """At the end of a request, keep the blocks its answer completed too, and what is
        left after the last whole block as a tail (plain KV models: the next turn of a
        conversation resends prompt and answer; a repeated prompt ends in that tail)."""
        if not self.caching or self.hybrid or not cache:
            return
        try:
            hashes = block_hashes(self.fingerprint, tokens, self.block_size)
            self._cut(req, cache, tokens, hashes)
            start = len(hashes) * self.block_size
            if start < len(tokens):
                parent = hashes[-1] if hashes else None
                name = "tail-" + chain_hash(parent or self.fingerprint, tokens[start:])
                self._keep(req, cut_tail(cache, start, tokens, parent, name))
        except Exception:
            log.exception("could not cut prefix blocks of %s", req.request_id)

    def _on_token(self, req: Request, resp: Any) -> list[Event]:
        token = resp.token
        now = time.perf_counter()
        if req.first_token_at is None:
            req.first_token_at = now
        req.generated += 1
        self.generated_tokens += 1
        finish = resp.finish_reason
        events: list[Event] = []
        if finish is not None:
            self._cut_finished(req, resp.prompt_cache, resp.all_tokens)
        if token in req.stop_ids and finish == "stop":
            # EOS and stop token ids end the text; they are not part of it.
            req.detokenizer.finalize()
            text, _ = req.stops.feed(req.detokenizer.last_segment)
            text += req.stops.flush()
            if delta := self._delta(req, text, [], None, last=True):
                events.append(delta)
            events.append(self._finish(req, "stop"))
            return events
        req.detokenizer.add_token(token)
        if finish is not None:
            req.detokenizer.finalize()
        text, matched = req.stops.feed(req.detokenizer.last_segment)
        logprobs = self._logprobs(req, token, resp.logprobs) if req.sampling.logprobs else None
        if matched:
            events.append(self._delta(req, text, [token], logprobs, last=True))
            # The stop string ended the request inside the batch: take it out now.
            if self.caching and not self.hybrid:
                self._cut_finished(req, *self.gen.extract_cache([req.uid])[req.uid])
            self.gen.remove([req.uid])
            events.append(self._finish(req, "stop", stop_sequence=req.stops.matched))
            return events
        if finish is not None:
            text += req.stops.flush()
        events.append(self._delta(req, text, [token], logprobs, last=finish is not None))
        if finish is not None:
            events.append(self._finish(req, finish))
        return events

    def _delta(self, req: Request, text: str, token_ids: list[int],
               logprobs: list[TokenLogprob] | None, *, last: bool) -> TokensGenerated | None:
        """The client's delta for ``text``: with a parser, reasoning and tool calls are taken
        out of it (markup that may begin one is held back, and flushed by the last delta).
        None when a delta without tokens carries nothing."""
        reasoning, calls = "", None
        parser = req.parser
        if parser is not None:
            was_reasoning = parser.in_reasoning
            parsed = parser.feed(text)
            if last:
                end = parser.finish()
                parsed = Parsed(text=parsed.text + end.text,
                                reasoning=parsed.reasoning + end.reasoning,
                                tool_calls=parsed.tool_calls + end.tool_calls)
            if token_ids and (was_reasoning or parser.in_reasoning):
                req.reasoning_tokens += len(token_ids)
            text, reasoning, calls = parsed.text, parsed.reasoning, parsed.tool_calls or None
        if not (token_ids or text or reasoning or calls):
            return None
        return TokensGenerated(request_id=req.request_id, text=text, token_ids=token_ids,
                               logprobs=logprobs, reasoning=reasoning, tool_calls=calls)

    def _logprobs(self, req: Request, token: int, logprobs: mx.array) -> list[TokenLogprob]:
        k = req.sampling.top_logprobs
        chosen = logprobs[token].item()
        top: list[TopLogprob] = []
        if k > 0:
            idx = mx.argpartition(-logprobs, kth=k - 1)[:k]
            vals = logprobs[idx]
            order = mx.argsort(-vals)
            ids = idx[order].tolist()
            top = [self._top(i, v) for i, v in zip(ids, vals[order].tolist(), strict=True)]
        piece = self._piece(token)
        return [
            TokenLogprob(
                token=piece,
                token_id=token,
                logprob=chosen,
                bytes=list(piece.encode("utf-8")),
                top_logprobs=top,
            )
        ]

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        piece = self._piece(token_id)
        return TopLogprob(
            token=piece, token_id=token_id, logprob=logprob, bytes=list(piece.encode("utf-8"))
        )

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    # -- endings -------------------------------------------------------------------------

    def _finish(
        self,
        req: Request,
        reason: str,
        *,
        error: str | None = None,
        status: int | None = None,
        stop_sequence: str | None = None,
    ) -> RequestFinished:
        self.requests.pop(req.request_id, None)
        self._by_uid.pop(req.uid, None)
        ttft = None if req.first_token_at is None else req.first_token_at - req.added_at
        if reason == "stop" and req.parser is not None and req.parser.calls_made:
            reason = "tool_calls"  # the answer ended after calling tools
        return RequestFinished(
            request_id=req.request_id,
            finish_reason=reason,
            usage=Usage(
                prompt_tokens=req.prompt_len,
                completion_tokens=req.generated,
                cached_tokens=req.cached_tokens,
                reasoning_tokens=req.reasoning_tokens,
            ),
            error=error,
            error_status=status,
            ttft_s=ttft,
            stop_sequence=stop_sequence,
        )

    def _fail_all(self, message: str) -> list[Event]:
        events: list[Event] = [
            self._finish(req, "error", error=message, status=500)
            for req in list(self.requests.values())
        ]
        # A fresh generator: the old one's batch state is not trustworthy after a failed step.
        self.gen = MixedBatchGenerator(self.model, **self._gen_kwargs)
        mx.clear_cache()
        return events

    # -- the per-chunk memory gate -------------------------------------------------------------

    def _gate(self, limit: int, floor: int, events: list[Event]) -> int:
        """Fail the prefilling requests the next step cannot fit, and return how many waiting
        ones may start prefilling (``actors.memory_estimate.plan_step``)."""
        gen = self.gen
        prefilling = [
            self._member(uid, seq[0], len(tokens))
            for uid, seq, tokens in zip(gen._prompt_batch.uids, gen._currently_processing,
                                        gen._prompt_batch.tokens, strict=True)
        ]
        free = max(0, gen.prefill_batch_size - len(prefilling))
        queued = list(gen._unprocessed_sequences)[:free]
        # An unprocessed sequence: (uid, segments, max_tokens, cache, cached tokens, ...).
        waiting = [self._member(seq[0], seq[1], len(seq[4])) for seq in queued]
        decode_len = max((len(t) for t in gen._generation_batch.tokens), default=0)

        def plan(usage: int) -> StepPlan:
            return plan_step(self.memory, usage=usage, limit=limit,
                             decoding=len(gen._generation_batch), decode_len=decode_len,
                             prefilling=prefilling, waiting=waiting,
                             step=self.prefill_step_size)

        active, cached = mx.get_active_memory(), mx.get_cache_memory()
        p = plan(active + cached)
        if cached and (p.fail or p.reject_waiting or p.admit < len(waiting)):
            # The allocator's cache is memory MLX can give back: give it back, then decide.
            mx.clear_cache()
            cached = mx.get_cache_memory()
            p = plan(active + cached)
        doomed = [gen._prompt_batch.uids[i] for i in p.fail]
        if p.reject_waiting:
            doomed.append(queued[0][0])
        for uid in doomed:
            req = self._by_uid.get(uid)
            if req is not None:
                events.append(self._fail_for_memory(req, limit, floor, active + cached))
        return p.admit

    def _member(self, uid: int, segments: list[list[int]], in_cache: int) -> Member:
        """Where one sequence stands, for the gate: its cache, what is left of its prompt,
        its next chunk, and the prefix-cache blocks it cuts next step and until it ends."""
        remaining = sum(len(seg) for seg in segments)
        chunk = min(len(segments[0]), self.prefill_step_size) if segments else 0
        if (self.gen.mixed and chunk + 1 == remaining and len(segments) == 2
                and chunk < self.prefill_step_size):
            chunk = remaining  # the chunk takes the prompt's last token too (mixed steps)
        req = self._by_uid.get(uid)
        cut_now = blocks_left = 0
        if self.caching and req is not None and req.hashes:
            blocks_left = max(0, len(req.hashes) - req.stored) * self.block_size
            if self.hybrid and len(segments) > 1 and chunk == len(segments[0]):
                cut_now = self._block_tokens_at(req, in_cache + chunk)  # a boundary this step
            elif not self.hybrid and (remaining == 1 or chunk == remaining):
                cut_now = self._block_tokens_at(req, req.prompt_len)  # the prompt ends this step
        return Member(in_cache=in_cache, remaining=remaining, chunk=chunk, cut_now=cut_now,
                      blocks_left=blocks_left)

    def _fail_for_memory(self, req: Request, limit: int, floor: int, usage: int
                         ) -> RequestFinished:
        """Take one request out of the batch for want of memory, freeing its cache."""
        self.gen.remove([req.uid])
        self.gate_failures += 1
        need = prompt_need(self.memory, prompt_tokens=req.prompt_len,
                           step=self.prefill_step_size,
                           block_size=self.block_size if self.caching else 0)
        mb = 1e6
        # 413: it could never fit, even at idle; 503: memory held by other work.
        status = 413 if need > limit - floor else 503
        message = (
            f"out of memory for this prompt's prefill: it needs about {need / mb:.0f} MB more; "
            f"{usage / mb:.0f} MB of the {limit / mb:.0f} MB memory limit are in use"
        )
        log.warning("request %s failed by the memory gate: %s", req.request_id, message)
        return self._finish(req, "error", error=message, status=status)

    def progress(self) -> list[dict[str, Any]]:
        """Where each request stands (waiting, prefilling n of its prompt, decoding), for a
        report read on another thread: every live container is first copied with ``list()``,
        which runs without yielding the GIL, so the MLX thread's changes never break it; a
        request that moves between the copies shows its old stage for one snapshot."""
        batch = self.gen._prompt_batch
        uids, held = list(batch.uids), list(batch.tokens)
        prefilled = {uid: len(tokens) for uid, tokens in zip(uids, held, strict=False)}
        out = []
        for req in list(self.requests.values()):
            if req.generated:
                stage, done = "decoding", req.prompt_len
            elif req.uid in prefilled:
                stage, done = "prefilling", min(req.prompt_len, prefilled[req.uid])
            else:
                stage, done = "waiting", req.cached_tokens
            out.append({"id": req.request_id, "stage": stage, "prompt_tokens": req.prompt_len,
                        "prefilled_tokens": done, "generated_tokens": req.generated})
        return out

    def stats(self) -> dict[str, Any]:
        return {
            "requests": len(self.requests),
            "waiting": self.waiting,
            "prefilling": len(self.gen._prompt_batch),
            "decoding": len(self.gen._generation_batch),
            "steps": self.steps,
            "generated_tokens": self.generated_tokens,
            "prefill_tokens": self.prefill_tokens,
            "partial_hit_tokens": self.partial_hit_tokens,
            "prefill_budget": self.last_prefill_budget,
            "gate_failures": self.gate_failures,
        }

    def warm_up(self) -> float:
        """Run a few tokens through a generator of this engine's settings and throw it away:
        two prompts of different lengths prefilled together, a third joining while they
        decode. MLX builds a run-time compiled kernel the first time a kernel's shape of
        operation appears, with g++ on the CPU (cached on disk after: troupe's JIT directory
        under TROUPE_HOME), and the first request on a new machine waited 12-17 s for them
        (the tiny test model, measured). Returns the seconds it took; ``self`` is unchanged."""
        began = time.perf_counter()
        ids = list(self.tokenizer.encode("The quick brown fox jumps over the lazy dog."))
        ids = (ids * 4)[:12] if ids else [0] * 12
        gen = MixedBatchGenerator(self.model, **self._gen_kwargs)
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
        return time.perf_counter() - began

    def close(self) -> None:
        self.gen.close()
