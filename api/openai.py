"""OpenAI-compatible routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

A request body is decoded straight into a msgspec Struct (strict types, ranges as ``Meta``
constraints), turned into an admission message, and the request's events are rendered back as
OpenAI's response objects: whole, or as server-sent chunks.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from functools import partial
from typing import Annotated, Any, Literal

import msgspec
from aiohttp import web
from msgspec import Meta

from troupe.actors.config import ServeConfig
from troupe.actors.messages import (
    AdmitChat,
    AdmitCompletion,
    Admitted,
    DescribeModel,
    ListModels,
    ModelCard,
    OutputFormat,
    RequestEvent,
    RequestFinished,
    SamplingDefaults,
    SamplingParams,
    TokenLogprob,
    TokensGenerated,
    ToolCall,
    ToolChoice,
    Usage,
    unset_sampling,
)
from troupe.api.cache_namespace import CacheSalt
from troupe.api.errors import ApiError, ask_admission, why_unsupported
from troupe.api.generation import Renderer
from troupe.api.generation_route import generate
from troupe.api.images import ImageInput, content, url_image
from troupe.api.shutdown import generation
from troupe.api.sse import DONE, Frame
from troupe.api.stops import stop_sequences
from troupe.runtime import ActorRef

# --- request schemas -----------------------------------------------------------------------

NonNegativeInt = Annotated[int, Meta(ge=0)]
PositiveInt = Annotated[int, Meta(ge=1)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    description: str | None = None
    # msgspec cannot name a field "schema" on every Python: it is renamed on the wire.
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class ImageUrl(msgspec.Struct, kw_only=True):
    url: str
    detail: str | None = None  # accepted and ignored: the model's processor sizes images


class ContentPart(msgspec.Struct, kw_only=True):
    # ``type`` stays a plain string so an audio or file part gets a clear refusal, not a
    # schema error.
    type: str
    text: str | None = None
    # Some clients send the URL as a string, not an object: taken too.
    image_url: ImageUrl | str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class SamplingRequest(msgspec.Struct, kw_only=True):
    """Fields chat and legacy completions share. ``None`` everywhere means "not sent"."""

    model: str
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: NonNegativeInt | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    seed: int | None = None
    stop: str | Annotated[list[str], Meta(max_length=4)] | None = None
    stop_token_ids: list[NonNegativeInt] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    ignore_eos: bool | None = None
    speculative: bool | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    cache_salt: CacheSalt | None = None


class ChatCompletionRequest(SamplingRequest, kw_only=True):
    """The body of ``POST /v1/chat/completions``. Unknown fields are ignored."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingRequest, kw_only=True):
    """The body of ``POST /v1/completions`` (the legacy API). Unknown fields are ignored."""

    prompt: str | list[str | NonNegativeInt | list[NonNegativeInt]]
    # Legacy logprobs: how many alternatives to return per token, 0..5.
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None
    response_format: ResponseFormat | None = None


# --- response schemas ----------------------------------------------------------------------


class TopLogprobOut(msgspec.Struct, kw_only=True, gc=False):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobOut(msgspec.Struct, kw_only=True, gc=False):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprobOut]


class ChatLogprobs(msgspec.Struct, kw_only=True, gc=False):
    content: list[TokenLogprobOut]


class CompletionLogprobs(msgspec.Struct, kw_only=True, gc=False):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class PromptTokensDetails(msgspec.Struct, kw_only=True, gc=False):
    cached_tokens: int


class CompletionTokensDetails(msgspec.Struct, kw_only=True, gc=False):
    reasoning_tokens: int


class UsageOut(msgspec.Struct, kw_only=True, gc=False):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


class FunctionOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A tool call: whole in a message; in a stream, first its id and name, then arguments."""

    index: int | None = None
    id: str | None = None
    type: str | None = None
    function: FunctionOut


class AssistantMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str
    content: str | None  # null when the answer is only tool calls (always sent)
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str


class OpenAIObject(msgspec.Struct, kw_only=True):
    """The fields every response object and chunk starts with."""

    id: str
    object: str
    created: int
    model: str


class ChatCompletion(OpenAIObject, kw_only=True):
    choices: list[ChatChoice]
    usage: UsageOut


class Delta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(OpenAIObject, kw_only=True, omit_defaults=True):
    # omit_defaults drops ``usage`` from every chunk but the usage chunk.
    choices: list[ChatChunkChoice]
    usage: UsageOut | None = None


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(OpenAIObject, kw_only=True, omit_defaults=True):
    """A ``text_completion`` object: the whole answer, or one streamed chunk of it."""

    choices: list[CompletionChoice]
    usage: UsageOut | None = None


class ModelObject(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str
    object: str
    created: int
    owned_by: str
    root: str  # the served model that answers to this id (itself, or an alias's model)
    # The model's context in tokens, as vLLM names it: agents size their history by it.
    max_model_len: int
    # The model's own sampling defaults (generation_config.json), when it sets any.
    sampling_defaults: SamplingDefaults | None = None
    # "embed" or "rerank" for a model that serves /v1/embeddings or /v1/rerank (None: chat).
    task: str | None = None


class ModelList(msgspec.Struct, kw_only=True):
    object: str
    data: list[ModelObject]


class AnthropicModel(msgspec.Struct, kw_only=True):
    """A model in Anthropic's shape (``GET /v1/models`` with an ``anthropic-version``)."""

    type: str
    id: str
    display_name: str
    created_at: str
    lifecycle: str
    max_input_tokens: int
    max_tokens: int


