"""Messages between the HTTP layer and the serving actors.

Everything here is plain data (``msgspec.Struct``): no ``mx.array`` ever crosses an actor
boundary, so this module imports neither MLX nor anything that does. ``api/`` imports it.

Commands are named in the imperative (``AddRequest``), events in the past tense
(``TokensGenerated``), following house-style.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from troupe.runtime import Message, ReplyStream


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How one request samples and when it stops. Validated by the API schemas."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False
    # Speculative decoding for this request (when the server has it on): an extension field.
    speculative: bool = True


class SamplingDefaults(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A model's own sampling settings (its generation_config.json). Each one set is the value
    of a request that does not set that field; None leaves ``SamplingParams``' default."""

    temperature: Annotated[float, msgspec.Meta(ge=0.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0)] | None = None


# The ``SamplingParams`` fields a model's defaults may fill.
DEFAULTABLE = SamplingDefaults.__struct_fields__


def unset_sampling(sent: dict[str, Any]) -> tuple[str, ...]:
    """The ``DEFAULTABLE`` fields a request left unset, from what it ``sent`` (a field's
    value, None when not sent; a field its API lacks counts as unset)."""
    return tuple(name for name in DEFAULTABLE if sent.get(name) is None)


# --- agents: tools, constrained output, reasoning ---------------------------------------------


class ToolChoice(msgspec.Struct, frozen=True, kw_only=True):
    """Whether and how the model calls tools, in the neutral shape every API maps onto.

    ``mode``: ``auto`` (the model decides), ``none`` (tools hidden from the model),
    ``required`` (at least one call), ``function`` (a call of the tool named ``name``).
    ``parallel``: whether an answer may hold several calls. ``input_formats``: the grammar
    (``regex`` or ``lark``) each freeform tool's one string argument, ``input``, follows when
    its call is enforced, by tool name (the Responses API's ``custom`` tools)."""

    mode: str = "auto"
    name: str | None = None
    parallel: bool = True
    input_formats: dict[str, OutputFormat] | None = None


class OutputFormat(msgspec.Struct, frozen=True, kw_only=True):
    """A constraint on the answer's text. ``type``: ``text`` (none), ``json_object`` (any JSON
    object), ``json_schema`` (JSON valid against ``schema``), ``regex`` or ``lark`` (``pattern``
    is the grammar)."""

    type: str = "text"
    schema: dict | None = None
    pattern: str | None = None
    name: str | None = None


class OutputSpec(msgspec.Struct, frozen=True, kw_only=True):
    """How the engine reads one chat answer's text (``actors.engine.agent_output.OutputParser``).

    ``tool_format``: the parser of the model's tool-call markup (an ``mlx_lm.tool_parsers``
    module name, or one of troupe's own formats), None when no tools were offered.
    ``tools``: the request's tools as OpenAI functions (``{"type": "function", "function":
    {...}}``). ``think``: the (start, end) tags of the model's reasoning, None when it has none.
    ``in_reasoning``: the prompt ends inside an open reasoning tag (the template opened it).
    ``thinking_budget``: reasoning tokens after which the closing tag is forced."""

    tool_format: str | None = None
    tools: list[dict] | None = None
    think: tuple[str, str] | None = None
    in_reasoning: bool = False
    thinking_budget: int | None = None


