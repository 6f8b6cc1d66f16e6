"""The admission actor: templates, tokenizes and validates, and decides before any header.

It runs on its own thread and never touches MLX. An admitted request goes straight into the
model's scheduler with ``try_stream``; the HTTP layer gets the scheduler's event stream back in
an ``AdmissionTicket``. Every refusal is an ``AdmissionError`` carrying its HTTP status.

One request's tokenizing never holds the others: the handler checks what is cheap (the model,
the tools, an empty conversation), takes the ask's answer and returns, so the actor takes the
next message at once. The templating, tokenizing and grammar compiling run in a small pool of
daemon threads the actor owns (the fast tokenizer releases the GIL while it encodes); the rest
(the context and memory checks, loading the model, the send to the scheduler, the counters)
runs back on the actor's thread, which then gives the answer. A prompt that cannot fit the
context is refused from a floor on its token count, before it is tokenized (``PromptBound``);
one that fits but whose ``max_tokens`` does not is served with ``max_tokens`` cut to the room
left.

The chat template is the model's: ``chat_template_kwargs`` may set the template's variables
(``enable_thinking``...), never ``apply_chat_template``'s own parameters (``chat_template``
would replace the template). A render is bounded in time (``template_timeout``: a
``Watchdog`` cuts it, which frees its worker at once) and in length
(``RENDER_CHARS_PER_TOKEN``).

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
import inspect
import json
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import jinja2
import msgspec
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_tokenizer
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import render_jinja_template

from troupe.actors.config import TEMPLATE_TIMEOUT_S
from troupe.actors.distributed.shards import rank_memory_of
from troupe.actors.engine.agent_output import (
    FALLBACK_TOOL_FORMAT,
    prompt_opens_reasoning,
    think_tags_of,
    tool_format_of,
)
from troupe.actors.engine.embed import read_embed_spec, rerank_tokens, shared_prefix
from troupe.actors.engine.encoder import is_encoder, pair_tokens, text_tokens
from troupe.actors.engine.grammar import Constraint, GrammarError, Grammars
from troupe.actors.engine.memory_estimate import (
    HARD,
    ModelMemory,
    admission_estimate,
    embed_need,
    idle_floor,
    prompt_need,
    served_memory,
    too_large,
    tower_transient,
)
from troupe.actors.engine.vision import vision_config, why_no_images
from troupe.actors.engine.vision_prompt import image_token, load_processor, with_images
from troupe.actors.images import MAX_IMAGE_PIXELS, ImageError, decode_part, image_parts
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
    ErrorKind,
    ImageInput,
    ListModels,
    ModelCard,
    OutputFormat,
    OutputSpec,
    RequestEvent,
    RequestFinished,
    SamplingDefaults,
    SamplingParams,
    ToolChoice,
)
from troupe.actors.retry import Drain
from troupe.actors.tool_prompt import uses_tools, with_parsed_arguments, with_tools_in_prompt
from troupe.actors.workers import DaemonPool, Overrun, Watchdog
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
# A rendered chat longer than this many characters a token of the model's context (or than
# its tokenizer's longest token, when that is longer) could never fit: it is refused before it
# is tokenized. Tokenizers take 3 to 5 characters a token of prose, a few more of indented code.
RENDER_CHARS_PER_TOKEN = 64
# apply_chat_template's own parameters (mlx-lm's wrapper's, transformers' and those of the
# render it calls), read off their signatures so that one a new version adds is refused too,
# and the conversation itself: in chat_template_kwargs they would replace the model's template
# (chat_template), what it renders (messages, tools, documents) or what it returns (tokenize,
# return_dict...). Every other key is a variable of the template (enable_thinking...).
TEMPLATE_PARAMETERS = frozenset(
    {"messages"}
    | {name
       for fn in (TokenizerWrapper.apply_chat_template,
                  PreTrainedTokenizerBase.apply_chat_template, render_jinja_template)
       for name, p in inspect.signature(fn).parameters.items()
       if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and name != "self"}
)
# With one model served, the first use of each other name is logged once: for this many names
# at the most, each kept to this many characters (a client sending random names cannot grow
# the set, nor the log, without bound).
LOGGED_NAMES = 64
LOGGED_NAME_CHARS = 200


# -- a floor on a prompt's tokens, without tokenizing it ----------------------------------------

# Pre-tokenizers that keep every character of the text (they split it, or map it one to one).
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "FixedLength",
                           "Split", "Punctuation", "Sequence"}


@dataclass(frozen=True)
class PromptBound:
    """The most characters one token of this tokenizer can stand for (``chars``, L), and the
    normalizer the text goes through first (None: none).

    Why ceil(C / L) tokens is a floor for a text of C characters (C counted after the
    normalizer): each token stands for one vocabulary entry, or one added token, and covers at
    most that many characters of the normalized text (a byte-level entry is one character per
    byte, and a character has at least one byte); every character is covered by some token. So
    the tokens times L reach C. ``prompt_bound`` gives None for a tokenizer whose pipeline can
    drop text or fold a run of unknown characters into one token, where this does not hold.
    """

    chars: int
    normalizer: Any = None

    def fewest_tokens(self, text: str) -> int:
        """At least this many tokens encode ``text`` (see the class)."""
        if self.normalizer is not None:
            text = self.normalizer.normalize_str(text)
        return -(-len(text) // self.chars)


def prompt_bound(tokenizer: Any) -> PromptBound | None:
    """The ``PromptBound`` of an mlx-lm ``TokenizerWrapper`` (or a Hugging Face tokenizer), read
    from its vocabulary once per model; None when no sound bound can be read off it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None  # a slow tokenizer: nothing to read the pipeline from
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # a tokenizer that cannot be serialized: tokenize everything
        return None
    model = spec.get("model") or {}
    pre = spec.get("pre_tokenizer")
    byte_level = _has(pre, "ByteLevel")
    if model.get("type") == "BPE":
        vocab = list(model.get("vocab") or ())
        # Unknown characters become bytes (byte-level, byte fallback) or one <unk> each; with
        # fuse_unk a whole run of them becomes one token.
        if not (byte_level or model.get("byte_fallback")) and model.get("fuse_unk"):
            return None
    elif model.get("type") == "Unigram" and model.get("byte_fallback"):
        vocab = [piece for piece, _ in model.get("vocab") or ()]
    else:
        return None  # WordPiece, WordLevel, Unigram without byte fallback: a word may be <unk>
    if not _keeps_text(pre) or _has(spec.get("normalizer"), "Strip"):
        # Dropped text, or a Strip that acts on each piece between added tokens rather than on
        # the whole text the floor is counted on.
        return None
    added = spec.get("added_tokens") or ()
    if any(token.get("lstrip") or token.get("rstrip") for token in added):
        return None  # such a token also swallows the whitespace beside it
    normalizer = backend.normalizer
    lengths = [len(piece) for piece in vocab]
    for token in added:
        content = token.get("content") or ""
        lengths.append(len(content))
        if normalizer is not None:
            lengths.append(len(normalizer.normalize_str(content)))
    if not lengths or max(lengths) < 1:
        return None
    return PromptBound(chars=max(lengths), normalizer=normalizer)


