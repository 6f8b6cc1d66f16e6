"""OpenAI's Responses API: ``POST /v1/responses`` (what Codex CLI and the Agents SDK speak),
and the stored responses ``GET`` and ``DELETE /v1/responses/{id}``.

A Responses request becomes the same admission message as a chat completion: ``instructions``
as a system message first, message items as chat messages (text parts joined by newlines),
``function_call``, ``custom_tool_call`` and ``local_shell_call`` items as an assistant turn's
OpenAI ``tool_calls`` and their outputs as ``tool`` messages, tools as OpenAI chat functions
(``api.responses_tools``: custom and local_shell tools mapped, hosted tools dropped),
``tool_choice`` and ``parallel_tool_calls`` as a ``ToolChoice``, ``text.format`` as an
``OutputFormat``, ``input_image`` parts as image parts (``api.images``). So one
conversation gets the same prompt tokens through either API.

The answer is a ``response`` object whose ``output`` lists, in the order the model produced
them, a ``reasoning`` item, a ``message`` item and one item per call (``function_call``,
``custom_tool_call`` or ``local_shell_call``, by its tool's kind); a stream sends OpenAI's
typed events (``event: <type>`` lines, a ``sequence_number`` in each), ending with
``response.completed``, ``response.incomplete`` (the token limit was reached) or
``response.failed`` (the request failed after the stream began).

Responses are stored (``api.responses_store``: in memory, the last ``--responses-store`` of
them) unless the request says ``store: false``; ``previous_response_id`` continues a stored
one (its input and output items come before the request's own; its instructions do not).
``conversation`` and ``background: true`` are refused with a 400. ``reasoning`` items sent
back in ``input`` are left out of the prompt (chat templates drop earlier turns' reasoning
too); ``reasoning.effort`` is accepted and ignored.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from aiohttp import web
from msgspec import Meta

from troupe.actors.config import ServeConfig
from troupe.actors.messages import (
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
    unset_sampling,
)
from troupe.api.cache_namespace import CacheSalt
from troupe.api.errors import ApiError, why_unsupported
from troupe.api.generation import Renderer
from troupe.api.generation_route import generate
from troupe.api.images import ImageInput, content, url_image
from troupe.api.responses_store import ResponseStore, StoredResponse
from troupe.api.responses_tools import (
    LOCAL_SHELL,
    Tool,
    ToolSet,
    freeform_arguments,
    freeform_input,
    local_shell_action,
    local_shell_arguments,
    tool_set,
)
from troupe.api.shutdown import generation
from troupe.api.sse import Frame
from troupe.runtime import ActorRef

log = logging.getLogger(__name__)

# The header that names the tools a request asked for and this server cannot run.
WARNING_HEADER = "Warning"
_DROPPED = web.RequestKey("responses_dropped_tools", list)

# --- request schemas -----------------------------------------------------------------------


class InputPart(msgspec.Struct, kw_only=True):
    # ``type`` stays a plain string so a file part gets a clear refusal, not a schema error.
    type: str
    text: str | None = None
    image_url: str | None = None  # an input_image's
    file_id: str | None = None  # an input_image's or input_file's: refused (no Files API)
    detail: str | None = None  # an input_image's: accepted and ignored


class InputItem(msgspec.Struct, kw_only=True):
    """Any input item; ``type`` (absent means a message) says which fields apply."""

    type: str | None = None
    id: str | None = None
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    input: str | None = None  # a custom_tool_call's
    action: dict[str, Any] | None = None  # a local_shell_call's
    output: str | list[InputPart] | None = None


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
    # An extension: false turns speculative decoding off for this request.
    speculative: bool | None = None
    stream: bool | None = None
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None
    store: bool | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    cache_salt: CacheSalt | None = None


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


class CustomToolCallItem(msgspec.Struct, kw_only=True, tag_field="type",
                         tag="custom_tool_call"):
    """A call of a freeform (``custom``) tool: ``input`` is the text the model wrote."""

    id: str
    call_id: str
    name: str
    input: str


class LocalShellAction(msgspec.Struct, kw_only=True, tag_field="type", tag="exec"):
    command: list[str]
    timeout_ms: int | None = None
    working_directory: str | None = None
    env: dict[str, str] = {}
    user: str | None = None


class LocalShellCallItem(msgspec.Struct, kw_only=True, tag_field="type",
                         tag="local_shell_call"):
    id: str
    call_id: str
    action: LocalShellAction
    status: str = "in_progress"


OutputItem = (
    MessageItem | ReasoningItem | FunctionCallItem | CustomToolCallItem | LocalShellCallItem
)


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


class DeletedResponse(msgspec.Struct, kw_only=True):
    """The answer of ``DELETE /v1/responses/{id}``."""

    id: str
    object: str = "response.deleted"
    deleted: bool = True


# --- requests as admission messages -------------------------------------------------------

_decoder = msgspec.json.Decoder(ResponsesRequest)
_encoder = msgspec.json.Encoder()

# Part types that carry text: input_text (what clients send), output_text (earlier answers
# sent back), and chat's "text" for clients that mix the two APIs up.
_TEXT_PARTS = ("input_text", "output_text", "text")
# The items that are a tool's call (an assistant turn's tool_calls) and a call's output.
_CALLS = ("function_call", "custom_tool_call", "local_shell_call")
_OUTPUTS = ("function_call_output", "custom_tool_call_output", "local_shell_call_output")
_ACCEPTED_PARTS = ("input_text and output_text parts, and input_image parts in user messages "
                   "and tool outputs")


def _content(parts: str | list[InputPart] | None, param: str,
             images: bool = False) -> str | list[dict[str, Any]]:
    """The content's text: a string as it is, text parts joined by newlines (as chat does);
    with ``input_image`` parts (where ``images`` allows them), the text and image parts in
    order (``api.images.content``)."""
    if parts is None:
        return ""
    if isinstance(parts, str):
        return parts
    found = []
    for j, part in enumerate(parts):
        where = f"{param}[{j}]"
        if part.type == "input_image" and images:
            found.append(_image(part, where))
            continue
        if part.type not in _TEXT_PARTS:
            raise ApiError(
                400,
                f"Content parts of type '{part.type}' are not supported here: "
                f"{why_unsupported(part.type, _ACCEPTED_PARTS)}.",
                param=f"{where}.type",
            )
        if part.text is None:
            raise ApiError(400, "A text content part needs a 'text' string.", param=f"{where}.text")
        found.append({"type": "text", "text": part.text})
    return content(found)


def _image(part: InputPart, where: str) -> dict[str, Any]:
    if part.image_url is None:
        if part.file_id is not None:
            raise ApiError(400, "input_image parts naming a file_id are not supported (this "
                           "server has no Files API); send the image in 'image_url', as a "
                           "data: URL.", param=f"{where}.file_id")
        raise ApiError(400, "An input_image part needs 'image_url'.", param=f"{where}.image_url")
    return url_image(part.image_url, f"{where}.image_url")


def _required(value: str | None, field: str, kind: str, where: str) -> str:
    if value is None:
        raise ApiError(400, f"A {kind} item needs '{field}'.", param=f"{where}.{field}")
    return value


def _call(item: InputItem, kind: str, where: str) -> dict[str, Any]:
    """An earlier call item as the OpenAI ``tool_calls`` entry the model's call was."""
    if kind == "local_shell_call":
        call_id = item.call_id or _required(item.id, "call_id", kind, where)
        name, arguments = LOCAL_SHELL, local_shell_arguments(item.action, where)
    else:
        call_id = _required(item.call_id, "call_id", kind, where)
        name = _required(item.name, "name", kind, where)
        if kind == "custom_tool_call":
            arguments = freeform_arguments(_required(item.input, "input", kind, where))
        else:
            arguments = _required(item.arguments, "arguments", kind, where)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _messages(instructions: str | None, items: list[InputItem], own: int = 0
              ) -> list[dict[str, Any]]:
    """The conversation as chat templates read it (OpenAI chat's conventions). ``own``: where
    the request's own input begins in ``items`` (after a continued response's)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    # The assistant turn that call items join: an answer's text and its calls are one turn,
    # as the model produced them (so the prompt matches what it generated).
    turn: dict[str, Any] | None = None
    for i, item in enumerate(items):
        where = f"input[{i - own}]"
        kind = item.type or "message"
        if kind == "message":
            if item.role is None:
                raise ApiError(400, "A message item needs a 'role'.", param=f"{where}.role")
            message = {"role": item.role, "content": _content(
                item.content, f"{where}.content", images=item.role == "user")}
            messages.append(message)
            turn = message if item.role == "assistant" else None
        elif kind in _CALLS:
            call = _call(item, kind, where)
            if turn is None:
                turn = {"role": "assistant", "content": ""}  # templates expect a string
                messages.append(turn)
            turn.setdefault("tool_calls", []).append(call)
        elif kind in _OUTPUTS:
            # OpenAI's local_shell_call_output names its call by ``id``.
            call_id = item.call_id if kind != "local_shell_call_output" else item.call_id or item.id
            call_id = _required(call_id, "call_id", kind, where)
            if item.output is None:
                raise ApiError(400, f"A {kind} item needs 'output'.", param=f"{where}.output")
            output = _content(item.output, f"{where}.output", images=True)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
            turn = None
        elif kind == "reasoning":
            continue  # an earlier answer's reasoning: templates drop it, so do we
        else:
            raise ApiError(
                400,
                f"Input items of type '{kind}' are not supported: this server accepts message, "
                "reasoning, function_call, custom_tool_call, local_shell_call items and their "
                "outputs.",
                param=f"{where}.type",
            )
    if not messages:
        raise ApiError(400, "The input holds no message.", param="input")
    return messages


def _named(choice: dict[str, Any], tools: ToolSet) -> str:
    """The tool a ``{"type": ..., "name"}`` choice names, checked against the request's."""
    kind, name = choice.get("type"), choice.get("name")
    names = tools.functions if kind == "function" else tools.freeform
    if kind in ("function", "custom"):
        if name in names:
            return name
        raise ApiError(
            400,
            f"tool_choice names the {kind} tool {name!r}, which is not among the tools.",
            param="tool_choice",
        )
    if kind in tools.dropped:
        raise ApiError(
            400,
            f"tool_choice names the {kind} tool, which this server cannot run.",
            param="tool_choice",
        )
    raise ApiError(
        400,
        "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\" | "
        "\"custom\", \"name\"}.",
        param="tool_choice",
    )


