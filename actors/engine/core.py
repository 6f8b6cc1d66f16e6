"""The batch engine: plain synchronous policy around troupe's batch (``runner.Runner``).

The scheduler actor owns one ``Engine`` on the MLX thread and calls ``add``, ``abort`` and
``step``; everything here runs on that thread. ``step`` returns plain events (``actors.messages``)
with no ``mx.array`` in them, ready to cross to the event loop.
"""

from __future__ import annotations

import logging
import struct
import time
import zlib
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import (
    make_logits_processors,
)

from troupe.actors.engine.config import DEFAULTS, EngineConfig
from troupe.actors.engine.draft_model import DraftModel
from troupe.actors.engine.grammar import GrammarProcessor, thinking_budget_processor
from troupe.actors.engine.kv_blocks import (
    ARRAYS,
    WINDOW,
    KVBlock,
    build_cache,
    covered,
    cut_blocks,
    cut_tail,
    head,
    layer_kinds,
    layer_windows,
    layout,
    usable,
    window_parts,
)
from troupe.actors.engine.memory_estimate import (
    Member,
    ModelMemory,
    idle_floor,
    prompt_need,
    too_large,
)
from troupe.actors.engine.prefix import block_hashes, chain_hash, namespace_root, usable_blocks
from troupe.actors.engine.prefix_cache import PrefixCache
from troupe.actors.engine.request import Request, make_request_sampler
from troupe.actors.engine.runner import ModelOutput, Runner
from troupe.actors.engine.schedule import (
    Memory,
    Pending,
    SchedulerOutput,
    StepState,
    Waiting,
    chunk_of,
    ema,
    schedule,
    start_order,
)
from troupe.actors.engine.text import (
    EndRequest,
    EngineEvent,
    Event,
    SampledLogprobs,
    TextOutput,
    TextStage,
    TokensSampled,
)
from troupe.actors.messages import (
    ErrorKind,
    OutputSpec,
    RequestFinished,
    SamplingParams,
    Usage,
)

log = logging.getLogger("actors.engine.core")

# Penalties look back over this many tokens (mlx-lm's default of 20 forgets too quickly for
# OpenAI's presence/frequency semantics, which cover the whole completion).
PENALTY_CONTEXT = 256


class RequestError(Exception):
    """A request that cannot run, with the kind of error (``actors.messages.ErrorKind``)."""

    def __init__(self, message: str, kind: ErrorKind = "invalid") -> None:
        super().__init__(message)
        self.kind = kind


def _digest(responses: list[Any]) -> int:
    """A checksum of the tokens a step sampled, the same on every rank that sampled them."""
    return zlib.crc32(b"".join(struct.pack("<qq", r.uid, r.token) for r in responses))


# What the engine's ``step`` returns: the clients' events with the text stage inline, else the
# stage's input (``text.TokensSampled`` and the engine's ``RequestFinished``).
Out = Event | TokensSampled


def sampled_logprobs(token: int, logprobs: mx.array, k: int) -> SampledLogprobs:
    """The sampled token's logprob and the ``k`` most likely tokens', as plain numbers."""
    top: list[tuple[int, float]] = []
    if k > 0:
        idx = mx.argpartition(-logprobs, kth=k - 1)[:k]
        vals = logprobs[idx]
        order = mx.argsort(-vals)
        top = list(zip(idx[order].tolist(), vals[order].tolist(), strict=True))
    return SampledLogprobs(logprobs[token].item(), top)