class AnthropicModelList(msgspec.Struct, kw_only=True):
    data: list[AnthropicModel]
    has_more: bool
    first_id: str | None
    last_id: str | None


# --- decoding and validation ---------------------------------------------------------------

_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_encoder = msgspec.json.Encoder()


# The roles whose messages may hold images: a user's, and a tool's output.
_IMAGE_ROLES = ("user", "tool")
_ACCEPTED_PARTS = "text parts, and image_url parts in user and tool messages"


def _message_content(message: ChatMessage, index: int) -> str | list[dict[str, Any]]:
    """The message's content: a string as it is, text parts joined by newlines; with images,
    its text and image parts in order (``api.images.content``)."""
    if message.content is None:
        return ""  # an assistant turn that only calls tools; templates expect a string
    if isinstance(message.content, str):
        return message.content
    parts = []
    for j, part in enumerate(message.content):
        param = f"messages[{index}].content[{j}]"
        if part.type == "text":
            if part.text is None:
                raise ApiError(400, "A text content part needs a 'text' string.",
                               param=f"{param}.text")
            parts.append({"type": "text", "text": part.text})
        elif part.type == "image_url" and message.role in _IMAGE_ROLES:
            parts.append(_image(part, f"{param}.image_url"))
        else:
            raise ApiError(
                400,
                f"Content parts of type '{part.type}' are not supported here: "
                f"{why_unsupported(part.type, _ACCEPTED_PARTS)}.",
                param=param,
            )
    return content(parts)


def _image(part: ContentPart, param: str) -> dict[str, Any]:
    url = part.image_url.url if isinstance(part.image_url, ImageUrl) else part.image_url
    if url is None:
        raise ApiError(400, "An image_url part needs 'image_url': {\"url\": ...}.", param=param)
    return url_image(url, param)


def _template_message(message: ChatMessage, index: int) -> dict[str, Any]:
    """One message as chat templates read it: role, content and the tool fields."""
    out: dict[str, Any] = {"role": message.role, "content": _message_content(message, index)}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls is not None:
        out["tool_calls"] = message.tool_calls
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


# Optional fields copied to SamplingParams as they are when sent; the rest keep its defaults.
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop_token_ids",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "ignore_eos",
    "speculative",
)


def _sampling(
    req: SamplingRequest, *, max_tokens: int, logprobs: bool, top_logprobs: int
) -> SamplingParams:
    if req.n is not None and req.n != 1:
        raise ApiError(400, "Only n=1 is supported.", param="n")
    stop = stop_sequences([req.stop] if isinstance(req.stop, str) else list(req.stop or []),
                          "stop")
    fields = {name: getattr(req, name) for name in _SAMPLING_FIELDS}
    return SamplingParams(
        max_tokens=max_tokens,
        stop=stop,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        **{name: value for name, value in fields.items() if value is not None},
    )


def _unset(req: SamplingRequest) -> tuple[str, ...]:
    """The sampling fields the request left to the model's defaults."""
    return unset_sampling({name: getattr(req, name) for name in _SAMPLING_FIELDS})


def output_format(fmt: ResponseFormat | None) -> OutputFormat | None:
    """``response_format`` as the neutral constraint admission compiles (None: free text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return OutputFormat(type="json_object")
    if fmt.type == "json_schema":
        spec = fmt.json_schema
        if spec is None or not isinstance(spec.schema_, dict):
            raise ApiError(400, "response_format of type 'json_schema' needs "
                           "json_schema.schema, a JSON Schema object.",
                           param="response_format.json_schema")
        return OutputFormat(type="json_schema", schema=spec.schema_, name=spec.name)
    raise ApiError(
        400,
        f"response_format of type '{fmt.type}' is not supported; use 'text', 'json_object' "
        "or 'json_schema'.",
        param="response_format",
    )


def tool_choice(choice: str | dict[str, Any] | None, parallel: bool | None) -> ToolChoice:
    """OpenAI's ``tool_choice`` (and ``parallel_tool_calls``) in the neutral shape."""
    parallel = parallel is not False
    if choice is None or choice in ("auto", "none", "required"):
        return ToolChoice(mode=choice or "auto", parallel=parallel)
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") == "function" and isinstance(name, str):
            return ToolChoice(mode="function", name=name, parallel=parallel)
    raise ApiError(
        400,
        "tool_choice must be 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}.',
        param="tool_choice",
    )


