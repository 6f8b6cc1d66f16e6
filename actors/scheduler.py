"""The scheduler actor: owns one model, its MLX stream and its ``Engine``, on the MLX thread.

Spawn it with ``thread=MLX_THREAD``: MLX streams are bound to the thread that made them, so the
model is loaded in ``on_start`` and every array it makes stays on that thread. Only plain
``msgspec`` events and numpy snapshots leave it.

The step loop is message driven: after handling any message, if requests are in flight and no
``Step`` is queued, the scheduler queues one to itself. Everything that arrived meanwhile (new
requests, aborts, blocks read from disk) sits ahead of that ``Step`` in the mailbox, so the
mailbox is drained between every two model steps.

The prefix cache's disk tier (a request's wait for its cached blocks, new blocks written,
RAM spilled) is actors/disk_tier.py's ``DiskTier``, which the scheduler owns and calls.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from typing import Any

import mlx.core as mx
import msgspec
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_load

from troupe.actors.cache_messages import BlocksRead, FoundOnDisk, HeldOnDisk, SpillRam
from troupe.actors.disk_tier import DiskTier, PrefixSupplied
from troupe.actors.distributed.leader import STUCK_AFTER_S, Followers
from troupe.actors.distributed.protocol import read_secret
from troupe.actors.distributed.shards import load_shard, shard_memory
from troupe.actors.engine.config import DEFAULTS, EngineConfig
from troupe.actors.engine.core import Engine, RequestError
from troupe.actors.engine.dense import read_dense
from troupe.actors.engine.draft_model import DraftModel, check_draft_model, vocabulary
from troupe.actors.engine.embed import (
    Embedder,
    EmbedJob,
    answer_token,
    model_task,
    read_embed_spec,
)
from troupe.actors.engine.encoder import (
    EncoderEmbedder,
    encoder_positions,
    is_encoder,
    load_encoder,
)
from troupe.actors.engine.kv_blocks import KVBlock
from troupe.actors.engine.memory_estimate import OK, ModelMemory, model_memory, with_draft
from troupe.actors.engine.prefix import model_fingerprint
from troupe.actors.engine.schedule import ema, embed_budget
from troupe.actors.engine.vision import VisionTower, why_no_images
from troupe.actors.memory_messages import (
    DescribeLoad,
    EngineLoad,
    GetMemoryLimits,
    MemoryLimits,
    RanksMemory,
    Retire,
)
from troupe.actors.memory_monitor import trim_heap
from troupe.actors.messages import (
    AbortRequest,
    AddRequest,
    AdmissionError,
    DescribeEngine,
    Embedded,
    EmbedInputs,
    ErrorKind,
    ModelCard,
    RequestFinished,
    RequestStarted,
    Step,
    Usage,
)
from troupe.actors.models.generation_config import sampling_defaults
from troupe.actors.models.store import DEFAULT_MODEL, resolve_model
from troupe.actors.retry import FinishPace
from troupe.actors.text_worker import TextWorker
from troupe.runtime import Actor, ActorDead, ActorRef, AskTimeout, MailboxFull, Message, Reply
from troupe.runtime.threads import at_thread_exit

log = logging.getLogger("actors.scheduler")

MLX_THREAD = "mlx"
# After a stuck step's requests got their errors, how long the process stays up so that the
# HTTP layer writes them out before it exits.
STUCK_EXIT_GRACE_S = 2.0
# An idle engine's arrival window stays open while requests keep arriving, up to this many
# windows after the first arrival.
ARRIVAL_WINDOWS_MAX = 5
# A starting scheduler asks the memory monitor for the limits; it does not wait longer.
LIMITS_TIMEOUT_S = 2.0
# An engine idle this long gives back the memory its last requests freed (MLX's buffer
# cache, the C heap's free pages): a burst of long prompts left the process 2.3 GB larger
# for good. Not at once: a request arriving soon after reuses that memory.
IDLE_RELEASE_S = 2.0


def context_length(config: dict[str, Any]) -> int:
    """The model's context window, from its config (nested ``text_config`` included); an
    encoder's, the inputs its position table takes."""
    positions = encoder_positions(config)
    if positions is not None:
        return positions
    for cfg in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length"):
            if isinstance(cfg.get(key), int):
                return cfg[key]
    return 4096