class Engine:
    """Continuous batching over one model: requests join between steps, leave on finish/abort."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        config: EngineConfig = DEFAULTS,
        *,
        stream: mx.Stream | None = None,
        fingerprint: str = "",
        memory: ModelMemory | None = None,
        vision: Any = None,
        draft: DraftModel | None = None,
        inline_text: bool = True,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        # The model's memory shape, for the per-chunk gate (None: no gate).
        self.memory = memory
        self.prefill_step_size = config.prefill_step_size
        self.prefill_interleave = config.prefill_interleave
        self._decode_s: float | None = None  # a decode step's time, smoothed
        self._token_s: float | None = None  # one prompt token's prefill time, smoothed
        self.last_prefill_budget: int | None = None
        self.gate_failures = 0
        self.eos_ids = frozenset(tokenizer.eos_token_ids)
        # Prefix cache (block_size 0 turns it off; so does a model whose caches cannot be cut).
        self.block_size = config.block_size
        self.fingerprint = fingerprint
        self.kinds = layer_kinds(model) if config.block_size else None
        self.hybrid = bool(self.kinds) and ARRAYS in self.kinds
        # Per layer, a sliding window's tokens (0: none); what a block holds, by layer.
        self.windows = layer_windows(model) if self.kinds else []
        self.window_layers = frozenset(i for i, k in enumerate(self.kinds or ()) if k == WINDOW)
        self.layout = layout(self.kinds, self.windows) if self.kinds else ""
        self.state_sizes = (
            [len(c.cache) if k == ARRAYS else 0 for c, k in
             zip(make_prompt_cache(model), self.kinds, strict=True)]
            if self.kinds else []
        )
        # The prefix cache's RAM blocks, owned by this thread, within cache_ram_max bytes.
        self.blocks = PrefixCache(config.cache_ram_max, block_size=config.block_size)
        self.new_blocks: list[tuple[str, KVBlock]] = []  # cut since the caller last took them
        # The last step's prompt responses whose blocks are still to cut (``cut_pending``).
        self._to_cut: list[Any] = []
        # A vision-language model's tower (``vision.VisionTower``; None: text alone).
        self.vision = vision
        # ``draft``: the draft model (``draft_model.DraftModel``) for --speculative draft.
        self.runner = Runner(model, config, stream, vision, draft)
        self.requests: dict[str, Request] = {}
        self._by_uid: dict[int, Request] = {}
        self.steps = 0
        self.generated_tokens = 0
        self.prefill_tokens = 0  # prompt tokens run through the model
        # Each waiting sequence's uid -> ``prefill_tokens`` when it was first seen waiting.
        self._waiting_since: dict[int, int] = {}
        self.partial_hit_tokens = 0  # prompt tokens taken from part of a block
        # The tokens the last step sampled, as a checksum (followers of a sharded model
        # compare theirs with rank 0's), and rank 0's channel to its followers: told each
        # step's plan before it runs, and of a reset (actors/distributed.py).
        self.last_digest = 0
        self.mirror: Any = None
        # The requests' text (``text.TextStage``), run inside ``update`` so that ``step``
        # returns the clients' events; None: the caller runs it on a thread of its own, fed
        # the engine's events, and ends the requests it says must end (``end``).
        self.text: TextStage | None = TextStage() if inline_text else None

    # -- commands ----------------------------------------------------------------------

    @property
    def caching(self) -> bool:
        return bool(self.kinds)

    def chain_root(self, namespace: str = "") -> str:
        """Where the block names of a prompt in cache namespace ``namespace`` start."""
        return namespace_root(self.fingerprint, namespace)

    def prompt_hashes(self, prompt: list[int], namespace: str = "") -> list[str]:
        """Hashes of the prompt's blocks that could be served from cache, in its cache
        namespace."""
        if not self.caching:
            return []
        hashes = block_hashes(self.chain_root(namespace), prompt, self.block_size)
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
        partial_max: int | None = None,
        namespace: str = "",
        images: dict[int, Any] | None = None,
    ) -> Request:
        """Queue a request; it joins the batch at the next step. Raises RequestError.

        ``cached``: leading blocks of the prompt already computed (a prefix-cache hit); only
        the rest of the prompt is prefilled. ``output``: how to read tool calls and reasoning
        out of the answer. ``constraint``: a compiled grammar (``actors.engine.grammar.Constraint``)
        whose mask every sampled token obeys. ``partial_max``: at most this many tokens of a
        partial hit after the cached blocks (None: as many as RAM shares; the ranks of a
        sharded model agree on it). ``namespace``: its cache namespace, whose blocks alone it
        reads and into which it cuts its own (``prefix.namespace_root``). ``images``: by
        key, each image whose tokens the prompt holds (``messages.ImageInput``; its tokens
        negative ids: ``vision.image_token_ids``).
        """
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already running", "conflict")
        if not prompt:
            raise RequestError("the prompt is empty")
        if sampling.max_tokens <= 0:
            raise RequestError("max_tokens must be positive")
        if images and self.vision is None:
            raise RequestError("this model reads no images")
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
        grammar = constraint.processor() if constraint is not None else None
        if grammar is not None:
            processors.append(grammar)
        if output is not None and output.think and output.thinking_budget is not None:
            start, end = output.think
            processors.append(thinking_budget_processor(
                output.thinking_budget, self._encode_tag(end),
                start_tokens=self._encode_tag(start), starts_inside=output.in_reasoning))
        root = self.chain_root(namespace)
        hashes = self.prompt_hashes(prompt, namespace)
        # Sliding-window layers: only up to a block whose window the blocks hold.
        n_cached = usable(cached, self.kinds, self.windows) if cached else 0
        cached = cached[:n_cached]
        start = n_cached * self.block_size
        prefix = list(cached)
        partial = self._partial_hit(prompt, start, cached[-1].block_hash if cached else None,
                                    partial_max, root)
        if partial is not None and not covered([*prefix, partial], self.kinds, self.windows):
            partial = None
        if partial is not None:
            prefix.append(partial)
            start += partial.n_tokens
            self.partial_hit_tokens += partial.n_tokens
        uid = self.runner.insert(
            self._segments(prompt, start, len(hashes)),
            max_tokens=sampling.max_tokens,
            cache=self._prefix_cache(prompt, start, prefix, root),
            done=prompt[:start],
            sampler=make_request_sampler(sampling),
            processors=processors,
            stop_ids=stop_ids,
            speculative=sampling.speculative,
            images=images,
        )
        req = Request(
            request_id=request_id,
            uid=uid,
            prompt_len=len(prompt),
            sampling=sampling,
            stop_ids=stop_ids,
            cached_tokens=start,
            hashes=hashes,
            stored=n_cached,
            windows_upto=n_cached,
            root=root,
            grammar=grammar,
        )
        self.requests[request_id] = req
        if self.text is not None:
            self.text.open(self.text_output(req, output))
        self._by_uid[uid] = req
        return req

    def text_output(self, req: Request, output: OutputSpec | None) -> TextOutput:
        """The text stage's side of a request this engine added (``output``: as given to
        ``add``)."""
        return TextOutput.of(self.tokenizer, req.request_id, req.uid, req.sampling, output,
                             prompt_tokens=req.prompt_len, cached_tokens=req.cached_tokens)

    def _prefix_cache(self, prompt: list[int], start: int, prefix: list[KVBlock],
                      root: str) -> list[Any] | None:
        """The cache holding the prompt's first ``start`` tokens (those of ``prefix``): a
        finished sequence's whole cache that holds them and has room for the prompt (a
        repeated prompt: a hot cache, taken out of the store, its buffers the request's, no
        copy), else one built from the blocks (a copy of every block, 30-50 ms for 2,000
        tokens of the default model on the CPU). Both hold exactly ``start`` tokens,
        whichever path a rank takes: the ranks of a sharded model must agree on the tokens
        each sequence holds. Hot caches are taken within the namespace of ``root`` only."""
        if not prefix:
            return None
        if not self.hybrid:
            hot = self.blocks.take_hot(prompt, start, root)
            if hot is not None:
                return hot
        return build_cache(self.model, self.kinds, prefix)

    def _encode_tag(self, tag: str) -> list[int]:
        return list(self.tokenizer.encode(tag, add_special_tokens=False))

    def _partial_hit(self, prompt: list[int], start: int, parent: str | None,
                     most: int | None = None, root: str = "") -> KVBlock | None:
        """After the whole blocks, the longest run of the prompt's next tokens that a block in
        RAM following the same parent shares (a full block of another prompt, or a tail), cut
        to that length: a shared chat template, a repeated prompt's last partial block and a
        new ending reuse every token they share, not only whole blocks. Plain KV models
        only (recurrent state exists only at a block's end), and one prompt token is always
        left to run through the model. At the prompt's start (no ``parent``) only blocks of
        the chain from ``root`` count: its own namespace's."""
        if not self.caching or self.hybrid:
            return None
        room = min(self.block_size, len(prompt) - 1 - start)
        if most is not None:
            room = min(room, most)
        if room <= 0:
            return None
        block, n = self.blocks.best_partial(parent, prompt[start : start + room], root)
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
        for blk in cut_blocks(cache, self.kinds, first, last, self.block_size, hashes, tokens,
                              req.root, req.windows):
            self._keep(req, blk)
        req.stored = last
        for b in range(first, last):
            req.windows.pop(b, None)

    def _keep(self, req: Request, blk: KVBlock) -> None:
        # Queued for the disk even if the RAM budget evicts it at once: the queue holds it.
        if self.blocks.store(blk):
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
        if self.window_layers:
            self._take_windows()
        pending, self._to_cut = self._to_cut, []
        if pending:
            self._cut_at_boundaries(pending)

    def _take_windows(self) -> None:
        """Sliding-window models: the window layers' KV of the blocks the last step completed,
        kept with their request until its blocks are cut. A sliding layer keeps only its last
        ``window`` tokens (and a prefill's last chunk): by the end of a prompt, or of an
        answer, it has dropped most blocks' tokens, and a hit ending at such a block could not
        rebuild its window. Only those layers are copied, a window each."""
        size = self.block_size
        for uid, n in self.runner.cache_lengths().items():
            req = self._by_uid.get(uid)
            if req is None or n // size <= req.windows_upto:
                continue
            try:
                cache, _ = self.runner.extract_cache(uid, self.window_layers)
                req.windows.update(window_parts(cache, self.kinds, req.windows_upto, n // size,
                                                size))
            except Exception:  # caching is an optimisation: never fail the request for it
                log.exception("could not take the windows of %s", req.request_id)
            req.windows_upto = n // size

    def abort(self, request_id: str) -> RequestFinished | None:
        """Remove a request wherever it is (queued, prefilling, decoding) and free its KV."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.cut_pending()  # its blocks, and its neighbours', before the batch changes
        self.runner.remove(req.uid)
        events = self._through_text([self._finish(req, "abort")])
        return events[0] if events else None

    def end(self, notice: EndRequest) -> bool:
        """End a request its text ended: out of the batch, keeping the blocks its answer
        completed; no event (the text stage gave its last). The tokens made after the end
        leave the generated count, as they never reached the client. False when the engine
        no longer runs it (it finished meanwhile, or was aborted)."""
        req = self.requests.get(notice.request_id)
        if req is None or req.uid != notice.uid:
            return False
        self.generated_tokens -= max(0, req.generated - notice.generated)
        try:
            self._take_out(req)
        except Exception:  # its blocks are an optimisation: it leaves the batch regardless
            log.exception("could not keep the blocks of %s", notice.request_id)
            self.runner.remove(req.uid)
        self._forget(req)
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    @property
    def waiting(self) -> int:
        """Requests not yet in a batch."""
        return self.runner.waiting

    def release_idle(self) -> None:
        """What an idle engine gives back beside MLX's buffer cache: the draft model's
        caches of finished rows (kept for a conversation's next turn)."""
        if self.runner.draft is not None:
            self.runner.draft.forget()

    # -- the step ------------------------------------------------------------------------

    def step(self, limit: int | None = None, floor: int = 0,
             plan: SchedulerOutput | None = None) -> list[Out]:
        """Run one step of the batch: ``schedule`` decides, the runner executes, ``update``
        turns the tokens into events.

        ``limit``: bytes of MLX memory the step must stay under (the per-chunk gate; None:
        no gate). Prefilling requests that no longer fit fail alone, and waiting ones join
        the prefill only while the whole prefill fits. ``floor``: memory in use at idle, to
        tell a request that can never fit (too large) from one that came at a bad time
        (memory unavailable now). ``plan``: run this plan instead of making one (a follower
        rank of a sharded model runs rank 0's)."""
        self.cut_pending()
        if not self.requests:
            return []
        plan, usage = self._schedule(limit, plan)
        events = self._through_text(self._fail_for_memory(plan, limit, floor, usage))
        if not self.requests:
            return events
        try:
            out = self.runner.execute(plan)
        except Exception as exc:  # the model step failed: no request in it can go on
            return events + self._step_failed(exc)
        self._measured(out, plan)
        return events + self.update(out)

    def _schedule(self, limit: int | None, plan: SchedulerOutput | None
                  ) -> tuple[SchedulerOutput, int]:
        """The step's plan (``plan`` when given: rank 0's, on a follower) and the memory in
        use it was made with; rank 0's followers are told it before it runs."""
        self._order_waiting()
        usage = 0
        if plan is None:
            plan, usage = self._plan(limit)
        if self.mirror is not None:
            self.mirror.plan(plan, self.steps, self.last_digest)
        self.last_prefill_budget = plan.budget
        return plan, usage

    def _step_failed(self, exc: Exception) -> list[Out]:
        """Every request fails and the batch starts afresh (followers too)."""
        log.exception("batch step failed; failing %d requests", len(self.requests))
        if self.mirror is not None:
            self.mirror.reset(f"rank 0's step failed: {exc}")
        return self.reset(f"engine step failed: {exc}")

    def update(self, out: ModelOutput) -> list[Out]:
        """The step's results as events: each sampled token appended to its request
        (``TokensSampled``), finishing it at a stop token or its length; then, with the text
        stage inline, the clients' events (text, stop strings, tool calls), the requests the
        text ended taken out at once. The blocks its prefill completed are cut after the
        tokens are answered (``cut_pending``)."""
        if self.caching:
            self._to_cut = [r for r in out.prompt_responses if r.end_of_segment]
        raw: list[EngineEvent] = []
        for resp in out.responses:
            req = self._by_uid.get(resp.uid)
            if req is None:
                continue
            try:
                self._on_token(req, resp, raw)
            except Exception as exc:  # one request's post-processing failed: only it fails
                log.exception("request %s failed", req.request_id)
                self.runner.remove(req.uid)
                raw.append(self._finish(req, "error", error=str(exc), kind="internal"))
        return self._through_text(raw)

    def _through_text(self, raw: list[EngineEvent]) -> list[Out]:
        """The clients' events for the engine's, through the inline text stage, ending at
        once the requests it ended; without one, the engine's events as they are."""
        if self.text is None:
            return list(raw)
        events, notices = self.text.feed(raw)
        for notice in notices:
            self.end(notice)
        return list(events)

    def _plan(self, limit: int | None) -> tuple[SchedulerOutput, int]:
        """The step's plan from ``schedule``, and the memory in use it was made with. When the
        gate held something back, MLX's allocator cache (memory it can give back) is given
        back first and the step planned again."""
        if limit is None or self.memory is None:
            return schedule(self._state(None)), 0
        # A sharded model runs on every rank at once: its fullest rank is the one that runs
        # out (the others' memory as they reported it after the last step).
        others = self.mirror.usage() if self.mirror is not None else 0
        active, cached = mx.get_active_memory(), mx.get_cache_memory()
        plan = schedule(self._state(Memory(self.memory, max(active + cached, others), limit)))
        if plan.held and (cached or len(self.blocks.hot)):
            # The hot caches are copies of blocks' KV: the first to go for a prompt.
            self.blocks.drop_hot()
            mx.clear_cache()
            active, cached = mx.get_active_memory(), mx.get_cache_memory()
            plan = schedule(self._state(Memory(self.memory, max(active + cached, others),
                                               limit)))
        return plan, max(active + cached, others)

    def _order_waiting(self) -> None:
        """Put the waiting sequences in the order they start (``schedule.start_order``); the
        plan starts the first ``admit`` of them. On every rank of a sharded model (which runs
        rank 0's plan) each engine orders its own queue, alike: from prompt lengths and
        token counts that are the same on every rank."""
        since = self._waiting_since
        rows = self.runner.waiting_lengths()
        self._waiting_since = {uid: since.get(uid, self.prefill_tokens) for uid, _ in rows}
        order = start_order([Waiting(uid, n, self._waited(uid)) for uid, n in rows],
                            self.config)
        self.runner.order_waiting(order)

    def _waited(self, uid: int) -> int:
        """Prompt tokens prefilled since the waiting sequence ``uid`` arrived."""
        return self.prefill_tokens - self._waiting_since.get(uid, self.prefill_tokens)

    def _state(self, memory: Memory | None) -> StepState:
        """Where the batch stands, in the plain numbers ``schedule`` takes."""
        runner = self.runner
        prefilling = [Pending(uid, self._member(uid, segments, in_cache), whole,
                              segments=tuple(len(s) for s in segments))
                      for uid, segments, whole, in_cache in runner.prefill_rows()]
        waiting = []
        for uid, segments, in_cache in runner.waiting_rows(self.config.prefill_batch_size):
            member = self._member(uid, segments, in_cache)
            waiting.append(Pending(uid, member, member.remaining,
                                   tuple(len(s) for s in segments), self._waited(uid)))
        return StepState(
            config=self.config, mixed=runner.mixed, decoding=runner.decoding,
            decode_len=runner.decode_len, prefilling=prefilling, waiting=waiting,
            decode_s=self._decode_s, token_s=self._token_s, memory=memory,
            decode_uids=runner.decode_uids, first_token_in_chunk=runner.first_token_in_chunk)

    def _measured(self, out: ModelOutput, plan: SchedulerOutput) -> None:
        """Count the step and learn its timings."""
        self.steps += 1
        self.last_digest = _digest(out.responses)
        self.prefill_tokens += out.prefilled
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %d: %.0f ms, %d decoding, %d drafted, %d prompt tokens, "
                      "%d waiting for a first token, budget %s, decode step %.0f ms, "
                      "prompt token %.1f ms", self.steps, out.wall * 1e3, out.decoding,
                      out.drafted, out.prefilled, self.runner.waiting
                      + self.runner.prefilling, plan.budget,
                      (self._decode_s or 0) * 1e3, (self._token_s or 0) * 1e3)
        self._measure(out.prefilled, out.decoding, out.wall)

    def _measure(self, tokens: int, decoding: int, wall: float) -> None:
        """Learn a decode step's time from steps without prefill, and a prompt token's from
        the rest of the steps' time. Whole steps are timed: MLX evaluates lazily, so the
        work cannot be told apart inside a step."""
        if not tokens:
            if decoding:
                self._decode_s = ema(self._decode_s, wall)
            return
        if decoding and self._decode_s is None:
            if self._token_s is not None:
                # Rows began decoding beside a prefill and every step since carried a chunk
                # (a chat behind a long prompt): the decode step is what the chunk's tokens,
                # at the rate the prefill ran alone, leave of the step. Unknown, the decode
                # step counted as free and the interleave gave whole chunks of seconds.
                self._decode_s = max(wall - tokens * self._token_s, 0.0)
            return
        spent = wall - (self._decode_s if decoding else 0.0)
        self._token_s = ema(self._token_s, max(spent, 0.0) / tokens)

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
            if not self.runner.holds(r.uid):
                continue  # it finished in this step: its blocks were cut as it finished
            try:
                cache, tokens = self.runner.extract_cache(r.uid)
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
        conversation resends prompt and answer; a repeated prompt ends in that tail).

        The cache itself (already a copy, extracted from the batch) is kept whole too, as a
        hot cache (``hot_cache.py``), so that a repeated prompt takes it instead of copying
        the blocks back: the KV of the last few sequences is then in RAM twice, in blocks and
        whole, within the prefix cache's budget."""
        if not self.caching or self.hybrid or not cache:
            return
        try:
            hashes = block_hashes(req.root, tokens, self.block_size)
            self._cut(req, cache, tokens, hashes)
            start = len(hashes) * self.block_size
            if start < len(tokens):
                parent = hashes[-1] if hashes else None
                name = "tail-" + chain_hash(parent or req.root, tokens[start:])
                self._keep(req, cut_tail(cache, self.kinds, start, tokens, parent, name,
                                         req.root))
            self.blocks.keep_hot(tokens, cache, req.root)
        except Exception:
            log.exception("could not cut prefix blocks of %s", req.request_id)

    def _on_token(self, req: Request, resp: Any, raw: list[EngineEvent]) -> None:
        """Append one sampled token of ``req`` to ``raw`` (with the tokens the same step
        sampled before it for ``req``, in one ``TokensSampled``), finishing the request at a
        stop token or its length, or at the token its grammar could not give."""
        grammar = req.grammar
        if grammar is not None and grammar.error_at is not None \
                and req.generated >= grammar.error_at:
            raw.append(self._grammar_failed(req, grammar, resp))
            return
        token = resp.token
        ttft = None
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
            ttft = req.first_token_at - req.added_at
        req.generated += 1
        self.generated_tokens += 1
        finish = resp.finish_reason
        if finish is not None:
            self._cut_finished(req, resp.prompt_cache, resp.all_tokens)
        logprobs = (sampled_logprobs(token, resp.logprobs, req.sampling.top_logprobs)
                    if req.sampling.logprobs else None)
        last = raw[-1] if raw else None
        if isinstance(last, TokensSampled) and last.request_id == req.request_id \
                and last.finish_reason is None:
            last.token_ids.append(token)
            last.finish_reason = finish
            if logprobs is not None and last.logprobs is not None:
                last.logprobs.append(logprobs)
        else:
            raw.append(TokensSampled(request_id=req.request_id, token_ids=[token],
                                     finish_reason=finish, ttft_s=ttft,
                                     logprobs=[logprobs] if logprobs is not None else None))
        if finish is not None:
            raw.append(self._finish(req, finish))

    def _grammar_failed(self, req: Request, grammar: GrammarProcessor, resp: Any
                        ) -> RequestFinished:
        """End a request at the token its grammar could not give (``GrammarProcessor``): with
        an error, never with an answer the grammar did not finish. The grammar is the
        client's (its schema, its tools), whence a 400 "invalid"."""
        if resp.finish_reason is None:  # the EOS it was left to was not a stop (ignore_eos)
            self.runner.remove(req.uid)
        log.warning("request %s failed: %s; llguidance: %s", req.request_id, grammar.error,
                    grammar.detail or "-")
        return self._finish(req, "error", error=grammar.error, kind="invalid")

    def _take_out(self, req: Request) -> None:
        """Take a request that ended before the generator saw it end (a stop string, a
        repeated call) out of the batch, keeping the blocks its answer completed."""
        if self.caching and not self.hybrid:
            self._cut_finished(req, *self.runner.extract_cache(req.uid))
        self.runner.remove(req.uid)

    # -- endings -------------------------------------------------------------------------

    def _forget(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        self._by_uid.pop(req.uid, None)

    def _finish(
        self,
        req: Request,
        reason: str,
        *,
        error: str | None = None,
        kind: ErrorKind | None = None,
    ) -> RequestFinished:
        """The engine's last event of a request (the text stage adds what the text knows:
        its reasoning tokens, a "tool_calls" finish)."""
        self._forget(req)
        ttft = None if req.first_token_at is None else req.first_token_at - req.added_at
        return RequestFinished(
            request_id=req.request_id,
            finish_reason=reason,
            usage=Usage(
                prompt_tokens=req.prompt_len,
                completion_tokens=req.generated,
                cached_tokens=req.cached_tokens,
            ),
            error=error,
            error_kind=kind,
            ttft_s=ttft,
        )

    def reset(self, message: str) -> list[Out]:
        """Fail every request and start a fresh batch (after a failed step)."""
        events: list[EngineEvent] = [
            self._finish(req, "error", error=message, kind="internal")
            for req in list(self.requests.values())
        ]
        self.runner.reset()
        self.blocks.drop_hot()
        mx.clear_cache()
        return self._through_text(events)

    # -- the per-chunk memory gate -------------------------------------------------------------

    def _member(self, uid: int, segments: list[list[int]], in_cache: int) -> Member:
        """Where one sequence stands, for the gate: its cache, what is left of its prompt,
        its next chunk, and the prefix-cache blocks it cuts next step and until it ends."""
        remaining = sum(len(seg) for seg in segments)
        chunk = chunk_of([len(s) for s in segments], self.prefill_step_size,
                         self.runner.mixed)[0] \
            if segments else 0
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

    def _fail_for_memory(self, plan: SchedulerOutput, limit: int | None, floor: int, usage: int
                         ) -> list[EngineEvent]:
        """Take the requests the plan fails or rejects for want of memory out of the batch,
        freeing their caches."""
        uids = [*plan.fail, *([plan.reject] if plan.reject is not None else [])]
        reqs = [r for r in (self._by_uid.get(uid) for uid in uids) if r is not None]
        events: list[EngineEvent] = []
        if not reqs:
            return events
        if limit is None or self.memory is None:
            # A plan made elsewhere (rank 0's, on a follower): the same requests go.
            for req in reqs:
                self.runner.remove(req.uid)
                events.append(self._finish(req, "error", error="out of memory (rank 0's gate)",
                                           kind="unavailable"))
            return events
        floor = idle_floor(self.memory, floor)
        for req in reqs:
            self.runner.remove(req.uid)
            self.gate_failures += 1
            need = prompt_need(self.memory, prompt_tokens=req.prompt_len,
                               step=self.prefill_step_size,
                               block_size=self.block_size if self.caching else 0)
            mb = 1e6
            # It could never fit, even at idle; or memory is held by other work now.
            never = too_large(need, limit=limit, idle=floor)
            kind: ErrorKind = "too_large" if never else "unavailable"
            message = (
                f"out of memory for this prompt's prefill: it needs about {need / mb:.0f} MB "
                f"more; {usage / mb:.0f} MB of the {limit / mb:.0f} MB memory limit are in use"
            )
            log.warning("request %s failed by the memory gate: %s", req.request_id, message)
            events.append(self._finish(req, "error", error=message, kind=kind))
        return events

    def progress(self) -> list[dict[str, Any]]:
        """Where each request stands (waiting, prefilling n of its prompt, decoding), for a
        report read on another thread: every live container is first copied with ``list()``,
        which runs without yielding the GIL, so the MLX thread's changes never break it; a
        request that moves between the copies shows its old stage for one snapshot."""
        prefilled = self.runner.prefilled_tokens()
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
            "prefilling": self.runner.prefilling,
            "decoding": self.runner.decoding,
            "steps": self.steps,
            "generated_tokens": self.generated_tokens,
            "prefill_tokens": self.prefill_tokens,
            "partial_hit_tokens": self.partial_hit_tokens,
            "prefill_budget": self.last_prefill_budget,
            "gate_failures": self.gate_failures,
            "drafts": self.runner.drafts,
            "draft_tokens": self.runner.drafted,
            "draft_accepted_tokens": self.runner.accepted,
            "draft_restores": self.runner.restored,
            "draft_model_passes": self.runner.draft.passes if self.runner.draft else 0,
            "draft_model_reused_tokens": self.runner.draft.reused if self.runner.draft else 0,
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
        self.runner.warm_up(ids)
        return time.perf_counter() - began

    def close(self) -> None:
        self.runner.close()