def admit_chat(req: ChatCompletionRequest, request_id: str, default_max_tokens: int) -> AdmitChat:
    """Validate what the schema cannot express and build the admission message."""
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs to be true.", param="top_logprobs")
    choice = tool_choice(req.tool_choice, req.parallel_tool_calls)
    response_format = output_format(req.response_format)
    max_tokens = req.max_completion_tokens or req.max_tokens or default_max_tokens
    sampling = _sampling(
        req,
        max_tokens=max_tokens,
        logprobs=bool(req.logprobs),
        top_logprobs=req.top_logprobs or 0,
    )
    return AdmitChat(
        request_id=request_id,
        model=req.model,
        messages=[_template_message(m, i) for i, m in enumerate(req.messages)],
        sampling=sampling,
        unset=_unset(req),
        tools=req.tools,
        chat_template_kwargs=req.chat_template_kwargs,
        tool_choice=choice,
        response_format=response_format,
    )


def _prompt(prompt: str | list[str | int | list[int]]) -> str | list[int]:
    """One prompt, as text or token ids; batches of prompts are refused."""
    if isinstance(prompt, str):
        return prompt
    if not prompt:
        raise ApiError(400, "prompt must not be empty.", param="prompt")
    token_ids = [item for item in prompt if isinstance(item, int)]
    if len(token_ids) == len(prompt):
        return token_ids
    only = prompt[0]
    if len(prompt) == 1 and not isinstance(only, int):
        return only  # a one-item batch: one string or one list of token ids
    raise ApiError(
        400,
        "Batched prompts are not supported: send one prompt (a string or a list of token ids) "
        "per request.",
        param="prompt",
    )


def admit_completion(
    req: CompletionRequest, request_id: str, default_max_tokens: int
) -> AdmitCompletion:
    """Validate what the schema cannot express and build the admission message."""
    if req.echo:
        raise ApiError(400, "echo is not supported.", param="echo")
    if req.best_of is not None and req.best_of != 1:
        raise ApiError(400, "Only best_of=1 is supported.", param="best_of")
    sampling = _sampling(
        req,
        max_tokens=req.max_tokens or default_max_tokens,
        logprobs=req.logprobs is not None,
        top_logprobs=req.logprobs or 0,
    )
    return AdmitCompletion(
        request_id=request_id,
        model=req.model,
        prompt=_prompt(req.prompt),
        sampling=sampling,
        unset=_unset(req),
        response_format=output_format(req.response_format),
        # Code completion between the prompt and the suffix (an empty suffix: none).
        suffix=req.suffix or None,
    )


# --- rendering events as OpenAI objects ----------------------------------------------------


def _usage(usage: Usage) -> UsageOut:
    return UsageOut(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
        completion_tokens_details=CompletionTokensDetails(
            reasoning_tokens=usage.reasoning_tokens
        ),
    )


def _whole_call(call: ToolCall) -> ToolCallOut:
    return ToolCallOut(
        id=call.id, type="function", function=FunctionOut(name=call.name, arguments=call.arguments)
    )


def _streamed_call(call: ToolCall) -> list[ToolCallOut]:
    """OpenAI's stream of one call: its id and name first, then its arguments."""
    return [
        ToolCallOut(index=call.index, id=call.id, type="function",
                    function=FunctionOut(name=call.name, arguments="")),
        ToolCallOut(index=call.index, function=FunctionOut(arguments=call.arguments)),
    ]


def _chat_logprobs(items: list[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            TokenLogprobOut(
                token=item.token,
                logprob=item.logprob,
                bytes=item.bytes,
                top_logprobs=[
                    TopLogprobOut(token=top.token, logprob=top.logprob, bytes=top.bytes)
                    for top in item.top_logprobs
                ],
            )
            for item in items
        ]
    )


