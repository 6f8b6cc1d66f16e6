"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A Messages request becomes the same admission message as an OpenAI chat request (system
prompt first, text blocks joined by newlines, image blocks as image parts (``api.images``),
``tool_use``/``tool_result`` blocks as OpenAI tool calls and tool messages, tools as OpenAI
functions), so one conversation gets the same prompt tokens through either API.
``tool_choice``, ``thinking`` and a JSON output format map onto the neutral ``ToolChoice``,
thinking budget and ``OutputFormat`` of ``AdmitChat``.
Answers and streams follow Anthropic's shapes exactly: thinking, text and ``tool_use``
content blocks, each streamed as its own block once its first content arrives.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

import msgspec
from aiohttp import web
from msgspec import Meta

from troupe.actors.config import ServeConfig
from troupe.actors.images import image_part
from troupe.actors.messages import (
    AdmitChat,
    Admitted,
    CountTokens,
    OutputFormat,
    RequestEvent,
    RequestFinished,
    RequestStarted,
    SamplingParams,
    TokensGenerated,
    ToolCall,
    ToolChoice,
    unset_sampling,
)
from troupe.api.cache_namespace import CacheSalt
from troupe.api.decode import decode_body
from troupe.api.errors import ApiError, ask_admission, why_unsupported
from troupe.api.generation import Renderer
from troupe.api.generation_route import generate
from troupe.api.images import ImageInput, content, media_type, url_image
from troupe.api.shutdown import generation
from troupe.api.sse import Frame
from troupe.api.stops import stop_sequences
from troupe.api.telemetry import RECORD
from troupe.runtime import ActorRef

log = logging.getLogger(__name__)

# --- request schemas -----------------------------------------------------------------------


class ImageSource(msgspec.Struct, kw_only=True):
    """An image block's ``source``: ``base64`` (``media_type``, ``data``) or ``url``."""

    type: str
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ContentBlock(msgspec.Struct, kw_only=True):
    """Any content block; ``type`` says which fields apply (text, image, tool_use...)."""

    # A plain string, so a document block gets a clear refusal rather than a schema error.
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[ContentBlock] | None = None  # a tool_result's content
    is_error: bool | None = None
    source: ImageSource | None = None  # an image's