class ToolCall(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One tool call parsed from the model's output. ``index``: its place among this answer's
    calls; ``arguments``: the arguments object as JSON text."""

    index: int
    id: str
    name: str
    arguments: str


# --- HTTP layer -> admission -------------------------------------------------------------


class AdmitChat(Message, frozen=True, kw_only=True):
    """Apply the model's chat template to ``messages`` (and ``tools``), then admit."""

    request_id: str
    model: str
    messages: list[dict]
    sampling: SamplingParams
    # The ``DEFAULTABLE`` fields the request did not set: the model's defaults fill them.
    unset: tuple[str, ...] = ()
    tools: list[dict] | None = None
    chat_template_kwargs: dict | None = None
    tool_choice: ToolChoice = ToolChoice()
    response_format: OutputFormat | None = None
    # Reasoning tokens after which the closing tag is forced (Anthropic's budget_tokens).
    thinking_budget: int | None = None
    # Whose prefix-cache blocks it may read and write ("": the shared namespace).
    cache_namespace: str = ""


class AdmitCompletion(Message, frozen=True, kw_only=True):
    """Admit a raw-text (or pre-tokenized) completion prompt."""

    request_id: str
    model: str
    prompt: str | list[int]
    sampling: SamplingParams
    # The ``DEFAULTABLE`` fields the request did not set: the model's defaults fill them.
    unset: tuple[str, ...] = ()
    response_format: OutputFormat | None = None
    # Whose prefix-cache blocks it may read and write ("": the shared namespace).
    cache_namespace: str = ""
    # Code completion: the text after the gap the answer fills, ``prompt`` the text before
    # (the model's fill-in-the-middle tokens around them). None: a plain completion.
    suffix: str | None = None


class AdmitEmbed(Message, frozen=True, kw_only=True):
    """Embed ``inputs`` (texts, or token id lists: all of one kind) with an embedding model;
    ``ask`` answers ``EmbedAnswer``. ``input_type`` "query" puts the model's query prompt
    before each text; ``truncate`` cuts an input over the context instead of refusing it."""

    request_id: str
    model: str
    inputs: list[str | list[int]]
    input_type: str | None = None
    truncate: bool = False


class AdmitRerank(Message, frozen=True, kw_only=True):
    """Score each of ``documents`` against ``query`` with a reranker; ``ask`` answers
    ``EmbedAnswer`` (one relevance score per document, in their order). ``truncate`` cuts a
    pair over the context (the default, as Cohere's and Jina's rerank do) instead of
    refusing it."""

    request_id: str
    model: str
    query: str
    documents: list[str]
    instruction: str | None = None
    truncate: bool = True
    # Whose prefix-cache blocks the query's prefix may read and write ("": the shared one).
    cache_namespace: str = ""


class EmbedAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """Admission's answer to ``AdmitEmbed``/``AdmitRerank``: the model that answered, one
    result per input (a unit vector, or a score), and the tokens the inputs took."""

    model: str
    results: list[Any]
    prompt_tokens: int


class CountTokens(Message, frozen=True, kw_only=True):
    """Tokenize a chat without admitting it (for token counting endpoints)."""

    model: str
    messages: list[dict]
    tools: list[dict] | None = None


class ListModels(Message, frozen=True, kw_only=True):
    """Ask admission which models it serves."""


class DescribeModel(Message, frozen=True, kw_only=True):
    """Ask admission for the card of the model a request naming ``name`` would get (its own
    card, or, for an alias or any other name served, that model's under ``name``)."""

    name: str


class ModelCard(msgspec.Struct, frozen=True, kw_only=True):
    """A served model. ``alias_of``: on the card admission lists for an alias (``--alias``),
    the id of the model the alias names (the rest is that model's). ``sampling_defaults``:
    the model's own, read from its directory when it is resolved. ``task``: what it serves,
    "generate", "embed" or "rerank" (``actors.engine.embed.model_task``).
    ``draft_path``: its draft model's directory (``--draft-model``)."""

    id: str
    context_length: int
    source: str
    path: str
    fingerprint: str = ""
    alias_of: str | None = None
    sampling_defaults: SamplingDefaults = SamplingDefaults()
    task: str = "generate"
    # The draft model that drafts for it (``--draft-model``), resolved; None: none.
    draft_path: str | None = None
    # What it does here and whether it is in memory, as admission answers ``ListModels`` and
    # ``DescribeModel``: "completion", "tools", "thinking", "vision", "embedding".
    capabilities: tuple[str, ...] = ()
    loaded: bool | None = None
    # Its parameters, counted from its weights' headers (None: not counted).
    parameters: int | None = None


class Admitted(msgspec.Struct, frozen=True, kw_only=True):
    """What admission tells the HTTP layer about an accepted request."""

    request_id: str
    model: str
    prompt_tokens: int
    # How it samples: the request's own settings, the model's defaults where it set none.
    sampling: SamplingParams | None = None


# What went wrong, in the core's words: a request that is malformed or cannot be served as
# asked, a model not served here, a request id already running, a prompt that can never fit,
# a full queue, memory or a model that is busy now, a failure of the server itself.
# api/errors.py alone turns each into an HTTP status.
ErrorKind = Literal["invalid", "unknown_model", "conflict", "too_large", "overloaded",
                    "unavailable", "internal"]


class AdmissionError(Exception):
    """A request refused before any response header, with the kind of refusal.

    ``param`` names the field at fault; ``retry_after`` (seconds): when it is worth retrying.
    """

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def __reduce__(self):  # keeps the error intact if it is ever copied or pickled
        return (
            _rebuild_admission_error,
            (self.kind, self.message, self.param, self.code, self.retry_after),
        )


def _rebuild_admission_error(kind, message, param, code, retry_after):
    return AdmissionError(kind, message, param=param, code=code, retry_after=retry_after)


# --- admission -> scheduler ---------------------------------------------------------------


class ImageInput(msgspec.Struct, frozen=True, kw_only=True):
    """One image of a prompt, as its processor made it: ``pixels`` (a numpy array; only the
    scheduler's thread makes MLX arrays of it), its key (``actors.engine.vision.image_key``),
    how many prompt tokens it takes, and ``grid``: for the Qwen-VL family, whose pixels are
    rows of patches, its (temporal, height, width) patch grid (None for the others)."""

    key: int
    tokens: int
    pixels: Any
    grid: tuple[int, int, int] | None = None


class AddRequest(Message, frozen=True, kw_only=True):
    """Join the running batch. Sent with ``stream()``: the scheduler answers with events.

    ``output``: how to read the answer (tool calls, reasoning); None for plain text.
    ``constraint``: a compiled grammar (``actors.engine.grammar.Constraint``, made in admission, off
    the MLX thread) that masks every sampled token; None when unconstrained.
    ``cache_namespace``: the prefix-cache namespace whose blocks alone it reads and into which
    it cuts its own (an API key's, a ``cache_salt``'s; "": the shared one). A hash, never a
    key."""

    request_id: str
    prompt_tokens: list[int]
    sampling: SamplingParams
    output: OutputSpec | None = None
    constraint: Any = None
    cache_namespace: str = ""
    # The images whose tokens ``prompt_tokens`` holds (negative ids: actors/engine/vision.py).
    images: list[ImageInput] = []


class EmbedInputs(Message, frozen=True, kw_only=True):
    """Embed or score ``inputs`` (token ids, each within the context), with ``ask``: the
    scheduler answers ``Embedded`` when the last one ends. ``task``: "embed" (a unit vector
    each) or "rerank" (a relevance score each)."""

    request_id: str
    task: Literal["embed", "rerank"]
    inputs: list[list[int]]
    # The prefix-cache namespace a shared prefix's blocks are read from and cut into.
    cache_namespace: str = ""


class Embedded(msgspec.Struct, frozen=True, kw_only=True):
    """The answer to ``EmbedInputs``: one vector (embed) or score (rerank) per input."""

    results: list[Any]


class AbortRequest(Message, frozen=True, kw_only=True):
    """The client has gone: drop the request from the batch and free its memory."""

    request_id: str


class Step(Message, frozen=True, kw_only=True):
    """The scheduler's note to itself: run one model step after draining the mailbox."""


class DescribeEngine(Message, frozen=True, kw_only=True):
    """Ask a scheduler for its model card and its live state."""


# --- scheduler -> the request's reply stream ------------------------------------------------


class TopLogprob(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    token: str
    token_id: int
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    token: str
    token_id: int
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class Usage(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0  # of completion_tokens, those inside the reasoning tags

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class RequestStarted(Message, frozen=True, kw_only=True):
    """The scheduler accepted the request into its queue (sent before any token)."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int = 0


class TokensGenerated(Message, frozen=True, kw_only=True):
    """New output: ``text`` is the printable delta (whole UTF-8 characters, stop strings cut,
    tool-call markup and reasoning taken out); ``reasoning`` the delta of the model's
    reasoning; ``tool_calls`` the calls completed in this delta, each whole."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    reasoning: str = ""
    tool_calls: list[ToolCall] | None = None


class RequestFinished(Message, frozen=True, kw_only=True):
    """The last event of a request. ``finish_reason``: stop, length, tool_calls (the answer
    ended after calling tools), abort or error."""

    request_id: str
    finish_reason: str
    usage: Usage
    error: str | None = None
    error_kind: ErrorKind | None = None
    ttft_s: float | None = None
    stop_sequence: str | None = None  # the stop string that ended the text, if one did
    retry_after: float | None = None  # a refusal's Retry-After (seconds), when it estimated one


RequestEvent = RequestStarted | TokensGenerated | RequestFinished


@dataclass(frozen=True)
class AdmissionTicket:
    """Admission's answer to ``AdmitChat``/``AdmitCompletion``: the request is in the scheduler.

    ``events`` yields ``RequestStarted``, then ``TokensGenerated`` deltas, then exactly one
    ``RequestFinished``. Closing it early tells the scheduler the client has gone.
    """

    admitted: Admitted
    # A ReplyStream, or admission's wrapper of one (the same interface).
    events: ReplyStream | Any