def _legacy_logprobs(items: list[TokenLogprob], offset: int) -> CompletionLogprobs:
    """The legacy shape; ``offset`` is where the first token starts in the whole answer."""
    offsets = []
    for item in items:
        offsets.append(offset)
        offset += len(item.token)
    return CompletionLogprobs(
        tokens=[item.token for item in items],
        token_logprobs=[item.logprob for item in items],
        top_logprobs=[{top.token: top.logprob for top in item.top_logprobs} for item in items],
        text_offset=offsets,
    )


class _OpenAIRenderer(Renderer):
    """What chat and legacy completions share: ids, ``[DONE]``, the error event."""

    def __init__(
        self, req: SamplingRequest, msg: AdmitChat | AdmitCompletion, admitted: Admitted
    ) -> None:
        self.request_id = msg.request_id
        self.model = admitted.model
        self.logprobs = msg.sampling.logprobs
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.created = int(time.time())

    def _encode(
        self, kind: type[OpenAIObject], name: str, choices: list[Any], usage: UsageOut | None
    ) -> bytes:
        """A response object or chunk of this request; ``name`` is its ``object`` field."""
        return _encoder.encode(
            kind(
                id=self.request_id,
                object=name,
                created=self.created,
                model=self.model,
                choices=choices,
                usage=usage,
            )
        )

    def opening(self, first: RequestEvent) -> list[Frame]:
        return []

    def failure(self, error: ApiError) -> list[Frame]:
        return [(None, error.body()), DONE]

    def interrupted(self, error: ApiError, usage: Usage) -> list[Frame]:
        # include_usage promises a usage chunk before [DONE]: a stream cut short (the
        # shutdown, a failure) still sends one, counting the tokens so far.
        frames = [(None, self.usage_chunk(usage))] if self.include_usage else []
        return frames + self.failure(error)

    def closing(self, finished: RequestFinished) -> list[Frame]:
        frames = [(None, self.finish_chunk(finished))]
        if self.include_usage:
            frames.append((None, self.usage_chunk(finished.usage)))
        frames.append(DONE)
        return frames

    @abstractmethod
    def finish_chunk(self, finished: RequestFinished) -> bytes:
        """The last choice chunk, carrying the finish reason."""

    @abstractmethod
    def usage_chunk(self, usage: Usage) -> bytes:
        """The ``include_usage`` chunk: no choices, only usage."""


class _ChatRenderer(_OpenAIRenderer):
    def _chunk(self, choices: list[ChatChunkChoice], usage: UsageOut | None = None) -> bytes:
        return self._encode(ChatCompletionChunk, "chat.completion.chunk", choices, usage)

    def _choice(self, delta: Delta, logprobs: ChatLogprobs | None, finish: str | None) -> bytes:
        choice = ChatChunkChoice(index=0, delta=delta, logprobs=logprobs, finish_reason=finish)
        return self._chunk([choice])

    def opening(self, first: RequestEvent) -> list[Frame]:
        return [(None, self._choice(Delta(role="assistant", content=""), None, None))]

    def delta(self, event: TokensGenerated) -> list[Frame]:
        logprobs = _chat_logprobs(event.logprobs) if self.logprobs and event.logprobs else None
        frames: list[Frame] = []
        if event.reasoning:
            frames.append((None, self._choice(Delta(reasoning_content=event.reasoning), None,
                                              None)))
        if event.text or logprobs is not None:
            frames.append((None, self._choice(Delta(content=event.text), logprobs, None)))
        for call in event.tool_calls or ():
            frames.extend((None, self._choice(Delta(tool_calls=[part]), None, None))
                          for part in _streamed_call(call))
        return frames

    def finish_chunk(self, finished: RequestFinished) -> bytes:
        return self._choice(Delta(), None, finished.finish_reason)

    def usage_chunk(self, usage: Usage) -> bytes:
        return self._chunk([], _usage(usage))

    def whole(self, deltas: list[TokensGenerated], finished: RequestFinished) -> bytes:
        logprobs = [item for event in deltas for item in event.logprobs or ()]
        calls = [_whole_call(call) for event in deltas for call in event.tool_calls or ()]
        text = "".join(event.text for event in deltas)
        reasoning = "".join(event.reasoning for event in deltas)
        choice = ChatChoice(
            index=0,
            message=AssistantMessage(
                role="assistant",
                content=text if text or not calls else None,
                reasoning_content=reasoning or None,
                tool_calls=calls or None,
            ),
            logprobs=_chat_logprobs(logprobs) if self.logprobs else None,
            finish_reason=finished.finish_reason,
        )
        return self._encode(ChatCompletion, "chat.completion", [choice], _usage(finished.usage))


