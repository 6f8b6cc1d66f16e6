"""The admission actor: templates, tokenizes and validates, and decides before any header.

It runs on its own thread and never touches MLX. An admitted request goes straight into the
model's scheduler with ``try_stream``; the HTTP layer gets the scheduler's event stream back in
an ``AdmissionTicket``. Every refusal is an ``AdmissionError`` carrying its HTTP status.

One request's tokenizing never holds the others: the handler checks what is cheap (the model,
the tools, an empty conversation), takes the ask's answer and returns, so the actor takes the
next message at once. The templating, tokenizing and grammar compiling run in a small pool of
daemon threads the actor owns (the fast tokenizer releases the GIL while it encodes); the rest
(the context and memory checks, loading the model, the send to the scheduler, the counters)
runs back on the actor's thread, which then gives the answer. The work in the pool is in
``actors.prompts``, as pure functions of the model: the chat rendered within the template's
bounds in time and length, tokenizing, the context checks (a prompt refused from a floor on
its tokens, ``max_tokens`` cut to the room left) and compiling grammars.

A request's model name is resolved here (``_model``): a served model's id, then an alias
(``--alias``); with one model served, any other name is served by it.

The prefill guard: with the memory monitor's latest ``MemoryLimits``, a prompt whose prefill
would take MLX memory past the limit is refused here, before any response header (413 if it
could never fit beside its model, 503 with Retry-After if other work holds the memory); under
hard memory pressure every new request gets 503. For a model sharded over ranks
(``--distributed``) it counts one rank's share against the limit, which is each rank's, as the
scheduler's gate does. A model not loaded yet is loaded through the engine pool
(``LoadModel``) before its first request goes to its scheduler.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine
from fnmatch import fnmatchcase
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import msgspec
from mlx_lm.utils import load_tokenizer

from troupe.actors.config import TEMPLATE_TIMEOUT_S
from troupe.actors.distributed.shards import rank_memory_of
from troupe.actors.engine.agent_output import think_tags_of, tool_format_of
from troupe.actors.engine.embed import shared_prefix
from troupe.actors.engine.encoder import is_encoder
from troupe.actors.engine.grammar import Constraint, Grammars
from troupe.actors.engine.memory_estimate import (
    HARD,
    ModelMemory,
    admission_estimate,
    embed_need,
    idle_floor,
    parameter_count,
    prompt_need,
    served_memory,
    too_large,
    tower_transient,
)
from troupe.actors.engine.vision import vision_config, why_no_images
from troupe.actors.engine.vision_prompt import image_token, load_processor
from troupe.actors.images import MAX_IMAGE_PIXELS
from troupe.actors.memory_messages import LoadModel, MemoryLimits
from troupe.actors.messages import (
    AbortRequest,
    AddRequest,
    AdmissionError,
    AdmissionTicket,
    AdmitChat,
    AdmitCompletion,
    AdmitEmbed,
    AdmitRerank,
    Admitted,
    CountTokens,
    DescribeModel,
    EmbedAnswer,
    EmbedInputs,
    ImageInput,
    ListModels,
    ModelCard,
    OutputSpec,
    RequestEvent,
    RequestFinished,
    SamplingParams,
    ToolChoice,
)
from troupe.actors.prompts import (
    PromptModel,
    RenderBound,
    RenderedChat,
    check_context,
    check_floor,
    check_rendered,
    check_template_kwargs,
    embed_tokens,
    encode,
    encode_with_images,
    fim_tokens_of,
    fit_answer,
    format_constraint,
    prepare_chat,
    prepare_chat_if_short,
    prepare_fim,
    prepare_text,
    prompt_bound,
    render_chat,
    rerank_inputs,
    with_model_defaults,
)
from troupe.actors.retry import Drain
from troupe.actors.workers import DaemonPool, Watchdog
from troupe.runtime import Actor, ActorDead, ActorRef, MailboxFull, Reply, ReplyStream

log = logging.getLogger("actors.admission")

T = TypeVar("T")

ADMISSION_THREAD = "admission"
RETRY_AFTER_S = 1.0
# Loading a model (the first request for it) may take minutes for a large one.
LOAD_TIMEOUT_S = 600.0
MB = 1e6
# Threads that template, tokenize and compile grammars off the actor's message loop. The fast
# tokenizer releases the GIL while it encodes, so they run in parallel (measured: two 2 MB
# prompts at once took 1.47x less time than one after the other on 2 cores).
ADMISSION_WORKERS = 4
# A templated prompt longer than this (characters; about 25 ms to tokenize) is large: at most
# ADMISSION_WORKERS - 1 of them tokenize at once, so a worker is always left for short ones.
LARGE_PROMPT_CHARS = 32_768
# A graceful stop lets the admissions under way finish within this long, then cancels them.
STOP_WAIT_S = 10.0
# With one model served, the first use of each other name is logged once: for this many names
# at the most, each kept to this many characters (a client sending random names cannot grow
# the set, nor the log, without bound).
LOGGED_NAMES = 64
LOGGED_NAME_CHARS = 200


class TrackedEvents:
    """A ticket's event stream (a ``ReplyStream``'s interface) that tells the model's ``Drain``
    once when the request ends: its last event read, the stream closed, or dropped."""

    __slots__ = ("_events", "_drain", "_open")

    def __init__(self, events: ReplyStream[RequestEvent], drain: Drain) -> None:
        self._events = events
        self._drain = drain
        self._open = True

    def __aiter__(self) -> TrackedEvents:
        return self

    async def __anext__(self) -> RequestEvent:
        try:
            event = await self._events.__anext__()
        except Exception:  # StopAsyncIteration or the request's error: either way it ended
            self._end()
            raise
        if isinstance(event, RequestFinished):
            self._end()
        return event

    async def next(self) -> RequestEvent:
        return await self.__anext__()

    async def aclose(self) -> None:
        self._end()
        await self._events.aclose()

    async def __aenter__(self) -> TrackedEvents:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    def __del__(self) -> None:
        self._end()

    def _end(self) -> None:
        if self._open:
            self._open = False
            self._drain.ended()


# -- the actor ---------------------------------------------------------------------------------


class ModelEntry(PromptModel):
    """What admission knows of one served model: what its prompts are built with
    (``PromptModel``), its memory shape, and its scheduler (None, or a stopped one, while the
    model is not loaded)."""

    def __init__(self, card: ModelCard, scheduler: ActorRef | None) -> None:
        super().__init__(card)
        self.scheduler = scheduler
        self.memory: ModelMemory | None = None
        self.vision: dict = {}  # its checkpoint's vision_config
        self.parameters: int | None = None  # counted from its weights' headers
        self.drain = Drain()

    @property
    def loaded(self) -> bool:
        return self.scheduler is not None and self.scheduler.alive


class Admission(Actor):
    """Turns API requests into scheduler requests, or into a refusal with a status code.

    ``workers``: the threads of its pool (default ADMISSION_WORKERS; at least 2, as large
    prompts may take all but one). ``distributed``: how the model is sharded ("tensor" or
    "pipeline") over ``ranks`` processes, or None for one process. ``aliases``: other names
    (or glob patterns, tried in order) of served models, by the model id each names; one
    naming a model not served is a ValueError. ``max_tokens_limit``: the most tokens any
    answer may have (None: the context's room alone). ``template_timeout``: the seconds a
    chat template may take to render one request's conversation."""

    def __init__(
        self,
        *,
        models: list[tuple[ModelCard, ActorRef | None]],
        pool: ActorRef | None = None,
        prefill_step_size: int = 512,
        block_size: int = 0,
        workers: int | None = None,
        distributed: str | None = None,
        ranks: int = 1,
        aliases: dict[str, str] | None = None,
        max_tokens_limit: int | None = None,
        template_timeout: float = TEMPLATE_TIMEOUT_S,
        max_image_pixels: int = MAX_IMAGE_PIXELS,
    ) -> None:
        self.models = {card.id: ModelEntry(card, ref) for card, ref in models}
        self.max_image_pixels = max_image_pixels
        aliases = aliases or {}
        for name, model in aliases.items():
            if model not in self.models:
                served = ", ".join(self.models)
                raise ValueError(f"--alias {name}={model}: no model {model!r} is served "
                                 f"(served: {served})")
        self.exact_aliases = {n: m for n, m in aliases.items() if not _is_pattern(n)}
        self.pattern_aliases = [(n, m) for n, m in aliases.items() if _is_pattern(n)]
        self.logged_names: set[str] = set()
        if max_tokens_limit is not None and max_tokens_limit < 1:
            raise ValueError(f"--max-tokens-limit must be at least 1, not {max_tokens_limit}")
        self.max_tokens_limit = max_tokens_limit
        if not template_timeout > 0:
            raise ValueError(f"--template-timeout must be above 0, not {template_timeout}")
        self.template_timeout = template_timeout
        # The engine pool, injected by the wiring; None where every model is loaded at spawn
        # and none can load later (tests, embedding programs without a pool).
        self.pool = pool
        self.prefill_step_size = prefill_step_size
        self.block_size = block_size
        self.distributed = distributed
        self.ranks = ranks
        # Read when constructed (not as defaults), so a test can change the module's values.
        self.workers = max(2, workers or ADMISSION_WORKERS)
        self.large_prompt_chars = LARGE_PROMPT_CHARS
        self.limits: MemoryLimits | None = None
        self.admitted = 0
        self.refused: dict[str, int] = {}  # by kind of refusal (ErrorKind)
        self.last_estimate = 0
        self.last_retry_after: float | None = None
        self._pending: set[asyncio.Task[Any]] = set()
        # Embedding and rerank requests in their model's scheduler, for their aborts.
        self._embedding: dict[str, ModelEntry] = {}
        self._executor: DaemonPool | None = None
        self._render: RenderBound | None = None
        self._large: asyncio.Semaphore | None = None
        self._load_gate: asyncio.Lock | None = None

    async def on_start(self) -> None:
        for entry in self.models.values():
            entry.tokenizer = load_tokenizer(entry.card.path)
            entry.memory = (rank_memory_of(entry.card.path, self.distributed, self.ranks)
                            if self.distributed
                            else served_memory(entry.card.path, entry.card.draft_path))
            entry.tool_format = tool_format_of(entry.tokenizer)
            entry.think = think_tags_of(entry.tokenizer)
            entry.fim = fim_tokens_of(entry.tokenizer)
            entry.parameters = parameter_count(entry.card.path)
            entry.grammars = Grammars(entry.tokenizer)
            entry.bound = prompt_bound(entry.tokenizer)
            entry.no_images = ("a model sharded across processes reads text alone"
                               if self.distributed else why_no_images(Path(entry.card.path)))
            if entry.no_images is None:
                try:
                    entry.processor = load_processor(Path(entry.card.path))
                    entry.image_token = image_token(Path(entry.card.path))
                    entry.vision = (vision_config(Path(entry.card.path)) or {}).get(
                        "vision_config", {})
                except Exception as exc:  # a checkpoint whose processor files are missing
                    entry.no_images = f"its image processor could not be loaded ({exc})"
                    log.warning("%s: served on text alone: %s", entry.card.id,
                                entry.no_images)
            if entry.bound is None:
                log.info("%s: no cheap bound on prompt length; every prompt is tokenized",
                         entry.card.id)
        self._executor = DaemonPool(self.workers, "admission-work")
        self._render = RenderBound(Watchdog("admission-watchdog"), self.template_timeout)
        self._large = asyncio.Semaphore(self.workers - 1)
        self._load_gate = asyncio.Lock()

    @staticmethod
    def _card(entry: ModelEntry) -> ModelCard:
        """A model's card with what it does here and whether it is loaded now."""
        card = entry.card
        if card.task == "embed":
            found: tuple[str, ...] = ("embedding",)
        elif card.task != "generate":
            found = ()
        else:
            # Every chat model calls tools: in its template's format, or through a grammar.
            found = ("completion", "tools",
                     *(("thinking",) if entry.think or entry.tool_format == "harmony" else ()),
                     *(("vision",) if entry.no_images is None else ()))
        return msgspec.structs.replace(card, capabilities=found, loaded=entry.loaded,
                                       parameters=entry.parameters)

    async def on_stop(self, error: BaseException | None) -> None:
        if error is None and self._pending:
            # A graceful stop: what was admitted before it is answered, within a bound.
            await asyncio.wait(set(self._pending), timeout=STOP_WAIT_S)
        for task in list(self._pending):
            task.cancel()
        if self._executor is not None:
            # A tokenizer call under way cannot be interrupted: its thread ends after it (or
            # with the process: the pool's threads are daemons).
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self._render is not None:
            self._render.watchdog.close()  # a render still under way ends now

    async def handle(self, msg: Any) -> Any:
        try:
            return self._handle(msg)
        except AdmissionError as err:
            self._count(err)
            raise

    def _handle(self, msg: Any) -> Any:
        """The order-independent checks, here on the actor's thread; the rest is deferred."""
        match msg:
            case AdmitChat():
                entry = self._model(msg.model)
                _check_task(entry, "generate")
                check_template_kwargs(msg.chat_template_kwargs)
                tools = self._tools(msg.tools, msg.tool_choice)
                self._defer(self._admit_chat(entry, msg, tools))
            case AdmitCompletion():
                entry = self._model(msg.model)
                _check_task(entry, "generate")
                if msg.suffix is not None:
                    if not isinstance(msg.prompt, str):
                        raise AdmissionError("invalid", "a suffix goes with a text prompt, not "
                                             "token ids", param="suffix")
                    self._defer(self._admit_fim(entry, msg, msg.prompt, msg.suffix))
                elif isinstance(msg.prompt, str):
                    self._defer(self._admit_text(entry, msg, msg.prompt))
                else:
                    tokens = list(msg.prompt)
                    # The exact length first: the range check below is then O(context).
                    check_context(entry, len(tokens), "prompt", exact=True)
                    vocab = len(entry.tokenizer)
                    if any(t < 0 or t >= vocab for t in tokens):
                        raise AdmissionError("invalid", f"prompt token ids must be in [0, {vocab})",
                                             param="prompt")
                    self._defer(self._admit_ids(entry, msg, tokens))
            case AdmitEmbed():
                entry = self._model(msg.model)
                _check_task(entry, "embed")
                self._defer(self._admit_embed(entry, msg))
            case AdmitRerank():
                entry = self._model(msg.model)
                _check_task(entry, "rerank")
                self._defer(self._admit_rerank(entry, msg))
            case CountTokens():
                entry = self._model(msg.model)
                tools = self._tools(msg.tools, ToolChoice())
                self._defer(self._count_tokens(entry, msg, tools))
            case ListModels():
                # The served models, then an alias's card for each name that is not a pattern.
                cards = [self._card(entry) for entry in self.models.values()]
                return cards + [msgspec.structs.replace(self._card(self.models[model]), id=name,
                                                        alias_of=model)
                                for name, model in self.exact_aliases.items()]
            case DescribeModel(name=name):
                card = self._card(self._model(name))
                return card if name == card.id else msgspec.structs.replace(
                    card, id=name, alias_of=card.id)
            case MemoryLimits():
                self.limits = msg
            case AbortRequest(request_id=rid):
                # An embedding or rerank request's client has gone: its model drops its inputs.
                entry = self._embedding.get(rid)
                if entry is not None and entry.scheduler is not None:
                    try:
                        entry.scheduler.try_tell(msg)
                    except (MailboxFull, ActorDead):
                        pass  # busy or gone: the job ends on its own
            case _:
                raise TypeError(f"admission cannot handle {type(msg).__name__}")
        return None

    # -- deferred work: the pool, then back on the actor's thread -----------------------------

    def _defer(self, work: Coroutine[Any, Any, Any]) -> None:
        """Take the ask's answer and give it when ``work`` (a task on the actor's own loop, so
        its state changes stay on this thread) ends; the actor takes its next message now."""
        try:
            answer: Reply | None = self.take_answer()
        except RuntimeError:
            answer = None  # sent with tell or stream: nobody waits for this answer
        task = asyncio.get_running_loop().create_task(work)
        self._pending.add(task)
        task.add_done_callback(functools.partial(self._answer, answer))

    def _answer(self, answer: Reply | None, task: asyncio.Task[Any]) -> None:
        self._pending.discard(task)
        if answer is None:
            error = None if task.cancelled() else task.exception()
            if isinstance(error, AdmissionError):
                self._count(error)
            elif error is not None:
                log.error("admission failed on a message nobody waits for", exc_info=error)
            return
        if task.cancelled():
            answer.fail(ActorDead(f"actor {self.name!r} stopped before answering"))
            return
        error = task.exception()
        if error is None:
            answer.send(task.result())
            return
        if isinstance(error, AdmissionError):
            self._count(error)
        answer.fail(error)

    async def _work(self, fn: Callable[..., T], *args: Any) -> T:
        """Run pure ``fn(*args)`` in the pool (it must not touch the actor's state)."""
        assert self._executor is not None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    async def _large_turn(self, fn: Callable[..., T], *args: Any) -> T:
        """``_work`` for a large prompt: at most workers - 1 of them at once (FIFO), so a
        worker is always left for short prompts."""
        assert self._large is not None
        async with self._large:
            return await self._work(fn, *args)

    async def _admit_chat(self, entry: ModelEntry, msg: AdmitChat,
                          tools: list[dict] | None) -> AdmissionTicket:
        args = (tools, msg.tool_choice, msg.response_format, msg.thinking_budget)
        # One trip to the pool for a short prompt; a large one comes back to wait its turn.
        prepared = await self._work(prepare_chat_if_short, entry, self._render, msg.messages,
                                    msg.chat_template_kwargs, self.large_prompt_chars,
                                    self.max_image_pixels, *args)
        if isinstance(prepared, RenderedChat):
            prepared = await self._large_turn(prepare_chat, entry, prepared, *args)
        tokens, output, constraint, images = prepared
        return await self._admit(entry, msg.request_id, tokens, msg.sampling, "messages",
                                 unset=msg.unset, output=output, constraint=constraint,
                                 namespace=msg.cache_namespace, images=images)

    async def _admit_text(self, entry: ModelEntry, msg: AdmitCompletion,
                          prompt: str) -> AdmissionTicket:
        if len(prompt) <= self.large_prompt_chars:
            tokens, constraint = await self._work(prepare_text, entry, prompt,
                                                  msg.response_format)
        else:
            await self._work(check_floor, entry, prompt, "prompt")
            tokens, constraint = await self._large_turn(prepare_text, entry, prompt,
                                                        msg.response_format)
        return await self._admit(entry, msg.request_id, tokens, msg.sampling, "prompt",
                                 unset=msg.unset, constraint=constraint,
                                 namespace=msg.cache_namespace)

    async def _admit_fim(self, entry: ModelEntry, msg: AdmitCompletion, prefix: str,
                         suffix: str) -> AdmissionTicket:
        # A large file around the gap waits its turn as a large prompt does.
        work = self._work if len(prefix) + len(suffix) <= self.large_prompt_chars \
            else self._large_turn
        tokens, constraint = await work(prepare_fim, entry, prefix, suffix,
                                        msg.response_format)
        return await self._admit(entry, msg.request_id, tokens, msg.sampling, "prompt",
                                 unset=msg.unset, constraint=constraint,
                                 namespace=msg.cache_namespace)

    async def _admit_ids(self, entry: ModelEntry, msg: AdmitCompletion,
                         tokens: list[int]) -> AdmissionTicket:
        constraint = None
        if msg.response_format is not None and msg.response_format.type != "text":
            constraint = await self._work(format_constraint, entry, msg.response_format)
        return await self._admit(entry, msg.request_id, tokens, msg.sampling, "prompt",
                                 unset=msg.unset, constraint=constraint,
                                 namespace=msg.cache_namespace)

    async def _admit_embed(self, entry: ModelEntry, msg: AdmitEmbed) -> EmbedAnswer:
        if not msg.inputs:
            raise AdmissionError("invalid", "input must not be empty", param="input")
        texts = [isinstance(x, str) for x in msg.inputs]
        if any(texts) and not all(texts):
            raise AdmissionError("invalid", "input must be all strings or all token id lists",
                                 param="input")
        if all(texts):
            inputs = await self._work(embed_tokens, entry, msg.inputs, msg.input_type,
                                      entry.card.context_length if msg.truncate else None)
        else:
            vocab = len(entry.tokenizer)
            inputs = [list(ids) for ids in msg.inputs]
            for i, ids in enumerate(inputs):
                if any(t < 0 or t >= vocab for t in ids):
                    raise AdmissionError("invalid", f"input {i}: token ids must be in [0, {vocab})",
                                         param=f"input[{i}]")
        return await self._embed(entry, msg.request_id, "embed", inputs, "input",
                                 truncate=msg.truncate)

    async def _admit_rerank(self, entry: ModelEntry, msg: AdmitRerank) -> EmbedAnswer:
        if not msg.documents:
            raise AdmissionError("invalid", "documents must not be empty", param="documents")
        limit = entry.card.context_length if msg.truncate else None
        inputs = await self._work(rerank_inputs, entry, msg.query, msg.documents,
                                  msg.instruction, limit)
        return await self._embed(entry, msg.request_id, "rerank", inputs, "documents",
                                 truncate=msg.truncate, namespace=msg.cache_namespace)

    async def _embed(self, entry: ModelEntry, request_id: str, task: str,
                     inputs: list[list[int]], param: str, *, truncate: bool,
                     namespace: str = "") -> EmbedAnswer:
        """Check each input against the context (cut it with ``truncate``) and the memory
        limit, then have the model's scheduler run them all."""
        limit = entry.card.context_length
        for i, ids in enumerate(inputs):
            if not ids:
                raise AdmissionError("invalid", f"input {i} is empty", param=f"{param}[{i}]")
            if len(ids) > limit:
                if not truncate:
                    raise AdmissionError(
                        "invalid", f"input {i} has {len(ids)} tokens, over this model's "
                        f"context of {limit}: shorten it, or send \"truncate\": true to cut it",
                        param=f"{param}[{i}]", code="context_length_exceeded")
                inputs[i] = ids[:limit]
        # The job's worst step is what must fit (its model's per-step gate counts each step
        # the same way, actors/engine/embed_gate.py).
        longest, encoder = max(len(ids) for ids in inputs), is_encoder(entry.card.path)
        shared = (shared_prefix(inputs, self.prefill_step_size)
                  if task == "rerank" and not encoder else 0)
        need = None if entry.memory is None else embed_need(
            entry.memory, longest=longest, step=self.prefill_step_size, shared=shared,
            whole=encoder)
        self._check_memory(entry, longest, param, need=need)
        msg = EmbedInputs(request_id=request_id, task=task, inputs=inputs,
                          cache_namespace=namespace)
        self._embedding[request_id] = entry
        try:
            try:
                answer = await (await self._scheduler(entry)).ask(msg)
            except ActorDead:
                # Unloaded between our look and the send: load it again, once.
                entry.scheduler = None
                answer = await (await self._scheduler(entry)).ask(msg)
        finally:
            del self._embedding[request_id]
        self.admitted += 1
        return EmbedAnswer(model=entry.card.id, results=answer.results,
                           prompt_tokens=sum(len(ids) for ids in inputs))

    async def _count_tokens(self, entry: ModelEntry, msg: CountTokens,
                            tools: list[dict] | None) -> int:
        prompt = await self._work(render_chat, entry, self._render, msg.messages, tools, None,
                                  False, self.max_image_pixels)
        check_rendered(entry, prompt.text)
        if prompt.images:
            return len((await self._large_turn(encode_with_images, entry, prompt))[0])
        if len(prompt.text) <= self.large_prompt_chars:
            return len(await self._work(encode, entry, prompt.text, False))
        return len(await self._large_turn(encode, entry, prompt.text, False))

    # -- checks on the actor's thread ---------------------------------------------------------

    def _model(self, name: str) -> ModelEntry:
        """The model a request names: a served model's id, else an alias (exact names, then
        patterns in the order given), else, with one model served, that model (agents send
        their own provider's names: claude-..., gpt-5-codex)."""
        entry = self.models.get(name)
        if entry is not None:
            return entry
        model = self.exact_aliases.get(name) or next(
            (model for pattern, model in self.pattern_aliases if fnmatchcase(name, pattern)),
            None)
        if model is not None:
            return self.models[model]
        if len(self.models) == 1:
            entry = next(iter(self.models.values()))
            self._log_name(name, entry.card.id)
            return entry
        served = ", ".join(sorted(self.models))
        aliases = [*self.exact_aliases.items(), *self.pattern_aliases]
        named = "; aliases: " + ", ".join(f"{n} -> {m}" for n, m in aliases) if aliases else ""
        raise AdmissionError("unknown_model",
                             f"model {name!r} is not served here (served: {served}{named})",
                             param="model", code="model_not_found")

    def _log_name(self, name: str, model: str) -> None:
        """Log the first use of a name that is not the one model's own, once per name."""
        name = name[:LOGGED_NAME_CHARS]
        if name in self.logged_names or len(self.logged_names) >= LOGGED_NAMES:
            return
        self.logged_names.add(name)
        last = ("; further new names are not logged"
                if len(self.logged_names) == LOGGED_NAMES else "")
        log.info("model name %r is served by %s, the one model served%s", name, model, last)

    def _tools(self, tools: list[dict] | None, choice: ToolChoice) -> list[dict] | None:
        """The request's tools, checked (OpenAI's function shape), or None when there are none
        or the choice hides them; a tool choice that names no offered tool is refused."""
        if choice.mode not in ("auto", "none", "required", "function"):
            raise AdmissionError("invalid", f"unknown tool_choice mode {choice.mode!r}",
                                 param="tool_choice")
        for i, tool in enumerate(tools or ()):
            function = tool.get("function") if isinstance(tool, dict) else None
            if (not isinstance(tool, dict) or tool.get("type", "function") != "function"
                    or not isinstance(function, dict)
                    or not isinstance(function.get("name"), str) or not function["name"]):
                raise AdmissionError("invalid", "each tool must be {'type': 'function', "
                                     "'function': {'name': ..., 'parameters': {...}}}",
                                     param=f"tools[{i}]")
            if not isinstance(function.get("parameters", {}), dict):
                raise AdmissionError("invalid", "a tool's parameters must be a JSON Schema object",
                                     param=f"tools[{i}].function.parameters")
        if choice.mode == "none":
            return None
        names = [tool["function"]["name"] for tool in tools or ()]
        if choice.mode in ("required", "function") and not names:
            raise AdmissionError("invalid", f"tool_choice {choice.mode!r} needs tools",
                                 param="tool_choice")
        if choice.mode == "function" and choice.name not in names:
            raise AdmissionError("invalid", f"tool_choice names {choice.name!r}, which is not "
                                 f"among the tools ({', '.join(names)})", param="tool_choice")
        return list(tools) if tools else None

    async def _admit(
        self,
        entry: ModelEntry,
        request_id: str,
        tokens: list[int],
        sampling: SamplingParams,
        prompt_param: str,
        *,
        unset: tuple[str, ...] = (),
        output: OutputSpec | None = None,
        constraint: Constraint | None = None,
        namespace: str = "",
        images: list[ImageInput] | None = None,
    ) -> AdmissionTicket:
        if not tokens:
            raise AdmissionError("invalid", "the prompt is empty", param=prompt_param)
        check_context(entry, len(tokens), prompt_param, exact=True)
        sampling = with_model_defaults(sampling, unset, entry.card.sampling_defaults)
        sampling, output = fit_answer(entry, len(tokens), sampling, output, request_id,
                                      self.max_tokens_limit)
        dtype_bytes = entry.memory.dtype_bytes if entry.memory is not None else 4
        tower = max((tower_transient(entry.vision, i.pixels.shape, dtype_bytes)
                     for i in images or ()), default=0)
        self._check_memory(entry, len(tokens), prompt_param, tower=tower)
        request = AddRequest(request_id=request_id, prompt_tokens=tokens, sampling=sampling,
                             output=output, constraint=constraint, cache_namespace=namespace,
                             images=images or [])
        try:
            try:
                events = (await self._scheduler(entry)).try_stream(request)
            except ActorDead:
                # Unloaded between our look and the send: load it again, once.
                entry.scheduler = None
                events = (await self._scheduler(entry)).try_stream(request)
        except MailboxFull:
            retry_after = self.last_retry_after = entry.drain.retry_after()
            raise AdmissionError("overloaded", "the server is busy; retry shortly",
                                 code="queue_full", retry_after=retry_after) from None
        self.admitted += 1
        entry.drain.started()
        admitted = Admitted(request_id=request_id, model=entry.card.id,
                            prompt_tokens=len(tokens), sampling=sampling)
        # Duck-typed as the ReplyStream it wraps: the HTTP layer only iterates and closes it.
        return AdmissionTicket(admitted=admitted,
                               events=TrackedEvents(events, entry.drain))

    def _check_memory(self, entry: ModelEntry, n_tokens: int, prompt_param: str, *,
                      tower: int = 0, need: int | None = None) -> None:
        """The prefill guard: refuse before any header what the memory limit cannot take.
        ``tower``: the vision tower's temporaries for the prompt's largest image. ``need``:
        the new memory the work needs when it is no chat prompt's (an embedding job's,
        ``embed_need``)."""
        limits = self.limits
        if limits is None or entry.memory is None:
            return
        if limits.pressure == HARD:
            raise AdmissionError(
                "unavailable",
                f"the server is short of memory ({limits.usage / MB:.0f} MB of its "
                f"{limits.limit / MB:.0f} MB limit in use); retry shortly",
                code="memory_pressure", retry_after=RETRY_AFTER_S,
            )
        if not limits.guard:
            return
        memory = entry.memory
        step = self.prefill_step_size
        if need is None:
            need = prompt_need(memory, prompt_tokens=n_tokens, step=step,
                               block_size=self.block_size, tower=tower)
        estimate = admission_estimate(memory, high_water=limits.high_water,
                                      prompt_tokens=n_tokens, step=step, loaded=entry.loaded,
                                      need=need)
        self.last_estimate = estimate
        floor = idle_floor(memory, limits.floor, loaded=entry.loaded)
        if too_large(need, limit=limits.limit, idle=floor):
            raise AdmissionError(
                "too_large",
                f"this prompt of {n_tokens} tokens needs about {need / MB:.0f} MB for its "
                f"prefill, {estimate / MB:.0f} MB in all with what is in use, over the server's "
                f"memory limit of {limits.limit / MB:.0f} MB, of which {floor / MB:.0f} MB "
                f"stay in use when idle: shorten it",
                param=prompt_param, code="memory_limit_exceeded",
            )
        if estimate > limits.limit:
            raise AdmissionError(
                "unavailable",
                f"this prompt of {n_tokens} tokens needs about {need / MB:.0f} MB for its "
                f"prefill, {estimate / MB:.0f} MB in all with what is in use, over the server's "
                f"memory limit of {limits.limit / MB:.0f} MB; retry shortly",
                code="memory_busy", retry_after=RETRY_AFTER_S,
            )

    async def _scheduler(self, entry: ModelEntry) -> ActorRef:
        """The model's scheduler, loading the model through the engine pool if need be.

        One load at a time, and no request goes to any scheduler while one runs (the load
        holds the MLX thread anyway, and the pool may be unloading another model for it):
        as when admission handled one request at a time, they wait for it in order."""
        assert self._load_gate is not None
        async with self._load_gate:
            if entry.loaded:
                assert entry.scheduler is not None
                return entry.scheduler
            pool = self.pool
            if pool is None:
                raise AdmissionError("unavailable", f"model {entry.card.id!r} is not loaded",
                                     retry_after=RETRY_AFTER_S)
            entry.scheduler = await pool.ask(LoadModel(model=entry.card.id),
                                             timeout=LOAD_TIMEOUT_S)
            return entry.scheduler

    def _count(self, err: AdmissionError) -> None:
        """Every refusal is counted once, on the actor's thread, when it is answered."""
        self.refused[err.kind] = self.refused.get(err.kind, 0) + 1

    def report(self) -> dict[str, Any]:
        limits = self.limits
        return {
            "models": sorted(self.models),
            "loaded": sorted(name for name, entry in self.models.items() if entry.loaded),
            "admitted": self.admitted,
            "refused": {str(k): v for k, v in sorted(self.refused.items())},
            "admitting": len(self._pending),
            "in_flight": {name: entry.drain.in_flight for name, entry in self.models.items()},
            "last_retry_after_s": self.last_retry_after,
            "memory_limit_bytes": limits.limit if limits else 0,
            "memory_pressure": limits.pressure if limits else "unknown",
            "last_estimate_bytes": self.last_estimate,
        }


# -- pure helpers of the actor's thread --------------------------------------------------------


def _is_pattern(name: str) -> bool:
    """Whether an alias is a glob pattern (``fnmatch``'s), not a name."""
    return any(c in name for c in "*?[")


def _check_task(entry: ModelEntry, task: str) -> None:
    """Refuse a request for what the model does not serve (``--task`` says what it does)."""
    served = entry.card.task
    if served == task:
        return
    routes = {"generate": "chat and completions", "embed": "/v1/embeddings",
              "rerank": "/v1/rerank"}
    raise AdmissionError(
        "invalid", f"model {entry.card.id!r} serves {routes[served]}, not {routes[task]}; "
        f"serve a model for {routes[task]} (or this one with --task {task})",
        param="model", code="model_task_mismatch")
