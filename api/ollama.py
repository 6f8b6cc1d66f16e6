"""Ollama's API: ``/api/chat``, ``/api/generate``, ``/api/embed`` (and the older
``/api/embeddings``), ``/api/tags``, ``/api/show``, ``/api/ps`` and ``/api/version``.

Many desktop clients and editor plugins speak only this API. A chat becomes the same admission
message as an OpenAI chat request (images as image parts, tool calls as OpenAI's, ``format``
as a JSON constraint, ``think`` as the template's ``enable_thinking``), so one conversation
gets the same prompt tokens through any of the APIs. Answers follow Ollama's shapes: streamed
by default as newline-delimited JSON, the last object ``done`` with its counts and durations
(nanoseconds), the reasoning in ``thinking``, errors as ``{"error": "..."}``.
"""

from __future__ import annotations

import json
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from aiohttp import web
from msgspec import Meta

from troupe.actors.config import ServeConfig
from troupe.actors.images import image_part
from troupe.actors.messages import (
    AdmitChat,
    AdmitCompletion,
    AdmitEmbed,
    Admitted,
    DescribeModel,
    ListModels,
    ModelCard,
    OutputFormat,
    RequestEvent,
    RequestFinished,
    SamplingParams,
    TokensGenerated,
    ToolCall,
    ToolChoice,
    unset_sampling,
)
from troupe.api.cache_namespace import CacheSalt
from troupe.api.decode import decode_body
from troupe.api.embeddings import ask_embedding, shortened
from troupe.api.errors import ApiError, ask_admission
from troupe.api.generation import Renderer
from troupe.api.generation_route import generate
from troupe.api.images import ImageInput
from troupe.api.shutdown import generation
from troupe.api.sse import Frame
from troupe.api.stops import stop_sequences
from troupe.api.telemetry import RECORD
from troupe.runtime import ActorRef

# The Ollama release whose API these routes follow (clients compare it against the versions
# that brought the features they use: tools, thinking, structured outputs).
OLLAMA_VERSION = "0.12.6"

# --- request schemas -----------------------------------------------------------------------


class OllamaOptions(msgspec.Struct, kw_only=True):
    """A request's ``options``: the sampling ones apply; ``num_ctx``, ``num_gpu`` and the
    other load-time settings are the server's to choose and are ignored."""

    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    seed: int | None = None
    # Ollama's -1 (until the end) and -2 (fill the context) both leave it to the server.
    num_predict: Annotated[int, Meta(ge=-2)] | None = None
    stop: str | list[str] | None = None
    repeat_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None


class OllamaFunctionCall(msgspec.Struct, kw_only=True):
    name: str
    # An object in Ollama's API; some clients send OpenAI's JSON text instead.
    arguments: dict[str, Any] | str = {}


class OllamaToolCallIn(msgspec.Struct, kw_only=True):
    """An assistant message's tool call, as the client sends it back."""

    function: OllamaFunctionCall
    id: str | None = None


class OllamaMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    # Base64 image files (no data-URL prefix), read with the message's text.
    images: list[str] | None = None
    tool_calls: list[OllamaToolCallIn] | None = None
    thinking: str | None = None  # an earlier answer's reasoning: not sent to the model again
    tool_name: str | None = None  # a tool message's tool
    tool_call_id: str | None = None


class OllamaGenerationFields(msgspec.Struct, kw_only=True):
    """What ``/api/chat`` and ``/api/generate`` share. Unknown fields are ignored."""

    model: str
    options: OllamaOptions | None = None
    # "json" (a JSON object, as Ollama's JSON mode gives), or a JSON Schema the answer obeys.
    format: str | dict[str, Any] | None = None
    stream: bool = True
    # Whether the model thinks first (its template's ``enable_thinking``); "low", "medium"
    # or "high" for the models that take a reasoning effort.
    think: bool | Literal["low", "medium", "high"] | None = None
    keep_alive: str | int | float | None = None  # models stay loaded: ignored
    cache_salt: CacheSalt | None = None
    # Each answer token's log probability, and this many of the likeliest beside it.
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None


