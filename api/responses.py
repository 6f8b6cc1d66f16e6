"""OpenAI's Responses API: ``POST /v1/responses`` (what Codex CLI and the Agents SDK speak).

A Responses request becomes the same admission message as a chat completion: ``instructions``
as a system message first, message items as chat messages (text parts joined by newlines),
``function_call`` items as an assistant turn's OpenAI ``tool_calls`` and
``function_call_output`` items as ``tool`` messages, function tools as OpenAI chat functions,
``tool_choice`` and ``parallel_tool_calls`` as a ``ToolChoice``, ``text.format`` as an
``OutputFormat``. So one conversation gets the same prompt tokens through either API.

The answer is a ``response`` object whose ``output`` lists, in the order the model produced
them, a ``reasoning`` item, a ``message`` item and one ``function_call`` item per call; a
stream sends OpenAI's typed events (``event: <type>`` lines, a ``sequence_number`` in each),
ending with ``response.completed``, ``response.incomplete`` (the token limit was reached) or
``response.failed`` (the request failed after the stream began).

This server is stateless: it keeps no responses and no conversations. A request must carry
the whole conversation in ``input``; ``previous_response_id``, ``conversation``,
``background: true`` and an explicit ``store: true`` are refused with a 400 (clients that
send nothing about storage, like the ``openai`` package, are unaffected; ``store: false`` is
accepted). Every response says ``"store": false``. ``reasoning`` items sent back in ``input``
are dropped (chat templates drop earlier turns' reasoning too); ``reasoning.effort`` is
accepted and ignored.
"""

from __future__ import annotations

import time
import uuid
from functools import partial
from typing import Annotated, Any, Literal

import msgspec
from aiohttp import web
from msgspec import Meta

from actors.config import ServeConfig
from actors.messages import (
    AdmitChat,
    Admitted,
    OutputFormat,
    RequestEvent,
    RequestFinished,
    SamplingParams,
    TokensGenerated,
    ToolCall,
    ToolChoice,
    Usage,
)
from api.errors import ApiError
from api.generation import Renderer
from api.generation_route import generate
from api.shutdown import generation
from api.sse import Frame
from runtime import ActorRef

# --- request schemas -----------------------------------------------------------------------


class InputPart(msgspec.Struct, kw_only=True):
    # ``type`` stays a plain string so an image part gets a clear refusal, not a schema error.
    type: str
    text: str | None = None


class InputItem(msgspec.Struct, kw_only=True):
    """Any input item; ``type`` (absent means a message) says which fields apply."""

    type: str | None = None
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None


class Tool(msgspec.Struct, kw_only=True):
    # Any type decodes, so that a built-in tool (web_search...) gets a refusal naming it.
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: str
    name: str | None = None
    description: str | None = None
    # msgspec cannot name a field "schema" on every Python (as api/openai.py): renamed.
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """The body of ``POST /v1/responses``. Unknown fields are ignored."""

    model: str
    input: str | Annotated[list[InputItem], Meta(min_length=1)]
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    stream: bool | None = None
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None
    store: bool | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None


# --- response schemas ----------------------------------------------------------------------


