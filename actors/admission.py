"""The admission actor: templates, tokenizes and validates, and decides before any header.

It runs on its own thread (tokenizing a long prompt would otherwise stall the event loop) and
never touches MLX. An admitted request goes straight into the model's scheduler with
``try_stream``; the HTTP layer gets the scheduler's event stream back in an
``AdmissionTicket``. Every refusal is an ``AdmissionError`` carrying its HTTP status.

The prefill guard: with the memory monitor's latest ``MemoryLimits``, a prompt whose prefill
would take MLX memory past the limit is refused here, before any response header (413 if it
could never fit beside its model, 503 with Retry-After if other work holds the memory); under
hard memory pressure every new request gets 503. A model not loaded yet is loaded through the
engine pool (``LoadModel``) before its first request goes to its scheduler.
"""

from __future__ import annotations

import logging
from typing import Any

import jinja2
from mlx_lm.utils import load_tokenizer

from actors.agent_output import (
    FALLBACK_TOOL_FORMAT,
    prompt_opens_reasoning,
    think_tags_of,
    tool_format_of,
)
from actors.grammar import Constraint, GrammarError, Grammars
from actors.memory_estimate import (
    HARD,
    ModelMemory,
    admission_estimate,
    model_memory_of,
    prompt_need,
)
from actors.memory_messages import LoadModel, MemoryLimits
from actors.messages import (
    AddRequest,
    AdmissionError,
    AdmissionTicket,
    AdmitChat,
    AdmitCompletion,
    Admitted,
    CountTokens,
    ListModels,
    ModelCard,
    OutputFormat,
    OutputSpec,
    SamplingParams,
    ToolChoice,
)
from actors.tool_prompt import uses_tools, with_parsed_arguments, with_tools_in_prompt
from runtime import Actor, ActorDead, ActorRef, MailboxFull

log = logging.getLogger("actors.admission")

ADMISSION_THREAD = "admission"
RETRY_AFTER_S = 1.0
# Loading a model (the first request for it) may take minutes for a large one.
LOAD_TIMEOUT_S = 600.0
MB = 1e6


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

    @property
    def loaded(self) -> bool:
        return self.scheduler is not None and self.scheduler.alive


