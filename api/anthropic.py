"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A Messages request becomes the same admission message as an OpenAI chat request (system
prompt first, text blocks joined by newlines, ``tool_use``/``tool_result`` blocks as OpenAI
tool calls and tool messages, tools as OpenAI functions), so one conversation gets the same
prompt tokens through either API. Answers and streams follow Anthropic's shapes exactly.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from aiohttp import web
from msgspec import Meta

from actors.config import ServeConfig
from actors.messages import (
    AdmitChat,
    Admitted,
    CountTokens,
    RequestEvent,
    RequestFinished,
    RequestStarted,
    SamplingParams,
    TokensGenerated,
)
from api.decode import decode_body
from api.errors import ApiError, ask_admission
from api.generation import Renderer
from api.generation_route import generate
from api.shutdown import generation
from api.sse import Frame
from api.telemetry import RECORD
from runtime import ActorRef

# --- request schemas -----------------------------------------------------------------------


class ContentBlock(msgspec.Struct, kw_only=True):
    """Any content block; ``type`` says which fields apply (text, tool_use, tool_result...)."""

    # A plain string, so an image block gets a clear refusal rather than a schema error.
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[ContentBlock] | None = None  # a tool_result's content
    is_error: bool | None = None


class InputMessage(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    # Absent or "custom" for client tools; Anthropic's server tools name a versioned type.
    type: str | None = None


class ToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True):
    """The body of ``POST /v1/messages/count_tokens``. Unknown fields are ignored."""

    model: str
    messages: Annotated[list[InputMessage], Meta(min_length=1)]
    system: str | list[ContentBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    """The body of ``POST /v1/messages``. Unknown fields (``metadata``...) are ignored."""

    max_tokens: Annotated[int, Meta(ge=1)]
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    stream: bool | None = None


# --- response schemas ----------------------------------------------------------------------


class TextBlock(msgspec.Struct, kw_only=True):
    """A text content block (``type`` "text"), or a text delta (``type`` "text_delta")."""

    type: str
    text: str


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
    content: list[TextBlock]
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
    content_block: TextBlock


class ContentBlockDelta(ContentBlockEvent, kw_only=True):
    delta: TextBlock


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


def _texts(blocks: list[ContentBlock], param: str) -> str:
    """Text blocks joined by newlines (as the OpenAI route joins text parts); others refused."""
    texts = []
    for j, block in enumerate(blocks):
        if block.type != "text":
            raise _unsupported(block.type, f"{param}[{j}]")
        texts.append(_text(block, f"{param}[{j}]"))
    return "\n".join(texts)


def _text(block: ContentBlock, param: str) -> str:
    if block.text is None:
        raise ApiError(400, "A text block needs a 'text' string.", param=f"{param}.text")
    return block.text


def _unsupported(kind: str, param: str) -> ApiError:
    return ApiError(
        400,
        f"Content blocks of type '{kind}' are not supported: this server accepts text, "
        "tool_use and tool_result blocks.",
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
    texts: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        where = f"{param}[{j}]"
        if block.type == "text":
            texts.append(_text(block, where))
        elif block.type == "tool_use" and message.role == "assistant":
            if block.id is None or block.name is None:
                raise ApiError(400, "A tool_use block needs 'id' and 'name'.", param=where)
            tool_calls.append({
                "id": block.id,
                "type": "function",
                "function": {"name": block.name, "arguments": block.input or {}},
            })
        elif block.type == "tool_result" and message.role == "user":
            if block.tool_use_id is None:
                raise ApiError(400, "A tool_result block needs 'tool_use_id'.", param=where)
            content = block.content or ""
            if not isinstance(content, str):
                content = _texts(content, f"{where}.content")
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        elif block.type in _DROPPED and message.role == "assistant":
            continue
        else:
            raise _unsupported(block.type, where)
    if texts or tool_calls or not out:
        turn: dict[str, Any] = {"role": message.role, "content": "\n".join(texts)}
        if tool_calls:
            turn["tool_calls"] = tool_calls
        out.append(turn)
    return out


def _chat(req: CountTokensRequest) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The conversation and tools as chat templates read them (OpenAI's conventions)."""
    messages: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else _texts(req.system, "system")
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(req.messages):
        messages.extend(_template_messages(message, i))
    tools = None
    # tool_choice "none" means the model must not see the tools at all.
    if req.tools and not (req.tool_choice and req.tool_choice.type == "none"):
        tools = [_function(tool, i) for i, tool in enumerate(req.tools)]
    return messages, tools


def _function(tool: Tool, index: int) -> dict[str, Any]:
    if tool.type not in (None, "custom"):
        raise ApiError(
            400, f"Server tools ('{tool.type}') are not supported; define the tool's "
            "input_schema instead.", param=f"tools[{index}].type",
        )
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = tool.input_schema or {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def admit_message(req: MessagesRequest, request_id: str) -> AdmitChat:
    """Validate what the schema cannot express and build the admission message."""
    stops = list(req.stop_sequences or [])
    if any(s == "" for s in stops):
        raise ApiError(400, "Stop sequences must not be empty.", param="stop_sequences")
    messages, tools = _chat(req)
    sent = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k}
    sampling = SamplingParams(
        max_tokens=req.max_tokens,
        stop=stops,
        **{name: value for name, value in sent.items() if value is not None},
    )
    return AdmitChat(
        request_id=request_id, model=req.model, messages=messages, sampling=sampling, tools=tools
    )


# --- rendering events as Anthropic objects -------------------------------------------------


def stop_details(
    finished: RequestFinished, stops: list[str], delivered_tokens: int
) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a request that ended normally.

    ``delivered_tokens`` counts the token ids the deltas carried. When the scheduler names
    the stop sequence it matched (``RequestFinished.stop_sequence``), that is the answer.
    Otherwise: an end-of-sequence token is counted in the usage but carried by no delta,
    while a stop string is matched on a token that is delivered, so a "stop" whose every
    token was delivered ended on a stop sequence (named when only one was asked for).
    """
    if finished.finish_reason == "length":
        return "max_tokens", None
    if "stop_sequence" in finished.__struct_fields__:
        matched = getattr(finished, "stop_sequence", None)
        return ("stop_sequence", matched) if matched is not None else ("end_turn", None)
    if stops and delivered_tokens >= finished.usage.completion_tokens:
        return "stop_sequence", stops[0] if len(stops) == 1 else None
    return "end_turn", None


class _MessagesRenderer(Renderer):
    def __init__(self, req: MessagesRequest, msg: AdmitChat, admitted: Admitted) -> None:
        self.message_id = msg.request_id
        self.model = admitted.model
        self.prompt_tokens = admitted.prompt_tokens
        self.stops = msg.sampling.stop
        self.delivered = 0

    def _usage(self, prompt_tokens: int, cached: int, output_tokens: int) -> MessageUsage:
        # Anthropic counts cache reads apart: input_tokens are the ones not read from cache.
        return MessageUsage(
            input_tokens=prompt_tokens - cached,
            output_tokens=output_tokens,
            cache_read_input_tokens=cached,
            cache_creation_input_tokens=0,
        )

    def _message(
        self, text: str | None, usage: MessageUsage, stop: tuple[str | None, str | None]
    ) -> Message:
        return Message(
            id=self.message_id,
            type="message",
            role="assistant",
            model=self.model,
            content=[] if text is None else [TextBlock(type="text", text=text)],
            stop_reason=stop[0],
            stop_sequence=stop[1],
            usage=usage,
        )

    def opening(self, first: RequestEvent) -> list[Frame]:
        prompt, cached = self.prompt_tokens, 0
        if isinstance(first, RequestStarted):
            prompt, cached = first.prompt_tokens, first.cached_tokens
        start = MessageStart(
            type="message_start",
            message=self._message(None, self._usage(prompt, cached, 0), (None, None)),
        )
        block = ContentBlockStart(
            type="content_block_start", index=0, content_block=TextBlock(type="text", text="")
        )
        return [
            ("message_start", _encoder.encode(start)),
            ("content_block_start", _encoder.encode(block)),
            ("ping", _encoder.encode(Bare(type="ping"))),
        ]

    def delta(self, event: TokensGenerated) -> list[Frame]:
        self.delivered += len(event.token_ids)
        if not event.text:
            return []
        delta = ContentBlockDelta(
            type="content_block_delta", index=0, delta=TextBlock(type="text_delta", text=event.text)
        )
        return [("content_block_delta", _encoder.encode(delta))]

    def closing(self, finished: RequestFinished) -> list[Frame]:
        reason, sequence = stop_details(finished, self.stops, self.delivered)
        delta = MessageDelta(
            type="message_delta",
            delta=StopDelta(stop_reason=reason, stop_sequence=sequence),
            usage=OutputUsage(output_tokens=finished.usage.completion_tokens),
        )
        stop = ContentBlockEvent(type="content_block_stop", index=0)
        return [
            ("content_block_stop", _encoder.encode(stop)),
            ("message_delta", _encoder.encode(delta)),
            ("message_stop", _encoder.encode(Bare(type="message_stop"))),
        ]

    def failure(self, error: ApiError) -> list[Frame]:
        return [("error", error.body("anthropic"))]

    def whole(self, deltas: list[TokensGenerated], finished: RequestFinished) -> bytes:
        delivered = sum(len(event.token_ids) for event in deltas)
        usage = finished.usage
        message = self._message(
            "".join(event.text for event in deltas),
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

    def register(self, router: web.UrlDispatcher) -> None:
        """Add the routes to an application's router."""
        router.add_post("/v1/messages", self.messages)
        router.add_post("/v1/messages/count_tokens", self.count_tokens)

    @generation
    async def messages(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/messages``."""
        return await generate(
            request, self.admission, _messages_decoder, "msg_", admit_message, _MessagesRenderer
        )

    async def count_tokens(self, request: web.Request) -> web.Response:
        """``POST /v1/messages/count_tokens``: the prompt's size, without generating."""
        req = decode_body(await request.read(), _count_decoder)
        request[RECORD].model = req.model
        messages, tools = _chat(req)
        count: int = await ask_admission(
            self.admission, CountTokens(model=req.model, messages=messages, tools=tools)
        )
        return web.Response(
            body=_encoder.encode(TokenCount(input_tokens=count)), content_type="application/json"
        )