class ThreadLoad:
    """Requests each model's scheduler has in flight, and how long its steps take (smoothed),
    by scheduler name: every scheduler runs on the one MLX thread, which runs the models'
    steps in turn, and an embedding model's step keeps to what the step budget leaves beside
    the steps of the other models with requests waiting (``schedule.embed_budget``). The
    engine pool makes one and gives it to every scheduler it spawns; each writes its own
    entries, on that thread: after every message it handles, and after every step."""

    def __init__(self) -> None:
        self._in_flight: dict[str, int] = {}
        self._step_s: dict[str, float] = {}

    def report(self, name: str, in_flight: int) -> None:
        self._in_flight[name] = in_flight

    def stepped(self, name: str, wall: float) -> None:
        """``name``'s step took ``wall`` seconds."""
        self._step_s[name] = ema(self._step_s.get(name), wall)

    def drop(self, name: str) -> None:
        self._in_flight.pop(name, None)
        self._step_s.pop(name, None)

    def others_step_s(self, name: str) -> float | None:
        """The time the steps of the schedulers other than ``name`` with requests in flight
        take, one each (a step not timed yet counts as none); None when none has any."""
        busy = [key for key, n in self._in_flight.items() if n and key != name]
        return sum(self._step_s.get(key, 0.0) for key in busy) if busy else None


class ReleaseMemory(Message, frozen=True, kw_only=True):
    """The scheduler's note to itself: it may have been idle for IDLE_RELEASE_S."""


def weights_profile(model: Any) -> tuple[int, int | None]:
    """(bytes of the model's parameters, bytes per element of the floating dtype holding most
    of them): quantized weights are integers, their scales carry the compute dtype."""
    total = 0
    floats: dict[int, int] = {}
    for _, p in tree_flatten(model.parameters()):
        total += p.nbytes
        if mx.issubdtype(p.dtype, mx.floating):
            floats[p.dtype.size] = floats.get(p.dtype.size, 0) + p.nbytes
    return total, max(floats, key=lambda k: floats[k]) if floats else None