def _tool_choice(req: ResponsesRequest, tools: ToolSet) -> ToolChoice:
    parallel = req.parallel_tool_calls is not False
    formats = tools.input_formats or None
    choice = req.tool_choice
    if choice is None or choice == "auto":
        return ToolChoice(mode="auto", parallel=parallel, input_formats=formats)
    if choice == "none":
        return ToolChoice(mode="none", parallel=parallel, input_formats=formats)
    if choice == "required":
        if not tools.chat:
            raise ApiError(400, "tool_choice 'required' needs tools.", param="tool_choice")
        _check_grammars(tools, list(tools.input_formats))
        return ToolChoice(mode="required", parallel=parallel, input_formats=formats)
    if isinstance(choice, dict):
        name = _named(choice, tools)
        _check_grammars(tools, [name])
        return ToolChoice(mode="function", name=name, parallel=parallel, input_formats=formats)
    raise ApiError(
        400,
        "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\" | "
        "\"custom\", \"name\"}.",
        param="tool_choice",
    )


def _check_grammars(tools: ToolSet, names: list[str]) -> None:
    """Refuse, naming the tool's format, a grammar an enforced call could not follow."""
    # Imported here: the check compiles the grammar (llguidance, no MLX), which only a
    # request that enforces a freeform call needs.
    from troupe.actors.engine.custom_tools import check_format

    for name in names:
        fmt = tools.input_formats.get(name)
        if fmt is None:
            continue
        reason = check_format(fmt)
        if reason is not None:
            raise ApiError(
                400,
                f"The {fmt.type} grammar of the custom tool {name!r} cannot be enforced: {reason}",
                param=f"tools[{tools.index[name]}].format",
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


def _refuse_unsupported(req: ResponsesRequest) -> None:
    """What this server does not do: conversations, and responses run in the background."""
    if req.conversation is not None:
        raise ApiError(
            400,
            "Conversation objects are not supported: continue a stored response with "
            "'previous_response_id', or send the whole conversation in 'input'.",
            param="conversation",
        )
    if req.background:
        raise ApiError(
            400,
            "Background responses are not supported: send the request and read its answer "
            "(stream it to see it as it comes).",
            param="background",
        )


@dataclass
class Turn:
    """One request as admission gets it and as its answer is rendered and stored."""

    msg: AdmitChat
    # The conversation's input items: a continued response's, then the request's own.
    items: list[InputItem]
    tools: ToolSet
    store: bool  # whether the answer is kept (the response says so)


def prepare_turn(
    req: ResponsesRequest, request_id: str, default_max_tokens: int, store: ResponseStore
) -> Turn:
    """Validate what the schema cannot express, continue a stored response, and build the
    admission message."""
    _refuse_unsupported(req)
    own = [InputItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    items = list(own)
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id)
        if previous is None:
            # 400, as OpenAI answers it (code previous_response_not_found); GET is the 404.
            raise ApiError(
                400,
                f"Previous response with id '{req.previous_response_id}' not found: it was "
                "never stored here, was stored with 'store': false, or is no longer kept.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        items = [*previous.items, *own]
    tools = tool_set(req.tools or [])
    choice = _tool_choice(req, tools)
    sent = {"temperature": req.temperature, "top_p": req.top_p}
    sampling = SamplingParams(
        max_tokens=req.max_output_tokens or default_max_tokens,
        **{name: value for name, value in sent.items() if value is not None},
        **({} if req.speculative is None else {"speculative": req.speculative}),
    )
    msg = AdmitChat(
        request_id=request_id,
        model=req.model,
        messages=_messages(req.instructions, items, own=len(items) - len(own)),
        sampling=sampling,
        unset=unset_sampling(sent),
        # Sent even with tool_choice "none", as chat sends them: admission hides them then.
        tools=tools.chat or None,
        tool_choice=choice,
        response_format=_output_format(req.text),
    )
    return Turn(msg=msg, items=items, tools=tools, store=store.enabled and req.store is not False)


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


def _as_input(item: OutputItem) -> InputItem:
    """An output item as the input item a client sends back (the Agents SDK's way)."""
    return msgspec.convert(msgspec.to_builtins(item), InputItem)


class _ResponsesRenderer(Renderer):
    """Builds the output items as the deltas come; streamed or whole, the items are the same.

    One item is open at a time (a reasoning or a message item, taking deltas); a delta of the
    other kind, or a tool call, closes it. A stream sends each item's added, delta and done
    events; a whole answer runs the same steps and keeps only the items. A response that
    ends (completed or incomplete) is stored when its turn says so; a failed one is not.
    """

    def __init__(self, req: ResponsesRequest, turn: Turn, admitted: Admitted,
                 store: ResponseStore) -> None:
        msg = turn.msg
        self.response_id = msg.request_id
        self.model = admitted.model
        self.created_at = int(time.time())
        self.turn = turn
        self.store = store
        self.items: list[OutputItem] = []
        self.open: MessageItem | ReasoningItem | None = None
        self.sequence = 0
        fmt = req.text.format if req.text and req.text.format else TextFormat(type="text")
        # The sampling it runs with: the model's defaults fill what the request left unset.
        sampling = admitted.sampling or msg.sampling
        # What the response echoes of the request, as OpenAI's does.
        self.echo: dict[str, Any] = {
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": msg.tool_choice.parallel,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning,
            "store": turn.store,
            "temperature": sampling.temperature,
            "text": {"format": msgspec.to_builtins(fmt)},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": turn.tools.echo,
            "top_p": sampling.top_p,
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

    def _ended(self, finished: RequestFinished) -> ResponseObject:
        """The final response object; stored when the request asked for it."""
        status = self._status(finished)
        response = self._response(status, finished)
        if self.turn.store:
            items = (*self.turn.items, *map(_as_input, self.items))
            self.store.put(self.response_id, StoredResponse(response=response, items=items))
        return response

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
        """A whole tool call, as the item of its tool's kind."""
        frames = self._close()
        tools = self.turn.tools
        if call.name in tools.freeform:
            return frames + self._custom_call(call)
        if call.name == LOCAL_SHELL and tools.local_shell:
            action = local_shell_action(call.arguments)
            if action is not None:
                return frames + self._local_shell_call(call, action)
        return frames + self._function_call(call)

    def _function_call(self, call: ToolCall) -> list[Frame]:
        """Its item added, its arguments in one delta, then done."""
        item = FunctionCallItem(id=_new_id("fc_"), call_id=call.id, name=call.name, arguments="")
        index, added = self._add(item)
        frames = [added]
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

    def _custom_call(self, call: ToolCall) -> list[Frame]:
        """Its item added with no input, the input in one delta, its done events."""
        item = CustomToolCallItem(id=_new_id("ctc_"), call_id=call.id, name=call.name, input="")
        index, added = self._add(item)
        frames = [added]
        item.input = freeform_input(call.arguments)
        if item.input:
            frames.append(
                self._event(
                    "response.custom_tool_call_input.delta",
                    item_id=item.id,
                    output_index=index,
                    delta=item.input,
                )
            )
        frames += [
            self._event(
                "response.custom_tool_call_input.done",
                item_id=item.id,
                output_index=index,
                input=item.input,
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]
        return frames

    def _local_shell_call(self, call: ToolCall, action: dict[str, Any]) -> list[Frame]:
        """Its item added whole, then done (the API has no events in between)."""
        item = LocalShellCallItem(
            id=_new_id("lsh_"), call_id=call.id, action=msgspec.convert(action, LocalShellAction)
        )
        index, added = self._add(item)
        item.status = "completed"
        return [added, self._event("response.output_item.done", output_index=index, item=item)]

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
        frames.append(self._event(kind, response=self._ended(finished)))
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
        self._close(self._status(finished))
        return _encoder.encode(self._ended(finished))


# --- routes --------------------------------------------------------------------------------


class ResponsesRoutes:
    """OpenAI's Responses API, answering through the admission actor; owns the stored
    responses."""

    def __init__(self, admission: ActorRef, config: ServeConfig) -> None:
        self.admission = admission
        self.config = config
        self.store = ResponseStore(config.responses_store)
        self.images = ImageInput(config)

    def register(self, app: web.Application) -> None:
        """Add the routes to an application, and the warning header to its responses."""
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/responses/{response_id}", self.get_response)
        app.router.add_delete("/v1/responses/{response_id}", self.delete_response)
        app.on_response_prepare.append(_warn_dropped)

    @generation
    async def responses(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/responses``."""
        turns: list[Turn] = []

        def admit(req: ResponsesRequest, request_id: str) -> AdmitChat:
            turn = prepare_turn(req, request_id, self.config.default_max_tokens, self.store)
            if turn.tools.dropped:
                log.warning("%s: tools this server cannot run were dropped: %s", request_id,
                            _printable(turn.tools.dropped))
                request[_DROPPED] = turn.tools.dropped
            turns.append(turn)
            return turn.msg

        def render(req: ResponsesRequest, msg: AdmitChat, admitted: Admitted) -> Renderer:
            return _ResponsesRenderer(req, turns[0], admitted, self.store)

        return await generate(request, self.admission, _decoder, "resp_", admit, render,
                              self.images)

    async def get_response(self, request: web.Request) -> web.Response:
        """``GET /v1/responses/{response_id}``: a stored response."""
        stored = self.store.get(request.match_info["response_id"])
        if stored is None:
            raise _not_stored(request.match_info["response_id"])
        return web.Response(body=_encoder.encode(stored.response), content_type="application/json")

    async def delete_response(self, request: web.Request) -> web.Response:
        """``DELETE /v1/responses/{response_id}``: forget a stored response."""
        response_id = request.match_info["response_id"]
        if not self.store.delete(response_id):
            raise _not_stored(response_id)
        return web.Response(body=_encoder.encode(DeletedResponse(id=response_id)),
                            content_type="application/json")


def _not_stored(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.",
                    code="response_not_found")


async def _warn_dropped(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: name the dropped tools in a header, streamed answers included."""
    dropped = request.get(_DROPPED)
    if dropped:
        response.headers[WARNING_HEADER] = (
            f'299 mlx-troupe "tools this server cannot run were dropped: {_printable(dropped)}"'
        )


def _printable(types: list[str]) -> str:
    """The dropped tools' types, once each, as printable ASCII: a type is the client's text,
    and a line break or a quote in it would end the header (aiohttp refuses to send it, and
    the client got no answer at all) or the log line."""
    return ", ".join(json.dumps(kind, ensure_ascii=True)[1:-1] for kind in dict.fromkeys(types))