class OutputText(msgspec.Struct, kw_only=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class ReasoningText(msgspec.Struct, kw_only=True, tag_field="type", tag="reasoning_text"):
    text: str


class MessageItem(msgspec.Struct, kw_only=True, tag_field="type", tag="message"):
    id: str
    role: str = "assistant"
    status: str = "in_progress"
    content: list[OutputText] = []


class ReasoningItem(msgspec.Struct, kw_only=True, tag_field="type", tag="reasoning"):
    id: str
    summary: list[Any] = []
    content: list[ReasoningText] = []


class FunctionCallItem(msgspec.Struct, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "in_progress"


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


class InputTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int
    cache_write_tokens: int = 0  # the openai package's model requires it; nothing is billed


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(msgspec.Struct, kw_only=True):
    code: str
    message: str


class IncompleteDetails(msgspec.Struct, kw_only=True):
    reason: str


class ResponseObject(msgspec.Struct, kw_only=True):
    """A ``response`` object: the whole answer, or the state a lifecycle event carries."""

    id: str
    object: str = "response"
    created_at: int
    status: str
    completed_at: int | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None
    store: bool = False
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    metadata: dict[str, str]


# --- requests as admission messages -------------------------------------------------------

_decoder = msgspec.json.Decoder(ResponsesRequest)
_encoder = msgspec.json.Encoder()

# Part types that carry text: input_text (what clients send), output_text (earlier answers
# sent back), and chat's "text" for clients that mix the two APIs up.
_TEXT_PARTS = ("input_text", "output_text", "text")


def _texts(content: str | list[InputPart] | None, param: str) -> str:
    """The content's text: a string as it is, text parts joined by newlines (as chat does)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if part.type not in _TEXT_PARTS:
            raise ApiError(
                400,
                f"Content parts of type '{part.type}' are not supported: this server accepts "
                "input_text and output_text parts only.",
                param=f"{where}.type",
            )
        if part.text is None:
            raise ApiError(400, "A text content part needs a 'text' string.", param=f"{where}.text")
        texts.append(part.text)
    return "\n".join(texts)


def _required(value: str | None, field: str, kind: str, where: str) -> str:
    if value is None:
        raise ApiError(400, f"A {kind} item needs '{field}'.", param=f"{where}.{field}")
    return value


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation as chat templates read it (OpenAI chat's conventions)."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        return messages
    # The assistant turn that function_call items join: an answer's text and its calls are
    # one turn, as the model produced them (so the prompt matches what it generated).
    turn: dict[str, Any] | None = None
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.type or "message"
        if kind == "message":
            if item.role is None:
                raise ApiError(400, "A message item needs a 'role'.", param=f"{where}.role")
            message = {"role": item.role, "content": _texts(item.content, f"{where}.content")}
            messages.append(message)
            turn = message if item.role == "assistant" else None
        elif kind == "function_call":
            call = {
                "id": _required(item.call_id, "call_id", kind, where),
                "type": "function",
                "function": {
                    "name": _required(item.name, "name", kind, where),
                    "arguments": _required(item.arguments, "arguments", kind, where),
                },
            }
            if turn is None:
                turn = {"role": "assistant", "content": ""}  # templates expect a string
                messages.append(turn)
            turn.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = _required(item.call_id, "call_id", kind, where)
            if item.output is None:
                raise ApiError(
                    400, "A function_call_output item needs 'output'.", param=f"{where}.output"
                )
            output = _texts(item.output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
            turn = None
        elif kind == "reasoning":
            continue  # an earlier answer's reasoning: templates drop it, so do we
        else:
            raise ApiError(
                400,
                f"Input items of type '{kind}' are not supported: this server accepts message, "
                "function_call, function_call_output and reasoning items.",
                param=f"{where}.type",
            )
    if not messages:
        raise ApiError(400, "The input holds no message.", param="input")
    return messages


def _chat_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """Function tools in OpenAI chat's shape; any other tool type is refused."""
    out = []
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise ApiError(
                400,
                f"Tools of type '{tool.type}' are not supported: this server offers function "
                "tools only.",
                param=f"tools[{i}].type",
            )
        if not tool.name:
            raise ApiError(400, "A function tool needs a 'name'.", param=f"tools[{i}].name")
        function: dict[str, Any] = {"name": tool.name}
        if tool.description is not None:
            function["description"] = tool.description
        function["parameters"] = tool.parameters or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(req: ResponsesRequest, names: list[str]) -> ToolChoice:
    parallel = req.parallel_tool_calls is not False
    choice = req.tool_choice
    if choice is None or choice == "auto":
        return ToolChoice(mode="auto", parallel=parallel)
    if choice == "none":
        return ToolChoice(mode="none", parallel=parallel)
    if choice == "required":
        if not names:
            raise ApiError(400, "tool_choice 'required' needs tools.", param="tool_choice")
        return ToolChoice(mode="required", parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if name not in names:
            raise ApiError(
                400,
                f"tool_choice names the function {name!r}, which is not among the tools.",
                param="tool_choice",
            )
        return ToolChoice(mode="function", name=name, parallel=parallel)
    raise ApiError(
        400,
        "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\"}.",
        param="tool_choice",
    )


def _output_format(text: TextConfig | None) -> OutputFormat | None:
    fmt = text.format if text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return OutputFormat(type="json_object")
    if fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise ApiError(
                400, "A json_schema format needs a 'schema'.", param="text.format.schema"
            )
        return OutputFormat(type="json_schema", schema=fmt.schema_, name=fmt.name)
    raise ApiError(
        400,
        f"text.format of type '{fmt.type}' is not supported; use 'text', 'json_object' or "
        "'json_schema'.",
        param="text.format.type",
    )


def _refuse_state(req: ResponsesRequest) -> None:
    """This server keeps nothing between requests: refuse what would need it."""
    stored = "This server does not store responses; send the whole conversation in 'input'."
    if req.previous_response_id is not None:
        raise ApiError(400, stored, param="previous_response_id")
    if req.conversation is not None:
        raise ApiError(400, stored, param="conversation")
    if req.store:
        raise ApiError(400, stored + " Send 'store': false or leave it out.", param="store")
    if req.background:
        raise ApiError(
            400,
            "Background responses need stored responses; this server keeps none.",
            param="background",
        )


def admit_response(req: ResponsesRequest, request_id: str, default_max_tokens: int) -> AdmitChat:
    """Validate what the schema cannot express and build the admission message."""
    _refuse_state(req)
    tools = _chat_tools(req.tools or [])
    choice = _tool_choice(req, [tool["function"]["name"] for tool in tools])
    sent = {"temperature": req.temperature, "top_p": req.top_p}
    sampling = SamplingParams(
        max_tokens=req.max_output_tokens or default_max_tokens,
        **{name: value for name, value in sent.items() if value is not None},
    )
    return AdmitChat(
        request_id=request_id,
        model=req.model,
        messages=_messages(req),
        sampling=sampling,
        # Sent even with tool_choice "none", as chat sends them: admission hides them then.
        tools=tools or None,
        tool_choice=choice,
        response_format=_output_format(req.text),
    )


# --- rendering events as Responses objects -------------------------------------------------


def _usage(usage: Usage) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=usage.cached_tokens),
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=usage.reasoning_tokens),
        total_tokens=usage.total_tokens,
    )