class Scheduler(Actor):
    """Continuous batching for one model. Messages: AddRequest (via ``stream``), AbortRequest,
    DescribeEngine (via ``ask``), FoundOnDisk and HeldOnDisk (from the cache index), BlocksRead
    (from the SSD writer) and PrefixSupplied (rank 0: the other ranks' answer to a probe), which
    its disk tier takes, MemoryLimits and SpillRam (from the memory monitor), DescribeLoad and
    Retire (from the engine pool), and its own Step and ReleaseMemory."""

    def __init__(
        self,
        *,
        model: str | None = None,
        config: EngineConfig = DEFAULTS,
        index: ActorRef | None = None,
        writer: ActorRef | None = None,
        model_id: str | None = None,
        memory_monitor: ActorRef | None = None,
        thread_load: ThreadLoad | None = None,
        draft_model: str | None = None,
    ) -> None:
        self.model_spec = model
        # The draft model's directory (``--draft-model``, resolved by the pool for a chat
        # model; None: no draft model).
        self.draft_model = draft_model
        # What the other models on the MLX thread have in flight (the pool's; alone: its own).
        self.thread_load = thread_load if thread_load is not None else ThreadLoad()
        self.config = config
        # An idle engine steps once no request has arrived for this long (at most
        # ARRIVAL_WINDOWS_MAX windows after the first), so a burst of requests is prefilled
        # together rather than in one step per arrival.
        self.arrival_window_s = max(0.0, config.arrival_window_ms) / 1000
        self._window_opened: float | None = None  # when an idle engine's window opened
        self._last_arrival = 0.0
        # The pool resolves models itself and passes the name the model is served as.
        self.model_id = model_id
        self.model_name = model_id or model or DEFAULT_MODEL
        self.max_queue = config.max_queue
        self.pace = FinishPace()  # how fast requests finish: a full queue's Retry-After
        # The disk tier's actors, injected at spawn (None: no disk tier), for ``self.disk``.
        self.index = index
        self.writer = writer
        # Injected at spawn; None: no memory monitor (a scheduler spawned alone, in a test):
        # no limits until some are sent, and the other ranks' memory is told to no one.
        self.memory_monitor = memory_monitor
        self.limits: MemoryLimits | None = None
        self.retired = False
        self._last_active = time.monotonic()
        self.engine: Engine | None = None
        # An embedding or reranker model's queue of inputs (None: a chat model), and the
        # answers of its jobs by request id.
        self.embedder: Embedder | EncoderEmbedder | None = None
        self._embed_answers: dict[str, Reply] = {}
        self._embed_budget = 0  # the tokens the last embedding step was given
        self.card: ModelCard | None = None
        self._replies: dict[str, Reply] = {}
        # The requests' text, on a thread of its own (None: inside the engine's step, as
        # rank 0 of a sharded model keeps it, ending requests in the same step as its
        # followers, which run the same text inline).
        self.text: TextWorker | None = None
        # The prefix cache's disk tier: the requests waiting for their cached blocks, and the
        # new blocks waiting for the disk (made with the engine, in on_start).
        self.disk: DiskTier | None = None
        self._step_queued = False
        # The next step held for the cache index's answers (``DiskTier.lookup_grace``): its
        # timer, and whether a step was held since the last one ran (once a step at most).
        self._lookup_hold: asyncio.TimerHandle | None = None
        self._held = False
        self._tps_window: list[tuple[float, int]] = []
        self.counters = {"hit_tokens": 0, "miss_tokens": 0}
        self._stepping = False  # inside engine.step (read by the stuck-step watchdog)
        # The other ranks of a sharded model (rank 0 only; actors/distributed/).
        self.followers: Followers | None = None
        self._release_timer: asyncio.TimerHandle | None = None
        self.memory_releases = 0  # times an idle engine gave memory back
        self._ranks_peak = 0  # the other ranks' peak not yet told to the memory monitor

    async def on_start(self) -> None:
        started = time.perf_counter()
        # Conversion (a GGUF or the bundled default) makes MLX arrays too: it runs here.
        resolved = resolve_model(self.model_spec)
        self.model_name = self.model_id or resolved.name
        stream = mx.new_stream(mx.default_device())
        encoder = is_encoder(resolved.path)
        with mx.stream(stream):
            if encoder:  # the BERT family, through mlx-vlm (actors/engine/encoder.py)
                model, tokenizer, config = load_encoder(resolved.path,
                                                        model_task(self.config, resolved.path))
            elif self.config.distributed:  # rank 0 of a sharded model: this rank's shard
                model, tokenizer = load_shard(str(resolved.path), self.config.distributed,
                                              mx.distributed.init())
                config = json.loads((resolved.path / "config.json").read_text())
            else:
                model, tokenizer, config = mlx_load(str(resolved.path), return_config=True)
        fingerprint = model_fingerprint(resolved.path)
        weights, dtype_bytes = weights_profile(model)
        memory = model_memory(config, dtype_bytes=dtype_bytes, weights_bytes=weights)
        draft = None
        if self.draft_model is not None:
            draft, draft_memory = self._load_draft(stream, resolved.name, tokenizer)
            memory = with_draft(memory, draft_memory)
        if self.config.distributed:  # the gate counts one rank's shard against its limit
            memory = shard_memory(memory, self.config.distributed,
                                  mx.distributed.init().size())
        vision = None
        if not encoder and not self.config.distributed and why_no_images(resolved.path) is None:
            try:
                with mx.stream(stream):
                    vision = VisionTower(resolved.path, model)
            except Exception:  # its tower's weights or config do not load: text alone
                log.warning("%s: vision tower not loaded; served on text alone",
                            resolved.name, exc_info=True)
        # An encoder's engine never steps (its inputs run in ``EncoderEmbedder``); without
        # blocks it keeps no prefix cache.
        engine = Engine(model, tokenizer,
                        msgspec.structs.replace(self.config, block_size=0) if encoder
                        else self.config,
                        stream=stream, fingerprint=fingerprint, memory=memory,
                        vision=vision, draft=draft, inline_text=bool(self.config.distributed))
        # Before the engine is seen: a report (read from any thread) has both or neither.
        self.disk = DiskTier(engine, scheduler=self.ref, index=self.index, writer=self.writer,
                             start=self._start)
        self.engine = engine
        self.card = ModelCard(
            id=self.model_name,
            context_length=context_length(config),
            source=resolved.source,
            path=str(resolved.path),
            fingerprint=fingerprint,
            sampling_defaults=sampling_defaults(resolved.path),
            task=model_task(self.config, resolved.path),
        )
        if self.card.task != "generate" and self.config.distributed:
            raise ValueError("embedding and reranker models are served by one process, "
                             "not sharded with --distributed")
        with mx.stream(stream):  # sentence-transformers' Dense modules: an embedder's own
            dense = read_dense(resolved.path) if self.card.task == "embed" else []
        if encoder:
            self.embedder = EncoderEmbedder(model, tokenizer, config, memory=memory,
                                            dense=dense)
        elif self.card.task != "generate":
            yes_no = ((answer_token(tokenizer, "yes"), answer_token(tokenizer, "no"))
                      if self.card.task == "rerank" else (0, 0))
            self.embedder = Embedder(model, read_embed_spec(resolved.path),
                                     yes_id=yes_no[0], no_id=yes_no[1],
                                     max_shared=self.config.prefill_step_size,
                                     engine=self.engine, memory=memory, dense=dense)
        if self.config.distributed:
            self._lead(fingerprint)
        # The run-time compiled kernels are built now, not in the first request's time.
        warm = self.embedder.warm_up() if encoder else self.engine.warm_up()
        # MLX's compile cache is per thread and holds Python objects. Left to its C++
        # thread_local destructor, which runs after the thread was joined, it needed the GIL
        # while the interpreter finalized and aborted `troupe serve` at exit now and then.
        at_thread_exit(mx.clear_streams)
        if self.engine.text is None:
            self.text = TextWorker(f"{self.name}-text")
            self.text.start()
        if self.config.block_size and not self.engine.caching and not encoder:
            log.warning("%s: its cache layers cannot be cut into blocks; prefix cache off",
                        resolved.name)
        log.info(
            "loaded %s from %s in %.1fs (warm-up %.1fs)", self.model_name, resolved.path,
            time.perf_counter() - started, warm,
        )
        monitor = self.memory_monitor
        if monitor is not None:
            # The limits from the first step on; from then the monitor sends them every poll.
            try:
                self.limits = await monitor.ask(GetMemoryLimits(), timeout=LIMITS_TIMEOUT_S)
            except (AskTimeout, ActorDead):
                pass

    def _load_draft(self, stream: mx.Stream, name: str, tokenizer: Any
                    ) -> tuple[DraftModel, ModelMemory]:
        """The draft model (``--draft-model``) on this model's stream, checked against it
        (``check_draft_model``: the same vocabulary, a cache that can take positions back),
        and its memory shape."""
        resolved = resolve_model(self.draft_model)
        with mx.stream(stream):
            model, draft_tokenizer, config = mlx_load(str(resolved.path), return_config=True)
        check_draft_model(resolved.name, model, draft_tokenizer, name, tokenizer)
        weights, dtype_bytes = weights_profile(model)
        log.info("%s drafts with %s", name, resolved.name)
        return (DraftModel(model, vocab=len(vocabulary(tokenizer)),
                           catch_up=self.config.prefill_step_size),
                model_memory(config, dtype_bytes=dtype_bytes, weights_bytes=weights))

    def _lead(self, fingerprint: str) -> None:
        """Rank 0 of a sharded model: wait for the other ranks (they load their shards
        meanwhile), give every rank the same PRNG seed, and tell them each change to the
        batch from now on (actors/distributed/)."""
        followers = Followers(mx.distributed.init().size(), self.config.distributed_port,
                              read_secret())
        seed = int.from_bytes(os.urandom(4), "little")
        followers.accept(fingerprint, seed, self.config)
        mx.random.seed(seed)
        self._attach(followers)

    def _attach(self, followers: Followers) -> None:
        """Tell ``followers`` every change to the batch from now on; their answers to probes
        come back to this actor as ``PrefixSupplied``."""
        loop, ref = asyncio.get_running_loop(), self.ref

        def supplied(request_id: str, blocks: int, partials: list[int]) -> None:
            # On a reader or timer thread. ``tell`` waits for room: the request waits on it.
            msg = PrefixSupplied(request_id=request_id, blocks=blocks, partials=partials)
            try:
                asyncio.run_coroutine_threadsafe(ref.tell(msg), loop)
            except RuntimeError:
                pass  # the loop is closed: the scheduler has stopped

        followers.on_supply = supplied
        followers.on_lost = self._watch_stuck
        self.followers = self.engine.mirror = self.disk.followers = followers

    async def on_stop(self, error: BaseException | None) -> None:
        self.thread_load.drop(self.name)
        if self._release_timer is not None:
            self._release_timer.cancel()
        if error is None and self.disk is not None:
            await self.disk.flush()
        if self.engine is not None:
            for rid in list(self.engine.requests):
                self._deliver([self.engine.abort(rid)])
            self.engine.close()
        if self.text is not None:
            self.text.stop()  # after the aborts' events: it sends them first
        if self.followers is not None:
            self.followers.close()  # the other ranks exit (their batch goes with them)
        for reply in self._replies.values():
            reply.close()
        for answer in self._embed_answers.values():
            answer.fail(AdmissionError("unavailable", "the model was unloaded; retry shortly"))
        self._embed_answers.clear()
        if self.disk is not None:
            self.disk.close()
        self._replies.clear()

    async def handle(self, msg: Any) -> Any:
        match msg:
            case Step():
                grace = 0.0 if self._held else self.disk.lookup_grace(time.monotonic())
                if grace > 0:
                    # Requests just asked the index about their blocks: the step waits for
                    # the answers (a few ms at most, once), so that they start in it and not
                    # a whole step later.
                    self._held = True
                    self._lookup_hold = asyncio.get_running_loop().call_later(
                        grace, self._lookup_held)
                    return None
                self._step_queued = False
                self._window_opened = None
                self._held = False
                await self._step()
            case AddRequest():
                self._last_active = self._last_arrival = time.monotonic()
                idle = self.engine is not None and not self.engine.has_work
                self._add(msg, self.take_reply())
                if idle and self.arrival_window_s > 0 and not self._step_queued:
                    self._queue_step(delay=self.arrival_window_s)
                    self._window_opened = self._last_arrival if self._step_queued else None
            case EmbedInputs():
                self._last_active = time.monotonic()
                self._embed(msg, self.take_answer())
            case FoundOnDisk():
                self.disk.found(msg)
                if self._lookup_hold is not None and not self.disk.looking_up:
                    # Every lookup answered: the held step runs now (queued below).
                    self._lookup_hold.cancel()
                    self._lookup_hold, self._step_queued = None, False
            case BlocksRead():
                self.disk.loaded(msg)
            case PrefixSupplied():
                self.disk.supplied(msg)
            case ReleaseMemory():
                self._release_if_idle()
            case AbortRequest(request_id=rid):
                self._abort(rid)
            case SpillRam(unpersisted=unpersisted):
                self.disk.spill(unpersisted)
            case HeldOnDisk(hashes=hashes):
                self.disk.held(hashes)
            case DescribeEngine():
                return self.card
            case MemoryLimits():
                self.limits = msg
                if msg.pressure != OK:
                    mx.clear_cache()  # the allocator's cache is the cheapest memory to give
            case DescribeLoad():
                return EngineLoad(in_flight=self._in_flight(), idle_s=self._idle_s())
            case Retire():
                # Everything sent before this message has been handled: idle now means idle.
                self.retired = self._in_flight() == 0
                return self.retired
            case _:
                raise TypeError(f"scheduler cannot handle {type(msg).__name__}")
        self.thread_load.report(self.name, self._in_flight())
        self._queue_step()
        return None

    # -- requests ------------------------------------------------------------------------

    def _in_flight(self) -> int:
        return (len(self.engine.requests) + self.disk.waiting + len(self._embed_answers)
                if self.engine else 0)

    def _embed(self, msg: EmbedInputs, answer: Reply) -> None:
        """Queue an embedding or rerank job; its answer is given when its last input ends."""
        embedder = self.embedder
        if embedder is None or self.card.task != msg.task:
            answer.fail(AdmissionError("invalid", f"model {self.model_name!r} serves "
                                       f"{self.card.task}, not {msg.task}", param="model"))
            return
        if msg.request_id in self._embed_answers:
            answer.fail(AdmissionError("conflict",
                                       f"request {msg.request_id!r} is already running"))
            return

        def done(results: list | None, error: Exception | None) -> None:
            reply = self._embed_answers.pop(msg.request_id, None)
            if reply is None:
                return
            if isinstance(error, AdmissionError):  # the memory gate's
                reply.fail(error)
            elif error is not None:
                reply.fail(AdmissionError("internal", f"the embedding step failed: {error}"))
            else:
                reply.send(Embedded(results=results))

        self._embed_answers[msg.request_id] = answer
        embedder.add(EmbedJob(msg.request_id, msg.task, msg.inputs, done,
                              namespace=msg.cache_namespace))

    def _idle_s(self) -> float:
        return 0.0 if self._in_flight() else time.monotonic() - self._last_active

    def _add(self, msg: AddRequest, reply: Reply) -> None:
        engine = self.engine
        if self.retired:
            # The pool is unloading this model: the request raced the unload. 503 with
            # Retry-After: a retry loads the model again.
            reply.send(_refused(msg, "unavailable", f"model {self.model_name!r} is being unloaded; "
                                "retry shortly"))
            reply.close()
            return
        if self.followers is not None and self.followers.dead:
            reply.send(_refused(msg, "unavailable", f"{self.followers.dead}; the sharded "
                                "model cannot run until its ranks are restarted"))
            reply.close()
            return
        if engine.waiting + self.disk.waiting >= self.max_queue:
            refused = _refused(msg, "overloaded", "the scheduler's queue is full; retry shortly")
            ahead = len(engine.requests) + self.disk.waiting
            reply.send(msgspec.structs.replace(refused, retry_after=self.pace.retry_after(ahead)))
            reply.close()
            return
        if not engine.has_work and not self.disk.waiting:
            self.pace.busy()
        self.disk.begin(msg, reply)

    def _start(self, msg: AddRequest, reply: Reply, cached: list[KVBlock],
               partial_max: int | None = None) -> bool:
        """Add the request to the batch, from ``cached`` blocks and a partial hit of at most
        ``partial_max`` tokens after them (None: any; on a sharded model, 0 unless the other
        ranks can supply one). False when it was not added (its client is gone, or the engine
        refused it: its reply has the error)."""
        if reply.consumer_gone:
            reply.close()
            return False
        if self.followers is not None and partial_max is None:
            partial_max = 0
        try:
            req = self.engine.add(msg.request_id, msg.prompt_tokens, msg.sampling,
                                  cached=cached, output=msg.output, constraint=msg.constraint,
                                  partial_max=partial_max, namespace=msg.cache_namespace,
                                  images={i.key: i for i in msg.images})
        except RequestError as exc:
            reply.send(_refused(msg, exc.kind, str(exc)))
            reply.close()
            return False
        if self.followers is not None:
            self.followers.add(msg.request_id, msg.prompt_tokens, msg.sampling, msg.output,
                               msg.constraint.grammar if msg.constraint is not None else None,
                               blocks=len(cached), cached_tokens=req.cached_tokens,
                               namespace=msg.cache_namespace)
        self.counters["hit_tokens"] += req.cached_tokens
        self.counters["miss_tokens"] += req.prompt_len - req.cached_tokens
        self._replies[msg.request_id] = reply
        reply.send(RequestStarted(request_id=msg.request_id, prompt_tokens=req.prompt_len,
                                  cached_tokens=req.cached_tokens))
        if self.text is not None:  # its tokens come after this: the worker takes items in order
            self.text.open(self.engine.text_output(req, msg.output), reply)
        return True

    def _abort(self, request_id: str) -> None:
        answer = self._embed_answers.pop(request_id, None)
        if answer is not None:
            self.embedder.abort(request_id)
            answer.fail(AdmissionError("invalid", "aborted: the client has gone"))
        waiting = self.disk.abort(request_id)
        if waiting is not None:
            msg, reply = waiting
            reply.send(_refused(msg, None, "aborted", reason="abort"))
            reply.close()
        finished = self.engine.abort(request_id)
        if finished is not None:
            if self.followers is not None:
                self.followers.abort(request_id)
            self.disk.cancel_writes(request_id)
            self._deliver([finished])

    # -- the step --------------------------------------------------------------------------

    async def _step(self) -> None:
        engine = self.engine
        # Clients that went away leave the batch before the step, not after it. Those seen
        # gone are looked for before the text's notices are taken: the worker records a
        # request's notice before it sends the final event, so a client that closed after
        # that event has its notice taken here, and its request ends keeping its blocks.
        gone = [rid for rid, reply in self._replies.items() if reply.consumer_gone]
        if self.text is not None:
            for notice in self.text.take_notices():
                if engine.end(notice):
                    self._finished(notice.request_id)
        for rid in gone:
            if rid in self._replies:
                self._abort(rid)
        self.disk.drop_gone()
        if self.embedder is not None:
            self._embed_step()
        if engine.has_work and self.followers is not None and self.followers.dead:
            # A rank of the sharded model is gone: nothing in the batch can go on.
            self._deliver(engine.reset(self.followers.dead))
        if engine.has_work:
            limits = self.limits
            self._stepping = True
            began = time.perf_counter()
            try:
                events = engine.step(limit=limits.limit if limits and limits.guard else None,
                                     floor=limits.floor if limits else 0)
            finally:
                self._stepping = False
            self.thread_load.stepped(self.name, time.perf_counter() - began)
            self._last_active = time.monotonic()
            self._deliver(events)
            self._tps_window.append((time.perf_counter(), engine.generated_tokens))
            del self._tps_window[:-64]
            if self.followers is not None:
                self._tell_ranks_memory()
        await self.disk.persist_step(engine.take_new_blocks())
        if not self._in_flight() and not self.disk.unsaved:
            self._arm_release(IDLE_RELEASE_S)

    def _embed_step(self) -> None:
        """One step of embedding work, of the tokens ``schedule.embed_budget`` gives it (a
        chat prefill chunk's: while other models' requests wait on the MLX thread, what
        ``step_budget_ms`` leaves beside their steps), if it fits in memory (the per-step
        gate: else its jobs fail)."""
        embedder = self.embedder
        for rid in [rid for rid, a in self._embed_answers.items() if a.consumer_gone]:
            embedder.abort(rid)
            self._embed_answers.pop(rid).close()
        if not embedder.has_work:
            return
        limits = self.limits
        others = self.thread_load.others_step_s(self.name)
        self._embed_budget = embed_budget(self.config, embedder.token_s, others_step_s=others)
        began = time.perf_counter()
        embedder.step(self._embed_budget,
                      limit=limits.limit if limits and limits.guard else None,
                      floor=limits.floor if limits else 0)
        self.thread_load.stepped(self.name, time.perf_counter() - began)
        self._last_active = time.monotonic()

    def _tell_ranks_memory(self) -> None:
        """Rank 0: tell the memory monitor the other ranks' memory (the fullest rank is the
        one that runs out). A peak the monitor could not take is told with the next step's."""
        followers = self.followers
        self._ranks_peak = max(self._ranks_peak, followers.take_peak())
        monitor = self.memory_monitor
        if monitor is None:
            return
        try:
            monitor.try_tell(RanksMemory(active_bytes=followers.usage(),
                                         peak_bytes=self._ranks_peak))
        except (MailboxFull, ActorDead):
            return
        self._ranks_peak = 0

    def _arm_release(self, delay: float) -> None:
        """Remind this actor to release memory in ``delay`` seconds (once: a later step
        that leaves it idle finds the reminder set)."""
        if self._release_timer is None:
            self._release_timer = asyncio.get_running_loop().call_later(delay, self._remind)

    def _remind(self) -> None:
        self._release_timer = None
        try:
            self.ref.try_tell(ReleaseMemory())
        except (MailboxFull, ActorDead):
            pass  # busy (the step that leaves it idle reminds it again), or stopping

    def _release_if_idle(self) -> None:
        """Give back what an idle engine does not use: the draft model's caches of finished
        rows, MLX's buffer cache and the C heap's free pages. The model, the prefix cache's
        blocks and its hot caches stay: they are within their own budgets. Not while requests
        run, nor before IDLE_RELEASE_S of quiet."""
        if self._in_flight() or self.disk.unsaved:
            return  # the step that leaves it idle again arms a new reminder
        quiet = time.monotonic() - self._last_active
        if quiet < IDLE_RELEASE_S:
            self._arm_release(IDLE_RELEASE_S - quiet)
            return
        self.engine.release_idle()
        mx.clear_cache()
        trim_heap()
        self.memory_releases += 1

    def _watch_stuck(self, reason: str) -> None:
        """A follower is lost (on a reader thread): if the step in flight has not returned
        STUCK_AFTER_S later, its collective never will, and this thread is all that can
        still answer. Every request in flight gets its error and the process exits 1 (as
        mlx.launch stops the whole group when a rank dies); the log names the rank."""
        steps = self.engine.steps

        def check() -> None:
            if not self._stepping or self.engine.steps != steps:
                return  # the step failed and returned: the scheduler answers as usual
            log.error("%s, and rank 0's step has not returned in %.0f s (a collective that "
                      "will not complete): failing the requests in flight and exiting",
                      reason, STUCK_AFTER_S)
            # The MLX thread that owns these is blocked for good; replies are thread-safe.
            pending = [(rid, r) for rid, r in list(self._replies.items())]
            pending += self.disk.replies()
            for rid, reply in pending:
                reply.send(RequestFinished(
                    request_id=rid, finish_reason="error",
                    usage=Usage(prompt_tokens=0, completion_tokens=0),
                    error=f"{reason}; the sharded model cannot run until its ranks are "
                          "restarted", error_kind="unavailable"))
                reply.close()
            time.sleep(STUCK_EXIT_GRACE_S)  # the error events reach their clients first
            logging.shutdown()
            os._exit(1)

        timer = threading.Timer(STUCK_AFTER_S, check)
        timer.daemon = True
        timer.start()

    def _deliver(self, events: list[Any]) -> None:
        """The engine's events to their replies: through the text worker, which sends
        them, or (the text inline) sent here."""
        events = [e for e in events if e is not None]
        if self.text is not None:
            self.text.feed(events)
        for event in events:
            reply = self._replies.get(event.request_id)
            if reply is None:
                continue
            if self.text is None:
                reply.send(event)
            if isinstance(event, RequestFinished):
                if self.text is None:
                    reply.close()
                self._finished(event.request_id)

    def _finished(self, request_id: str) -> None:
        """A request has left the engine: its bookkeeping here ends."""
        del self._replies[request_id]
        self.pace.finished()
        self.disk.finished(request_id)

    def _queue_step(self, delay: float = 0.0) -> None:
        if (self._step_queued or self.engine is None
                or not (self.engine.has_work or self.disk.unsaved
                        or (self.embedder is not None and self.embedder.has_work))):
            return
        if delay > 0:
            self._step_queued = True
            asyncio.get_running_loop().call_later(delay, self._delayed_step)
            return
        try:
            self.ref.try_tell(Step())
            self._step_queued = True
        except MailboxFull:
            # The mailbox is full of other messages; handling the next one queues the step.
            pass
        except ActorDead:
            # Stopping: the mailbox is closed and being drained; on_stop ends what is left.
            pass

    def _lookup_held(self) -> None:
        """The lookups' grace is over: step with what has been answered."""
        self._lookup_hold, self._step_queued = None, False
        self._queue_step()

    def _delayed_step(self) -> None:
        """The arrival window's timer: step, unless requests are still arriving (each
        admitted a few milliseconds after the last: a burst's requests pass admission one at
        a time) and the window has room left; then wait for a quiet window."""
        self._step_queued = False
        opened, now = self._window_opened, time.monotonic()
        if opened is not None:
            quiet = self._last_arrival + self.arrival_window_s
            closes = opened + ARRIVAL_WINDOWS_MAX * self.arrival_window_s
            if now < quiet and now < closes:
                self._queue_step(delay=min(quiet, closes) - now)
                if self._step_queued:
                    return
        self._window_opened = None
        self._queue_step()

    def report(self) -> dict[str, Any]:
        engine = self.engine
        if engine is None:
            return {"model": self.model_name, "loaded": False}
        window = self._tps_window
        tps = 0.0
        if len(window) >= 2 and window[-1][0] > window[0][0] and \
                time.perf_counter() - window[-1][0] < 2.0:
            tps = (window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0])
        stats = engine.stats()
        return {
            "model": self.model_name,
            "loaded": True,
            "running": stats["prefilling"] + stats["decoding"],
            "waiting": stats["waiting"] + self.disk.waiting,
            "batch_size": stats["decoding"],
            "steps": stats["steps"],
            "generated_tokens": stats["generated_tokens"],
            "prefill_tokens": stats["prefill_tokens"],
            "partial_hit_tokens": stats["partial_hit_tokens"],
            "gate_failures": stats["gate_failures"],
            # Speculative decoding: drafts verified, their tokens, those kept, and the tokens
            # a draft gave on average.
            "drafts": stats["drafts"],
            "draft_tokens": stats["draft_tokens"],
            "draft_accepted_tokens": stats["draft_accepted_tokens"],
            # Hybrid models: rows whose recurrent state went back after a rejected draft.
            "draft_restores": stats["draft_restores"],
            "draft_model_passes": stats["draft_model_passes"],
            # Tokens new rows took from an earlier row's draft cache (an agent's next turn).
            "draft_model_reused_tokens": stats["draft_model_reused_tokens"],
            "draft_mean_accepted": round(stats["draft_accepted_tokens"] / stats["drafts"], 2)
            if stats["drafts"] else 0.0,
            "memory_limit_bytes": self.limits.limit if self.limits else 0,
            "retired": self.retired,
            "tokens_per_s": round(tps, 2),
            **engine.blocks.stats(),
            **self.disk.report(),
            "memory_releases": self.memory_releases,
            **self.counters,
            "requests": engine.progress(),
            **({"followers": self.followers.report(), "probes": self.disk.probes,
                "probe_timeouts": self.followers.probe_timeouts}
               if self.followers is not None else {}),
            **({"task": self.card.task, "embed_jobs": len(self._embed_answers),
                "embedded_inputs": self.embedder.inputs_done,
                "embedded_tokens": self.embedder.tokens_run,
                "embed_cached_tokens": self.embedder.cached_tokens,
                "embed_step_tokens": self._embed_budget}
               if self.embedder is not None else {}),
        }


def _refused(
    msg: AddRequest, kind: ErrorKind | None, message: str, reason: str = "error"
) -> RequestFinished:
    return RequestFinished(
        request_id=msg.request_id,
        finish_reason=reason,
        usage=Usage(prompt_tokens=len(msg.prompt_tokens), completion_tokens=0),
        error=message,
        error_kind=kind,
    )