class Admission(Actor):
    """Turns API requests into scheduler requests, or into a refusal with a status code."""

    def __init__(
        self,
        *,
        models: list[tuple[ModelCard, ActorRef | None]],
        pool: str | None = "engine_pool",
        prefill_step_size: int = 512,
        block_size: int = 0,
    ) -> None:
        self.models = {card.id: ModelEntry(card, ref) for card, ref in models}
        self.pool_name = pool
        self.prefill_step_size = prefill_step_size
        self.block_size = block_size
        self.limits: MemoryLimits | None = None
        self.admitted = 0
        self.refused: dict[int, int] = {}
        self.last_estimate = 0

    async def on_start(self) -> None:
        for entry in self.models.values():
            entry.tokenizer = load_tokenizer(entry.card.path)
            entry.memory = model_memory_of(entry.card.path)
            entry.tool_format = tool_format_of(entry.tokenizer)
            entry.think = think_tags_of(entry.tokenizer)
            entry.grammars = Grammars(entry.tokenizer)

    async def handle(self, msg: Any) -> Any:
        match msg:
            case AdmitChat():
                entry = self._model(msg.model)
                tools = self._tools(msg.tools, msg.tool_choice)
                tokens, tool_format = self._chat_tokens(entry, msg.messages, tools,
                                                        msg.chat_template_kwargs)
                output = self._output_spec(entry, tokens, tools, tool_format,
                                           msg.thinking_budget)
                # The reasoning before a constrained answer stays free text.
                think = {"think": output.think, "in_reasoning": output.in_reasoning} \
                    if output is not None else {}
                if tools and msg.tool_choice.mode in ("required", "function"):
                    constraint = self._compile(
                        "tool_choice",
                        lambda g: g.for_tools(tools, msg.tool_choice, tool_format, **think),
                        entry)
                else:
                    constraint = self._format_constraint(entry, msg.response_format, **think)
                return await self._admit(entry, msg.request_id, tokens, msg.sampling,
                                         "messages", output=output, constraint=constraint)
            case AdmitCompletion():
                entry = self._model(msg.model)
                if isinstance(msg.prompt, str):
                    tokens = entry.tokenizer.encode(msg.prompt)
                else:
                    tokens = list(msg.prompt)
                    vocab = len(entry.tokenizer)
                    if any(t < 0 or t >= vocab for t in tokens):
                        raise self._refuse(400, f"prompt token ids must be in [0, {vocab})",
                                           param="prompt")
                constraint = self._format_constraint(entry, msg.response_format)
                return await self._admit(entry, msg.request_id, tokens, msg.sampling, "prompt",
                                         constraint=constraint)
            case CountTokens():
                entry = self._model(msg.model)
                tools = self._tools(msg.tools, ToolChoice())
                tokens, _ = self._chat_tokens(entry, msg.messages, tools, None,
                                              generation_prompt=False)
                return len(tokens)
            case ListModels():
                return [entry.card for entry in self.models.values()]
            case MemoryLimits():
                self.limits = msg
            case _:
                raise TypeError(f"admission cannot handle {type(msg).__name__}")

    def _model(self, name: str) -> ModelEntry:
        entry = self.models.get(name)
        if entry is None and len(self.models) == 1 and name in ("", "default"):
            entry = next(iter(self.models.values()))
        if entry is None:
            served = ", ".join(sorted(self.models))
            raise self._refuse(404, f"model {name!r} is not served here (served: {served})",
                               param="model", code="model_not_found")
        return entry

    # -- agents: tools, reasoning, constrained output ------------------------------------

    def _tools(self, tools: list[dict] | None, choice: ToolChoice) -> list[dict] | None:
        """The request's tools, checked (OpenAI's function shape), or None when there are none
        or the choice hides them; a tool choice that names no offered tool is refused."""
        if choice.mode not in ("auto", "none", "required", "function"):
            raise self._refuse(400, f"unknown tool_choice mode {choice.mode!r}",
                               param="tool_choice")
        for i, tool in enumerate(tools or ()):
            function = tool.get("function") if isinstance(tool, dict) else None
            if (not isinstance(tool, dict) or tool.get("type", "function") != "function"
                    or not isinstance(function, dict)
                    or not isinstance(function.get("name"), str) or not function["name"]):
                raise self._refuse(400, "each tool must be {'type': 'function', 'function': "
                                   "{'name': ..., 'parameters': {...}}}", param=f"tools[{i}]")
            if not isinstance(function.get("parameters", {}), dict):
                raise self._refuse(400, "a tool's parameters must be a JSON Schema object",
                                   param=f"tools[{i}].function.parameters")
        if choice.mode == "none":
            return None
        names = [tool["function"]["name"] for tool in tools or ()]
        if choice.mode in ("required", "function") and not names:
            raise self._refuse(400, f"tool_choice {choice.mode!r} needs tools",
                               param="tool_choice")
        if choice.mode == "function" and choice.name not in names:
            raise self._refuse(400, f"tool_choice names {choice.name!r}, which is not among "
                               f"the tools ({', '.join(names)})", param="tool_choice")
        return list(tools) if tools else None

    def _chat_tokens(
        self,
        entry: ModelEntry,
        messages: list[dict],
        tools: list[dict] | None,
        extra: dict | None,
        generation_prompt: bool = True,
    ) -> tuple[list[int], str | None]:
        """The templated prompt, and the tool-call format its answer is read with. A template
        without a tool format gets the tools written into the conversation instead
        (``actors.tool_prompt``), read back in troupe's fallback format."""
        tool_format = entry.tool_format
        if tool_format is None and (tools or uses_tools(messages)):
            messages, tools, tool_format = (with_tools_in_prompt(messages, tools), None,
                                            FALLBACK_TOOL_FORMAT)
        elif uses_tools(messages):
            messages = with_parsed_arguments(messages)
        tokens = self._apply_template(entry, messages, tools, extra, generation_prompt)
        return tokens, tool_format

    def _output_spec(self, entry: ModelEntry, tokens: list[int], tools: list[dict] | None,
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

    def _format_constraint(self, entry: ModelEntry, fmt: OutputFormat | None,
                           **think: Any) -> Constraint | None:
        if fmt is None or fmt.type == "text":
            return None
        return self._compile("response_format", lambda g: g.for_format(fmt, **think), entry)

    def _compile(self, param: str, build: Any, entry: ModelEntry) -> Constraint:
        """Compile a grammar here, on admission's thread, so that the scheduler never waits
        for one; a grammar llguidance cannot compile is the client's 400."""
        assert entry.grammars is not None
        try:
            return build(entry.grammars)
        except GrammarError as exc:
            raise self._refuse(400, f"cannot enforce this {param}: {exc}", param=param) from exc

    def _apply_template(
        self,
        entry: ModelEntry,
        messages: list[dict],
        tools: list[dict] | None,
        extra: dict | None,
        generation_prompt: bool = True,
    ) -> list[int]:
        if not messages:
            raise self._refuse(400, "messages must not be empty", param="messages")
        tokenizer = entry.tokenizer
        if not tokenizer.has_chat_template:
            raise self._refuse(400, f"model {entry.card.id!r} has no chat template; "
                               "use /v1/completions", param="messages")
        try:
            return list(tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=generation_prompt,
                **(extra or {}),
            ))
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
            # Templates reject what they cannot render (roles out of order, bad tool specs).
            raise self._refuse(400, f"the chat template rejected the messages: {exc}",
                               param="messages") from exc

    async def _admit(
        self,
        entry: ModelEntry,
        request_id: str,
        tokens: list[int],
        sampling: SamplingParams,
        prompt_param: str,
        *,
        output: OutputSpec | None = None,
        constraint: Constraint | None = None,
    ) -> AdmissionTicket:
        if not tokens:
            raise self._refuse(400, "the prompt is empty", param=prompt_param)
        limit = entry.card.context_length
        if len(tokens) + sampling.max_tokens > limit:
            raise self._refuse(
                400,
                f"this model's context is {limit} tokens; the prompt has {len(tokens)} and "
                f"max_tokens asks for {sampling.max_tokens}",
                param="max_tokens" if len(tokens) < limit else prompt_param,
                code="context_length_exceeded",
            )
        self._check_memory(entry, len(tokens), prompt_param)
        request = AddRequest(request_id=request_id, prompt_tokens=tokens, sampling=sampling,
                             output=output, constraint=constraint)
        try:
            try:
                events = (await self._scheduler(entry)).try_stream(request)
            except ActorDead:
                # Unloaded between our look and the send: load it again, once.
                entry.scheduler = None
                events = (await self._scheduler(entry)).try_stream(request)
        except MailboxFull:
            raise self._refuse(429, "the server is busy; retry shortly", type="rate_limit_error",
                               code="queue_full", retry_after=RETRY_AFTER_S) from None
        self.admitted += 1
        admitted = Admitted(request_id=request_id, model=entry.card.id,
                            prompt_tokens=len(tokens))
        return AdmissionTicket(admitted=admitted, events=events)

    def _check_memory(self, entry: ModelEntry, n_tokens: int, prompt_param: str) -> None:
        """The prefill guard: refuse before any header what the memory limit cannot take."""
        limits = self.limits
        if limits is None or entry.memory is None:
            return
        if limits.pressure == HARD:
            raise self._refuse(
                503,
                f"the server is short of memory ({limits.usage / MB:.0f} MB of its "
                f"{limits.limit / MB:.0f} MB limit in use); retry shortly",
                type="server_error", code="memory_pressure", retry_after=RETRY_AFTER_S,
            )
        if not limits.guard:
            return
        memory = entry.memory
        block_size = self.block_size
        need = prompt_need(memory, prompt_tokens=n_tokens, step=self.prefill_step_size,
                           block_size=block_size)
        estimate = admission_estimate(memory, high_water=limits.high_water,
                                      prompt_tokens=n_tokens, step=self.prefill_step_size,
                                      block_size=block_size, loaded=entry.loaded)
        self.last_estimate = estimate
        # What stays in use at idle: the floor, and this model's weights if not loaded yet.
        floor = max(limits.floor, memory.weights_bytes) + (0 if entry.loaded else
                                                           memory.weights_bytes)
        if need > limits.limit - floor:
            raise self._refuse(
                413,
                f"this prompt of {n_tokens} tokens needs about {need / MB:.0f} MB for its "
                f"prefill, {estimate / MB:.0f} MB in all with what is in use, over the server's "
                f"memory limit of {limits.limit / MB:.0f} MB, of which {floor / MB:.0f} MB "
                f"stay in use when idle: shorten it",
                param=prompt_param, code="memory_limit_exceeded",
            )
        if estimate > limits.limit:
            raise self._refuse(
                503,
                f"this prompt of {n_tokens} tokens needs about {need / MB:.0f} MB for its "
                f"prefill, {estimate / MB:.0f} MB in all with what is in use, over the server's "
                f"memory limit of {limits.limit / MB:.0f} MB; retry shortly",
                type="server_error", code="memory_busy", retry_after=RETRY_AFTER_S,
            )

    async def _scheduler(self, entry: ModelEntry) -> ActorRef:
        """The model's scheduler, loading the model through the engine pool if need be.
        (Admission waits for the load: the load holds the MLX thread anyway.)"""
        if entry.loaded:
            assert entry.scheduler is not None
            return entry.scheduler
        pool = self.system.find(self.pool_name) if self.pool_name else None
        if pool is None:
            raise self._refuse(503, f"model {entry.card.id!r} is not loaded",
                               type="server_error", retry_after=RETRY_AFTER_S)
        try:
            entry.scheduler = await pool.ask(LoadModel(model=entry.card.id),
                                             timeout=LOAD_TIMEOUT_S)
        except AdmissionError as err:
            self.refused[err.status] = self.refused.get(err.status, 0) + 1
            raise
        return entry.scheduler

    def _refuse(self, status: int, message: str, **kw: Any) -> AdmissionError:
        self.refused[status] = self.refused.get(status, 0) + 1
        return AdmissionError(status, message, **kw)

    def report(self) -> dict[str, Any]:
        limits = self.limits
        return {
            "models": sorted(self.models),
            "loaded": sorted(name for name, entry in self.models.items() if entry.loaded),
            "admitted": self.admitted,
            "refused": {str(k): v for k, v in sorted(self.refused.items())},
            "memory_limit_bytes": limits.limit if limits else 0,
            "memory_pressure": limits.pressure if limits else "unknown",
            "last_estimate_bytes": self.last_estimate,
        }
