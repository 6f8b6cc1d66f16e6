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
    SamplingParams,
)
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

    async def handle(self, msg: Any) -> Any:
        match msg:
            case AdmitChat():
                entry = self._model(msg.model)
                tokens = self._apply_template(entry, msg.messages, msg.tools,
                                              msg.chat_template_kwargs)
                return await self._admit(entry, msg.request_id, tokens, msg.sampling,
                                         "messages")
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
                return await self._admit(entry, msg.request_id, tokens, msg.sampling, "prompt")
            case CountTokens():
                entry = self._model(msg.model)
                return len(self._apply_template(entry, msg.messages, msg.tools, None,
                                                generation_prompt=False))
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
        request = AddRequest(request_id=request_id, prompt_tokens=tokens, sampling=sampling)
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