class _CompletionRenderer(_OpenAIRenderer):
    def __init__(self, req: CompletionRequest, msg: AdmitCompletion, admitted: Admitted) -> None:
        super().__init__(req, msg, admitted)
        self._text_offset = 0  # legacy logprobs count characters across the whole answer

    def _chunk(self, choices: list[CompletionChoice], usage: UsageOut | None = None) -> bytes:
        return self._encode(Completion, "text_completion", choices, usage)

    def delta(self, event: TokensGenerated) -> list[Frame]:
        logprobs = None
        if self.logprobs and event.logprobs:
            logprobs = _legacy_logprobs(event.logprobs, self._text_offset)
            self._text_offset += sum(len(item.token) for item in event.logprobs)
        if not event.text and logprobs is None:
            return []
        choice = CompletionChoice(index=0, text=event.text, logprobs=logprobs, finish_reason=None)
        return [(None, self._chunk([choice]))]

    def finish_chunk(self, finished: RequestFinished) -> bytes:
        choice = CompletionChoice(
            index=0, text="", logprobs=None, finish_reason=finished.finish_reason
        )
        return self._chunk([choice])

    def usage_chunk(self, usage: Usage) -> bytes:
        return self._chunk([], _usage(usage))

    def whole(self, deltas: list[TokensGenerated], finished: RequestFinished) -> bytes:
        logprobs = [item for event in deltas for item in event.logprobs or ()]
        choice = CompletionChoice(
            index=0,
            text="".join(event.text for event in deltas),
            logprobs=_legacy_logprobs(logprobs, 0) if self.logprobs else None,
            finish_reason=finished.finish_reason,
        )
        return self._chunk([choice], _usage(finished.usage))


# --- routes --------------------------------------------------------------------------------


class OpenAIRoutes:
    """The OpenAI-compatible routes, answering through the admission actor."""

    def __init__(self, admission: ActorRef, config: ServeConfig) -> None:
        self.admission = admission
        self.config = config
        self.images = ImageInput(config)
        # ModelCard has no creation time; the server's start stands in for it.
        self.created = int(time.time())

    def register(self, router: web.UrlDispatcher) -> None:
        """Add the routes to an application's router."""
        router.add_post("/v1/chat/completions", self.chat_completions)
        router.add_post("/v1/completions", self.completions)
        router.add_get("/v1/models", self.models)
        # Hugging Face repo ids hold a slash: the id is the rest of the path.
        router.add_get("/v1/models/{model:.+}", self.model)

    @generation
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions``."""
        admit = partial(admit_chat, default_max_tokens=self.config.default_max_tokens)
        return await generate(
            request, self.admission, _chat_decoder, "chatcmpl-", admit, _ChatRenderer,
            self.images,
        )

    @generation
    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions``."""
        admit = partial(admit_completion, default_max_tokens=self.config.default_max_tokens)
        return await generate(
            request, self.admission, _completion_decoder, "cmpl-", admit, _CompletionRenderer
        )

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: the served models, then one entry per alias name; in
        Anthropic's shape for a client that sends ``anthropic-version`` (its SDK does)."""
        cards: list[ModelCard] = await ask_admission(self.admission, ListModels())
        if _anthropic(request):
            data = [self._anthropic_model(card) for card in cards]
            body = _encoder.encode(AnthropicModelList(
                data=data, has_more=False, first_id=data[0].id if data else None,
                last_id=data[-1].id if data else None))
        else:
            body = _encoder.encode(ModelList(object="list",
                                             data=[self._model(card) for card in cards]))
        return web.Response(body=body, content_type="application/json")

    async def model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{model}``: the model a request naming it gets (a 404 as a request
        naming it would get one), in OpenAI's shape or Anthropic's."""
        name = request.match_info["model"]
        card: ModelCard = await ask_admission(self.admission, DescribeModel(name=name))
        found = self._anthropic_model(card) if _anthropic(request) else self._model(card)
        return web.Response(body=_encoder.encode(found), content_type="application/json")

    def _model(self, card: ModelCard) -> ModelObject:
        return ModelObject(id=card.id, object="model", created=self.created,
                           owned_by="mlx-troupe", root=card.alias_of or card.id,
                           max_model_len=card.context_length,
                           sampling_defaults=card.sampling_defaults
                           if card.sampling_defaults != SamplingDefaults() else None,
                           task=card.task if card.task != "generate" else None)

    def _anthropic_model(self, card: ModelCard) -> AnthropicModel:
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created))
        return AnthropicModel(type="model", id=card.id, display_name=card.id,
                              created_at=created, lifecycle="active",
                              max_input_tokens=card.context_length,
                              max_tokens=card.context_length)


def _anthropic(request: web.Request) -> bool:
    """Whether the client speaks Anthropic's API (its SDK sends this header every time)."""
    return "anthropic-version" in request.headers