def _has(node: Any, kind: str) -> bool:
    """Whether a tokenizer.json component (or a sequence of them) contains ``kind``."""
    if isinstance(node, dict):
        return node.get("type") == kind or any(_has(v, kind) for v in node.values())
    if isinstance(node, list):
        return any(_has(v, kind) for v in node)
    return False


def _keeps_text(pre: Any) -> bool:
    """Whether a pre-tokenizer (possibly a sequence) keeps every character."""
    if pre is None:
        return True
    if pre.get("type") not in _KEEPING_PRE_TOKENIZERS or pre.get("behavior") == "Removed":
        return False
    return all(_keeps_text(p) for p in pre.get("pretokenizers") or ())


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


class ModelEntry:
    """What admission knows of one served model: its card, tokenizer, memory shape, and its
    scheduler (None, or a stopped one, while the model is not loaded)."""

    def __init__(self, card: ModelCard, scheduler: ActorRef | None) -> None:
        self.card = card
        self.scheduler = scheduler
        self.tokenizer: Any = None
        self.memory: ModelMemory | None = None
        # Agents: the template's tool-call format (None: troupe's fallback), its reasoning
        # tags, and the grammar compiler (its llguidance tokenizer is built on first use).
        self.tool_format: str | None = None
        self.think: tuple[str, str] | None = None
        self.grammars: Grammars | None = None
        self.bound: PromptBound | None = None
        # Images: why this model reads none (None: it reads them), its processor, and the id
        # the processor writes for an image's tokens.
        self.no_images: str | None = "it is not loaded"
        self.processor: Any = None
        self.image_token = -1
        self.vision: dict = {}  # its checkpoint's vision_config
        self.drain = Drain()

    @property
    def loaded(self) -> bool:
        return self.scheduler is not None and self.scheduler.alive