class OllamaChatRequest(OllamaGenerationFields, kw_only=True):
    """The body of ``POST /api/chat``."""

    messages: list[OllamaMessage] = []
    tools: list[dict[str, Any]] | None = None


class OllamaGenerateRequest(OllamaGenerationFields, kw_only=True):
    """The body of ``POST /api/generate``."""

    prompt: str = ""
    system: str | None = None
    images: list[str] | None = None
    # The prompt as it is, without the chat template.
    raw: bool = False
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None


class OllamaEmbedRequest(msgspec.Struct, kw_only=True):
    """The body of ``POST /api/embed``."""

    model: str
    input: str | Annotated[list[str], Meta(min_length=1)]
    truncate: bool = True
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    options: OllamaOptions | None = None
    keep_alive: str | int | float | None = None


class OllamaEmbeddingsRequest(msgspec.Struct, kw_only=True):
    """The body of the older ``POST /api/embeddings``: one text."""

    model: str
    prompt: str
    options: OllamaOptions | None = None
    keep_alive: str | int | float | None = None


class OllamaShowRequest(msgspec.Struct, kw_only=True):
    """The body of ``POST /api/show`` (``name``: older clients' spelling of ``model``)."""

    model: str | None = None
    name: str | None = None
    verbose: bool | None = None


# --- response schemas ----------------------------------------------------------------------


class OllamaFunctionOut(msgspec.Struct, kw_only=True):
    index: int
    name: str
    arguments: dict[str, Any]


class OllamaToolCallOut(msgspec.Struct, kw_only=True):
    id: str
    function: OllamaFunctionOut


class OllamaMessageOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str
    content: str
    thinking: str | None = None
    tool_calls: list[OllamaToolCallOut] | None = None


class OllamaTokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class OllamaLogprob(OllamaTokenLogprob, kw_only=True):
    top_logprobs: list[OllamaTokenLogprob]