def _error_code(status: int) -> str:
    # ResponseError.code is a closed list; these are the ones a failure here can be.
    if status == 429:
        return "rate_limit_exceeded"
    return "server_error" if status >= 500 else "invalid_prompt"


def _new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


class _ResponsesRenderer(Renderer):
    """Builds the output items as the deltas come; streamed or whole, the items are the same.

    One item is open at a time (a reasoning or a message item, taking deltas); a delta of the
    other kind, or a tool call, closes it. A stream sends each item's added, delta and done
    events; a whole answer runs the same steps and keeps only the items.
    """

    def __init__(self, req: ResponsesRequest, msg: AdmitChat, admitted: Admitted) -> None:
        self.response_id = msg.request_id
        self.model = admitted.model
        self.created_at = int(time.time())
        self.items: list[OutputItem] = []
        self.open: MessageItem | ReasoningItem | None = None
        self.sequence = 0
        fmt = req.text.format if req.text and req.text.format else TextFormat(type="text")
        # What the response echoes of the request, as OpenAI's does.
        self.echo: dict[str, Any] = {
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": msg.tool_choice.parallel,
            "reasoning": req.reasoning,
            "temperature": msg.sampling.temperature,
            "text": {"format": msgspec.to_builtins(fmt)},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": [
                {
                    "type": "function",
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.parameters,
                    "strict": tool.strict,
                }
                for tool in req.tools or []
            ],
            "top_p": msg.sampling.top_p,
            "metadata": req.metadata or {},
        }

    # -- events --

    def _event(self, kind: str, **fields: Any) -> Frame:
        """One SSE event: ``event: kind``, its data carrying the type and sequence number."""
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return (kind, _encoder.encode(data))

    def _response(
        self,
        status: str,
        finished: RequestFinished | None = None,
        error: ResponseError | None = None,
    ) -> ResponseObject:
        incomplete = None
        if status == "incomplete":
            incomplete = IncompleteDetails(reason="max_output_tokens")
        return ResponseObject(
            id=self.response_id,
            created_at=self.created_at,
            status=status,
            completed_at=int(time.time()) if status == "completed" else None,
            error=error,
            incomplete_details=incomplete,
            model=self.model,
            output=list(self.items),
            usage=_usage(finished.usage) if finished else None,
            **self.echo,
        )

    # -- items --

    def _add(self, item: OutputItem) -> tuple[int, Frame]:
        self.items.append(item)
        index = len(self.items) - 1
        return index, self._event("response.output_item.added", output_index=index, item=item)

    def _text(self, kind: type[MessageItem] | type[ReasoningItem], delta: str) -> list[Frame]:
        """Add ``delta`` to the open item of ``kind``, opening one (and closing another) first."""
        frames: list[Frame] = []
        item = self.open
        if not isinstance(item, kind):
            frames += self._close()
            item = (
                MessageItem(id=_new_id("msg_"))
                if kind is MessageItem
                else ReasoningItem(id=_new_id("rs_"))
            )
            index, added = self._add(item)  # sent with no content: its part comes next
            if isinstance(item, MessageItem):
                item.content.append(OutputText(text=""))
            else:
                item.content.append(ReasoningText(text=""))
            frames += [
                added,
                self._event(
                    "response.content_part.added",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    part=item.content[0],
                ),
            ]
            self.open = item
        index = len(self.items) - 1  # the open item is always the last one
        item.content[0].text += delta
        if isinstance(item, MessageItem):
            frames.append(
                self._event(
                    "response.output_text.delta",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    delta=delta,
                    logprobs=[],
                )
            )
        else:
            frames.append(
                self._event(
                    "response.reasoning_text.delta",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    delta=delta,
                )
            )
        return frames

    def _close(self, status: str = "completed") -> list[Frame]:
        """Close the open item: its done events (``status``: the message's final status)."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.items) - 1  # the open item is always the last one
        part = item.content[0]
        if isinstance(item, MessageItem):
            item.status = status
            done = self._event(
                "response.output_text.done",
                item_id=item.id,
                output_index=index,
                content_index=0,
                text=part.text,
                logprobs=[],
            )
        else:
            done = self._event(
                "response.reasoning_text.done",
                item_id=item.id,
                output_index=index,
                content_index=0,
                text=part.text,
            )
        return [
            done,
            self._event(
                "response.content_part.done",
                item_id=item.id,
                output_index=index,
                content_index=0,
                part=part,
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _call(self, call: ToolCall) -> list[Frame]:
        """A whole tool call: its item added, its arguments in one delta, then done."""
        frames = self._close()
        item = FunctionCallItem(id=_new_id("fc_"), call_id=call.id, name=call.name, arguments="")
        index, added = self._add(item)
        frames.append(added)
        item.arguments = call.arguments
        if call.arguments:
            frames.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item.id,
                    output_index=index,
                    delta=call.arguments,
                )
            )
        item.status = "completed"
        frames += [
            self._event(
                "response.function_call_arguments.done",
                item_id=item.id,
                output_index=index,
                name=call.name,
                arguments=call.arguments,
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]
        return frames

    @staticmethod
    def _status(finished: RequestFinished) -> str:
        return "incomplete" if finished.finish_reason == "length" else "completed"

    # -- Renderer --

    def opening(self, first: RequestEvent) -> list[Frame]:
        response = self._response("in_progress")
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def delta(self, event: TokensGenerated) -> list[Frame]:
        # One delta may carry all three; the model wrote them in this order.
        frames: list[Frame] = []
        if event.reasoning:
            frames += self._text(ReasoningItem, event.reasoning)
        if event.text:
            frames += self._text(MessageItem, event.text)
        for call in event.tool_calls or ():
            frames += self._call(call)
        return frames

    def closing(self, finished: RequestFinished) -> list[Frame]:
        status = self._status(finished)
        frames = self._close(status)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        frames.append(self._event(kind, response=self._response(status, finished)))
        return frames

    def failure(self, error: ApiError) -> list[Frame]:
        # The items so far go with it; the one cut short is marked so.
        if isinstance(self.open, MessageItem):
            self.open.status = "incomplete"
        self.open = None
        failed = ResponseError(code=_error_code(error.status), message=error.message)
        return [self._event("response.failed", response=self._response("failed", error=failed))]

    def whole(self, deltas: list[TokensGenerated], finished: RequestFinished) -> bytes:
        for event in deltas:
            self.delta(event)  # the same items a stream builds; its events are dropped
        status = self._status(finished)
        self._close(status)
        return _encoder.encode(self._response(status, finished))


# --- routes --------------------------------------------------------------------------------


class ResponsesRoutes:
    """OpenAI's Responses API, answering through the admission actor."""

    def __init__(self, admission: ActorRef, config: ServeConfig) -> None:
        self.admission = admission
        self.config = config

    def register(self, router: web.UrlDispatcher) -> None:
        """Add the routes to an application's router."""
        router.add_post("/v1/responses", self.responses)

    @generation
    async def responses(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/responses``."""
        admit = partial(admit_response, default_max_tokens=self.config.default_max_tokens)
        return await generate(request, self.admission, _decoder, "resp_", admit, _ResponsesRenderer)