@dataclass(frozen=True)
class _Prompt:
    """A chat rendered by its template (in the pool), and the tool-call format its answer is
    read with."""

    text: str
    tool_format: str | None
    # The chat's images, decoded, in the order the template wrote their markers.
    images: tuple[Any, ...] = ()


@dataclass(frozen=True)
class _RenderBound:
    """How long a chat template may take to render: ``seconds``, cut by ``watchdog``."""

    watchdog: Watchdog
    seconds: float


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
        self._render: _RenderBound | None = None
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
        self._render = _RenderBound(Watchdog("admission-watchdog"), self.template_timeout)
        self._large = asyncio.Semaphore(self.workers - 1)
        self._load_gate = asyncio.Lock()

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
                _check_template_kwargs(msg.chat_template_kwargs)
                tools = self._tools(msg.tools, msg.tool_choice)
                self._defer(self._admit_chat(entry, msg, tools))
            case AdmitCompletion():
                entry = self._model(msg.model)
                _check_task(entry, "generate")
                if isinstance(msg.prompt, str):
                    self._defer(self._admit_text(entry, msg, msg.prompt))
                else:
                    tokens = list(msg.prompt)
                    # The exact length first: the range check below is then O(context).
                    _check_context(entry, len(tokens), "prompt", exact=True)
                    vocab = len(entry.tokenizer)
                    if any(t < 0 or t >= vocab for t in tokens):
                        raise _refusal("invalid", f"prompt token ids must be in [0, {vocab})",
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
                cards = [entry.card for entry in self.models.values()]
                return cards + [msgspec.structs.replace(self.models[model].card, id=name,
                                                        alias_of=model)
                                for name, model in self.exact_aliases.items()]
            case DescribeModel(name=name):
                card = self._model(name).card
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
        prepared = await self._work(_chat_short, entry, self._render, msg.messages,
                                    msg.chat_template_kwargs, self.large_prompt_chars,
                                    self.max_image_pixels, *args)
        if isinstance(prepared, _Prompt):
            prepared = await self._large_turn(_prepare_chat, entry, prepared, *args)
        tokens, output, constraint, images = prepared
        return await self._admit(entry, msg.request_id, tokens, msg.sampling, "messages",
                                 unset=msg.unset, output=output, constraint=constraint,
                                 namespace=msg.cache_namespace, images=images)

    async def _admit_text(self, entry: ModelEntry, msg: AdmitCompletion,
                          prompt: str) -> AdmissionTicket:
        if len(prompt) <= self.large_prompt_chars:
            tokens, constraint = await self._work(_prepare_text, entry, prompt,
                                                  msg.response_format)
        else:
            await self._work(_check_floor, entry, prompt, "prompt")
            tokens, constraint = await self._large_turn(_prepare_text, entry, prompt,
                                                        msg.response_format)
        return await self._admit(entry, msg.request_id, tokens, msg.sampling, "prompt",
                                 unset=msg.unset, constraint=constraint,
                                 namespace=msg.cache_namespace)

    async def _admit_ids(self, entry: ModelEntry, msg: AdmitCompletion,
                         tokens: list[int]) -> AdmissionTicket:
        constraint = None
        if msg.response_format is not None and msg.response_format.type != "text":
            constraint = await self._work(_format_constraint, entry, msg.response_format)
        return await self._admit(entry, msg.request_id, tokens, msg.sampling, "prompt",
                                 unset=msg.unset, constraint=constraint,
                                 namespace=msg.cache_namespace)

    async def _admit_embed(self, entry: ModelEntry, msg: AdmitEmbed) -> EmbedAnswer:
        if not msg.inputs:
            raise _refusal("invalid", "input must not be empty", param="input")
        texts = [isinstance(x, str) for x in msg.inputs]
        if any(texts) and not all(texts):
            raise _refusal("invalid", "input must be all strings or all token id lists",
                           param="input")
        if all(texts):
            inputs = await self._work(_embed_tokens, entry, msg.inputs, msg.input_type,
                                      entry.card.context_length if msg.truncate else None)
        else:
            vocab = len(entry.tokenizer)
            inputs = [list(ids) for ids in msg.inputs]
            for i, ids in enumerate(inputs):
                if any(t < 0 or t >= vocab for t in ids):
                    raise _refusal("invalid", f"input {i}: token ids must be in [0, {vocab})",
                                   param=f"input[{i}]")
        return await self._embed(entry, msg.request_id, "embed", inputs, "input",
                                 truncate=msg.truncate)

    async def _admit_rerank(self, entry: ModelEntry, msg: AdmitRerank) -> EmbedAnswer:
        if not msg.documents:
            raise _refusal("invalid", "documents must not be empty", param="documents")
        limit = entry.card.context_length if msg.truncate else None
        inputs = await self._work(_rerank_inputs, entry, msg.query, msg.documents,
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
                raise _refusal("invalid", f"input {i} is empty", param=f"{param}[{i}]")
            if len(ids) > limit:
                if not truncate:
                    raise _refusal(
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
        prompt = await self._work(_render_chat, entry, self._render, msg.messages, tools, None,
                                  False, self.max_image_pixels)
        _check_rendered(entry, prompt.text)
        if prompt.images:
            return len((await self._large_turn(_with_images, entry, prompt))[0])
        if len(prompt.text) <= self.large_prompt_chars:
            return len(await self._work(_encode, entry, prompt.text, False))
        return len(await self._large_turn(_encode, entry, prompt.text, False))

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
        raise _refusal("unknown_model",
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
            raise _refusal("invalid", f"unknown tool_choice mode {choice.mode!r}",
                           param="tool_choice")
        for i, tool in enumerate(tools or ()):
            function = tool.get("function") if isinstance(tool, dict) else None
            if (not isinstance(tool, dict) or tool.get("type", "function") != "function"
                    or not isinstance(function, dict)
                    or not isinstance(function.get("name"), str) or not function["name"]):
                raise _refusal("invalid", "each tool must be {'type': 'function', 'function': "
                               "{'name': ..., 'parameters': {...}}}", param=f"tools[{i}]")
            if not isinstance(function.get("parameters", {}), dict):
                raise _refusal("invalid", "a tool's parameters must be a JSON Schema object",
                               param=f"tools[{i}].function.parameters")
        if choice.mode == "none":
            return None
        names = [tool["function"]["name"] for tool in tools or ()]
        if choice.mode in ("required", "function") and not names:
            raise _refusal("invalid", f"tool_choice {choice.mode!r} needs tools",
                           param="tool_choice")
        if choice.mode == "function" and choice.name not in names:
            raise _refusal("invalid", f"tool_choice names {choice.name!r}, which is not among "
                           f"the tools ({', '.join(names)})", param="tool_choice")
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
            raise _refusal("invalid", "the prompt is empty", param=prompt_param)
        _check_context(entry, len(tokens), prompt_param, exact=True)
        sampling = with_model_defaults(sampling, unset, entry.card.sampling_defaults)
        sampling, output = _fit_answer(entry, len(tokens), sampling, output, request_id,
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
            raise _refusal("overloaded", "the server is busy; retry shortly", code="queue_full",
                           retry_after=retry_after) from None
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
            raise _refusal(
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
            raise _refusal(
                "too_large",
                f"this prompt of {n_tokens} tokens needs about {need / MB:.0f} MB for its "
                f"prefill, {estimate / MB:.0f} MB in all with what is in use, over the server's "
                f"memory limit of {limits.limit / MB:.0f} MB, of which {floor / MB:.0f} MB "
                f"stay in use when idle: shorten it",
                param=prompt_param, code="memory_limit_exceeded",
            )
        if estimate > limits.limit:
            raise _refusal(
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
                raise _refusal("unavailable", f"model {entry.card.id!r} is not loaded",
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


# -- pure work: runs in the pool, reads only what does not change after on_start ---------------


def _refusal(kind: ErrorKind, message: str, **kw: Any) -> AdmissionError:
    return AdmissionError(kind, message, **kw)


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
    raise _refusal(
        "invalid", f"model {entry.card.id!r} serves {routes[served]}, not {routes[task]}; "
        f"serve a model for {routes[task]} (or this one with --task {task})",
        param="model", code="model_task_mismatch")


def _embed_tokens(entry: ModelEntry, texts: list[str], input_type: str | None,
                  limit: int | None) -> list[list[int]]:
    """Embedding inputs as token ids; queries get the model's query prompt before them. An
    encoder's input is cut here to ``limit`` (truncation asked for), its closing token kept."""
    prefix = read_embed_spec(entry.card.path).query_prefix if input_type == "query" else ""
    if is_encoder(entry.card.path):
        return [text_tokens(entry.tokenizer, prefix + text, limit) for text in texts]
    return [entry.tokenizer.encode(prefix + text) for text in texts]


def _rerank_inputs(entry: ModelEntry, query: str, documents: list[str],
                   instruction: str | None, limit: int | None) -> list[list[int]]:
    """Rerank inputs as token ids: a cross-encoder's (query, document) pairs (it takes no
    instruction), a decoder reranker's prompt format."""
    if is_encoder(entry.card.path):
        return [pair_tokens(entry.tokenizer, query, doc, limit) for doc in documents]
    return [rerank_tokens(entry.tokenizer, query, doc, instruction=instruction, limit=limit)
            for doc in documents]


def _check_context(entry: ModelEntry, n_tokens: int, prompt_param: str, *,
                   exact: bool) -> None:
    """Refuse a prompt of ``n_tokens`` (``exact``, or at least that many) that leaves no room
    in the context for one token of answer (a ``max_tokens`` over the room is cut instead:
    ``_fit_answer``)."""
    limit = entry.card.context_length
    if n_tokens >= limit:
        has = "has" if exact else "has at least"
        raise _refusal(
            "invalid",
            f"this model's context is {limit} tokens; the prompt {has} {n_tokens}, which "
            f"leaves no room for an answer: shorten it",
            param=prompt_param, code="context_length_exceeded",
        )


def with_model_defaults(sampling: SamplingParams, unset: tuple[str, ...],
                        defaults: SamplingDefaults) -> SamplingParams:
    """``sampling`` with the model's ``defaults`` in the fields its request left ``unset``
    (a field the model sets no default for keeps ``SamplingParams``' own)."""
    filled = {name: value for name in unset
              if (value := getattr(defaults, name)) is not None}
    return msgspec.structs.replace(sampling, **filled) if filled else sampling


def _fit_answer(entry: ModelEntry, n_tokens: int, sampling: SamplingParams,
                output: OutputSpec | None, request_id: str, limit: int | None = None,
                ) -> tuple[SamplingParams, OutputSpec | None]:
    """``max_tokens`` cut to the room the prompt of ``n_tokens`` leaves in the context (and to
    ``limit``, the server's ``--max-tokens-limit``), and a thinking budget kept below it
    (Anthropic's rule, on the cut value). Agents send a ``max_tokens`` of their own
    provider's models (Claude Code: 32000) whatever the model."""
    room = entry.card.context_length - n_tokens
    if limit is not None:
        room = min(room, limit)
    if sampling.max_tokens <= room:
        return sampling, output
    log.debug("%s: max_tokens %d cut to %d (the context's room, the server's limit)",
              request_id, sampling.max_tokens, room)
    sampling = msgspec.structs.replace(sampling, max_tokens=room)
    if output is not None and output.thinking_budget is not None \
            and output.thinking_budget >= room:
        output = msgspec.structs.replace(output, thinking_budget=max(1, room - 1))
    return sampling, output


def _check_floor(entry: ModelEntry, text: str, prompt_param: str) -> None:
    """Refuse, without tokenizing it, a text whose floor of tokens cannot fit."""
    if entry.bound is not None:
        _check_context(entry, entry.bound.fewest_tokens(text), prompt_param, exact=False)


# Claude Code (>= 2.1.36) puts this line first in its system prompt, with a hash (cch=) and a
# version suffix that change on every request: billing data for Anthropic's own servers, which
# means nothing to the model and, kept, would make every turn's prompt differ from its first
# line on (no prefix cache hit). Gateways that turn its requests into OpenAI's shape carry it
# into a system message, so the rule is here, under every route.
BILLING_HEADER = "x-anthropic-billing-header:"


def without_billing_header(messages: list[dict]) -> list[dict]:
    """The conversation without Claude Code's billing line in its system (or developer)
    messages; a message left empty by it is dropped, as if the block had not been sent."""
    out = []
    for message in messages:
        content = message.get("content")
        if (message.get("role") in ("system", "developer") and isinstance(content, str)
                and BILLING_HEADER in content):
            content = "\n".join(line for line in content.split("\n")
                                if not line.lstrip(" \t").startswith(BILLING_HEADER))
            if not content:
                continue
            message = {**message, "content": content}
        out.append(message)
    return out


def _check_template_kwargs(kwargs: dict | None) -> None:
    """Refuse a ``chat_template_kwargs`` key that is not a variable of the template but a
    parameter of ``apply_chat_template`` (``TEMPLATE_PARAMETERS``)."""
    for key in kwargs or ():
        if key in TEMPLATE_PARAMETERS:
            raise _refusal(
                "invalid",
                f"chat_template_kwargs may set the chat template's variables (such as "
                f"enable_thinking), not {key!r}: the model's own template renders every "
                f"request",
                param=f"chat_template_kwargs.{key}",
            )


def _render_chat(entry: ModelEntry, render: _RenderBound, messages: list[dict],
                 tools: list[dict] | None, extra: dict | None,
                 generation_prompt: bool, max_pixels: int) -> _Prompt:
    """The chat as the template renders it, not tokenized yet (so that its floor of tokens is
    checked first), within ``render``'s time, and its images decoded (each at most
    ``max_pixels``). A template without a tool format gets the tools written into the
    conversation instead (``actors.tool_prompt``), read back in troupe's fallback format."""
    messages = without_billing_header(messages)
    messages, images = _take_images(entry, messages, max_pixels)
    tool_format = entry.tool_format
    if tool_format is None and (tools or uses_tools(messages)):
        messages, tools, tool_format = (with_tools_in_prompt(messages, tools), None,
                                        FALLBACK_TOOL_FORMAT)
    elif uses_tools(messages):
        messages = with_parsed_arguments(messages)
    if not messages:
        raise _refusal("invalid", "messages must not be empty", param="messages")
    if not entry.tokenizer.has_chat_template:
        raise _refusal("invalid", f"model {entry.card.id!r} has no chat template; "
                       "use /v1/completions", param="messages")
    try:
        text = render.watchdog.call(
            render.seconds, entry.tokenizer.apply_chat_template,
            messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False,
            **(extra or {}),
        )
    except Overrun:
        raise _refusal(
            "invalid",
            f"the chat template did not finish rendering these messages within "
            f"{render.seconds:g} s (the server's --template-timeout)",
            param="messages", code="template_timeout",
        ) from None
    except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
        # Templates reject what they cannot render (roles out of order, bad tool specs).
        raise _refusal("invalid", f"the chat template rejected the messages: {exc}",
                       param="messages") from exc
    return _Prompt(text=text, tool_format=tool_format, images=images)


def _take_images(entry: ModelEntry, messages: list[dict], max_pixels: int
                 ) -> tuple[list[dict], tuple[Any, ...]]:
    """The messages with each image part (``actors.images``' shape) left as the bare
    ``{"type": "image"}`` a chat template writes its marker for, and the images decoded, in
    order. Refused: images sent to a model that reads none, and images that do not decode or
    are too large (each naming its part)."""
    parts = image_parts(messages)
    if not parts:
        return messages, ()
    first = parts[0]["image"].get("param")
    if entry.no_images is not None:
        raise _refusal("invalid", f"model {entry.card.id!r} does not read images: "
                       f"{entry.no_images}", param=first, code="images_not_supported")
    try:
        images = [decode_part(part, max_pixels=max_pixels) for part in parts]
    except ImageError as exc:
        raise _refusal("invalid", exc.message, param=exc.param) from None

    def bare(message: dict) -> dict:
        content = message.get("content")
        if not isinstance(content, list):
            return message
        return {**message, "content": [
            {"type": "image"} if isinstance(p, dict) and p.get("type") == "image" else p
            for p in content]}

    return [bare(m) for m in messages], tuple(images)


def _with_images(entry: ModelEntry, prompt: _Prompt) -> tuple[list[int], list[ImageInput]]:
    """A rendered chat's tokens with its images placed by the model's processor."""
    try:
        return with_images(entry.processor, entry.image_token, prompt.text, list(prompt.images))
    except ValueError as exc:
        # A template that dropped an image's marker (or wrote one of its own).
        raise _refusal("invalid", f"the chat template did not place the images: {exc}",
                       param="messages") from None


def _check_rendered(entry: ModelEntry, text: str) -> None:
    """Refuse, from its length alone, a rendered chat that no tokenizing could fit in the
    context (see ``RENDER_CHARS_PER_TOKEN``): a template that wrote far more than it was
    given is not tokenized. Checked after ``_check_floor``, whose refusal (the prompt's
    least number of tokens) says more where the tokenizer gives a floor."""
    context = entry.card.context_length
    most = context * max(RENDER_CHARS_PER_TOKEN, entry.bound.chars if entry.bound else 0)
    if len(text) > most:
        raise _refusal(
            "invalid",
            f"the chat template rendered these messages as {len(text)} characters, more than "
            f"this model's context of {context} tokens can hold ({most} at the most): "
            f"shorten them",
            param="messages", code="context_length_exceeded",
        )


_Prepared = tuple[list[int], OutputSpec | None, Constraint | None, list[ImageInput]]


def _chat_short(entry: ModelEntry, render: _RenderBound, messages: list[dict],
                extra: dict | None, large: int, max_pixels: int, tools: list[dict] | None,
                choice: ToolChoice, fmt: OutputFormat | None, thinking_budget: int | None,
                ) -> _Prepared | _Prompt:
    """The chat rendered for generation, refused if its floor of tokens cannot fit; prepared
    at once if it has at most ``large`` characters and no images (whose processing takes
    longer), else returned to wait its turn."""
    prompt = _render_chat(entry, render, messages, tools, extra, True, max_pixels)
    _check_floor(entry, prompt.text, "messages")
    _check_rendered(entry, prompt.text)
    if len(prompt.text) > large or prompt.images:
        return prompt
    return _prepare_chat(entry, prompt, tools, choice, fmt, thinking_budget)


def _prepare_text(entry: ModelEntry, prompt: str,
                  fmt: OutputFormat | None) -> tuple[list[int], Constraint | None]:
    """A completion prompt's tokens and its grammar, refused first if its floor of tokens
    cannot fit."""
    _check_floor(entry, prompt, "prompt")
    return _encode(entry, prompt, True), _format_constraint(entry, fmt)


def _encode(entry: ModelEntry, text: str, special: bool) -> list[int]:
    """The text's tokens; a rendered chat carries its special tokens already (as
    ``apply_chat_template`` encodes it), a raw completion prompt gets the tokenizer's own."""
    return list(entry.tokenizer.encode(text, add_special_tokens=special))


def _prepare_chat(entry: ModelEntry, prompt: _Prompt, tools: list[dict] | None,
                  choice: ToolChoice, fmt: OutputFormat | None, thinking_budget: int | None,
                  ) -> _Prepared:
    """A rendered chat's tokens, how its answer is read, and its grammar (``tools``: the
    request's, also when the fallback wrote them into the prompt)."""
    images: list[ImageInput] = []
    if prompt.images:
        tokens, images = _with_images(entry, prompt)
        # The answer is read from the text after the images (their ids are no vocabulary's).
        text_ids = [entry.image_token if t < 0 else t for t in tokens]
    else:
        tokens = text_ids = _encode(entry, prompt.text, False)
    tool_format = prompt.tool_format
    output = _output_spec(entry, text_ids, tools, tool_format, thinking_budget)
    # The reasoning before a constrained answer stays free text.
    think = {"think": output.think, "in_reasoning": output.in_reasoning} \
        if output is not None else {}
    if tools and choice.mode in ("required", "function"):
        constraint = _compile(
            entry, "tool_choice", lambda g: g.for_tools(tools, choice, tool_format, **think))
    else:
        constraint = _format_constraint(entry, fmt, **think)
    return tokens, output, constraint, images


def _output_spec(entry: ModelEntry, tokens: list[int], tools: list[dict] | None,
                 tool_format: str | None, thinking_budget: int | None) -> OutputSpec | None:
    """How the engine reads this answer; None when it is plain text (no parser runs).
    Harmony (gpt-oss) marks reasoning and the final text with the same markup as its
    calls, so its answers are always parsed."""
    if entry.tool_format == "harmony":
        tool_format = "harmony"
    elif not tools:
        tool_format = None
    if tool_format is None and entry.think is None:
        return None
    in_reasoning = False
    if entry.think is not None:
        tail = entry.tokenizer.decode(tokens[-16:])
        in_reasoning = prompt_opens_reasoning(tail, entry.think)
    return OutputSpec(tool_format=tool_format, tools=tools,
                      think=entry.think, in_reasoning=in_reasoning,
                      thinking_budget=thinking_budget)


def _format_constraint(entry: ModelEntry, fmt: OutputFormat | None,
                       **think: Any) -> Constraint | None:
    if fmt is None or fmt.type == "text":
        return None
    return _compile(entry, "response_format", lambda g: g.for_format(fmt, **think))


def _compile(entry: ModelEntry, param: str, build: Callable[[Grammars], Constraint]
             ) -> Constraint:
    """Compile a grammar in admission's pool, so that the scheduler never waits for one; a
    grammar that cannot be enforced is the client's 400, naming ``param`` (or the narrower
    field the error names: a tool's parameters)."""
    assert entry.grammars is not None
    try:
        return build(entry.grammars)
    except GrammarError as exc:
        raise _refusal("invalid", f"cannot enforce this {param}: {exc}",
                       param=exc.param or param) from exc