class OllamaStats(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a finished answer adds: why it ended, its token counts and its times (ns)."""

    done_reason: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class OllamaChatChunk(OllamaStats, kw_only=True, omit_defaults=True):
    """One object of ``/api/chat``'s answer: a delta, or (``done``) the whole or the last."""

    model: str
    created_at: str
    message: OllamaMessageOut
    done: bool
    logprobs: list[OllamaLogprob] | None = None


class OllamaGenerateChunk(OllamaStats, kw_only=True, omit_defaults=True):
    """One object of ``/api/generate``'s answer."""

    model: str
    created_at: str
    response: str
    thinking: str | None = None
    done: bool
    logprobs: list[OllamaLogprob] | None = None


class OllamaEmbedResponse(msgspec.Struct, kw_only=True):
    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int
    prompt_eval_count: int


class OllamaEmbeddingsResponse(msgspec.Struct, kw_only=True):
    embedding: list[float]


class OllamaModelDetails(msgspec.Struct, kw_only=True):
    parent_model: str
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str


class OllamaModelEntry(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A model in ``/api/tags`` and ``/api/ps``."""

    name: str
    model: str
    modified_at: str | None = None
    size: int
    digest: str
    details: OllamaModelDetails
    expires_at: str | None = None  # /api/ps: served models stay loaded
    size_vram: int | None = None
    context_length: int | None = None


class OllamaModelsResponse(msgspec.Struct, kw_only=True):
    models: list[OllamaModelEntry]


class OllamaShowResponse(msgspec.Struct, kw_only=True):
    license: str
    modelfile: str
    parameters: str
    template: str
    details: OllamaModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class OllamaVersionResponse(msgspec.Struct, kw_only=True):
    version: str


_chat_decoder = msgspec.json.Decoder(OllamaChatRequest)
_generate_decoder = msgspec.json.Decoder(OllamaGenerateRequest)
_embed_decoder = msgspec.json.Decoder(OllamaEmbedRequest)
_embeddings_decoder = msgspec.json.Decoder(OllamaEmbeddingsRequest)
_show_decoder = msgspec.json.Decoder(OllamaShowRequest)
_encoder = msgspec.json.Encoder()

# --- requests as admission messages -------------------------------------------------------


def served_name(model: str) -> str:
    """The served model an Ollama name means: Ollama's names carry a tag, and a name without
    one means ``:latest``, so a client that adds ``:latest`` to a name it was given gets the
    model of that name."""
    return model.removesuffix(":latest")


def _sampling(req: OllamaGenerationFields, default_max_tokens: int
              ) -> tuple[SamplingParams, tuple[str, ...]]:
    """The request's sampling, and the fields it left to the model's defaults."""
    if req.top_logprobs and not req.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs to be true.", param="top_logprobs")
    o = req.options or OllamaOptions()
    stop = [o.stop] if isinstance(o.stop, str) else list(o.stop or [])
    sent = {"temperature": o.temperature, "top_p": o.top_p, "top_k": o.top_k, "min_p": o.min_p,
            "repetition_penalty": o.repeat_penalty}
    fields = {**sent, "seed": o.seed, "presence_penalty": o.presence_penalty,
              "frequency_penalty": o.frequency_penalty}
    if o.num_predict == 0:
        raise ApiError(400, "options.num_predict must not be 0.", param="options.num_predict")
    max_tokens = o.num_predict if o.num_predict and o.num_predict > 0 else default_max_tokens
    sampling = SamplingParams(
        max_tokens=max_tokens,
        stop=stop_sequences(stop, "options.stop"),
        logprobs=bool(req.logprobs),
        top_logprobs=req.top_logprobs or 0,
        **{name: value for name, value in fields.items() if value is not None},
    )
    return sampling, unset_sampling(sent)


def _format(fmt: str | dict[str, Any] | None) -> OutputFormat | None:
    """``format``: "json" for a JSON object, or a JSON Schema."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return OutputFormat(type="json_object")
    if isinstance(fmt, dict):
        return OutputFormat(type="json_schema", schema=fmt)
    raise ApiError(400, f"format '{fmt}' is not supported: send \"json\" or a JSON Schema "
                   "object.", param="format")


def _think(think: bool | str | None) -> dict[str, Any] | None:
    """The chat template's arguments for ``think`` (None: the template's own default)."""
    if think is None:
        return None
    if isinstance(think, str):
        return {"enable_thinking": True, "reasoning_effort": think}
    return {"enable_thinking": think}


def _images(images: list[str] | None, param: str) -> list[dict[str, Any]]:
    """Base64 image files as image parts (their type is read from the bytes)."""
    parts = []
    for j, data in enumerate(images or []):
        # Some clients send a data URL where Ollama's API has bare base64.
        if data.startswith("data:") and "," in data:
            data = data.partition(",")[2]
        parts.append(image_part(data, None, f"{param}[{j}]"))
    return parts


def _content(text: str, images: list[str] | None, param: str) -> str | list[dict[str, Any]]:
    """A message's text, with its images (``param``) before it, as Ollama places them."""
    parts = _images(images, param)
    if not parts:
        return text
    return [*parts, {"type": "text", "text": text}] if text else parts


def _arguments(arguments: dict[str, Any] | str, param: str) -> dict[str, Any]:
    """A tool call's arguments as the object chat templates read."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = msgspec.json.decode(arguments or "{}")
    except msgspec.DecodeError:
        value = None
    if not isinstance(value, dict):
        raise ApiError(400, "A tool call's arguments must be an object (or its JSON text).",
                       param=param)
    return value


def _template_message(message: OllamaMessage, index: int, ids: list[str]) -> dict[str, Any]:
    """One message as chat templates read it; ``ids`` the calls made so far, in order, so a
    tool message without an id answers the earliest call not yet answered."""
    param = f"messages[{index}]"
    if message.images and message.role not in ("user", "tool"):
        raise ApiError(400, "Only user and tool messages can hold images.",
                       param=f"{param}.images")
    out: dict[str, Any] = {"role": message.role,
                           "content": _content(message.content, message.images,
                                               f"{param}.images")}
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            call_id = call.id or f"call_{uuid.uuid4().hex[:24]}"
            ids.append(call_id)
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": call.function.name,
                                       "arguments": _arguments(call.function.arguments,
                                                               f"{param}.tool_calls")}})
        out["tool_calls"] = calls
    if message.role == "tool":
        call_id = message.tool_call_id or (ids.pop(0) if ids else None)
        if message.tool_call_id in ids:
            ids.remove(message.tool_call_id)
        if call_id is not None:
            out["tool_call_id"] = call_id
        if message.tool_name is not None:
            out["name"] = message.tool_name
    return out


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    for i, tool in enumerate(tools or []):
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise ApiError(400, "A tool must be {\"type\": \"function\", \"function\": "
                           "{\"name\": ..., \"parameters\": ...}}.", param=f"tools[{i}]")
    return [{"type": "function", **tool} for tool in tools] if tools else None


def admit_chat(req: OllamaChatRequest, request_id: str, default_max_tokens: int) -> AdmitChat:
    """Validate what the schema cannot express and build the admission message."""
    if not req.messages:
        raise ApiError(400, "messages must not be empty (an empty chat only loads a model, "
                       "and models here are loaded when they are served).", param="messages")
    sampling, unset = _sampling(req, default_max_tokens)
    ids: list[str] = []
    messages = [_template_message(m, i, ids) for i, m in enumerate(req.messages)]
    return AdmitChat(
        request_id=request_id,
        model=served_name(req.model),
        messages=messages,
        sampling=sampling,
        unset=unset,
        tools=_tools(req.tools),
        chat_template_kwargs=_think(req.think),
        tool_choice=ToolChoice(),
        response_format=_format(req.format),
    )


def admit_generate(req: OllamaGenerateRequest, request_id: str, default_max_tokens: int
                   ) -> AdmitChat | AdmitCompletion:
    """``/api/generate``: the prompt through the chat template (a system message first when
    given), or as it is with ``raw``."""
    if not req.prompt and not req.images:
        raise ApiError(400, "prompt must not be empty (an empty prompt only loads a model, and "
                       "models here are loaded when they are served).", param="prompt")
    for name in ("template", "context"):
        if getattr(req, name):
            raise ApiError(400, f"'{name}' is not supported here.", param=name)
    sampling, unset = _sampling(req, default_max_tokens)
    if req.suffix:
        # Code completion: the model's fill-in-the-middle tokens, not its chat template.
        if req.images:
            raise ApiError(400, "A prompt with a suffix cannot hold images.", param="images")
        return AdmitCompletion(request_id=request_id, model=served_name(req.model),
                               prompt=req.prompt, suffix=req.suffix, sampling=sampling,
                               unset=unset, response_format=_format(req.format))
    if req.raw:
        if req.images:
            raise ApiError(400, "A raw prompt cannot hold images.", param="images")
        return AdmitCompletion(request_id=request_id, model=served_name(req.model),
                               prompt=req.prompt,
                               sampling=sampling, unset=unset,
                               response_format=_format(req.format))
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": req.system})
    messages.append({"role": "user", "content": _content(req.prompt, req.images, "images")})
    return AdmitChat(request_id=request_id, model=served_name(req.model), messages=messages,
                     sampling=sampling, unset=unset, chat_template_kwargs=_think(req.think),
                     response_format=_format(req.format))


# --- rendering events as Ollama's objects --------------------------------------------------


def _now() -> str:
    """The time as Ollama writes ``created_at`` (RFC 3339, UTC)."""
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


def _logprobs(events: list[TokensGenerated]) -> list[OllamaLogprob] | None:
    """The deltas' token log probabilities (None: not asked for)."""
    items = [item for event in events for item in event.logprobs or ()]
    if not items:
        return None
    return [OllamaLogprob(token=i.token, logprob=i.logprob, bytes=i.bytes,
                          top_logprobs=[OllamaTokenLogprob(token=t.token, logprob=t.logprob,
                                                           bytes=t.bytes)
                                        for t in i.top_logprobs])
            for i in items]


def _call(call: ToolCall) -> OllamaToolCallOut:
    """A tool call with its arguments as an object (Ollama's), not JSON text (OpenAI's)."""
    try:
        arguments = msgspec.json.decode(call.arguments or "{}")
    except msgspec.DecodeError:
        arguments = {}
    return OllamaToolCallOut(id=call.id, function=OllamaFunctionOut(
        index=call.index, name=call.name,
        arguments=arguments if isinstance(arguments, dict) else {}))


class _OllamaRenderer(Renderer):
    """A request's events as Ollama's objects: one per line when streamed."""

    ndjson = True

    def __init__(self, model: str) -> None:
        self.model = model
        self.started = time.monotonic_ns()

    def _stats(self, finished: RequestFinished) -> dict[str, Any]:
        total = time.monotonic_ns() - self.started
        ttft = int((finished.ttft_s or 0.0) * 1e9)
        usage = finished.usage
        return {
            # Ollama says "stop" for an answer that ended by calling tools too.
            "done_reason": "length" if finished.finish_reason == "length" else "stop",
            "total_duration": total, "load_duration": 0,
            "prompt_eval_count": usage.prompt_tokens, "prompt_eval_duration": min(ttft, total),
            "eval_count": usage.completion_tokens, "eval_duration": max(0, total - ttft),
        }

    def opening(self, first: RequestEvent) -> list[Frame]:
        return []

    def failure(self, error: ApiError) -> list[Frame]:
        return [(None, error.body("ollama"))]


class _ChatRenderer(_OllamaRenderer):
    def _chunk(self, message: OllamaMessageOut, done: bool, **stats: Any) -> bytes:
        return _encoder.encode(OllamaChatChunk(model=self.model, created_at=_now(),
                                               message=message, done=done, **stats))

    def delta(self, event: TokensGenerated) -> list[Frame]:
        if not (event.text or event.reasoning or event.tool_calls or event.logprobs):
            return []
        message = OllamaMessageOut(role="assistant", content=event.text,
                                   thinking=event.reasoning or None,
                                   tool_calls=[_call(c) for c in event.tool_calls or []] or None)
        return [(None, self._chunk(message, False, logprobs=_logprobs([event])))]

    def closing(self, finished: RequestFinished) -> list[Frame]:
        message = OllamaMessageOut(role="assistant", content="")
        return [(None, self._chunk(message, True, **self._stats(finished)))]

    def whole(self, deltas: list[TokensGenerated], finished: RequestFinished) -> bytes:
        calls = [_call(c) for event in deltas for c in event.tool_calls or []]
        message = OllamaMessageOut(role="assistant", content="".join(e.text for e in deltas),
                                   thinking="".join(e.reasoning for e in deltas) or None,
                                   tool_calls=calls or None)
        return self._chunk(message, True, logprobs=_logprobs(deltas), **self._stats(finished))


class _GenerateRenderer(_OllamaRenderer):
    def _chunk(self, text: str, thinking: str, done: bool, **stats: Any) -> bytes:
        return _encoder.encode(OllamaGenerateChunk(
            model=self.model, created_at=_now(), response=text, thinking=thinking or None,
            done=done, **stats))

    def delta(self, event: TokensGenerated) -> list[Frame]:
        if not (event.text or event.reasoning or event.logprobs):
            return []
        return [(None, self._chunk(event.text, event.reasoning, False,
                                   logprobs=_logprobs([event])))]

    def closing(self, finished: RequestFinished) -> list[Frame]:
        return [(None, self._chunk("", "", True, **self._stats(finished)))]

    def whole(self, deltas: list[TokensGenerated], finished: RequestFinished) -> bytes:
        return self._chunk("".join(e.text for e in deltas), "".join(e.reasoning for e in deltas),
                           True, logprobs=_logprobs(deltas), **self._stats(finished))


def _chat_renderer(req: OllamaChatRequest, msg: AdmitChat, admitted: Admitted) -> Renderer:
    return _ChatRenderer(admitted.model)


def _generate_renderer(req: OllamaGenerateRequest, msg: AdmitChat | AdmitCompletion,
                       admitted: Admitted) -> Renderer:
    return _GenerateRenderer(admitted.model)


# --- what the model directory tells ----------------------------------------------------------


class _Facts(msgspec.Struct, kw_only=True):
    """What ``/api/tags`` and ``/api/show`` say of a model, read from its directory."""

    size: int
    modified_at: str
    details: OllamaModelDetails
    config: dict[str, Any]
    template: str


def _size(parameters: int | None) -> str:
    """A parameter count as Ollama writes one: 494.03M, 7.6B."""
    if not parameters:
        return ""
    if parameters >= 10**9:
        return f"{parameters / 1e9:.1f}B"
    return f"{parameters / 1e6:.2f}M"


def _facts(card: ModelCard) -> _Facts:
    path = Path(card.path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    files = [f for f in path.glob("*.safetensors") if f.is_file()] if path.is_dir() else []
    size = sum(f.stat().st_size for f in files)
    mtime = max((f.stat().st_mtime for f in files), default=time.time())
    family = str(config.get("model_type") or "unknown")
    bits = (config.get("quantization") or {}).get("bits") if isinstance(
        config.get("quantization"), dict) else None
    dtype = str(config.get("torch_dtype") or (config.get("text_config") or {}).get(
        "torch_dtype") or "")
    template = ""
    try:
        tok_config = json.loads((path / "tokenizer_config.json").read_text())
        chat_template = tok_config.get("chat_template")
        template = chat_template if isinstance(chat_template, str) else ""
    except (OSError, ValueError):
        pass
    if not template and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    details = OllamaModelDetails(
        parent_model="", format="mlx", family=family, families=[family],
        parameter_size=_size(card.parameters),
        quantization_level=f"Q{bits}" if bits else dtype.upper().replace("BFLOAT", "BF")
        .replace("FLOAT", "F"))
    modified = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(mtime))
    return _Facts(size=size, modified_at=modified, details=details, config=config,
                  template=template)


# --- routes --------------------------------------------------------------------------------


class OllamaRoutes:
    """Ollama's API, answering through the admission actor."""

    def __init__(self, admission: ActorRef, config: ServeConfig) -> None:
        self.admission = admission
        self.config = config
        self.images = ImageInput(config)

    def register(self, router: web.UrlDispatcher) -> None:
        """Add the routes to an application's router."""
        router.add_post("/api/chat", self.chat)
        router.add_post("/api/generate", self.generate)
        router.add_post("/api/embed", self.embed)
        router.add_post("/api/embeddings", self.embeddings)
        router.add_get("/api/tags", self.tags)
        router.add_get("/api/ps", self.ps)
        router.add_post("/api/show", self.show)
        router.add_get("/api/version", self.version)

    @generation
    async def chat(self, request: web.Request) -> web.StreamResponse:
        """``POST /api/chat``."""
        admit = partial(admit_chat, default_max_tokens=self.config.default_max_tokens)
        return await generate(request, self.admission, _chat_decoder, "chat-", admit,
                              _chat_renderer, self.images)

    @generation
    async def generate(self, request: web.Request) -> web.StreamResponse:
        """``POST /api/generate``."""
        admit = partial(admit_generate, default_max_tokens=self.config.default_max_tokens)
        return await generate(request, self.admission, _generate_decoder, "gen-", admit,
                              _generate_renderer, self.images)

    async def _embed(self, request: web.Request, model: str, inputs: list[str],
                     truncate: bool) -> tuple[str, list[list[float]], int]:
        request_id = f"embd-{uuid.uuid4().hex}"
        request[RECORD].request_id, request[RECORD].model = request_id, model
        answer = await ask_embedding(self.admission, AdmitEmbed(
            request_id=request_id, model=model, inputs=list(inputs), truncate=truncate))
        return answer.model, answer.results, answer.prompt_tokens

    @generation
    async def embed(self, request: web.Request) -> web.Response:
        """``POST /api/embed``: one unit vector per input."""
        started = time.monotonic_ns()
        req = decode_body(await request.read(), _embed_decoder)
        inputs = [req.input] if isinstance(req.input, str) else req.input
        model, vectors, tokens = await self._embed(request, served_name(req.model), inputs,
                                                   req.truncate)
        vectors = shortened(vectors, req.dimensions)
        body = OllamaEmbedResponse(model=model, embeddings=vectors,
                                   total_duration=time.monotonic_ns() - started,
                                   load_duration=0, prompt_eval_count=tokens)
        return web.Response(body=_encoder.encode(body), content_type="application/json")

    @generation
    async def embeddings(self, request: web.Request) -> web.Response:
        """``POST /api/embeddings`` (Ollama's older route): one text's vector."""
        req = decode_body(await request.read(), _embeddings_decoder)
        _, vectors, _ = await self._embed(request, served_name(req.model), [req.prompt], True)
        body = OllamaEmbeddingsResponse(embedding=vectors[0])
        return web.Response(body=_encoder.encode(body), content_type="application/json")

    async def _entries(self, loaded: bool) -> list[OllamaModelEntry]:
        """The served models (``loaded``: those in memory now)."""
        cards: list[ModelCard] = await ask_admission(self.admission, ListModels())
        entries = []
        for card in cards:
            if loaded and card.loaded is False:
                continue
            facts = _facts(card)
            entries.append(OllamaModelEntry(
                name=card.id, model=card.id, size=facts.size,
                digest=card.fingerprint or card.id, details=facts.details,
                modified_at=None if loaded else facts.modified_at,
                # A loaded model stays until memory is wanted for another: the far date
                # Ollama writes for a model kept loaded for good.
                expires_at="2318-01-01T00:00:00Z" if loaded else None,
                size_vram=facts.size if loaded else None,
                context_length=card.context_length if loaded else None))
        return entries

    async def tags(self, request: web.Request) -> web.Response:
        """``GET /api/tags``: the served models (aliases included)."""
        body = OllamaModelsResponse(models=await self._entries(loaded=False))
        return web.Response(body=_encoder.encode(body), content_type="application/json")

    async def ps(self, request: web.Request) -> web.Response:
        """``GET /api/ps``: the served models in memory now."""
        body = OllamaModelsResponse(models=await self._entries(loaded=True))
        return web.Response(body=_encoder.encode(body), content_type="application/json")

    async def show(self, request: web.Request) -> web.Response:
        """``POST /api/show``: a model's details, context length and capabilities."""
        req = decode_body(await request.read(), _show_decoder)
        name = served_name(req.model or req.name or "")
        if not name:
            raise ApiError(400, "'model' names the model to show.", param="model")
        card: ModelCard = await ask_admission(self.admission, DescribeModel(name=name))
        facts = _facts(card)
        text = facts.config.get("text_config") or facts.config
        family = facts.details.family
        info: dict[str, Any] = {"general.architecture": family,
                                f"{family}.context_length": card.context_length}
        if card.parameters:
            info["general.parameter_count"] = card.parameters
        for key, name_ in (("hidden_size", "embedding_length"),
                           ("num_hidden_layers", "block_count"),
                           ("num_attention_heads", "attention.head_count"),
                           ("num_key_value_heads", "attention.head_count_kv")):
            if isinstance(text.get(key), int):
                info[f"{family}.{name_}"] = text[key]
        body = OllamaShowResponse(license="", modelfile="", parameters="",
                                  template=facts.template, details=facts.details,
                                  model_info=info, capabilities=list(card.capabilities),
                                  modified_at=facts.modified_at)
        return web.Response(body=_encoder.encode(body), content_type="application/json")

    async def version(self, request: web.Request) -> web.Response:
        """``GET /api/version``: the Ollama release whose API is followed here."""
        body = OllamaVersionResponse(version=OLLAMA_VERSION)
        return web.Response(body=_encoder.encode(body), content_type="application/json")