class InputMessage(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    # Required for client tools; checked by hand so a server tool gets its own refusal.
    input_schema: dict[str, Any] | None = None
    # Absent or "custom" for client tools; Anthropic's server tools name a versioned type.
    type: str | None = None


class ToolChoiceParam(msgspec.Struct, kw_only=True):
    """The request's ``tool_choice``."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingParam(msgspec.Struct, kw_only=True):
    """The request's ``thinking``: ``enabled`` (with a budget), ``adaptive`` or ``disabled``."""

    type: Literal["enabled", "disabled", "adaptive"]
    # Anthropic asks for at least 1024; a local model may well think usefully in fewer.
    budget_tokens: Annotated[int, Meta(ge=1)] | None = None


class JsonOutputFormat(msgspec.Struct, kw_only=True):
    """A structured-output format: the answer's text is JSON valid against ``schema``."""

    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, kw_only=True):
    """The request's ``output_config`` (``effort`` and the like are ignored)."""

    format: JsonOutputFormat | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True):
    """The body of ``POST /v1/messages/count_tokens``. Unknown fields are ignored."""

    model: str
    messages: Annotated[list[InputMessage], Meta(min_length=1)]
    system: str | list[ContentBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoiceParam | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    """The body of ``POST /v1/messages``. Unknown fields (``metadata``...) are ignored."""

    max_tokens: Annotated[int, Meta(ge=1)]
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    # An extension: false turns speculative decoding off for this request.
    speculative: bool | None = None
    stream: bool | None = None
    thinking: ThinkingParam | None = None
    # Structured outputs: ``output_config.format`` today, top-level ``output_format`` in beta.
    output_config: OutputConfig | None = None
    output_format: JsonOutputFormat | None = None
    cache_salt: CacheSalt | None = None


# --- response schemas ----------------------------------------------------------------------
# Blocks and deltas are tagged structs: msgspec writes their ``type`` first, as Anthropic does.


class TextBlock(msgspec.Struct, kw_only=True, tag="text"):
    text: str


class ThinkingBlock(msgspec.Struct, kw_only=True, tag="thinking"):
    thinking: str
    # Anthropic signs its thinking so it can be verified when sent back; nothing to sign here.
    signature: str = ""


class ToolUseBlock(msgspec.Struct, kw_only=True, tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


class TextDelta(msgspec.Struct, kw_only=True, tag="text_delta"):
    text: str


class ThinkingDelta(msgspec.Struct, kw_only=True, tag="thinking_delta"):
    thinking: str


class SignatureDelta(msgspec.Struct, kw_only=True, tag="signature_delta"):
    signature: str


class InputJsonDelta(msgspec.Struct, kw_only=True, tag="input_json_delta"):
    partial_json: str


OutputBlock = TextBlock | ThinkingBlock | ToolUseBlock
BlockDelta = TextDelta | ThinkingDelta | SignatureDelta | InputJsonDelta


class MessageUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int


class Message(msgspec.Struct, kw_only=True):
    id: str
    type: str
    role: str
    model: str
    content: list[OutputBlock]
    stop_reason: str | None
    stop_sequence: str | None
    usage: MessageUsage


class MessageStart(msgspec.Struct, kw_only=True):
    type: str
    message: Message


class ContentBlockEvent(msgspec.Struct, kw_only=True):
    """An event about one content block: content_block_stop as it is; start and delta add."""

    type: str
    index: int


class ContentBlockStart(ContentBlockEvent, kw_only=True):
    content_block: OutputBlock


class ContentBlockDelta(ContentBlockEvent, kw_only=True):
    delta: BlockDelta


class StopDelta(msgspec.Struct, kw_only=True):
    stop_reason: str
    stop_sequence: str | None


class OutputUsage(msgspec.Struct, kw_only=True):
    output_tokens: int


class MessageDelta(msgspec.Struct, kw_only=True):
    type: str
    delta: StopDelta
    usage: OutputUsage


class Bare(msgspec.Struct, kw_only=True):
    """An event with nothing but its type (ping, message_stop)."""

    type: str


class TokenCount(msgspec.Struct, kw_only=True):
    input_tokens: int


# --- requests as admission messages -------------------------------------------------------

_messages_decoder = msgspec.json.Decoder(MessagesRequest)
_count_decoder = msgspec.json.Decoder(CountTokensRequest)
_encoder = msgspec.json.Encoder()

# Tool call ids: the engine names calls "call_..." (OpenAI's way), Anthropic "toolu_...".
_CALL_PREFIX, _TOOLU_PREFIX = "call_", "toolu_"


def anthropic_tool_id(call_id: str) -> str:
    """The ``tool_use`` id of an engine's tool call: ``call_x`` becomes ``toolu_x``."""
    return _TOOLU_PREFIX + call_id.removeprefix(_CALL_PREFIX)


def template_tool_id(tool_use_id: str) -> str:
    """The chat template's id of a ``tool_use`` id: ``toolu_x`` maps back to ``call_x``.

    The way back keeps the prompt of an agent loop the same as through OpenAI's route, where
    the client echoes the engine's own ids. Other ids (a client's own) pass as they are.
    """
    if tool_use_id.startswith(_TOOLU_PREFIX):
        return _CALL_PREFIX + tool_use_id.removeprefix(_TOOLU_PREFIX)
    return tool_use_id


def _texts(blocks: list[ContentBlock], param: str) -> str:
    """Text blocks joined by newlines (as the OpenAI route joins text parts); others refused."""
    texts = []
    for j, block in enumerate(blocks):
        if block.type != "text":
            raise _unsupported(block.type, f"{param}[{j}]", "text blocks")
        texts.append(_text(block, f"{param}[{j}]"))
    return "\n".join(texts)


def _text(block: ContentBlock, param: str) -> str:
    if block.text is None:
        raise ApiError(400, "A text block needs a 'text' string.", param=f"{param}.text")
    return block.text


def _image(block: ContentBlock, where: str) -> dict[str, Any]:
    """An image block as its part (``api.images``): a base64 source, or a url source."""
    param = f"{where}.source"
    source = block.source
    if source is None:
        raise ApiError(400, "An image block needs a 'source'.", param=param)
    if source.type == "base64":
        if source.data is None:
            raise ApiError(400, "A base64 image source needs 'data'.", param=f"{param}.data")
        return image_part(source.data, media_type(source.media_type, param), param)
    if source.type == "url":
        if source.url is None:
            raise ApiError(400, "A url image source needs 'url'.", param=f"{param}.url")
        return url_image(source.url, param)
    raise ApiError(400, f"Image sources of type '{source.type}' are not supported; send "
                   "'base64' or 'url'.", param=f"{param}.type")


def _tool_result(blocks: str | list[ContentBlock], param: str) -> str | list[dict[str, Any]]:
    """A tool_result's content: text blocks joined by newlines; with images, the text and
    image parts in order (``api.images.content``)."""
    if isinstance(blocks, str):
        return blocks
    parts = []
    for j, block in enumerate(blocks):
        where = f"{param}[{j}]"
        if block.type == "text":
            parts.append({"type": "text", "text": _text(block, where)})
        elif block.type == "image":
            parts.append(_image(block, where))
        else:
            raise _unsupported(block.type, where, "text and image blocks")
    return content(parts)


def _unsupported(kind: str, param: str,
                 accepted: str = "text, image, tool_use and tool_result blocks") -> ApiError:
    return ApiError(
        400,
        f"Content blocks of type '{kind}' are not supported here: "
        f"{why_unsupported(kind, accepted)}.",
        param=param,
    )


# Blocks an assistant turn may carry that mean nothing to another model: dropped.
_DROPPED = ("thinking", "redacted_thinking")


def _template_messages(message: InputMessage, index: int) -> list[dict[str, Any]]:
    """One Anthropic message as chat-template messages (tool results become ``tool`` turns)."""
    param = f"messages[{index}].content"
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    tool_calls: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        where = f"{param}[{j}]"
        if block.type == "text":
            parts.append({"type": "text", "text": _text(block, where)})
        elif block.type == "image" and message.role == "user":
            parts.append(_image(block, where))
        elif block.type == "tool_use" and message.role == "assistant":
            if block.id is None or block.name is None:
                raise ApiError(400, "A tool_use block needs 'id' and 'name'.", param=where)
            tool_calls.append({
                "id": template_tool_id(block.id),
                "type": "function",
                "function": {"name": block.name, "arguments": block.input or {}},
            })
        elif block.type == "tool_result" and message.role == "user":
            if block.tool_use_id is None:
                raise ApiError(400, "A tool_result block needs 'tool_use_id'.", param=where)
            out.append({
                "role": "tool",
                "tool_call_id": template_tool_id(block.tool_use_id),
                "content": _tool_result(block.content or "", f"{where}.content"),
            })
        elif block.type in _DROPPED and message.role == "assistant":
            continue
        else:
            raise _unsupported(block.type, where)
    if parts or tool_calls or not out:
        turn: dict[str, Any] = {"role": message.role, "content": content(parts)}
        if tool_calls:
            turn["tool_calls"] = tool_calls
        out.append(turn)
    return out


def _chat(
    req: CountTokensRequest,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, ToolChoice]:
    """The conversation and tools as chat templates read them (OpenAI's conventions), and
    the request's tool choice."""
    messages: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else _texts(req.system, "system")
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(req.messages):
        messages.extend(_template_messages(message, i))
    functions = [_function(tool, i) for i, tool in enumerate(req.tools or [])]
    choice = _tool_choice(req.tool_choice, [tool.name for tool in req.tools or []])
    # tool_choice "none" means the model must not see the tools at all.
    tools = functions if functions and choice.mode != "none" else None
    return messages, tools, choice


def _function(tool: Tool, index: int) -> dict[str, Any]:
    if tool.type not in (None, "custom"):
        raise ApiError(
            400, f"Server tools ('{tool.type}') are not supported; define the tool's "
            "input_schema instead.", param=f"tools[{index}].type",
        )
    if tool.input_schema is None:
        raise ApiError(
            400, f"Tool '{tool.name}' needs an 'input_schema' (a JSON schema of its input).",
            param=f"tools[{index}].input_schema",
        )
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = tool.input_schema
    return {"type": "function", "function": function}


def _tool_choice(choice: ToolChoiceParam | None, names: list[str]) -> ToolChoice:
    """Anthropic's ``tool_choice`` as the neutral one: any -> required, tool -> function."""
    if len(set(names)) != len(names):
        raise ApiError(400, "Tool names must be unique.", param="tools")
    if choice is None:
        return ToolChoice()
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "none":
        return ToolChoice(mode="none", parallel=parallel)
    if choice.type == "auto":
        return ToolChoice(mode="auto", parallel=parallel)
    if not names:
        raise ApiError(
            400, f"tool_choice '{choice.type}' needs tools to choose from.", param="tool_choice"
        )
    if choice.type == "any":
        return ToolChoice(mode="required", parallel=parallel)
    if choice.name is None:
        raise ApiError(400, "tool_choice 'tool' needs a 'name'.", param="tool_choice.name")
    if choice.name not in names:
        raise ApiError(
            400, f"tool_choice names the tool '{choice.name}', which is not in 'tools'.",
            param="tool_choice.name",
        )
    return ToolChoice(mode="function", name=choice.name, parallel=parallel)


def _thinking(req: MessagesRequest) -> tuple[dict[str, Any] | None, int | None]:
    """The chat template's ``enable_thinking`` and the thinking budget (None: not sent)."""
    thinking = req.thinking
    if thinking is None:
        return None, None  # the template's own default
    if thinking.type == "disabled":
        return {"enable_thinking": False}, None
    if thinking.type == "adaptive":
        return {"enable_thinking": True}, None
    budget = thinking.budget_tokens
    if budget is None:
        raise ApiError(
            400, "thinking 'enabled' needs 'budget_tokens'.", param="thinking.budget_tokens"
        )
    if budget >= req.max_tokens:
        raise ApiError(
            400, f"thinking.budget_tokens ({budget}) must be less than max_tokens "
            f"({req.max_tokens}).", param="thinking.budget_tokens",
        )
    return {"enable_thinking": True}, budget


def _output_format(req: MessagesRequest) -> OutputFormat | None:
    fmt = req.output_config.format if req.output_config else None
    fmt = fmt or req.output_format
    if fmt is None:
        return None
    return OutputFormat(type="json_schema", schema=fmt.schema)


def admit_message(req: MessagesRequest, request_id: str) -> AdmitChat:
    """Validate what the schema cannot express and build the admission message."""
    stops = stop_sequences(list(req.stop_sequences or []), "stop_sequences")
    messages, tools, choice = _chat(req)
    template_kwargs, budget = _thinking(req)
    sent = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k}
    sampling = SamplingParams(
        max_tokens=req.max_tokens,
        stop=stops,
        **{name: value for name, value in sent.items() if value is not None},
        **({} if req.speculative is None else {"speculative": req.speculative}),
    )
    return AdmitChat(
        request_id=request_id,
        model=req.model,
        messages=messages,
        sampling=sampling,
        unset=unset_sampling(sent),
        tools=tools,
        chat_template_kwargs=template_kwargs,
        tool_choice=choice,
        response_format=_output_format(req),
        thinking_budget=budget,
    )


# --- rendering events as Anthropic objects -------------------------------------------------


def stop_details(
    finished: RequestFinished, stops: list[str], delivered_tokens: int
) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a request that ended normally.

    An answer that ended by calling tools stopped for ``tool_use``. ``delivered_tokens``
    counts the token ids the deltas carried. When the scheduler names the stop sequence it
    matched (``RequestFinished.stop_sequence``), that is the answer. Otherwise: an
    end-of-sequence token is counted in the usage but carried by no delta, while a stop
    string is matched on a token that is delivered, so a "stop" whose every token was
    delivered ended on a stop sequence (named when only one was asked for).
    """
    if finished.finish_reason == "tool_calls":
        return "tool_use", None
    if finished.finish_reason == "length":
        return "max_tokens", None
    if "stop_sequence" in finished.__struct_fields__:
        matched = getattr(finished, "stop_sequence", None)
        return ("stop_sequence", matched) if matched is not None else ("end_turn", None)
    if stops and delivered_tokens >= finished.usage.completion_tokens:
        return "stop_sequence", stops[0] if len(stops) == 1 else None
    return "end_turn", None


def tool_use_block(call: ToolCall) -> tuple[ToolUseBlock, str]:
    """A tool call as a ``tool_use`` block, and its input as the JSON text to stream."""
    try:
        value = msgspec.json.decode(call.arguments or "{}")
    except msgspec.DecodeError:
        value = None
    if isinstance(value, dict):
        arguments = call.arguments or "{}"
    else:
        # Anthropic's input is always an object; the engine's parser should only make those.
        log.warning("tool call %s has arguments that are not a JSON object", call.id)
        value, arguments = {}, "{}"
    block = ToolUseBlock(id=anthropic_tool_id(call.id), name=call.name, input=value)
    return block, arguments


class MessagesRenderer(Renderer):
    """One request's events as Anthropic's message, or as its stream of block events."""

    def __init__(self, req: MessagesRequest, msg: AdmitChat, admitted: Admitted) -> None:
        self.message_id = msg.request_id
        self.model = admitted.model
        self.prompt_tokens = admitted.prompt_tokens
        self.stops = msg.sampling.stop
        self.delivered = 0
        # The streamed block now open ("thinking", "text", or None) and the last index used.
        self.open_kind: str | None = None
        self.index = -1

    def _usage(self, prompt_tokens: int, cached: int, output_tokens: int) -> MessageUsage:
        # Anthropic counts cache reads apart: input_tokens are the ones not read from cache.
        return MessageUsage(
            input_tokens=prompt_tokens - cached,
            output_tokens=output_tokens,
            cache_read_input_tokens=cached,
            cache_creation_input_tokens=0,
        )

    def _message(
        self, content: list[OutputBlock], usage: MessageUsage, stop: tuple[str | None, str | None]
    ) -> Message:
        return Message(
            id=self.message_id,
            type="message",
            role="assistant",
            model=self.model,
            content=content,
            stop_reason=stop[0],
            stop_sequence=stop[1],
            usage=usage,
        )

    # --- streaming: a block opens when its first content arrives, closes when another opens

    def _open(self, kind: str, block: OutputBlock) -> list[Frame]:
        frames = self._close()
        self.index += 1
        self.open_kind = kind
        start = ContentBlockStart(type="content_block_start", index=self.index, content_block=block)
        return [*frames, ("content_block_start", _encoder.encode(start))]

    def _close(self) -> list[Frame]:
        if self.open_kind is None:
            return []
        frames = []
        if self.open_kind == "thinking":
            frames.append(self._delta(SignatureDelta(signature="")))
        self.open_kind = None
        stop = ContentBlockEvent(type="content_block_stop", index=self.index)
        frames.append(("content_block_stop", _encoder.encode(stop)))
        return frames

    def _delta(self, delta: BlockDelta) -> Frame:
        event = ContentBlockDelta(type="content_block_delta", index=self.index, delta=delta)
        return ("content_block_delta", _encoder.encode(event))

    def opening(self, first: RequestEvent) -> list[Frame]:
        prompt, cached = self.prompt_tokens, 0
        if isinstance(first, RequestStarted):
            prompt, cached = first.prompt_tokens, first.cached_tokens
        start = MessageStart(
            type="message_start",
            message=self._message([], self._usage(prompt, cached, 0), (None, None)),
        )
        return [
            ("message_start", _encoder.encode(start)),
            ("ping", _encoder.encode(Bare(type="ping"))),
        ]

    def delta(self, event: TokensGenerated) -> list[Frame]:
        self.delivered += len(event.token_ids)
        frames: list[Frame] = []
        if event.reasoning:
            if self.open_kind != "thinking":
                frames += self._open("thinking", ThinkingBlock(thinking=""))
            frames.append(self._delta(ThinkingDelta(thinking=event.reasoning)))
        if event.text:
            if self.open_kind != "text":
                frames += self._open("text", TextBlock(text=""))
            frames.append(self._delta(TextDelta(text=event.text)))
        for call in event.tool_calls or []:
            block, arguments = tool_use_block(call)
            # Anthropic starts a tool_use block with an empty input and streams it as JSON.
            frames += self._open("tool_use", ToolUseBlock(id=block.id, name=block.name, input={}))
            frames.append(self._delta(InputJsonDelta(partial_json=arguments)))
            frames += self._close()
        return frames

    def closing(self, finished: RequestFinished) -> list[Frame]:
        frames = self._close()
        if self.index < 0:  # an empty answer is one empty text block, as Anthropic sends it
            frames += self._open("text", TextBlock(text="")) + self._close()
        reason, sequence = stop_details(finished, self.stops, self.delivered)
        delta = MessageDelta(
            type="message_delta",
            delta=StopDelta(stop_reason=reason, stop_sequence=sequence),
            usage=OutputUsage(output_tokens=finished.usage.completion_tokens),
        )
        return [
            *frames,
            ("message_delta", _encoder.encode(delta)),
            ("message_stop", _encoder.encode(Bare(type="message_stop"))),
        ]

    def failure(self, error: ApiError) -> list[Frame]:
        return [("error", error.body("anthropic"))]

    def whole(self, deltas: list[TokensGenerated], finished: RequestFinished) -> bytes:
        delivered = sum(len(event.token_ids) for event in deltas)
        reasoning = "".join(event.reasoning for event in deltas)
        text = "".join(event.text for event in deltas)
        calls = [call for event in deltas for call in event.tool_calls or []]
        content: list[OutputBlock] = []
        if reasoning:
            content.append(ThinkingBlock(thinking=reasoning))
        if text or not (reasoning or calls):
            content.append(TextBlock(text=text))
        content.extend(tool_use_block(call)[0] for call in calls)
        usage = finished.usage
        message = self._message(
            content,
            self._usage(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens),
            stop_details(finished, self.stops, delivered),
        )
        return _encoder.encode(message)


# --- routes --------------------------------------------------------------------------------


class AnthropicRoutes:
    """Anthropic's Messages API, answering through the admission actor."""

    def __init__(self, admission: ActorRef, config: ServeConfig) -> None:
        self.admission = admission
        self.config = config
        self.images = ImageInput(config)

    def register(self, router: web.UrlDispatcher) -> None:
        """Add the routes to an application's router."""
        router.add_post("/v1/messages", self.messages)
        router.add_post("/v1/messages/count_tokens", self.count_tokens)

    @generation
    async def messages(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/messages``."""
        return await generate(
            request, self.admission, _messages_decoder, "msg_", admit_message, MessagesRenderer,
            self.images,
        )

    async def count_tokens(self, request: web.Request) -> web.Response:
        """``POST /v1/messages/count_tokens``: the prompt's size, without generating."""
        req = decode_body(await request.read(), _count_decoder)
        request[RECORD].model = req.model
        messages, tools, _ = _chat(req)
        await self.images.resolve(messages)
        count: int = await ask_admission(
            self.admission, CountTokens(model=req.model, messages=messages, tools=tools)
        )
        return web.Response(
            body=_encoder.encode(TokenCount(input_tokens=count)), content_type="application/json"
        )
